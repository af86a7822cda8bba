//! `openai` (gpt-oss): harmony messages addressed to a function,
//! `<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>`,
//! are calls of `get_weather` with that JSON object as arguments.
//!
//! It reads the answer that the `openai_gptoss` reasoning parser leaves
//! (plain text, and calls in a canonical harmony form; the server puts
//! that parser in front of this one). Read from raw harmony, a message
//! without a recipient is content unless it is in the `analysis` channel,
//! which is reasoning, not content (as vLLM's parser of this name reads
//! it). Markers never reach the content; a call whose body is not a JSON
//! object (cut off by max_tokens) is content, its markers dropped.

use super::{
    arguments_json, hold_from_marker, non_empty_trimmed, ParsedOutput, ParsedToolCall, Spec,
};
use crate::server::openai::harmony;
use serde_json::Value;
use std::borrow::Cow;

pub(super) const SPEC: Spec = Spec {
    name: "openai",
    parse,
    hold_from,
    plain: Some(plain),
};

/// Reads `text`: its content (untrimmed) and, if `read_calls`, its calls.
fn read(text: &str, read_calls: bool) -> (String, Vec<ParsedToolCall>) {
    let (mut content, mut calls) = (String::new(), Vec::new());
    for part in harmony::parse(text, true) {
        let m = match part {
            harmony::Part::Loose(r) => {
                content.push_str(text.get(r).unwrap_or(""));
                continue;
            }
            harmony::Part::Message(m) => m,
        };
        let body = text.get(m.body.clone()).unwrap_or("");
        let name = m
            .recipient
            .as_deref()
            .and_then(|r| r.strip_prefix("functions."))
            .filter(|n| !n.is_empty());
        let call = name.filter(|_| read_calls).and_then(|name| {
            let value = serde_json::from_str::<Value>(body.trim()).ok()?;
            Some(ParsedToolCall {
                name: name.to_string(),
                arguments: value.is_object().then(|| arguments_json(Some(&value)))??,
            })
        });
        match call {
            Some(call) => calls.push(call),
            None if m.channel == "analysis" && m.recipient.is_none() => {}
            None => content.push_str(body),
        }
    }
    (content, calls)
}

pub(super) fn parse(text: &str) -> ParsedOutput {
    let (content, calls) = read(text, true);
    ParsedOutput {
        content: non_empty_trimmed(&content),
        calls,
    }
}

/// The output as content when it holds no call: without its markers.
fn plain(text: &str) -> Cow<'_, str> {
    Cow::Owned(read(text, false).0)
}

/// Holds from the first marker (a call's header), or from a tail that may
/// still become one.
pub(super) fn hold_from(text: &str) -> usize {
    [
        harmony::CHANNEL,
        harmony::START,
        harmony::MESSAGE,
        harmony::END,
        harmony::CALL,
        harmony::RETURN,
        harmony::CONSTRAIN,
    ]
    .into_iter()
    .map(|m| hold_from_marker(text, m))
    .min()
    .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;

    const CALL: &str = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Paris\"}<|call|>";

    #[test]
    fn openai_reads_a_call_addressed_to_a_function() {
        let output = OpenAi.parse(CALL);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"location": "Paris"}))]
        );
        assert_eq!(output.content, None);
        // The canonical form the reasoning parser leaves, after text.
        let output = OpenAi.parse(
            "Let me check.<|channel|>commentary to=functions.f<|message|>{}<|call|><|channel|>commentary to=functions.g<|message|>{\"a\": [1]}",
        );
        assert_eq!(
            calls(&output),
            [call("f", json!({})), call("g", json!({"a": [1]}))]
        );
        assert_eq!(output.content.as_deref(), Some("Let me check."));
    }

    #[test]
    fn openai_reads_raw_harmony_without_its_reasoning() {
        let text =
            format!("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant{CALL}");
        let output = OpenAi.parse(&text);
        assert_eq!(output.calls.len(), 1);
        assert_eq!(output.content, None);
        let output = OpenAi.parse(
            "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
        );
        assert!(output.calls.is_empty());
        assert_eq!(output.content.as_deref(), Some("Sunny."));
    }

    #[test]
    fn openai_a_cut_or_invalid_call_is_content_without_markers() {
        for text in [
            "<|channel|>commentary to=functions.f<|message|>{\"location\": \"Pa",
            "<|channel|>commentary to=functions.f<|message|>[1]<|call|>",
            "<|channel|>commentary to=functions.<|message|>{}<|call|>",
        ] {
            let output = OpenAi.parse(text);
            assert!(output.calls.is_empty(), "{text}");
            let content = output.content.unwrap_or_default();
            assert!(!content.contains("<|"), "{content}");
            assert_eq!(content, OpenAi.plain(text).trim(), "{text}");
        }
        // Cut in a marker: no part of it.
        assert_eq!(OpenAi.plain("Hi<|chan"), "Hi");
    }

    #[test]
    fn openai_holds_from_a_call_or_a_partial_marker() {
        assert_eq!(OpenAi.hold_from("Sure."), 5);
        assert_eq!(OpenAi.hold_from("Sure.<|chan"), 5);
        assert_eq!(OpenAi.hold_from("Sure.<"), 5);
        assert_eq!(OpenAi.hold_from(&format!("Sure.{CALL}")), 5);
        assert_eq!(OpenAi.hold_from("a < b"), 5);
    }
}
