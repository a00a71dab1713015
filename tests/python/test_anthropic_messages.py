"""POST /v1/messages through the official anthropic client (client.messages.*), as Claude Code
and the Claude Agent SDK use it through ANTHROPIC_BASE_URL. Every object and event is also
validated strictly against the client's own pydantic types (the client itself builds them
without validation, so a missing field would otherwise go unnoticed)."""

import random

import anthropic
import pytest
from anthropic import types

WEATHER_TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]

EVENT_TYPES = {
    "message_start": types.RawMessageStartEvent,
    "content_block_start": types.RawContentBlockStartEvent,
    "content_block_delta": types.RawContentBlockDeltaEvent,
    "content_block_stop": types.RawContentBlockStopEvent,
    "message_delta": types.RawMessageDeltaEvent,
    "message_stop": types.RawMessageStopEvent,
}


def strict(model):
    """Validates what the client built leniently against its declared type; returns it."""
    type(model).model_validate(model.to_dict())
    return model


def words(n):
    return " ".join(random.choice(["river", "stone", "lamp", "orbit", "maple", "echo"]) for _ in range(n))


def collect(stream):
    """Raw events of a stream, each checked to be the client's class for its type."""
    events = []
    for event in stream:
        assert isinstance(event, EVENT_TYPES[event.type]), event
        events.append(strict(event))
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    return events


def comparable(message):
    """A message without its ids, its input counted whole (a repeated prompt is read from the
    prefix cache the second time)."""
    m = message.to_dict(exclude_none=True)
    m.pop("id")
    for block in m["content"]:
        block.pop("id", None)
    usage = m.pop("usage")
    m["input"] = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    m["output"] = usage["output_tokens"]
    return m


def test_plain_message(claude_scripted):
    question = f"Hi, {words(3)}"
    message = strict(
        claude_scripted.messages.create(
            model="lily-demo", max_tokens=200, system="Be kind.", messages=[{"role": "user", "content": question}]
        )
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think." and message.content[0].signature == ""
    assert message.content[1].text == "Hello! How can I help?"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens > 0 and usage.cache_creation_input_tokens == 0
    counted = claude_scripted.messages.count_tokens(
        model="lily-demo", system="Be kind.", messages=[{"role": "user", "content": question}]
    )
    assert isinstance(strict(counted), types.MessageTokensCount)
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


@pytest.mark.parametrize("thinking", [{"type": "disabled"}, {"type": "enabled", "budget_tokens": 8}])
def test_streaming_and_whole_agree_under_greedy(claude_demo, thinking):
    args = dict(
        model="lily-demo",
        max_tokens=random.randint(10, 40),
        messages=[{"role": "user", "content": f"Tell me about {words(4)}."}],
        thinking=thinking,
        # This client version no longer has sampling parameters; the API still takes them.
        extra_body={"temperature": 0},
    )
    whole = strict(claude_demo.messages.create(**args))
    events = collect(claude_demo.messages.create(**args, stream=True))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    with claude_demo.messages.stream(**args) as stream:
        final = strict(stream.get_final_message())
    assert comparable(final) == comparable(whole)
    assert (whole.content[0].type == "thinking") == (thinking["type"] == "enabled")
    if whole.stop_reason == "max_tokens":
        assert whole.usage.output_tokens == args["max_tokens"]


def test_tools_and_a_tool_result_round_trip(claude_scripted):
    question = {"role": "user", "content": "What is the weather in Paris and Rome?"}
    message = strict(
        claude_scripted.messages.create(model="lily-demo", max_tokens=1000, messages=[question], tools=WEATHER_TOOLS)
    )
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert [c.input for c in calls] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert all(c.id.startswith("toolu_") for c in calls) and calls[0].id != calls[1].id

    # Streamed through the helper, the calls' inputs are assembled from input_json_delta events.
    with claude_scripted.messages.stream(
        model="lily-demo", max_tokens=1000, messages=[question], tools=WEATHER_TOOLS
    ) as stream:
        final = strict(stream.get_final_message())
    assert comparable(final) == comparable(message)

    # The client sends the assistant turn back as it came (Message.to_param), then the results.
    results = [
        {"type": "tool_result", "tool_use_id": c.id, "content": [{"type": "text", "text": "sunny"}]} for c in calls
    ]
    follow = strict(
        claude_scripted.messages.create(
            model="lily-demo",
            max_tokens=1000,
            messages=[question, message.to_param(), {"role": "user", "content": results}],
            tools=WEATHER_TOOLS,
        )
    )
    assert follow.stop_reason == "end_turn"
    assert follow.content[-1].text == "Hello! How can I help?"

    single = claude_scripted.messages.create(
        model="lily-demo",
        max_tokens=1000,
        messages=[question],
        tools=WEATHER_TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert [b.type for b in single.content].count("tool_use") == 1


def test_stop_sequences(claude_scripted):
    message = strict(
        claude_scripted.messages.create(
            model="lily-demo", max_tokens=200, messages=[{"role": "user", "content": "hi"}], stop_sequences=["How"]
        )
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "How"
    assert message.content[-1].text == "Hello! "


def test_errors_map_to_client_exceptions(claude_scripted):
    hi = [{"role": "user", "content": "hi"}]
    # The client refuses to send a request without max_tokens; its plain `post` does not.
    with pytest.raises(anthropic.BadRequestError) as missing:
        claude_scripted.post("/v1/messages", body={"model": "lily-demo", "messages": hi}, cast_to=types.Message)
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.message
    with pytest.raises(anthropic.BadRequestError) as image:
        claude_scripted.messages.create(
            model="lily-demo",
            max_tokens=10,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}],
        )
    assert "vision" in image.value.message
    with pytest.raises(anthropic.BadRequestError) as overflow:
        claude_scripted.messages.create(model="lily-demo", max_tokens=10**7, messages=hi, timeout=30)
    assert "maximum context length" in overflow.value.message
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude_scripted.messages.create(model="no-such-model", max_tokens=10, messages=hi)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    wrong_key = anthropic.Anthropic(base_url=str(claude_scripted.base_url), api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong_key.messages.create(model="lily-demo", max_tokens=10, messages=hi)
    with pytest.raises(anthropic.InternalServerError) as failed:
        claude_scripted.messages.create(model="lily-demo", max_tokens=10, messages=[{"role": "user", "content": "explode"}])
    assert failed.value.body["error"]["type"] == "api_error"


def test_mid_stream_failure_is_an_error_event(claude_scripted):
    events = []
    with pytest.raises(anthropic.APIStatusError) as failed:
        for event in claude_scripted.messages.create(
            model="lily-demo", max_tokens=10, messages=[{"role": "user", "content": "explode"}], stream=True
        ):
            events.append(event)
    assert [e.type for e in events] == ["message_start"]
    assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"] == "api_error"
