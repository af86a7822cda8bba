//! `llama3_json` (Llama 3.1/3.2): one or more `;`-separated JSON objects,
//! optionally after `<|python_tag|>`.

use super::{
    call_from_json, content_only, hold_if_starts_like, json_prefix, ParsedOutput, ParsedToolCall,
    Spec,
};

const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";

pub(super) fn parse(text: &str) -> ParsedOutput {
    match parse_llama3_calls(text) {
        Some(calls) => ParsedOutput {
            content: None,
            calls,
        },
        None => content_only(text),
    }
}

pub(super) const SPEC: Spec = Spec {
    name: "llama3_json",
    parse,
    hold_from,
    plain: None,
};

pub(super) fn hold_from(text: &str) -> usize {
    hold_if_starts_like(text, '{', LLAMA_PYTHON_TAG)
}

/// All or nothing, like vLLM: one stray character makes the whole output
/// content, since a partial reading could call a tool the model did not mean.
fn parse_llama3_calls(text: &str) -> Option<Vec<ParsedToolCall>> {
    let trimmed = text.trim_start();
    let mut rest = trimmed.strip_prefix(LLAMA_PYTHON_TAG).unwrap_or(trimmed);
    let mut calls = Vec::new();
    loop {
        let object_text = rest.trim_start();
        if !object_text.starts_with('{') {
            return None;
        }
        let (value, used) = json_prefix(object_text)?;
        calls.push(call_from_json(&value)?);
        let after = object_text.get(used..)?.trim_start();
        if after.is_empty() {
            return Some(calls);
        }
        rest = after.strip_prefix(';')?;
        if rest.trim().is_empty() {
            return Some(calls);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;

    #[test]
    fn llama3_reads_a_single_call_with_parameters() {
        let output = Llama3Json.parse(
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris", "days": 3}))]
        );
    }

    #[test]
    fn llama3_accepts_the_python_tag_and_arguments() {
        let output =
            Llama3Json.parse("\n<|python_tag|>{\"name\": \"f\", \"arguments\": {\"a\": true}}");
        assert_eq!(calls(&output), [call("f", json!({"a": true}))]);
    }

    #[test]
    fn llama3_reads_parallel_calls_separated_by_semicolons() {
        let output = Llama3Json.parse(
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": null}};",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("a", json!({})), call("b", json!({"x": null}))]
        );
    }

    #[test]
    fn llama3_text_before_the_json_makes_it_all_content() {
        assert_all_content(Llama3Json, "Calling: {\"name\": \"f\", \"parameters\": {}}");
        assert_all_content(Llama3Json, "The answer is 4.");
    }

    #[test]
    fn llama3_invalid_json_is_all_content() {
        assert_all_content(Llama3Json, "{\"name\": \"f\", \"parameters\": {a: 1}}");
        assert_all_content(Llama3Json, "{\"parameters\": {}}");
        assert_all_content(
            Llama3Json,
            "{\"name\": \"f\", \"parameters\": {}} trailing words",
        );
        assert_all_content(Llama3Json, "<|python_tag|>brave_search.call(query=\"x\")");
    }

    #[test]
    fn llama3_a_truncated_second_call_makes_it_all_content() {
        assert_all_content(
            Llama3Json,
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"para",
        );
    }

    #[test]
    fn llama3_holds_while_the_output_may_still_be_a_call() {
        assert_eq!(Llama3Json.hold_from(""), 0);
        assert_eq!(Llama3Json.hold_from("  "), 0);
        assert_eq!(Llama3Json.hold_from(" {\"na"), 0);
        assert_eq!(Llama3Json.hold_from("<|pyth"), 0);
        assert_eq!(Llama3Json.hold_from("<|python_tag|>{"), 0);
        assert_eq!(Llama3Json.hold_from("Hello"), 5);
        assert_eq!(Llama3Json.hold_from("<b>"), 3);
    }
}
