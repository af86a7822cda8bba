//! The gated full attention of the hybrid Qwen models (transformers'
//! `Qwen3NextAttention`, which Qwen3.5 reuses): grouped-query attention
//! over the paged KV cache whose `q_proj` emits, per head, the query and
//! an output gate of `head_dim` each; the attention output is multiplied
//! by `sigmoid(gate)` before `o_proj`. q and k go through a per-head
//! RMSNorm scaling by `1 + w`, then RoPE over their first `rotary_dim`
//! values (`partial_rotary_factor`; the rest pass through).
//!
//! transformers views `q_proj`'s output as `[heads, 2 · head_dim]` and
//! splits each head into query then gate, so the rows alternate per head.
//! They are regrouped once at load into `[queries | gates]`, and the
//! projection fused with k and v writes `[q | gate | k | v]` per token.

use super::gated_delta_net::row_range;
use super::projection::Projection;
use super::{load_matrix, load_offset_norm, Workspace};
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, BackendError, KvLayerSpec, Rows};

/// The shape of one gated attention layer.
#[derive(Clone, Copy, Debug)]
pub struct GatedAttentionShape {
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates.
    pub rotary_dim: usize,
    /// The q/k norms' epsilon (`rms_norm_eps`).
    pub eps: f32,
}

/// One gated attention layer on the device.
pub struct GatedAttention<B: Backend> {
    shape: GatedAttentionShape,
    /// `[q | gate | k | v]` rows.
    qkv: Projection<B>,
    /// `1 + q_norm.weight`, `1 + k_norm.weight`.
    q_norm: B::Vector,
    k_norm: B::Vector,
    o: B::Matrix,
    /// The layer's index in the KV pool, which holds the attention layers
    /// only.
    kv_layer: usize,
}

impl<B: Backend> GatedAttention<B> {
    /// Loads the layer under `prefix` (`model.layers.N.self_attn`) with
    /// transformers' tensor names; its K/V go to layer `kv_layer` of the
    /// pool.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        shape: GatedAttentionShape,
        prefix: &str,
        kv_layer: usize,
    ) -> Result<GatedAttention<B>> {
        let GatedAttentionShape {
            hidden: d,
            n_heads,
            n_kv_heads,
            head_dim: hd,
            ..
        } = shape;
        let (qd, kvd) = (n_heads * hd, n_kv_heads * hd);
        let p = |s: &str| format!("{prefix}.{s}");
        let q = source.matrix(&p("q_proj.weight"), 2 * qd, d)?;
        let k = source.matrix(&p("k_proj.weight"), kvd, d)?;
        let v = source.matrix(&p("v_proj.weight"), kvd, d)?;
        let mut parts = Vec::with_capacity(2 * n_heads + 2);
        // Head h's query rows, then (second loop) its gate rows.
        for off in [0, hd] {
            for h in 0..n_heads {
                let r0 = h * 2 * hd + off;
                parts.push(row_range(&q, r0, r0 + hd)?);
            }
        }
        parts.push(k);
        parts.push(v);
        let qkv = Projection::new(backend, parts)
            .with_context(|| format!("{}: {prefix} q/gate/k/v", source.describe()))?;
        Ok(GatedAttention {
            shape,
            qkv,
            q_norm: load_offset_norm(backend, source, &p("q_norm.weight"), hd)?,
            k_norm: load_offset_norm(backend, source, &p("k_norm.weight"), hd)?,
            o: load_matrix(backend, source, &p("o_proj.weight"), d, qd)?,
            kv_layer,
        })
    }

    /// What the layer keeps per token in the KV pool.
    pub fn kv_spec(&self) -> KvLayerSpec {
        KvLayerSpec::symmetric(self.shape.n_kv_heads, self.shape.head_dim)
    }

    /// The projections, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> impl Iterator<Item = &B::Matrix> {
        self.qkv.parts().iter().chain(std::iter::once(&self.o))
    }

    /// Rotates the first `rotary_dim` values of each of the `heads` heads
    /// of `x`'s `n` rows by the tokens' positions (`rope` is a table of
    /// `rotary_dim`). The rotated part goes out to `tmp` and back, so the
    /// RoPE operation sees heads of the table's width.
    #[allow(clippy::too_many_arguments)]
    fn partial_rope(
        &self,
        b: &mut B,
        rope: &B::Rope,
        x: &mut B::Buffer,
        heads: usize,
        n: usize,
        tmp: &mut B::Buffer,
        step: &B::Step,
    ) -> Result<(), BackendError> {
        let (hd, rd) = (self.shape.head_dim, self.shape.rotary_dim);
        if rd == hd {
            b.rope(rope, x, heads, step);
            return Ok(());
        }
        let rows = n * heads;
        b.reserve(tmp, rows * rd)?;
        b.copy_columns(x, hd, 0, tmp, rd, 0, rd, rows);
        b.rope(rope, tmp, heads, step);
        b.copy_columns(tmp, rd, 0, x, hd, 0, rd, rows);
        Ok(())
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
    ) -> Result<(), BackendError> {
        let s = &self.shape;
        let hd = s.head_dim;
        let (qd, kvd) = (s.n_heads * hd, s.n_kv_heads * hd);
        let width = 2 * qd + 2 * kvd;
        // `q`, `k` and `normed` trade places through the norms, so each
        // holds the wider of the two.
        let wide = n * qd.max(kvd);
        b.reserve(&mut ws.qkv, n * width)?;
        b.reserve(&mut ws.q, wide)?;
        b.reserve(&mut ws.k, wide)?;
        b.reserve(&mut ws.v, n * kvd)?;
        b.reserve(&mut ws.normed, wide)?;
        b.reserve(&mut ws.attn, n * qd)?;
        b.reserve(&mut ws.proj, n * s.hidden)?;

        self.qkv
            .matmul(b, &ws.h, n, &mut ws.qkv, &mut ws.split_tmp, step)?;
        b.copy_columns(&ws.qkv, width, 0, &mut ws.q, qd, 0, qd, n);
        b.copy_columns(&ws.qkv, width, 2 * qd, &mut ws.k, kvd, 0, kvd, n);
        b.copy_columns(&ws.qkv, width, 2 * qd + kvd, &mut ws.v, kvd, 0, kvd, n);
        // Rows of `head_dim`: every head of every token alike.
        b.rms_norm(
            &ws.q,
            &self.q_norm,
            s.eps,
            n * s.n_heads,
            hd,
            &mut ws.normed,
        );
        std::mem::swap(&mut ws.q, &mut ws.normed);
        b.rms_norm(
            &ws.k,
            &self.k_norm,
            s.eps,
            n * s.n_kv_heads,
            hd,
            &mut ws.normed,
        );
        std::mem::swap(&mut ws.k, &mut ws.normed);
        self.partial_rope(b, rope, &mut ws.q, s.n_heads, n, &mut ws.rot, step)?;
        self.partial_rope(b, rope, &mut ws.k, s.n_kv_heads, n, &mut ws.rot, step)?;
        b.write_kv(kv, self.kv_layer, &ws.k, &ws.v, step);
        let scale = 1.0 / (hd as f32).sqrt();
        b.attention(
            kv,
            self.kv_layer,
            &ws.q,
            s.n_heads,
            scale,
            None,
            None,
            step,
            &mut ws.attn,
        );
        b.mul_sigmoid(&mut ws.attn, &ws.qkv, width, qd, n, qd)?;
        b.matmul(&self.o, &ws.attn, n, &mut ws.proj, step, Rows::Tokens);
        Ok(())
    }
}
