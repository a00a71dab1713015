//! Tool schemas and the conversion of a parameter's raw text into the JSON value its type asks for.

use std::collections::HashMap;

use serde_json::Value;

/// The JSON type a parameter's schema declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    String,
    Integer,
    Number,
    Boolean,
    Null,
    Object,
    Array,
    /// No schema, several types, or one we do not know: JSON if it parses, else the raw string.
    Unknown,
}

/// A parameter's declared type; `nullable` when the schema also admits null.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamType {
    pub kind: ValueKind,
    pub nullable: bool,
}

impl ParamType {
    pub const UNKNOWN: ParamType = ParamType {
        kind: ValueKind::Unknown,
        nullable: false,
    };

    /// Read the type out of a JSON-schema fragment: `type` (a name or a list of names), else
    /// `anyOf` / `oneOf`, else hints (`enum` of strings, `properties`, `items`).
    pub fn from_schema(schema: &Value) -> Self {
        let mut kinds = Vec::new();
        let mut nullable = false;
        collect_kinds(schema, &mut kinds, &mut nullable);
        let mut distinct: Vec<ValueKind> = Vec::new();
        for kind in kinds {
            if !distinct.contains(&kind) {
                distinct.push(kind);
            }
        }
        let kind = match distinct.as_slice() {
            [] if nullable => ValueKind::Null,
            [one] => *one,
            _ => ValueKind::Unknown,
        };
        ParamType { kind, nullable }
    }
}

fn collect_kinds(schema: &Value, kinds: &mut Vec<ValueKind>, nullable: &mut bool) {
    let mut add = |name: &str| match kind_from_name(name) {
        Some(ValueKind::Null) => *nullable = true,
        Some(kind) => kinds.push(kind),
        None => kinds.push(ValueKind::Unknown),
    };
    match schema.get("type") {
        Some(Value::String(name)) => return add(name),
        Some(Value::Array(names)) => {
            names.iter().filter_map(Value::as_str).for_each(add);
            return;
        }
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(options)) = schema.get(key) {
            for option in options {
                collect_kinds(option, kinds, nullable);
            }
            return;
        }
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        if values.iter().all(Value::is_string) {
            kinds.push(ValueKind::String);
        }
    } else if schema.get("properties").is_some() {
        kinds.push(ValueKind::Object);
    } else if schema.get("items").is_some() {
        kinds.push(ValueKind::Array);
    }
}

/// JSON-schema type names, plus the loose spellings tool authors use (vLLM accepts the same).
fn kind_from_name(name: &str) -> Option<ValueKind> {
    let name = name.trim().to_ascii_lowercase();
    let kind = match name.as_str() {
        "string" | "str" | "text" | "varchar" | "char" | "enum" => ValueKind::String,
        "boolean" | "bool" | "binary" => ValueKind::Boolean,
        "null" | "none" => ValueKind::Null,
        "object" | "dict" | "map" => ValueKind::Object,
        "array" | "arr" | "list" | "tuple" => ValueKind::Array,
        n if ["int", "uint", "long", "short", "unsigned"]
            .iter()
            .any(|p| n.starts_with(p)) =>
        {
            ValueKind::Integer
        }
        n if n.starts_with("num") || n.starts_with("float") || n.starts_with("double") => {
            ValueKind::Number
        }
        _ => return None,
    };
    Some(kind)
}

/// Parameter types of the request's tools, by function name.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    functions: HashMap<String, HashMap<String, ParamType>>,
}

impl ToolSchemas {
    /// From the request's `tools` array (`[{"type": "function", "function": {"name", "parameters"}}]`).
    /// Entries that do not have that shape are skipped: validating `tools` is the server's job,
    /// this only needs the types.
    pub fn from_openai_tools(tools: &Value) -> Self {
        let mut functions = HashMap::new();
        for tool in tools.as_array().into_iter().flatten() {
            let Some(function) = tool.get("function") else {
                continue;
            };
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let params = function
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object)
                .map(|props| {
                    props
                        .iter()
                        .map(|(k, v)| (k.clone(), ParamType::from_schema(v)))
                        .collect()
                })
                .unwrap_or_default();
            functions.insert(name.to_string(), params);
        }
        Self { functions }
    }

    /// The declared type of `function`'s `param`; [`ParamType::UNKNOWN`] if undeclared.
    pub fn param_type(&self, function: &str, param: &str) -> ParamType {
        self.functions
            .get(function)
            .and_then(|p| p.get(param))
            .copied()
            .unwrap_or(ParamType::UNKNOWN)
    }

    /// Whether `param` is declared for `function`.
    pub(super) fn declares(&self, function: &str, param: &str) -> bool {
        self.functions
            .get(function)
            .is_some_and(|p| p.contains_key(param))
    }
}

/// Turn a parameter's raw text (template newlines already stripped) into its JSON value.
pub fn convert_value(raw: &str, ty: ParamType) -> Value {
    let trimmed = raw.trim();
    // Python's `None` too: Qwen3.5-era templates render null arguments with `| string`.
    let is_null = trimmed == "null" || trimmed == "None";
    if is_null && (ty.nullable || ty.kind == ValueKind::Null) {
        return Value::Null;
    }
    let typed = match ty.kind {
        ValueKind::String => return Value::String(raw.to_string()),
        ValueKind::Integer => trimmed
            .parse::<i64>()
            .map(Value::from)
            .or_else(|_| trimmed.parse::<u64>().map(Value::from))
            .ok(),
        ValueKind::Number => parse_number(trimmed),
        ValueKind::Boolean => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        ValueKind::Null | ValueKind::Object | ValueKind::Array | ValueKind::Unknown => None,
    };
    // Whatever did not fit its declared type: JSON if it parses, else the text itself.
    typed.unwrap_or_else(|| {
        serde_json::from_str(trimmed).unwrap_or_else(|_| Value::String(raw.to_string()))
    })
}

fn parse_number(text: &str) -> Option<Value> {
    if let Ok(i) = text.parse::<i64>() {
        return Some(Value::from(i));
    }
    // Rust's float syntax also takes `1.`, `.5` and `1e3`; infinities and NaN are not JSON.
    let f = text.parse::<f64>().ok().filter(|f| f.is_finite())?;
    serde_json::Number::from_f64(f).map(Value::Number)
}
