//! Gemma 3 text (transformers' `modeling_gemma3.py`, `Gemma3ForCausalLM`):
//! grouped-query attention with an RMSNorm over each q and k head and a
//! score scale of `query_pre_attn_scalar^-0.5`, local layers attending over
//! a sliding window with their own RoPE base and global layers over the
//! whole context with theirs (`layer_types`), a GeGLU MLP (GELU's tanh
//! approximation), and four norms per layer: each block's input and output
//! are normalized (sandwich norms),
//!
//! ```text
//! x += post_attention_norm(attn(input_norm(x)))
//! x += post_feedforward_norm(mlp(pre_feedforward_norm(x)))
//! ```
//!
//! Every RMSNorm scales by `1 + w`; the embedding is scaled by
//! `√hidden_size` rounded to the embedding's type, as transformers'
//! `Gemma3TextScaledWordEmbedding` does; the logits are soft-capped when
//! `final_logit_softcapping` is set.

use super::layers::attention::{AttentionParts, SelfAttention};
use super::layers::decoder::final_logits;
use super::layers::mlp::GatedMlp;
use super::layers::{load_matrix, load_offset_norm, weight_bytes, Workspace};
use super::{CausalLm, StateCache};
use crate::engine::config::{Activation, Arch, GemmaConfig, GgufMeta, ModelConfig};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{RopeScaling, RopeStyle, RopeTable};
use pagoda_accel::{Backend, BackendError, DeviceMatrix, GgmlType, KvLayerSpec};

struct GemmaLayer<B: Backend> {
    /// `1 + input_layernorm.weight`, and so on for the other three.
    input_norm: B::Vector,
    attn: SelfAttention<B>,
    post_attn_norm: B::Vector,
    pre_ffn_norm: B::Vector,
    mlp: GatedMlp<B>,
    post_ffn_norm: B::Vector,
    /// A sliding-window (local) layer, rotated with the local RoPE.
    local: bool,
}

impl<B: Backend> GemmaLayer<B> {
    fn matrices(&self) -> impl Iterator<Item = &B::Matrix> {
        self.attn.matrices().chain(self.mlp.matrices())
    }
}

/// A loaded Gemma 3 text model.
pub struct Gemma3<B: Backend> {
    config: ModelConfig,
    embed: B::Matrix,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Matrix>,
    layers: Vec<GemmaLayer<B>>,
    /// `1 + model.norm.weight`.
    norm: B::Vector,
    /// The global layers' RoPE (`rope_theta`, `rope_scaling`).
    global_rope: B::Rope,
    /// The local layers' RoPE.
    local_rope: B::Rope,
    /// `√hidden_size` in the embedding's type.
    embed_scale: f32,
    softcap: Option<f32>,
    prompt_kernel: bool,
    weight_type: &'static str,
}

/// `√hidden` as transformers scales the embedding: a float32 buffer cast to
/// the embedding weight's dtype before the product (bfloat16 or float16
/// checkpoints round it; float32 and quantized tables keep the float32).
pub fn embed_scale(hidden: usize, embed_type: GgmlType) -> f32 {
    let s = (hidden as f64).sqrt() as f32;
    match embed_type {
        GgmlType::BF16 => half::bf16::from_f32(s).to_f32(),
        GgmlType::F16 => half::f16::from_f32(s).to_f32(),
        _ => s,
    }
}

/// Loads a Gemma 3 text model (HF tensor names), refusing it on a device
/// without GeGLU, scaling and soft-capping.
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<Gemma3<B>> {
    if !backend.supports_gemma_ops() {
        bail!(
            "Gemma 3 needs GELU-tanh gating, a scaled embedding and logit soft-capping, which this device has no kernels for yet ({}); serve it with --device cpu",
            backend.describe()
        );
    }
    let c = &config;
    let g: GemmaConfig = c
        .gemma
        .clone()
        .context("a Gemma 3 config without its Gemma part")?;
    let d = c.hidden_size;
    let parts = AttentionParts {
        qkv_bias: c.attention_bias,
        o_bias: c.o_bias,
        qk_norm: true,
        qk_norm_offset: true,
        scale: Some(g.attn_scale),
        sinks: false,
    };
    let norm = |name: &str| load_offset_norm(backend, source, name, d);
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        layers.push(GemmaLayer {
            input_norm: norm(&p("input_layernorm.weight"))?,
            attn: SelfAttention::load(
                backend,
                source,
                c,
                i,
                &p("self_attn"),
                parts,
                max_positions,
            )?,
            post_attn_norm: norm(&p("post_attention_layernorm.weight"))?,
            pre_ffn_norm: norm(&p("pre_feedforward_layernorm.weight"))?,
            mlp: GatedMlp::load(backend, source, &p("mlp"), d, c.intermediate_size, false)?
                .with_activation(c.hidden_act),
            post_ffn_norm: norm(&p("post_feedforward_layernorm.weight"))?,
            local: c.sliding_window(i).is_some(),
        });
    }
    let upload = |name: &str, rows, cols| load_matrix(backend, source, name, rows, cols);
    let embed = upload("model.embed_tokens.weight", c.vocab_size, d)?;
    let lm_head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
        None
    } else {
        Some(upload("lm_head.weight", c.vocab_size, d)?)
    };
    let final_norm = norm("model.norm.weight")?;
    let rope = |theta, scaling| {
        backend.upload_rope(&RopeTable::new(
            c.head_dim,
            theta,
            max_positions,
            scaling,
            c.rope_style,
        ))
    };
    let global_rope = rope(c.rope_theta, &c.rope_scaling)?;
    let local_rope = rope(g.local_rope_theta, &g.local_rope_scaling)?;
    let head = lm_head.as_ref().unwrap_or(&embed);
    let prompt_kernel = backend.has_prompt_kernel(head)
        || layers
            .iter()
            .any(|l| l.matrices().any(|m| backend.has_prompt_kernel(m)));
    let weight_type = layers
        .first()
        .and_then(|l| l.attn.matrices().last())
        .map_or("none", |o| o.ty().name());
    let embed_scale = embed_scale(d, embed.ty());
    Ok(Gemma3 {
        embed,
        lm_head,
        layers,
        norm: final_norm,
        global_rope,
        local_rope,
        embed_scale,
        softcap: g.final_logit_softcap,
        prompt_kernel,
        weight_type,
        config,
    })
}

impl<B: Backend> CausalLm<B> for Gemma3<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layers(&self) -> Vec<KvLayerSpec> {
        self.layers.iter().map(|l| l.attn.kv_layer()).collect()
    }

    fn weight_bytes(&self) -> usize {
        weight_bytes(
            self.layers.iter().flat_map(|l| l.matrices()),
            &self.embed,
            self.lm_head.as_ref(),
        )
    }

    fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
        _state: &mut StateCache<B>,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (d, n, eps) = (c.hidden_size, n_tokens, c.rms_norm_eps);
        b.reserve(&mut ws.x, n * d)?;
        b.reserve(&mut ws.h, n * d)?;
        b.embed(&self.embed, step, &mut ws.x);
        b.scale(&mut ws.x, n * d, self.embed_scale)?;
        for layer in &self.layers {
            let rope = match layer.local {
                true => &self.local_rope,
                false => &self.global_rope,
            };
            b.rms_norm(&ws.x, &layer.input_norm, eps, n, d, &mut ws.h);
            layer.attn.forward(b, rope, step, n, kv, ws, None)?;
            b.rms_norm(&ws.proj, &layer.post_attn_norm, eps, n, d, &mut ws.h);
            b.add(&mut ws.x, &ws.h, n * d);
            b.rms_norm(&ws.x, &layer.pre_ffn_norm, eps, n, d, &mut ws.h);
            layer.mlp.forward(b, step, n, ws, None)?;
            b.rms_norm(&ws.proj, &layer.post_ffn_norm, eps, n, d, &mut ws.h);
            b.add(&mut ws.x, &ws.h, n * d);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        final_logits(b, step, c, &self.norm, head, n_logits, ws)?;
        if let Some(cap) = self.softcap {
            b.softcap(&mut ws.logits, n_logits * c.vocab_size, cap)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch's `torch.tensor(h ** 0.5).to(dtype)` for Gemma 3's widths.
    #[test]
    fn the_embedding_scale_rounds_to_the_embeddings_type_as_torch_does() {
        for (hidden, ty, want) in [
            (640, GgmlType::BF16, 25.25),
            (1152, GgmlType::BF16, 34.0),
            (5376, GgmlType::BF16, 73.5),
            (640, GgmlType::F16, 25.296875),
            (2560, GgmlType::F16, 50.59375),
            (640, GgmlType::F32, 25.298221588134766),
            (1152, GgmlType::Q8_0, 33.941123962402344),
        ] {
            assert_eq!(embed_scale(hidden, ty), want as f32, "{hidden} in {ty:?}");
        }
    }
}

/// Gemma 3 as llama.cpp's converter writes it (`gemma3`), read as
/// llama.cpp's loader reads it: the local layers from
/// `attention.sliding_window_pattern` (one bool per layer, or a period
/// `n` making every layer but each `n`-th local), else a period of 6;
/// none when `attention.sliding_window` is absent or 0. The local
/// layers rotate with `rope.freq_base_swa` (default 1e4) unscaled, the
/// global ones with `rope.freq_base` and the file's linear scaling. The
/// file has no `query_pre_attn_scalar`: the score scale is
/// `1/√head_dim`, except for the 62-layer model (27B), whose is
/// `1/√(hidden / heads)`, as in llama.cpp and Gemma's own configs. The
/// norms' `1 + w` folded into the weights is undone by
/// [`crate::engine::loader::gguf_weights::GgufWeights`].
pub fn gguf_config(g: &GgufFile) -> Result<ModelConfig> {
    let m = GgufMeta::new(g, "gemma3");
    let hidden_size = m.req("embedding_length")?;
    let num_heads = m.req("attention.head_count")?;
    let num_kv_heads = m.opt("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = match m.opt("attention.key_length")? {
        Some(k) => k,
        None if num_heads > 0 => hidden_size / num_heads,
        None => bail!("{} is 0", m.key("attention.head_count")),
    };
    if let Some(v) = m.opt("attention.value_length")?.filter(|&v| v != head_dim) {
        bail!(
            "{} = {v} differs from {} = {head_dim}; Gemma 3's values are as wide as its keys",
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
    if let Some(e) = m.opt("expert_count")?.filter(|&e| e > 0) {
        bail!("{} = {e}: Gemma 3 has no experts", m.key("expert_count"));
    }
    // Read by no llama.cpp graph of Gemma 3 (the converter refuses it);
    // transformers would soft-cap the scores.
    if let Some(c) = m.f32("attn_logit_softcapping")? {
        bail!(
            "{} = {c}: soft-capping the attention scores is not computed",
            m.key("attn_logit_softcapping")
        );
    }
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
                let every = match g.get_u64(&pattern_key)? {
                    Some(n) => n as usize,
                    None => 6,
                };
                (0..num_layers)
                    .map(|i| every == 0 || i % every < every - 1)
                    .collect()
            }
        },
    };
    let sliding_windows = local
        .iter()
        .map(|&l| l.then_some(window).flatten())
        .collect();
    let rope_scaling = match m.str("rope.scaling.type")? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: m.f32("rope.scaling.factor")?.unwrap_or(1.0),
        },
        Some(other) => bail!(
            "{} = '{other}' is not supported for Gemma 3 (supported: none, linear)",
            m.key("rope.scaling.type")
        ),
    };
    if m.has("rope_freqs.weight") {
        bail!("tensor 'rope_freqs.weight': per-pair RoPE factors are not read for Gemma 3");
    }
    let scalar = if num_layers == 62 {
        hidden_size as f64 / num_heads.max(1) as f64
    } else {
        head_dim as f64
    };
    let gemma = GemmaConfig {
        attn_scale: scalar.powf(-0.5) as f32,
        local_rope_theta: m.f32("rope.freq_base_swa")?.unwrap_or(10_000.0),
        local_rope_scaling: RopeScaling::None,
        final_logit_softcap: m.f32("final_logit_softcapping")?.filter(|&c| c != 0.0),
    };
    // The converter drops the embedding rows past the tokenizer's
    // tokens; the vocabulary is the LM head's (or the tokenizer's).
    let vocab_size = match g.tensors().iter().find(|t| t.name == "output.weight") {
        Some(t) if t.shape.len() == 2 => t.shape[0],
        _ => m.vocab_size()?,
    };
    let cfg = ModelConfig {
        arch: Arch::Gemma3,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: m.req("feed_forward_length")?,
        vocab_size,
        rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        rope_theta: m.f32("rope.freq_base")?.unwrap_or(1_000_000.0),
        rope_scaling,
        rope_style: RopeStyle::Neox,
        max_position_embeddings: m.opt("context_length")?.unwrap_or(131_072),
        tie_word_embeddings: !m.has("output.weight"),
        attention_bias: m.has("blk.0.attn_q.bias"),
        o_bias: m.has("blk.0.attn_output.bias"),
        mlp_bias: m.has("blk.0.ffn_down.bias"),
        sliding_windows,
        moe: None,
        mla: None,
        hybrid: None,
        hidden_act: Activation::GeluTanh,
        gemma: Some(gemma),
        gpt_oss: None,
        encoder: None,
    };
    cfg.validate()?;
    Ok(cfg)
}
