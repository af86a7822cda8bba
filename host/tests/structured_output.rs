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

/// A schema's regexes are enforced or refused at compile time, never
/// dropped: a pattern too large to match (wherever the schema carries it)
/// is the client's error, as are llguidance options that would weaken the
/// schema.
#[test]
fn schema_regexes_too_large_to_match_are_refused() {
    let (_, c) = compiler();
    let js = |v: serde_json::Value| StructuredOutputs::new(OutputConstraint::JsonSchema(v));
    let big = "(a{100}){100}";
    for schema in [
        json!({"type": "string", "pattern": big}),
        json!({"type": "object", "properties": {"a": {"type": "string", "pattern": big}},
            "required": ["a"]}),
        json!({"type": "object", "patternProperties": {big: {"type": "integer"}}}),
        json!({"type": "array", "items": {"anyOf": [{"type": "string", "pattern": big}]}}),
        // A `$ref` may point anywhere in the document.
        json!({"$ref": "#/x", "x": {"type": "string", "pattern": big}}),
        json!({"type": "object", "x-guidance": {"whitespace_pattern": "(a{1000}){1000}"}}),
    ] {
        let e = c
            .compile(&js(schema.clone()))
            .expect_err(&schema.to_string());
        assert!(e.contains("too large to match"), "{schema}: {e}");
    }
    // `lenient` would drop the unknown format; it is refused instead.
    let e = c
        .compile(&js(json!({"type": "string", "format": "no-such-format",
            "x-guidance": {"lenient": true}})))
        .expect_err("lenient");
    assert!(e.contains("no-such-format"), "{e}");
    // Realistic patterns compile, and are enforced.
    for rx in [
        "^[a-f0-9]{64}$",
        r"^\w+([\.-]?\w+)*@\w+([\.-]?\w+)*(\.\w{2,})+$",
        r"^\d{4}-\d{2}-\d{2}$",
    ] {
        c.compile(&js(json!({"type": "string", "pattern": rx})))
            .unwrap_or_else(|e| panic!("{rx}: {e}"));
    }
    let (tok, c) = compiler();
    let schema = js(json!({"type": "object",
        "properties": {"a": {"type": "string", "pattern": "^x[yz]{2}$"}},
        "required": ["a"], "additionalProperties": false}));
    let texts = walk(&tok, &c, &schema, 40);
    for t in texts {
        let v: serde_json::Value =
            serde_json::from_str(&t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        let a = v["a"].as_str().unwrap_or_else(|| panic!("{t}"));
        assert!(
            a.len() == 3 && a.starts_with('x') && a[1..].chars().all(|ch| ch == 'y' || ch == 'z'),
            "{t}"
        );
    }
}

/// A constraint whose language is empty is refused when it compiles, with
/// a message that says so, whatever its kind.
#[test]
fn constraints_that_match_no_text_are_refused() {
    let (_, c) = compiler();
    let regex = |r: &str| StructuredOutputs::new(OutputConstraint::Regex(r.into()));
    let lark = |g: &str| StructuredOutputs::new(OutputConstraint::Grammar(g.into()));
    let js = |v: serde_json::Value| StructuredOutputs::new(OutputConstraint::JsonSchema(v));
    for spec in [
        regex(r"[^\s\S]"),
        regex(r"a[^\s\S]b|[^\d\D]"),
        lark(r#"start: start "a""#),
        lark(r"start: /[^\s\S]/"),
        js(json!({"type": "string", "enum": []})),
        js(json!(false)),
        js(json!({"allOf": [{"type": "string"}, {"type": "integer"}]})),
        js(json!({"type": "object", "properties": {"a": false}, "required": ["a"]})),
        js(json!({"type": "string", "pattern": "^a$", "minLength": 3})),
    ] {
        let e = c.compile(&spec).expect_err(&format!("{spec:?}"));
        assert!(e.contains("matches no text"), "{spec:?}: {e}");
    }
    // Anchors that cannot hold: a text start after a character.
    for rx in ["a^b", "a$b"] {
        let e = c.compile(&regex(rx)).expect_err(rx);
        assert!(e.contains("matches no text"), "{rx}: {e}");
    }
    // The empty string is a language, not an empty one.
    c.compile(&regex("")).expect("the empty string");
    c.compile(&regex("a?")).expect("optional");
}
