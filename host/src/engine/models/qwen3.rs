//! Qwen3 dense: the Llama layer shape with an RMSNorm over each q and k
//! head before RoPE, an explicit `head_dim` (q is wider than the hidden
//! state in the larger models), and no q/k/v bias unless
//! `attention_bias` asks for it.

use super::layers::attention::AttentionParts;
use super::layers::decoder::DecoderStack;
use super::llama::dense_layer;
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::Result;
use pagoda_accel::Backend;

/// Loads a Qwen3 dense model (HF tensor names; GGUF `qwen3` maps onto
/// them).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let parts = AttentionParts {
        qkv_bias: config.attention_bias,
        o_bias: config.o_bias,
        qk_norm: true,
        sinks: false,
    };
    let layers = (0..config.num_layers)
        .map(|i| dense_layer(backend, source, &config, i, parts, max_positions))
        .collect::<Result<Vec<_>>>()?;
    DecoderStack::new(backend, source, config, layers, max_positions)
}
