//! Structured output: a grammar decides which tokens may come next.
//!
//! A request's constraint ([`StructuredOutputs`]: a JSON schema, any JSON
//! object, a regex, a choice of strings or a Lark grammar) is compiled once,
//! on the request's way in, into a [`GrammarMatcher`] by the model's
//! [`GrammarCompiler`] (llguidance over a token trie of the model's own
//! tokenizer). In the engine, each step that samples for the request
//! computes the matcher's [`TokenMask`] on a thread of its own while the
//! forward runs, applies it to the logits before sampling, and feeds the
//! sampled token back ([`GrammarMatcher::consume`]). A matcher whose
//! grammar is complete ends its request ("stop"); one cut short by
//! `max_tokens` ends with "length", so incomplete output is never reported
//! as complete.

use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, Context};
use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{panic_utils, Matcher, ParserFactory};
use serde_json::{json, Value};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputConstraint {
    /// JSON valid against this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text in the language of this Lark grammar (llguidance's dialect).
    Grammar(String),
}

/// A constraint with vLLM's options for JSON (`structured_outputs` and
/// the `response_format` / `guided_*` fields that map onto it).
#[derive(Clone, Debug, PartialEq)]
pub struct StructuredOutputs {
    pub constraint: OutputConstraint,
    /// JSON without whitespace between tokens (vLLM's
    /// `disable_any_whitespace`). Otherwise the model may write any
    /// whitespace JSON allows, as with vLLM's guidance backend.
    pub disable_any_whitespace: bool,
    /// Objects of the schema that say nothing about `additionalProperties`
    /// allow none (vLLM's `disable_additional_properties`).
    pub disable_additional_properties: bool,
}

impl StructuredOutputs {
    /// A constraint with vLLM's default options.
    pub fn new(constraint: OutputConstraint) -> StructuredOutputs {
        StructuredOutputs {
            constraint,
            disable_any_whitespace: false,
            disable_additional_properties: false,
        }
    }

    /// The llguidance grammar, with the options folded in.
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        let json = |mut schema: Value| -> Result<TopLevelGrammar, String> {
            if self.disable_additional_properties {
                close_objects(&mut schema);
            }
            // Every regex the schema carries is checked as the `regex`
            // constraint is, plus a bound on its expanded size: llguidance
            // matches a `pattern` anywhere in the string, and its lexer's
            // cost then grows with the pattern's size as the output grows,
            // so a pattern such as `(a{100}){100}` would compile, pass the
            // first mask, and exhaust the lexer a few hundred tokens later.
            check_schema_regexes(&schema)?;
            if let Some(o) = schema.as_object_mut() {
                // llguidance reads its options from the top-level
                // `x-guidance`. Those that weaken the schema (`lenient`
                // drops what it does not support, `coerce_one_of` turns
                // `oneOf` into `anyOf`) are off: a constraint is enforced
                // or refused, never dropped.
                let mut options = match o.remove("x-guidance") {
                    None => serde_json::Map::new(),
                    Some(Value::Object(m)) => m,
                    Some(_) => return Err("'x-guidance' must be an object".into()),
                };
                for key in ["whitespace_pattern", "item_separator", "key_separator"] {
                    if let Some(v) = options.get(key) {
                        let rx = v
                            .as_str()
                            .ok_or_else(|| format!("'x-guidance.{key}' must be a string"))?;
                        check_regex_size(rx, true)
                            .map_err(|e| format!("'x-guidance.{key}': {e}"))?;
                    }
                }
                options.insert("lenient".into(), Value::Bool(false));
                options.insert("coerce_one_of".into(), Value::Bool(false));
                if self.disable_any_whitespace {
                    options.insert("whitespace_flexible".into(), Value::Bool(false));
                }
                o.insert("x-guidance".into(), Value::Object(options));
            }
            Ok(TopLevelGrammar::from_json_schema(schema))
        };
        Ok(match &self.constraint {
            OutputConstraint::JsonSchema(s) => {
                if !(s.is_object() || s.is_boolean()) {
                    return Err("the JSON schema must be an object".into());
                }
                json(s.clone())?
            }
            OutputConstraint::JsonObject => json(json!({"type": "object"}))?,
            OutputConstraint::Regex(rx) => {
                // Checked here, so that a bad regex is the client's error
                // with the regex engine's message, not a grammar error.
                let hir = regex_syntax::Parser::new()
                    .parse(rx)
                    .map_err(|e| format!("invalid regex: {e}"))?;
                if hir.properties().minimum_len().is_none() || !can_match(&hir) {
                    return Err(MATCHES_NO_TEXT.into());
                }
                // A compile budget: llguidance builds its lexer lazily, so
                // a regex like `(a{1000}){1000}` would only fail (after
                // seconds of CPU) once tokens are generated. A regex whose
                // automaton exceeds REGEX_SIZE_LIMIT bytes is refused now.
                check_regex_size(rx, false)?;
                TopLevelGrammar::from_regex(rx)
            }
            OutputConstraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err("the choice list must not be empty".into());
                }
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            OutputConstraint::Grammar(g) => {
                if g.trim().is_empty() {
                    return Err("the grammar is empty".into());
                }
                TopLevelGrammar::from_lark(g.clone())
            }
        })
    }
}

/// The largest compiled regex (in the `regex` crate's measure) a
/// structured-output regex may be: a tenth of that crate's default, far
/// above any realistic output format.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// The most positions (characters and classes, counted repetitions
/// expanded) a regex of a JSON schema may have. llguidance matches a
/// schema's `pattern` anywhere in the string, so its lexer state can hold
/// a partial match from every position: measured on the demo model's
/// vocabulary, patterns of 2,000 positions match to the end (within about
/// 1.5 ms a token), while `(a{100}){100}` (10,000) exhausts the lexer's
/// budget a few hundred tokens into the string. Realistic patterns (dates,
/// identifiers, e-mail addresses, `[a-f0-9]{64}`) are far below.
const SCHEMA_REGEX_POSITIONS_LIMIT: u64 = 2_000;

/// The error of a constraint whose language is empty.
const MATCHES_NO_TEXT: &str = "the constraint matches no text, so no output can satisfy it";

/// Refuses a regex too large to match within the budget: over
/// REGEX_SIZE_LIMIT in the `regex` crate's measure, or, for the regexes of
/// a JSON schema (`bounded_positions`), over SCHEMA_REGEX_POSITIONS_LIMIT
/// positions.
fn check_regex_size(rx: &str, bounded_positions: bool) -> Result<(), String> {
    if bounded_positions {
        // llguidance parses the pattern after rewriting `\d` and `\w` to
        // their ASCII classes; what it cannot parse, it refuses itself.
        let lark = llguidance::regex_to_lark(rx, "dw");
        if let Ok(hir) = regex_syntax::Parser::new().parse(&lark) {
            let n = positions(&hir);
            if n > SCHEMA_REGEX_POSITIONS_LIMIT {
                return Err(format!(
                    "the regex {} is too large to match: {n} positions once its repetitions are expanded, over the limit of {SCHEMA_REGEX_POSITIONS_LIMIT}",
                    short(rx)
                ));
            }
        }
    }
    match regex::RegexBuilder::new(rx)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
    {
        Ok(_) => Ok(()),
        // A schema's regex in syntax the `regex` crate lacks is left to
        // llguidance, which refuses what it cannot parse.
        Err(e) if bounded_positions && !matches!(e, regex::Error::CompiledTooBig(_)) => Ok(()),
        Err(e) => Err(format!(
            "the regex {} is too large to match: {e}",
            short(rx)
        )),
    }
}

/// A regex for an error message, cut to a readable length.
fn short(rx: &str) -> String {
    const MAX: usize = 80;
    match rx.char_indices().nth(MAX) {
        None => format!("/{rx}/"),
        Some((i, _)) => format!("/{}.../", &rx[..i]),
    }
}

/// The positions of `hir`: its characters and classes, with counted
/// repetitions expanded (an unbounded one counts its minimum, at least
/// once), saturating.
fn positions(hir: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) => 0,
        HirKind::Literal(l) => l.0.len() as u64,
        HirKind::Class(_) => 1,
        HirKind::Repetition(r) => {
            let times = u64::from(r.max.unwrap_or(r.min).max(1));
            positions(&r.sub).saturating_mul(times)
        }
        HirKind::Capture(c) => positions(&c.sub),
        HirKind::Concat(v) | HirKind::Alternation(v) => v
            .iter()
            .fold(0u64, |acc, h| acc.saturating_add(positions(h))),
    }
}

/// Whether a regex matched against the whole text matches anything, as far
/// as its anchors tell: `a^b` and `a$b` match nothing (a text start after a
/// character, a character after the text end). An abstract run over four
/// states: nothing or something consumed yet, with the end asserted or
/// not. Each node is a function from a state to the states it can reach,
/// computed once, so nesting costs nothing extra; assertions other than
/// `^` and `$` pass every state (they can only say "maybe").
fn can_match(hir: &regex_syntax::hir::Hir) -> bool {
    apply(&reach(hir), START) != 0
}

/// States: nothing consumed; something consumed; then the same two with
/// the end of the text asserted.
const START: u8 = 1;
const CONSUMED: u8 = 2;
const START_AT_END: u8 = 4;
const CONSUMED_AT_END: u8 = 8;

/// For each of the four states, the set of states reachable from it.
type Reach = [u8; 4];

const IDENTITY: Reach = [START, CONSUMED, START_AT_END, CONSUMED_AT_END];

fn apply(f: &Reach, set: u8) -> u8 {
    (0..4)
        .filter(|i| set & (1 << i) != 0)
        .fold(0, |acc, i| acc | f[i])
}

/// `f` then `g`.
fn then(f: &Reach, g: &Reach) -> Reach {
    [0, 1, 2, 3].map(|i| apply(g, f[i]))
}

fn union(f: &Reach, g: &Reach) -> Reach {
    [0, 1, 2, 3].map(|i| f[i] | g[i])
}

/// `f` applied `n` times.
fn power(f: &Reach, mut n: u32) -> Reach {
    let (mut result, mut base) = (IDENTITY, *f);
    while n > 0 {
        if n & 1 == 1 {
            result = then(&result, &base);
        }
        base = then(&base, &base);
        n >>= 1;
    }
    result
}

fn reach(hir: &regex_syntax::hir::Hir) -> Reach {
    use regex_syntax::hir::{HirKind, Look};
    // A character: possible before the end is asserted, never after.
    let char_step: Reach = [CONSUMED, CONSUMED, 0, 0];
    match hir.kind() {
        HirKind::Empty => IDENTITY,
        HirKind::Literal(_) => char_step,
        HirKind::Class(c) => {
            let empty = match c {
                regex_syntax::hir::Class::Unicode(u) => u.ranges().is_empty(),
                regex_syntax::hir::Class::Bytes(b) => b.ranges().is_empty(),
            };
            if empty {
                [0; 4]
            } else {
                char_step
            }
        }
        HirKind::Look(Look::Start) => [START, 0, START_AT_END, 0],
        HirKind::Look(Look::End) => [START_AT_END, CONSUMED_AT_END, START_AT_END, CONSUMED_AT_END],
        HirKind::Look(_) => IDENTITY,
        HirKind::Capture(c) => reach(&c.sub),
        HirKind::Concat(v) => v.iter().fold(IDENTITY, |f, h| then(&f, &reach(h))),
        HirKind::Alternation(v) => v.iter().fold([0; 4], |f, h| union(&f, &reach(h))),
        HirKind::Repetition(r) => {
            let f = reach(&r.sub);
            let required = power(&f, r.min);
            // Up to `max - min` more: `IDENTITY | f` grows monotonically
            // over four states, so four more steps reach its fixpoint.
            let optional = union(&IDENTITY, &f);
            let extra = r.max.map_or(4, |max| (max - r.min).min(4));
            then(&required, &power(&optional, extra))
        }
    }
}

/// Checks every regex a JSON schema carries: each string under a `pattern`
/// key and each key of a `patternProperties` object, wherever they are (a
/// `$ref` may point anywhere in the document, so nothing is skipped).
fn check_schema_regexes(schema: &Value) -> Result<(), String> {
    match schema {
        Value::Object(o) => {
            for (k, v) in o {
                match (k.as_str(), v) {
                    ("pattern", Value::String(rx)) => {
                        check_regex_size(rx, true).map_err(|e| format!("'pattern': {e}"))?
                    }
                    ("patternProperties", Value::Object(props)) => {
                        for rx in props.keys() {
                            check_regex_size(rx, true)
                                .map_err(|e| format!("'patternProperties': {e}"))?;
                        }
                    }
                    _ => {}
                }
                check_schema_regexes(v)?;
            }
            Ok(())
        }
        Value::Array(a) => a.iter().try_for_each(check_schema_regexes),
        _ => Ok(()),
    }
}

/// Sets `additionalProperties: false` on every object schema that does not
/// say, so only the listed properties may appear.
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(o) => {
            let is_object_schema = o.get("type").and_then(Value::as_str) == Some("object")
                || o.get("properties").is_some_and(Value::is_object);
            if is_object_schema && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            for v in o.values_mut() {
                close_objects(v);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// The model's tokenizer as llguidance sees it: a trie of every token's
/// bytes, and the tokenizer itself for the text a grammar forces.
struct TokenizerEnvironment {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerEnvironment {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // llguidance tokenizes the bytes a grammar forces, which can end
        // (or start) inside a multi-byte character: "é1" | "è2" forces
        // C3 alone. The valid UTF-8 prefix goes through the tokenizer; the
        // bytes after it are matched against the trie, never replaced by
        // U+FFFD (whose tokens the grammar would then refuse).
        let valid = match std::str::from_utf8(s) {
            Ok(text) => text,
            Err(e) => std::str::from_utf8(&s[..e.valid_up_to()]).unwrap_or_default(),
        };
        let mut ids = if valid.is_empty() {
            Vec::new()
        } else {
            self.tokenizer.encode(valid, false).unwrap_or_default()
        };
        if valid.len() < s.len() {
            ids.extend(self.trie.greedy_tokenize(&s[valid.len()..]));
        }
        ids
    }
}

/// Compiles constraints for one model; built once, shared by its requests.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` over the model's `vocab_size`
    /// logits (ids past the tokenizer's own vocabulary are never allowed)
    /// with `eos_ids` as the tokens that end a complete output.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        eos_ids: &[u32],
        vocab_size: usize,
    ) -> anyhow::Result<GrammarCompiler> {
        let mut words = tokenizer.token_bytes();
        words.resize(vocab_size.max(words.len()), Vec::new());
        let n = u32::try_from(words.len()).context("the vocabulary is too large")?;
        let eos = *eos_ids.first().ok_or_else(|| {
            anyhow!("structured output needs an end-of-sequence token, and the tokenizer has none")
        })?;
        if eos >= n {
            return Err(anyhow!(
                "the end-of-sequence token {eos} is beyond the vocabulary of {n}"
            ));
        }
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words).with_eos_tokens(
            &eos_ids
                .iter()
                .copied()
                .filter(|&t| t < n)
                .collect::<Vec<_>>(),
        );
        let env: TokEnv = Arc::new(TokenizerEnvironment { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).context("llguidance")?;
        // Errors go to the client; llguidance's own stderr log stays quiet,
        // and its errors say what went wrong without its whole state.
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(GrammarCompiler { factory })
    }

    /// Compiles `s` into a matcher at the start of the output. The error is
    /// for the client: the schema, regex or grammar that does not compile,
    /// and why.
    pub fn compile(&self, s: &StructuredOutputs) -> Result<GrammarMatcher, String> {
        let grammar = s.grammar()?;
        let mut parser =
            panic_utils::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)))
                .map_err(|e| {
                    let e = e.to_string();
                    // llguidance's word for a schema no JSON value satisfies.
                    if e.contains("Unsatisfiable schema") {
                        format!("{MATCHES_NO_TEXT} ({})", first_line(&e))
                    } else {
                        e
                    }
                })?;
        parser.start_without_prompt();
        // llguidance builds the lexer lazily: a regex such as
        // `(a{1000}){1000}` compiles, then exhausts its fuel or lexer states
        // on the first mask. Computing that mask here (it costs what the
        // first step would, within llguidance's budgets) turns such a
        // constraint into the client's 400 at admission instead of an
        // aborted output. The same mask tells a constraint whose language
        // is empty (`[^\s\S]`, `start: start "a"`): it allows no token,
        // or only the end of the output while the grammar is not complete.
        let first = panic_utils::catch_unwind(AssertUnwindSafe(|| parser.compute_mask()));
        let eos = self.factory.tok_env().tok_trie().eos_token_set();
        match first {
            Err(_)
                if matches!(
                    parser.stop_reason(),
                    StopReason::NoExtension | StopReason::NoExtensionBias
                ) =>
            {
                return Err(MATCHES_NO_TEXT.into())
            }
            Err(e) => {
                return Err(format!(
                    "it cannot be matched within the compute budget: {}",
                    first_line(&e)
                ))
            }
            Ok(mask) => {
                let only_eos = mask.iter().all(|t| eos.is_allowed(t));
                if only_eos && !parser.is_accepting() {
                    return Err(MATCHES_NO_TEXT.into());
                }
            }
        }
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(first_line(&e));
        }
        Ok(GrammarMatcher { matcher })
    }
}

/// The first line of an llguidance error (the rest is its state).
fn first_line(e: &dyn std::fmt::Display) -> String {
    let e = e.to_string();
    e.lines().next().unwrap_or_default().to_string()
}

/// One output's position in its grammar.
pub struct GrammarMatcher {
    matcher: Matcher,
}

impl Clone for GrammarMatcher {
    /// An independent copy (for the `n` choices of one request).
    fn clone(&self) -> Self {
        GrammarMatcher {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("stop_reason", &self.matcher.stop_reason())
            .finish()
    }
}

impl GrammarMatcher {
    /// The tokens that may come next: only EOS once the grammar is
    /// complete. This is the slow part (up to a millisecond or so), which
    /// the engine runs beside the forward.
    pub fn compute_mask(&mut self) -> Result<TokenMask, String> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("{e}"))?;
        if mask.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        Ok(TokenMask(mask))
    }

    /// Advances past the sampled `token`.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("{e}"))
    }

    /// Takes back the last `n` tokens (rejected speculative tokens).
    pub fn rollback(&mut self, n: usize) -> Result<(), String> {
        self.matcher.rollback(n).map_err(|e| format!("{e}"))
    }

    /// Whether the grammar is complete and allows nothing more, so the
    /// output ends here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

/// The tokens a grammar allows at one step.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Sets the logits of disallowed tokens to −∞, so no sampling method can
    /// pick them (ids past the mask are disallowed too).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// The mask as 32-bit words: bit `t % 32` of word `t / 32` set means
    /// token `t` is allowed (ids past the last word are not).
    pub fn words(&self) -> &[u32] {
        self.0.as_slice()
    }

    /// A mask over `vocab` ids allowing `allowed` (for tests of what
    /// consumes masks).
    #[cfg(test)]
    pub(crate) fn from_allowed(vocab: usize, allowed: impl IntoIterator<Item = u32>) -> TokenMask {
        let mut v = SimpleVob::alloc(vocab);
        for t in allowed {
            v.allow_token(t);
        }
        TokenMask(v)
    }

    /// Whether `token` is allowed.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// How many tokens are allowed.
    pub fn num_allowed(&self) -> usize {
        self.0.num_set()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_objects_keeps_explicit_choices() {
        let mut s = json!({
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {}}, "b": {"type": "string"}},
            "$defs": {"X": {"type": "object", "additionalProperties": true}}
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["b"].get("additionalProperties"), None);
        assert_eq!(s["$defs"]["X"]["additionalProperties"], json!(true));
    }

    #[test]
    fn bad_regexes_and_empty_choices_are_client_errors() {
        let bad = StructuredOutputs::new(OutputConstraint::Regex("(a".into()));
        assert!(bad.grammar().unwrap_err().contains("invalid regex"));
        let empty = StructuredOutputs::new(OutputConstraint::Choice(vec![]));
        assert!(empty.grammar().is_err());
        let not_object = StructuredOutputs::new(OutputConstraint::JsonSchema(json!([1])));
        assert!(not_object.grammar().is_err());
    }

    #[test]
    fn anchors_that_cannot_hold_match_nothing() {
        let m = |rx: &str| can_match(&regex_syntax::Parser::new().parse(rx).expect(rx));
        for rx in [
            "a^b",
            "a$b",
            "(a|b)^c",
            "x(^a){2}",
            "a+^",
            "$a",
            "[^\\s\\S]",
        ] {
            assert!(!m(rx), "{rx}");
        }
        for rx in [
            "^a$",
            "",
            "^$",
            "a?^b",
            "(^a|b)",
            "a*$",
            "(a|^)b",
            "(ab){0}^c",
            "\\bx",
        ] {
            assert!(m(rx), "{rx}");
        }
    }

    #[test]
    fn positions_expand_counted_repetitions() {
        let n = |rx: &str| positions(&regex_syntax::Parser::new().parse(rx).expect(rx));
        assert_eq!(n("(a{100}){100}"), 10_000);
        assert_eq!(n("^[a-f0-9]{64}$"), 64);
        assert_eq!(n("ab+|c{2,}"), 4);
        assert_eq!(n("((a{1000}){1000}){1000}"), 1_000_000_000);
        // Nested past u64, it saturates.
        assert_eq!(
            n("(((((((a{1000}){1000}){1000}){1000}){1000}){1000}){1000})"),
            u64::MAX
        );
    }

    #[test]
    fn schema_regexes_are_found_wherever_they_are() {
        let big = "(a{100}){100}";
        for schema in [
            json!({"pattern": big}),
            json!({"$defs": {"x": {"items": [{"pattern": big}]}}}),
            json!({"patternProperties": {big: {}}}),
        ] {
            assert!(check_schema_regexes(&schema).is_err(), "{schema}");
        }
        let fine = json!({"properties": {"pattern": {"type": "string", "pattern": "^a+$"}}});
        assert!(check_schema_regexes(&fine).is_ok());
        // x-guidance cannot weaken the schema.
        let lenient = StructuredOutputs::new(OutputConstraint::JsonSchema(
            json!({"type": "string", "x-guidance": {"lenient": true, "coerce_one_of": true}}),
        ));
        let g = serde_json::to_value(lenient.grammar().expect("grammar")).expect("json");
        let opts = &g["grammars"][0]["json_schema"]["x-guidance"];
        assert_eq!(opts["lenient"], json!(false), "{g}");
        assert_eq!(opts["coerce_one_of"], json!(false), "{g}");
    }
}

/// A step's sampling row whose request follows a grammar: its matcher,
/// taken out of the request for the step, and the mask computed beside
/// the forward, which the runner applies when it samples the row.
pub struct GuidedRow {
    /// The row among the step's logit rows.
    pub row: usize,
    /// The request.
    pub id: u64,
    pub matcher: GrammarMatcher,
    /// The mask, once computed (or why it could not be); the runner takes it.
    pub mask: Option<Result<TokenMask, String>>,
}
