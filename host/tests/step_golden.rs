//! The engine step, before and after: greedy outputs, their logprobs,
//! prompt logprobs and seeded samples (with every logit processor on, with
//! n-gram drafts and with a sampling draft model) must stay bitwise what
//! they were when `tests/golden/engine_step.json` was written. Restructuring
//! the step (who owns the batch, how sampling is laid out) must change no
//! number; a change that means to (a new kernel, a fixed sampler bug)
//! rewrites the file with `PAGODA_BLESS=1` and says why in its commit.
//!
//! The kernels run at the AVX2 level on every machine (`PAGODA_SIMD=avx2`,
//! set before any engine starts), so that the figures are the same on any
//! x86-64 CPU with AVX2 and FMA, and on two threads.
//!
//! Seeded samples must also not depend on what else is in the batch: each
//! seeded request run alone gives what it gave in the batch.

mod common;
mod support;

use pagoda::engine::request::TokenLogprob;
use pagoda::engine::spec_decode::SpeculativeConfig;
use pagoda::engine::{EngineArgs, Prompt, RequestOutput, SamplingParams, LLM};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Once;

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/engine_step.json")
}

/// Pins the kernels to AVX2 for every test of this file, before the first
/// engine reads the level.
fn pin_simd() {
    static PIN: Once = Once::new();
    PIN.call_once(|| {
        // SAFETY: every test of this binary calls this first, before any
        // thread of its own reads the environment; `Once` makes the others
        // wait until it is set.
        unsafe { std::env::set_var("PAGODA_SIMD", "avx2") };
    });
    assert_eq!(
        pagoda_accel::cpu::simd_level(),
        pagoda_accel::cpu::SimdLevel::Avx2,
        "the golden figures are AVX2's: this CPU must have AVX2 and FMA"
    );
}

/// FNV-1a over 64 bits: a digest of logprobs' bit patterns, so the golden
/// file stays small while any changed bit shows.
#[derive(Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn put(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn put_logprob(&mut self, l: &TokenLogprob) {
        self.put(l.token_id as u64);
        self.put(l.logprob.to_bits() as u64);
        self.put(l.rank as u64);
        for &(t, v) in &l.top {
            self.put(t as u64);
            self.put(v.to_bits() as u64);
        }
    }
    fn hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// One request's outputs as the golden file holds them: every sample's
/// ids and finish reason, a digest of its logprobs, and one of the prompt
/// logprobs.
fn record(outputs: &[RequestOutput]) -> Value {
    let mut list = Vec::new();
    for r in outputs {
        let prompt = r.prompt_logprobs.as_ref().map(|p| {
            let mut h = Fnv::new();
            p.iter().for_each(|l| h.put_logprob(l));
            json!({"count": p.len(), "digest": h.hex()})
        });
        let samples: Vec<Value> = r
            .outputs
            .iter()
            .map(|c| {
                let logprobs = c.logprobs.as_ref().map(|ls| {
                    let mut h = Fnv::new();
                    ls.iter().for_each(|l| h.put_logprob(l));
                    h.hex()
                });
                json!({
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason.map(|f| f.as_str()),
                    "logprobs": logprobs,
                })
            })
            .collect();
        list.push(json!({"prompt_logprobs": prompt, "samples": samples}));
    }
    Value::Array(list)
}

/// Compares `got` with the golden entry `case` (or writes it under
/// `PAGODA_BLESS=1`).
fn check(case: &str, got: Value) {
    let path = golden_path();
    let bless = std::env::var_os("PAGODA_BLESS").is_some();
    if bless {
        // Tests of this file run in parallel: one writer at a time.
        static WRITE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = WRITE.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Map<String, Value> = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        all.insert(case.to_string(), got);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir golden");
        let text = serde_json::to_string_pretty(&all).expect("json");
        std::fs::write(&path, text + "\n").expect("write golden");
        return;
    }
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; write it with PAGODA_BLESS=1 on the code it should describe",
            path.display()
        )
    });
    let all: Value = serde_json::from_slice(&bytes).expect("golden JSON");
    let want = all
        .get(case)
        .unwrap_or_else(|| panic!("no golden entry {case:?}: bless it with PAGODA_BLESS=1"));
    if want == &got {
        return;
    }
    let (w, g) = (
        want.as_array().expect("a list"),
        got.as_array().expect("a list"),
    );
    for (i, (w, g)) in w.iter().zip(g).enumerate() {
        assert_eq!(w, g, "{case}: request {i} changed");
    }
    assert_eq!(w.len(), g.len(), "{case}: a different number of requests");
}

fn demo_args() -> EngineArgs {
    pin_simd();
    let mut a = EngineArgs::new(common::demo_gguf());
    a.threads = 2;
    a.max_model_len = Some(512);
    a.kv_cache_memory = Some(64 << 20);
    a
}

fn texts(list: &[&str]) -> Vec<Prompt> {
    list.iter().map(|t| Prompt::Text(t.to_string())).collect()
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "fn main() {",
    "List three prime numbers:",
    "Once upon a time, in a small village by the river, there lived an old miller who",
    "Q: What is 12 times 7?\nA:",
];

/// Every logit processor and every truncation on at once.
fn seeded(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        n: 2,
        max_tokens: Some(max_tokens),
        temperature: Some(0.9),
        top_p: Some(0.9),
        top_k: Some(50),
        min_p: Some(0.02),
        repetition_penalty: Some(1.15),
        presence_penalty: 0.4,
        frequency_penalty: 0.3,
        logit_bias: vec![(13, 2.5), (198, -3.0)],
        seed: Some(1234),
        logprobs: Some(2),
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_outputs_and_their_logprobs_are_unchanged() {
    let mut llm = LLM::new(demo_args()).expect("engine");
    let mut p = SamplingParams::greedy(24);
    p.logprobs = Some(3);
    p.ignore_eos = true;
    let out = llm.generate(&texts(&PROMPTS), &p).expect("generate");
    check("demo greedy", record(&out));
}

#[test]
fn prompt_logprobs_are_unchanged() {
    let mut llm = LLM::new(demo_args()).expect("engine");
    let mut p = SamplingParams::greedy(1);
    p.prompt_logprobs = Some(3);
    let out = llm.generate(&texts(&PROMPTS[..3]), &p).expect("generate");
    check("demo prompt logprobs", record(&out));
    // max_tokens 0 only scores the prompt.
    p.max_tokens = Some(0);
    let out = llm.generate(&texts(&PROMPTS[3..]), &p).expect("generate");
    check("demo prompt logprobs, no output", record(&out));
}

#[test]
fn seeded_samples_are_unchanged_and_independent_of_the_batch() {
    let mut llm = LLM::new(demo_args()).expect("engine");
    let p = seeded(24);
    let batched = llm.generate(&texts(&PROMPTS), &p).expect("generate");
    for (i, prompt) in PROMPTS.iter().enumerate().step_by(2) {
        let alone = llm.generate(&texts(&[prompt]), &p).expect("generate");
        for (a, b) in alone[0].outputs.iter().zip(&batched[i].outputs) {
            assert_eq!(
                a.token_ids, b.token_ids,
                "prompt {i}: a seeded sample alone differs from the same in a batch"
            );
        }
    }
    check("demo seeded", record(&batched));
}

/// Copying prompts, so that n-gram drafts are often right and often wrong.
const COPY: [&str; 3] = [
    "Copy this text exactly.\nText: The river bends twice before it reaches the old mill.\nCopy: The river",
    "Copy this text exactly.\nText: fn add(a: u32, b: u32) -> u32 { a + b }\nCopy: fn add(",
    "Write a short story about number 7.",
];

#[test]
fn samples_verified_against_ngram_drafts_are_unchanged() {
    let mut a = demo_args();
    a.speculative = Some(
        SpeculativeConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 64}"#,
        )
        .expect("config"),
    );
    let mut llm = LLM::new(a).expect("engine");
    let mut greedy = SamplingParams::greedy(24);
    greedy.ignore_eos = true;
    greedy.logprobs = Some(1);
    let out = llm.generate(&texts(&COPY), &greedy).expect("generate");
    check("demo ngram greedy", record(&out));
    let p = SamplingParams {
        n: 2,
        max_tokens: Some(24),
        temperature: Some(0.7),
        top_k: Some(20),
        seed: Some(99),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let out = llm.generate(&texts(&COPY), &p).expect("generate");
    check("demo ngram seeded", record(&out));
}

fn fixture_args(model: &Path) -> EngineArgs {
    pin_simd();
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(64 << 20);
    a
}

const IDS: [&[u32]; 3] = [
    &[1, 5, 9, 2, 7],
    &[3, 3, 3, 4],
    &[11, 12, 13, 14, 15, 16, 17],
];

fn id_prompts() -> Vec<Prompt> {
    IDS.iter().map(|p| Prompt::Tokens(p.to_vec())).collect()
}

#[test]
fn generated_fixtures_are_unchanged() {
    let dir = support::fixtures::fixtures();
    for family in ["llama3", "qwen3moe", "deepseek-v3"] {
        let mut llm =
            LLM::new(fixture_args(&dir.join(family).join("model-F32.gguf"))).expect("engine");
        let mut p = SamplingParams::greedy(12);
        p.prompt_logprobs = Some(2);
        p.logprobs = Some(2);
        p.ignore_eos = true;
        let out = llm.generate(&id_prompts(), &p).expect("generate");
        check(&format!("{family} greedy"), record(&out));
        let out = llm.generate(&id_prompts(), &seeded(12)).expect("generate");
        check(&format!("{family} seeded"), record(&out));
    }
}

#[test]
fn samples_verified_against_a_sampling_draft_model_are_unchanged() {
    // llama3 drafted by the unrelated qwen3, drafts drawn from qwen3's own
    // distribution: the draft model's draws and verification's share each
    // request's random stream.
    let dir = support::fixtures::fixtures();
    let mut a = fixture_args(&dir.join("llama3/model-F32.gguf"));
    a.speculative = Some(
        SpeculativeConfig::from_json(&format!(
            r#"{{"model": {:?}, "num_speculative_tokens": 2, "draft_sample_method": "probabilistic", "disable_by_batch_size": 64}}"#,
            dir.join("qwen3/model-F32.gguf")
        ))
        .expect("config"),
    );
    let mut llm = LLM::new(a).expect("engine");
    let p = SamplingParams {
        n: 3,
        max_tokens: Some(16),
        temperature: Some(2.0),
        seed: Some(7),
        logprobs: Some(1),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let out = llm.generate(&id_prompts(), &p).expect("generate");
    check("llama3 drafted by qwen3, sampled", record(&out));
}
