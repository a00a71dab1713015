//! `POST /v1/responses` over real TCP (`server_harness`): whole and streamed responses, usage,
//! tool calls and their results sent back, reasoning items, `text.format`, errors, disconnects.
//! The event contract checked here is openai-python's `types/responses/` (spec/API.md §2.12).

mod server_harness;

use std::collections::BTreeSet;
use std::time::Duration;

use rand::RngExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use server_harness::*;

async fn create(server: &TestServer, body: Value) -> Value {
    let r = server.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let response = r.json();
    assert_eq!(response["object"], "response");
    assert!(
        response["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("resp_")),
        "{response}"
    );
    response
}

/// A streamed response's events, after checking the framing: `event: TYPE` + `data: JSON` with
/// the same type, sequence numbers 0, 1, 2, ..., no `[DONE]`.
async fn create_stream(server: &TestServer, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let r = server.post("/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    let events = named_sse_events(&r.text());
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], json!(i), "{event}");
    }
    events
}

/// What a stream adds up to: the final response, after checking the events against it.
fn assemble(events: &[Value]) -> Value {
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(types[..2], ["response.created", "response.in_progress"]);
    assert_eq!(events[0]["response"]["status"], "in_progress");
    let last = events.last().expect("events");
    let response = last["response"].clone();
    assert!(
        ["response.completed", "response.incomplete"].contains(&types[types.len() - 1]),
        "{last}"
    );
    assert_eq!(
        response["id"], events[0]["response"]["id"],
        "one response id"
    );
    let output = response["output"].as_array().cloned().unwrap_or_default();
    // Rebuild each item from its events; it must equal the final item.
    let mut built: Vec<Value> = Vec::new();
    for event in &events[2..events.len() - 1] {
        let index = event["output_index"].as_u64().expect("output_index") as usize;
        match event["type"].as_str().unwrap_or("") {
            "response.output_item.added" => {
                assert_eq!(index, built.len(), "items are added in order");
                assert_eq!(event["item"]["status"], "in_progress");
                built.push(event["item"].clone());
            }
            "response.content_part.added" => built[index]["content"]
                .as_array_mut()
                .expect("content")
                .push(event["part"].clone()),
            "response.output_text.delta" | "response.reasoning_text.delta" => {
                let part = &mut built[index]["content"]
                    [event["content_index"].as_u64().unwrap_or(0) as usize];
                let text = format!(
                    "{}{}",
                    part["text"].as_str().unwrap_or(""),
                    event["delta"].as_str().expect("delta")
                );
                part["text"] = json!(text);
            }
            "response.function_call_arguments.delta" => {
                let text = format!(
                    "{}{}",
                    built[index]["arguments"].as_str().unwrap_or(""),
                    event["delta"].as_str().expect("delta")
                );
                built[index]["arguments"] = json!(text);
            }
            "response.output_text.done" | "response.reasoning_text.done" => {
                assert_eq!(event["text"], built[index]["content"][0]["text"], "{event}");
            }
            "response.function_call_arguments.done" => {
                assert_eq!(event["arguments"], built[index]["arguments"], "{event}");
            }
            "response.content_part.done" => assert_eq!(event["part"], built[index]["content"][0]),
            "response.output_item.done" => {
                let mut item = built[index].clone();
                item["status"] = event["item"]["status"].clone();
                assert_eq!(item, event["item"], "the item is what its events said");
                assert_eq!(
                    event["item"], output[index],
                    "the done item is the final one"
                );
            }
            other => panic!("unexpected event {other}"),
        }
        if let Some(id) = event.get("item_id") {
            assert_eq!(id, &built[index]["id"], "{event}");
        }
    }
    assert_eq!(built.len(), output.len());
    response
}

/// Text of the items of one type: `output_text` of messages, `reasoning_text` of reasoning.
fn text_of(response: &Value, item_type: &str) -> String {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == item_type)
        .flat_map(|item| item["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["text"].as_str().map(str::to_string))
        .collect()
}

/// The response with its ids and times taken out, for comparing two responses.
fn without_ids(response: &Value) -> Value {
    let mut r = response.clone();
    for key in ["id", "created_at", "completed_at"] {
        r[key] = Value::Null;
    }
    for item in r["output"].as_array_mut().into_iter().flatten() {
        item["id"] = Value::Null;
    }
    r
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_and_streamed_responses_agree_under_greedy_decoding() {
    let server = TestServer::demo().await;
    for effort in ["none", "high"] {
        let body = json!({
            "model": "lily-demo",
            "instructions": "Answer briefly.",
            "input": format!("Tell me about {}.", random_words(4)),
            "temperature": 0,
            "max_output_tokens": rand::rng().random_range(10..40),
            "reasoning": {"effort": effort},
            "metadata": {"run": random_words(1)},
        });
        let whole = create(&server, body.clone()).await;
        let streamed = assemble(&create_stream(&server, body.clone()).await);
        assert_eq!(
            without_ids(&streamed),
            without_ids(&whole),
            "effort {effort}"
        );
        let usage = &whole["usage"];
        assert_eq!(
            usage["total_tokens"],
            json!(
                usage["input_tokens"].as_u64().unwrap_or(0)
                    + usage["output_tokens"].as_u64().unwrap_or(0)
            )
        );
        if whole["status"] == "incomplete" {
            assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
            assert_eq!(usage["output_tokens"], body["max_output_tokens"]);
        }
        // The template starts the answer inside <think> unless thinking is off.
        assert_eq!(
            text_of(&whole, "reasoning").is_empty(),
            effort == "none",
            "effort {effort}: {whole}"
        );
        for key in ["instructions", "max_output_tokens", "reasoning", "metadata"] {
            assert_eq!(whole[key], body[key], "{key} is echoed");
        }
        assert_eq!(whole["temperature"].as_f64(), Some(0.0));
        assert_eq!(whole["tool_choice"], "auto");
        assert_eq!(whole["parallel_tool_calls"], true);
        assert_eq!(whole["store"], false);
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_and_reasoning_items_from_a_script() {
    let reply = format!("The {} is ready.", random_words(3));
    let script = format!("Thinking hard.\n</think>\n\n{reply}");
    let server = TestServer::scripted(json!({"default": script})).await;
    let question = format!("What about {}?", random_words(2));
    let response = create(&server, json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}], "instructions": "Be kind."})).await;
    assert_eq!(response["status"], "completed");
    let types: Vec<&str> = response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["type"].as_str())
        .collect();
    assert_eq!(types, ["reasoning", "message"]);
    assert_eq!(
        response["output"][0]["content"],
        json!([{"type": "reasoning_text", "text": "Thinking hard."}])
    );
    assert_eq!(response["output"][0]["summary"], json!([]));
    let message = &response["output"][1];
    assert_eq!(
        (&message["role"], &message["status"]),
        (&json!("assistant"), &json!("completed"))
    );
    assert_eq!(
        message["content"],
        json!([{"type": "output_text", "text": reply, "annotations": [], "logprobs": []}])
    );

    // The same prompt as the chat request it stands for.
    let chat_messages =
        json!([{"role": "system", "content": "Be kind."}, {"role": "user", "content": question}]);
    let prompt = server
        .post("/tokenize", &json!({"messages": chat_messages}))
        .await
        .json();
    let tokenizer = demo_tokenizer();
    let usage = &response["usage"];
    assert_eq!(usage["input_tokens"], prompt["count"]);
    let generated = tokenizer.encode(&script).expect("encode").len() + 1; // + <|im_end|>
    assert_eq!(usage["output_tokens"], json!(generated));
    let reasoning = tokenizer.encode("Thinking hard.\n").expect("encode").len();
    assert_eq!(
        usage["output_tokens_details"]["reasoning_tokens"],
        json!(reasoning)
    );
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);

    let events = create_stream(&server, json!({"input": question})).await;
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    let reasoning_deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(reasoning_deltas, "Thinking hard.");
    assert!(types.contains(&"response.reasoning_text.done"));
    let streamed = assemble(&events);
    assert_eq!(text_of(&streamed, "message"), reply);
    server.stop().await;
}

const WEATHER_CALLS: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";

fn weather_tools() -> Value {
    json!([{"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": false,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_calls_and_their_outputs_round_trip() {
    // The answer to the second turn depends on the tool output the client sends back.
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
    let body = json!({"input": [question], "tools": weather_tools()});
    let response = create(&server, body.clone()).await;
    assert_eq!(response["tools"], weather_tools(), "tools echoed as sent");
    let output = response["output"].as_array().cloned().unwrap_or_default();
    let types: Vec<&str> = output.iter().filter_map(|i| i["type"].as_str()).collect();
    assert_eq!(types, ["reasoning", "function_call", "function_call"]);
    let args: Vec<Value> = output[1..]
        .iter()
        .map(|call| {
            assert_eq!(call["name"], "get_weather");
            assert_eq!(call["status"], "completed");
            assert!(
                call["id"].as_str().is_some_and(|id| id.starts_with("fc_")),
                "{call}"
            );
            serde_json::from_str(call["arguments"].as_str().unwrap_or("")).expect("JSON arguments")
        })
        .collect();
    assert_eq!(
        args,
        [json!({"city": "Paris", "days": 3}), json!({"city": "Rome"})]
    );
    assert_ne!(output[1]["call_id"], output[2]["call_id"]);

    let streamed = assemble(&create_stream(&server, body.clone()).await);
    assert_eq!(
        without_ids(&streamed)["output"].as_array().map(|o| o
            .iter()
            .map(|i| {
                let mut i = i.clone();
                i["call_id"] = Value::Null;
                i
            })
            .collect::<Vec<_>>()),
        without_ids(&response)["output"].as_array().map(|o| o
            .iter()
            .map(|i| {
                let mut i = i.clone();
                i["call_id"] = Value::Null;
                i
            })
            .collect::<Vec<_>>())
    );

    // parallel_tool_calls: false stops after the first call.
    let mut single = body.clone();
    single["parallel_tool_calls"] = json!(false);
    let one = create(&server, single).await;
    assert_eq!(
        one["output"]
            .as_array()
            .map(|o| o.iter().filter(|i| i["type"] == "function_call").count()),
        Some(1)
    );
    assert_eq!(one["parallel_tool_calls"], false);

    // The client runs the calls and sends everything back, as the SDKs do: the output items as
    // they came, then one function_call_output per call.
    let mut input = vec![question.clone()];
    input.extend(output.iter().cloned());
    for call in &output[1..] {
        input.push(
            json!({"type": "function_call_output", "call_id": call["call_id"], "output": forecast}),
        );
    }
    let next = create(&server, json!({"input": input, "tools": weather_tools()})).await;
    assert_eq!(next["status"], "completed");
    assert_eq!(text_of(&next, "message"), format!("It is {forecast}."));
    // With preserve_thinking the reasoning item goes back into the prompt; without it the
    // template drops it.
    let input_tokens = |r: &Value| r["usage"]["input_tokens"].as_u64().unwrap_or(0);
    let kept = create(&server, json!({"input": input, "tools": weather_tools(), "chat_template_kwargs": {"preserve_thinking": true}})).await;
    let without: Vec<Value> = input
        .iter()
        .filter(|i| i["type"] != "reasoning")
        .cloned()
        .collect();
    let dropped = create(&server, json!({"input": without, "tools": weather_tools(), "chat_template_kwargs": {"preserve_thinking": true}})).await;
    assert!(
        input_tokens(&kept) > input_tokens(&dropped),
        "{} vs {}",
        input_tokens(&kept),
        input_tokens(&dropped)
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_forces_a_call_and_json_schema_output_validates() {
    // The demo model has random weights: only the grammar makes it call a tool or write JSON.
    let server = TestServer::demo().await;
    let seed = rand::rng().random_range(0..1000);
    let forced = create(&server, json!({
        "input": "weather?", "tools": weather_tools(), "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 1.0, "seed": seed, "max_output_tokens": 300, "reasoning": {"effort": "none"},
    }))
    .await;
    let call = forced["output"]
        .as_array()
        .and_then(|o| o.iter().find(|i| i["type"] == "function_call"))
        .cloned();
    assert_eq!(
        call.map(|c| c["name"].clone()),
        Some(json!("get_weather")),
        "{forced}"
    );
    assert_eq!(
        forced["tool_choice"],
        json!({"type": "function", "name": "get_weather"})
    );

    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": false
    });
    for (i, effort) in ["none", "low"].into_iter().enumerate() {
        let body = json!({
            "input": "Describe a person.", "temperature": 1.0, "seed": seed + i as i64, "max_output_tokens": 300,
            "text": {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": true}},
            "reasoning": {"effort": effort}, "thinking_token_budget": 5,
        });
        let response = create(&server, body).await;
        assert_eq!(response["status"], "completed", "{response}");
        let text = text_of(&response, "message");
        let value: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let keys: BTreeSet<&str> = value
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        assert_eq!(keys, BTreeSet::from(["age", "name"]), "{value}");
        assert!(
            value["name"]
                .as_str()
                .is_some_and(|n| n.chars().count() <= 12),
            "{value}"
        );
        assert!(value["age"].as_u64().is_some_and(|a| a <= 150), "{value}");
        assert_eq!(response["text"]["format"]["name"], "person", "text echoed");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_responses_field() {
    let mut opts = options();
    opts.api_key = Some("sekret".into());
    opts.max_body_bytes = 4096;
    opts.max_model_len = Some(512);
    let server = TestServer::start(opts, Some(json!({"default": "ok"}))).await;
    let post = |body: Vec<u8>, key: &'static str| {
        let addr = server.addr;
        async move {
            let auth = format!("Bearer {key}");
            http(
                addr,
                "POST",
                "/v1/responses",
                &[
                    ("authorization", auth.as_str()),
                    ("content-type", "application/json"),
                ],
                &body,
            )
            .await
        }
    };
    let check = |r: Response, status: u16, param: Option<&str>, code: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.text());
        let error = &r.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );
        assert_eq!(error["param"].as_str(), param, "{error}");
        if let Some(code) = code {
            assert_eq!(error["code"], code, "{error}");
        }
    };
    let bad = |body: Value| post(body.to_string().into_bytes(), "sekret");
    check(
        post(json!({"input": "hi"}).to_string().into_bytes(), "nope").await,
        401,
        None,
        Some("invalid_api_key"),
    );
    check(bad(json!({"input": 42})).await, 400, Some("input"), None);
    check(bad(json!({})).await, 400, Some("input"), None);
    check(
        bad(json!({"input": [{"type": "message", "role": "user", "content": 5}]})).await,
        400,
        Some("input[0].content"),
        None,
    );
    check(
        bad(json!({"input": [{"type": "function_call_output", "output": "x"}]})).await,
        400,
        Some("input[0].call_id"),
        None,
    );
    check(
        bad(json!({"input": [{"type": "item_reference", "id": "msg_1"}]})).await,
        400,
        Some("input[0]"),
        Some("unsupported_value"),
    );
    let stateful = bad(json!({"input": "hi", "previous_response_id": "resp_123"})).await;
    assert!(
        stateful.text().contains("not supported"),
        "{}",
        stateful.text()
    );
    check(
        stateful,
        400,
        Some("previous_response_id"),
        Some("unsupported_value"),
    );
    check(
        bad(json!({"model": "gpt-5", "input": "hi"})).await,
        404,
        Some("model"),
        Some("model_not_found"),
    );
    let tools = weather_tools();
    check(bad(json!({"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "nope"}})).await, 400, Some("tool_choice"), None);
    check(
        bad(json!({"input": "hi", "tools": tools, "tool_choice": "sometimes"})).await,
        400,
        Some("tool_choice"),
        None,
    );
    check(
        bad(json!({"input": "hi", "tool_choice": "required"})).await,
        400,
        Some("tool_choice"),
        None,
    );
    check(
        bad(json!({"input": "hi", "tools": [{"type": "web_search"}]})).await,
        400,
        Some("tools[0].type"),
        Some("unsupported_value"),
    );
    check(
        bad(json!({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]})).await,
        400,
        Some("tools[0].name"),
        None,
    );
    check(
        bad(json!({"input": "hi", "max_output_tokens": 0})).await,
        400,
        Some("max_output_tokens"),
        None,
    );
    check(
        bad(json!({"input": "hi", "max_output_tokens": 100_000})).await,
        400,
        Some("input"),
        Some("context_length_exceeded"),
    );
    check(
        bad(json!({"input": "hi", "temperature": "hot"})).await,
        400,
        Some("temperature"),
        None,
    );
    check(bad(json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}})).await, 400, Some("text.format.schema"), None);
    check(
        bad(json!({"input": "hi", "text": {"format": {"type": "yaml"}}})).await,
        400,
        Some("text.format"),
        None,
    );
    check(
        bad(json!({"input": "hi", "truncation": "auto"})).await,
        400,
        Some("truncation"),
        Some("unsupported_value"),
    );
    check(
        post(vec![b' '; 5000], "sekret").await,
        413,
        None,
        Some("request_too_large"),
    );
    // Accepted and ignored: store, include, unknown fields.
    let ok = bad(json!({"input": "hi", "store": true, "include": ["reasoning.encrypted_content"], "vendor_field": 1, "truncation": "disabled", "user": "u1"})).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(
        (ok.json()["store"].clone(), ok.json()["user"].clone()),
        (json!(false), json!("u1"))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_short_responses_are_incomplete_and_disconnects_stop_the_generation() {
    let long = "word ".repeat(5000);
    let server = TestServer::scripted(
        json!({"replies": [{"when": "long", "text": long}], "token_delay_ms": 2}),
    )
    .await;
    let limit = rand::rng().random_range(3..20);
    let body = json!({"input": "long please", "max_output_tokens": limit, "reasoning": {"effort": "none"}});
    let whole = create(&server, body.clone()).await;
    assert_eq!(whole["status"], "incomplete");
    assert_eq!(
        whole["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(whole["output"][0]["status"], "incomplete");
    assert_eq!(whole["usage"]["output_tokens"], json!(limit));
    let events = create_stream(&server, body).await;
    assert_eq!(
        events.last().map(|e| e["type"].clone()),
        Some(json!("response.incomplete"))
    );
    assert_eq!(
        without_ids(&assemble(&events))["output"],
        without_ids(&whole)["output"]
    );

    let body = json!({"input": "long please", "stream": true, "reasoning": {"effort": "none"}});
    let mut socket = TcpStream::connect(server.addr).await.expect("connect");
    socket
        .write_all(&request_bytes(
            server.addr,
            "POST",
            "/v1/responses",
            &[],
            body.to_string().as_bytes(),
        ))
        .await
        .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen)
        .matches("response.output_text.delta")
        .count()
        < 10
    {
        let n = socket.read(&mut buf).await.expect("read");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        server.metric("vllm:num_requests_running").await,
        1.0,
        "generating"
    );
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
