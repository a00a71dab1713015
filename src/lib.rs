#![recursion_limit = "256"]
//! lily: an inference engine for Qwen3.6-35B-A3B.
//!
//! The path of one request: server → chat template → tokenizer → engine → backend forward →
//! sampler → detokenizer → reasoning / tool-call parsers → server. See `../shared/DESIGN.md`.

pub mod agree;
pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod ggml;
pub mod model;
pub mod plot;
pub mod quant;
pub mod sampling;
pub mod serve_bench;
pub mod server;
pub mod tokenizer;
