//! Qwen2-MoE and Qwen3-MoE: Qwen2's attention (q/k/v biases) or Qwen3's
//! (per-head q/k RMSNorm), and in the layers that `decoder_sparse_step`
//! and `mlp_only_layers` pick, a sparse mixture of experts (`mlp.experts.E`,
//! routed by `mlp.gate`, renormalized with `norm_topk_prob`); Qwen2-MoE adds
//! a shared expert (`mlp.shared_expert`) scaled by
//! `sigmoid(mlp.shared_expert_gate · x)`. The other layers are dense MLPs.

use super::layers::attention::AttentionParts;
use super::layers::decoder::{DecoderLayer, DecoderStack, FeedForward};
use super::layers::moe::{hf_expert_names, MoeNames, SparseMoe};
use super::llama::dense_layer;
use crate::engine::config::{Arch, ModelConfig};
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::Backend;

/// Loads a Qwen2-MoE or Qwen3-MoE model (HF tensor names).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let moe = config
        .moe
        .clone()
        .context("a Qwen MoE config without its experts")?;
    let parts = AttentionParts {
        qkv_bias: config.attention_bias,
        o_bias: config.o_bias,
        qk_norm: config.arch == Arch::Qwen3Moe,
        sinks: false,
    };
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        if !moe.sparse_layers.get(i).copied().unwrap_or(false) {
            layers.push(dense_layer(
                backend,
                source,
                &config,
                i,
                parts,
                max_positions,
            )?);
            continue;
        }
        let p = |s: &str| format!("model.layers.{i}.mlp.{s}");
        let expert = hf_expert_names(format!("model.layers.{i}.mlp"));
        let names = MoeNames {
            router: p("gate.weight"),
            expert: &expert,
            bias: None,
            shared: moe
                .shared_ffn
                .map(|_| (p("shared_expert"), Some(p("shared_expert_gate.weight")))),
        };
        let ffn = || -> Result<FeedForward<B>> {
            Ok(FeedForward::Moe(
                SparseMoe::load(backend, source, &config, &moe, &names)
                    .with_context(|| format!("layer {i}'s experts"))?,
            ))
        };
        layers.push(DecoderLayer::load(
            backend,
            source,
            &config,
            i,
            parts,
            max_positions,
            ffn,
        )?);
    }
    DecoderStack::new(backend, source, config, layers, max_positions)
}
