//! Structured output's cost per step: how long llguidance takes to compute
//! a token mask over the demo model's 49,152-token vocabulary, p50 / p99,
//! while a matcher walks realistic outputs of a few schemas token by token
//! (the engine runs this beside the forward, so it is hidden while it stays
//! below the forward's time). Also the one-time token-trie build and the
//! per-request compile.
//!
//! `cargo bench -p pagoda --bench structured_output`
//! (the demo model from `$PAGODA_DEMO_GGUF`, else scripts/fetch-demo-model.sh)

#[path = "../tests/common/mod.rs"]
mod common;

use common::demo_gguf;
use pagoda::engine::loader::gguf::GgufFile;
use pagoda::engine::structured_output::{GrammarCompiler, OutputConstraint, StructuredOutputs};
use pagoda::tokenizer::Tokenizer;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let path = demo_gguf();
    let g = GgufFile::open(&path).expect("demo model");
    let tok = Arc::new(Tokenizer::from_gguf(&g).expect("tokenizer"));
    let started = Instant::now();
    let compiler =
        GrammarCompiler::new(tok.clone(), tok.eos_ids(), tok.vocab_size()).expect("compiler");
    println!(
        "token trie + parser factory, {} tokens: {:.1} ms",
        tok.vocab_size(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let cases = [
        (
            "person (flat object, bounds)",
            json!({"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "format": "email"}},
                "required": ["name", "age", "email"], "additionalProperties": false}),
            r#"{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}"#,
        ),
        (
            "order (nested, arrays, enums)",
            json!({"type": "object", "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "status": {"enum": ["new", "paid", "shipped"]},
                "items": {"type": "array", "items": {"type": "object", "properties": {
                    "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0}},
                    "required": ["sku", "qty", "price"], "additionalProperties": false}},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": false}},
                "required": ["id", "status", "items", "address"], "additionalProperties": false}),
            r#"{"id": "ORD-2024", "status": "paid", "items": [{"sku": "A-17", "qty": 2, "price": 9.99}, {"sku": "B-3", "qty": 1, "price": 120.5}], "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}}"#,
        ),
        (
            "any JSON object",
            json!({"type": "object"}),
            r#"{"title": "Notes", "tags": ["a", "b"], "body": {"text": "Hello, world!", "n": 3.25}}"#,
        ),
    ];
    let mut all = Vec::new();
    println!(
        "{:<32} {:>7} {:>11} {:>9} {:>9} {:>9}",
        "schema", "tokens", "compile ms", "p50 µs", "p99 µs", "max µs"
    );
    for (name, schema, text) in cases {
        let spec = StructuredOutputs::new(OutputConstraint::JsonSchema(schema));
        let ids = tok.encode(text, false).expect("encode");
        let mut times = Vec::new();
        let mut compile_ms = 0.0;
        // Several passes, so that p99 means something.
        for _ in 0..20 {
            let t0 = Instant::now();
            let mut m = compiler.compile(&spec).expect("compile");
            compile_ms += t0.elapsed().as_secs_f64() * 1e3 / 20.0;
            for &id in &ids {
                let t = Instant::now();
                let mask = m.compute_mask().expect("mask");
                times.push(t.elapsed().as_secs_f64() * 1e6);
                assert!(
                    mask.allows(id),
                    "{name}: the sample output is not valid at {id}"
                );
                m.consume(id).expect("consume");
            }
        }
        all.extend_from_slice(&times);
        times.sort_by(f64::total_cmp);
        println!(
            "{:<32} {:>7} {:>11.2} {:>9.0} {:>9.0} {:>9.0}",
            name,
            ids.len(),
            compile_ms,
            percentile(&times, 0.5),
            percentile(&times, 0.99),
            times[times.len() - 1]
        );
    }
    all.sort_by(f64::total_cmp);
    println!(
        "all steps ({}): p50 {:.0} µs, p99 {:.0} µs",
        all.len(),
        percentile(&all, 0.5),
        percentile(&all, 0.99)
    );
}
