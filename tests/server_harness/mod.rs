//! A `lily serve` per test over real TCP on 127.0.0.1, and a raw HTTP/1.1 client (so that what
//! is checked is exactly what goes over the wire, and a client can hang up mid-response). Shared
//! by the server test files.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use lily::engine::EngineOptions;
use lily::server::{self, cpu_backend, ModelSource, ServeOptions, DEMO_MODEL_NAME};
use lily::tokenizer::Tokenizer;

// ---------------------------------------------------------------------------------------------
// A server per test
// ---------------------------------------------------------------------------------------------

pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Keeps the script file alive.
    _script: Option<tempfile::NamedTempFile>,
}

pub fn options() -> ServeOptions {
    ServeOptions {
        source: ModelSource::Demo,
        served_model_name: DEMO_MODEL_NAME.into(),
        aliases: Vec::new(),
        host: "127.0.0.1".into(),
        port: 0,
        api_key: None,
        max_model_len: None,
        backend: cpu_backend(),
        max_body_bytes: 1 << 20,
        max_in_flight: 256,
        scripted: None,
        shutdown_grace: Duration::from_secs(2),
        engine: EngineOptions::default(),
    }
}

impl TestServer {
    pub async fn start(mut options: ServeOptions, script: Option<Value>) -> TestServer {
        let file = script.map(|s| {
            let file = tempfile::NamedTempFile::new().expect("temp file");
            std::fs::write(file.path(), s.to_string()).expect("write the script");
            file
        });
        options.scripted = file.as_ref().map(|f| f.path().to_path_buf());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(listener, options, async {
            let _ = stopped.await;
        }));
        let server = TestServer {
            addr,
            stop: Some(stop),
            task: Some(task),
            _script: file,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if server.get("/health").await.status == 200 {
                return server;
            }
            assert!(Instant::now() < deadline, "the server did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn scripted(script: Value) -> TestServer {
        TestServer::start(options(), Some(script)).await
    }

    pub async fn demo() -> TestServer {
        TestServer::start(options(), None).await
    }

    pub async fn get(&self, path: &str) -> Response {
        http(self.addr, "GET", path, &[], b"").await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Response {
        http(
            self.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
        .await
    }

    pub async fn chat(&self, body: Value) -> Value {
        let r = self.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    /// A streamed chat: the JSON of every `data:` event before `[DONE]` (which must end it).
    pub async fn chat_stream(&self, mut body: Value) -> Vec<Value> {
        body["stream"] = json!(true);
        let r = self.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("text/event-stream")
        );
        sse_events(&r.text())
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").await.text();
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let result = tokio::time::timeout(Duration::from_secs(10), task).await;
            assert!(
                matches!(result, Ok(Ok(Ok(())))),
                "the server did not stop cleanly"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A minimal HTTP/1.1 client
// ---------------------------------------------------------------------------------------------

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

pub fn request_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(&request_bytes(addr, method, path, headers, body))
        .await
        .expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Response {
        status,
        headers,
        body,
    }
}

pub fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            std::str::from_utf8(&data[..eol])
                .expect("chunk size")
                .trim(),
            16,
        )
        .expect("hex size");
        if size == 0 {
            break;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[eol + 2 + size + 2..];
    }
    out
}

/// The `data:` payloads of an SSE body, checking the framing: events separated by blank lines,
/// `[DONE]` exactly once and last, comments (`: ping`) allowed.
pub fn sse_events(body: &str) -> Vec<Value> {
    let mut events = Vec::new();
    let mut done = false;
    for block in body.split("\n\n").filter(|b| !b.is_empty()) {
        if block.starts_with(':') {
            continue;
        }
        let data = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data event: {block:?}"));
        assert!(!done, "an event after [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(
                serde_json::from_str(data)
                    .unwrap_or_else(|e| panic!("bad event JSON ({e}): {data}")),
            );
        }
    }
    assert!(done, "the stream did not end with [DONE]");
    events
}

/// The events of a named-event SSE body (Responses, Messages), checking the framing: blocks of
/// `event: TYPE` + `data: JSON` whose `type` is TYPE, no `[DONE]`, comments allowed.
pub fn named_sse_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter(|b| !b.is_empty() && !b.starts_with(':'))
        .map(|block| {
            let (name, data) = block
                .strip_prefix("event: ")
                .and_then(|b| b.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named SSE event: {block:?}"));
            let event: Value =
                serde_json::from_str(data).unwrap_or_else(|e| panic!("bad JSON ({e}): {data}"));
            assert_eq!(event["type"], name, "event name and type agree");
            event
        })
        .collect()
}

pub fn demo_tokenizer() -> Tokenizer {
    Tokenizer::byte_level_demo().expect("demo tokenizer")
}

pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Waits until no request is running; false on timeout.
pub async fn idle(server: &TestServer, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if server.metric("vllm:num_requests_running").await == 0.0
            && server.metric("vllm:num_requests_waiting").await == 0.0
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}
