//! gpt-oss (transformers' `modeling_gpt_oss.py`): the pre-norm decoder
//! stack with biased q/k/v/o projections and a learned sink logit per
//! attention head (`self_attn.sinks`, in the softmax denominator with no
//! value), layers alternating between a sliding window and full attention
//! (`layer_types`, `sliding_window`), YaRN RoPE, and a mixture of experts
//! in every layer: a biased router whose top-k logits are weighted by
//! their own softmax, and experts stored fused (`experts.gate_up_proj`
//! with gate and up in alternating columns, biases on both projections)
//! with a clamped SwiGLU between them (`swiglu_limit`, `swiglu_alpha`).
//!
//! bf16 and f32 checkpoints load as stored; MXFP4 ones (how OpenAI
//! publishes the weights: the experts as e2m1 blocks with e8m0 scales) keep
//! their experts in MXFP4 (`pagoda_accel::quant::mxfp4`, re-packed into
//! ggml's block layout at load, whatever `--dtype` says), and so do GGUF
//! files whose experts are ggml's MXFP4 (`llama-quantize … MXFP4_MOE`,
//! already in that layout); backends without an MXFP4 kernel (CUDA)
//! refuse them at upload.

use super::layers::attention::AttentionParts;
use super::layers::decoder::{DecoderLayer, DecoderStack, FeedForward};
use super::layers::moe::{ExpertAct, SparseMoe};
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::Backend;

/// Loads a gpt-oss model (HF tensor names), refusing it on a device whose
/// attention has no sinks.
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let moe = config
        .moe
        .clone()
        .context("a gpt-oss config without its experts")?;
    let g = config
        .gpt_oss
        .context("a gpt-oss config without its SwiGLU limits")?;
    let act = ExpertAct::ClampedSwiglu {
        alpha: g.swiglu_alpha,
        limit: g.swiglu_limit,
    };
    let parts = AttentionParts {
        qkv_bias: config.attention_bias,
        o_bias: config.o_bias,
        qk_norm: false,
        sinks: true,
        ..Default::default()
    };
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let prefix = format!("model.layers.{i}.mlp");
        let ffn = || -> Result<FeedForward<B>> {
            Ok(FeedForward::Moe(
                SparseMoe::load_fused(backend, source, &config, &moe, &prefix, act)
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
