//! Redaction of whole texts and of streamed text, independent of the host
//! so it tests natively.
//!
//! All patterns (built-in and configured) form one leftmost-first pattern
//! set: scanning left to right, the earliest match wins, and at one
//! position the pattern listed first (e-mail, then phones, then the
//! configured ones in order). Every match is replaced by the replacement.
//!
//! # Streaming
//!
//! [`Stream`] must produce exactly what [`Redactor::redact`] produces for
//! the concatenated text, whatever the split. Text can be released once no
//! later text can change how it is redacted. For a position `s` that is
//! the case when no match starting at `s` can reach beyond the text seen so
//! far: the set's lazy DFA, run anchored from `s` over the rest of the
//! buffer, has died (no pattern can continue). So a piece is released up to
//! the first position where the DFA is still alive at the end of the buffer
//! ("live"), and matches that start before it are final. For ordinary
//! prose that holds back only the last word (which could still become an
//! e-mail address) or a trailing run of digits (a phone number).
//!
//! The lazy DFA cannot follow a Unicode word boundary (`\b` in a configured
//! pattern) through non-ASCII text and gives up there; such a position is
//! then taken as live while it is within [`FALLBACK_WINDOW`] bytes of the
//! end, which is exact for matches up to that long.

use pagoda_sdk::json;
use pagoda_sdk::serde_json::Value;
use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::util::start;
use regex_automata::{meta, Anchored, Input};
use serde::Deserialize;
use std::cell::RefCell;

/// E-mail addresses: local part, `@`, dot-separated domain labels and a
/// top-level domain of two or more letters.
pub const EMAIL: &str = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}";

/// International phone numbers, written with a leading `+`: country code,
/// then three to five groups of digits (the first may be in parentheses),
/// e.g. `+44 20 7946 0958`, `+33 6 12 34 56 78`, `+15551234567`.
pub const PHONE_INTERNATIONAL: &str =
    r"\+[0-9]{1,3}[ .-]?\(?[0-9]{1,4}\)?(?:[ .-]?[0-9]{2,4}){2,4}(?-u:\b)";

/// North American numbers: `555-123-4567`, `(555) 123 4567`,
/// `1 555.123.4567`, `5551234567`. Numbers in other national formats
/// without `+` are left to configured patterns, since short digit groups
/// alone are too often not phone numbers.
pub const PHONE_NANP: &str = r"(?:(?-u:\b)1[ .-]?)?(?:\([0-9]{3}\)[ .-]?|(?-u:\b)[0-9]{3}[ .-]?)[0-9]{3}[ .-]?[0-9]{4}(?-u:\b)";

/// The replacement when the config names none.
pub const DEFAULT_REPLACEMENT: &str = "[REDACTED]";

/// How far from the end a position counts as live when the DFA gives up
/// on it (see the module docs).
pub const FALLBACK_WINDOW: usize = 256;

/// Most configured patterns accepted.
pub const MAX_PATTERNS: usize = 64;

/// The plugin's config; see the crate docs.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Extra patterns (Rust regex syntax) to redact.
    pub patterns: Vec<String>,
    /// What each match becomes.
    pub replacement: String,
    /// Whether to redact e-mail addresses.
    pub emails: bool,
    /// Whether to redact phone numbers.
    pub phones: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            patterns: Vec::new(),
            replacement: DEFAULT_REPLACEMENT.to_owned(),
            emails: true,
            phones: true,
        }
    }
}

/// The JSON Schema of [`Config`].
pub fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "patterns": {
                "type": "array",
                "maxItems": MAX_PATTERNS,
                "items": {"type": "string", "minLength": 1, "maxLength": 1024}
            },
            "replacement": {"type": "string", "maxLength": 256},
            "emails": {"type": "boolean"},
            "phones": {"type": "boolean"}
        },
        "additionalProperties": false
    })
}

/// A compiled pattern set and its replacement.
#[derive(Debug)]
pub struct Redactor {
    /// `None` when there are no patterns at all: text passes unchanged.
    set: Option<Set>,
    replacement: String,
}

#[derive(Debug)]
struct Set {
    /// Finds matches.
    regex: meta::Regex,
    /// Tells live positions (see the module docs).
    dfa: DFA,
    /// The DFA's state cache. A `RefCell` so that `Redactor` can be shared
    /// between the choices' streams; components are single-threaded.
    cache: RefCell<Cache>,
}

impl Redactor {
    /// Compiles the patterns of `config`. Errors name the offending
    /// configured pattern.
    pub fn new(config: &Config) -> Result<Redactor, String> {
        if config.patterns.len() > MAX_PATTERNS {
            return Err(format!("at most {MAX_PATTERNS} patterns are allowed"));
        }
        let mut patterns: Vec<&str> = Vec::new();
        if config.emails {
            patterns.push(EMAIL);
        }
        if config.phones {
            patterns.extend([PHONE_INTERNATIONAL, PHONE_NANP]);
        }
        for (i, p) in config.patterns.iter().enumerate() {
            let hir = regex_syntax::Parser::new()
                .parse(p)
                .map_err(|e| format!("pattern {i} ({p:?}) is not a valid regex: {e}"))?;
            // A pattern that matches "" would insert the replacement
            // between every two characters.
            if hir.properties().minimum_len() == Some(0) {
                return Err(format!("pattern {i} ({p:?}) matches the empty string"));
            }
            patterns.push(p);
        }
        let set = if patterns.is_empty() {
            None
        } else {
            let regex = meta::Regex::new_many(&patterns)
                .map_err(|e| format!("patterns do not compile: {e}"))?;
            let dfa = DFA::builder()
                // Without this a configured `\b` would fail the build;
                // with it the DFA gives up on non-ASCII bytes instead.
                .configure(DFA::config().unicode_word_boundary(true))
                .build_many(&patterns)
                .map_err(|e| format!("patterns do not compile: {e}"))?;
            let cache = RefCell::new(dfa.create_cache());
            Some(Set { regex, dfa, cache })
        };
        Ok(Redactor {
            set,
            replacement: config.replacement.clone(),
        })
    }

    /// Redacts a whole text.
    pub fn redact(&self, text: &str) -> String {
        self.step(text, 0, true).0
    }

    /// Redacts `buf[start..]` (`buf[..start]` is context already released,
    /// seen only by look-behind such as `\b`). Unless `finish`, stops at the
    /// first live position. Returns the redacted text and where it stopped.
    fn step(&self, buf: &str, start: usize, finish: bool) -> (String, usize) {
        let Some(set) = &self.set else {
            return (buf[start..].to_owned(), buf.len());
        };
        let mut out = String::new();
        let mut pos = start;
        for m in set.regex.find_iter(Input::new(buf).range(start..)) {
            if !finish {
                // Text before the match is final up to the first live
                // position; a match is final if its start is not live.
                let stop = set
                    .first_live(buf, pos, m.start())
                    .or_else(|| set.is_live(buf, m.start()).then_some(m.start()));
                if let Some(s) = stop {
                    out.push_str(&buf[pos..s]);
                    return (out, s);
                }
            }
            out.push_str(&buf[pos..m.start()]);
            out.push_str(&self.replacement);
            pos = m.end();
        }
        let end = if finish {
            buf.len()
        } else {
            set.first_live(buf, pos, buf.len()).unwrap_or(buf.len())
        };
        out.push_str(&buf[pos..end]);
        (out, end)
    }
}

impl Set {
    /// The first live character position in `from..to`.
    fn first_live(&self, buf: &str, from: usize, to: usize) -> Option<usize> {
        (from..to).find(|&s| buf.is_char_boundary(s) && self.is_live(buf, s))
    }

    /// Whether a match starting at `s` could still reach past the end of
    /// `buf` (see the module docs).
    fn is_live(&self, buf: &str, s: usize) -> bool {
        let bytes = buf.as_bytes();
        let fallback = bytes.len() - s < FALLBACK_WINDOW;
        let mut cache = self.cache.borrow_mut();
        let config = start::Config::new()
            .anchored(Anchored::Yes)
            .look_behind(s.checked_sub(1).map(|i| bytes[i]));
        let Ok(mut sid) = self.dfa.start_state(&mut cache, &config) else {
            return fallback;
        };
        for &b in &bytes[s..] {
            if sid.is_dead() {
                return false;
            }
            if sid.is_quit() {
                return fallback;
            }
            sid = match self.dfa.next_state(&mut cache, sid, b) {
                Ok(next) => next,
                Err(_) => return fallback,
            };
        }
        if sid.is_quit() {
            return fallback;
        }
        !sid.is_dead()
    }
}

/// The held-back text of one streamed choice.
#[derive(Debug, Default)]
pub struct Stream {
    /// The last released character (context for look-behind), then the
    /// text not released yet.
    buf: String,
    /// Where the unreleased text starts in `buf`.
    start: usize,
}

impl Stream {
    /// Adds a piece of the choice's text and returns what can be released
    /// now; with `finish`, returns everything still held.
    pub fn push(&mut self, redactor: &Redactor, text: &str, finish: bool) -> String {
        self.buf.push_str(text);
        let (out, pos) = redactor.step(&self.buf, self.start, finish);
        if finish {
            self.buf.clear();
            self.start = 0;
        } else {
            // Keep one released character before `pos` as context.
            let keep_from = self.buf[..pos]
                .char_indices()
                .next_back()
                .map_or(0, |(i, _)| i);
            self.buf.drain(..keep_from);
            self.start = pos - keep_from;
        }
        out
    }

    /// Bytes held back (not yet released).
    pub fn held(&self) -> usize {
        self.buf.len() - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redactor(v: Value) -> Redactor {
        let config: Config = pagoda_sdk::serde_json::from_value(v).expect("config");
        Redactor::new(&config).expect("redactor")
    }

    fn stream_all(r: &Redactor, pieces: &[&str]) -> String {
        let mut s = Stream::default();
        let mut out = String::new();
        for p in pieces {
            out += &s.push(r, p, false);
        }
        out += &s.push(r, "", true);
        out
    }

    #[test]
    fn emails() {
        let r = redactor(json!({}));
        assert_eq!(
            r.redact("Write to john.doe+x@mail.example.co.uk."),
            "Write to [REDACTED]."
        );
        assert_eq!(
            r.redact("a@b.c is no address, a@b.cd is"),
            "a@b.c is no address, [REDACTED] is"
        );
        assert_eq!(
            r.redact("user@localhost and @home and x@"),
            "user@localhost and @home and x@"
        );
    }

    #[test]
    fn phones() {
        let r = redactor(json!({"emails": false}));
        for phone in [
            "555-123-4567",
            "(555) 123-4567",
            "(555)123-4567",
            "1 555.123.4567",
            "5551234567",
            "+1 555 123 4567",
            "+44 20 7946 0958",
            "+33 6 12 34 56 78",
            "+15551234567",
            "+49 (30) 1234 5678",
        ] {
            assert_eq!(
                r.redact(&format!("call {phone} now")),
                "call [REDACTED] now",
                "{phone}"
            );
        }
        for not_phone in [
            "2024-07-26",
            "12 34 56",
            "555-1234",
            "in 1999 2000 2001",
            "v1.2.3",
            "12345678901234",
        ] {
            assert_eq!(r.redact(not_phone), not_phone);
        }
    }

    #[test]
    fn configured_patterns_and_replacement() {
        let r = redactor(
            json!({"patterns": [r"\bAcme\w*", "(?i)secret"], "replacement": "#", "phones": false}),
        );
        assert_eq!(
            r.redact("AcmeCorp's SeCrEt: x@y.org; notAcme"),
            "#'s #: #; notAcme"
        );
        let none = redactor(json!({"emails": false, "phones": false}));
        assert_eq!(none.redact("x@y.org 555-123-4567"), "x@y.org 555-123-4567");
        assert_eq!(stream_all(&none, &["x@y", ".org"]), "x@y.org");
    }

    #[test]
    fn bad_patterns_rejected() {
        let config = |p: &str| Config {
            patterns: vec![p.to_owned()],
            ..Config::default()
        };
        assert!(Redactor::new(&config("("))
            .unwrap_err()
            .contains("not a valid regex"));
        assert!(Redactor::new(&config("a*"))
            .unwrap_err()
            .contains("empty string"));
    }

    #[test]
    fn streaming_across_boundaries() {
        let r = redactor(json!({}));
        assert_eq!(
            stream_all(
                &r,
                &[
                    "Mail jo",
                    "hn@exa",
                    "mple.",
                    "com or call 555-",
                    "123-45",
                    "67."
                ]
            ),
            "Mail [REDACTED] or call [REDACTED]."
        );
        // An address that grows after looking complete.
        assert_eq!(stream_all(&r, &["a@b.co", "m.au", " x"]), "[REDACTED] x");
    }

    #[test]
    fn streaming_releases_early() {
        let r = redactor(json!({}));
        let mut s = Stream::default();
        // The last word could still become an address: held.
        assert_eq!(s.push(&r, "Hello there fri", false), "Hello there ");
        assert_eq!(s.push(&r, "end, how", false), "friend, ");
        assert_eq!(s.held(), 3);
        // A finished address is released as soon as it cannot grow.
        assert_eq!(s.push(&r, " is a@b.org", false), "how is ");
        assert_eq!(s.push(&r, " ok", false), "[REDACTED] ");
        assert_eq!(s.push(&r, "", true), "ok");
        // Nothing is held after finish, and the stream can be reused.
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn finish_flushes_partial_match() {
        let r = redactor(json!({}));
        let mut s = Stream::default();
        assert_eq!(s.push(&r, "to bob@example", false), "to ");
        assert_eq!(s.push(&r, ".org", true), "[REDACTED]");
        let mut s = Stream::default();
        assert_eq!(s.push(&r, "to bob@", false), "to ");
        assert_eq!(s.push(&r, "", true), "bob@");
    }

    /// A deterministic pseudo-random generator, so failures reproduce.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n
        }
    }

    /// Splits `text` at random character boundaries into 1..=n pieces.
    fn random_split<'a>(rng: &mut Lcg, text: &'a str) -> Vec<&'a str> {
        let bounds: Vec<usize> = (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        if bounds.is_empty() {
            return vec![text];
        }
        let mut cuts: Vec<usize> = (0..rng.next(8))
            .map(|_| bounds[rng.next(bounds.len())])
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([text.len()]) {
            pieces.push(&text[prev..c]);
            prev = c;
        }
        pieces
    }

    #[test]
    fn streaming_equals_whole_text() {
        let configs = [
            json!({}),
            json!({"patterns": [r"\bAcme\w*", "(?i)secret plan", r"[0-9]+ dollars", "é+"], "replacement": "<x>"}),
            json!({"patterns": [r"^Hello", r"end$", r"(?m)^line"], "emails": false}),
        ];
        let texts = [
            "Contact jane.doe@example.com or +44 20 7946 0958; also bob@x.io.",
            "Call (555) 123-4567, 555.123.4567 or 1-555-123-4567 today, not 2024-07-26.",
            "Hello Acmeé, the SECRET plan costs 1000000 dollars. éééé end",
            "line one\nline two: café@example.fr? naïve — Acme_Ünïcode résumé@mail.com end",
            "a@b.c a@b.cd @@ x@y.z.w +1 555 123 4567 +33 6 12 34 56 78 5551234567",
            "",
            "no matches at all in this one, just words and numbers 12 34.",
        ];
        let mut rng = Lcg(7);
        for config in &configs {
            let r = redactor(config.clone());
            for text in texts {
                let whole = r.redact(text);
                for _ in 0..200 {
                    let pieces = random_split(&mut rng, text);
                    assert_eq!(
                        stream_all(&r, &pieces),
                        whole,
                        "config {config}, pieces {pieces:?}"
                    );
                }
                // One character at a time, the hardest split.
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(
                    stream_all(&r, &pieces),
                    whole,
                    "config {config}, char by char"
                );
            }
        }
    }
}
