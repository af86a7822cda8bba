//! DeepSeek-V2 and V3 (and R1): multi-head latent attention in every layer
//! ([`LatentAttention`]); dense SwiGLU MLPs in the first
//! `first_k_dense_replace` layers, then a mixture of routed experts plus
//! always-on shared experts. V2 routes by softmax, V3 by sigmoid scores
//! with a correction bias and group-limited choice; both weigh the chosen
//! experts by `routed_scaling_factor`.

use super::layers::decoder::{Attention, DecoderLayer, DecoderStack, FeedForward};
use super::layers::load_vector;
use super::layers::mla::LatentAttention;
use super::layers::mlp::GatedMlp;
use super::layers::moe::{hf_expert_names, MoeNames, SparseMoe};
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::Backend;

/// Loads a DeepSeek-V2/V3 model (HF tensor names).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let mla = config
        .mla
        .clone()
        .context("a DeepSeek config without its latent attention")?;
    let moe = config
        .moe
        .clone()
        .context("a DeepSeek config without its experts")?;
    let d = config.hidden_size;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let vector = |name: &str| load_vector(backend, source, name, d);
        let attn = LatentAttention::load(backend, source, &config, &mla, i, &p("self_attn"))
            .with_context(|| format!("layer {i}'s attention"))?;
        let ffn = if moe.sparse_layers.get(i).copied().unwrap_or(false) {
            let expert = hf_expert_names(format!("model.layers.{i}.mlp"));
            let names = MoeNames {
                router: p("mlp.gate.weight"),
                expert: &expert,
                bias: Some(p("mlp.gate.e_score_correction_bias")),
                shared: moe.shared_ffn.map(|_| (p("mlp.shared_experts"), None)),
            };
            FeedForward::Moe(
                SparseMoe::load(backend, source, &config, &moe, &names)
                    .with_context(|| format!("layer {i}'s experts"))?,
            )
        } else {
            FeedForward::Dense(GatedMlp::load(
                backend,
                source,
                &p("mlp"),
                d,
                config.intermediate_size,
                false,
            )?)
        };
        layers.push(DecoderLayer {
            attn_norm: vector(&p("input_layernorm.weight"))?,
            attn: Attention::Latent(attn),
            ffn_norm: vector(&p("post_attention_layernorm.weight"))?,
            ffn,
        });
    }
    DecoderStack::new(backend, source, config, layers, max_positions)
}
