//! The hybrid Qwen models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from the GGUF
//! files llama.cpp's own converter writes (architectures `qwen35`,
//! `qwen35moe`, `qwen3next`; tests/fixtures/hf-families-2026/gguf, see its
//! README), served in float32: the loader undoes the converter's layout
//! (value heads reordered, `A_log` folded into `-exp(A_log)`, norms stored
//! as `1 + w`, Qwen3-Next's q/k/v/z split), so the logprobs agree with
//! transformers' float32 `reference.json` as closely as the Hugging Face
//! folders do (host/tests/hf_families.rs), and greedy ids agree up to the
//! first near-tie.

use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A greedy step whose top-two gap is below this is a near-tie, where
/// float32 rounding may pick either token.
const NEAR_TIE: f64 = 1e-3;

/// The same bound as the Hugging Face folders' (`hybrid_tol` in
/// hf_families.rs): 1e-4, and 3e-4 for qwen3_next, whose first case is
/// worse conditioned (transformers' own float32 is 1.0e-4 from float64).
fn tol(family: &str) -> f64 {
    match family {
        "qwen3_next" => 3e-4,
        _ => 1e-4,
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families-2026")
}

fn gguf(family: &str) -> PathBuf {
    fixtures().join("gguf").join(format!("{family}.f32.gguf"))
}

fn engine(model: &Path) -> anyhow::Result<LLM> {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    assert_eq!(a.kv_cache_dtype, KvCacheDtype::Auto);
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    LLM::new(a)
}

fn f64s(v: &Value) -> Vec<Option<f64>> {
    v.as_array()
        .expect("array")
        .iter()
        .map(Value::as_f64)
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn reference(family: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(family).join("reference.json"))
            .expect("reference.json"),
    )
    .expect("reference JSON")
}

/// Serves `model` and checks every case of `family`'s reference: prompt
/// logprobs within `tol`, greedy ids equal up to the first step whose
/// top-two gap is under `near_tie`. Returns the largest logprob difference.
fn check_against_reference(family: &str, what: &str, model: &Path, tol: f64, near_tie: f64) -> f64 {
    let reference = reference(family);
    let mut llm = engine(model).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let mut worst = 0f64;
    for (c, case) in reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let prompt = u32s(&case["prompt_ids"]);
        let want_lp = f64s(&case["prompt_logprobs"]);
        let want_greedy = u32s(&case["greedy_ids"]);
        let gaps = f64s(&case["greedy_top2_gap"]);
        let mut params = SamplingParams::greedy(want_greedy.len());
        // transformers generated with min_new_tokens = max_new_tokens.
        params.min_tokens = want_greedy.len();
        params.prompt_logprobs = Some(1);
        let out = llm
            .generate(&[Prompt::Tokens(prompt.clone())], &params)
            .unwrap_or_else(|e| panic!("{what} case {c}: {e:#}"));
        let got_lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(got_lp.len(), prompt.len() - 1);
        for (i, l) in got_lp.iter().enumerate() {
            let want = want_lp[i + 1].expect("reference logprob");
            assert_eq!(l.token_id, prompt[i + 1]);
            let err = (l.logprob as f64 - want).abs();
            worst = worst.max(err);
            assert!(
                err < tol,
                "{what} case {c}, prompt token {}: logprob {} vs transformers {want}",
                i + 1,
                l.logprob
            );
        }
        let got = &out[0].outputs[0].token_ids;
        for (i, (&g, &w)) in got.iter().zip(&want_greedy).enumerate() {
            if gaps[i].is_some_and(|gap| gap < near_tie) {
                break;
            }
            assert_eq!(
                g, w,
                "{what} case {c}: greedy token {i} is {g}, transformers {w} (got {got:?}, want {want_greedy:?})"
            );
        }
    }
    eprintln!("{what}: largest prompt logprob difference {worst:.2e}");
    worst
}

fn gguf_agrees_with_transformers(family: &str) {
    let what = format!("{family} (llama.cpp's f32 GGUF)");
    check_against_reference(family, &what, &gguf(family), tol(family), NEAR_TIE);
}

#[test]
fn qwen35_gguf_with_tiled_value_heads_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_5");
}

#[test]
fn qwen35moe_gguf_with_stacked_experts_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_5_moe");
}

#[test]
fn qwen3next_gguf_with_split_qkvz_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_next");
}
