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
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
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
        let json = |mut schema: Value| {
            if self.disable_additional_properties {
                close_objects(&mut schema);
            }
            if self.disable_any_whitespace {
                if let Some(o) = schema.as_object_mut() {
                    o.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
                }
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match &self.constraint {
            OutputConstraint::JsonSchema(s) => {
                if !(s.is_object() || s.is_boolean()) {
                    return Err("the JSON schema must be an object".into());
                }
                json(s.clone())
            }
            OutputConstraint::JsonObject => json(json!({"type": "object"})),
            OutputConstraint::Regex(rx) => {
                // Checked here, so that a bad regex is the client's error
                // with the regex engine's message, not a grammar error.
                regex_syntax::Parser::new()
                    .parse(rx)
                    .map_err(|e| format!("invalid regex: {e}"))?;
                // A compile budget: llguidance builds its lexer lazily, so
                // a regex like `(a{1000}){1000}` would only fail (after
                // seconds of CPU) once tokens are generated. A regex whose
                // automaton exceeds REGEX_SIZE_LIMIT bytes is refused now.
                regex::RegexBuilder::new(rx)
                    .size_limit(REGEX_SIZE_LIMIT)
                    .build()
                    .map_err(|e| format!("the regex is too large to match: {e}"))?;
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
        // Errors go to the client; llguidance's own stderr log stays quiet.
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// Compiles `s` into a matcher at the start of the output. The error is
    /// for the client: the schema, regex or grammar that does not compile,
    /// and why.
    pub fn compile(&self, s: &StructuredOutputs) -> Result<GrammarMatcher, String> {
        let grammar = s.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| format!("{e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        // llguidance builds the lexer lazily: a regex such as
        // `(a{1000}){1000}` compiles, then exhausts its fuel or lexer states
        // on the first mask. Computing that mask here (it costs what the
        // first step would, within llguidance's budgets) turns such a
        // constraint into the client's 400 at admission instead of an
        // aborted output.
        let mut m = GrammarMatcher { matcher };
        m.compute_mask()
            .map_err(|e| format!("it cannot be matched within the compute budget: {e}"))?;
        Ok(m)
    }
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
