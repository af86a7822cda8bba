//! vLLM's `--reasoning-parser`: a reasoning model's `<think>…</think>` is
//! split from its answer, into `message.reasoning` and `reasoning_content`
//! (vLLM 0.32's name and its older one; streamed as `delta.reasoning` and
//! `delta.reasoning_content`) and, on the Responses API, a reasoning item;
//! usage counts its tokens as `reasoning_tokens`.
//!
//! - `deepseek_r1`: the chat template opens `<think>` itself, so the output
//!   starts inside the reasoning (a leading `<think>` is dropped too);
//!   everything before `</think>` is reasoning, and an output cut short
//!   before it is all reasoning.
//! - `qwen3`: the model writes `<think>` itself when it thinks; an output
//!   that does not start with it (thinking off, `enable_thinking: false`)
//!   is all answer.
//! - `openai_gptoss` (gpt-oss): the harmony format (see [`super::harmony`]).
//!   The `analysis` channel is the reasoning (messages joined by a line
//!   break), the `final` channel and `commentary` without a recipient (a
//!   preamble) the answer. A call of a function (`to=functions.NAME`)
//!   stays in the answer, in a canonical harmony form, when the request
//!   reads tool calls with `--tool-call-parser openai`; otherwise, and for
//!   calls of built-in tools (`to=browser.search`, `to=python`), its text
//!   goes to the reasoning. No marker reaches either.
//!
//! Whatever the parser, a template whose generation prompt opens
//! `<think>` (Qwen3-Thinking, DeepSeek-R1) starts the output inside the
//! reasoning, and one that closes it (`enable_thinking: false`) makes the
//! output all answer. Only the generation prompt is read for that, never
//! earlier turns or the client's text.
//!
//! Streaming keeps back a tail that may still become a tag (`</thi`), so
//! no part of a tag is ever sent as text.

use super::harmony;
use anyhow::bail;
use std::borrow::Cow;
use std::ops::Range;

const START: &str = "<think>";
const END: &str = "</think>";

/// Which reasoning format the model writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    DeepSeekR1,
    Qwen3,
    /// gpt-oss's harmony channels; with `calls`, function calls stay in
    /// the answer for the `openai` tool parser.
    GptOss {
        calls: bool,
    },
}

/// An output's split: the reasoning's byte ranges in the text, and the
/// reasoning and answer texts (each only growing as the text grows).
struct Split<'a> {
    ranges: Vec<Range<usize>>,
    reasoning: Cow<'a, str>,
    answer: Cow<'a, str>,
}

impl std::str::FromStr for ReasoningParser {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "deepseek_r1" => ReasoningParser::DeepSeekR1,
            "qwen3" => ReasoningParser::Qwen3,
            "openai_gptoss" => ReasoningParser::GptOss { calls: false },
            other => bail!(
                "--reasoning-parser '{other}' is not one of {}",
                ReasoningParser::NAMES.join(", ")
            ),
        })
    }
}

/// The longest tail of `text` that is a proper prefix of `tag`: text that
/// may still turn out to be the tag.
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl ReasoningParser {
    /// The names, for help texts and errors.
    pub const NAMES: &'static [&'static str] = &["deepseek_r1", "qwen3", "openai_gptoss"];

    /// Splits `text` (an output so far, or all of it when `finished`)
    /// into (reasoning, answer) with a `<think>` parser: slices of `text`,
    /// each only growing as `text` grows.
    #[cfg(test)]
    fn classify(self, text: &str, finished: bool) -> (&str, &str) {
        let (r, a) = self.spans(text, finished);
        (text.get(r).unwrap_or(""), text.get(a).unwrap_or(""))
    }

    /// Splits `text` (an output so far, or all of it when `finished`).
    fn split(self, text: &str, finished: bool) -> Split<'_> {
        if let ReasoningParser::GptOss { calls } = self {
            return harmony_split(text, finished, calls);
        }
        let (r, a) = self.spans(text, finished);
        Split {
            reasoning: Cow::Borrowed(text.get(r.clone()).unwrap_or("")),
            answer: Cow::Borrowed(text.get(a).unwrap_or("")),
            ranges: vec![r],
        }
    }

    /// A `<think>` parser's split as byte ranges of `text`.
    fn spans(self, text: &str, finished: bool) -> (Range<usize>, Range<usize>) {
        let n = text.len();
        // An output that is still only a prefix of "<think>" could go
        // either way.
        if !finished && n < START.len() && START.starts_with(text) {
            return (0..0, 0..0);
        }
        let thinking = match self {
            ReasoningParser::DeepSeekR1 => true,
            ReasoningParser::Qwen3 => text.starts_with(START),
            ReasoningParser::GptOss { .. } => false,
        };
        if !thinking {
            return (0..0, 0..n);
        }
        let from = if text.starts_with(START) {
            START.len()
        } else {
            0
        };
        let body = text.get(from..).unwrap_or("");
        match body.find(END) {
            Some(i) => (from..from + i, from + i + END.len()..n),
            None if finished => (from..n, n..n),
            None => (from..n - partial_tag(body, END), n..n),
        }
    }
}

/// One choice's output as it streams: what has been sent of its reasoning
/// and of its answer, and where each step's tokens end in its text.
#[derive(Clone, Debug, Default)]
pub struct ReasoningStream {
    text: String,
    reasoning_sent: usize,
    answer_sent: usize,
    /// Per engine output: (the length of `text` after it, its tokens).
    steps: Vec<(usize, usize)>,
    finished: bool,
}

impl ReasoningStream {
    /// Adds `new` output, the text of `tokens` generated tokens; returns
    /// the reasoning and answer text that can now be sent (all of it once
    /// `finished`).
    pub fn push(
        &mut self,
        parser: ReasoningParser,
        new: &str,
        tokens: usize,
        finished: bool,
    ) -> (String, String) {
        self.text.push_str(new);
        self.steps.push((self.text.len(), tokens));
        self.finished |= finished;
        let Split {
            reasoning: r,
            answer: a,
            ..
        } = parser.split(&self.text, finished);
        let rd = r.get(self.reasoning_sent..).unwrap_or("").to_string();
        let ad = a.get(self.answer_sent..).unwrap_or("").to_string();
        self.reasoning_sent = self.reasoning_sent.max(r.len());
        self.answer_sent = self.answer_sent.max(a.len());
        (rd, ad)
    }

    /// How many of the generated tokens are reasoning (usage's
    /// `reasoning_tokens`). The split is by text, so tokens are placed by
    /// the boundaries the detokenizer reported: each engine output's text
    /// is that of its tokens (a token whose text the detokenizer held
    /// back, as an incomplete character, goes with the next output that
    /// has text). A group of tokens wholly inside the reasoning counts
    /// whole; one that straddles its end (several tokens from one step,
    /// or a token holding the last reasoning text and part of `</think>`)
    /// counts its share, rounded up; the tags themselves are not reasoning.
    pub fn reasoning_tokens(&self, parser: ReasoningParser) -> usize {
        let ranges = parser.split(&self.text, self.finished).ranges;
        if ranges.iter().all(Range::is_empty) {
            return 0;
        }
        let (mut count, mut start, mut pending) = (0, 0, 0);
        for &(end, tokens) in &self.steps {
            pending += tokens;
            if end == start || pending == 0 {
                continue;
            }
            let overlap: usize = ranges
                .iter()
                .map(|r| end.min(r.end).saturating_sub(start.max(r.start)))
                .sum();
            count += (pending * overlap).div_ceil(end - start);
            start = end;
            pending = 0;
        }
        count
    }
}

impl ReasoningParser {
    /// Its `--reasoning-parser` name.
    pub fn name(self) -> &'static str {
        match self {
            ReasoningParser::DeepSeekR1 => "deepseek_r1",
            ReasoningParser::Qwen3 => "qwen3",
            ReasoningParser::GptOss { .. } => "openai_gptoss",
        }
    }

    /// Whether it reads harmony (gpt-oss) rather than `<think>` tags.
    pub fn is_harmony(self) -> bool {
        matches!(self, ReasoningParser::GptOss { .. })
    }

    /// For one request: whether function calls stay in the answer (the
    /// request reads them with the `openai` tool parser); only harmony's
    /// parser has calls to keep.
    pub fn keeping_calls(self, calls: bool) -> ReasoningParser {
        match self {
            ReasoningParser::GptOss { .. } => ReasoningParser::GptOss { calls },
            other => other,
        }
    }

    /// The parser for an output that starts inside the reasoning (the
    /// prompt opened `<think>`): everything before `</think>` is reasoning,
    /// whichever format the model otherwise writes.
    pub fn inside(self) -> ReasoningParser {
        match self {
            // Harmony opens no `<think>`.
            ReasoningParser::GptOss { .. } => self,
            _ => ReasoningParser::DeepSeekR1,
        }
    }
}

/// Harmony's split (see the module's notes).
fn harmony_split(text: &str, finished: bool, calls: bool) -> Split<'_> {
    let (mut ranges, mut reasoning, mut answer) = (Vec::new(), String::new(), String::new());
    for part in harmony::parse(text, finished) {
        let m = match part {
            harmony::Part::Loose(r) => {
                answer.push_str(text.get(r).unwrap_or(""));
                continue;
            }
            harmony::Part::Message(m) => m,
        };
        let body = text.get(m.body.clone()).unwrap_or("");
        let function = m
            .recipient
            .as_deref()
            .is_some_and(|r| r.starts_with("functions."));
        if function && calls {
            answer.push_str(&harmony::canonical_call(&m, body));
        } else if m.channel == "analysis" || m.recipient.is_some() {
            if !reasoning.is_empty() && !body.is_empty() {
                reasoning.push('\n');
            }
            reasoning.push_str(body);
            ranges.push(m.body);
        } else {
            answer.push_str(body);
        }
    }
    Split {
        ranges,
        reasoning: Cow::Owned(reasoning),
        answer: Cow::Owned(answer),
    }
}

/// How the prompt left the reasoning for the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptReasoning {
    /// It closed it (a template that wrote an empty `<think></think>`
    /// because thinking is off): the output is all answer.
    Closed,
    /// It opened it (`<think>` last): the output starts inside it.
    Opened,
    /// Neither: the output opens it or not.
    Untouched,
}

impl PromptReasoning {
    /// From the template's generation prompt, the text it wrote to open
    /// the reply: only what the template wrote counts, not earlier turns
    /// or the client's text.
    pub fn of_text(generation_prompt: &str) -> PromptReasoning {
        Self::from_last(generation_prompt.rfind(START), generation_prompt.rfind(END))
    }

    /// From a whole prompt's ids, where the generation prompt is not known
    /// (a tenant's plugin rendered it): the last tag decides.
    pub fn of_ids(ids: &[u32], start: &[u32], end: &[u32]) -> PromptReasoning {
        let last = |needle: &[u32]| {
            (!needle.is_empty() && ids.len() >= needle.len())
                .then(|| ids.windows(needle.len()).rposition(|w| w == needle))
                .flatten()
        };
        Self::from_last(last(start), last(end))
    }

    fn from_last(start: Option<usize>, end: Option<usize>) -> PromptReasoning {
        match (start, end) {
            (s, Some(e)) if s.is_none_or(|s| e > s) => PromptReasoning::Closed,
            (Some(_), _) => PromptReasoning::Opened,
            _ => PromptReasoning::Untouched,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `pieces` and returns what was sent, reasoning and answer.
    fn stream(p: ReasoningParser, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningStream::default();
        let (mut r, mut a) = (String::new(), String::new());
        for (i, piece) in pieces.iter().enumerate() {
            let (rd, ad) = s.push(p, piece, 1, i + 1 == pieces.len());
            r += &rd;
            a += &ad;
        }
        (r, a)
    }

    #[test]
    fn deepseek_r1_output_starts_inside_the_reasoning() {
        let p = ReasoningParser::DeepSeekR1;
        assert_eq!(
            p.classify("Let me see.</think>\n\n42", true),
            ("Let me see.", "\n\n42")
        );
        assert_eq!(p.classify("<think>Hmm</think>Yes", true), ("Hmm", "Yes"));
        // Cut short: all reasoning.
        assert_eq!(p.classify("Still thinking", true), ("Still thinking", ""));
    }

    #[test]
    fn qwen3_without_a_think_tag_is_all_answer() {
        let p = ReasoningParser::Qwen3;
        assert_eq!(
            p.classify("<think>\nok\n</think>\n\nHi", true),
            ("\nok\n", "\n\nHi")
        );
        assert_eq!(p.classify("Hi there", true), ("", "Hi there"));
        assert_eq!(p.classify("<think>cut", true), ("cut", ""));
    }

    #[test]
    fn how_a_prompt_left_the_reasoning() {
        use PromptReasoning::*;
        let (s, e) = ([1, 2], [3, 4]);
        assert_eq!(PromptReasoning::of_ids(&[9, 1, 2, 3, 4, 9], &s, &e), Closed);
        assert_eq!(
            PromptReasoning::of_ids(&[9, 3, 4, 1, 2], &s, &e),
            Opened,
            "reopened"
        );
        assert_eq!(PromptReasoning::of_ids(&[9, 9], &s, &e), Untouched);
        assert_eq!(PromptReasoning::of_ids(&[3, 4], &s, &e), Closed);
        // Generation prompts as templates write them.
        assert_eq!(
            PromptReasoning::of_text("<|im_start|>assistant\n<think>\n"),
            Opened
        );
        assert_eq!(
            PromptReasoning::of_text("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            Closed
        );
        assert_eq!(
            PromptReasoning::of_text("<|im_start|>assistant\n"),
            Untouched
        );
        assert_eq!(PromptReasoning::of_text(""), Untouched);
    }

    #[test]
    fn an_output_that_starts_inside_the_reasoning_splits_at_its_end() {
        // Qwen3-Thinking: the template opened `<think>`, the model writes
        // only `</think>`.
        let p = ReasoningParser::Qwen3.inside();
        assert_eq!(
            p.classify("Let me see.</think>\n\n42", true),
            ("Let me see.", "\n\n42")
        );
        assert_eq!(p.classify("Still thinking", true), ("Still thinking", ""));
    }

    /// The reasoning tokens of an output streamed as `steps` of
    /// (text, tokens).
    fn reasoning_tokens(p: ReasoningParser, steps: &[(&str, usize)]) -> usize {
        let mut s = ReasoningStream::default();
        for (i, (text, n)) in steps.iter().enumerate() {
            s.push(p, text, *n, i + 1 == steps.len());
        }
        s.reasoning_tokens(p)
    }

    #[test]
    fn reasoning_tokens_are_those_whose_text_is_reasoning() {
        let (d, q) = (ReasoningParser::DeepSeekR1, ReasoningParser::Qwen3);
        // Two reasoning tokens, the tag's two, two of the answer.
        let steps = [
            ("Hm", 1),
            ("m.", 1),
            ("</", 1),
            ("think>", 1),
            ("Ye", 1),
            ("s", 1),
        ];
        assert_eq!(reasoning_tokens(d, &steps), 2);
        // A token held back by the detokenizer goes with the next text.
        let steps = [("a", 1), ("", 1), ("bc", 1), ("</think>", 1), ("x", 1)];
        assert_eq!(reasoning_tokens(d, &steps), 3);
        // A token that ends the reasoning and starts the tag counts.
        assert_eq!(reasoning_tokens(d, &[("ab</", 1), ("think>x", 1)]), 1);
        // Cut short: all of it, but the opening tag.
        assert_eq!(
            reasoning_tokens(q, &[("<think>", 1), ("a", 1), ("b", 1)]),
            2
        );
        // No reasoning: none.
        assert_eq!(reasoning_tokens(q, &[("Hi", 1), (" there", 1)]), 0);
        assert_eq!(reasoning_tokens(d, &[("</think>", 1), ("Hi", 1)]), 0);
        // Several tokens from one step straddling the end: their share.
        assert_eq!(reasoning_tokens(d, &[("ab</think>cd", 4)]), 1);
    }

    #[test]
    fn a_tag_split_across_chunks_is_never_sent_as_text() {
        for pieces in [
            &["<th", "ink>Reason", "ing</th", "ink>Ans", "wer"][..],
            &["<think>R", "easoning<", "/", "think", ">", "Answer"][..],
            &["<", "think>", "Reasoning", "</think>Answer"][..],
        ] {
            for p in [ReasoningParser::DeepSeekR1, ReasoningParser::Qwen3] {
                assert_eq!(
                    stream(p, pieces),
                    ("Reasoning".to_string(), "Answer".to_string()),
                    "{p:?} {pieces:?}"
                );
            }
        }
        // A '<' that was not a tag after all is sent once it is known.
        assert_eq!(
            stream(ReasoningParser::DeepSeekR1, &["a <", " b</think>c"]),
            ("a < b".to_string(), "c".to_string())
        );
        assert_eq!(
            stream(ReasoningParser::Qwen3, &["<", "b>"]),
            (String::new(), "<b>".to_string())
        );
    }

    const HARMONY: &str = "<|channel|>analysis<|message|>L'utilisateur veut la météo 🌦.<|end|><|start|>assistant<|channel|>analysis<|message|>Use get_weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Je vérifie…<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Zürich\"}<|call|>";

    /// Streams `text` cut at every char boundary `cuts` gives.
    fn stream_cut(p: ReasoningParser, text: &str, cuts: &[usize]) -> (String, String) {
        let mut pieces = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain([&text.len()]) {
            pieces.push(&text[from..c]);
            from = c;
        }
        stream(p, &pieces)
    }

    #[test]
    fn harmony_channels_split_into_reasoning_and_answer() {
        let p: ReasoningParser = "openai_gptoss".parse().unwrap();
        assert_eq!(p.name(), "openai_gptoss");
        let (r, a) = stream(p, &[HARMONY]);
        assert_eq!(
            r,
            "L'utilisateur veut la météo 🌦.\nUse get_weather.\n{\"location\":\"Zürich\"}"
        );
        assert_eq!(a, "Je vérifie…");
        // With the openai tool parser, the call stays in the answer for it.
        let (r, a) = stream(p.keeping_calls(true), &[HARMONY]);
        assert_eq!(r, "L'utilisateur veut la météo 🌦.\nUse get_weather.");
        assert_eq!(
            a,
            "Je vérifie…<|channel|>commentary to=functions.get_weather<|message|>{\"location\":\"Zürich\"}<|call|>"
        );
        let parsed = crate::server::openai::tool_parsers::ToolCallParser::OpenAi.parse(&a);
        assert_eq!(parsed.content.as_deref(), Some("Je vérifie…"));
        assert_eq!(parsed.calls.len(), 1);
        assert_eq!(parsed.calls[0].name, "get_weather");
        assert_eq!(parsed.calls[0].arguments, "{\"location\":\"Zürich\"}");
        // The final channel, as gpt-oss ends an answer.
        let t = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>";
        assert_eq!(stream(p, &[t]), ("Easy.".into(), "Paris.".into()));
        // Stop tokens are not in the text: an output that ends unclosed.
        let t = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.";
        assert_eq!(stream(p, &[t]), ("Easy.".into(), "Paris.".into()));
        // No harmony at all: all answer.
        assert_eq!(stream(p, &["Just text"]), ("".into(), "Just text".into()));
    }

    #[test]
    fn harmony_chunk_splits_at_every_boundary_give_the_unsplit_result() {
        let bounds: Vec<usize> = HARMONY.char_indices().map(|(i, _)| i).skip(1).collect();
        for p in [
            ReasoningParser::GptOss { calls: false },
            ReasoningParser::GptOss { calls: true },
        ] {
            let whole = stream(p, &[HARMONY]);
            // Two chunks, cut anywhere.
            for &c in &bounds {
                assert_eq!(stream_cut(p, HARMONY, &[c]), whole, "{p:?} cut at {c}");
            }
            // One chunk per character.
            assert_eq!(stream_cut(p, HARMONY, &bounds), whole, "{p:?} per char");
        }
    }

    #[test]
    fn a_harmony_output_cut_mid_marker_never_leaks_it() {
        let p = ReasoningParser::GptOss { calls: true };
        let bounds = HARMONY
            .char_indices()
            .map(|(i, _)| i)
            .chain([HARMONY.len()]);
        for end in bounds {
            let cut = &HARMONY[..end];
            let (r, a) = stream(p, &[cut]);
            assert!(!r.contains("<|"), "{cut:?} -> {r:?}");
            // The answer holds markers only in the canonical call, which
            // the tool parser reads; its content never holds any.
            let parsed = crate::server::openai::tool_parsers::ToolCallParser::OpenAi.parse(&a);
            let content = parsed.content.unwrap_or_default();
            // (A lone '<' at the very end is text: no marker starts so.)
            assert!(!content.contains("<|"), "{cut:?} -> {content:?}");
            let (_, a) = stream(ReasoningParser::GptOss { calls: false }, &[cut]);
            assert!(!a.contains("<|"), "{cut:?} -> {a:?}");
        }
    }

    #[test]
    fn harmony_reasoning_tokens_are_the_analysis_tokens() {
        let p = ReasoningParser::GptOss { calls: false };
        let steps = [
            ("<|channel|>", 1),
            ("analysis", 1),
            ("<|message|>", 1),
            ("Hm", 1),
            ("m.", 1),
            ("<|end|>", 1),
            ("<|start|>", 1),
            ("assistant", 1),
            ("<|channel|>", 1),
            ("final", 1),
            ("<|message|>", 1),
            ("Yes", 1),
        ];
        assert_eq!(reasoning_tokens(p, &steps), 2);
    }
}
