//! The chat template: turns a conversation into the prompt string, with the model's own Jinja
//! template, rendered exactly as Hugging Face transformers' `apply_chat_template` renders it.
//!
//! transformers uses jinja2 configured with `trim_blocks=True, lstrip_blocks=True`, the
//! `loopcontrols` extension, its own `tojson` (`json.dumps(x, ensure_ascii=False)`, no HTML
//! escaping) and a `raise_exception(msg)` global. We use minijinja with the same settings, the
//! Python string methods from `minijinja_contrib::pycompat`, and the Python behaviours in
//! [`python`]. `tests/chat_template.rs` checks the output byte for byte against jinja2.
//!
//! Before rendering, OpenAI-style messages are normalised (see [`normalize`]): null keys dropped,
//! `developer` → `system`, system messages merged into one leading message, `reasoning` →
//! `reasoning_content`, and JSON-string tool-call arguments parsed into objects.

mod normalize;
mod python;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{AutoEscape, Environment, Value};
use serde::Deserialize;

/// The Qwen3.6 chat template, as published with the model (a byte-for-byte copy).
pub const QWEN36_TEMPLATE: &str = include_str!("../../assets/qwen3.6-chat-template.jinja");

/// Template names, as in a `tokenizer_config.json` that carries several templates.
const DEFAULT: &str = "default";
/// transformers renders with this one, when present, if the request has tools.
const TOOL_USE: &str = "tool_use";

/// Variables the renderer sets itself; `chat_template_kwargs` may not replace them.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Special tokens that transformers passes to every template (`tokenizer.special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("no chat template in {0}: expected chat_template.jinja, or chat_template in tokenizer_config.json")]
    Missing(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    /// The template called `raise_exception(message)`: the conversation breaks one of the
    /// template's rules (e.g. "No user query found in messages."). The request is at fault, so
    /// the server answers 400 with exactly this message.
    #[error("{0}")]
    Raised(String),
    /// The request cannot be prepared for the template (e.g. tool-call arguments that are not a
    /// JSON object). The request is at fault: 400.
    #[error("{0}")]
    InvalidInput(String),
    /// The template failed for another reason, almost always a message shape it does not expect
    /// (e.g. a tool call without a name). Also a 400: retrying the same request cannot help.
    #[error("chat template failed: {0}")]
    Render(String),
}

/// What a chat request gives the template.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatInput {
    /// The messages as the OpenAI request carries them (any JSON; normalised before rendering).
    pub messages: Vec<serde_json::Value>,
    /// The request's `tools`, passed to the template as given. `None` when the request has none.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// End the prompt with the opening of an assistant turn.
    #[serde(default)]
    pub add_generation_prompt: bool,
    /// Extra template variables: the request's `chat_template_kwargs` (`enable_thinking`,
    /// `preserve_thinking`, ...). Keys the template does not read are ignored, as in transformers.
    #[serde(default)]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template. Build once per model; rendering takes `&self`, so one value can be
/// shared between request handlers.
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    /// Special tokens from `tokenizer_config.json`, visible to the template unless a kwarg of
    /// the same name replaces them (transformers' precedence).
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_tool_use", &self.has_tool_use)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The built-in Qwen3.6 template, for a model directory without one.
    pub fn qwen36() -> Self {
        // A compile error here is a bug in the committed asset, which the tests would catch.
        Self::from_source(QWEN36_TEMPLATE).expect("the built-in Qwen3.6 chat template compiles")
    }

    /// A template from its Jinja source.
    pub fn from_source(source: &str) -> Result<Self, TemplateError> {
        Self::build(
            vec![(DEFAULT.to_string(), source.to_string())],
            BTreeMap::new(),
        )
    }

    /// The model's own template, found where transformers looks: `chat_template.jinja` first,
    /// else `chat_template` in `tokenizer_config.json` (a string, or a list of `{name, template}`
    /// of which "default" is used, and "tool_use" for requests with tools when present).
    pub fn from_model_dir(dir: &Path) -> Result<Self, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = match read_if_present(&config_path)? {
            Some(text) => Some(
                serde_json::from_str(&text).map_err(|e| TemplateError::Config {
                    path: config_path.clone(),
                    message: e.to_string(),
                })?,
            ),
            None => None,
        };
        let templates = match read_if_present(&dir.join("chat_template.jinja"))? {
            Some(source) => vec![(DEFAULT.to_string(), source)],
            None => match config.as_ref().and_then(|c| c.get("chat_template")) {
                Some(entry) => templates_from_config(entry, &config_path)?,
                None => return Err(TemplateError::Missing(dir.to_path_buf())),
            },
        };
        let special_tokens = config.as_ref().map(special_tokens).unwrap_or_default();
        Self::build(templates, special_tokens)
    }

    fn build(
        templates: Vec<(String, String)>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // jinja2 as transformers configures it. keep_trailing_newline stays off (jinja2's
        // default, which transformers keeps): a single newline at the end of the source is dropped.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        // Prompts are plain text: never HTML-escape, whatever the template's name.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python::format_value);
        env.add_filter("tojson", python::tojson);
        env.add_filter("trim", python::trim);
        env.add_function("raise_exception", raise_exception);
        let has_tool_use = templates.iter().any(|(name, _)| name == TOOL_USE);
        for (name, source) in templates {
            env.add_template_owned(name, source)
                .map_err(|e| TemplateError::Compile(describe(&e)))?;
        }
        Ok(ChatTemplate {
            env,
            has_tool_use,
            special_tokens,
        })
    }

    /// Renders the prompt for a conversation.
    pub fn render(&self, input: &ChatInput) -> Result<String, TemplateError> {
        if let Some(key) = RESERVED.iter().find(|key| input.kwargs.contains_key(**key)) {
            return Err(TemplateError::InvalidInput(format!(
                "chat_template_kwargs may not set `{key}`: it is set from the request itself"
            )));
        }
        let messages = normalize::normalize_messages(&input.messages)?;

        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        for (name, token) in &self.special_tokens {
            context.insert(name.clone(), Value::from(token.as_str()));
        }
        for (name, value) in &input.kwargs {
            context.insert(name.clone(), Value::from(Serde(value)));
        }
        context.insert("messages".into(), Value::from(Serde(&messages)));
        context.insert("tools".into(), Value::from(Serde(&input.tools)));
        context.insert("documents".into(), Value::from(()));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        );

        let name = if input.tools.is_some() && self.has_tool_use {
            TOOL_USE
        } else {
            DEFAULT
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        template.render(Value::from(context)).map_err(render_error)
    }
}

/// transformers' `raise_exception`: fails the render with the template's message. The message
/// travels as the error's source so that [`render_error`] can tell it from other failures.
fn raise_exception(message: &Value) -> Result<Value, minijinja::Error> {
    let message = message
        .as_str()
        .map_or_else(|| message.to_string(), str::to_string);
    Err(
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedByTemplate(message)),
    )
}

#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn render_error(err: minijinja::Error) -> TemplateError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TemplateError::Raised(raised.0.clone());
        }
        cause = e.source();
    }
    TemplateError::Render(describe(&err))
}

/// A minijinja error with its causes, on one line (it already names the template line).
fn describe(err: &minijinja::Error) -> String {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(err);
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// A file's text, or `None` if it does not exist.
fn read_if_present(path: &Path) -> Result<Option<String>, TemplateError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TemplateError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// `tokenizer_config.json`'s `chat_template`: a string, or a list of `{name, template}`.
fn templates_from_config(
    entry: &serde_json::Value,
    path: &Path,
) -> Result<Vec<(String, String)>, TemplateError> {
    let bad = |message: &str| TemplateError::Config {
        path: path.to_path_buf(),
        message: message.to_string(),
    };
    if let Some(source) = entry.as_str() {
        return Ok(vec![(DEFAULT.to_string(), source.to_string())]);
    }
    let list = entry
        .as_array()
        .ok_or_else(|| bad("chat_template must be a string or a list"))?;
    let mut templates = Vec::new();
    for item in list {
        match (
            item.get("name").and_then(|v| v.as_str()),
            item.get("template").and_then(|v| v.as_str()),
        ) {
            (Some(name), Some(source)) => templates.push((name.to_string(), source.to_string())),
            _ => {
                return Err(bad(
                    "each chat_template entry needs a string name and template",
                ))
            }
        }
    }
    if !templates.iter().any(|(name, _)| name == DEFAULT) {
        return Err(bad("chat_template has no template named \"default\""));
    }
    Ok(templates)
}

/// The special tokens of `tokenizer_config.json`, written either as strings or as added-token
/// objects (`{"content": "<|im_end|>", ...}`).
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|name| {
            let entry = config.get(*name)?;
            let token = entry
                .as_str()
                .or_else(|| entry.get("content").and_then(|c| c.as_str()))?;
            Some((name.to_string(), token.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn input(messages: serde_json::Value) -> ChatInput {
        ChatInput {
            messages: messages.as_array().cloned().unwrap_or_default(),
            ..Default::default()
        }
    }

    #[test]
    fn model_dir_prefers_chat_template_jinja() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = json!({"chat_template": "from config", "eos_token": {"content": "<E>"}});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string())
            .expect("write");
        let from_config = ChatTemplate::from_model_dir(dir.path()).expect("loads");
        assert_eq!(
            from_config.render(&input(json!([]))).ok().as_deref(),
            Some("from config")
        );

        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{{ eos_token }}|{{ bos_token }}\n",
        )
        .expect("write");
        let from_file = ChatTemplate::from_model_dir(dir.path()).expect("loads");
        // bos_token is not in the config, so it is undefined and prints nothing.
        assert_eq!(
            from_file.render(&input(json!([]))).ok().as_deref(),
            Some("<E>|")
        );
    }

    #[test]
    fn named_templates_pick_tool_use_for_tools() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = json!({"chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        ]});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string())
            .expect("write");
        let template = ChatTemplate::from_model_dir(dir.path()).expect("loads");
        assert_eq!(
            template.render(&input(json!([]))).ok().as_deref(),
            Some("plain")
        );
        let with_tools = ChatInput {
            tools: Some(vec![json!({})]),
            ..input(json!([]))
        };
        assert_eq!(
            template.render(&with_tools).ok().as_deref(),
            Some("tools: 1")
        );
    }

    #[test]
    fn missing_template_is_reported() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert!(matches!(
            ChatTemplate::from_model_dir(dir.path()),
            Err(TemplateError::Missing(_))
        ));
    }

    #[test]
    fn syntax_errors_are_compile_errors() {
        assert!(matches!(
            ChatTemplate::from_source("{% if %}"),
            Err(TemplateError::Compile(_))
        ));
    }

    #[test]
    fn can_be_shared_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<ChatTemplate>();
    }

    #[test]
    fn kwargs_cannot_replace_the_messages() {
        let mut request = input(json!([{"role": "user", "content": "hi"}]));
        request.kwargs.insert("messages".into(), json!([]));
        assert!(matches!(
            ChatTemplate::qwen36().render(&request),
            Err(TemplateError::InvalidInput(_))
        ));
    }
}
