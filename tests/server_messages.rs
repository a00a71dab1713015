//! `POST /v1/messages` and `/v1/messages/count_tokens` over real TCP (`server_harness`): whole
//! and streamed messages, usage, thinking and tool_use blocks, tool results sent back, stop
//! sequences, Anthropic-shaped errors, disconnects. The shapes checked here are those of
//! anthropic-python's `types/` (spec/API.md §1 row 20).

mod server_harness;

use std::time::Duration;

use rand::RngExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use server_harness::*;

async fn create(server: &TestServer, body: Value) -> Value {
    let r = server.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let message = r.json();
    assert_eq!(
        (&message["type"], &message["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert!(
        message["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("msg_")),
        "{message}"
    );
    message
}

/// A streamed message's events, after checking the framing: `event: TYPE` + `data: JSON` with
/// the same type, no `[DONE]`.
async fn create_stream(server: &TestServer, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let r = server.post("/v1/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    named_sse_events(&r.text())
        .into_iter()
        .filter(|event| event["type"] != "ping")
        .collect()
}

/// The message a stream adds up to, built as Anthropic's SDKs build it, after checking the order
/// of the events: message_start, per block start, deltas, stop, then message_delta and
/// message_stop.
fn assemble(events: &[Value]) -> Value {
    assert_eq!(events[0]["type"], "message_start");
    let mut message = events[0]["message"].clone();
    assert_eq!(message["content"], json!([]));
    assert_eq!(message["stop_reason"], Value::Null);
    let mut json_text: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    let n = events.len();
    for event in &events[1..n - 2] {
        let index = event["index"].as_u64().expect("index") as usize;
        let content = message["content"].as_array_mut().expect("content");
        match event["type"].as_str().unwrap_or("") {
            "content_block_start" => {
                assert_eq!((open, index), (None, content.len()), "blocks open in order");
                content.push(event["content_block"].clone());
                json_text.push(String::new());
                open = Some(index);
            }
            "content_block_delta" => {
                assert_eq!(open, Some(index), "a delta of the open block");
                let (delta, block) = (&event["delta"], &mut content[index]);
                let append = |block: &mut Value, field: &str, more: &Value| {
                    let text = format!(
                        "{}{}",
                        block[field].as_str().expect("text field"),
                        more.as_str().expect("delta text")
                    );
                    block[field] = json!(text);
                };
                match (delta["type"].as_str().unwrap_or(""), block["type"].as_str()) {
                    ("text_delta", Some("text")) => append(block, "text", &delta["text"]),
                    ("thinking_delta", Some("thinking")) => {
                        append(block, "thinking", &delta["thinking"])
                    }
                    ("input_json_delta", Some("tool_use")) => {
                        json_text[index].push_str(delta["partial_json"].as_str().expect("json"))
                    }
                    other => panic!("delta {other:?} does not fit its block"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open, Some(index));
                open = None;
                if content[index]["type"] == "tool_use" && !json_text[index].is_empty() {
                    content[index]["input"] =
                        serde_json::from_str(&json_text[index]).expect("input JSON");
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(open, None, "every block is closed");
    assert_eq!(events[n - 2]["type"], "message_delta");
    assert_eq!(events[n - 1], json!({"type": "message_stop"}));
    let delta = &events[n - 2];
    message["stop_reason"] = delta["delta"]["stop_reason"].clone();
    message["stop_sequence"] = delta["delta"]["stop_sequence"].clone();
    for (key, value) in delta["usage"].as_object().into_iter().flatten() {
        message["usage"][key] = value.clone();
    }
    message
}

/// The message with its ids taken out, and its input counted whole (a repeated prompt is read
/// from the prefix cache the second time).
fn comparable(message: &Value) -> Value {
    let mut m = message.clone();
    m["id"] = Value::Null;
    for block in m["content"].as_array_mut().into_iter().flatten() {
        if block.get("id").is_some() {
            block["id"] = Value::Null;
        }
    }
    m["usage"] =
        json!({"input": total_input(message), "output": message["usage"]["output_tokens"]});
    m
}

fn total_input(message: &Value) -> u64 {
    let usage = &message["usage"];
    [
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ]
    .iter()
    .map(|k| usage[*k].as_u64().expect("a count"))
    .sum()
}

fn text_of(message: &Value, block_type: &str) -> String {
    let field = if block_type == "thinking" {
        "thinking"
    } else {
        "text"
    };
    message["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == block_type)
        .filter_map(|b| b[field].as_str())
        .collect()
}

fn random_words(n: usize) -> String {
    const WORDS: [&str; 8] = [
        "river", "stone", "lamp", "orbit", "maple", "violet", "harbor", "echo",
    ];
    let mut rng = rand::rng();
    (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

async fn count_tokens(server: &TestServer, body: Value) -> u64 {
    let r = server.post("/v1/messages/count_tokens", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["input_tokens"].as_u64().expect("input_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_and_streamed_messages_agree_under_greedy_decoding() {
    let server = TestServer::demo().await;
    for thinking in [
        json!({"type": "disabled"}),
        json!({"type": "enabled", "budget_tokens": 8}),
    ] {
        let body = json!({
            "model": "lily-demo",
            "system": "Answer briefly.",
            "messages": [{"role": "user", "content": format!("Tell me about {}.", random_words(4))}],
            "temperature": 0,
            "max_tokens": rand::rng().random_range(10..40),
            "thinking": thinking,
            "metadata": {"user_id": random_words(1)},
        });
        let whole = create(&server, body.clone()).await;
        let streamed = assemble(&create_stream(&server, body.clone()).await);
        assert_eq!(comparable(&streamed), comparable(&whole), "{thinking}");
        assert_eq!(whole["model"], "lily-demo");
        assert_eq!(whole["usage"]["cache_creation_input_tokens"], 0);
        assert_eq!(
            total_input(&whole),
            count_tokens(&server, body.clone()).await
        );
        if whole["stop_reason"] == "max_tokens" {
            assert_eq!(whole["usage"]["output_tokens"], body["max_tokens"]);
        } else {
            assert_eq!(whole["stop_reason"], "end_turn", "{whole}");
        }
        assert_eq!(whole["stop_sequence"], Value::Null);
        // The template starts the answer inside <think> unless thinking is off.
        let thinks = whole["content"][0]["type"] == "thinking";
        assert_eq!(thinks, thinking["type"] == "enabled", "{whole}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_and_thinking_blocks_from_a_script() {
    let reply = format!("The {} is ready.", random_words(3));
    let script = format!("Thinking hard.\n</think>\n\n{reply}");
    let server = TestServer::scripted(json!({"default": script})).await;
    let question = format!("What about {}?", random_words(2));
    let body = json!({
        "max_tokens": 500,
        "system": [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
    });
    let message = create(&server, body.clone()).await;
    assert_eq!(
        message["content"],
        json!([
            {"type": "thinking", "thinking": "Thinking hard.", "signature": ""},
            {"type": "text", "text": reply},
        ])
    );
    assert_eq!(message["stop_reason"], "end_turn");

    // The prompt is the one of the chat request it stands for.
    let chat_messages =
        json!([{"role": "system", "content": "Be kind."}, {"role": "user", "content": question}]);
    let prompt = server
        .post("/tokenize", &json!({"messages": chat_messages}))
        .await
        .json();
    assert_eq!(
        json!(count_tokens(&server, body.clone()).await),
        prompt["count"]
    );
    assert_eq!(json!(total_input(&message)), prompt["count"]);
    let generated = demo_tokenizer().encode(&script).expect("encode").len() + 1; // + <|im_end|>
    assert_eq!(message["usage"]["output_tokens"], json!(generated));

    let events = create_stream(&server, body).await;
    let thinking: String = events
        .iter()
        .filter(|e| e["delta"]["type"] == "thinking_delta")
        .filter_map(|e| e["delta"]["thinking"].as_str())
        .collect();
    assert_eq!(thinking, "Thinking hard.");
    let start = &events[0]["message"];
    assert_eq!(
        total_input(start),
        total_input(&message),
        "message_start counts the prompt"
    );
    assert_eq!(start["usage"]["output_tokens"], 0);
    let streamed = assemble(&events);
    assert_eq!(comparable(&streamed), comparable(&message));
    assert_eq!(text_of(&streamed, "text"), reply);
    server.stop().await;
}

const WEATHER_CALLS: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";

fn weather_tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_use_blocks_and_tool_results_round_trip() {
    // The answer to the second turn depends on the tool result the client sends back.
    let forecast = format!(
        "{} degrees and {}",
        rand::rng().random_range(-20..40),
        random_words(1)
    );
    let server = TestServer::scripted(json!({"replies": [
        {"when": forecast, "text": format!("Noted.\n</think>\n\nIt is {forecast}.")},
        {"when": "weather", "text": WEATHER_CALLS},
    ]}))
    .await;
    let question = json!({"role": "user", "content": "What is the weather in Paris and Rome?"});
    let body = json!({"max_tokens": 1000, "messages": [question], "tools": weather_tools()});
    let message = create(&server, body.clone()).await;
    assert_eq!(message["stop_reason"], "tool_use");
    let content = message["content"].as_array().cloned().unwrap_or_default();
    let types: Vec<&str> = content.iter().filter_map(|b| b["type"].as_str()).collect();
    assert_eq!(types, ["thinking", "tool_use", "tool_use"]);
    let inputs: Vec<&Value> = content[1..].iter().map(|b| &b["input"]).collect();
    assert_eq!(
        inputs,
        [
            &json!({"city": "Paris", "days": 3}),
            &json!({"city": "Rome"})
        ]
    );
    for call in &content[1..] {
        assert_eq!(call["name"], "get_weather");
        assert!(
            call["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("toolu_")),
            "{call}"
        );
    }
    assert_ne!(content[1]["id"], content[2]["id"]);

    let streamed = assemble(&create_stream(&server, body.clone()).await);
    assert_eq!(comparable(&streamed), comparable(&message));

    // disable_parallel_tool_use stops after the first call.
    let mut single = body.clone();
    single["tool_choice"] = json!({"type": "auto", "disable_parallel_tool_use": true});
    let one = create(&server, single).await;
    let calls = one["content"]
        .as_array()
        .map(|c| c.iter().filter(|b| b["type"] == "tool_use").count());
    assert_eq!((calls, &one["stop_reason"]), (Some(1), &json!("tool_use")));

    // The client sends the assistant turn back as it came, then one tool_result per call.
    let results: Vec<Value> = content[1..]
        .iter()
        .map(|call| json!({"type": "tool_result", "tool_use_id": call["id"], "content": [{"type": "text", "text": forecast}]}))
        .collect();
    let turns = json!([question, {"role": "assistant", "content": content}, {"role": "user", "content": results}]);
    let next = create(
        &server,
        json!({"max_tokens": 1000, "messages": turns, "tools": weather_tools()}),
    )
    .await;
    assert_eq!(next["stop_reason"], "end_turn");
    assert_eq!(text_of(&next, "text"), format!("It is {forecast}."));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sequences_are_reported() {
    let stop = format!("<{}>", random_words(1).to_uppercase());
    let before = format!("Hello {}", random_words(2));
    let server = TestServer::scripted(
        json!({"default": format!("Hm.\n</think>\n\n{before}{stop} and more after it.")}),
    )
    .await;
    let body = json!({"max_tokens": 200, "stop_sequences": ["NEVER SEEN", stop],
        "messages": [{"role": "user", "content": "hi"}]});
    let message = create(&server, body.clone()).await;
    assert_eq!(
        (&message["stop_reason"], &message["stop_sequence"]),
        (&json!("stop_sequence"), &json!(stop))
    );
    assert_eq!(text_of(&message, "text"), before);
    let streamed = assemble(&create_stream(&server, body).await);
    assert_eq!(comparable(&streamed), comparable(&message));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_anthropics_shape() {
    let mut opts = options();
    opts.api_key = Some("sekret".into());
    opts.max_body_bytes = 4096;
    opts.max_model_len = Some(512);
    let server = TestServer::start(opts, Some(json!({"default": "ok"}))).await;
    let post = |path: &'static str, body: Vec<u8>, auth: (&'static str, &'static str)| {
        let addr = server.addr;
        async move {
            let mut headers = vec![
                ("content-type", "application/json"),
                ("anthropic-version", "2023-06-01"),
            ];
            if !auth.0.is_empty() {
                headers.push(auth);
            }
            http(addr, "POST", path, &headers, &body).await
        }
    };
    let key = ("x-api-key", "sekret");
    let check = |r: Response, status: u16, kind: &str, mentions: &str| {
        assert_eq!(r.status, status, "{}", r.text());
        let body = r.json();
        assert_eq!(body["type"], "error", "{body}");
        assert_eq!(body["error"]["type"], kind, "{body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.contains(mentions),
            "{message:?} should mention {mentions:?}"
        );
        assert_eq!(
            body["error"].as_object().map(|e| e.len()),
            Some(2),
            "{body}"
        );
    };
    let hi = json!([{"role": "user", "content": "hi"}]);
    let bad = |body: Value| post("/v1/messages", body.to_string().into_bytes(), key);
    let ok_body = json!({"max_tokens": 5, "messages": hi})
        .to_string()
        .into_bytes();
    for auth in [
        ("", ""),
        ("x-api-key", "nope"),
        ("authorization", "Bearer nope"),
    ] {
        check(
            post("/v1/messages", ok_body.clone(), auth).await,
            401,
            "authentication_error",
            "x-api-key",
        );
    }
    for auth in [key, ("authorization", "Bearer sekret")] {
        let r = post("/v1/messages", ok_body.clone(), auth).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    check(
        bad(json!({"messages": hi})).await,
        400,
        "invalid_request_error",
        "max_tokens",
    );
    check(
        bad(json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]})).await,
        400,
        "invalid_request_error",
        "role",
    );
    let image = json!([{"role": "user", "content": [{"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]);
    check(
        bad(json!({"max_tokens": 5, "messages": image})).await,
        400,
        "invalid_request_error",
        "vision",
    );
    check(
        bad(json!({"model": "claude-opus-4-1", "max_tokens": 5, "messages": hi})).await,
        404,
        "not_found_error",
        "claude-opus-4-1",
    );
    check(
        bad(json!({"max_tokens": 5, "messages": hi, "tool_choice": {"type": "tool", "name": "nope"}, "tools": weather_tools()})).await,
        400,
        "invalid_request_error",
        "nope",
    );
    check(
        bad(json!({"max_tokens": 100_000, "messages": hi})).await,
        400,
        "invalid_request_error",
        "maximum context length",
    );
    let long = json!([{"role": "user", "content": "word ".repeat(700)}]);
    check(
        bad(json!({"max_tokens": 5, "messages": long})).await,
        400,
        "invalid_request_error",
        "maximum context length",
    );
    check(
        post("/v1/messages", vec![b' '; 5000], key).await,
        413,
        "request_too_large",
        "4096",
    );
    check(
        post("/v1/messages/count_tokens", b"{".to_vec(), key).await,
        400,
        "invalid_request_error",
        "JSON",
    );
    check(
        post("/v1/messages/batches", b"{}".to_vec(), key).await,
        404,
        "not_found_error",
        "/v1/messages/batches",
    );
    // Accepted and ignored: metadata, cache_control, unknown fields.
    let extra = json!({"max_tokens": 5, "metadata": {"user_id": "u1"}, "service_tier": "auto", "vendor": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]});
    let r = bad(extra).await;
    assert_eq!(r.status, 200, "{}", r.text());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_matches_the_rendered_prompt() {
    let server = TestServer::demo().await;
    let system = random_words(5);
    let question = random_words(rand::rng().random_range(3..30));
    let body = json!({"model": "lily-demo", "system": system, "tools": weather_tools(),
        "messages": [{"role": "user", "content": question}], "thinking": {"type": "disabled"}});
    let chat = json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": weather_tools()[0]["input_schema"]}}],
        "chat_template_kwargs": {"enable_thinking": false}});
    let prompt = server.post("/tokenize", &chat).await.json();
    assert_eq!(
        json!(count_tokens(&server, body.clone()).await),
        prompt["count"]
    );
    let mut without_tools = body.clone();
    without_tools["tools"] = json!([]);
    assert!(count_tokens(&server, without_tools).await < count_tokens(&server, body).await);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_is_overloaded_and_a_disconnect_stops_the_generation() {
    let long = "word ".repeat(5000);
    let mut opts = options();
    opts.max_in_flight = 1;
    let script = json!({"replies": [{"when": "long", "text": long}], "token_delay_ms": 2});
    let server = TestServer::start(opts, Some(script)).await;
    let body = json!({"max_tokens": 8000, "stream": true, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "long please"}]});
    let mut socket = TcpStream::connect(server.addr).await.expect("connect");
    socket
        .write_all(&request_bytes(
            server.addr,
            "POST",
            "/v1/messages",
            &[],
            body.to_string().as_bytes(),
        ))
        .await
        .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("text_delta").count() < 10 {
        let n = socket.read(&mut buf).await.expect("read");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        server.metric("vllm:num_requests_running").await,
        1.0,
        "generating"
    );
    let hi = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let busy = server.post("/v1/messages", &hi).await;
    assert_eq!(
        (busy.status, busy.header("retry-after").as_deref()),
        (503, Some("1"))
    );
    assert_eq!(busy.json()["error"]["type"], "overloaded_error");
    drop(socket);
    assert!(
        idle(&server, Duration::from_secs(3)).await,
        "the slot was not freed"
    );
    let generated = server.metric("vllm:generation_tokens_total").await;
    assert!(
        generated < 2000.0,
        "stopped long before the end ({generated} tokens)"
    );
    server.stop().await;
}
