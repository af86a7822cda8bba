//! `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

use super::{call_from_json, hold_from_marker, non_empty_trimmed, ParsedOutput, Spec};
use serde_json::Value;

pub(super) const HERMES_START: &str = "<tool_call>";
pub(super) const HERMES_END: &str = "</tool_call>";

pub(super) const SPEC: Spec = Spec {
    name: "hermes",
    parse,
    hold_from,
    plain: None,
};

pub(super) fn hold_from(text: &str) -> usize {
    hold_from_marker(text, HERMES_START)
}

pub(super) fn parse(text: &str) -> ParsedOutput {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some((before, after_start)) = rest.split_once(HERMES_START) {
        content.push_str(before);
        // An unclosed block runs to the end: generation may stop on the
        // end-of-turn token right after the JSON, before `</tool_call>`.
        let (body, after_block, closed) = match after_start.split_once(HERMES_END) {
            Some((body, after)) => (body, after, true),
            None => (after_start, "", false),
        };
        match serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|value| call_from_json(&value))
        {
            Some(call) => calls.push(call),
            None => {
                content.push_str(HERMES_START);
                content.push_str(body);
                if closed {
                    content.push_str(HERMES_END);
                }
            }
        }
        rest = after_block;
    }
    content.push_str(rest);
    ParsedOutput {
        content: non_empty_trimmed(&content),
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;

    #[test]
    fn hermes_reads_a_single_call_and_leaves_no_content() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris"}))]
        );
        assert_eq!(output.calls[0].arguments, r#"{"city":"Paris"}"#);
    }

    #[test]
    fn hermes_reads_parallel_calls_in_order() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"n\": 1}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("a", json!({"n": 1})), call("b", json!({}))]
        );
    }

    #[test]
    fn hermes_keeps_text_before_the_call_as_trimmed_content() {
        let text = "Let me check.\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content.as_deref(), Some("Let me check."));
        assert_eq!(calls(&output), [call("get_time", json!({}))]);
    }

    #[test]
    fn hermes_keeps_text_between_and_after_blocks() {
        let text = "A <tool_call>{\"name\": \"x\"}</tool_call> B <tool_call>{\"name\": \"y\"}</tool_call> C";
        let output = Hermes.parse(text);
        assert_eq!(output.content.as_deref(), Some("A  B  C"));
        assert_eq!(calls(&output), [call("x", json!({})), call("y", json!({}))]);
    }

    #[test]
    fn hermes_leaves_a_block_with_invalid_json_as_content() {
        let bad = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"n\": }\n</tool_call>";
        assert_all_content(Hermes, bad);

        let text =
            format!("{bad}\n<tool_call>{{\"name\": \"b\", \"arguments\": {{}}}}</tool_call>");
        let output = Hermes.parse(&text);
        assert_eq!(output.content.as_deref(), Some(bad));
        assert_eq!(calls(&output), [call("b", json!({}))]);
    }

    #[test]
    fn hermes_leaves_a_block_without_a_string_name_as_content() {
        assert_all_content(Hermes, "<tool_call>{\"arguments\": {}}</tool_call>");
        assert_all_content(Hermes, "<tool_call>{\"name\": 3}</tool_call>");
        assert_all_content(Hermes, "<tool_call>[1, 2]</tool_call>");
    }

    #[test]
    fn hermes_accepts_a_final_block_without_its_end_tag_if_the_json_is_complete() {
        let output =
            Hermes.parse("Sure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1]}}\n");
        assert_eq!(output.content.as_deref(), Some("Sure."));
        assert_eq!(calls(&output), [call("f", json!({"a": [1]}))]);
    }

    #[test]
    fn hermes_keeps_a_truncated_call_as_content() {
        assert_all_content(Hermes, "Sure. <tool_call>\n{\"name\": \"f\", \"argum");
        assert_all_content(Hermes, "<tool_call>");
    }

    #[test]
    fn hermes_accepts_parameters_and_string_encoded_arguments() {
        let output =
            Hermes.parse("<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 1}}</tool_call>");
        assert_eq!(calls(&output), [call("f", json!({"a": 1}))]);

        let output =
            Hermes.parse(r#"<tool_call>{"name": "f", "arguments": "{\"a\": \"b\"}"}</tool_call>"#);
        assert_eq!(calls(&output), [call("f", json!({"a": "b"}))]);
        assert_eq!(output.calls[0].arguments, r#"{"a":"b"}"#);
    }

    #[test]
    fn hermes_rejects_arguments_that_are_not_an_object() {
        assert_all_content(
            Hermes,
            r#"<tool_call>{"name": "f", "arguments": "not json"}</tool_call>"#,
        );
        assert_all_content(
            Hermes,
            r#"<tool_call>{"name": "f", "arguments": [1]}</tool_call>"#,
        );
    }

    #[test]
    fn hermes_without_a_block_is_all_content() {
        assert_all_content(Hermes, "  The weather is fine.  ");
        assert_eq!(Hermes.parse(""), ParsedOutput::default());
        assert_eq!(Hermes.parse(" \n "), ParsedOutput::default());
    }

    #[test]
    fn hermes_holds_from_the_start_tag_or_a_partial_one_at_the_end() {
        assert_eq!(Hermes.hold_from("Hello"), 5);
        assert_eq!(Hermes.hold_from(""), 0);
        assert_eq!(Hermes.hold_from("Hi <tool_call>{\"na"), 3);
        assert_eq!(Hermes.hold_from("Hi <"), 3);
        assert_eq!(Hermes.hold_from("Hi <tool_cal"), 3);
        assert_eq!(Hermes.hold_from("a < b"), 5);
        assert_eq!(Hermes.hold_from("x<<tool"), 2);
        assert_eq!(Hermes.hold_from("é<tool_call>"), "é".len());
    }
}
