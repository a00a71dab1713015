"""The server over raw HTTP: exact SSE bytes, malformed and hostile requests, disconnects."""

import http.client
import json
import os
import socket
import time
import urllib.parse

import pytest

SCRIPTED = urllib.parse.urlparse(os.environ.get("LILY_SCRIPTED_URL", "http://127.0.0.1:1"))
KEY = os.environ.get("LILY_SCRIPTED_KEY", "")
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def request(method, path, body=None, headers=AUTH):
    conn = http.client.HTTPConnection(SCRIPTED.hostname, SCRIPTED.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def error_of(status, body, expected_status):
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert error["message"] and error["type"]
    return error


def test_sse_bytes():
    status, headers, body = request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [block for block in text.split("\n\n") if block and not block.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "null" not in json.dumps([c["choices"][0]["delta"] for c in chunks]), "no null fields in deltas"


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (b'{"messages": "hi"}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": 5}', 400, "stop"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}', 400, "tools[0].function.name"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": {"type": "function", "function": {"name": "nope"}}}', 400, "tool_choice"),
        (b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}', 400, "messages[0].content[0]"),
    ],
)
def test_malformed_requests(body, status, param):
    got_status, _, got_body = request("POST", "/v1/chat/completions", body)
    error = error_of(got_status, got_body, status)
    if param:
        assert error["param"] == param


def test_hostile_requests():
    # Oversize body.
    status, _, body = request("POST", "/v1/chat/completions", b'{"messages": "' + b"x" * 100_000 + b'"}')
    error_of(status, body, 413)
    # No key, then a key that is a prefix of the right one.
    status, _, body = request("GET", "/v1/models", headers={})
    assert error_of(status, body, 401)["code"] == "invalid_api_key"
    status, _, body = request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}"})
    error_of(status, body, 401)
    # Unknown routes and methods; a path that tries to reach the filesystem.
    error_of(*request("GET", "/v1/../../etc/passwd")[::2], 404)
    error_of(*request("PUT", "/v1/chat/completions", b"{}")[::2], 405)
    # chat_template_kwargs may not replace the template's own variables.
    status, _, body = request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})
    error_of(status, body, 400)
    # Deeply nested JSON is refused, not a crash.
    status, _, body = request("POST", "/v1/chat/completions", b"[" * 5000 + b"]" * 5000)
    error_of(status, body, 400)
    # The server still answers.
    assert request("GET", "/health", headers={})[0] == 200


def metric(name):
    _, _, body = request("GET", "/metrics", headers={})
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(stream):
    body = json.dumps({"messages": [{"role": "user", "content": "a long story please"}], "stream": stream}).encode()
    sock = socket.create_connection((SCRIPTED.hostname, SCRIPTED.port), timeout=10)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    if stream:
        seen = b""
        while seen.count(b"data: ") < 5:
            chunk = sock.recv(4096)
            assert chunk, "the stream ended early"
            seen += chunk
    else:
        time.sleep(0.3)
    assert metric("vllm:num_requests_running") == 1
    sock.close()
    deadline = time.time() + 3
    while metric("vllm:num_requests_running") != 0:
        assert time.time() < deadline, "the slot was not freed"
        time.sleep(0.02)
