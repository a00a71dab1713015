//! The server over real TCP on 127.0.0.1, with a raw HTTP/1.1 client (`server_harness`), so
//! that what is checked is exactly what goes over the wire.
//!
//! Two kinds of servers: the built-in demo model (random weights: real forward passes, greedy or
//! seeded) and the scripted test backend, which emits known token sequences through the real
//! detokenizer, parsers and SSE path (see `lily::server::scripted`).

mod server_harness;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use lily::engine::EngineOptions;
use lily::server::DEMO_MODEL_NAME;
use server_harness::*;

/// What a streamed chat adds up to, after checking the chunk contract of spec/API.md §2.5.
#[derive(Debug, Default, PartialEq)]
struct Streamed {
    reasoning: String,
    content: String,
    /// (id, name, arguments) per call index.
    tool_calls: Vec<(String, String, String)>,
    finish_reason: String,
    usage: Option<Value>,
}

fn assemble(events: &[Value], include_usage: bool) -> Streamed {
    let mut out = Streamed::default();
    let id = events[0]["id"].clone();
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""}),
        "first chunk"
    );
    let mut finishes = 0;
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["id"], id, "one id for the whole stream");
        assert_eq!(event["object"], "chat.completion.chunk");
        let choices = event["choices"].as_array().expect("choices");
        if choices.is_empty() {
            assert!(include_usage, "a usage chunk nobody asked for");
            assert_eq!(i, events.len() - 1, "the usage chunk comes last");
            out.usage = Some(event["usage"].clone());
            continue;
        }
        assert!(
            event.get("usage").is_none_or(Value::is_null),
            "usage outside the usage chunk: {event}"
        );
        let choice = &choices[0];
        let delta = &choice["delta"];
        assert!(
            delta.get("content").is_none_or(Value::is_string),
            "content must not be null: {event}"
        );
        if let Some(r) = delta.get("reasoning_content").and_then(Value::as_str) {
            assert_eq!(delta["reasoning"], json!(r), "reasoning under both names");
            out.reasoning.push_str(r);
        }
        if let Some(c) = delta.get("content").and_then(Value::as_str) {
            out.content.push_str(c);
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = call["index"].as_u64().expect("tool call index") as usize;
            if index == out.tool_calls.len() {
                assert_eq!(call["type"], "function", "first delta of a call: {call}");
                let id = call["id"]
                    .as_str()
                    .expect("first delta has the id")
                    .to_string();
                let name = call["function"]["name"]
                    .as_str()
                    .expect("first delta has the name")
                    .to_string();
                out.tool_calls.push((id, name, String::new()));
            }
            assert!(
                index < out.tool_calls.len(),
                "tool call indexes go up one at a time"
            );
            out.tool_calls[index]
                .2
                .push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finishes += 1;
            out.finish_reason = reason.to_string();
        }
    }
    assert_eq!(finishes, 1, "exactly one finish chunk");
    assert_eq!(out.usage.is_some(), include_usage);
    out
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let server = TestServer::demo().await;
    assert_eq!(server.get("/health").await.json(), json!({"status": "ok"}));
    let models = server.get("/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], DEMO_MODEL_NAME);
    assert_eq!(models["data"][0]["max_model_len"], 32768);
    assert_eq!(
        models["data"][0]["meta"]["demo"], true,
        "the demo model says so"
    );
    assert_eq!(server.get("/v1/models/lily-demo").await.status, 200);
    assert_eq!(server.get("/v1/models/other").await.status, 404);
    let metrics = server.get("/metrics").await.text();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ] {
        assert!(
            metrics.contains(&format!("{name}{{model_name=\"lily-demo\"}}")),
            "{name} missing from /metrics"
        );
    }
    // CORS: a browser's preflight is answered.
    let preflight = http(
        server.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("origin", "http://example.com"),
            ("access-control-request-method", "POST"),
        ],
        b"",
    )
    .await;
    assert_eq!(preflight.status, 200);
    assert!(preflight.header("access-control-allow-origin").is_some());
    server.stop().await;
}

/// Drafts accepted by position, as vLLM's `spec_decode_num_accepted_tokens_per_pos`: one
/// series a position the engine drafts (none when it does not), each with its count.
#[test]
fn accepted_drafts_are_reported_by_position() {
    use lily::engine::EngineStats;
    use std::sync::atomic::Ordering;
    let metrics = lily::server::metrics::Metrics::new("per-position-test");
    let stats = EngineStats::default();
    stats.draft_positions.store(3, Ordering::Relaxed);
    for (p, n) in [7, 4, 1].into_iter().enumerate() {
        stats.accepted_per_position[p].store(n, Ordering::Relaxed);
    }
    let text = metrics.render(Some(&stats));
    let name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(name) && l.contains("per-position-test"))
        .collect();
    assert_eq!(series.len(), 3, "{series:?}");
    for (p, n) in [7, 4, 1].into_iter().enumerate() {
        assert!(
            series
                .iter()
                .any(|l| l.contains(&format!("position=\"{p}\"")) && l.ends_with(&format!(" {n}"))),
            "position {p}: {series:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped_with_the_right_status() {
    let mut opts = options();
    opts.api_key = Some("sekret".into());
    opts.max_body_bytes = 4096;
    let server = TestServer::start(opts, Some(json!({"default": "ok"}))).await;
    let auth = [
        ("authorization", "Bearer sekret"),
        ("content-type", "application/json"),
    ];
    let post = |body: Value| {
        let addr = server.addr;
        async move {
            http(
                addr,
                "POST",
                "/v1/chat/completions",
                &auth,
                body.to_string().as_bytes(),
            )
            .await
        }
    };
    let check = |r: &Response, status: u16, param: Option<&str>, code: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.text());
        let error = &r.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );
        assert!(error["type"].is_string(), "{error}");
        if let Some(p) = param {
            assert_eq!(error["param"], p, "{error}");
        }
        if let Some(c) = code {
            assert_eq!(error["code"], c, "{error}");
        }
    };

    // Health needs no key; the API does.
    assert_eq!(server.get("/health").await.status, 200);
    check(
        &server.get("/v1/models").await,
        401,
        None,
        Some("invalid_api_key"),
    );
    let wrong = http(
        server.addr,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer nope")],
        b"",
    )
    .await;
    check(&wrong, 401, None, Some("invalid_api_key"));
    assert_eq!(
        http(server.addr, "GET", "/v1/models", &auth, b"")
            .await
            .status,
        200
    );

    let ok = post(json!({"messages": user("hi")})).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let bad_json = http(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        b"{\"messages\": [",
    )
    .await;
    check(&bad_json, 400, None, None);
    check(
        &post(json!({"messages": user("hi"), "temperature": -1})).await,
        400,
        Some("temperature"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "temperature": "hot"})).await,
        400,
        Some("temperature"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "top_p": 0})).await,
        400,
        Some("top_p"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "n": 0})).await,
        400,
        Some("n"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "max_tokens": 0})).await,
        400,
        Some("max_tokens"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "max_completion_tokens": -5})).await,
        400,
        Some("max_completion_tokens"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "top_logprobs": 3})).await,
        400,
        Some("top_logprobs"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "logprobs": true, "top_logprobs": 50})).await,
        400,
        Some("top_logprobs"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "stream_options": {"include_usage": true}})).await,
        400,
        Some("stream_options"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "logit_bias": {"999999": 5}})).await,
        400,
        Some("logit_bias"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "tool_choice": "required"})).await,
        400,
        Some("tool_choice"),
        None,
    );
    check(
        &post(json!({"messages": user("hi"), "response_format": {"type": "xml"}})).await,
        400,
        Some("response_format"),
        None,
    );
    check(
        &post(json!({"messages": []})).await,
        400,
        Some("messages"),
        None,
    );
    check(
        &post(json!({"messages": [{"role": "wizard", "content": "x"}]})).await,
        400,
        Some("messages[0].role"),
        None,
    );
    let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]);
    check(
        &post(json!({"messages": image})).await,
        400,
        Some("messages[0].content[0]"),
        Some("unsupported_value"),
    );
    // The template's own rule: 400 with its message, never a 500.
    check(
        &post(json!({"messages": [{"role": "assistant", "content": "x"}]})).await,
        400,
        None,
        None,
    );
    // Context: the prompt plus the requested output must fit.
    let overflow = post(json!({"messages": user("hi"), "max_tokens": 40000})).await;
    check(&overflow, 400, None, Some("context_length_exceeded"));
    let message = overflow.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("maximum context length is 32768 tokens")
            && message.contains("exceeds the available context size")
    );
    check(
        &post(json!({"model": "gpt-4", "messages": user("hi")})).await,
        404,
        Some("model"),
        Some("model_not_found"),
    );
    check(&server.get("/v1/nothing").await, 404, None, None);
    check(
        &http(server.addr, "DELETE", "/v1/models", &auth, b"").await,
        405,
        None,
        None,
    );
    let big = json!({"messages": user(&"x".repeat(10_000))});
    check(&post(big).await, 413, None, None);
    // Lenient input: unknown fields, the developer role, content parts, several system messages.
    let lenient = post(json!({
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        ],
        "user": "u-1", "metadata": {"a": "b"}, "store": false, "some_vendor_field": 1
    }))
    .await;
    assert_eq!(lenient.status, 200, "{}", lenient.text());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_whole_responses_agree_under_greedy_decoding() {
    let server = TestServer::demo().await;
    for thinking in [true, false] {
        let body = json!({
            "messages": user("Tell me a story."),
            "temperature": 0,
            "max_tokens": 40,
            "chat_template_kwargs": {"enable_thinking": thinking},
        });
        let whole = server.chat(body.clone()).await;
        let mut streamed_body = body.clone();
        streamed_body["stream_options"] = json!({"include_usage": true});
        let streamed = assemble(&server.chat_stream(streamed_body).await, true);
        let message = &whole["choices"][0]["message"];
        assert_eq!(
            streamed.content,
            message["content"].as_str().unwrap_or_default(),
            "thinking {thinking}"
        );
        assert_eq!(
            streamed.reasoning,
            message["reasoning_content"].as_str().unwrap_or_default(),
            "thinking {thinking}"
        );
        assert_eq!(message["reasoning"], message["reasoning_content"]);
        assert_eq!(
            streamed.finish_reason,
            whole["choices"][0]["finish_reason"]
                .as_str()
                .unwrap_or_default()
        );
        assert_eq!(streamed.usage.as_ref(), Some(&whole["usage"]));
        if !thinking {
            assert!(
                message["reasoning_content"].is_null(),
                "no reasoning with thinking off"
            );
        }
        // Without include_usage there is no usage chunk (assemble checks it).
        assemble(&server.chat_stream(body).await, false);
    }
    server.stop().await;
}

/// `--draft-tokens 3` on the demo model (which has an MTP head): greedy answers, streamed (a
/// pass's kept drafts arrive as several tokens at once) and whole, with thinking and tools, are
/// the ones the server without drafts gives, and the drafts show in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafting_changes_no_greedy_answer() {
    let plain = TestServer::demo().await;
    let mut opts = options();
    opts.engine.draft_tokens = 3;
    opts.engine.draft_schedule = lily::engine::DraftSchedule::Fixed;
    // A name of its own: the metrics recorder is the process's, and other tests' demo servers
    // write their own engines' counters under the demo's name.
    opts.served_model_name = "lily-demo-drafting".into();
    let drafting = TestServer::start(opts, None).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    for (thinking, with_tools) in [(true, false), (false, false), (false, true)] {
        let mut body = json!({
            "messages": user("Tell me a story."),
            "temperature": 0,
            "max_tokens": 48,
            "chat_template_kwargs": {"enable_thinking": thinking},
        });
        if with_tools {
            body["tools"] = tools.clone();
        }
        let want = plain.chat(body.clone()).await;
        let got = drafting.chat(body.clone()).await;
        assert_eq!(got["choices"], want["choices"], "thinking {thinking}");
        assert_eq!(got["usage"], want["usage"]);
        let want = assemble(&plain.chat_stream(body.clone()).await, false);
        let got = assemble(&drafting.chat_stream(body).await, false);
        assert_eq!(
            (got.content, got.reasoning, got.finish_reason),
            (want.content, want.reasoning, want.finish_reason),
            "streamed, thinking {thinking}"
        );
    }
    let metrics = drafting.get("/metrics").await.text();
    let drafts: f64 = (metrics.lines())
        .find_map(|l| {
            l.strip_prefix("vllm:spec_decode_num_drafts_total{model_name=\"lily-demo-drafting\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(drafts > 0.0, "{metrics}");
    plain.stop().await;
    drafting.stop().await;
}

/// vLLM's `stream_options.continuous_usage_stats`: with `include_usage`, every chunk after the
/// first carries the usage so far; the counts only grow and end at the final usage chunk's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_count_as_they_go() {
    let server = TestServer::scripted(json!({"default": "one two three"})).await;
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "Count:"})),
        ("/v1/chat/completions", json!({"messages": user("Count")})),
    ] {
        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let events = sse_events(&server.post(path, &body).await.text());
        let counted: Vec<u64> = events
            .iter()
            .filter(|e| !e["choices"].as_array().is_some_and(|c| c.is_empty()))
            .filter_map(|e| e["usage"]["completion_tokens"].as_u64())
            .collect();
        let last = events.last().expect("a final usage chunk");
        let total = last["usage"]["completion_tokens"].as_u64().expect("usage");
        assert!(counted.len() >= 2, "{path}: {events:?}");
        assert!(
            counted.windows(2).all(|w| w[0] <= w[1]),
            "{path}: {counted:?}"
        );
        assert_eq!(counted.last(), Some(&total), "{path}");
        assert!(
            events.iter().all(
                |e| e["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"]
                    || e["usage"].is_null()
            ),
            "{path}"
        );
        // Without it, only the final chunk has usage.
        body["stream_options"] = json!({"include_usage": true});
        let events = sse_events(&server.post(path, &body).await.text());
        let with_usage = events.iter().filter(|e| !e["usage"].is_null()).count();
        assert_eq!(with_usage, 1, "{path}");
    }
    server.stop().await;
}

/// vLLM's `include_reasoning: false`: the answer alone, streamed or not (the reasoning is still
/// generated and counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_reasoning_false_leaves_the_reasoning_out() {
    let server =
        TestServer::scripted(json!({"default": "Thinking hard.\n</think>\n\nThe answer."})).await;
    let messages = user("What is the answer?");
    for include in [true, false] {
        let body = server
            .chat(json!({"messages": messages, "include_reasoning": include}))
            .await;
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], "The answer.", "{body}");
        let reasoning = message["reasoning_content"].as_str().unwrap_or("");
        assert_eq!(reasoning.is_empty(), !include, "{body}");
        assert!(
            body["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64() > Some(0),
            "{body}"
        );
        let r = server
            .post(
                "/v1/chat/completions",
                &json!({"messages": messages, "include_reasoning": include, "stream": true}),
            )
            .await;
        let events = sse_events(&r.text());
        let streamed: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(streamed.is_empty(), !include, "{}", r.text());
        let answer: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(answer, "The answer.");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_match_the_tokenizer() {
    let reply = "Sure! The answer is forty-two.";
    let server =
        TestServer::scripted(json!({"default": format!("Thinking hard.\n</think>\n\n{reply}")}))
            .await;
    let messages = user("What is the answer?");
    let response = server.chat(json!({"messages": messages})).await;
    let prompt = server
        .post("/tokenize", &json!({"messages": messages}))
        .await
        .json();
    let usage = &response["usage"];
    assert_eq!(usage["prompt_tokens"], prompt["count"]);
    let tokenizer = demo_tokenizer();
    let generated = tokenizer
        .encode(&format!("Thinking hard.\n</think>\n\n{reply}"))
        .expect("encode")
        .len()
        + 1; // + <|im_end|>
    assert_eq!(usage["completion_tokens"], json!(generated));
    assert_eq!(
        usage["total_tokens"],
        json!(generated + prompt["count"].as_u64().unwrap_or(0) as usize)
    );
    // Reasoning tokens: "Thinking hard." and the newline before </think>.
    let reasoning = tokenizer.encode("Thinking hard.\n").expect("encode").len();
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"],
        json!(reasoning)
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(response["choices"][0]["message"]["content"], reply);
    assert_eq!(
        response["choices"][0]["message"]["reasoning_content"],
        "Thinking hard."
    );
    server.stop().await;
}

const WEATHER_CALLS: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_and_reasoning_end_to_end() {
    let server =
        TestServer::scripted(json!({"replies": [{"when": "weather", "text": WEATHER_CALLS}]}))
            .await;
    let body = json!({"messages": user("What is the weather in Paris and Rome?"), "tools": weather_tools()});

    let whole = server.chat(body.clone()).await;
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(
        choice["message"]["content"].is_null(),
        "only tool calls: content is null"
    );
    assert_eq!(
        choice["message"]["reasoning_content"],
        "The user wants the weather."
    );
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool calls");
    assert_eq!(calls.len(), 2);
    let args: Vec<Value> = calls
        .iter()
        .map(|c| {
            serde_json::from_str(c["function"]["arguments"].as_str().unwrap_or(""))
                .expect("JSON arguments")
        })
        .collect();
    assert_eq!(
        args,
        [json!({"city": "Paris", "days": 3}), json!({"city": "Rome"})],
        "typed by the schema"
    );
    assert_eq!(calls[0]["type"], "function");
    assert_ne!(calls[0]["id"], calls[1]["id"]);

    let streamed = assemble(&server.chat_stream(body.clone()).await, false);
    assert_eq!(streamed.finish_reason, "tool_calls");
    assert_eq!(streamed.reasoning, "The user wants the weather.");
    assert_eq!(streamed.content, "");
    let names: Vec<&str> = streamed
        .tool_calls
        .iter()
        .map(|(_, n, _)| n.as_str())
        .collect();
    assert_eq!(names, ["get_weather", "get_weather"]);
    for ((_, _, arguments), expected) in streamed.tool_calls.iter().zip(&args) {
        assert_eq!(
            &serde_json::from_str::<Value>(arguments).expect("streamed arguments are JSON"),
            expected
        );
    }

    // parallel_tool_calls: false stops after the first call.
    let mut single = body.clone();
    single["parallel_tool_calls"] = json!(false);
    let one = server.chat(single).await;
    assert_eq!(
        one["choices"][0]["message"]["tool_calls"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(one["choices"][0]["finish_reason"], "tool_calls");

    // The turn goes back into the history (arguments as a JSON string, reasoning under either
    // name) and the conversation continues.
    let mut history = user("What is the weather in Paris and Rome?")
        .as_array()
        .cloned()
        .unwrap_or_default();
    history.push(json!({"role": "assistant", "content": null, "reasoning": "The user wants the weather.", "tool_calls": calls}));
    for call in calls {
        history.push(json!({"role": "tool", "tool_call_id": call["id"], "content": [{"type": "text", "text": "sunny"}]}));
    }
    let next = server.chat(json!({"messages": history, "tools": weather_tools(), "chat_template_kwargs": {"preserve_thinking": true}})).await;
    assert_eq!(next["choices"][0]["finish_reason"], "stop");
    let text = rendered_prompt(server.addr, &json!({"messages": history, "tools": weather_tools(), "chat_template_kwargs": {"preserve_thinking": true}})).await;
    assert!(
        text.contains("<think>\nThe user wants the weather.\n</think>"),
        "reasoning kept in history: {text}"
    );
    assert!(
        text.contains("<parameter=city>\nParis\n</parameter>"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_required_and_named_produce_calls() {
    // The demo model has random weights: only the grammar makes it call a tool.
    let server = TestServer::demo().await;
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        for seed in 0..3 {
            let response = server
                .chat(json!({
                    "messages": user("weather?"), "tools": weather_tools(), "tool_choice": choice,
                    "temperature": 1.0, "seed": seed, "max_tokens": 300,
                    "chat_template_kwargs": {"enable_thinking": false},
                }))
                .await;
            let choice0 = &response["choices"][0];
            let calls = choice0["message"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            assert!(!calls.is_empty(), "no tool call: {response}");
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            if choice0["finish_reason"] == "tool_calls" {
                let args: Value =
                    serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap_or(""))
                        .expect("JSON arguments");
                assert!(
                    args.as_object()
                        .is_some_and(|a| a.keys().all(|k| k == "city" || k == "days")),
                    "{args}"
                );
            }
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_answers_always_parse_and_validate() {
    let server = TestServer::demo().await;
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    });
    for (seed, thinking) in (0..6).map(|s| (s, s % 2 == 0)) {
        let response = server
            .chat(json!({
                "messages": user("Describe a person."),
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}},
                "temperature": 1.0, "seed": seed, "max_tokens": 400,
                // With thinking on, the grammar applies only after </think>; a budget makes the
                // random model close its reasoning.
                "chat_template_kwargs": {"enable_thinking": thinking}, "thinking_token_budget": 5,
            }))
            .await;
        let choice = &response["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{response}");
        let content = choice["message"]["content"].as_str().expect("content");
        let value: Value =
            serde_json::from_str(content).unwrap_or_else(|e| panic!("not JSON ({e}): {content:?}"));
        let object = value.as_object().expect("an object");
        assert_eq!(object.len(), 4, "{value}");
        assert!(
            object["name"]
                .as_str()
                .is_some_and(|s| s.chars().count() <= 12),
            "{value}"
        );
        assert!(object["age"].as_u64().is_some_and(|a| a <= 150), "{value}");
        assert!(
            object["tags"].as_array().is_some_and(|t| t.len() <= 3
                && t.iter()
                    .all(|x| ["a", "b", "c"].contains(&x.as_str().unwrap_or("")))),
            "{value}"
        );
        assert!(object["ok"].is_boolean(), "{value}");
        if thinking {
            assert!(
                choice["message"]["reasoning_content"].is_string(),
                "reasoning stays unconstrained: {response}"
            );
        }
    }
    // json_object: any JSON object.
    let response = server
        .chat(json!({"messages": user("hi"), "response_format": {"type": "json_object"}, "seed": 1, "temperature": 1.0, "max_tokens": 400, "chat_template_kwargs": {"enable_thinking": false}}))
        .await;
    if response["choices"][0]["finish_reason"] == "stop" {
        let content = response["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        assert!(
            serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()),
            "{content:?}"
        );
    }
    server.stop().await;
}

/// vLLM's constraints on the answer (`structured_outputs`, the older `guided_*` spellings) and
/// llama.cpp's `json_schema`: the random demo model's answers always follow them, with thinking on
/// (the constraint applies after `</think>`) and off, on chat and text completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_constrain_the_answer() {
    let server = TestServer::demo().await;
    let answer = |response: &Value| -> String {
        let choice = &response["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{response}");
        choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str())
            .expect("an answer")
            .to_string()
    };
    let is_code = |s: &str| {
        let b = s.as_bytes();
        b.len() == 6
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'/'
            && b[4..].iter().all(u8::is_ascii_lowercase)
    };
    let options = ["yes", "no", "maybe so"];
    for (seed, thinking) in (0..4).map(|s| (s, s % 2 == 0)) {
        let chat = |constraint: Value| {
            let mut body = json!({
                "messages": user("Answer."), "temperature": 1.0, "seed": seed, "max_tokens": 200,
                "chat_template_kwargs": {"enable_thinking": thinking}, "thinking_token_budget": 5,
            });
            for (k, v) in constraint.as_object().expect("fields") {
                body[k] = v.clone();
            }
            body
        };
        let choice = answer(
            &server
                .chat(chat(json!({"structured_outputs": {"choice": options}})))
                .await,
        );
        assert!(options.contains(&choice.as_str()), "{choice:?}");
        let choice = answer(&server.chat(chat(json!({"guided_choice": options}))).await);
        assert!(options.contains(&choice.as_str()), "{choice:?}");
        // A slash in the pattern, which Lark's regex literal needs escaped.
        let code = answer(
            &server
                .chat(chat(json!({"guided_regex": "[0-9]{3}/[a-z]{2}"})))
                .await,
        );
        assert!(is_code(&code), "{code:?}");
        let lark = answer(
            &server
                .chat(chat(
                    json!({"structured_outputs": {"grammar": "start: \"AB\" | \"BA\""}}),
                ))
                .await,
        );
        assert!(lark == "AB" || lark == "BA", "{lark:?}");
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false});
        for constraint in [
            json!({"structured_outputs": {"json": schema}}),
            json!({"structured_outputs": {"json": schema.to_string()}}),
            json!({"guided_json": schema}),
            json!({"json_schema": schema}),
        ] {
            let text = answer(&server.chat(chat(constraint.clone())).await);
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{constraint}: not JSON ({e}): {text:?}"));
            assert!(
                value["n"].is_i64() && value.as_object().is_some_and(|o| o.len() == 1),
                "{constraint}: {value}"
            );
        }
    }
    // Without a constraint the random model says something else (so the checks above can fail).
    let free = server
        .chat(
            json!({"messages": user("Answer."), "temperature": 1.0, "seed": 0, "max_tokens": 30,
                     "chat_template_kwargs": {"enable_thinking": false}}),
        )
        .await;
    let free = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(!options.contains(&free) && !is_code(free), "{free:?}");
    // Text completions take them too.
    let r = server
        .post("/v1/completions", &json!({"prompt": "The answer is", "guided_choice": options, "max_tokens": 20, "seed": 3, "temperature": 1.0}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let text = answer(&r.json());
    assert!(options.contains(&text.as_str()), "{text:?}");
    server.stop().await;
}

/// Bad or conflicting constraints are 400s that name the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_structured_outputs_are_rejected() {
    let server = TestServer::demo().await;
    let cases = [
        (json!({"guided_regex": "("}), "guided_regex"),
        (json!({"guided_regex": ""}), "guided_regex"),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_choice": ["a", 3]}), "guided_choice"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (json!({"structured_outputs": "regex"}), "structured_outputs"),
        (json!({"structured_outputs": {}}), "structured_outputs"),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: undefined_rule"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"structural_tag": {}}}),
            "structured_outputs.structural_tag",
        ),
        (
            json!({"guided_choice": ["a"], "response_format": {"type": "json_object"}}),
            "guided_choice",
        ),
        (
            json!({"guided_regex": "a+", "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
            "guided_regex",
        ),
    ];
    for (constraint, param) in cases {
        let mut body = json!({"messages": user("hi"), "max_tokens": 5});
        for (k, v) in constraint.as_object().expect("fields") {
            body[k] = v.clone();
        }
        let r = server.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{constraint}: {}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["param"], param, "{constraint}: {error}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );
    }
    server.stop().await;
}

/// `echo` with `logprobs` (lm-eval's loglikelihood requests): the text and the logprobs start with
/// the prompt's tokens, the first without a value; a prompt token's logprob is the one the model
/// gives it in context, so scoring a greedy continuation reproduces generation's own logprobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt() {
    let server = TestServer::demo().await;
    let prompt: Vec<u32> = (0..12).map(|i| 100 + 7 * i).collect();
    // Scored, nothing generated.
    let r = server
        .post(
            "/v1/completions",
            &json!({"prompt": [prompt], "max_tokens": 0, "echo": true, "logprobs": 2}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 0);
    let echoed = server
        .post("/detokenize", &json!({"tokens": prompt}))
        .await
        .json()["prompt"]
        .clone();
    assert_eq!(choice["text"], echoed);
    let lp = &choice["logprobs"];
    assert_eq!(
        lp["tokens"].as_array().map(Vec::len),
        Some(prompt.len()),
        "{lp}"
    );
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    for i in 1..prompt.len() {
        let v = lp["token_logprobs"][i].as_f64().expect("a logprob");
        assert!(v <= 0.0, "{lp}");
        assert!(
            lp["top_logprobs"][i]
                .as_object()
                .is_some_and(|o| !o.is_empty() && o.len() <= 2),
            "{lp}"
        );
    }
    // Position i is scored by the distribution after the first i tokens: the one a completion of
    // those i tokens samples its first token from (its own top logprobs).
    for i in [3, 7, 11] {
        let r = server
            .post("/v1/completions", &json!({"prompt": [&prompt[..i]], "max_tokens": 1, "temperature": 0, "logprobs": 2}))
            .await;
        let next = r.json()["choices"][0]["logprobs"]["top_logprobs"][0].clone();
        let (want, got) = (
            next.as_object().expect("top"),
            lp["top_logprobs"][i].as_object().expect("top"),
        );
        assert_eq!(
            want.len(),
            got.len(),
            "position {i}: {next} vs {}",
            lp["top_logprobs"][i]
        );
        for (token, v) in want {
            let g = got.get(token).and_then(Value::as_f64).unwrap_or(f64::NAN);
            assert!(
                (g - v.as_f64().unwrap_or(f64::NAN)).abs() < 2e-3,
                "position {i}, {token:?}: {g} vs {v}"
            );
        }
    }
    // Echo with generation: the prompt's logprobs, then the new tokens'.
    let seed = &prompt[..5];
    let r = server
        .post("/v1/completions", &json!({"prompt": [seed], "max_tokens": 3, "echo": true, "logprobs": 1, "temperature": 0}))
        .await;
    let choice = r.json()["choices"][0].clone();
    let seed_text = server
        .post("/detokenize", &json!({"tokens": seed}))
        .await
        .json()["prompt"]
        .as_str()
        .expect("text")
        .to_string();
    assert!(
        choice["text"]
            .as_str()
            .is_some_and(|t| t.starts_with(&seed_text) && t.len() > seed_text.len()),
        "{choice}"
    );
    let n = choice["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
    assert_eq!(n, seed.len() + 3, "{choice}");
    let offsets: Vec<u64> = choice["logprobs"]["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .map(|v| v.as_u64().expect("offset"))
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_content_only() {
    let server =
        TestServer::scripted(json!({"default": "Stop here?\n</think>\n\nHello! How can I help?"}))
            .await;
    let body = json!({"messages": user("hi"), "stop": ["can", "here"]});
    let whole = server.chat(body.clone()).await;
    // "here" is in the reasoning: stop strings apply to the answer only.
    assert_eq!(
        whole["choices"][0]["message"]["reasoning_content"],
        "Stop here?"
    );
    assert_eq!(whole["choices"][0]["message"]["content"], "Hello! How ");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    let streamed = assemble(&server.chat_stream(body).await, false);
    assert_eq!(streamed.content, "Hello! How ");
    assert_eq!(streamed.reasoning, "Stop here?");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_n_and_seed() {
    let server = TestServer::demo().await;
    let response = server
        .chat(json!({"messages": user("hi"), "logprobs": true, "top_logprobs": 3, "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}))
        .await;
    let entries = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!entries.is_empty());
    for entry in &entries {
        assert_eq!(entry["top_logprobs"].as_array().map(Vec::len), Some(3));
        assert!(entry["logprob"].as_f64().is_some_and(|l| l <= 0.0));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(entry["top_logprobs"][0]["token"], entry["token"]);
    }
    let text: String = entries.iter().filter_map(|e| e["token"].as_str()).collect();
    assert_eq!(
        text,
        response["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
    );

    let body =
        json!({"messages": user("hi"), "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12});
    let a = server.chat(body.clone()).await;
    let b = server.chat(body).await;
    assert_eq!(a["choices"].as_array().map(Vec::len), Some(3));
    for i in 0..3 {
        assert_eq!(a["choices"][i]["index"], i);
        assert_eq!(
            a["choices"][i]["message"], b["choices"][i]["message"],
            "a seed makes choices reproducible"
        );
    }
    assert!(
        a["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n >= 3),
        "usage sums the choices"
    );
    server.stop().await;
}

/// vLLM's `ignore_eos` (fixed-length benchmark requests), `min_tokens`, `allowed_token_ids`,
/// `include_stop_str_in_output` and `bad_words`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sampling_extras() {
    let server = TestServer::scripted(json!({"default": "one two three"})).await;
    let usage = |body: &Value| body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    // The script ends its reply with <|im_end|> after a few tokens; ignore_eos runs to max_tokens.
    let r = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(usage(&body), 24, "{body}");
    let chat = json!({"messages": [{"role": "user", "content": "Count"}], "max_tokens": 24,
                      "temperature": 0, "ignore_eos": true});
    let body = server.post("/v1/chat/completions", &chat).await.json();
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(usage(&body), 24, "{body}");
    // min_tokens: the end of the reply is held back until 15 tokens are out, then it may stop.
    let plain = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 40, "temperature": 0}),
        )
        .await
        .json();
    assert!(usage(&plain) < 15, "the script's reply is short: {plain}");
    let body = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 40, "temperature": 0, "min_tokens": 15}),
        )
        .await
        .json();
    assert!(usage(&body) >= 15, "{body}");
    assert!(
        body["choices"][0]["text"]
            .as_str()
            .unwrap_or("")
            .starts_with("one two three"),
        "{body}"
    );
    // allowed_token_ids: only that token, again and again (the end of turn is not allowed).
    let tokenizer = demo_tokenizer();
    let id = tokenizer.encode("one").expect("encode")[0];
    let body = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 5, "allowed_token_ids": [id]}),
        )
        .await
        .json();
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(
        body["choices"][0]["text"],
        tokenizer.decode(&[id; 5]).expect("decode"),
        "{body}"
    );
    // Stop strings count from min_tokens on: the first reply's "two" passes; its end of turn is
    // held back (token 10), the script starts over at token 11 and that "two" stops the text.
    let body = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 60, "temperature": 0, "min_tokens": 11,
                    "stop": ["two"]}),
        )
        .await
        .json();
    let text = body["choices"][0]["text"].as_str().unwrap_or("");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    assert!(
        text.starts_with("one two three") && text.ends_with("one "),
        "{body}"
    );
    assert!(usage(&body) >= 11 && usage(&body) < 20, "{body}");
    // include_stop_str_in_output keeps the stop string that ended the text.
    for (keep, text) in [(false, "one "), (true, "one two")] {
        let body = server
            .post(
                "/v1/completions",
                &json!({"prompt": "Count:", "stop": ["two"], "include_stop_str_in_output": keep}),
            )
            .await
            .json();
        assert_eq!(body["choices"][0]["text"], text, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    }
    // bad_words: "two" never appears, though the script keeps trying to write it.
    let body = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 30, "temperature": 0, "bad_words": ["two"]}),
        )
        .await
        .json();
    let text = body["choices"][0]["text"].as_str().unwrap_or("");
    assert!(text.starts_with("one") && !text.contains("two"), "{body}");
    // Out of range: a 400 naming the field.
    for (bad, param) in [
        (
            json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5}),
            "min_tokens",
        ),
        (json!({"prompt": "x", "min_tokens": -1}), "min_tokens"),
        (
            json!({"prompt": "x", "allowed_token_ids": []}),
            "allowed_token_ids",
        ),
        (
            json!({"prompt": "x", "allowed_token_ids": [1, 99999999]}),
            "allowed_token_ids",
        ),
        (
            json!({"prompt": "x", "bad_words": ["ok", " "]}),
            "bad_words",
        ),
    ] {
        let r = server.post("/v1/completions", &bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{bad}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_completions() {
    let server = TestServer::scripted(json!({"default": "one two three"})).await;
    let r = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 50}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], "one two three");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let tokenizer = demo_tokenizer();
    assert_eq!(
        body["usage"]["prompt_tokens"],
        json!(tokenizer.encode("Count:").expect("encode").len())
    );

    let r = server.post("/v1/completions", &json!({"prompt": "Count:", "max_tokens": 50, "stream": true, "stream_options": {"include_usage": true}})).await;
    let events = sse_events(&r.text());
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "one two three");
    assert_eq!(events.last().map(|e| e["choices"].clone()), Some(json!([])));
    // `echo` is offered without `stream` only.
    assert_eq!(
        server
            .post(
                "/v1/completions",
                &json!({"prompt": "x", "echo": true, "stream": true})
            )
            .await
            .status,
        400
    );
    assert_eq!(
        server
            .post("/v1/completions", &json!({"prompt": ["a", "b"]}))
            .await
            .status,
        400
    );
    let short = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 2}),
        )
        .await
        .json();
    assert_eq!(short["choices"][0]["finish_reason"], "length");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_streams_all_complete() {
    let replies: Vec<Value> = (0..50).map(|i| json!({"when": format!("client {i}."), "text": format!("Done.\n</think>\n\nReply for client {i}, all good.")})).collect();
    let server = TestServer::scripted(json!({"replies": replies, "token_delay_ms": 1})).await;
    let addr = server.addr;
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            tokio::spawn(async move {
                let body = json!({"messages": user(&format!("I am client {i}.")), "stream": true});
                let r = http(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    &[],
                    body.to_string().as_bytes(),
                )
                .await;
                assert_eq!(r.status, 200);
                let streamed = assemble(&sse_events(&r.text()), false);
                assert_eq!(streamed.content, format!("Reply for client {i}, all good."));
                assert_eq!(streamed.finish_reason, "stop");
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("client task");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_frees_the_slot() {
    let long = "word ".repeat(5000);
    let server = TestServer::scripted(
        json!({"replies": [{"when": "long", "text": long}], "token_delay_ms": 2}),
    )
    .await;
    for stream in [true, false] {
        let body = json!({"messages": user("long please"), "stream": stream, "chat_template_kwargs": {"enable_thinking": false}});
        let mut socket = TcpStream::connect(server.addr).await.expect("connect");
        socket
            .write_all(&request_bytes(
                server.addr,
                "POST",
                "/v1/chat/completions",
                &[],
                body.to_string().as_bytes(),
            ))
            .await
            .expect("send");
        if stream {
            // Read until a few content chunks arrived, then hang up.
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while String::from_utf8_lossy(&seen)
                .matches("\"content\"")
                .count()
                < 5
            {
                let n = socket.read(&mut buf).await.expect("read");
                assert!(n > 0, "stream ended early");
                seen.extend_from_slice(&buf[..n]);
            }
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(
            server.metric("vllm:num_requests_running").await,
            1.0,
            "stream {stream}: generating"
        );
        drop(socket);
        assert!(
            idle(&server, Duration::from_secs(3)).await,
            "stream {stream}: the slot was not freed"
        );
        let generated = server.metric("vllm:generation_tokens_total").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            server.metric("vllm:generation_tokens_total").await,
            generated,
            "generation stopped"
        );
        assert!(
            generated < 2000.0,
            "stopped long before the end ({generated} tokens)"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_request_leaves_the_others_alone() {
    let server = TestServer::scripted(json!({
        "replies": [{"when": "explode", "panic": true}, {"when": "slow", "text": "fine ".repeat(200)}],
        "token_delay_ms": 2,
    }))
    .await;
    let addr = server.addr;
    let bystander = tokio::spawn(async move {
        let body = json!({"messages": user("slow please"), "stream": true, "chat_template_kwargs": {"enable_thinking": false}});
        let r = http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .await;
        assemble(&sse_events(&r.text()), false)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let failed = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("explode")}),
        )
        .await;
    assert_eq!(failed.status, 500, "{}", failed.text());
    assert_eq!(failed.json()["error"]["type"], "server_error");
    let failed_stream = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("explode"), "stream": true}),
        )
        .await;
    let events = sse_events(&failed_stream.text());
    assert!(
        events
            .last()
            .is_some_and(|e| e["error"]["message"].is_string()),
        "a mid-stream error event: {events:?}"
    );
    let streamed = bystander.await.expect("bystander");
    assert_eq!(streamed.content, "fine ".repeat(200));
    assert_eq!(server.get("/health").await.status, 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_switches_and_budget() {
    let server = TestServer::demo().await;
    let prompt = |extra: Value| {
        let mut body = json!({"messages": user("hi")});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let addr = server.addr;
    let rendered = |body: Value| async move { rendered_prompt(addr, &body).await };
    assert!(
        rendered(prompt(json!({}))).await.ends_with("<think>\n"),
        "thinking is on by default"
    );
    for off in [
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        json!({"reasoning_effort": "none"}),
        json!({"enable_thinking": false}),
    ] {
        assert!(
            rendered(prompt(off.clone()))
                .await
                .ends_with("<think>\n\n</think>\n\n"),
            "{off}"
        );
    }
    // A budget of 3 reasoning tokens forces </think> after them.
    let response = server
        .chat(prompt(
            json!({"thinking_token_budget": 3, "max_tokens": 30, "temperature": 0}),
        ))
        .await;
    assert_eq!(
        response["usage"]["completion_tokens_details"]["reasoning_tokens"], 3,
        "{response}"
    );
    server.stop().await;
}

/// A backend that holds at most `capacity` sequences, as a GPU with fixed state slots does.
struct Limited {
    inner: Box<dyn lily::model::Backend>,
    capacity: usize,
    live: usize,
}

impl lily::model::Backend for Limited {
    fn config(&self) -> &lily::config::ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        format!("{} with {} slots", self.inner.device_name(), self.capacity)
    }
    fn create_sequence(&mut self, seq: u64) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.live < self.capacity,
            "all {} slots are in use",
            self.capacity
        );
        self.live += 1;
        self.inner.create_sequence(seq)
    }
    fn free_sequence(&mut self, seq: u64) {
        self.live -= 1;
        self.inner.free_sequence(seq)
    }
    fn forward(&mut self, seq: u64, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.inner.forward(seq, tokens)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_for_a_full_backend() {
    let mut opts = options();
    opts.backend = std::sync::Arc::new(|weights, _| {
        let inner = Box::new(lily::model::CpuBackend::new(weights));
        Ok(Box::new(Limited {
            inner,
            capacity: 2,
            live: 0,
        }) as Box<dyn lily::model::Backend>)
    });
    let server = TestServer::start(opts, None).await;
    let addr = server.addr;
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(async move {
                let body = json!({"messages": user(&format!("hi {i}")), "max_tokens": 30, "temperature": 0});
                http(addr, "POST", "/v1/chat/completions", &[], body.to_string().as_bytes()).await
            })
        })
        .collect();
    for task in tasks {
        let response = task.await.expect("client");
        assert_eq!(response.status, 200, "{}", response.text());
    }
    server.stop().await;
}

/// The prompt the server builds for a chat request, through /tokenize and /detokenize.
async fn rendered_prompt(addr: SocketAddr, body: &Value) -> String {
    let post = |path: &'static str, body: String| async move {
        http(addr, "POST", path, &[], body.as_bytes()).await.json()
    };
    let ids = post("/tokenize", body.to_string()).await["tokens"].clone();
    post("/detokenize", json!({"tokens": ids}).to_string()).await["prompt"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn the_binary_serves_the_demo_model_and_stops_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["serve", "--port", "0"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start lily serve");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let addr: SocketAddr = loop {
        let line = lines.next().expect("a log line").expect("read the log");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest
                .split(';')
                .next()
                .unwrap_or("")
                .parse()
                .expect("address");
        }
    };
    let ready_line = loop {
        let line = lines.next().expect("a log line").expect("read the log");
        if line.contains("ready: serving") {
            break line;
        }
    };
    assert!(ready_line.contains("lily-demo"), "{ready_line}");
    assert!(addr.ip().is_loopback(), "binds 127.0.0.1 by default");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let health = runtime.block_on(http(addr, "GET", "/health", &[], b""));
    assert_eq!(health.status, 200);
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = child.try_wait().expect("wait") {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "lily serve did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(exit.success(), "clean exit: {exit:?}");
}

/// Hundreds of requests of random lengths on the demo model, with the prefix cache on and a
/// quarter of the clients hanging up at a random moment: every other request completes, equal
/// greedy prompts get equal answers whether or not their state came from the cache, and the
/// engine ends where it started (nothing running or reserved, the cache within its budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_with_random_disconnects_ends_at_baseline() {
    use rand::RngExt;
    const NAME: &str = "lily-stress";
    const CACHE: u64 = 2 << 20;
    let mut opts = options();
    opts.served_model_name = NAME.into();
    opts.engine = EngineOptions {
        prefix_cache_bytes: CACHE,
        snapshot_interval: 64,
        ..EngineOptions::default()
    };
    let server = TestServer::start(opts, None).await;
    let addr = server.addr;
    let words = [
        "alpha", "beta", "gamma", "delta", "tool", "json", "why", "how",
    ];
    let repeated = ["Tell me about the weather.", "Count to five.", "Say hi."];
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(24));
    let mut tasks = Vec::new();
    for i in 0..240 {
        let mut rng = rand::rng();
        // A third repeat one of three greedy prompts; the rest are random text.
        let (text, greedy) = if i % 3 == 0 {
            (repeated[rng.random_range(0..3)].to_string(), true)
        } else {
            let n = rng.random_range(1..80);
            let text: Vec<&str> = (0..n)
                .map(|_| words[rng.random_range(0..words.len())])
                .collect();
            (text.join(" "), false)
        };
        let max_tokens = if greedy { 12 } else { rng.random_range(1..24) };
        let stream = rng.random_range(0..2) == 0;
        let hang_up = (!greedy && rng.random_range(0..4) == 0)
            .then(|| Duration::from_millis(rng.random_range(0..40)));
        let mut body = json!({
            "messages": [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": if greedy { 0.0 } else { 0.8 },
            "seed": i,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire().await.expect("gate");
            let bytes = request_bytes(
                addr,
                "POST",
                "/v1/chat/completions",
                &[],
                body.to_string().as_bytes(),
            );
            if let Some(after) = hang_up {
                let mut socket = TcpStream::connect(addr).await.expect("connect");
                socket.write_all(&bytes).await.expect("send");
                tokio::time::sleep(after).await;
                return None;
            }
            let r = http(
                addr,
                "POST",
                "/v1/chat/completions",
                &[],
                body.to_string().as_bytes(),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text());
            let (content, finish, usage) = if stream {
                let s = assemble(&sse_events(&r.text()), true);
                (
                    s.reasoning + &s.content,
                    s.finish_reason,
                    s.usage.expect("usage"),
                )
            } else {
                let v = r.json();
                let m = &v["choices"][0]["message"];
                let text = format!(
                    "{}{}",
                    m["reasoning_content"].as_str().unwrap_or(""),
                    m["content"].as_str().unwrap_or("")
                );
                (
                    text,
                    v["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    v["usage"].clone(),
                )
            };
            assert!(
                ["stop", "length"].contains(&finish.as_str()),
                "finish {finish}"
            );
            let completion = usage["completion_tokens"]
                .as_u64()
                .expect("completion tokens");
            assert!(completion <= max_tokens as u64);
            let cached = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached tokens");
            assert!(cached < usage["prompt_tokens"].as_u64().expect("prompt tokens"));
            greedy.then_some((text, content, cached))
        }));
    }
    let mut answers: std::collections::HashMap<String, String> = Default::default();
    let mut reused = 0;
    for task in tasks {
        if let Some((text, content, cached)) = task.await.expect("client task") {
            reused += cached;
            let first = answers
                .entry(text.clone())
                .or_insert_with(|| content.clone());
            assert_eq!(*first, content, "greedy answers to {text:?} differ");
        }
    }
    assert!(reused > 0, "repeated prompts reused no cached state");
    // Back to baseline. (Metrics are per process, so this server's series are told apart by
    // their model name.)
    let metric = |name: &'static str| async move {
        let text = http(addr, "GET", "/metrics", &[], b"").await.text();
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("model_name=\"{NAME}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} for {NAME}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric("vllm:num_requests_running").await + metric("vllm:num_requests_waiting").await
        > 0.0
    {
        assert!(Instant::now() < deadline, "requests still running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric("lily:reserved_state_bytes").await, 0.0);
    assert!(metric("lily:prefix_cache_bytes").await <= CACHE as f64);
    assert!(metric("vllm:prefix_cache_hits_total").await > 0.0);
    assert_eq!(server.get("/health").await.status, 200);
    server.stop().await;
}
