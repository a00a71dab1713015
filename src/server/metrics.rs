//! `GET /metrics`: Prometheus text with vLLM's metric names (spec/API.md §2.11), so existing
//! Grafana dashboards and scripts that scrape vLLM work unchanged.
//!
//! Request-level metrics (latencies, token counts per request, finish reasons) are recorded by
//! the handlers through the `metrics` facade; engine-level ones (queue depth, token totals) are
//! read from the engine's counters at scrape time.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::engine::EngineStats;

/// The process-wide recorder. `metrics` has one global recorder, so every server in a process
/// (tests start several) shares it; series are told apart by their `model_name` label.
fn handle() -> &'static Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE.get_or_init(|| {
        const LATENCY: &[f64] = &[
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        const TOKENS: &[f64] = &[
            1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
            20000.0, 50000.0, 100000.0, 262144.0,
        ];
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_tokens".into()), TOKENS))
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("vllm:request_params_n".into()),
                    &[1.0, 2.0, 4.0, 8.0],
                )
            });
        match builder.and_then(|b| b.install_recorder()) {
            Ok(handle) => Some(handle),
            Err(e) => {
                // Another recorder is installed (an embedding program's own): keep serving, without metrics.
                tracing::warn!("metrics are disabled: {e}");
                None
            }
        }
    })
}

/// Records metrics for one served model.
#[derive(Clone)]
pub struct Metrics {
    model_name: String,
}

impl Metrics {
    pub fn new(model_name: &str) -> Metrics {
        // Installing early makes the first scrape already list every series.
        let _ = handle();
        Metrics {
            model_name: model_name.to_string(),
        }
    }

    /// The Prometheus text, with the engine's counters brought up to date.
    pub fn render(&self, stats: Option<&EngineStats>) -> String {
        if let Some(stats) = stats {
            let label = self.model_name.clone();
            gauge!("vllm:num_requests_running", "model_name" => label.clone())
                .set(stats.running.load(Ordering::Relaxed) as f64);
            gauge!("vllm:num_requests_waiting", "model_name" => label.clone())
                .set(stats.waiting.load(Ordering::Relaxed) as f64);
            counter!("vllm:prompt_tokens_total", "model_name" => label.clone())
                .absolute(stats.prompt_tokens_total.load(Ordering::Relaxed));
            counter!("vllm:generation_tokens_total", "model_name" => label.clone())
                .absolute(stats.generation_tokens_total.load(Ordering::Relaxed));
            // Prompt tokens looked up in the prefix cache, and those found there.
            counter!("vllm:prefix_cache_queries_total", "model_name" => label.clone())
                .absolute(stats.prompt_tokens_total.load(Ordering::Relaxed));
            counter!("vllm:prefix_cache_hits_total", "model_name" => label.clone())
                .absolute(stats.cached_tokens_total.load(Ordering::Relaxed));
            gauge!("lily:prefix_cache_bytes", "model_name" => label.clone())
                .set(stats.prefix_cache_bytes.load(Ordering::Relaxed) as f64);
            gauge!("lily:reserved_state_bytes", "model_name" => label.clone())
                .set(stats.reserved_bytes.load(Ordering::Relaxed) as f64);
            // Speculative decoding, named as vLLM names it: passes that checked drafts, the
            // drafts, and those accepted.
            counter!("vllm:spec_decode_num_drafts_total", "model_name" => label.clone())
                .absolute(stats.draft_passes_total.load(Ordering::Relaxed));
            counter!("vllm:spec_decode_num_draft_tokens_total", "model_name" => label.clone())
                .absolute(stats.draft_tokens_total.load(Ordering::Relaxed));
            counter!("vllm:spec_decode_num_accepted_tokens_total", "model_name" => label.clone())
                .absolute(stats.accepted_draft_tokens_total.load(Ordering::Relaxed));
            // Acceptance by position (0: a pass's first draft), as vLLM's per-position counter.
            let positions = stats.draft_positions.load(Ordering::Relaxed);
            for (p, accepted) in stats
                .accepted_per_position
                .iter()
                .enumerate()
                .take(positions)
            {
                counter!(
                    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    "model_name" => label.clone(),
                    "position" => p.to_string()
                )
                .absolute(accepted.load(Ordering::Relaxed));
            }
        }
        handle()
            .as_ref()
            .map(PrometheusHandle::render)
            .unwrap_or_default()
    }

    /// A request was accepted: its parameters.
    pub fn request_started(&self, max_tokens: Option<usize>, n: usize) -> RequestTimer {
        if let Some(m) = max_tokens {
            histogram!("vllm:request_params_max_tokens", "model_name" => self.model_name.clone())
                .record(m as f64);
        }
        histogram!("vllm:request_params_n", "model_name" => self.model_name.clone())
            .record(n as f64);
        RequestTimer {
            metrics: self.clone(),
            start: Instant::now(),
            last_token: None,
        }
    }
}

/// Timing of one request, from acceptance to its last token.
pub struct RequestTimer {
    metrics: Metrics,
    start: Instant,
    last_token: Option<Instant>,
}

impl RequestTimer {
    /// A token arrived: the first gives the time to first token, later ones the inter-token
    /// latency.
    pub fn token(&mut self) {
        let now = Instant::now();
        let name = self.metrics.model_name.clone();
        match self.last_token {
            None => histogram!("vllm:time_to_first_token_seconds", "model_name" => name)
                .record(secs(now - self.start)),
            Some(last) => histogram!("vllm:inter_token_latency_seconds", "model_name" => name)
                .record(secs(now - last)),
        }
        self.last_token = Some(now);
    }

    /// The request finished normally (not cancelled, not failed).
    pub fn finished(
        &self,
        finish_reason: &'static str,
        prompt_tokens: usize,
        generation_tokens: usize,
    ) {
        let name = self.metrics.model_name.clone();
        counter!("vllm:request_success_total", "model_name" => name.clone(), "finished_reason" => finish_reason).increment(1);
        histogram!("vllm:e2e_request_latency_seconds", "model_name" => name.clone())
            .record(secs(self.start.elapsed()));
        histogram!("vllm:request_prompt_tokens", "model_name" => name.clone())
            .record(prompt_tokens as f64);
        histogram!("vllm:request_generation_tokens", "model_name" => name)
            .record(generation_tokens as f64);
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
