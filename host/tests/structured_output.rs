//! Structured output's matcher on the demo model's real tokenizer, with no
//! model in the loop: random walks over the tokens each mask allows must
//! always be consumable, and must spell text the constraint accepts. This
//! is where byte-level edge cases live: tokens that end inside a UTF-8
//! character, grammars that force part of one, Unicode digits under `\d`.

mod common;

use pagoda::engine::loader::gguf::GgufFile;
use pagoda::engine::structured_output::{GrammarCompiler, OutputConstraint, StructuredOutputs};
use pagoda::tokenizer::Tokenizer;
use serde_json::json;
use std::sync::Arc;

fn compiler() -> (Arc<Tokenizer>, GrammarCompiler) {
    let g = GgufFile::open(&common::demo_gguf()).expect("demo model");
    let tok = Arc::new(Tokenizer::from_gguf(&g).expect("tokenizer"));
    let c = GrammarCompiler::new(tok.clone(), tok.eos_ids(), tok.vocab_size()).expect("compiler");
    (tok, c)
}

/// A tiny deterministic generator, so a failing walk can be replayed.
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

/// Walks `spec` `walks` times, choosing uniformly among the allowed tokens;
/// returns the texts of the walks that completed.
fn walk(tok: &Tokenizer, c: &GrammarCompiler, spec: &StructuredOutputs, walks: u64) -> Vec<String> {
    let eos = tok.eos_ids();
    let mut done = Vec::new();
    for seed in 0..walks {
        let mut rng = Lcg(seed);
        let mut m = c.compile(spec).expect("compile");
        let mut ids = Vec::new();
        for _ in 0..48 {
            let mask = m
                .compute_mask()
                .unwrap_or_else(|e| panic!("{spec:?} seed {seed}: {e}"));
            let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
                .filter(|&t| mask.allows(t))
                .collect();
            assert_eq!(allowed.len(), mask.num_allowed());
            let t = allowed[rng.below(allowed.len())];
            if eos.contains(&t) {
                break;
            }
            m.consume(t).unwrap_or_else(|e| {
                panic!("{spec:?} seed {seed}: token {t} allowed but refused: {e}")
            });
            ids.push(t);
            if m.is_complete() {
                break;
            }
        }
        if m.is_complete()
            || m.compute_mask()
                .is_ok_and(|mask| eos.iter().any(|&e| mask.allows(e)))
        {
            done.push(tok.decode(&ids, false).expect("decode"));
        }
    }
    done
}

#[test]
fn every_allowed_token_is_consumable_and_spells_accepted_text() {
    let (tok, c) = compiler();
    let choice = |v: &[&str]| {
        StructuredOutputs::new(OutputConstraint::Choice(
            v.iter().map(|s| s.to_string()).collect(),
        ))
    };
    // Alternatives that share the first byte of a multi-byte character:
    // the grammar forces C3 (or F0 9F AF) alone.
    for (spec, accepts) in [
        (choice(&["é1", "è2"]), &["é1", "è2"][..]),
        (choice(&["🯰1", "🯱2"]), &["🯰1", "🯱2"][..]),
    ] {
        for text in walk(&tok, &c, &spec, 40) {
            assert!(accepts.contains(&text.as_str()), "{spec:?}: {text:?}");
        }
    }
    // Unicode digits (\d is Unicode-aware), reached through partial tokens.
    let rx = StructuredOutputs::new(OutputConstraint::Regex(r"\d{3}-\d{2}".into()));
    let texts = walk(&tok, &c, &rx, 60);
    assert!(!texts.is_empty());
    for t in texts {
        let chars: Vec<char> = t.chars().collect();
        assert!(
            chars.len() == 6
                && chars[3] == '-'
                && chars
                    .iter()
                    .enumerate()
                    .all(|(i, ch)| i == 3 || ch.is_numeric()),
            "{t:?}"
        );
    }
    // JSON: every completed walk parses.
    let schema = StructuredOutputs::new(OutputConstraint::JsonSchema(json!({
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "é"]}},
        "required": ["a", "b"], "additionalProperties": false})));
    for t in walk(&tok, &c, &schema, 40) {
        let v: serde_json::Value =
            serde_json::from_str(&t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        assert!(v["a"].is_i64() && (v["b"] == "x" || v["b"] == "é"), "{t}");
    }
}
