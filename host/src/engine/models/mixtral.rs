//! Mixtral: Mistral's attention (a sliding window where the config sets
//! one), and in every layer a sparse mixture of `num_local_experts` SwiGLU
//! experts (`w1` gate, `w3` up, `w2` down), top-k by softmax, the chosen
//! weights renormalized.

use super::layers::attention::AttentionParts;
use super::layers::decoder::{DecoderLayer, DecoderStack, FeedForward};
use super::layers::moe::{ExpertPart, MoeNames, SparseMoe};
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::Backend;

/// Loads a Mixtral model (HF tensor names).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<DecoderStack<B>> {
    let moe = config
        .moe
        .clone()
        .context("a Mixtral config without its experts")?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let expert = |e: usize, part: ExpertPart| {
            let w = match part {
                ExpertPart::Gate => "w1",
                ExpertPart::Up => "w3",
                ExpertPart::Down => "w2",
            };
            format!("model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight")
        };
        let names = MoeNames {
            router: format!("model.layers.{i}.block_sparse_moe.gate.weight"),
            expert: &expert,
            bias: None,
            shared: None,
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
            AttentionParts::default(),
            max_positions,
            ffn,
        )?);
    }
    DecoderStack::new(backend, source, config, layers, max_positions)
}
