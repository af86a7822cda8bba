//! The Llama family: Llama 2/3, Mistral, SmolLM2 and Qwen2. Pre-norm
//! decoder layers of grouped-query attention and a SwiGLU MLP. Qwen2 adds
//! biases on q, k and v; HF Llama's `attention_bias` puts them on the
//! output projection too, and `mlp_bias` on the MLP's projections.

use super::layers::attention::AttentionParts;
use super::layers::decoder::{DecoderLayer, DecoderStack, FeedForward};
use super::layers::mlp::GatedMlp;
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::Result;
use pagoda_accel::Backend;

/// Loads a Llama-family model (HF tensor names; GGUF maps onto them).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let parts = AttentionParts {
        qkv_bias: config.attention_bias,
        o_bias: config.o_bias,
        qk_norm: false,
        sinks: false,
    };
    let layers = (0..config.num_layers)
        .map(|i| dense_layer(backend, source, &config, i, parts, max_positions))
        .collect::<Result<Vec<_>>>()?;
    DecoderStack::new(backend, source, config, layers, max_positions)
}

/// Layer `i` of a dense model whose attention has `parts`: the shape
/// Llama, Mistral, Qwen2 and Qwen3 share (and the dense layers of the
/// Qwen mixtures).
pub fn dense_layer<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    c: &ModelConfig,
    i: usize,
    parts: AttentionParts,
    max_positions: usize,
) -> Result<DecoderLayer<B>> {
    DecoderLayer::load(backend, source, c, i, parts, max_positions, || {
        Ok(FeedForward::Dense(GatedMlp::load(
            backend,
            source,
            &format!("model.layers.{i}.mlp"),
            c.hidden_size,
            c.intermediate_size,
            c.mlp_bias,
        )?))
    })
}
