//! Extraction of OpenAI tool calls from generated text, for `tool_choice: "auto"`.
//!
//! Models that were trained for tool use write their calls into the ordinary
//! output in a model-specific format. The server is told which one with
//! `--tool-call-parser`, and this module turns a generation into the message
//! content the user sees plus a list of `tool_calls`. The accepted formats are
//! those of vLLM's parsers of the same names, so that deployments can switch
//! servers without changing flags:
//!
//! - `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
//! - `llama3_json` (Llama 3.1/3.2): one or more `;`-separated JSON objects,
//!   optionally after `<|python_tag|>`.
//! - `mistral`: `[TOOL_CALLS]` followed by a JSON array of calls, or by
//!   `name[ARGS]{...}` (newer tokenizers).
//! - `pythonic` (Llama 3.2, Llama 4): a Python list of calls with keyword arguments,
//!   `[get_weather(city="Paris"), get_time()]`.
//! - `openai` (gpt-oss): harmony messages addressed `to=functions.NAME`.
//!
//! Model output is untrusted, so nothing here panics, and text that does not
//! form a well-formed call is handed back as content rather than dropped.
//!
//! Streaming uses two steps: while tokens arrive,
//! [`ToolCallParser::hold_from`] says how much of the text so far can safely
//! go out as content; once generation ends, [`ToolCallParser::parse`] splits
//! the complete text.
use serde_json::Value;
use std::borrow::Cow;

/// Which format the model writes tool calls in (`--tool-call-parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>` blocks holding one JSON call each (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// Bare JSON calls separated by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2).
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` per call (Mistral).
    Mistral,
    /// A Python list of keyword-argument calls, optionally inside
    /// `<|python_start|>`/`<|python_end|>` (Llama 3.2, Llama 4).
    Pythonic,
    /// Harmony messages addressed `to=functions.NAME` (gpt-oss).
    OpenAi,
}

/// One tool call found in the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedToolCall {
    /// The function's name as the model wrote it.
    pub name: String,
    /// The arguments as a JSON object serialized compactly (serde_json::to_string of a Value).
    pub arguments: String,
}

/// A complete generation split into what the user reads and what the tools get.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ParsedOutput {
    /// Text outside the tool calls, trimmed; None if empty (OpenAI sends content null when a message only calls tools).
    pub content: Option<String>,
    /// The calls in the order the model wrote them; empty when the output
    /// holds no well-formed call, in which case `content` is the whole output.
    pub calls: Vec<ParsedToolCall>,
}

mod hermes;
mod llama3_json;
mod mistral;
mod openai;
mod pythonic;

/// One parser: its `--tool-call-parser` name and its two entry points
/// (see [`ToolCallParser::parse`] and [`ToolCallParser::hold_from`]). Each
/// parser's file defines its `SPEC`.
struct Spec {
    name: &'static str,
    parse: fn(&str) -> ParsedOutput,
    hold_from: fn(&str) -> usize,
    /// The output as content when it holds no call; `None`: as written.
    plain: Option<fn(&str) -> Cow<'_, str>>,
}

impl ToolCallParser {
    /// The names, for help texts and errors (those of [`Self::ALL`], in order).
    pub const NAMES: &'static [&'static str] =
        &["hermes", "llama3_json", "mistral", "pythonic", "openai"];

    /// Every parser: the registry that names are looked up in.
    pub const ALL: &'static [ToolCallParser] = &[
        ToolCallParser::Hermes,
        ToolCallParser::Llama3Json,
        ToolCallParser::Mistral,
        ToolCallParser::Pythonic,
        ToolCallParser::OpenAi,
    ];

    /// The parser's file's entry.
    fn spec(self) -> &'static Spec {
        match self {
            ToolCallParser::Hermes => &hermes::SPEC,
            ToolCallParser::Llama3Json => &llama3_json::SPEC,
            ToolCallParser::Mistral => &mistral::SPEC,
            ToolCallParser::Pythonic => &pythonic::SPEC,
            ToolCallParser::OpenAi => &openai::SPEC,
        }
    }

    /// Parses a `--tool-call-parser` value (one of [`Self::NAMES`]); the error message lists the known names.
    pub fn from_name(name: &str) -> Result<ToolCallParser, String> {
        Self::ALL
            .iter()
            .copied()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown tool call parser {name:?}; known parsers: {}",
                    Self::NAMES.join(", ")
                )
            })
    }

    /// The `--tool-call-parser` value that selects this parser.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Splits the complete output into the text the user sees and the tool calls.
    ///
    /// Never fails: output that is not a well-formed call in this parser's
    /// format comes back as content, so no generated text is lost.
    pub fn parse(self, text: &str) -> ParsedOutput {
        (self.spec().parse)(text)
    }

    /// For streaming: the byte offset in `text` (text generated so far) from which output must be held back because a tool call has started or may be starting (a prefix of the start marker at the end of text counts as "may be starting"). `text.len()` means everything so far can be sent as content.
    ///
    /// The result is always a char boundary of `text`. Marker formats
    /// (`hermes`, `mistral`) hold from the first marker, or from a partial
    /// marker at the very end. Formats whose calls fill the whole output
    /// (`llama3_json`, `pythonic`) hold everything while the output is empty
    /// or starts like a call, and nothing once it clearly does not.
    pub fn hold_from(self, text: &str) -> usize {
        (self.spec().hold_from)(text)
    }

    /// The output as the content the user sees when it holds no call (or
    /// the part of it not yet sent as content while streaming): the text
    /// as written, but for formats with markers that are never content
    /// (`openai`'s harmony markers).
    pub fn plain(self, text: &str) -> Cow<'_, str> {
        match self.spec().plain {
            Some(plain) => plain(text),
            None => Cow::Borrowed(text),
        }
    }
}

/// The whole text as content, for outputs that hold no call.
fn content_only(text: &str) -> ParsedOutput {
    ParsedOutput {
        content: non_empty_trimmed(text),
        calls: Vec::new(),
    }
}

fn non_empty_trimmed(text: &str) -> Option<String> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

fn hold_from_marker(text: &str, marker: &str) -> usize {
    if let Some(start) = text.find(marker) {
        return start;
    }
    // Longest first, so that "<tool" holds from "<" rather than from nowhere.
    // The markers are ASCII, so the matched suffix starts on a char boundary.
    (1..marker.len())
        .rev()
        .find(|&len| marker.get(..len).is_some_and(|p| text.ends_with(p)))
        .map_or(text.len(), |len| text.len().saturating_sub(len))
}

fn hold_if_starts_like(text: &str, opener: char, tag: &str) -> usize {
    let trimmed = text.trim_start();
    // `tag.starts_with("")` also holds the empty and all-whitespace text:
    // the model has not yet shown whether it answers or calls.
    if trimmed.starts_with(opener) || trimmed.starts_with(tag) || tag.starts_with(trimmed) {
        0
    } else {
        text.len()
    }
}

/// Reads one JSON value from the start of `text` (after whitespace) and
/// returns it with the byte offset just past it.
fn json_prefix(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => Some((value, values.byte_offset())),
        _ => None,
    }
}

/// Reads `{"name": ..., "arguments": {...}}`, the shape shared by the JSON
/// formats; Llama 3 templates name the arguments `parameters`.
fn call_from_json(value: &Value) -> Option<ParsedToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match object.get("arguments") {
        Some(Value::Null) | None => object.get("parameters"),
        some => some,
    };
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: arguments_json(arguments)?,
    })
}

/// Normalizes arguments to a compact JSON object, the form OpenAI clients
/// `JSON.parse`; some models already write them as a JSON string.
fn arguments_json(arguments: Option<&Value>) -> Option<String> {
    match arguments {
        None | Some(Value::Null) => Some("{}".to_string()),
        Some(object @ Value::Object(_)) => Some(object.to_string()),
        Some(Value::String(encoded)) => match serde_json::from_str::<Value>(encoded) {
            Ok(object @ Value::Object(_)) => Some(object.to_string()),
            _ => None,
        },
        Some(_) => None,
    }
}

/// What the parsers' tests share.
#[cfg(test)]
mod test_util {
    pub use super::*;
    pub use serde_json::{json, Value};
    pub use ToolCallParser::{Hermes, Llama3Json, Mistral, OpenAi, Pythonic};

    /// The calls as `(name, arguments as a Value)`, so tests do not depend
    /// on serde_json's key order.
    pub fn calls(output: &ParsedOutput) -> Vec<(String, Value)> {
        output
            .calls
            .iter()
            .map(|call| {
                let arguments = serde_json::from_str(&call.arguments)
                    .unwrap_or_else(|e| panic!("arguments {:?}: {e}", call.arguments));
                (call.name.clone(), arguments)
            })
            .collect()
    }

    pub fn call(name: &str, arguments: Value) -> (String, Value) {
        (name.to_string(), arguments)
    }

    pub fn assert_all_content(parser: ToolCallParser, text: &str) {
        let output = parser.parse(text);
        assert!(
            output.calls.is_empty(),
            "{parser:?} found calls in {text:?}"
        );
        assert_eq!(output.content.as_deref(), Some(text.trim()), "{parser:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::hermes::HERMES_START;
    use super::mistral::MISTRAL_MARKER;
    use super::test_util::*;

    const ALL: [ToolCallParser; 5] = [Hermes, Llama3Json, Mistral, Pythonic, OpenAi];

    // --- names ---

    #[test]
    fn every_listed_name_parses_back_to_its_parser() {
        for name in ToolCallParser::NAMES {
            let parser = ToolCallParser::from_name(name).unwrap();
            assert_eq!(parser.name(), *name);
        }
        assert_eq!(ToolCallParser::NAMES.len(), ALL.len());
    }

    #[test]
    fn an_unknown_name_is_an_error_listing_the_known_ones() {
        let err = ToolCallParser::from_name("qwen").unwrap_err();
        assert!(err.contains("\"qwen\""), "{err}");
        for name in ToolCallParser::NAMES {
            assert!(err.contains(name), "{err}");
        }
    }

    // --- all parsers ---

    /// Outputs with calls in each format, used for streaming and fuzz tests.
    fn samples() -> Vec<(ToolCallParser, &'static str)> {
        vec![
            (
                Hermes,
                "Voilà — je vérifie 🌦.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>",
            ),
            (
                Llama3Json,
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"日本\"}}; {\"name\": \"g\", \"parameters\": {}}",
            ),
            (
                Mistral,
                "Un instant…[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"ü\"}}, {\"name\": \"g\"}]",
            ),
            (Mistral, "[TOOL_CALLS]f[ARGS]{\"q\": \"é\"}[TOOL_CALLS]g[ARGS]{}"),
            (
                Pythonic,
                "[f(q='日本\\'s', n=-1.5e3, l=[1, (2,), {'k': None}]), g.h(b=True)]",
            ),
            (
                OpenAi,
                "Je vérifie 🌦.<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Zürich\"}<|call|><|start|>assistant<|channel|>commentary to=functions.t<|message|>{}<|call|>",
            ),
        ]
    }

    #[test]
    fn samples_parse_into_calls() {
        for (parser, text) in samples() {
            assert_eq!(parser.parse(text).calls.len(), 2, "{parser:?} {text:?}");
        }
    }

    #[test]
    fn streaming_never_sends_part_of_a_call_as_content() {
        for (parser, text) in samples() {
            let call_start = match parser {
                Hermes => text.find(HERMES_START),
                Mistral => text.find(MISTRAL_MARKER),
                Llama3Json | Pythonic => Some(0),
                OpenAi => text.find("<|"),
            }
            .unwrap();
            for (end, _) in text.char_indices().chain([(text.len(), ' ')]) {
                let prefix = &text[..end];
                let hold = parser.hold_from(prefix);
                assert!(
                    hold <= call_start,
                    "{parser:?} would send {:?}",
                    &prefix[..hold]
                );
            }
        }
    }

    /// A deterministic pseudo-random generator, so the fuzz test needs no
    /// extra crate and fails reproducibly.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, bound: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % bound
        }
    }

    fn check_no_panic_and_invariants(parser: ToolCallParser, text: &str) {
        let hold = parser.hold_from(text);
        assert!(hold <= text.len(), "{parser:?} {text:?}");
        assert!(text.is_char_boundary(hold), "{parser:?} {text:?}");
        let output = parser.parse(text);
        if output.calls.is_empty() {
            assert_eq!(
                output.content.as_deref(),
                non_empty_trimmed(&parser.plain(text)).as_deref()
            );
        }
        if let Some(content) = &output.content {
            assert!(!content.is_empty() && content.trim() == content);
        }
        for call in &output.calls {
            assert!(!call.name.is_empty());
            let arguments: Value = serde_json::from_str(&call.arguments).unwrap();
            assert!(arguments.is_object(), "{parser:?} {text:?}");
        }
    }

    #[test]
    fn every_prefix_of_a_valid_output_is_handled_by_every_parser() {
        for (_, text) in samples() {
            for (end, _) in text.char_indices().chain([(text.len(), ' ')]) {
                for parser in ALL {
                    check_no_panic_and_invariants(parser, &text[..end]);
                }
            }
        }
    }

    #[test]
    fn random_and_hostile_text_is_handled_by_every_parser() {
        const PIECES: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "<tool_",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[TOOL",
            "<|python_tag|>",
            "<|python_start|>",
            "<|python_end|>",
            "<|py",
            "<|channel|>",
            "<|message|>",
            "<|start|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<|constrain|>",
            "<|chan",
            "commentary to=functions.f",
            "analysis",
            "final",
            "{",
            "}",
            "[",
            "]",
            "(",
            ")",
            ",",
            ";",
            ":",
            "=",
            "\"",
            "'",
            "'''",
            "\\",
            "\\x",
            "\\u",
            "\\U0001F6",
            "\\N{",
            "name",
            "\"name\"",
            "\"arguments\"",
            "\"parameters\"",
            "f",
            "a.b",
            "True",
            "None",
            "-",
            "1",
            "2.5e",
            "0x",
            "_",
            ".",
            " ",
            "\n",
            "r'",
            "b'",
            "é",
            "日本",
            "🌦",
            "\u{0}",
            "\u{200b}",
        ];
        let mut rng = Lcg(0x5eed);
        for _ in 0..3000 {
            let mut text = String::new();
            for _ in 0..rng.below(24) {
                text.push_str(PIECES[rng.below(PIECES.len())]);
            }
            for parser in ALL {
                check_no_panic_and_invariants(parser, &text);
            }
        }
        let hostile = [
            "[".repeat(100_000),
            format!("[f(a={})]", "[".repeat(100_000)),
            format!("[f(a={})]", "(".repeat(100_000)),
            format!("<tool_call>{}</tool_call>", "[".repeat(100_000)),
            format!("[TOOL_CALLS]{}", "{\"a\":".repeat(50_000)),
            "{".repeat(100_000),
            "\u{10ffff}\u{fffd}".repeat(100),
        ];
        for text in &hostile {
            for parser in ALL {
                check_no_panic_and_invariants(parser, text);
            }
        }
    }
}
