//! Qwen XML tool calls through the full output parser: typed arguments, several calls, calls inside
//! the thinking, malformed and truncated output, and every split of each transcript.

use lily::chat::tools::*;
use serde_json::{json, Value};

fn weather_tools() -> ToolSchemas {
    ToolSchemas::from_openai_tools(&json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "celsius": {"type": "boolean"},
            "threshold": {"type": "number"},
            "note": {"type": ["string", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "options": {"type": "object"},
            "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]}
        }}}},
        {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
            "content": {"type": "string"}
        }}}},
        {"type": "function", "function": {"name": "no_params"}}
    ]))
}

/// Everything one run produced, plus checks on the event stream's shape.
struct Run {
    parsed: ParsedOutput,
    events: Vec<OutputEvent>,
}

fn run(thinking: bool, tools: Option<ToolSchemas>, pieces: &[&str]) -> Run {
    let mut parser = OutputParser::new(thinking, tools);
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(parser.push(piece));
    }
    events.extend(parser.finish());
    let started = parser.tool_calls_started();

    let mut parsed = ParsedOutput::default();
    let mut open: Option<usize> = None;
    for e in &events {
        match e {
            OutputEvent::Reasoning(s) | OutputEvent::Content(s) => {
                assert!(!s.is_empty(), "empty text event")
            }
            OutputEvent::ToolCallStart { index, id, name } => {
                assert_eq!(open, None, "call started inside another");
                assert_eq!(
                    *index,
                    parsed.tool_calls.len(),
                    "indices must count up from 0"
                );
                assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                assert!(id[5..].chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
                assert!(!name.is_empty());
                open = Some(*index);
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                assert_eq!(open, Some(*index), "arguments outside their call");
                assert!(!delta.is_empty(), "empty arguments delta");
            }
            OutputEvent::ToolCallEnd { index } => {
                assert_eq!(open, Some(*index), "end without start");
                open = None;
            }
        }
        parsed.apply(e);
    }
    assert_eq!(open, None, "a call was left open after finish");
    assert_eq!(started, parsed.tool_calls.len());
    for call in &parsed.tool_calls {
        let args: Value = serde_json::from_str(&call.arguments)
            .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {}", call.arguments));
        assert!(args.is_object(), "{}", call.arguments);
    }
    Run { parsed, events }
}

/// (name, arguments as JSON values) of each call, ignoring the random ids.
fn calls(p: &ParsedOutput) -> Vec<(String, Value)> {
    p.tool_calls
        .iter()
        .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
        .collect()
}

fn without_ids(p: &ParsedOutput) -> (String, String, Vec<(String, String)>) {
    (
        p.reasoning.clone(),
        p.content.clone(),
        p.tool_calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect(),
    )
}

// ---------------------------------------------------------------------------------------------
// Transcripts: (thinking, generated text, expected reasoning, expected content, expected calls)
// ---------------------------------------------------------------------------------------------

struct Case {
    thinking: bool,
    text: &'static str,
    reasoning: &'static str,
    content: &'static str,
    calls: Vec<(&'static str, Value)>,
}

fn cases() -> Vec<Case> {
    vec![
        // The template's own shape, with every value type.
        Case {
            thinking: true,
            text: "User wants weather.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n\
                   <parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
                   <parameter=celsius>\nTrue\n</parameter>\n<parameter=threshold>\n-2.5e1\n</parameter>\n\
                   <parameter=note>\nNone\n</parameter>\n<parameter=tags>\n[\"a\", \"b\", 1, true]\n</parameter>\n\
                   <parameter=options>\n{\"unit\": \"metric\", \"n\": null}\n</parameter>\n\
                   <parameter=when>\nnull\n</parameter>\n</function>\n</tool_call>",
            reasoning: "User wants weather.",
            content: "Let me check.",
            calls: vec![(
                "get_weather",
                json!({"city": "San Francisco", "days": 3, "celsius": true, "threshold": -25.0, "note": null,
                       "tags": ["a", "b", 1, true], "options": {"unit": "metric", "n": null}, "when": null}),
            )],
        },
        // Two calls back to back (one delta when fed whole), text after the last call.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n\
                   <tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>\n\n\
                   Both requested.",
            reasoning: "",
            content: "Both requested.",
            calls: vec![("get_weather", json!({"city": "Paris"})), ("get_weather", json!({"city": "London"}))],
        },
        // A call from inside the thinking, without </think>.
        Case {
            thinking: true,
            text: "I need the weather.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n\
                   </function>\n</tool_call>",
            reasoning: "I need the weather.",
            content: "",
            calls: vec![("get_weather", json!({"city": "Oslo"}))],
        },
        // String values keep inner newlines, quotes, backslashes, unicode and XML-ish text; a literal
        // </parameter> and a whole literal tool call inside a value do not end it.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a \"b\"\\c.txt\n</parameter>\n\
                   <parameter=content>\nline 1\n\n  <b>bold</b> ✓ 日本\nsay </parameter> here\n\
                   <tool_call>\n<function=x>\n<parameter=y>\nz\n</parameter>\n</function>\n</tool_call>\nend\n\n</parameter>\n\
                   </function>\n</tool_call>",
            reasoning: "",
            content: "",
            calls: vec![(
                "write_file",
                json!({"path": "/tmp/a \"b\"\\c.txt",
                       "content": "line 1\n\n  <b>bold</b> ✓ 日本\nsay </parameter> here\n<tool_call>\n<function=x>\n<parameter=y>\nz\n</parameter>\n</function>\n</tool_call>\nend\n"}),
            )],
        },
        // Unknown function and parameters outside the schema: still a call, values converted
        // heuristically (JSON if it parses, else the string).
        Case {
            thinking: false,
            text: "<tool_call>\n<function=search_web>\n<parameter=query>\nrust lang\n</parameter>\n\
                   <parameter=limit>\n5\n</parameter>\n<parameter=flags>\n{\"safe\": true}\n</parameter>\n</function>\n</tool_call>",
            reasoning: "",
            content: "",
            calls: vec![("search_web", json!({"query": "rust lang", "limit": 5, "flags": {"safe": true}}))],
        },
        // Typed values that do not fit their type fall back instead of being invented.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n\
                   <parameter=celsius>\nmaybe\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
            reasoning: "",
            content: "",
            calls: vec![("get_weather", json!({"days": "three", "celsius": "maybe", "extra": 42}))],
        },
        // No parameters.
        Case {
            thinking: false,
            text: "Sure.<tool_call>\n<function=no_params>\n</function>\n</tool_call>",
            reasoning: "",
            content: "Sure.",
            calls: vec![("no_params", json!({}))],
        },
        // Missing </parameter> (the next declared parameter starts) and missing </function>.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</parameter>\n</tool_call>\nafter",
            reasoning: "",
            content: "after",
            calls: vec![("get_weather", json!({"city": "Rome", "days": 2}))],
        },
        // Missing </parameter> before </function>, then another call.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</function>\n</tool_call>\n\
                   <tool_call>\n<function=no_params>\n</function>\n</tool_call>",
            reasoning: "",
            content: "",
            calls: vec![("get_weather", json!({"city": "Bern"})), ("no_params", json!({}))],
        },
        // Missing both </parameter> and </function> at the very end.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</tool_call>",
            reasoning: "",
            content: "",
            calls: vec![("get_weather", json!({"days": 4}))],
        },
        // A bare <function=…> block without the <tool_call> wrapper.
        Case {
            thinking: false,
            text: "Calling now.\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>",
            reasoning: "",
            content: "Calling now.",
            calls: vec![("get_weather", json!({"city": "Lima"}))],
        },
        // Malformed: <tool_call> without a function, bad names, prose mentioning the tags — all
        // content, nothing dropped.
        Case {
            thinking: false,
            text: "Use <tool_call> tags.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>\n<tool_call><function=bad name>\n\
                   and a <function=inline> mention.",
            reasoning: "",
            content: "Use <tool_call> tags.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>\n<tool_call><function=bad name>\n\
                      and a <function=inline> mention.",
            calls: vec![],
        },
        // Truncated (max_tokens) in the middle of a value: the call is closed with what arrived.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=write_file>\n<parameter=path>\nnotes.md\n</parameter>\n<parameter=content>\n# Title\nFirst li",
            reasoning: "",
            content: "",
            calls: vec![("write_file", json!({"path": "notes.md", "content": "# Title\nFirst li"}))],
        },
        // Truncated before the function name is complete: content, not a call.
        Case {
            thinking: false,
            text: "Let me look.\n\n<tool_call>\n<function=get_wea",
            reasoning: "",
            content: "Let me look.\n\n<tool_call>\n<function=get_wea",
            calls: vec![],
        },
        // Stray text between parameters is kept as content.
        Case {
            thinking: false,
            text: "<tool_call>\n<function=get_weather>\noops, a < b \n c\n<parameter=city>\nKyiv\n</parameter>\n</function>\n</tool_call>",
            reasoning: "",
            content: "oops, a < b \n c",
            calls: vec![("get_weather", json!({"city": "Kyiv"}))],
        },
    ]
}

#[test]
fn one_shot_results() {
    for case in cases() {
        let r = run(case.thinking, Some(weather_tools()), &[case.text]);
        assert_eq!(
            r.parsed.reasoning, case.reasoning,
            "reasoning of {:?}",
            case.text
        );
        assert_eq!(r.parsed.content, case.content, "content of {:?}", case.text);
        let want: Vec<(String, Value)> = case
            .calls
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        assert_eq!(calls(&r.parsed), want, "calls of {:?}", case.text);
    }
}

/// Every single split point, one char at a time, and 300 random multi-piece splits per transcript.
#[test]
fn every_split_gives_the_one_shot_result() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for case in cases() {
        let text = case.text;
        let want = without_ids(&run(case.thinking, Some(weather_tools()), &[text]).parsed);
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();

        let mut splits: Vec<Vec<&str>> = vec![text
            .char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect()];
        for &a in &cuts {
            splits.push(vec![&text[..a], &text[a..]]);
        }
        for _ in 0..300 {
            let mut points: Vec<usize> = (0..rng.random_range(2..12))
                .map(|_| cuts[rng.random_range(0..cuts.len())])
                .collect();
            points.sort();
            let mut pieces = Vec::new();
            let mut start = 0;
            for p in points.into_iter().chain([text.len()]) {
                pieces.push(&text[start..p]);
                start = p;
            }
            splits.push(pieces);
        }
        for pieces in splits {
            let got = without_ids(&run(case.thinking, Some(weather_tools()), &pieces).parsed);
            assert_eq!(got, want, "{text:?} split as {pieces:?}");
        }
    }
}

use rand::{RngExt, SeedableRng};

#[test]
fn string_arguments_stream_before_the_call_ends() {
    let mut parser = OutputParser::new(false, Some(weather_tools()));
    let mut args_before_end = Vec::new();
    let text = "<tool_call>\n<function=write_file>\n<parameter=content>\nabcdefghijklmnopqrstuvwxyz\n</parameter>\n</function>\n</tool_call>";
    let mut ended = false;
    for chunk in text.as_bytes().chunks(4) {
        for e in parser.push(std::str::from_utf8(chunk).unwrap()) {
            match e {
                OutputEvent::ToolCallArguments { delta, .. } if !ended => {
                    args_before_end.push(delta)
                }
                OutputEvent::ToolCallEnd { .. } => ended = true,
                _ => {}
            }
        }
    }
    assert!(ended);
    assert!(
        args_before_end.len() > 5,
        "arguments were not streamed: {args_before_end:?}"
    );
    assert_eq!(
        args_before_end.concat(),
        r#"{"content": "abcdefghijklmnopqrstuvwxyz"}"#
    );
}

#[test]
fn two_calls_in_one_delta_both_surface() {
    let r = run(
        false,
        Some(weather_tools()),
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n\
           <tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>"],
    );
    assert_eq!(r.parsed.tool_calls.len(), 2);
    assert_ne!(r.parsed.tool_calls[0].id, r.parsed.tool_calls[1].id);
    let starts = r
        .events
        .iter()
        .filter(|e| matches!(e, OutputEvent::ToolCallStart { .. }))
        .count();
    assert_eq!(starts, 2);
}

#[test]
fn arguments_use_python_json_spacing() {
    let r = run(
        false,
        Some(weather_tools()),
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"],
    );
    assert_eq!(
        r.parsed.tool_calls[0].arguments,
        r#"{"city": "Paris", "days": 3}"#
    );
}

#[test]
fn without_tools_everything_is_text() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
    let r = run(false, None, &[text]);
    assert_eq!(r.parsed.content, text);
    assert!(r.parsed.tool_calls.is_empty());
}

#[test]
fn schema_types() {
    let t = |schema: Value| ParamType::from_schema(&schema);
    assert_eq!(
        t(json!({"type": "string"})),
        ParamType {
            kind: ValueKind::String,
            nullable: false
        }
    );
    assert_eq!(
        t(json!({"type": ["integer", "null"]})),
        ParamType {
            kind: ValueKind::Integer,
            nullable: true
        }
    );
    assert_eq!(
        t(json!({"oneOf": [{"type": "number"}, {"type": "null"}]})),
        ParamType {
            kind: ValueKind::Number,
            nullable: true
        }
    );
    assert_eq!(
        t(json!({"type": ["string", "integer"]})).kind,
        ValueKind::Unknown
    );
    assert_eq!(t(json!({"enum": ["a", "b"]})).kind, ValueKind::String);
    assert_eq!(t(json!({"properties": {}})).kind, ValueKind::Object);
    assert_eq!(t(json!({"$ref": "#/defs/x"})).kind, ValueKind::Unknown);

    let s = ParamType {
        kind: ValueKind::String,
        nullable: false,
    };
    assert_eq!(convert_value("null", s), json!("null")); // a non-nullable string stays a string
    assert_eq!(
        convert_value(
            " 42 ",
            ParamType {
                kind: ValueKind::Integer,
                nullable: false
            }
        ),
        json!(42)
    );
    assert_eq!(
        convert_value(
            "1.5",
            ParamType {
                kind: ValueKind::Integer,
                nullable: false
            }
        ),
        json!(1.5)
    );
    assert_eq!(
        convert_value(
            "FALSE",
            ParamType {
                kind: ValueKind::Boolean,
                nullable: false
            }
        ),
        json!(false)
    );
    assert_eq!(
        convert_value(
            "inf",
            ParamType {
                kind: ValueKind::Number,
                nullable: false
            }
        ),
        json!("inf")
    );
    assert_eq!(
        convert_value(
            "[1, 2",
            ParamType {
                kind: ValueKind::Array,
                nullable: false
            }
        ),
        json!("[1, 2")
    );
    assert_eq!(
        convert_value("plain words", ParamType::UNKNOWN),
        json!("plain words")
    );
}
