//! The Python behaviours that Hugging Face chat templates depend on, redone over minijinja values.
//!
//! transformers renders templates with jinja2, so what a template prints is what *Python* would
//! print: `tojson` is `json.dumps`, `trim` is `str.strip()`, and `{{ x }}` writes `str(x)`.
//! minijinja's built-ins follow Rust conventions instead (`1e16` vs Python's `1e+16`, `true` vs
//! `True`, HTML-escaping `tojson`), which would change prompts byte for byte, so these replace them.

use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind, Output, State};

/// The `tojson` filter exactly as transformers defines it:
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
/// Each option may be given by position (in that order) or by name.
pub(super) fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    // minijinja functions take at most five parameters, so the options are unpacked here.
    let args = args.into_values();
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    ) = from_args(&args)?;
    let ensure_ascii = option(ensure_ascii, &kwargs, "ensure_ascii")?;
    let indent = option(indent, &kwargs, "indent")?;
    let separators = option(separators, &kwargs, "separators")?;
    let sort_keys = option(sort_keys, &kwargs, "sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        // Python: a string is used as is; a number n (a bool counts as 0 or 1) means n spaces.
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(python_int(&v, "indent")?.max(0) as usize),
        }),
    };
    // json.dumps drops the space after "," when indenting, since a newline follows.
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => two_strings(&v)?,
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = JsonWriter {
        out: String::new(),
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
    };
    writer.value(value, 0)?;
    Ok(Value::from(writer.out))
}

/// jinja2's `trim` filter: Python's `str.strip(chars)`.
pub(super) fn trim(value: &Value, chars: Option<String>) -> Value {
    let text = match value.as_str() {
        Some(s) => s.to_string(),
        None => value.to_string(),
    };
    let trimmed = match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)),
        None => text.trim_matches(is_python_whitespace),
    };
    Value::from(trimmed)
}

/// Python's `str.isspace()`. It is Rust's `char::is_whitespace` plus the four ASCII information
/// separators U+001C..U+001F, which Python counts as whitespace and Rust does not.
fn is_python_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// How `{{ x }}` prints a value: Python's `str(x)` for the scalars where it differs from minijinja
/// (`True`, `False`, `None`, float repr); everything else as minijinja prints it.
pub(super) fn format_value(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    let python = match value.kind() {
        ValueKind::Bool => Some(if value.is_true() { "True" } else { "False" }.to_string()),
        ValueKind::None => Some("None".to_string()),
        ValueKind::Number if !value.is_integer() => f64::try_from(value.clone()).ok().map(|f| {
            if f.is_nan() {
                "nan".to_string()
            } else if f.is_infinite() {
                if f > 0.0 { "inf" } else { "-inf" }.to_string()
            } else {
                float_repr(f)
            }
        }),
        _ => None,
    };
    match python {
        Some(text) => out.write_str(&text).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr(float)` for a finite float: the shortest digits that round-trip, written
/// positionally when the decimal exponent is in -4..16, else as `d.ddde+XX` (at least two
/// exponent digits); whole numbers keep a `.0`.
pub(super) fn float_repr(f: f64) -> String {
    // Rust's `{:e}` gives the same shortest round-trip digits, e.g. "-1.5e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // The value is 0.DIGITS × 10^point.
    let point = exponent + 1;
    let body = if !(-4 < point && point <= 16) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if point - 1 < 0 { '-' } else { '+' };
        format!("{first}{fraction}e{exp_sign}{:02}", (point - 1).abs())
    } else if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (whole, fraction) = digits.split_at(point as usize);
        format!("{whole}.{fraction}")
    };
    format!("{sign}{body}")
}

/// A `tojson` option given either by position or by keyword (not both, as in Python).
fn option(positional: Option<Value>, kwargs: &Kwargs, name: &str) -> Result<Option<Value>, Error> {
    let keyword: Option<Value> = kwargs.get(name)?;
    match (positional, keyword) {
        (Some(_), Some(_)) => Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("tojson got multiple values for argument '{name}'"),
        )),
        (positional, keyword) => Ok(positional.or(keyword)),
    }
}

fn python_int(value: &Value, what: &str) -> Result<i64, Error> {
    if value.kind() == ValueKind::Bool {
        return Ok(i64::from(value.is_true()));
    }
    i64::try_from(value.clone()).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: {what} must be an integer or a string"),
        )
    })
}

fn two_strings(value: &Value) -> Result<(String, String), Error> {
    let bad = || {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: separators must be a pair of strings",
        )
    };
    let items: Vec<Value> = value.try_iter().map_err(|_| bad())?.collect();
    match items.as_slice() {
        [a, b] => match (a.as_str(), b.as_str()) {
            (Some(a), Some(b)) => Ok((a.to_string(), b.to_string())),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// A number as `json.dumps` writes it; non-finite floats get their JavaScript names, not null.
fn json_number(value: &Value) -> String {
    match f64::try_from(value.clone()) {
        Ok(f) if !value.is_integer() && f.is_nan() => "NaN".to_string(),
        Ok(f) if !value.is_integer() && f.is_infinite() => {
            if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
        }
        Ok(f) if !value.is_integer() => float_repr(f),
        // Integers (of any width) print their decimal digits.
        _ => value.to_string(),
    }
}

/// A port of Python's `json.encoder` for the value kinds a template can hold.
struct JsonWriter {
    out: String,
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl JsonWriter {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&json_number(value)),
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(('[', ']'), items.len(), depth, |w, i, depth| {
                    w.value(&items[i], depth)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((self.key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container(('{', '}'), entries.len(), depth, |w, i, depth| {
                    let (key, item) = &entries[i];
                    w.string(key);
                    w.out.push_str(&w.key_sep);
                    w.value(item, depth)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// Writes `open item sep item ... close`, one item per line when indenting.
    fn container(
        &mut self,
        (open, close): (char, char),
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len > 0 {
            let newline = self
                .indent
                .as_ref()
                .map(|unit| format!("\n{}", unit.repeat(depth + 1)));
            for i in 0..len {
                if i > 0 {
                    self.out.push_str(&self.item_sep);
                }
                if let Some(newline) = &newline {
                    self.out.push_str(newline);
                }
                item(self, i, depth + 1)?;
            }
            if let Some(unit) = &self.indent {
                self.out.push('\n');
                self.out.push_str(&unit.repeat(depth));
            }
        }
        self.out.push(close);
        Ok(())
    }

    /// Python turns scalar keys into strings (`True` → "true", `1.5` → "1.5") and refuses others.
    fn key(&self, key: &Value) -> Result<String, Error> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
            ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
            ValueKind::None => Ok("null".to_string()),
            ValueKind::Number => Ok(json_number(key)),
            kind => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            )),
        }
    }

    /// A JSON string as Python writes it: `"`, `\` and control characters escaped, and with
    /// `ensure_ascii` everything outside printable ASCII as `\uXXXX` (UTF-16 surrogate pairs).
    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if c < ' ' || (self.ensure_ascii && c > '~') => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are Python 3.11's repr().
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (100.0, "100.0"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e16, "1.2345e+16"),
            (123456.789, "123456.789"),
            (1.0 / 3.0, "0.3333333333333333"),
            (-2.5e300, "-2.5e+300"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
        ];
        for (value, python) in cases {
            assert_eq!(float_repr(value), python, "repr({value:?})");
        }
    }

    #[test]
    fn python_whitespace() {
        let value = Value::from("\u{1c}\u{1f}\u{85}\u{3000} x \t\n");
        assert_eq!(trim(&value, None).as_str(), Some("x"));
        assert_eq!(
            trim(&value, Some("\u{1c}\n".into())).as_str(),
            Some("\u{1f}\u{85}\u{3000} x \t")
        );
        // U+200B (zero width space) is not whitespace in Python either.
        assert_eq!(
            trim(&Value::from("\u{200b}x"), None).as_str(),
            Some("\u{200b}x")
        );
    }
}
