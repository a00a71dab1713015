//! The chat template renderer against jinja2: every case in tests/fixtures/chat_template/cases.json
//! (written by tools/make_template_fixtures.py with jinja2 configured as transformers configures
//! it) must render byte for byte the same, or fail the same way.

use lily::chat::template::{ChatInput, ChatTemplate, TemplateError, QWEN36_TEMPLATE};
use serde::Deserialize;

const CASES: &str = include_str!("fixtures/chat_template/cases.json");

#[derive(Deserialize)]
struct Fixtures {
    /// The Qwen3.6 template source the fixtures were rendered from.
    qwen_template: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    /// A template of its own; the Qwen3.6 template when absent.
    template: Option<String>,
    #[serde(flatten)]
    input: ChatInput,
    expected: Option<String>,
    error: Option<ExpectedError>,
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum ExpectedError {
    /// raise_exception(message) in the template: the message must match exactly.
    Raised { message: String },
    /// Rejected before rendering; the message must name the offending field.
    InvalidInput { contains: String },
    /// Any other template failure; engines word these differently, so only the kind is checked.
    Render,
}

fn load() -> Fixtures {
    serde_json::from_str(CASES).expect("cases.json parses")
}

fn fixtures() -> Vec<Case> {
    load().cases
}

/// Where two renderings first differ, with some context, for a readable failure.
fn first_difference(expected: &str, actual: &str) -> String {
    let at = expected
        .bytes()
        .zip(actual.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    let around = |s: &str| {
        let mut start = at.saturating_sub(40).min(s.len());
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 40).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at} (lengths {} vs {}):\n  expected {}\n  actual   {}",
        expected.len(),
        actual.len(),
        around(expected),
        around(actual)
    )
}

/// Checks one case; `None` when it passes, else what went wrong.
fn check(case: &Case, qwen: &ChatTemplate) -> Option<String> {
    let own;
    let template = match &case.template {
        Some(source) => match ChatTemplate::from_source(source) {
            Ok(t) => {
                own = t;
                &own
            }
            Err(e) => return Some(format!("template does not compile: {e}")),
        },
        None => qwen,
    };
    let result = template.render(&case.input);
    match (&case.expected, &case.error, result) {
        (Some(expected), _, Ok(actual)) if *expected == actual => None,
        (Some(expected), _, Ok(actual)) => Some(first_difference(expected, &actual)),
        (Some(_), _, Err(e)) => Some(format!("expected a rendering, got error {e:?}")),
        (None, Some(expected), Ok(actual)) => Some(format!(
            "expected error {:?}, rendered {actual:?}",
            kind_of(expected)
        )),
        (None, Some(expected), Err(e)) => match (expected, &e) {
            (ExpectedError::Raised { message }, TemplateError::Raised(actual))
                if message == actual =>
            {
                None
            }
            (ExpectedError::InvalidInput { contains }, TemplateError::InvalidInput(actual))
                if actual.contains(contains.as_str()) =>
            {
                None
            }
            (ExpectedError::Render, TemplateError::Render(_)) => None,
            (expected, e) => Some(format!("expected error {:?}, got {e:?}", kind_of(expected))),
        },
        (None, None, _) => Some("case has neither `expected` nor `error`".to_string()),
    }
}

fn kind_of(e: &ExpectedError) -> String {
    match e {
        ExpectedError::Raised { message } => format!("raised {message:?}"),
        ExpectedError::InvalidInput { contains } => format!("invalid input naming {contains:?}"),
        ExpectedError::Render => "render failure".to_string(),
    }
}

#[test]
fn every_case_matches_jinja2() {
    let qwen = ChatTemplate::qwen36();
    let cases = fixtures();
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| check(case, &qwen).map(|why| format!("{}: {why}", case.name)))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from jinja2:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn fixtures_cover_what_they_must() {
    let cases = fixtures();
    let qwen_renders = cases
        .iter()
        .filter(|c| c.template.is_none() && c.expected.is_some())
        .count();
    assert!(qwen_renders >= 30, "only {qwen_renders} Qwen3.6 renderings");
    assert!(cases
        .iter()
        .any(|c| matches!(c.error, Some(ExpectedError::Raised { .. }))));
    assert!(cases
        .iter()
        .any(|c| matches!(c.error, Some(ExpectedError::InvalidInput { .. }))));
}

#[test]
fn fixtures_were_made_from_the_built_in_template() {
    // Regenerate the fixtures (tools/make_template_fixtures.py) after changing the asset.
    assert!(
        load().qwen_template == QWEN36_TEMPLATE,
        "cases.json was rendered from another template"
    );
}

#[test]
fn a_wrong_expectation_is_caught() {
    // The comparison itself must be able to fail.
    let qwen = ChatTemplate::qwen36();
    let mut case = fixtures()
        .into_iter()
        .find(|c| c.name == "single_user")
        .expect("case single_user");
    let expected = case.expected.take().expect("single_user renders");
    case.expected = Some(format!("{expected} "));
    assert!(check(&case, &qwen).is_some());
}
