//! gpt-oss's harmony output format, read from detokenized text with its
//! special tokens kept: the `openai_gptoss` reasoning parser and the
//! `openai` tool parser both read it.
//!
//! The chat template's generation prompt ends with `<|start|>assistant`, so
//! an output is a run of messages, the first without its `<|start|>`:
//!
//! ```text
//! <|channel|>analysis<|message|>…<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>…<|return|>
//! ```
//!
//! A message's header runs from `<|start|>` (or a bare `<|channel|>`) to
//! `<|message|>`: the role, `<|channel|>` and the channel's name, and
//! optionally a recipient (`to=functions.NAME`, before or after the
//! channel) and a content type (`<|constrain|>json`, or a bare `json`).
//! Its body runs to `<|end|>`, `<|call|>` (a tool call), `<|return|>` (the
//! last message), or to the next marker if the model left it open. Text
//! outside any message (a model that writes no harmony) is kept as such;
//! stray markers are dropped.
//!
//! While the output streams, a header still without its `<|message|>` and
//! a tail that may still become a marker (`<|ret`) are held back; once it
//! is finished, such a cut-off header or partial marker is dropped, so
//! no part of a marker is ever read as text.

use std::ops::Range;

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const MESSAGE: &str = "<|message|>";
pub const END: &str = "<|end|>";
pub const CALL: &str = "<|call|>";
pub const RETURN: &str = "<|return|>";
pub const CONSTRAIN: &str = "<|constrain|>";

const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];

/// One piece of an output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// Text outside any message.
    Loose(Range<usize>),
    /// A message whose header is complete, with its body so far.
    Message(Message),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `analysis`, `commentary`, `final`, … (empty if the header named none).
    pub channel: String,
    /// `functions.get_weather`, without its `to=`.
    pub recipient: Option<String>,
    /// The body, as a byte range of the text.
    pub body: Range<usize>,
    /// Its end marker was read (`<|end|>`, `<|call|>` or `<|return|>`).
    pub ended: bool,
}

/// The ids that open the `final` channel (`<|channel|>final<|message|>`),
/// after which a structured-output constraint applies, where the
/// tokenizer has harmony's markers as special tokens (a grammar over text
/// could not write them). Empty where it has not: the markers are then
/// text that a grammar may write, and the constraint covers the whole
/// output.
pub fn final_header_ids(tok: &crate::tokenizer::Tokenizer) -> Vec<u32> {
    let special = |t: &str| tok.token_to_id(t).is_some_and(|id| tok.is_special(id));
    if special(CHANNEL) && special(MESSAGE) {
        tok.encode(&format!("{CHANNEL}final{MESSAGE}"), false)
            .unwrap_or_default()
    } else {
        Vec::new()
    }
}

/// A call as the `openai_gptoss` reasoning parser leaves it in the answer
/// for the `openai` tool parser: `<|channel|>CHANNEL to=RECIPIENT<|message|>BODY`,
/// then `<|call|>` once it has ended. Only a message with a recipient is
/// written so, and only once its header is complete, so the form only
/// grows as the body does.
pub fn canonical_call(m: &Message, body: &str) -> String {
    format!(
        "{CHANNEL}{} to={}{MESSAGE}{body}{}",
        m.channel,
        m.recipient.as_deref().unwrap_or(""),
        if m.ended { CALL } else { "" }
    )
}

/// The marker that starts at `text[at..]`, if any.
fn marker_at(text: &str, at: usize) -> Option<&'static str> {
    let rest = text.get(at..)?;
    MARKERS.into_iter().find(|m| rest.starts_with(m))
}

/// The first marker at or after `from`: its offset and text.
fn next_marker(text: &str, from: usize) -> Option<(usize, &'static str)> {
    let rest = text.get(from..)?;
    let mut search = 0;
    while let Some(i) = rest.get(search..).and_then(|r| r.find("<|")) {
        let at = from + search + i;
        if let Some(m) = marker_at(text, at) {
            return Some((at, m));
        }
        search += i + 2;
    }
    None
}

/// The length of the longest tail of `text` that is a proper prefix of a
/// marker: text that may still become one.
fn partial_marker(text: &str) -> usize {
    let longest = MARKERS.iter().map(|m| m.len()).max().unwrap_or(0);
    (1..longest.min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && MARKERS
                    .iter()
                    .any(|m| m.len() > n && m.starts_with(&text[text.len() - n..]))
        })
        .unwrap_or(0)
}

/// Where text that runs to the end of the output stops being readable:
/// before a tail that may still become a marker while it streams; once
/// finished, before a cut-off marker (`<|ret`), though a lone `<` is text.
fn readable_end(text: &str, from: usize, finished: bool) -> usize {
    let tail = partial_marker(text.get(from..).unwrap_or(""));
    if finished && tail < 2 {
        text.len()
    } else {
        text.len() - tail
    }
}

/// Reads a header (what lies between its first marker and `<|message|>`).
fn header(h: &str) -> (String, Option<String>) {
    let (role, channel) = match h.split_once(CHANNEL) {
        Some((r, c)) => (r, c),
        None => (h, ""),
    };
    let role = role.strip_prefix(START).unwrap_or(role);
    let channel = channel.replace(CONSTRAIN, " ");
    let recipient = role
        .split_whitespace()
        .chain(channel.split_whitespace())
        .find_map(|w| w.strip_prefix("to="))
        .filter(|r| !r.is_empty())
        .map(str::to_string);
    let name = channel
        .split_whitespace()
        .next()
        .filter(|w| !w.starts_with("to="))
        .unwrap_or("")
        .to_string();
    (name, recipient)
}

/// Splits `text` (an output so far, or all of it when `finished`) into its
/// parts, in order. As `text` grows, the parts only grow: a part's range
/// keeps its start and never shrinks, and new parts come after.
pub fn parse(text: &str, finished: bool) -> Vec<Part> {
    let mut parts = Vec::new();
    let mut pos = 0;
    while pos < text.len() {
        let Some((at, marker)) = next_marker(text, pos) else {
            let end = readable_end(text, pos, finished);
            if end > pos {
                parts.push(Part::Loose(pos..end));
            }
            break;
        };
        if at > pos {
            parts.push(Part::Loose(pos..at));
        }
        if marker != START && marker != CHANNEL {
            // A stray end, `<|message|>` or `<|constrain|>`: not text.
            pos = at + marker.len();
            continue;
        }
        // The header runs to `<|message|>`; one that meets an end marker
        // first is malformed and dropped with it, and one cut off by a new
        // message is dropped.
        let mut scan = at + marker.len();
        let header_end = loop {
            match next_marker(text, scan) {
                Some((m, MESSAGE)) => break Some(m),
                Some((m, START)) => {
                    scan = m;
                    break None;
                }
                Some((m, k @ (END | CALL | RETURN))) => {
                    scan = m + k.len();
                    break None;
                }
                Some((m, k)) => scan = m + k.len(),
                // Cut off in the header: held back, then dropped.
                None => {
                    scan = text.len();
                    break None;
                }
            }
        };
        let Some(header_end) = header_end else {
            pos = scan;
            continue;
        };
        let (channel, recipient) = header(&text[at..header_end]);
        let from = header_end + MESSAGE.len();
        let (body, ended, next) = match next_marker(text, from) {
            Some((m, k @ (END | CALL | RETURN))) => (from..m, true, m + k.len()),
            Some((m, _)) => (from..m, false, m),
            None => (from..readable_end(text, from, finished), false, text.len()),
        };
        parts.push(Part::Message(Message {
            channel,
            recipient,
            body,
            ended,
        }));
        pos = next;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bodies(text: &str, finished: bool) -> Vec<(String, Option<String>, String, bool)> {
        parse(text, finished)
            .into_iter()
            .map(|p| match p {
                Part::Loose(r) => ("<loose>".into(), None, text[r].to_string(), false),
                Part::Message(m) => (m.channel, m.recipient, text[m.body].to_string(), m.ended),
            })
            .collect()
    }

    fn msg(
        c: &str,
        to: Option<&str>,
        b: &str,
        ended: bool,
    ) -> (String, Option<String>, String, bool) {
        (c.into(), to.map(str::to_string), b.into(), ended)
    }

    #[test]
    fn messages_channels_and_recipients() {
        let t = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Paris\"}<|call|>";
        assert_eq!(
            bodies(t, true),
            [
                msg("analysis", None, "Think.", true),
                msg(
                    "commentary",
                    Some("functions.get_weather"),
                    "{\"location\":\"Paris\"}",
                    true
                )
            ]
        );
        // The recipient in the role part, a bare content type.
        let t = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>";
        assert_eq!(
            bodies(t, true),
            [msg("commentary", Some("functions.f"), "{}", true)]
        );
        let t = "<|channel|>final<|message|>Hi <b>there</b> <|x|><|return|>";
        assert_eq!(
            bodies(t, true),
            [msg("final", None, "Hi <b>there</b> <|x|>", true)]
        );
    }

    #[test]
    fn text_outside_messages_and_stray_markers() {
        assert_eq!(
            bodies("plain answer", true),
            [msg("<loose>", None, "plain answer", false)]
        );
        assert_eq!(
            bodies("a<|end|>b<|message|>c", true),
            [
                msg("<loose>", None, "a", false),
                msg("<loose>", None, "b", false),
                msg("<loose>", None, "c", false)
            ]
        );
        // A header that meets an end first is dropped with it.
        assert_eq!(
            bodies("<|channel|>final<|end|>x", true),
            [msg("<loose>", None, "x", false)]
        );
    }

    #[test]
    fn a_cut_off_output_never_yields_part_of_a_marker() {
        // Cut in a header: nothing from it.
        assert_eq!(bodies("<|channel|>analy", true), []);
        assert_eq!(bodies("<|channel|>analysis<|mess", true), []);
        // Cut in an end marker: the body without it; a lone '<' is text.
        assert_eq!(
            bodies("<|channel|>final<|message|>Hi<|ret", true),
            [msg("final", None, "Hi", false)]
        );
        assert_eq!(
            bodies("<|channel|>final<|message|>a <", true),
            [msg("final", None, "a <", false)]
        );
        // Streaming: even the '<' waits.
        assert_eq!(
            bodies("<|channel|>final<|message|>a <", false),
            [msg("final", None, "a ", false)]
        );
    }
}
