//! Incremental detokenization: turning a stream of generated token ids into
//! a stream of text pieces.
//!
//! Decoding token by token is wrong in two ways: a multi-byte UTF-8
//! character may be split across several byte-level tokens (each of which
//! alone decodes to U+FFFD), and SentencePiece decoders treat a token's
//! leading `▁` differently depending on whether the token starts the text.
//! [`IncrementalDetokenizer`] therefore decodes a small window of recent
//! tokens twice — without and with the new tokens — and emits the
//! difference, holding text back while it still ends in an incomplete
//! character.

use super::Tokenizer;
use anyhow::Result;
use std::sync::Arc;

/// How many prompt tokens are decoded as context in front of the first
/// generated token (enough for any leading-space or merge effects).
const CONTEXT_TOKENS: usize = 6;

/// When the already-emitted prefix of the buffer exceeds this many tokens,
/// it is dropped so that the buffer stays small on long generations.
const COMPACT_AFTER: usize = 64;

/// Streams decoded text for token ids pushed one at a time.
///
/// The concatenation of everything [`push`](Self::push) and
/// [`finish`](Self::finish) return equals the decode of all pushed ids
/// (decoded in the context of the prompt's last tokens), and no returned
/// piece ends inside a multi-byte character.
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special: bool,
    /// Context tokens from the prompt followed by the generated tokens.
    ids: Vec<u32>,
    /// `ids[prefix..read]` is the decode window whose text was already emitted.
    prefix: usize,
    /// `ids[read..]` are tokens whose text has not been emitted yet.
    read: usize,
}

impl std::fmt::Debug for IncrementalDetokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncrementalDetokenizer")
            .field("ids", &self.ids)
            .field("prefix", &self.prefix)
            .field("read", &self.read)
            .finish()
    }
}

/// The byte length of the longest common prefix of `a` and `b` that ends on
/// a character boundary of both.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

impl IncrementalDetokenizer {
    /// Starts a stream for text generated after `prompt_ids`; the prompt's
    /// last few tokens serve as decoding context and are never emitted.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special: bool) -> Self {
        let start = prompt_ids.len().saturating_sub(CONTEXT_TOKENS);
        let ids = prompt_ids[start..].to_vec();
        let read = ids.len();
        IncrementalDetokenizer {
            tokenizer,
            skip_special,
            ids,
            prefix: 0,
            read,
        }
    }

    /// The text of `ids[prefix..read]` and of `ids[prefix..]`.
    fn texts(&self) -> Result<(String, String)> {
        let old = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let new = self
            .tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        Ok((old, new))
    }

    /// The part of `new` that goes beyond what `old` already showed.
    fn diff(old: &str, new: &str) -> String {
        if let Some(rest) = new.strip_prefix(old) {
            rest.to_owned()
        } else {
            // The window's old text ended in an incomplete character that the
            // new tokens completed (or a decoder rewrote its tail): emit from
            // the first character that differs.
            new[common_prefix_len(new, old)..].to_owned()
        }
    }

    /// Moves the window forward after emitting everything up to the end.
    fn advance(&mut self) {
        self.prefix = self.read;
        self.read = self.ids.len();
        if self.prefix > COMPACT_AFTER {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
    }

    /// Adds one generated token and returns the text it completes — possibly
    /// empty, e.g. while a multi-byte character is still incomplete or when
    /// a skipped special token was pushed.
    pub fn push(&mut self, id: u32) -> Result<String> {
        if id as usize >= self.tokenizer.vocab_size() {
            anyhow::bail!(
                "token id {id} is outside the vocabulary (size {})",
                self.tokenizer.vocab_size()
            );
        }
        self.ids.push(id);
        let (old, new) = self.texts()?;
        if new == old || new.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let out = Self::diff(&old, &new);
        self.advance();
        Ok(out)
    }

    /// Flushes whatever is still held back. A dangling incomplete
    /// character (the output was cut inside it, by `max_tokens` or a stop
    /// token) comes out as U+FFFD, as vLLM's output ends: clients see that
    /// the text was cut inside a character rather than silently losing it.
    pub fn finish(&mut self) -> String {
        if self.read == self.ids.len() {
            return String::new();
        }
        match self.texts() {
            Ok((old, new)) => {
                let out = Self::diff(&old, &new);
                self.advance();
                out
            }
            // Every id was checked in `push`, so decoding cannot fail here;
            // if it somehow does, there is nothing sensible to flush.
            Err(_) => String::new(),
        }
    }

    /// The pushed ids whose text is still held back.
    pub fn pending_ids(&self) -> &[u32] {
        &self.ids[self.read..]
    }
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("a\u{FFFD}", "a中"), 1);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
