//! The reasoning/content splitter, fed whole and in every split.

use lily::chat::reasoning::{ReasoningParser, Segment};

/// Feed `pieces`; return (reasoning, content), checking that no empty segment is ever reported.
fn run(thinking: bool, tools: bool, pieces: &[&str]) -> (String, String) {
    let mut parser = ReasoningParser::new(thinking, tools);
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut collect = |segments: Vec<Segment>| {
        for s in segments {
            match s {
                Segment::Reasoning(t) => {
                    assert!(!t.is_empty(), "empty reasoning segment");
                    reasoning.push_str(&t)
                }
                Segment::Content(t) => {
                    assert!(!t.is_empty(), "empty content segment");
                    content.push_str(&t)
                }
            }
        }
    };
    for piece in pieces {
        collect(parser.push(piece));
    }
    collect(parser.finish());
    (reasoning, content)
}

/// Every way of cutting `text` into two pieces, every way into three, and one char at a time.
fn all_splits(text: &str) -> Vec<Vec<&str>> {
    let cuts: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let mut out = vec![text
        .char_indices()
        .map(|(i, c)| &text[i..i + c.len_utf8()])
        .collect()];
    for &a in &cuts {
        out.push(vec![&text[..a], &text[a..]]);
        for &b in cuts.iter().filter(|&&b| b >= a) {
            out.push(vec![&text[..a], &text[a..b], &text[b..]]);
        }
    }
    out
}

/// (thinking, tools, generated text, expected reasoning, expected content)
const CASES: &[(bool, bool, &str, &str, &str)] = &[
    // The Qwen3.6 shape: `<think>\n` is in the prompt.
    (
        true,
        false,
        "Let me think.\nSo 2+2=4.\n</think>\n\nThe answer is 4.",
        "Let me think.\nSo 2+2=4.",
        "The answer is 4.",
    ),
    // Truncated inside the thinking: all reasoning, trailing newlines dropped.
    (
        true,
        false,
        "Still thinking about it\n\n",
        "Still thinking about it",
        "",
    ),
    // A model that opens <think> itself (older template), thinking on or off.
    (
        true,
        false,
        "<think>\nplan\n</think>\n\nanswer",
        "plan",
        "answer",
    ),
    (
        false,
        false,
        "<think>\nplan\n</think>\n\nanswer",
        "plan",
        "answer",
    ),
    // Thinking off: all content, tags in the middle are just text.
    (
        false,
        false,
        "Use <think> and </think> tags.\n",
        "",
        "Use <think> and </think> tags.\n",
    ),
    // Newlines inside the reasoning survive; only the edges are trimmed.
    (
        true,
        false,
        "\nfirst\n\n\nsecond\n</think>\n\n\nbody\n\nmore",
        "first\n\n\nsecond",
        "body\n\nmore",
    ),
    // Reasoning mentioning tags that are not the end tag.
    (
        true,
        false,
        "a <b> c </thinking> d < e\n</think>\ndone",
        "a <b> c </thinking> d < e",
        "done",
    ),
    // A tool call inside the thinking ends the reasoning when the request has tools...
    (
        true,
        true,
        "I should call it.\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        "I should call it.",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ),
    // ...and stays reasoning without tools.
    (
        true,
        false,
        "x <tool_call>\n<function=f>\n</function>\n</tool_call>",
        "x <tool_call>\n<function=f>\n</function>\n</tool_call>",
        "",
    ),
    // Prose mentioning <tool_call> without a function tag stays reasoning.
    (
        true,
        true,
        "the <tool_call> tag wraps calls\n</think>\n\nok",
        "the <tool_call> tag wraps calls",
        "ok",
    ),
    // Empty reasoning (budget 0 forced </think> at once).
    (true, false, "</think>\n\nquick answer", "", "quick answer"),
    // Output ending in a partial tag: released as text at the end.
    (true, false, "almost </thi", "almost </thi", ""),
    (
        true,
        true,
        "call <tool_call>\n<func",
        "call <tool_call>\n<func",
        "",
    ),
    (false, false, "<thi", "", "<thi"),
    // Unicode on both sides.
    (
        true,
        false,
        "überlegen… ✓\n</think>\n\n答案是 4",
        "überlegen… ✓",
        "答案是 4",
    ),
    // After </think>, a later </think> is content.
    (
        true,
        false,
        "r</think>\n\na </think> b",
        "r",
        "a </think> b",
    ),
];

#[test]
fn one_shot_results() {
    for &(thinking, tools, text, reasoning, content) in CASES {
        assert_eq!(
            run(thinking, tools, &[text]),
            (reasoning.to_string(), content.to_string()),
            "{text:?}"
        );
    }
}

#[test]
fn every_split_gives_the_one_shot_result() {
    for &(thinking, tools, text, reasoning, content) in CASES {
        let want = (reasoning.to_string(), content.to_string());
        for pieces in all_splits(text) {
            assert_eq!(
                run(thinking, tools, &pieces),
                want,
                "{text:?} split as {pieces:?}"
            );
        }
    }
}

#[test]
fn reasoning_streams_without_waiting_for_the_end() {
    let mut p = ReasoningParser::new(true, true);
    assert!(p.in_reasoning());
    assert_eq!(
        p.push("Thinking hard"),
        vec![Segment::Reasoning("Thinking hard".into())]
    );
    // A trailing newline may precede </think>: held back until decided.
    assert_eq!(p.push(" now\n"), vec![Segment::Reasoning(" now".into())]);
    assert_eq!(p.push("more"), vec![Segment::Reasoning("\nmore".into())]);
    assert_eq!(p.push("</th"), vec![]);
    assert_eq!(p.push("ink>\n\nHi"), vec![Segment::Content("Hi".into())]);
    assert!(!p.in_reasoning());
    assert_eq!(p.push(" there"), vec![Segment::Content(" there".into())]);
    assert_eq!(p.finish(), vec![]);
}
