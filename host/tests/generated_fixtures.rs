//! Every family on checkpoints that scripts/make-fixtures.py writes (tiny
//! random models in both config forms, with non-default `rope_theta`,
//! Llama 3 and YaRN scaling, a sliding window shorter than the prompts,
//! and as GGUF where the family has a GGUF architecture), against that
//! script's float64 forward, which is written from each model's published
//! definition and shares nothing with Pagoda:
//!
//! - Pagoda's float32 logits at every prompt position are within 1e-4 of
//!   the largest logit of the reference's, for each config form and for
//!   the F32 GGUF;
//! - 32 greedy tokens agree (up to a near-tie, under 1e-3 apart);
//! - 16 prompts of mixed lengths batched, chunked, preempted and prefix
//!   cached each give exactly what they give alone;
//! - the Q8_0 GGUF keeps its weights quantized.
//!
//! The hybrid Qwen fixtures use shapes unlike the published models' (one key
//! head for three value heads of another width, a 3-tap conv, irregular
//! layer patterns, partial RoPE over half or a quarter of the head) in
//! transformers' `layer_types` and `full_attention_interval` forms; the
//! reference runs their delta rule token by token, the recurrent form.
//!
//! Qwen3.5-MoE adds a mixture with a gated shared expert in every layer
//! (top 3 of 6, five query heads over one KV head, half of each head
//! rotated). gpt-oss has learned sinks, biases on q/k/v/o, a window of 6 on
//! the first and last of four layers, six experts (top 3) whose SwiGLU is
//! clamped at 1.5 for about a tenth of the values, and YaRN with factor 2.5
//! and betas 8 and 0.5 with its ramp ends left unrounded (`truncate:
//! false`). Neither has a GGUF here (the script's GGUF writer does not lay
//! out the hybrids' or gpt-oss's tensors).
//!
//! The fixtures are made once into `target/generated-fixtures` (or
//! `$PAGODA_GENERATED_FIXTURES`); scripts/test.sh makes them before the
//! suite runs, and this test makes them itself when they are missing.

mod support;

use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::batching::batch_changes_nothing;
use support::fixtures::fixtures;
use support::reference::{load, run_schedule};

/// Largest |logit − reference| as a fraction of the position's largest
/// |reference logit|.
const TOL: f64 = 1e-4;
/// Greedy steps whose top two logits are closer than this may go either
/// way in float32.
const NEAR_TIE: f64 = 1e-3;

fn reference(family: &str) -> Value {
    let path = fixtures().join(family).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("reference.json")).expect("JSON")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// A copy of `family`'s folder whose config.json is the `form` file.
fn folder(family: &str, form: &str, dir: &Path) -> PathBuf {
    let src = fixtures().join(family);
    let dst = dir.join(family);
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy fixture file");
    }
    std::fs::copy(src.join(form), dst.join("config.json")).expect("copy config");
    dst
}

/// Checks `model`'s logits at every prompt position against the
/// reference's; returns the worst error relative to the largest logit.
fn logits_agree(family: &str, what: &str, model: &Path) -> f64 {
    let r = reference(family);
    let cases = r["cases"].as_array().expect("cases");
    let seqs: Vec<Vec<u32>> = cases.iter().map(|c| u32s(&c["prompt_ids"])).collect();
    let (m, _) = load(model, DType::Float32);
    // Every prompt in one step, then again in chunks of 7 beside each
    // other, through scattered KV blocks.
    let one: Vec<Vec<(usize, usize)>> =
        vec![seqs.iter().enumerate().map(|(i, s)| (i, s.len())).collect()];
    let mut chunked = Vec::new();
    let mut left: Vec<usize> = seqs.iter().map(Vec::len).collect();
    while left.iter().any(|&n| n > 0) {
        let step: Vec<(usize, usize)> = left
            .iter_mut()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| {
                let k = (*n).min(7);
                *n -= k;
                (i, k)
            })
            .collect();
        chunked.push(step);
    }
    let mut worst = 0f64;
    for schedule in [one, chunked] {
        let got = run_schedule(&m, &seqs, &schedule);
        for (c, case) in cases.iter().enumerate() {
            for (pos, want) in case["logits"]
                .as_array()
                .expect("logits")
                .iter()
                .enumerate()
            {
                let want: Vec<f64> = want
                    .as_array()
                    .expect("row")
                    .iter()
                    .map(|x| x.as_f64().expect("logit"))
                    .collect();
                let scale = want.iter().fold(0f64, |a, x| a.max(x.abs()));
                let err = got[c][pos]
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (*g as f64 - w).abs())
                    .fold(0f64, f64::max)
                    / scale;
                worst = worst.max(err);
                assert!(
                    err < TOL,
                    "{what}: prompt {c} position {pos}: logits {err:.2e} of the largest apart"
                );
            }
        }
    }
    eprintln!("{what}: logits within {worst:.2e} of the largest");
    worst
}

/// 32 greedy tokens of each prompt agree with the reference's, up to the
/// first near-tie.
fn greedy_agrees(family: &str, what: &str, model: &Path) {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    for (c, case) in reference(family)["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let want = u32s(&case["greedy_ids"]);
        let gaps: Vec<f64> = case["greedy_top2_logit_gap"]
            .as_array()
            .expect("gaps")
            .iter()
            .map(|g| g.as_f64().expect("gap"))
            .collect();
        let mut p = SamplingParams::greedy(want.len());
        p.ignore_eos = true;
        let out = llm
            .generate(&[Prompt::Tokens(u32s(&case["prompt_ids"]))], &p)
            .expect("generate");
        let got = &out[0].outputs[0].token_ids;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if gaps[i] < NEAR_TIE {
                break;
            }
            assert_eq!(
                g, w,
                "{what} prompt {c}: greedy token {i} (got {got:?}, want {want:?})"
            );
        }
    }
}

fn check_family(family: &str) {
    for (form, file) in [
        ("transformers 5", "config.json"),
        ("transformers 4", "config.v4.json"),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = folder(family, file, dir.path());
        let what = format!("{family} ({form})");
        logits_agree(family, &what, &model);
        greedy_agrees(family, &what, &model);
        if file == "config.json" {
            batch_changes_nothing(&model, &what);
        }
    }
    let f32 = fixtures().join(family).join("model-F32.gguf");
    if f32.exists() {
        let what = format!("{family} (GGUF F32)");
        logits_agree(family, &what, &f32);
        greedy_agrees(family, &what, &f32);
        let q8 = fixtures().join(family).join("model-Q8_0.gguf");
        let (m, _) = load(&q8, DType::Auto);
        assert_eq!(m.weight_type(), "Q8_0", "{family}: Q8_0 stays quantized");
    }
}

#[test]
fn llama_with_llama3_rope_scaling() {
    check_family("llama3");
}

#[test]
fn mistral_with_a_sliding_window_shorter_than_the_prompts() {
    check_family("mistral");
}

#[test]
fn qwen3_with_qk_norm_and_wide_heads() {
    check_family("qwen3");
}

#[test]
fn mixtral() {
    check_family("mixtral");
}

#[test]
fn qwen2_moe_with_a_gated_shared_expert() {
    check_family("qwen2moe");
}

#[test]
fn qwen3_moe_with_a_dense_layer() {
    check_family("qwen3moe");
}

#[test]
fn deepseek_v2_lite_with_yarn() {
    check_family("deepseek-v2-lite");
}

#[test]
fn deepseek_v3_with_yarn_and_group_limited_routing() {
    check_family("deepseek-v3");
}

#[test]
fn qwen3_next_with_one_key_head_for_three_value_heads_and_sparse_experts() {
    check_family("qwen3-next");
}

#[test]
fn qwen3_5_with_every_third_layer_full_and_a_quarter_of_each_head_rotated() {
    check_family("qwen3_5");
}

#[test]
fn qwen3_5_moe_with_five_heads_over_one_and_a_gated_shared_expert_in_every_layer() {
    check_family("qwen3_5_moe");
}

#[test]
fn gpt_oss_with_sinks_a_short_window_on_irregular_layers_clamped_experts_and_unrounded_yarn() {
    check_family("gpt_oss");
}

/// A model whose every layer has a window gives back the blocks that fell
/// below it: a long sequence holds about a window's worth of blocks, not
/// its whole length, and still computes the reference's tokens.
#[test]
fn a_windowed_model_holds_about_a_window_of_blocks() {
    let case = &reference("mistral")["cases"][2];
    let prompt = u32s(&case["prompt_ids"]);
    let want = u32s(&case["greedy_ids"]);
    let gaps: Vec<f64> = case["greedy_top2_logit_gap"]
        .as_array()
        .expect("gaps")
        .iter()
        .map(|g| g.as_f64().expect("gap"))
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let model = folder("mistral", "config.json", dir.path());
    let mut a = EngineArgs::new(&model);
    a.threads = 2;
    a.dtype = DType::Float32;
    a.block_size = 4;
    a.max_model_len = Some(160);
    a.kv_cache_memory = Some(8 << 20);
    let mut llm = LLM::new(a).expect("engine");
    let core = llm.engine_mut();
    let mut p = SamplingParams::greedy(100);
    p.ignore_eos = true;
    let id = core
        .add_request("long".into(), prompt.clone(), p, Default::default())
        .expect("add");
    let (mut out, mut most) = (Vec::new(), 0);
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            out.extend_from_slice(&o.new_token_ids);
        }
        core.check_kv_accounting().expect("KV accounting");
        most = most.max(core.kv_cache().num_held_blocks(id));
    }
    // Window 8, blocks of 4, and the kernel reads from the 32-position
    // chunk boundary below the window: at most (8 + 32) / 4 + 2 blocks,
    // where the whole 140-token sequence spans 35.
    assert!(most <= 12, "held up to {most} blocks");
    assert_eq!(out.len(), 100);
    for (i, (g, w)) in out.iter().zip(&want).enumerate() {
        if gaps[i] < NEAR_TIE {
            break;
        }
        assert_eq!(g, w, "token {i} (got {out:?}, want {want:?})");
    }
    let kv = core.kv_cache();
    assert_eq!(
        kv.pool().num_free(),
        kv.pool().num_blocks(),
        "blocks leaked"
    );
}
