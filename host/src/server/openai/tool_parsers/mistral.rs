//! `mistral`: `[TOOL_CALLS]` followed by a JSON array of calls, or by
//! `name[ARGS]{...}` (newer tokenizers).

use super::{
    arguments_json, call_from_json, content_only, hold_from_marker, non_empty_trimmed,
    ParsedOutput, ParsedToolCall, Spec,
};
use serde_json::Value;

pub(super) const MISTRAL_MARKER: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";

pub(super) const SPEC: Spec = Spec {
    name: "mistral",
    parse,
    hold_from,
    plain: None,
};

pub(super) fn hold_from(text: &str) -> usize {
    hold_from_marker(text, MISTRAL_MARKER)
}

pub(super) fn parse(text: &str) -> ParsedOutput {
    let Some((before, after)) = text.split_once(MISTRAL_MARKER) else {
        return content_only(text);
    };
    let mut calls = Vec::new();
    for segment in after.split(MISTRAL_MARKER) {
        if parse_mistral_segment(segment, &mut calls).is_none() {
            return content_only(text);
        }
    }
    if calls.is_empty() {
        return content_only(text);
    }
    ParsedOutput {
        content: non_empty_trimmed(before),
        calls,
    }
}

/// One stretch after a `[TOOL_CALLS]`: a JSON array (or single object) of
/// calls in the older format, or `name[ARGS]{...}` in the newer one.
fn parse_mistral_segment(segment: &str, calls: &mut Vec<ParsedToolCall>) -> Option<()> {
    let segment = segment.trim();
    if segment.starts_with('[') || segment.starts_with('{') {
        match serde_json::from_str::<Value>(segment).ok()? {
            Value::Array(items) => {
                for item in &items {
                    calls.push(call_from_json(item)?);
                }
            }
            object => calls.push(call_from_json(&object)?),
        }
        return Some(());
    }
    let (name, arguments) = segment.split_once(MISTRAL_ARGS)?;
    let name = name.trim();
    if name.is_empty() || name.chars().any(char::is_whitespace) {
        return None;
    }
    let arguments = serde_json::from_str::<Value>(arguments).ok()?;
    calls.push(ParsedToolCall {
        name: name.to_string(),
        arguments: arguments_json(Some(&arguments))?,
    });
    Some(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;

    #[test]
    fn mistral_reads_a_json_array_call() {
        let output = Mistral.parse(
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris"}))]
        );
    }

    #[test]
    fn mistral_reads_parallel_calls_from_one_array() {
        let output = Mistral.parse(
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"n\": 1.5}}, {\"name\": \"b\", \"arguments\": {}}]",
        );
        assert_eq!(
            calls(&output),
            [call("a", json!({"n": 1.5})), call("b", json!({}))]
        );
    }

    #[test]
    fn mistral_reads_the_newer_name_args_form_repeated() {
        let output = Mistral.parse(
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [
                call("get_weather", json!({"city": "Paris"})),
                call("get_time", json!({}))
            ]
        );
    }

    #[test]
    fn mistral_keeps_text_before_the_marker_as_content() {
        let output =
            Mistral.parse("Let me look.\n[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]");
        assert_eq!(output.content.as_deref(), Some("Let me look."));
        assert_eq!(calls(&output), [call("f", json!({}))]);
    }

    #[test]
    fn mistral_invalid_json_is_all_content() {
        assert_all_content(
            Mistral,
            "Hi [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {,}}]",
        );
        assert_all_content(Mistral, "[TOOL_CALLS][{\"arguments\": {}}]");
        assert_all_content(Mistral, "[TOOL_CALLS]get weather[ARGS]{}");
        assert_all_content(Mistral, "[TOOL_CALLS]f[ARGS]{} and more");
        assert_all_content(Mistral, "[TOOL_CALLS][]");
    }

    #[test]
    fn mistral_truncated_output_is_all_content() {
        assert_all_content(Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"argu");
        assert_all_content(Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": ");
        assert_all_content(Mistral, "[TOOL_CALLS]f");
    }

    #[test]
    fn mistral_without_the_marker_is_all_content() {
        assert_all_content(Mistral, "[1, 2, 3] is a list.");
    }

    #[test]
    fn mistral_holds_from_the_marker_or_a_partial_one_at_the_end() {
        assert_eq!(Mistral.hold_from("Hello"), 5);
        assert_eq!(Mistral.hold_from("Hi [TOOL_CALLS][{"), 3);
        assert_eq!(Mistral.hold_from("Hi [TOOL"), 3);
        assert_eq!(Mistral.hold_from("Hi ["), 3);
        assert_eq!(Mistral.hold_from("[1]"), 3);
    }
}
