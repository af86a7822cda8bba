//! Grouped-query self-attention over the paged KV cache: the attention
//! block of Llama, Mistral, Qwen2 and Qwen3 (and of the mixture-of-experts
//! models built on them).

use super::lora::{LayerLora, LoraSlices};
use super::projection::Projection;
use super::{load_matrix, load_offset_norm, load_vector, Workspace};
use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use crate::engine::lora::LoraModule;
use anyhow::{bail, Context, Result};
use pagoda_accel::{Backend, BackendError, DeviceMatrix, KvLayerSpec};

/// The optional parts a family's attention block carries.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionParts {
    /// Biases on q, k and v (Qwen2; `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// An RMSNorm over each q and k head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The q/k norms scale by `1 + w` (Gemma 3).
    pub qk_norm_offset: bool,
    /// The scores' scale where it is not `1/√head_dim` (Gemma 3's
    /// `query_pre_attn_scalar^-0.5`).
    pub scale: Option<f32>,
    /// A learned sink logit per q head in the softmax denominator
    /// (gpt-oss's `sinks`).
    pub sinks: bool,
}

/// One layer's self-attention: q/k/v projections, RoPE, a write of this
/// step's K/V into the layer's cache, paged attention and the output
/// projection.
pub struct SelfAttention<B: Backend> {
    qkv: Projection<B>,
    /// q|k|v biases side by side.
    qkv_bias: Option<B::Vector>,
    /// Per-head RMSNorm weights of q and k, `head_dim` each.
    qk_norm: Option<(B::Vector, B::Vector)>,
    o: B::Matrix,
    o_bias: Option<B::Vector>,
    /// One sink logit per q head.
    sinks: Option<B::Vector>,
    /// The layer's index in the KV pool.
    layer: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    eps: f32,
    /// The attention window, where it is shorter than the context (a
    /// longer one changes nothing).
    window: Option<usize>,
    /// The scores' scale.
    scale: f32,
}

impl<B: Backend> SelfAttention<B> {
    /// Loads layer `layer`'s attention from the tensors under `prefix`
    /// (`model.layers.N.self_attn`), with HF's names (`q_proj`, `k_proj`,
    /// `v_proj`, `o_proj`, `q_norm`, `k_norm`). `max_positions` decides
    /// whether the layer's window matters.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        c: &ModelConfig,
        layer: usize,
        prefix: &str,
        parts: AttentionParts,
        max_positions: usize,
    ) -> Result<SelfAttention<B>> {
        let (d, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let p = |s: &str| format!("{prefix}.{s}");
        let qkv = Projection::new(
            backend,
            vec![
                source.matrix(&p("q_proj.weight"), q, d)?,
                source.matrix(&p("k_proj.weight"), kv, d)?,
                source.matrix(&p("v_proj.weight"), kv, d)?,
            ],
        )
        .with_context(|| format!("{}: layer {layer} q/k/v", source.describe()))?;
        let qkv_bias = if parts.qkv_bias {
            let mut b = source.vector(&p("q_proj.bias"), q)?;
            b.extend(source.vector(&p("k_proj.bias"), kv)?);
            b.extend(source.vector(&p("v_proj.bias"), kv)?);
            Some(backend.upload_vector(&b)?)
        } else {
            None
        };
        let vector = |name: &str, len| load_vector(backend, source, name, len);
        let norm = |name: &str| match parts.qk_norm_offset {
            true => load_offset_norm(backend, source, name, c.head_dim),
            false => vector(name, c.head_dim),
        };
        let qk_norm = match parts.qk_norm {
            true => Some((norm(&p("q_norm.weight"))?, norm(&p("k_norm.weight"))?)),
            false => None,
        };
        let o_bias = match parts.o_bias {
            true => Some(vector(&p("o_proj.bias"), d)?),
            false => None,
        };
        let sinks = match parts.sinks {
            true => {
                if !backend.supports_attention_sinks() {
                    bail!(
                        "the model's attention has a sink logit per head, and this device's attention has no sinks yet ({}); serve it with --device cpu",
                        backend.describe()
                    );
                }
                Some(vector(&p("sinks"), c.num_heads)?)
            }
            false => None,
        };
        let o = load_matrix(backend, source, &p("o_proj.weight"), d, q)?;
        Ok(SelfAttention {
            qkv,
            qkv_bias,
            qk_norm,
            o,
            o_bias,
            sinks,
            layer,
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            eps: c.rms_norm_eps,
            window: c.sliding_window(layer).filter(|&w| w < max_positions),
            scale: parts
                .scale
                .unwrap_or_else(|| 1.0 / (c.head_dim as f32).sqrt()),
        })
    }

    /// What the layer keeps per token in the KV pool.
    pub fn kv_layer(&self) -> KvLayerSpec {
        KvLayerSpec::symmetric(self.n_kv_heads, self.head_dim)
    }

    /// The projections, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> impl Iterator<Item = &B::Matrix> {
        self.qkv.parts().iter().chain(std::iter::once(&self.o))
    }

    /// Attends the `n` tokens of the step whose normed hidden states are in
    /// `ws.h`, leaving the output projection in `ws.proj` (`[n, hidden]`).
    pub fn forward(
        &self,
        b: &mut B,
        rope: &B::Rope,
        step: &B::Step,
        n: usize,
        kv: &mut B::Kv,
        ws: &mut Workspace<B>,
        lora: Option<&LayerLora<B>>,
    ) -> Result<(), BackendError> {
        let (hd, qd) = (self.head_dim, self.n_heads * self.head_dim);
        let kvd = self.n_kv_heads * hd;
        let d = self.o.rows();
        let qkv_w = qd + 2 * kvd;
        b.reserve(&mut ws.qkv, n * qkv_w)?;
        // With the q/k norms, `q`, `k` and `normed` trade places, so each
        // must hold the wider of the two.
        let wide = n * qd.max(kvd);
        b.reserve(&mut ws.q, wide)?;
        b.reserve(
            &mut ws.k,
            if self.qk_norm.is_some() {
                wide
            } else {
                n * kvd
            },
        )?;
        b.reserve(&mut ws.v, n * kvd)?;
        b.reserve(&mut ws.attn, n * qd)?;
        b.reserve(&mut ws.proj, n * d)?;

        // Each adapted part adds to its columns of the fused output.
        let qkv_slices = lora.map_or_else(LoraSlices::none, |l| {
            l.slices(&[
                (LoraModule::Q, 0, qd),
                (LoraModule::K, qd, kvd),
                (LoraModule::V, qd + kvd, kvd),
            ])
        });
        self.qkv.matmul_lora(
            b,
            &ws.h,
            n,
            &mut ws.qkv,
            &mut ws.split_tmp,
            self.qkv_bias.as_ref(),
            &qkv_slices,
            step,
        )?;
        b.copy_columns(&ws.qkv, qkv_w, 0, &mut ws.q, qd, 0, qd, n);
        b.copy_columns(&ws.qkv, qkv_w, qd, &mut ws.k, kvd, 0, kvd, n);
        b.copy_columns(&ws.qkv, qkv_w, qd + kvd, &mut ws.v, kvd, 0, kvd, n);
        if let Some((qn, kn)) = &self.qk_norm {
            // Rows of `head_dim`: every head of every token alike.
            b.reserve(&mut ws.normed, wide)?;
            b.rms_norm(&ws.q, qn, self.eps, n * self.n_heads, hd, &mut ws.normed);
            std::mem::swap(&mut ws.q, &mut ws.normed);
            b.rms_norm(&ws.k, kn, self.eps, n * self.n_kv_heads, hd, &mut ws.normed);
            std::mem::swap(&mut ws.k, &mut ws.normed);
        }
        b.rope(rope, &mut ws.q, self.n_heads, step);
        b.rope(rope, &mut ws.k, self.n_kv_heads, step);
        b.write_kv(kv, self.layer, &ws.k, &ws.v, step);
        b.attention(
            kv,
            self.layer,
            &ws.q,
            self.n_heads,
            self.scale,
            self.window,
            self.sinks.as_ref(),
            step,
            &mut ws.attn,
        );
        let o_slices = lora.map_or_else(LoraSlices::none, |l| l.slices(&[(LoraModule::O, 0, d)]));
        b.matmul_lora(
            &self.o,
            &ws.attn,
            n,
            &mut ws.proj,
            self.o_bias.as_ref(),
            &o_slices,
            step,
        )?;
        Ok(())
    }
}
