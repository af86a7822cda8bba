//! Mixture-of-experts and latent-attention models in the batched engine:
//! routing is per token and the latent cache is paged like any other, so
//! batching, chunked prefill, preemption and prefix caching must not change
//! any greedy output. Each of 16 prompts of mixed lengths (some sharing
//! prefixes) must give exactly what it gives alone, on transformers' own
//! tiny Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2-Lite and DeepSeek-V3
//! checkpoints (float32) and on a Q8_0 GGUF of Qwen2-MoE whose experts stay
//! quantized. The hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE)
//! too: their linear layers' state is carried across chunks in per-sequence
//! slots, and a preempted sequence recomputes it from its first token.
//! Gemma 3 too: its local layers attend over a 16-token window, so chunks,
//! batches and recomputation all cross window edges.

mod support;

use pagoda_accel::GgmlType;
use std::path::{Path, PathBuf};
use support::batching::batch_changes_nothing;

fn fixtures() -> PathBuf {
    match std::env::var_os("PAGODA_HF_FAMILIES") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families"),
    }
}

fn fixtures_2026() -> PathBuf {
    match std::env::var_os("PAGODA_HF_FAMILIES_2026") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families-2026"),
    }
}

#[test]
fn qwen3_5_batches_exactly() {
    batch_changes_nothing(&fixtures_2026().join("qwen3_5"), "qwen3_5");
}

#[test]
fn qwen3_5_moe_batches_exactly() {
    batch_changes_nothing(&fixtures_2026().join("qwen3_5_moe"), "qwen3_5_moe");
}

#[test]
fn gemma3_batches_exactly() {
    batch_changes_nothing(&fixtures_2026().join("gemma3"), "gemma3");
}

#[test]
fn qwen3_next_batches_exactly() {
    batch_changes_nothing(&fixtures_2026().join("qwen3_next"), "qwen3_next");
}

/// With n-gram speculative decoding, a hybrid model's linear layers run
/// through drafts that may be rejected; their state must come back to the
/// last accepted token. Greedy outputs of 16 prompts batched with drafts are
/// exactly their plain solo outputs, with drafts rejected along the way (the
/// state put back and the accepted part run again) and some accepted (the
/// random models rarely continue a pattern, so the prompts repeat one and
/// the outputs are long; over both models a few drafts hold).
#[test]
fn hybrid_models_speculate_exactly() {
    use pagoda::engine::loader::DType;
    use pagoda::engine::spec_decode::SpeculativeConfig;
    use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
    const NGRAM: &str = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2, "disable_by_batch_size": 64}"#;
    let prompts: Vec<Vec<u32>> = (0..16u32)
        .map(|i| {
            let pattern: Vec<u32> = (0..2 + i % 4)
                .map(|j| 3 + (i * 41 + j * 97) % 500)
                .collect();
            pattern
                .iter()
                .cycle()
                .take(6 + i as usize)
                .copied()
                .collect()
        })
        .collect();
    let mut params = SamplingParams::greedy(64);
    params.ignore_eos = true;
    let mut accepted = 0;
    for family in ["qwen3_5", "qwen3_next"] {
        let model = fixtures_2026().join(family);
        let args = |spec: bool| {
            let mut a = EngineArgs::new(&model);
            a.threads = 2;
            a.dtype = DType::Float32;
            a.max_model_len = Some(128);
            a.kv_cache_memory = Some(16 << 20);
            if spec {
                a.speculative = Some(SpeculativeConfig::from_json(NGRAM).expect("config"));
            }
            a
        };
        let mut plain = LLM::new(args(false)).expect("engine");
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                plain
                    .generate(&[Prompt::Tokens(p.clone())], &params)
                    .expect("generate")[0]
                    .outputs[0]
                    .token_ids
                    .clone()
            })
            .collect();
        let (got, llm) =
            support::batching::batched_with(args(true), &prompts, &vec![params.clone(); 16]);
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            assert_eq!(
                g, a,
                "{family}: prompt {i} with drafts differs from its plain solo run"
            );
        }
        let spec = llm.engine().stats().spec;
        eprintln!(
            "{family}: {} of {} drafted tokens accepted",
            spec.num_accepted_tokens, spec.num_draft_tokens
        );
        assert!(
            spec.num_draft_tokens > spec.num_accepted_tokens,
            "{family}: some drafts should be rejected ({} of {} accepted)",
            spec.num_accepted_tokens,
            spec.num_draft_tokens
        );
        accepted += spec.num_accepted_tokens;
    }
    assert!(accepted > 0, "no draft was accepted by either model");
}

#[test]
fn mixtral_batches_exactly() {
    batch_changes_nothing(&fixtures().join("mixtral"), "mixtral");
}

#[test]
fn qwen2_moe_batches_exactly() {
    batch_changes_nothing(&fixtures().join("qwen2moe"), "qwen2moe");
}

#[test]
fn qwen3_moe_batches_exactly() {
    batch_changes_nothing(&fixtures().join("qwen3moe"), "qwen3moe");
}

#[test]
fn deepseek_v2_lite_batches_exactly() {
    batch_changes_nothing(&fixtures().join("deepseekv2lite"), "deepseekv2lite");
}

#[test]
fn deepseek_v3_batches_exactly() {
    batch_changes_nothing(&fixtures().join("deepseekv3"), "deepseekv3");
}

#[test]
fn quantized_experts_batch_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gguf = dir.path().join("qwen2moe-q8_0.gguf");
    support::hf_to_gguf::convert(&fixtures().join("qwen2moe"), &gguf, GgmlType::Q8_0);
    batch_changes_nothing(&gguf, "qwen2moe Q8_0");
}
