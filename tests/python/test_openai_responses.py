"""POST /v1/responses through the official openai client (client.responses.*), as the Agents SDK
and Codex use it. Every object and event is also validated strictly against the client's own
pydantic types (the client itself builds them without validation, so a missing field would
otherwise go unnoticed)."""

import json
import random
from typing import Literal

import openai
import pydantic
import pytest
from openai.types import responses as types

WEATHER_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
        "strict": False,
    }
]

EVENT_TYPES = {
    "response.created": types.ResponseCreatedEvent,
    "response.in_progress": types.ResponseInProgressEvent,
    "response.output_item.added": types.ResponseOutputItemAddedEvent,
    "response.content_part.added": types.ResponseContentPartAddedEvent,
    "response.output_text.delta": types.ResponseTextDeltaEvent,
    "response.output_text.done": types.ResponseTextDoneEvent,
    "response.reasoning_text.delta": types.ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": types.ResponseReasoningTextDoneEvent,
    "response.function_call_arguments.delta": types.ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": types.ResponseFunctionCallArgumentsDoneEvent,
    "response.content_part.done": types.ResponseContentPartDoneEvent,
    "response.output_item.done": types.ResponseOutputItemDoneEvent,
    "response.completed": types.ResponseCompletedEvent,
    "response.incomplete": types.ResponseIncompleteEvent,
    "response.failed": types.ResponseFailedEvent,
}


def strict(model):
    """Validates what the client built leniently against its declared type; returns it."""
    type(model).model_validate(model.to_dict())
    return model


def words(n):
    return " ".join(random.choice(["river", "stone", "lamp", "orbit", "maple", "echo"]) for _ in range(n))


def collect(stream):
    """Events of a stream, each checked to be the client's class for its type."""
    events = []
    for event in stream:
        assert isinstance(event, EVENT_TYPES[event.type]), event
        strict(event)
        assert event.sequence_number == len(events)
        events.append(event)
    return events


def test_plain_response(scripted):
    response = strict(scripted.responses.create(model="lily-demo", input=f"Hi, {words(3)}", instructions="Be kind."))
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Let me think."
    assert response.output_text == "Hello! How can I help?"
    assert response.instructions == "Be kind."
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > usage.output_tokens_details.reasoning_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


@pytest.mark.parametrize("effort", ["none", "medium"])
def test_streaming_and_whole_give_the_same_text_under_greedy(demo, effort):
    args = dict(
        model="lily-demo",
        input=f"Tell me about {words(4)}.",
        temperature=0,
        max_output_tokens=random.randint(10, 40),
        reasoning={"effort": effort},
    )
    whole = strict(demo.responses.create(**args))
    events = collect(demo.responses.create(**args, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == ("response.completed" if whole.status == "completed" else "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output_text == final.output_text
    whole_reasoning = "".join(p.text for i in whole.output if i.type == "reasoning" for p in i.content)
    assert reasoning == whole_reasoning
    assert bool(reasoning) == (effort != "none")
    assert final.usage.output_tokens == whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"


def test_stream_helper_accumulates_the_same_response(scripted):
    # The helper checks the events' ids and order, and wants `response.completed` (the demo model
    # rarely finishes; the script does).
    args = dict(model="lily-demo", input=f"Hello {words(2)}", tools=WEATHER_TOOLS)
    whole = scripted.responses.create(**args)
    with scripted.responses.stream(**args) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text == "Hello! How can I help?"
    assert [i.type for i in final.output] == [i.type for i in whole.output] == ["reasoning", "message"]


def test_function_calls_and_their_outputs(scripted):
    question = {"role": "user", "content": "What is the weather in Paris and Rome?"}
    response = strict(scripted.responses.create(model="lily-demo", input=[question], tools=WEATHER_TOOLS))
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert calls[0].call_id != calls[1].call_id
    assert response.tools[0].name == "get_weather"

    # The client runs the calls and sends the output items back with their results.
    history = [question] + [item.model_dump(exclude_none=True) for item in response.output]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    follow = strict(scripted.responses.create(model="lily-demo", input=history, tools=WEATHER_TOOLS))
    assert follow.output_text == "Hello! How can I help?"

    single = scripted.responses.create(model="lily-demo", input=[question], tools=WEATHER_TOOLS, parallel_tool_calls=False)
    assert [item.type for item in single.output].count("function_call") == 1


def test_function_calls_streamed(scripted):
    events = collect(scripted.responses.create(model="lily-demo", input="weather in Paris?", tools=WEATHER_TOOLS, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [a.name for a in added] == ["get_weather", "get_weather"]
    arguments = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
    done = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert arguments == done
    assert [json.loads(done[i]) for i in sorted(done)] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert "response.reasoning_text.done" in [e.type for e in events]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    mood: Literal["happy", "sad"]


def test_parse_with_a_text_format_validates(demo):
    response = demo.responses.parse(
        model="lily-demo",
        input="Describe a person.",
        text_format=Person,
        temperature=1.0,
        max_output_tokens=300,
        reasoning={"effort": "none"},
        extra_body={"seed": random.randint(0, 1000)},
    )
    assert isinstance(response.output_parsed, Person)


def test_errors_map_to_client_exceptions(scripted):
    with pytest.raises(openai.BadRequestError) as stateful:
        scripted.responses.create(model="lily-demo", input="hi", previous_response_id="resp_123")
    assert stateful.value.param == "previous_response_id" and stateful.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as choice:
        scripted.responses.create(
            model="lily-demo", input="hi", tools=WEATHER_TOOLS, tool_choice={"type": "function", "name": "nope"}
        )
    assert choice.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as overflow:
        scripted.responses.create(model="lily-demo", input="hi", max_output_tokens=10**6)
    assert overflow.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        scripted.responses.create(model="gpt-9", input="hi")
    with pytest.raises(openai.InternalServerError):
        scripted.responses.create(model="lily-demo", input="explode")
    # store is accepted (and nothing is stored).
    assert scripted.responses.create(model="lily-demo", input="hi", store=True).store is False


def test_mid_stream_failure_is_a_failed_response(scripted):
    events = collect(scripted.responses.create(model="lily-demo", input="explode", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error.message
