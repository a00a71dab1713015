#!/usr/bin/env python3
"""Write tests/fixtures/chat_template/cases.json: chat conversations rendered by jinja2 as
transformers' `apply_chat_template` renders them, for `tests/chat_template.rs` to compare
byte for byte with lily's minijinja renderer (src/chat/template.rs).

Usage (from the repository root):
    pip install -r tools/requirements-fixtures.txt     # jinja2==3.1.6 (MarkupSafe 3.0.3)
    python3 tools/make_template_fixtures.py

The committed cases.json is what CI uses; Python is only needed to regenerate it.

How this mirrors transformers (src/transformers/utils/chat_template_utils.py, v5.x):
  * ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
    extensions=[loopcontrols]); keep_trailing_newline stays at jinja2's default (False);
  * `tojson` = json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    (transformers' own filter, replacing jinja2's HTML-escaping one);
  * `raise_exception(msg)` raises a TemplateError whose text is msg;
  * the template sees messages=, tools=, documents=None, add_generation_prompt=, **kwargs.

Before rendering, lily normalises OpenAI-style messages (see `normalize` below, which must
stay in step with src/chat/template/normalize.rs): keys with null values are dropped
(transformers does this), `developer` becomes `system`, all system messages are merged into
one leading message, `reasoning` fills a missing `reasoning_content`, and tool-call
`arguments` given as JSON strings are parsed into objects (vLLM does this), since the Qwen
template iterates them as a mapping.
"""

import copy
import json
import sys
from pathlib import Path

import jinja2
from importlib.metadata import version
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "assets" / "qwen3.6-chat-template.jinja"
OUT = ROOT / "tests" / "fixtures" / "chat_template" / "cases.json"


class Raised(jinja2.exceptions.TemplateError):
    """What the template's raise_exception() throws (a TemplateError, as in transformers)."""


class InvalidInput(ValueError):
    """A request lily rejects before rendering; `where` names the offending field."""

    def __init__(self, where):
        super().__init__(where)
        self.where = where


def raise_exception(message):
    raise Raised(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def merge_system_messages(messages):
    """All system messages, in order, become one leading system message (contents joined by a
    blank line); a conversation with at most one system message, already first, is untouched."""
    system_at = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if not system_at or system_at == [0]:
        return messages
    contents = [messages[i]["content"] for i in system_at if "content" in messages[i]]
    for i in system_at:
        content = messages[i].get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidInput(f"messages[{i}].content")
    if all(isinstance(c, str) for c in contents):
        merged = "\n\n".join(contents)
    else:
        merged = []
        for n, content in enumerate(contents):
            if n > 0:
                merged.append({"type": "text", "text": "\n\n"})
            merged.extend([{"type": "text", "text": content}] if isinstance(content, str) else content)
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": merged}] + rest


def normalize(messages):
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidInput(f"messages[{i}]")
        message = {k: v for k, v in copy.deepcopy(message).items() if v is not None}
        if message.get("role") == "developer":
            message["role"] = "system"
        if "reasoning_content" not in message and "reasoning" in message:
            message["reasoning_content"] = message["reasoning"]
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del message["tool_calls"]
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    continue
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                args = function.get("arguments")
                if args is None or args == "":
                    args = {}
                elif isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        raise InvalidInput(where)
                if not isinstance(args, dict):
                    raise InvalidInput(where)
                function["arguments"] = args
        out.append(message)
    return merge_system_messages(out)


def render(env, source, case):
    try:
        messages = normalize(case["messages"])
        template = env.from_string(source)
        return {
            "expected": template.render(
                messages=messages,
                tools=case.get("tools"),
                documents=None,
                add_generation_prompt=case.get("add_generation_prompt", False),
                **case.get("kwargs", {}),
            )
        }
    except Raised as e:
        return {"error": {"kind": "raised", "message": str(e)}}
    except InvalidInput as e:
        return {"error": {"kind": "invalid_input", "contains": e.where}}
    except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
        # Other failures (undefined attributes, type errors) have engine-specific wording:
        # only the fact that rendering fails is compared.
        return {"error": {"kind": "render", "python": f"{type(e).__name__}: {e}"}}


# ---------------------------------------------------------------------------------------------
# Building blocks for the conversations.

def user(content):
    return {"role": "user", "content": content}


def system(content):
    return {"role": "system", "content": content}


def assistant(content, **extra):
    return {"role": "assistant", "content": content, **extra}


def tool(content, call_id="call_1"):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def text(t):
    return {"type": "text", "text": t}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

# Nested schema, unicode, quotes, backslashes, characters that jinja2's own tojson would escape.
NESTED_TOOL = {
    "type": "function",
    "function": {
        "name": "book_trip",
        "description": "Réserve un voyage — 旅行を予約する. Use <b>only</b> when asked & \"confirmed\"; path C:\\trips.",
        "parameters": {
            "type": "object",
            "properties": {
                "travellers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                },
                "budget": {"type": "number", "default": 1500.5, "multipleOf": 0.01},
                "refundable": {"type": "boolean", "default": True},
                "notes": {"type": ["string", "null"], "default": None},
                "emoji": {"type": "string", "default": "✈️🌍", "pattern": "^[^\\n\\t]*$"},
            },
            "required": ["travellers"],
        },
        "strict": True,
    },
}

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

# Arguments of every JSON type, given the two ways clients send them.
MIXED_ARGS = {
    "city": "Zürich",
    "days": 3,
    "ratio": 0.25,
    "filters": {"min": -4, "labels": ["a", "b"], "nested": {"ok": True}},
    "dates": ["2026-01-01", "2026-01-02"],
    "metric": False,
    "note": None,
    "text": "line 1\nline \"2\"\t<tab>",
}


def cases():
    hello = [user("Hello!")]
    q1, a1, q2 = user("What is 2+2?"), assistant("4"), user("And 3+3?")
    reasoned = assistant("It is 4.", reasoning_content="2 plus 2 equals 4.")
    tool_turn = assistant(
        "Let me check.",
        reasoning_content="I should call the weather tool.",
        tool_calls=[call("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))],
    )
    yield dict(name="single_user", messages=hello, add_generation_prompt=True)
    yield dict(name="single_user_no_generation_prompt", messages=hello)
    yield dict(name="system_user", messages=[system("You are a helpful assistant."), *hello], add_generation_prompt=True)
    yield dict(name="thinking_off", messages=[system("Be brief."), *hello], add_generation_prompt=True,
               kwargs={"enable_thinking": False})
    yield dict(name="thinking_on_explicit", messages=hello, add_generation_prompt=True,
               kwargs={"enable_thinking": True})
    yield dict(name="thinking_flag_not_bool", messages=hello, add_generation_prompt=True,
               kwargs={"enable_thinking": 0})
    yield dict(name="multi_turn", messages=[system("Math tutor."), q1, a1, q2], add_generation_prompt=True)
    yield dict(name="multi_turn_ends_with_assistant", messages=[q1, a1, q2, assistant("6")])
    yield dict(name="reasoning_before_last_query_dropped", messages=[q1, reasoned, q2], add_generation_prompt=True)
    yield dict(name="reasoning_after_last_query_kept", messages=[q1, a1, q2, reasoned])
    yield dict(name="preserve_thinking", messages=[q1, reasoned, q2, reasoned], add_generation_prompt=True,
               kwargs={"preserve_thinking": True})
    yield dict(name="preserve_thinking_false", messages=[q1, reasoned, q2], add_generation_prompt=True,
               kwargs={"preserve_thinking": False, "enable_thinking": False})
    yield dict(name="reasoning_field_alias", messages=[q1, a1, q2, assistant("6", reasoning="3 plus 3.")])
    yield dict(name="reasoning_content_wins_over_reasoning",
               messages=[q1, assistant("4", reasoning_content="kept", reasoning="ignored")],
               kwargs={"preserve_thinking": True})
    yield dict(name="reasoning_null_uses_reasoning",
               messages=[q1, assistant("4", reasoning_content=None, reasoning="from reasoning")])
    yield dict(name="think_tags_inside_assistant_content",
               messages=[q1, assistant("<think>\nquick sum\n</think>\n\nIt is 4.")])
    yield dict(name="think_close_inside_content_before_last_query",
               messages=[q1, assistant("plan</think>answer </think> tail"), q2], add_generation_prompt=True)
    yield dict(name="think_close_inside_user_content",
               messages=[user("What does </think> mean? <think>x</think>")], add_generation_prompt=True)
    yield dict(name="empty_system", messages=[system(""), *hello], add_generation_prompt=True)
    yield dict(name="whitespace_system_with_tools", messages=[system("  \n "), *hello], tools=[WEATHER_TOOL],
               add_generation_prompt=True)
    yield dict(name="content_parts_user", messages=[user([text("Part one. "), text("Part two.")])],
               add_generation_prompt=True)
    yield dict(name="content_parts_with_extra_keys",
               messages=[system([text("Sys A"), text(" + B")]),
                         user([{"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}}])],
               add_generation_prompt=True)
    yield dict(name="content_parts_image_and_video",
               messages=[user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                               text("What is this?"), {"type": "video", "video": "clip.mp4"},
                               {"type": "image", "image": "x.png"}]),
                         assistant("A cat."), user([{"type": "image_url", "image_url": {"url": "y.png"}}])],
               add_generation_prompt=True, kwargs={"add_vision_id": True})
    yield dict(name="tools_simple", messages=hello, tools=[WEATHER_TOOL], add_generation_prompt=True)
    yield dict(name="tools_nested_unicode_with_system",
               messages=[system("Plan trips.\n"), user("Book Tokyo for two 🙂")],
               tools=[NESTED_TOOL, WEATHER_TOOL, SEARCH_TOOL], add_generation_prompt=True,
               kwargs={"enable_thinking": False})
    yield dict(name="tools_empty_list", messages=hello, tools=[], add_generation_prompt=True)
    yield dict(name="tool_call_string_arguments",
               messages=[user("Weather in Zürich?"),
                         assistant("", tool_calls=[call("get_weather", json.dumps(MIXED_ARGS))])],
               tools=[WEATHER_TOOL])
    yield dict(name="tool_call_object_arguments",
               messages=[user("Weather in Zürich?"), assistant(None, tool_calls=[call("get_weather", MIXED_ARGS)])],
               tools=[WEATHER_TOOL])
    yield dict(name="tool_call_string_arguments_unicode_escapes",
               messages=[user("Translate"),
                         assistant(None, tool_calls=[call("search", '{"query": "caf\\u00e9 \\ud83d\\ude00 \\"q\\""}')])],
               tools=[SEARCH_TOOL])
    yield dict(name="tool_call_numbers",
               messages=[user("Numbers"),
                         assistant(None, tool_calls=[call("search", {
                             "big": 1e16, "small": 1.5e-7, "tiny": 1e-05, "neg_zero": -0.0, "whole_float": 100.0,
                             "third": 1 / 3, "huge_int": 18446744073709551615, "neg_int": -9223372036854775808,
                             "fraction": 123456.789, "list": [1, 2.5, -3e-20, 1e+300]})])],
               tools=[SEARCH_TOOL])
    yield dict(name="tool_call_parallel_with_content",
               messages=[user("Weather in Paris and Rome?"),
                         assistant("I'll check both.",
                                   tool_calls=[call("get_weather", '{"city": "Paris"}', "call_a"),
                                               call("get_weather", '{"city": "Rome", "unit": "celsius"}', "call_b")]),
                         tool('{"temp": 18}', "call_a"), tool('{"temp": 24}', "call_b"),
                         assistant("Paris 18°C, Rome 24°C.")],
               tools=[WEATHER_TOOL], add_generation_prompt=False)
    yield dict(name="tool_loop_multi_step",
               messages=[system("Use tools."), user("Weather in Paris, then search for events."), tool_turn,
                         tool('{"temp": 18}'),
                         assistant("", reasoning_content="Now search.",
                                   tool_calls=[call("search", '{"query": "Paris events"}', "call_2")]),
                         tool([text("Result A"), text(" and result B")], "call_2")],
               tools=[WEATHER_TOOL, SEARCH_TOOL], add_generation_prompt=True)
    yield dict(name="three_consecutive_tool_results",
               messages=[user("go"), assistant(None, tool_calls=[call("search", '{"query": "a"}', "1"),
                                                              call("search", '{"query": "b"}', "2"),
                                                              call("search", '{"query": "c"}', "3")]),
                         tool("A", "1"), tool("B", "2"), tool("  C  ", "3"), user("thanks")],
               tools=[SEARCH_TOOL], add_generation_prompt=True)
    yield dict(name="tool_response_wrapper_user_is_not_a_query",
               messages=[user("Real question"), reasoned, user("<tool_response>\nok\n</tool_response>"),
                         assistant("done", reasoning_content="after wrapper")],
               add_generation_prompt=True)
    yield dict(name="tool_call_without_function_wrapper",
               messages=[user("hi"), assistant("", tool_calls=[{"name": "search", "arguments": {"query": "x"}}])])
    yield dict(name="tool_call_empty_arguments",
               messages=[user("hi"), assistant("", tool_calls=[call("search", ""), call("search", None, "c2"),
                                                               call("search", "{}", "c3")])])
    yield dict(name="tool_calls_empty_list_dropped", messages=[user("hi"), assistant("plain", tool_calls=[])])
    yield dict(name="tool_calls_null", messages=[user("hi"), assistant("plain", tool_calls=None)])
    yield dict(name="unicode_and_quotes",
               messages=[system("Réponds en français. «Guillemets» and 'single' \"double\" \\ backslash"),
                         user("日本語 👩‍💻 עברית العربية \u2028 ctrl\x7f"), assistant("D'accord — \"oui\"."),
                         user("{{ not_jinja }} {% raw %} {# c #}")],
               add_generation_prompt=True)
    yield dict(name="trim_python_whitespace",
               messages=[user("\x1c\x1d padded \u3000\u00a0\t\n"), assistant("\x1f answer \x85")],
               add_generation_prompt=True)
    yield dict(name="developer_role_is_system", messages=[{"role": "developer", "content": "Obey."}, *hello],
               add_generation_prompt=True)
    yield dict(name="system_and_developer_merged",
               messages=[system("First."), {"role": "developer", "content": "Second."}, *hello,
                         system("Third, late.")],
               tools=[SEARCH_TOOL], add_generation_prompt=True)
    yield dict(name="system_not_first_merged", messages=[*hello, system("Late system.")],
               add_generation_prompt=True)
    yield dict(name="system_merged_with_parts",
               messages=[system("A"), user("q"), {"role": "developer", "content": [text("B1"), text("B2")]}],
               add_generation_prompt=True)
    yield dict(name="tool_result_before_any_user",
               messages=[tool("orphan"), user("q"), assistant(None, tool_calls=[call("search", '{"query": "q"}')]),
                         tool("r")], add_generation_prompt=True)
    yield dict(name="odd_content_shapes",
               messages=[user(["a string with text in it", "image-less"]), assistant([text("<think>r</think>ok")]),
                         user(None), assistant(None)], add_generation_prompt=True)
    yield dict(name="extra_kwargs_ignored", messages=hello, add_generation_prompt=True,
               kwargs={"custom_flag": True, "reasoning_effort": "high", "nested": {"a": [1, 2]}})

    # Cases that must fail.
    yield dict(name="err_no_messages", messages=[])
    yield dict(name="err_only_system", messages=[system("alone")])
    yield dict(name="err_only_tool_response_wrappers", messages=[user("<tool_response>x</tool_response>")])
    yield dict(name="err_unknown_role", messages=[*hello, {"role": "function", "content": "x"}])
    yield dict(name="err_content_type", messages=[user(42)])
    yield dict(name="err_content_mapping", messages=[user({"type": "text", "text": "x"})])
    yield dict(name="err_tool_call_name_not_string",
               messages=[user("hi"), assistant("", tool_calls=[call(7, "{}")])])
    yield dict(name="err_content_item_type",
               messages=[user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])])
    yield dict(name="err_system_image", messages=[system([{"type": "image_url", "image_url": {"url": "a"}}]), *hello])
    yield dict(name="err_system_video", messages=[system([{"type": "video", "video": "a"}]), *hello])
    yield dict(name="err_bad_json_arguments",
               messages=[user("hi"), assistant("", tool_calls=[call("search", '{"query": ')])])
    yield dict(name="err_arguments_not_object",
               messages=[user("hi"), assistant("", tool_calls=[call("search", "[1, 2]")])])
    yield dict(name="err_message_not_object", messages=[user("hi"), "just a string"])
    yield dict(name="err_tool_call_without_name",
               messages=[user("hi"), assistant("", tool_calls=[{"function": {"arguments": {}}}])])

    # Small templates that pin the engine behaviour beyond what the Qwen template exercises.
    values = {"s": "é \"q\" \\ \n\t\x01 \u2028 😀 <&>'", "n": [1, 2.0, -0.0, 1e16, 1e-5, 0.1, 123456789012],
              "o": {"z": 1, "a": {"y": [], "b": {}}}, "t": True, "f": False, "none": None}
    yield dict(name="tojson_variants", template="\n".join([
        "{{ v | tojson }}",
        "{{ v | tojson(indent=2) }}",
        "{{ v | tojson(indent='\\t', sort_keys=true) }}",
        "{{ v | tojson(separators=(',', ':')) }}",
        "{{ v | tojson(ensure_ascii=true) }}",
        "{{ v.s | tojson(true) }}",
        "{{ v.o | tojson(indent=0) }}",
        "{{ v.o | tojson(false, 1, [';', '='], true) }}",
    ]), messages=hello, kwargs={"v": values})
    yield dict(name="trailing_newline_stripped", template="{{ messages[0].content }}\n\n", messages=hello)
    yield dict(name="whitespace_control",
               template="{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n  {{- 'end' }}",
               messages=[*hello, assistant("x"), user("again")])
    yield dict(name="loop_controls",
               template="{% for i in range(10) %}{% if i is odd %}{% continue %}{% endif %}{% if i > 6 %}{% break %}{% endif %}{{ i }},{% endfor %}",
               messages=hello)
    yield dict(name="python_string_methods",
               template="{{ s.upper() }}|{{ s.strip('x') }}|{{ s.split(',')[-1] }}|{{ s.replace('a', 'A') }}|"
                        "{{ s.startswith('xa') }}|{{ s.endswith('x') }}|{{ s.lstrip('x').rstrip('x') }}|"
                        "{{ s|trim('x') }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('zz', 'dflt') }}",
               messages=hello, kwargs={"s": "xa,b,cax", "d": {"k2": 2, "k1": 1}})
    yield dict(name="python_str_of_values",
               template="{{ t }} {{ f }} {{ n }} {{ x }} {{ 1.0 }} {{ 7 }} [{{ u }}] {{ 'a' ~ 1.5 }} {{ 2 ** 70 }}",
               messages=hello, kwargs={"t": True, "f": False, "n": None, "x": 1e16})
    yield dict(name="loop_adjacent_items",
               template="{% for m in messages %}{{ loop.previtem.role if loop.previtem else '-' }}>{{ m.role }}"
                        "<{{ loop.nextitem.role if loop.nextitem else '-' }}|{% endfor %}",
               messages=[tool("t0"), *hello, assistant("a")])
    yield dict(name="raise_exception_custom", template="{{ raise_exception('Custom: ' ~ messages|length) }}",
               messages=hello)


def main():
    source = TEMPLATE.read_text(encoding="utf-8")
    env = make_env()
    out = []
    names = set()
    for case in cases():
        assert case["name"] not in names, case["name"]
        names.add(case["name"])
        result = render(env, case.get("template", source), case)
        out.append({**case, **result})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "generated_by": "tools/make_template_fixtures.py",
        "jinja2": version("jinja2"),
        "markupsafe": version("markupsafe"),
        "python": sys.version.split()[0],
        "note": "cases render assets/qwen3.6-chat-template.jinja (copied below) unless they have their own `template`",
        "qwen_template": source,
        "cases": out,
    }
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    ok = sum("expected" in c for c in out)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(out)} cases ({ok} render, {len(out) - ok} must fail)")


if __name__ == "__main__":
    main()
