"""The server through the official openai client, as agents and chat UIs use it."""

import asyncio
import json
from typing import Literal

import openai
import pydantic
import pytest

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def user(text):
    return [{"role": "user", "content": text}]


def test_models_list(demo, scripted):
    models = demo.models.list().data
    assert [m.id for m in models] == ["lily-demo"]
    assert models[0].model_extra["max_model_len"] == 32768
    assert models[0].model_extra["meta"]["demo"] is True
    assert scripted.models.list().data[0].model_extra["meta"]["scripted"] is True


@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_and_whole_give_the_same_text_under_greedy(demo, thinking):
    args = dict(
        model="lily-demo",
        messages=user("Tell me a story."),
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    whole = demo.chat.completions.create(**args)
    stream = demo.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    content, reasoning, finish, usage, roles = "", "", [], None, []
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    message = whole.choices[0].message
    assert roles == ["assistant"]
    assert content == (message.content or "")
    assert reasoning == (message.model_extra.get("reasoning_content") or "")
    assert message.model_extra.get("reasoning") == message.model_extra.get("reasoning_content")
    assert finish == [whole.choices[0].finish_reason]
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)
    assert counts(usage) == counts(whole.usage)
    # The second request resumes from the state the first saved before its prompt's last token.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert usage.completion_tokens == 40 or finish == ["stop"]


def test_no_usage_chunk_unless_asked(demo):
    stream = demo.chat.completions.create(model="lily-demo", messages=user("hi"), max_tokens=5, stream=True)
    chunks = list(stream)
    assert all(chunk.choices for chunk in chunks), "every chunk has a choice"
    assert all(chunk.usage is None for chunk in chunks)


def test_tool_calls(scripted):
    response = scripted.chat.completions.create(
        model="lily-demo", messages=user("What is the weather in Paris and Rome?"), tools=WEATHER_TOOLS
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert calls[0].id != calls[1].id

    # The turn and the results go back; reasoning is accepted in history.
    history = user("What is the weather in Paris and Rome?") + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [c.model_dump() for c in calls],
        }
    ]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    follow = scripted.chat.completions.create(model="lily-demo", messages=history, tools=WEATHER_TOOLS)
    assert follow.choices[0].message.content == "Hello! How can I help?"


def test_tool_calls_streamed(scripted):
    stream = scripted.chat.completions.create(
        model="lily-demo", messages=user("weather in Paris?"), tools=WEATHER_TOOLS, stream=True
    )
    calls, finishes = {}, []
    for chunk in stream:
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.name == "get_weather"
                calls[call.index] = ""
            calls[call.index] += call.function.arguments or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    assert sorted(calls) == [0, 1], "distinct indexes per call"
    assert [json.loads(calls[i]) for i in (0, 1)] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    assert finishes == ["tool_calls"]


def test_parallel_tool_calls_false(scripted):
    response = scripted.chat.completions.create(
        model="lily-demo", messages=user("weather in Paris?"), tools=WEATHER_TOOLS, parallel_tool_calls=False
    )
    assert len(response.choices[0].message.tool_calls) == 1


def test_required_tool_choice_on_a_random_model(demo):
    response = demo.chat.completions.create(
        model="lily-demo",
        messages=user("weather?"),
        tools=WEATHER_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=3,
        max_tokens=300,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    mood: Literal["happy", "sad"]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_parse_always_validates(demo, seed):
    completion = demo.chat.completions.parse(
        model="lily-demo",
        messages=user("Describe a person."),
        response_format=Person,
        temperature=1.0,
        seed=seed,
        max_tokens=300,
        extra_body={"chat_template_kwargs": {"enable_thinking": seed % 2 == 0}, "thinking_token_budget": 8},
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)
    Person.model_validate_json(completion.choices[0].message.content)


def test_errors_map_to_client_exceptions(scripted):
    with pytest.raises(openai.BadRequestError) as bad:
        scripted.chat.completions.create(model="lily-demo", messages=user("hi"), temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as overflow:
        scripted.chat.completions.create(model="lily-demo", messages=user("hi"), max_tokens=10**6)
    assert overflow.value.code == "context_length_exceeded"
    assert "maximum context length" in overflow.value.message
    with pytest.raises(openai.NotFoundError):
        scripted.chat.completions.create(model="gpt-9", messages=user("hi"))
    with pytest.raises(openai.BadRequestError) as n:
        scripted.chat.completions.create(model="lily-demo", messages=user("hi"), n=100)
    assert n.value.param == "n"
    wrong_key = openai.OpenAI(base_url=str(scripted.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    with pytest.raises(openai.InternalServerError):
        scripted.chat.completions.create(model="lily-demo", messages=user("explode"))
    # The server is fine afterwards.
    assert scripted.chat.completions.create(model="lily-demo", messages=user("hi")).choices[0].message.content


def test_mid_stream_failure_raises_api_error(scripted):
    with pytest.raises(openai.APIError):
        for _ in scripted.chat.completions.create(model="lily-demo", messages=user("explode"), stream=True):
            pass


def test_n_choices_and_seed(demo):
    args = dict(model="lily-demo", messages=user("hi"), n=2, seed=11, temperature=1.0, max_tokens=10)
    a, b = demo.chat.completions.create(**args), demo.chat.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message for c in a.choices] == [c.message for c in b.choices]


def test_logprobs(demo):
    response = demo.chat.completions.create(
        model="lily-demo",
        messages=user("hi"),
        logprobs=True,
        top_logprobs=2,
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    entries = response.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_text_completions(scripted):
    response = scripted.completions.create(model="lily-demo", prompt="Say hi", max_tokens=100)
    assert response.choices[0].text == "Let me think.\n</think>\n\nHello! How can I help?"
    streamed = "".join(c.choices[0].text for c in scripted.completions.create(model="lily-demo", prompt="Say hi", max_tokens=100, stream=True) if c.choices)
    assert streamed == response.choices[0].text


def test_echo_logprobs_as_lm_eval_asks(demo):
    # lm-eval's local-completions loglikelihood request: token ids, echo, logprobs, no new tokens.
    ids = [100 + 7 * i for i in range(10)]
    response = demo.completions.create(model="lily-demo", prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0, seed=1234)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # The greedy check lm-eval makes: is each token the most likely one?
    greedy = [max(t.values()) == v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])]
    assert len(greedy) == len(ids) - 1


def test_fifty_concurrent_streams(scripted_async):
    async def one(i):
        stream = await scripted_async.chat.completions.create(
            model="lily-demo", messages=user(f"I am client {i}."), stream=True
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
        return text

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(50)))

    texts = asyncio.run(all_of_them())
    assert texts == [f"Reply for client {i}, all good." for i in range(50)]
