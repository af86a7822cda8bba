//! The SSE events of a streamed Messages response, in Anthropic's order:
//! `message_start`, `ping`, then per content block `content_block_start`,
//! its `content_block_delta`s (`text_delta`, `thinking_delta` then a
//! `signature_delta`, `input_json_delta`) and `content_block_stop`, and at
//! the end `message_delta` (stop reason, usage) and `message_stop`. A
//! failure mid-stream is an `error` event.

use crate::server::errors::ApiError;
use bytes::Bytes;
use serde_json::{json, Value};

/// One SSE event: its name, and its data with `type` set to the name.
pub fn event(kind: &str, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The `error` event of a failure after the stream began.
pub fn error_event(e: &ApiError) -> Bytes {
    event(
        "error",
        json!({"error": super::error_body(e)["error"].clone()}),
    )
}

/// A thinking block's signature. Anthropic's clients send it back with the
/// block; this server signs nothing, so it is only a unique token.
pub fn signature() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Text,
    Thinking,
    ToolUse,
}

/// The content blocks of one streamed message: which is open and the
/// index of the next.
#[derive(Default)]
pub struct Blocks {
    open: Option<Kind>,
    next: usize,
}

impl Blocks {
    fn index(&self) -> usize {
        self.next.saturating_sub(1)
    }

    fn start(&mut self, kind: Kind, block: Value, out: &mut Vec<Bytes>) {
        self.close(out);
        out.push(event(
            "content_block_start",
            json!({"index": self.next, "content_block": block}),
        ));
        self.open = Some(kind);
        self.next += 1;
    }

    fn delta(&self, delta: Value, out: &mut Vec<Bytes>) {
        out.push(event(
            "content_block_delta",
            json!({"index": self.index(), "delta": delta}),
        ));
    }

    /// Answer text, in the open text block or a new one.
    pub fn text(&mut self, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(Kind::Text) {
            self.start(Kind::Text, json!({"type": "text", "text": ""}), out);
        }
        self.delta(json!({"type": "text_delta", "text": text}), out);
    }

    /// Reasoning, in the open thinking block or a new one.
    pub fn thinking(&mut self, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(Kind::Thinking) {
            self.start(
                Kind::Thinking,
                json!({"type": "thinking", "thinking": "", "signature": ""}),
                out,
            );
        }
        self.delta(json!({"type": "thinking_delta", "thinking": text}), out);
    }

    /// Opens a `tool_use` block; its input follows as [`Blocks::input_json`].
    pub fn tool_use(&mut self, id: &str, name: &str, out: &mut Vec<Bytes>) {
        self.start(
            Kind::ToolUse,
            json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
            out,
        );
    }

    /// A piece of the open `tool_use` block's input JSON.
    pub fn input_json(&mut self, partial: &str, out: &mut Vec<Bytes>) {
        if self.open == Some(Kind::ToolUse) && !partial.is_empty() {
            self.delta(
                json!({"type": "input_json_delta", "partial_json": partial}),
                out,
            );
        }
    }

    /// Closes the open block (a thinking block gets its signature first).
    pub fn close(&mut self, out: &mut Vec<Bytes>) {
        let Some(kind) = self.open.take() else {
            return;
        };
        if kind == Kind::Thinking {
            self.delta(
                json!({"type": "signature_delta", "signature": signature()}),
                out,
            );
        }
        out.push(event("content_block_stop", json!({"index": self.index()})));
    }

    /// Closes the message: the open block, the stop reason and usage, and
    /// `message_stop`.
    pub fn finish(
        &mut self,
        stop_reason: &str,
        stop_sequence: Value,
        input_tokens: usize,
        output_tokens: usize,
        out: &mut Vec<Bytes>,
    ) {
        self.close(out);
        out.push(event(
            "message_delta",
            json!({
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            }),
        ));
        out.push(event("message_stop", json!({})));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(out: &[Bytes]) -> Vec<String> {
        out.iter()
            .map(|b| {
                let s = String::from_utf8_lossy(b);
                let data: Value = serde_json::from_str(
                    s.lines()
                        .find_map(|l| l.strip_prefix("data: "))
                        .expect("data line"),
                )
                .expect("json");
                let t = data["type"].as_str().unwrap_or("").to_string();
                match data["delta"]["type"].as_str() {
                    Some(d) => format!("{t}:{d}@{}", data["index"]),
                    None => match data["index"].as_u64() {
                        Some(i) => format!("{t}@{i}"),
                        None => t,
                    },
                }
            })
            .collect()
    }

    #[test]
    fn blocks_open_and_close_in_order() {
        let mut b = Blocks::default();
        let mut out = Vec::new();
        b.thinking("hm", &mut out);
        b.thinking("m", &mut out);
        b.text("Hi", &mut out);
        b.tool_use("toolu_1", "f", &mut out);
        b.input_json("{\"a\":", &mut out);
        b.input_json("1}", &mut out);
        b.finish("tool_use", Value::Null, 3, 4, &mut out);
        assert_eq!(
            kinds(&out),
            [
                "content_block_start@0",
                "content_block_delta:thinking_delta@0",
                "content_block_delta:thinking_delta@0",
                "content_block_delta:signature_delta@0",
                "content_block_stop@0",
                "content_block_start@1",
                "content_block_delta:text_delta@1",
                "content_block_stop@1",
                "content_block_start@2",
                "content_block_delta:input_json_delta@2",
                "content_block_delta:input_json_delta@2",
                "content_block_stop@2",
                "message_delta",
                "message_stop",
            ]
        );
    }

    #[test]
    fn a_message_without_content_still_closes() {
        let mut b = Blocks::default();
        let mut out = Vec::new();
        b.text("", &mut out);
        b.finish("max_tokens", Value::Null, 3, 0, &mut out);
        assert_eq!(kinds(&out), ["message_delta", "message_stop"]);
    }
}
