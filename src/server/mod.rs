//! `lily serve`: the OpenAI-compatible HTTP server.
//!
//! The server binds first and loads the model in the background, so `/health` can answer 503
//! ("loading") until it is ready — what orchestrators and test harnesses poll for. Then:
//!
//! ```text
//! routes.rs   handlers: parse + validate (request.rs) → start generations (engine::generate)
//! stream.rs   SSE framing of chat / text completion chunks
//! responses/  /v1/responses: translated to a chat request, output as Responses items and events
//! messages/   /v1/messages (Anthropic): translated the same way, output as content blocks
//! openai.rs   the wire types          errors.rs   OpenAI error objects and status codes
//! metrics.rs  /metrics (vLLM names)   scripted.rs test-only scripted backend
//! ```

pub mod errors;
pub mod hub;
pub mod messages;
pub mod metrics;
pub mod openai;
pub mod request;
pub mod responses;
pub mod routes;
pub mod scripted;
pub mod stream;

use std::future::{Future, IntoFuture};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;

use self::metrics::Metrics;
use crate::chat::template::{ChatTemplate, TemplateError};
use crate::checkpoint::{self, synth};
use crate::config::ModelConfig;
use crate::engine::generate::TextModel;
use crate::engine::{Engine, EngineOptions};
use crate::model::{Backend, CpuBackend, Weights};
use crate::sampling::GenerationDefaults;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Name under which the built-in demo model is served.
pub const DEMO_MODEL_NAME: &str = "lily-demo";

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The built-in demo: the `tiny` preset with random weights, the byte-level demo tokenizer
    /// and the real Qwen3.6 chat template.
    Demo,
    /// A model directory (already resolved from a Hugging Face repo id if one was given), or a
    /// GGUF file.
    Dir(PathBuf),
}

impl ModelSource {
    /// From a `--model` argument: none is the demo; a directory or a cached Hugging Face repo id.
    pub fn from_arg(arg: Option<&str>) -> anyhow::Result<ModelSource> {
        match arg {
            None => Ok(ModelSource::Demo),
            Some(arg) => Ok(ModelSource::Dir(hub::resolve(arg)?)),
        }
    }
}

/// Makes the backend that runs the weights, given the longest context it must hold. The
/// command line picks the device (`--device cpu|cuda|cuda:N`); tests use [`cpu_backend`].
pub type BackendFactory =
    Arc<dyn Fn(Weights, usize) -> anyhow::Result<Box<dyn Backend>> + Send + Sync>;

/// The CPU reference backend.
pub fn cpu_backend() -> BackendFactory {
    Arc::new(|weights, _max_context| Ok(Box::new(CpuBackend::new(weights))))
}

/// Everything `lily serve` was asked for.
#[derive(Clone)]
pub struct ServeOptions {
    pub source: ModelSource,
    /// The name clients use in `model`; defaults to the repo id, directory name or `lily-demo`.
    pub served_model_name: String,
    /// Other names accepted in `model` (what was passed to `--model`).
    pub aliases: Vec<String>,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_model_len: Option<usize>,
    pub backend: BackendFactory,
    /// Request bodies above this are refused with 413.
    pub max_body_bytes: usize,
    /// Requests in flight (queued or generating) above this are refused with 503.
    pub max_in_flight: usize,
    /// Test only: serve scripted replies instead of a model (see `scripted.rs`).
    pub scripted: Option<PathBuf>,
    /// How long in-flight requests may take to finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// Batching, admission and prefix-cache settings of the engine.
    pub engine: EngineOptions,
}

/// A loaded model, ready to serve.
pub struct ServedModel {
    pub name: String,
    pub aliases: Vec<String>,
    pub text: TextModel,
    pub engine: Engine,
    pub max_model_len: usize,
    /// Unix time of loading (`created` in `/v1/models`).
    pub created: u64,
    /// Facts for `/v1/models` (`meta`): demo or not, source, device.
    pub meta: serde_json::Value,
}

impl ServedModel {
    /// Whether a request's `model` names this model. An absent or empty name means "the one
    /// you serve", as vLLM treats it.
    pub fn answers_to(&self, model: Option<&str>) -> bool {
        match model {
            None | Some("") => true,
            Some(m) => m == self.name || self.aliases.iter().any(|a| a == m),
        }
    }
}

/// Shared by all handlers.
pub struct AppState {
    /// Set once the model is loaded; until then requests get 503.
    model: OnceLock<Arc<ServedModel>>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_in_flight: usize,
    in_flight: AtomicUsize,
    pub metrics: Metrics,
}

impl AppState {
    pub fn new(options: &ServeOptions) -> AppState {
        AppState {
            model: OnceLock::new(),
            api_key: options.api_key.clone(),
            max_body_bytes: options.max_body_bytes,
            max_in_flight: options.max_in_flight,
            in_flight: AtomicUsize::new(0),
            metrics: Metrics::new(&options.served_model_name),
        }
    }

    pub fn model(&self) -> Option<&Arc<ServedModel>> {
        self.model.get()
    }

    /// Makes the model available; the server is ready from now on.
    pub fn set_model(&self, model: ServedModel) {
        let ready = format!(
            "ready: serving `{}` ({}), max_model_len {}",
            model.name,
            model.meta["description"].as_str().unwrap_or(""),
            model.max_model_len
        );
        let _ = self.model.set(Arc::new(model));
        // Logged only now: scripts and tests take this line to mean that requests are served.
        tracing::info!("{ready}");
    }

    /// Counts a request in flight until the returned guard is dropped; `None` when the server
    /// is full.
    pub fn admit(self: &Arc<Self>) -> Option<InFlight> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight {
            state: self.clone(),
        };
        (before < self.max_in_flight).then_some(guard)
    }
}

/// A request in flight; see [`AppState::admit`].
pub struct InFlight {
    state: Arc<AppState>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the server until SIGINT or SIGTERM. Binds first, then loads the model.
pub fn run(options: ServeOptions) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((options.host.as_str(), options.port))
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot listen on {}:{}: {e}", options.host, options.port)
            })?;
        serve(listener, options, shutdown_signal()).await
    });
    // Generations still streaming after the grace period are dropped here, not waited for.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}

/// Serves on `listener` until `shutdown` resolves, then lets requests in flight finish for up
/// to the grace period. The model loads in the background meanwhile; a failed load ends the
/// server with its error (a server that can never become ready helps no one).
pub async fn serve(
    listener: tokio::net::TcpListener,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = Arc::new(AppState::new(&options));
    tracing::info!(
        "listening on http://{}; loading the model (/health answers 503 until it is ready)",
        listener.local_addr()?
    );

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, routes::router(state.clone()))
        .with_graceful_shutdown(async move {
            let _ = stop_rx.changed().await;
        })
        .into_future();
    let server = tokio::spawn(server);

    let loader_state = state.clone();
    let load_options = options.clone();
    let loader = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        loader_state.set_model(load(&load_options)?);
        Ok(())
    });
    let load_failed = async {
        match loader.await {
            Ok(Ok(())) => std::future::pending().await,
            Ok(Err(e)) => e,
            Err(e) => anyhow::anyhow!("loading the model failed: {e}"),
        }
    };
    let load_error = tokio::select! {
        _ = shutdown => None,
        e = load_failed => Some(e),
    };
    if load_error.is_none() {
        tracing::info!(
            "shutting down: no new connections; waiting up to {:?} for requests in flight",
            options.shutdown_grace
        );
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(options.shutdown_grace, server).await {
        Ok(Ok(Err(e))) => tracing::warn!("server error while stopping: {e}"),
        Err(_) => tracing::warn!(
            "requests still running after {:?}; stopping them",
            options.shutdown_grace
        ),
        _ => {}
    }
    match load_error {
        Some(e) => Err(e),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Loads the model (on a blocking thread) and starts its engine.
pub fn load(options: &ServeOptions) -> anyhow::Result<ServedModel> {
    let (text, backend, description, source): (TextModel, Box<dyn Backend>, String, String) =
        match (&options.scripted, &options.source) {
            (Some(script), source) => {
                let text = match source {
                    ModelSource::Demo => TextModel::demo()?,
                    ModelSource::Dir(dir) => text_model(dir)?,
                };
                let config = ModelConfig::from_json(&demo_config(
                    text.tokenizer.vocab_size(),
                    text.special.im_end,
                ))?;
                let script_text = scripted::Script::load(script)?;
                let backend =
                    scripted::ScriptedBackend::new(config, text.tokenizer.clone(), &script_text)?;
                tracing::warn!(
                    "TEST MODE: replies come from the script {}, not from a model",
                    script.display()
                );
                let description = "scripted test replies (no model)".to_string();
                (
                    text,
                    Box::new(backend),
                    description,
                    script.display().to_string(),
                )
            }
            (None, source) => {
                let (text, weights) = load_model(source)?;
                let context = max_model_len(
                    options.max_model_len,
                    weights.config.max_position_embeddings,
                )?;
                let backend = (options.backend)(weights, context)?;
                let (description, source) = match source {
                    ModelSource::Demo => (
                        "built-in demo model: tiny, random weights, byte-level demo tokenizer"
                            .into(),
                        "built-in".into(),
                    ),
                    ModelSource::Dir(dir) => (dir.display().to_string(), dir.display().to_string()),
                };
                (text, backend, description, source)
            }
        };
    text.prepare_grammars().map_err(|e| anyhow::anyhow!(e))?;
    let max_model_len = max_model_len(
        options.max_model_len,
        backend.config().max_position_embeddings,
    )?;
    let engine = Engine::start(backend, options.engine.clone());
    let meta = json!({
        "description": description,
        "demo": options.source == ModelSource::Demo && options.scripted.is_none(),
        "scripted": options.scripted.is_some(),
        "source": source,
        "device": engine.device_name(),
    });
    Ok(ServedModel {
        name: options.served_model_name.clone(),
        aliases: options.aliases.clone(),
        text,
        engine,
        max_model_len,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        meta,
    })
}

/// `--max-model-len`, checked against the model's context; the model's context without it.
fn max_model_len(requested: Option<usize>, context: usize) -> anyhow::Result<usize> {
    match requested {
        Some(n) if n > context => {
            anyhow::bail!(
                "--max-model-len {n} is more than the model's context of {context} tokens"
            )
        }
        Some(0) => anyhow::bail!("--max-model-len must be at least 1"),
        Some(n) => Ok(n),
        None => Ok(context),
    }
}

/// The text side and the weights of a model: what `lily serve` and `lily generate` run.
pub fn load_model(source: &ModelSource) -> anyhow::Result<(TextModel, Weights)> {
    match source {
        ModelSource::Demo => {
            let text = TextModel::demo()?;
            let weights = demo_weights(text.tokenizer.vocab_size(), text.special.im_end)?;
            tracing::warn!(
                "using the built-in DEMO model: random weights, so its output is gibberish. \
                 Pass --model DIR (or a Hugging Face repo id) for a real model."
            );
            Ok((text, weights))
        }
        ModelSource::Dir(dir) => {
            let text = text_model(dir)?;
            let weights = load_weights(dir)?;
            let vocab = weights.config.vocab_size;
            anyhow::ensure!(
                vocab >= text.tokenizer.vocab_size(),
                "the tokenizer has {} tokens but the model only {vocab} logits",
                text.tokenizer.vocab_size()
            );
            Ok((text, weights))
        }
    }
}

/// The text side of the model at `path`: the tokenizer and template files of its directory; for
/// a GGUF model without a tokenizer beside it, the vocabulary and chat template the file carries.
fn text_model(path: &Path) -> anyhow::Result<TextModel> {
    let Some(file) = checkpoint::gguf::find(path)? else {
        return TextModel::from_dir(path);
    };
    let dir = if path.is_dir() {
        path
    } else {
        file.parent().unwrap_or(Path::new("."))
    };
    match Tokenizer::from_dir(dir) {
        Err(TokenizerError::NotFound { .. }) => {}
        _ => return TextModel::from_dir(dir),
    }
    let gguf = checkpoint::gguf::GgufFile::open(&file)?;
    let tokens = gguf.token_list()?;
    let tokenizer = Tokenizer::from_token_list(&tokens, &file)?;
    let template = match ChatTemplate::from_model_dir(dir) {
        Err(TemplateError::Missing(_)) => match gguf.chat_template() {
            Some(source) => ChatTemplate::from_source(source)?,
            None => {
                tracing::warn!(
                    "{} has no chat template; using the built-in Qwen3.6 template",
                    file.display()
                );
                ChatTemplate::qwen36()
            }
        },
        other => other?,
    };
    TextModel::new(tokenizer, template, GenerationDefaults::load(dir)?)
}

/// The demo model's config: the `tiny` preset with the demo tokenizer's vocabulary,
/// `<|im_end|>` as its end-of-sequence token, and an MTP head (as the real checkpoint has), so
/// that `--draft-tokens` runs on it too.
fn demo_config(vocab_size: usize, im_end: u32) -> serde_json::Value {
    let mut config = synth::preset("tiny").unwrap_or_default();
    config["text_config"]["vocab_size"] = json!(vocab_size);
    config["text_config"]["eos_token_id"] = json!(im_end);
    config["text_config"]["mtp_num_hidden_layers"] = json!(1);
    config
}

/// Writes the demo checkpoint to a temporary directory, loads it and removes the directory
/// (the loaded weights do not need the files: a mapping outlives the file's name).
fn demo_weights(vocab_size: usize, im_end: u32) -> anyhow::Result<Weights> {
    let dir = std::env::temp_dir().join(format!(
        "lily-demo-{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let written = synth::write_checkpoint(
        &demo_config(vocab_size, im_end),
        &dir,
        0,
        checkpoint::tensor::DType::F32,
        synth::SHARD_BYTES,
        false,
    )
    .and_then(|_| checkpoint::load(&dir).map_err(anyhow::Error::from));
    let _ = std::fs::remove_dir_all(&dir);
    written
}

/// Loads a checkpoint with a progress line (a spinner with the elapsed time on a terminal).
fn load_weights(dir: &Path) -> anyhow::Result<Weights> {
    let weight_files: Vec<PathBuf> = match checkpoint::gguf::find(dir)? {
        Some(file) => vec![file],
        None => std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect(),
    };
    let (files, bytes) = weight_files.iter().fold((0, 0u64), |(n, b), p| {
        (n + 1, b + p.metadata().map_or(0, |m| m.len()))
    });
    let message = format!(
        "loading {} ({:.1} GB in {files} files)",
        dir.display(),
        bytes as f64 / 1e9
    );
    tracing::info!("{message}");
    let spinner = indicatif::ProgressBar::new_spinner().with_message(message);
    spinner.enable_steady_tick(Duration::from_millis(200));
    let start = std::time::Instant::now();
    let weights = checkpoint::load(dir);
    spinner.finish_and_clear();
    let weights = weights?;
    tracing::info!("weights loaded in {:.1} s", start.elapsed().as_secs_f64());
    Ok(weights)
}
