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
fn qwen3_next_batches_exactly() {
    batch_changes_nothing(&fixtures_2026().join("qwen3_next"), "qwen3_next");
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
