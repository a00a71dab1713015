//! Random bad input against every generating endpoint: valid requests with fields replaced by
//! values of the wrong type, out of range or absurd, added unknown fields, broken bytes. Whatever
//! arrives, the server answers with a success or a client error whose body says what is wrong —
//! never a 5xx, a dropped connection or a hang — and stays healthy and idle afterwards.
//!
//! The inputs come from a seeded generator (the seed is printed; LILY_TEST_SEED repeats a run).
//! The scripted backend makes each request cheap; a smaller round runs on the demo model, whose
//! requests reach real sampling and generation.

mod common;
mod server_harness;

use std::time::Duration;

use serde_json::{json, Map, Value};

use common::Rng;
use server_harness::*;

/// Per request: anything slower is reported as a hang.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A valid request for each endpoint, with the model filled in.
fn valid(path: &str, model: &str) -> Value {
    match path {
        "/v1/chat/completions" => json!({
            "model": model,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}
            ],
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "stream": false,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
        }),
        "/v1/completions" => {
            json!({"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0.5})
        }
        "/v1/responses" => json!({"model": model, "input": "hello", "max_output_tokens": 4}),
        "/v1/messages" => json!({
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]
        }),
        other => panic!("no request for {other}"),
    }
}

/// A value of some other type or an absurd one.
fn odd_value(rng: &mut Rng) -> Value {
    let long = "x".repeat(20_000);
    let deep = (0..300).fold(json!(1), |v, _| json!([v]));
    let options = [
        Value::Null,
        json!(true),
        json!(false),
        json!(-1),
        json!(0),
        json!(1),
        json!(2.5),
        json!(-1e300),
        json!(1e300),
        json!(9_007_199_254_740_993u64),
        json!(-9_223_372_036_854_775_808i64),
        json!(""),
        json!("x"),
        json!("\u{0}"),
        json!("\u{fffd}\u{202e}"),
        json!(long),
        json!([]),
        json!([1, "a", null]),
        json!({}),
        json!({"type": "nonsense"}),
        json!([{"role": "user"}]),
        json!([{"type": "image_url", "image_url": {"url": "x"}}]),
        json!([4_294_967_295u64, 0]),
        json!([-5]),
        json!([[1, 2], [3]]),
        json!([{"role": "tool", "content": "x"}]),
        json!([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
        json!({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}),
        json!({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "minItems": 1000000}}}),
        deep,
    ];
    options[rng.below(options.len())].clone()
}

/// Fields the endpoints read (and some they do not), for replacing or adding.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "reasoning_effort",
    "chat_template_kwargs",
    "user",
    "echo",
    "suffix",
    "system",
    "instructions",
    "text",
    "thinking",
    "metadata",
    "prompt_cache_key",
    "best_of",
    "unknown_field_xyz",
];

/// The valid request with one to three mutations: a field replaced or added, a message or
/// content part replaced, a field removed.
fn mutate(rng: &mut Rng, mut body: Value) -> Value {
    for _ in 0..1 + rng.below(3) {
        let obj: &mut Map<String, Value> = body.as_object_mut().expect("an object");
        match rng.below(4) {
            0 | 1 => {
                let field = FIELDS[rng.below(FIELDS.len())];
                obj.insert(field.into(), odd_value(rng));
            }
            2 => {
                if let Some(Value::Array(messages)) = obj.get_mut("messages") {
                    if !messages.is_empty() {
                        let i = rng.below(messages.len());
                        let key =
                            ["role", "content", "name", "tool_calls", "tool_call_id"][rng.below(5)];
                        match messages[i].as_object_mut() {
                            Some(m) if rng.below(3) > 0 => {
                                m.insert(key.into(), odd_value(rng));
                            }
                            _ => messages[i] = odd_value(rng),
                        }
                    }
                }
            }
            _ => {
                let keys: Vec<String> = obj.keys().cloned().collect();
                let key = &keys[rng.below(keys.len())];
                obj.remove(key);
            }
        }
    }
    body
}

/// Bytes that are not a JSON request at all.
fn broken_bytes(rng: &mut Rng, valid: &Value) -> Vec<u8> {
    let text = valid.to_string();
    match rng.below(4) {
        0 => text.as_bytes()[..rng.below(text.len())].to_vec(),
        1 => {
            let mut b = text.into_bytes();
            let at = rng.below(b.len());
            b[at] = 0xFF; // invalid UTF-8
            b
        }
        2 => b"{\"messages\": [".repeat(1 + rng.below(50)),
        _ => (0..rng.below(2000)).map(|_| rng.next_u64() as u8).collect(),
    }
}

/// Sends `body` and checks the answer: a success, or a client error with a message.
async fn check(server: &TestServer, path: &str, body: &[u8], what: &str) -> u16 {
    let headers = [("content-type", "application/json")];
    let answer =
        tokio::time::timeout(TIMEOUT, http(server.addr, "POST", path, &headers, body)).await;
    let r = answer.unwrap_or_else(|_| panic!("{what}: no answer within {TIMEOUT:?}"));
    assert!(r.status < 500, "{what}: status {} — {}", r.status, r.text());
    if r.status >= 400 {
        let error = r.json();
        let message = error["error"]["message"]
            .as_str()
            .or(error["error"].as_str())
            .unwrap_or_default();
        assert!(
            !message.is_empty(),
            "{what}: an error without a message: {error}"
        );
    } else if r.header("content-type").as_deref() == Some("text/event-stream") {
        // A stream is framed to its end, which says how it ended (the helpers check the framing).
        let text = r.text();
        if path.ends_with("completions") {
            sse_events(&text);
        } else {
            let events = named_sse_events(&text);
            let last = events
                .last()
                .and_then(|e| e["type"].as_str())
                .unwrap_or_default();
            let ends = [
                "response.completed",
                "response.incomplete",
                "response.failed",
                "message_stop",
                "error",
            ];
            assert!(
                ends.contains(&last),
                "{what}: the stream ended with {last:?}"
            );
        }
    } else {
        assert!(r.json().is_object(), "{what}: {}", r.text());
    }
    r.status
}

async fn fuzz(server: &TestServer, model: &str, rng: &mut Rng, rounds: usize) -> (usize, usize) {
    let paths = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    ];
    let (mut ok, mut rejected) = (0, 0);
    for round in 0..rounds {
        let path = paths[rng.below(paths.len())];
        let valid = valid(path, model);
        let (body, kind) = if rng.below(8) == 0 {
            (broken_bytes(rng, &valid), "bytes")
        } else {
            (mutate(rng, valid).to_string().into_bytes(), "json")
        };
        let what = format!(
            "round {round}, {path}, {kind}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        );
        if check(server, path, &body, &what).await < 400 {
            ok += 1;
        } else {
            rejected += 1;
        }
    }
    (ok, rejected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bad_requests_get_client_errors_and_leave_the_server_healthy() {
    let mut rng = Rng::new("server fuzz");
    let scripted = TestServer::scripted(json!({"default": "ok"})).await;
    let (ok, rejected) = fuzz(&scripted, DEMO_MODEL, &mut rng, 400).await;
    println!("scripted: {ok} answered, {rejected} rejected");
    assert_eq!(scripted.get("/health").await.status, 200);
    assert!(
        idle(&scripted, Duration::from_secs(10)).await,
        "requests left running"
    );
    scripted.stop().await;

    // The demo model with a 2K context: the 20K-character strings among the odd values are then
    // prompts too long (a clear 400), not minutes of CPU prefill that a loaded 2-core machine
    // cannot finish within TIMEOUT (what failed 9 of 40 seeds in the dev profile).
    let mut options = server_harness::options();
    options.max_model_len = Some(2048);
    let demo = TestServer::start(options, None).await;
    let (ok, rejected) = fuzz(&demo, DEMO_MODEL, &mut rng, 120).await;
    println!("demo model: {ok} answered, {rejected} rejected");
    assert_eq!(demo.get("/health").await.status, 200);
    assert!(
        idle(&demo, Duration::from_secs(10)).await,
        "requests left running"
    );
    // And it still answers a plain request.
    let answer = demo.chat(valid("/v1/chat/completions", DEMO_MODEL)).await;
    assert!(answer["choices"][0]["message"].is_object(), "{answer}");
    demo.stop().await;
}

/// A model reply made of random pieces of the markup the output parsers look for (reasoning,
/// tool calls in Qwen's XML form, JSON), partial tags, control and multi-byte characters.
fn random_reply(rng: &mut Rng) -> String {
    let pieces = [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=f>",
        "<function=nope>",
        "<function=",
        "<parameter=a>",
        "<parameter=",
        "</parameter>",
        "</function>",
        "<tool_",
        "</tool",
        "<",
        ">",
        "{\"name\": \"f\", \"arguments\": {",
        "}",
        "\"",
        "\n",
        "\n\n",
        " ",
        "ok",
        "é",
        "漢字",
        "🙂",
        "\u{0}",
        "\u{202e}",
        "\\",
        "<|im_start|>",
        "null",
        "[1, 2",
        "{\"a\": \"b\"}",
    ];
    (0..rng.below(40))
        .map(|_| pieces[rng.below(pieces.len())])
        .collect()
}

/// Random model outputs through every endpoint, streamed and whole, with a tool on offer: the
/// reasoning and tool-call parsers take whatever the model says (a malformed call stays text or
/// is reported in the response), so each request answers 200 with a response framed to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_model_outputs_are_answered_whole() {
    let mut rng = Rng::new("output fuzz");
    let cases = 150;
    let replies: Vec<Value> = (0..cases)
        .map(|i| json!({"when": format!("case{i:03}x"), "text": random_reply(&mut rng)}))
        .collect();
    let server = TestServer::scripted(json!({"replies": replies, "default": "?"})).await;
    let paths = ["/v1/chat/completions", "/v1/responses", "/v1/messages"];
    for (i, reply) in replies.iter().enumerate() {
        let path = paths[rng.below(paths.len())];
        let mut body = valid(path, DEMO_MODEL);
        let ask = format!("case{i:03}x");
        match path {
            "/v1/chat/completions" => body["messages"] = json!([{"role": "user", "content": ask}]),
            "/v1/responses" => {
                body["input"] = json!(ask);
                body["tools"] = json!([{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}]);
            }
            _ => {
                body["messages"] = json!([{"role": "user", "content": ask}]);
                body["tools"] = json!([{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}]);
            }
        }
        // Enough tokens for the reply, whichever endpoint's field counts them.
        for field in ["max_tokens", "max_output_tokens"] {
            if body.get(field).is_some() {
                body[field] = json!(4096);
            }
        }
        body["stream"] = json!(rng.below(2) == 0);
        let what = format!(
            "case {i}, {path}, stream {}: reply {:?}",
            body["stream"], reply["text"]
        );
        let status = check(&server, path, body.to_string().as_bytes(), &what).await;
        assert_eq!(status, 200, "{what}");
    }
    assert!(
        idle(&server, Duration::from_secs(10)).await,
        "requests left running"
    );
    server.stop().await;
}

const DEMO_MODEL: &str = lily::server::DEMO_MODEL_NAME;
