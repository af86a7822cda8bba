//! Keeps every text a client sent out of the control tokens, whatever a
//! chat template does with it.
//!
//! Before rendering, every string the request contributes to the template
//! (message contents, names, tool definitions and their schemas, tool-call
//! names and arguments, ...) has each piece of special-token text (such as
//! `<|im_end|>`) swapped for a placeholder: one character of Unicode's
//! supplementary private use area, which no tokenizer treats as special,
//! and which templates copy through (even `tojson` keeps it). The rendered
//! prompt is then encoded in pieces: the template's own text as usual
//! (its markers become control tokens), and each placeholder as the plain
//! text it stands for. So only the template writes control tokens, and a
//! request without special-token text encodes exactly as before.

use super::Tokenizer;
use anyhow::{bail, Result};
use serde_json::Value;
use std::collections::HashMap;

/// The first placeholder: U+F0000, the start of plane 15 (private use).
const FIRST: u32 = 0xF_0000;
/// Placeholders available (plane 15 and 16 hold 2 × 65 534).
const MAX_PLACEHOLDERS: usize = 65_534;

/// The client texts swapped for placeholders in one request.
#[derive(Default, Debug)]
pub struct PlainText {
    /// What placeholder `k` stands for.
    originals: Vec<String>,
    index: HashMap<String, usize>,
}

impl PlainText {
    /// Swaps special-token text in every string of `v` (recursively,
    /// object keys included) for placeholders. Characters already in the
    /// placeholder range are swapped too, so they come back as themselves.
    pub fn protect(&mut self, tok: &Tokenizer, v: &mut Value) -> Result<()> {
        match v {
            Value::String(s) => {
                if let Some(t) = self.protect_str(tok, s)? {
                    *s = t;
                }
            }
            Value::Array(a) => {
                for x in a {
                    self.protect(tok, x)?;
                }
            }
            Value::Object(o) => {
                let keys: Vec<String> = o.keys().cloned().collect();
                for k in keys {
                    let Some(mut x) = o.remove(&k) else {
                        continue;
                    };
                    self.protect(tok, &mut x)?;
                    let k = self.protect_str(tok, &k)?.unwrap_or(k);
                    o.insert(k, x);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// `s` with its special-token text swapped, or `None` if it holds none.
    fn protect_str(&mut self, tok: &Tokenizer, s: &str) -> Result<Option<String>> {
        let specials = tok.special_texts();
        let placeholder_char =
            |c: char| (FIRST..FIRST + MAX_PLACEHOLDERS as u32).contains(&(c as u32));
        if !specials.iter().any(|t| s.contains(t.as_str())) && !s.chars().any(placeholder_char) {
            return Ok(None);
        }
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(c) = rest.chars().next() {
            // The longest special text that starts here.
            let hit = specials
                .iter()
                .filter(|t| rest.starts_with(t.as_str()))
                .max_by_key(|t| t.len());
            let (piece, len) = match hit {
                Some(t) => (t.as_str(), t.len()),
                None if placeholder_char(c) => (&rest[..c.len_utf8()], c.len_utf8()),
                None => {
                    out.push(c);
                    rest = &rest[c.len_utf8()..];
                    continue;
                }
            };
            out.push(self.placeholder(piece)?);
            rest = &rest[len..];
        }
        Ok(Some(out))
    }

    fn placeholder(&mut self, original: &str) -> Result<char> {
        let k = match self.index.get(original) {
            Some(&k) => k,
            None => {
                let k = self.originals.len();
                if k >= MAX_PLACEHOLDERS {
                    bail!("the request holds too many distinct special-token texts");
                }
                self.originals.push(original.to_string());
                self.index.insert(original.to_string(), k);
                k
            }
        };
        char::from_u32(FIRST + k as u32)
            .ok_or_else(|| anyhow::anyhow!("placeholder {k} is not a character"))
    }

    /// `text` with each placeholder back as the text it stands for (for
    /// messages that quote protected input, such as a template's error).
    pub fn restore(&self, text: &str) -> String {
        if self.originals.is_empty() {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len());
        for c in text.chars() {
            let k = (c as u32).wrapping_sub(FIRST) as usize;
            match self.originals.get(k) {
                Some(original) => out.push_str(original),
                None => out.push(c),
            }
        }
        out
    }

    /// Encodes a prompt rendered from protected input: the template's text
    /// as [`Tokenizer::encode`] does (without BOS: the template places it),
    /// and each placeholder as the plain text it stands for.
    pub fn encode(&self, tok: &Tokenizer, rendered: &str) -> Result<Vec<u32>> {
        if self.originals.is_empty() {
            return tok.encode(rendered, false);
        }
        let which = |c: char| {
            let k = (c as u32).wrapping_sub(FIRST) as usize;
            (k < self.originals.len()).then_some(k)
        };
        let mut ids = Vec::new();
        let mut start = 0;
        for (i, c) in rendered.char_indices() {
            let Some(k) = which(c) else {
                continue;
            };
            if start < i {
                ids.extend(tok.encode(&rendered[start..i], false)?);
            }
            ids.extend(tok.encode_as_text(&self.originals[k])?);
            start = i + c.len_utf8();
        }
        if start < rendered.len() {
            ids.extend(tok.encode(&rendered[start..], false)?);
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_puts_the_originals_back() {
        let mut p = PlainText::default();
        assert_eq!(p.restore("a\u{F0000}b"), "a\u{F0000}b");
        let a = p.placeholder("<|im_end|>").expect("placeholder");
        let b = p.placeholder("\u{F0000}").expect("placeholder");
        assert_eq!(p.placeholder("<|im_end|>").expect("placeholder"), a);
        assert_eq!(
            p.restore(&format!("x{a}y{b}{a}\u{F0005}")),
            "x<|im_end|>y\u{F0000}<|im_end|>\u{F0005}"
        );
    }
}
