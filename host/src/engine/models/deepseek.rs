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
use crate::engine::config::{
    yarn_mscale, Activation, Arch, GgufMeta, MlaConfig, ModelConfig, MoeConfig,
};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{GroupLimit, GroupScore, RopeScaling, RopeStyle, RouterScoring};
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

/// DeepSeek-V2/V3 as llama.cpp's converter writes them (`deepseek2`):
/// MLA as one KV head of the latent (`kv_lora_rank`,
/// `key_length_mla`, `value_length_mla`, or the older files'
/// `key_length`/`value_length`), experts after
/// `leading_dense_block_count` layers with `expert_shared_count` shared
/// ones, `expert_gating_func` (softmax, or sigmoid with the router's
/// `exp_probs_b` bias), `expert_group_count`/`expert_group_used_count`,
/// `expert_weights_scale` and `expert_weights_norm`, and YaRN from
/// `rope.scaling.*` (its `yarn_log_multiplier` is 0.1 ×
/// `mscale_all_dim`; llama.cpp, like DeepSeek's configs, takes `mscale`
/// equal to it, so cos/sin are not rescaled).
pub fn gguf_config(g: &GgufFile) -> Result<ModelConfig> {
    let m = GgufMeta::new(g, "deepseek2");
    let hidden_size = m.req("embedding_length")?;
    let num_heads = m.req("attention.head_count")?;
    let num_layers = m.block_count()?;
    let rope = m.req("rope.dimension_count")?;
    let kv_lora_rank = m.req("attention.kv_lora_rank")?;
    let (qk, v) = match (
        m.opt("attention.key_length_mla")?,
        m.opt("attention.value_length_mla")?,
    ) {
        (Some(k), Some(v)) => (k, v),
        // Files from before the MLA keys: the per-head sizes.
        _ => (
            m.req("attention.key_length")?,
            m.req("attention.value_length")?,
        ),
    };
    if qk <= rope {
        bail!("the attention heads ({qk}) are not wider than their rotary part ({rope})");
    }
    let (rope_scaling, softmax_mscale) = match m.str("rope.scaling.type")? {
        None | Some("none") => (RopeScaling::None, 1.0),
        Some("yarn") => {
            let factor = m.f32("rope.scaling.factor")?.unwrap_or(1.0);
            let original = m.req("rope.scaling.original_context_length")?;
            let mscale_all_dim =
                m.f32("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0) as f64 / 0.1;
            let mscale = yarn_mscale(factor as f64, mscale_all_dim);
            (
                RopeScaling::Yarn {
                    factor,
                    original_max_position: original,
                    beta_fast: m.f32("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                    beta_slow: m.f32("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                    attention_factor: 1.0,
                    truncate: true,
                },
                if mscale_all_dim != 0.0 {
                    (mscale * mscale) as f32
                } else {
                    1.0
                },
            )
        }
        Some(other) => {
            bail!("rope scaling '{other}' is not supported for deepseek2 (none, yarn)")
        }
    };
    let mla = MlaConfig {
        q_lora_rank: m.opt("attention.q_lora_rank")?.filter(|&q| q > 0),
        kv_lora_rank,
        qk_nope_head_dim: qk - rope,
        qk_rope_head_dim: rope,
        v_head_dim: v,
        softmax_mscale,
    };
    if mla.latent_width() > pagoda_accel::ops::mla::MAX_LATENT {
        bail!(
            "kv_lora_rank + rope = {} is beyond the supported maximum",
            mla.latent_width()
        );
    }
    let n_experts = m.req("expert_count")?;
    let top_k = m.req("expert_used_count")?;
    let first_dense = m.opt("leading_dense_block_count")?.unwrap_or(0);
    let expert_ffn = m.req("expert_feed_forward_length")?;
    let scoring = match m.opt("expert_gating_func")? {
        None | Some(1) => RouterScoring::Softmax,
        Some(2) => RouterScoring::Sigmoid,
        Some(other) => bail!(
            "{} = {other} is not supported (1 softmax, 2 sigmoid)",
            m.key("expert_gating_func")
        ),
    };
    let groups = match (
        m.opt("expert_group_count")?,
        m.opt("expert_group_used_count")?,
    ) {
        (Some(n_group), Some(topk_group)) if n_group > 1 => Some(GroupLimit {
            n_group,
            topk_group,
            score: match scoring {
                RouterScoring::Sigmoid => GroupScore::SumTop2,
                RouterScoring::Softmax | RouterScoring::TopKSoftmax => GroupScore::Max,
            },
        }),
        _ => None,
    };
    let moe = MoeConfig {
        n_experts,
        top_k,
        normalize: m.bool("expert_weights_norm")?.unwrap_or(false),
        expert_ffn,
        shared_ffn: m
            .opt("expert_shared_count")?
            .filter(|&n| n > 0)
            .map(|n| n * expert_ffn),
        sparse_layers: (0..num_layers).map(|i| i >= first_dense).collect(),
        scoring,
        routed_scale: m.f32("expert_weights_scale")?.unwrap_or(1.0),
        groups,
        score_bias: m.has(&format!("blk.{first_dense}.exp_probs_b.bias")),
        shared_gated: false,
    };
    let spec = pagoda_accel::ops::RouterSpec {
        n_experts,
        top_k,
        scoring,
        normalize: moe.normalize,
        scale: moe.routed_scale,
        groups,
    };
    if let Err(why) = spec.check() {
        bail!("{why}");
    }
    let vocab_size = m.vocab_size()?;
    let cfg = ModelConfig {
        arch: Arch::Deepseek,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads: num_heads,
        head_dim: rope,
        intermediate_size: m.req("feed_forward_length")?,
        vocab_size,
        rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        rope_theta: m.f32("rope.freq_base")?.unwrap_or(10_000.0),
        rope_scaling,
        // llama.cpp rotates adjacent pairs for deepseek2 (its NORM
        // rope), as DeepSeek's own code does.
        rope_style: RopeStyle::Interleaved,
        max_position_embeddings: m.opt("context_length")?.unwrap_or(4096),
        tie_word_embeddings: !m.has("output.weight"),
        attention_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_windows: Vec::new(),
        moe: Some(moe),
        mla: Some(mla),
        hybrid: None,
        hidden_act: Activation::Silu,
        gemma: None,
        gpt_oss: None,
        encoder: None,
    };
    cfg.validate()?;
    Ok(cfg)
}
