//! The model's own defaults from `generation_config.json`, used for whatever a request leaves out.

use std::path::Path;

use serde::Deserialize;

use super::params::{
    check_min_p, check_openai_penalty, check_repetition_penalty, check_temperature, check_top_k,
    check_top_p,
};
use super::ParamError;

/// `generation_config.json` exists but cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GenerationConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON for a generation config: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    Value { path: String, source: ParamError },
}

/// The defaults a model ships in `generation_config.json`, used for whatever a request leaves out
/// (vLLM's behaviour; Qwen's recommended temperature / top-p / top-k live there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub max_new_tokens: Option<i64>,
    /// Always stop tokens, whatever the request says.
    pub eos_token_ids: Vec<u32>,
}

/// `eos_token_id` is an integer in some configs and a list in others (Qwen uses a list).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

/// The file's shape; unknown keys (`do_sample`, `transformers_version`, ...) are ignored.
#[derive(Deserialize)]
struct RawGenerationConfig {
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    max_new_tokens: Option<i64>,
    eos_token_id: Option<OneOrMany>,
}

impl GenerationDefaults {
    pub const FILE_NAME: &'static str = "generation_config.json";

    /// Read `<model_dir>/generation_config.json`; a missing file means "no model defaults".
    pub fn load(model_dir: &Path) -> Result<Self, GenerationConfigError> {
        let path = model_dir.join(Self::FILE_NAME);
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(GenerationConfigError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// Parse the file's text. Values are range-checked now, so a bad file fails at start-up rather
    /// than in every request that relies on it.
    pub fn from_json(text: &str) -> Result<Self, GenerationConfigError> {
        Self::parse(text, Self::FILE_NAME)
    }

    /// `path` only names the file in errors.
    fn parse(text: &str, path: &str) -> Result<Self, GenerationConfigError> {
        let raw: RawGenerationConfig =
            serde_json::from_str(text).map_err(|source| GenerationConfigError::Json {
                path: path.to_string(),
                source,
            })?;
        let check = || -> Result<(), ParamError> {
            raw.temperature.map(check_temperature).transpose()?;
            raw.top_p.map(check_top_p).transpose()?;
            raw.top_k.map(check_top_k).transpose()?;
            raw.min_p.map(check_min_p).transpose()?;
            raw.repetition_penalty
                .map(check_repetition_penalty)
                .transpose()?;
            raw.presence_penalty
                .map(|v| check_openai_penalty("presence_penalty", v))
                .transpose()?;
            raw.frequency_penalty
                .map(|v| check_openai_penalty("frequency_penalty", v))
                .transpose()?;
            Ok(())
        };
        check().map_err(|source| GenerationConfigError::Value {
            path: path.to_string(),
            source,
        })?;
        Ok(Self {
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            presence_penalty: raw.presence_penalty,
            frequency_penalty: raw.frequency_penalty,
            // A zero or negative value would make every request invalid; treat it as "not set".
            max_new_tokens: raw.max_new_tokens.filter(|&n| n >= 1),
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
        })
    }
}
