//! lily: an inference engine for Qwen3.6-35B-A3B.
//!
//! The path of one request: server → chat template → tokenizer → engine → backend forward →
//! sampler → detokenizer → reasoning / tool-call parsers → server. See `../shared/DESIGN.md`.

pub mod config;
pub mod checkpoint;
pub mod quant;
pub mod model;
#[cfg(feature = "cuda")]
pub mod cuda;
