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
//! refuse them at upload. Each format's experts multiply the activations
//! as its reference does: a checkpoint's in f32 (transformers, the decoded
//! model), a GGUF file's quantized to 8 bits per 32 (llama.cpp's Q8_0).

use super::layers::attention::AttentionParts;
use super::layers::decoder::{DecoderLayer, DecoderStack, FeedForward};
use super::layers::moe::{ExpertAct, SparseMoe};
use crate::engine::config::{
    yarn_mscale, Activation, Arch, GgufMeta, GptOssConfig, HfFamily, ModelConfig, MoeConfig,
};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{RopeScaling, RopeStyle, RouterScoring};
use pagoda_accel::Backend;
use serde_json::Value;

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

/// gpt-oss as llama.cpp's converter writes it (`gpt-oss`), read as
/// llama.cpp's loader reads it: the local layers from
/// `attention.sliding_window_pattern` (bools, or a period), else every
/// other layer from the first; one RoPE base for all layers (a
/// different `rope.freq_base_swa` is refused); YaRN from
/// `rope.scaling.*` with gpt-oss's own unrounded ramp (transformers'
/// `truncate: false`, which every gpt-oss config sets; llama.cpp rounds
/// the ramp's ends); the SwiGLU's alpha 1.702 and limit 7, which
/// llama.cpp fixes too; the top-k router logits weighted by their
/// softmax. The converter's split of the fused experts is undone by
/// [`crate::engine::loader::gguf_weights::GgufWeights`].
pub fn gguf_config(g: &GgufFile) -> Result<ModelConfig> {
    let m = GgufMeta::new(g, "gpt-oss");
    let hidden_size = m.req("embedding_length")?;
    let num_heads = m.req("attention.head_count")?;
    let num_kv_heads = m.opt("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = m.req("attention.key_length")?;
    if let Some(v) = m.opt("attention.value_length")?.filter(|&v| v != head_dim) {
        bail!(
            "{} = {v} differs from {} = {head_dim}; gpt-oss's values are as wide as its keys",
            m.key("attention.value_length"),
            m.key("attention.key_length")
        );
    }
    if let Some(n) = m.opt("rope.dimension_count")?.filter(|&n| n != head_dim) {
        bail!(
            "{} = {n}, but the heads are {head_dim} wide; only a rotary embedding over whole heads is supported",
            m.key("rope.dimension_count")
        );
    }
    let num_layers = m.block_count()?;
    let rope_theta = m.f32("rope.freq_base")?.unwrap_or(10_000.0);
    if let Some(b) = m.f32("rope.freq_base_swa")?.filter(|&b| b != rope_theta) {
        bail!(
            "{} = {b} differs from {} = {rope_theta}; gpt-oss rotates every layer with one base",
            m.key("rope.freq_base_swa"),
            m.key("rope.freq_base")
        );
    }
    if let Some(a) = m.f32("rope.scaling.attn_factor")?.filter(|&a| a != 1.0) {
        bail!(
            "{} = {a}: gpt-oss's YaRN scales attention by 0.1·ln(factor) + 1 only",
            m.key("rope.scaling.attn_factor")
        );
    }
    let max_position_embeddings = m.opt("context_length")?.unwrap_or(131_072);
    let rope_scaling = match m.str("rope.scaling.type")? {
        None | Some("none") => RopeScaling::None,
        Some("yarn") => {
            let factor = m
                .f32("rope.scaling.factor")?
                .with_context(|| format!("missing metadata '{}'", m.key("rope.scaling.factor")))?;
            RopeScaling::Yarn {
                factor,
                original_max_position: m.req("rope.scaling.original_context_length")?,
                beta_fast: m
                    .f32("rope.scaling.yarn_beta_fast")?
                    .filter(|&b| b != 0.0)
                    .unwrap_or(32.0),
                beta_slow: m
                    .f32("rope.scaling.yarn_beta_slow")?
                    .filter(|&b| b != 0.0)
                    .unwrap_or(1.0),
                attention_factor: yarn_mscale(factor as f64, 1.0) as f32,
                truncate: false,
            }
        }
        Some(other) => bail!(
            "{} = '{other}' is not supported for gpt-oss (supported: none, yarn)",
            m.key("rope.scaling.type")
        ),
    };
    let window = m.opt("attention.sliding_window")?.filter(|&w| w > 0);
    let pattern_key = m.key("attention.sliding_window_pattern");
    let local: Vec<bool> = match window {
        None => vec![false; num_layers],
        Some(_) => match g.get_bool_array(&pattern_key) {
            Ok(Some(l)) => {
                if l.len() != num_layers {
                    bail!(
                        "{pattern_key} lists {} layers, but {} is {num_layers}",
                        l.len(),
                        m.key("block_count")
                    );
                }
                l
            }
            Ok(None) | Err(_) => {
                let every = g.get_u64(&pattern_key)?.unwrap_or(2) as usize;
                (0..num_layers)
                    .map(|i| every == 0 || i % every < every - 1)
                    .collect()
            }
        },
    };
    let n_experts = m.req("expert_count")?;
    let top_k = m.req("expert_used_count")?;
    if n_experts == 0 || n_experts > 1 << 12 {
        bail!(
            "{} = {n_experts} must be between 1 and 4096",
            m.key("expert_count")
        );
    }
    if top_k == 0 || top_k > n_experts {
        bail!(
            "{} = {top_k} must be between 1 and {} ({n_experts})",
            m.key("expert_used_count"),
            m.key("expert_count")
        );
    }
    let expert_ffn = m.req("expert_feed_forward_length")?;
    let vocab_size = match g.tensors().iter().find(|t| t.name == "output.weight") {
        Some(t) if t.shape.len() == 2 => t.shape[0],
        _ => g
            .get_str_array("tokenizer.ggml.tokens")?
            .map(|t| t.len())
            .context("no output.weight and no tokenizer")?,
    };
    let cfg = ModelConfig {
        arch: Arch::GptOss,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: expert_ffn,
        vocab_size,
        rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope_theta,
        rope_scaling,
        rope_style: RopeStyle::Neox,
        max_position_embeddings,
        tie_word_embeddings: !m.has("output.weight"),
        attention_bias: m.has("blk.0.attn_q.bias"),
        o_bias: m.has("blk.0.attn_output.bias"),
        mlp_bias: false,
        sliding_windows: local
            .iter()
            .map(|&l| l.then_some(window).flatten())
            .collect(),
        moe: Some(MoeConfig {
            n_experts,
            top_k,
            normalize: false,
            expert_ffn,
            shared_ffn: None,
            sparse_layers: vec![true; num_layers],
            scoring: RouterScoring::TopKSoftmax,
            routed_scale: 1.0,
            groups: None,
            score_bias: false,
            shared_gated: false,
        }),
        mla: None,
        hybrid: None,
        hidden_act: Activation::Silu,
        gemma: None,
        gpt_oss: Some(GptOssConfig {
            swiglu_alpha: 1.702,
            swiglu_limit: 7.0,
        }),
        encoder: None,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// gpt-oss's `config.json`: what it shares with the other decoders
/// ([`ModelConfig::from_hf_decoder`]: attention sinks and biases, its
/// sliding and full layers, YaRN, the fused experts' router), then its
/// own SwiGLU keys.
pub fn hf_config(v: &Value, _arch: &str) -> Result<ModelConfig> {
    let mut config = ModelConfig::from_hf_decoder(v, HfFamily::GptOss)?;
    config.gpt_oss = Some(read_swiglu(v)?);
    Ok(config)
}

/// gpt-oss's own keys: `swiglu_limit` (default 7) and `swiglu_alpha`
/// (default 1.702, the constant transformers' experts use), both positive
/// and finite. An MXFP4 checkpoint (`quantization_config.quant_method`
/// `mxfp4`, how OpenAI publishes the experts) is read by the loader
/// (`hf_quant::mxfp4`).
fn read_swiglu(v: &Value) -> Result<GptOssConfig> {
    let num = |key: &str, default: f32| -> Result<f32> {
        let x = match v.get(key) {
            None | Some(Value::Null) => default,
            Some(x) => x
                .as_f64()
                .with_context(|| format!("'{key}' must be a number, got {x}"))?
                as f32,
        };
        if !(x.is_finite() && x > 0.0) {
            bail!("'{key}' = {x} must be a positive number");
        }
        Ok(x)
    };
    Ok(GptOssConfig {
        swiglu_alpha: num("swiglu_alpha", 1.702)?,
        swiglu_limit: num("swiglu_limit", 7.0)?,
    })
}
