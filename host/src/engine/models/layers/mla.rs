//! DeepSeek's multi-head latent attention (MLA), in the absorbed form for
//! every token, prompt and decode alike.
//!
//! Per token: the query comes from `q_proj` (V2-Lite) or from `q_a_proj`,
//! its RMSNorm and `q_b_proj`; each head's query splits into a part without
//! RoPE (`nope`) and a rotary part. The KV side is one compressed latent
//! per token, `kv_a_proj_with_mqa`'s output: `kv_lora_rank` values (RMSNorm
//! applied) and a rotary key shared by all heads. `kv_b_proj` would expand
//! the latent into each head's key (`W_UK[h]`) and value (`W_UV[h]`); here
//! `W_UK[h]` is absorbed into the query instead (`q_latent = W_UK[h]ᵀ ·
//! q_nope`), so scores and the weighted sum run over the latent rows the
//! cache keeps, and `W_UV[h]` up-projects each head's result. The cache
//! holds `kv_lora_rank + qk_rope_head_dim` values per token and layer.

use super::{load_matrix, load_vector, Workspace};
use crate::engine::config::{MlaConfig, ModelConfig};
use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, BackendError, GgmlType, HostMatrix, KvLayerSpec, Rows};

/// RMSNorm epsilon of the query and KV latents: DeepSeek's modeling code
/// builds these norms with its default, not the config's `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

/// The query projection.
enum QueryProj<B: Backend> {
    /// `q_proj` (no `q_lora_rank`).
    Direct(B::Matrix),
    /// `q_a_proj`, its RMSNorm, `q_b_proj`.
    LowRank {
        a: B::Matrix,
        norm: B::Vector,
        b: B::Matrix,
        rank: usize,
    },
}

/// One layer's latent attention.
pub struct LatentAttention<B: Backend> {
    q: QueryProj<B>,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + rope, hidden]`.
    kv_a: B::Matrix,
    kv_norm: B::Vector,
    /// Per head `W_UK[h]ᵀ`: `[kv_lora_rank, nope]`.
    uk: Vec<B::Matrix>,
    /// Per head `W_UV[h]`: `[v_head_dim, kv_lora_rank]`.
    uv: Vec<B::Matrix>,
    o: B::Matrix,
    layer: usize,
    n_heads: usize,
    m: MlaConfig,
    hidden: usize,
    scale: f32,
}

/// The store type of the absorbed per-head matrices: the checkpoint's
/// float type, or f32 for a quantized `kv_b_proj` (dequantized exactly).
fn absorbed_type(stored: GgmlType) -> GgmlType {
    match stored {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => stored,
        _ => GgmlType::F32,
    }
}

impl<B: Backend> LatentAttention<B> {
    /// Loads layer `layer`'s attention from `{prefix}.q_proj` (or
    /// `q_a_proj`, `q_a_layernorm`, `q_b_proj`), `kv_a_proj_with_mqa`,
    /// `kv_a_layernorm`, `kv_b_proj` and `o_proj`.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        c: &ModelConfig,
        m: &MlaConfig,
        layer: usize,
        prefix: &str,
    ) -> Result<LatentAttention<B>> {
        let p = |s: &str| format!("{prefix}.{s}");
        let d = c.hidden_size;
        let h = c.num_heads;
        let (nope, rope, r, v) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let upload = |name: &str, rows, cols| load_matrix(backend, source, name, rows, cols);
        let vector = |name: &str, len| load_vector(backend, source, name, len);
        let q = match m.q_lora_rank {
            None => QueryProj::Direct(upload(&p("q_proj.weight"), h * (nope + rope), d)?),
            Some(rank) => QueryProj::LowRank {
                a: upload(&p("q_a_proj.weight"), rank, d)?,
                norm: vector(&p("q_a_layernorm.weight"), rank)?,
                b: upload(&p("q_b_proj.weight"), h * (nope + rope), rank)?,
                rank,
            },
        };
        let kv_a = upload(&p("kv_a_proj_with_mqa.weight"), r + rope, d).with_context(|| {
            format!("the config's kv_lora_rank {r} + qk_rope_head_dim {rope} disagree with the checkpoint")
        })?;
        let kv_norm = vector(&p("kv_a_layernorm.weight"), r)?;
        // kv_b_proj: per head, `nope` rows of W_UK then `v` rows of W_UV,
        // each `kv_lora_rank` wide. A checkpoint whose latent width is not
        // the config's fails here, naming the tensor.
        let kv_b_name = p("kv_b_proj.weight");
        let kv_b = source
            .matrix(&kv_b_name, h * (nope + v), r)
            .with_context(|| {
                format!(
                    "kv_lora_rank {r}: '{kv_b_name}' must be [{} × {r}]",
                    h * (nope + v)
                )
            })?;
        let ty = absorbed_type(kv_b.ty());
        let w = kv_b
            .dequantize()
            .with_context(|| format!("{}: tensor '{kv_b_name}'", source.describe()))?;
        let mut uk = Vec::with_capacity(h);
        let mut uv = Vec::with_capacity(h);
        for head in 0..h {
            let base = head * (nope + v) * r;
            // W_UK[h]ᵀ: row j (latent dim) holds W_UK[h][i][j] over i.
            let mut t = vec![0f32; r * nope];
            for i in 0..nope {
                for j in 0..r {
                    t[j * nope + i] = w[base + i * r + j];
                }
            }
            uk.push(backend.upload_matrix(&HostMatrix::from_f32_as(ty, r, nope, &t)?)?);
            let wv = &w[base + nope * r..base + (nope + v) * r];
            uv.push(backend.upload_matrix(&HostMatrix::from_f32_as(ty, v, r, wv)?)?);
        }
        let o = upload(&p("o_proj.weight"), d, h * v)?;
        Ok(LatentAttention {
            q,
            kv_a,
            kv_norm,
            uk,
            uv,
            o,
            layer,
            n_heads: h,
            m: m.clone(),
            hidden: d,
            scale: m.softmax_mscale / ((nope + rope) as f32).sqrt(),
        })
    }

    /// One latent row per token.
    pub fn kv_layer(&self) -> KvLayerSpec {
        KvLayerSpec::latent(self.m.latent_width())
    }

    /// The matrices, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> Box<dyn Iterator<Item = &B::Matrix> + '_> {
        let q: Box<dyn Iterator<Item = &B::Matrix>> = match &self.q {
            QueryProj::Direct(w) => Box::new(std::iter::once(w)),
            QueryProj::LowRank { a, b, .. } => Box::new([a, b].into_iter()),
        };
        Box::new(
            q.chain(std::iter::once(&self.kv_a))
                .chain(&self.uk)
                .chain(&self.uv)
                .chain(std::iter::once(&self.o)),
        )
    }

    /// Attends the step's `n` tokens (normed hidden states in `ws.h`),
    /// leaving the output projection in `ws.proj`.
    pub fn forward(
        &self,
        b: &mut B,
        rope_table: &B::Rope,
        step: &B::Step,
        n: usize,
        kv: &mut B::Kv,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let (h, d) = (self.n_heads, self.hidden);
        let (nope, rope, r, v) = (
            self.m.qk_nope_head_dim,
            self.m.qk_rope_head_dim,
            self.m.kv_lora_rank,
            self.m.v_head_dim,
        );
        let (qk, width) = (nope + rope, r + rope);
        let w = &mut ws.mla;
        b.reserve(&mut ws.q, n * h * qk)?;
        b.reserve(&mut w.q_pe, n * h * rope)?;
        b.reserve(&mut w.q_full, n * h * width)?;
        b.reserve(&mut w.kv, n * width)?;
        b.reserve(&mut w.c, n * r)?;
        b.reserve(&mut w.c_normed, n * r)?;
        b.reserve(&mut w.k_pe, n * rope)?;
        b.reserve(&mut w.latent, n * width)?;
        b.reserve(&mut w.out_latent, n * h * r)?;
        b.reserve(&mut ws.attn, n * h * v)?;
        b.reserve(&mut ws.proj, n * d)?;

        // The query, every head `nope | rope` wide.
        match &self.q {
            QueryProj::Direct(q) => b.matmul(q, &ws.h, n, &mut ws.q, step, Rows::Tokens),
            QueryProj::LowRank {
                a,
                norm,
                b: qb,
                rank,
            } => {
                b.reserve(&mut w.q_a, n * rank)?;
                b.reserve(&mut w.q_a_normed, n * rank)?;
                b.matmul(a, &ws.h, n, &mut w.q_a, step, Rows::Tokens);
                b.rms_norm(&w.q_a, norm, LATENT_NORM_EPS, n, *rank, &mut w.q_a_normed);
                b.matmul(qb, &w.q_a_normed, n, &mut ws.q, step, Rows::Tokens);
            }
        }
        // Rows of (token, head): the rotary parts, roped per token.
        b.copy_columns(&ws.q, qk, nope, &mut w.q_pe, rope, 0, rope, n * h);
        b.rope(rope_table, &mut w.q_pe, h, step);
        // Each head's absorbed query: W_UK[h]ᵀ · q_nope, then its rotary part.
        b.matmul_heads(&self.uk, &ws.q, n, qk, 0, &mut w.q_full, width, 0);
        b.copy_columns(&w.q_pe, rope, 0, &mut w.q_full, width, r, rope, n * h);

        // The latent row: the normed compressed KV, then the roped key.
        b.matmul(&self.kv_a, &ws.h, n, &mut w.kv, step, Rows::Tokens);
        b.copy_columns(&w.kv, width, 0, &mut w.c, r, 0, r, n);
        b.rms_norm(&w.c, &self.kv_norm, LATENT_NORM_EPS, n, r, &mut w.c_normed);
        b.copy_columns(&w.kv, width, r, &mut w.k_pe, rope, 0, rope, n);
        b.rope(rope_table, &mut w.k_pe, 1, step);
        b.copy_columns(&w.c_normed, r, 0, &mut w.latent, width, 0, r, n);
        b.copy_columns(&w.k_pe, rope, 0, &mut w.latent, width, r, rope, n);
        b.write_latent(kv, self.layer, &w.latent, step);

        b.latent_attention(
            kv,
            self.layer,
            &w.q_full,
            h,
            r,
            self.scale,
            step,
            &mut w.out_latent,
        );
        // Each head's value: W_UV[h] · its latent result.
        b.matmul_heads(&self.uv, &w.out_latent, n, r, 0, &mut ws.attn, v, 0);
        b.matmul(&self.o, &ws.attn, n, &mut ws.proj, step, Rows::Tokens);
        Ok(())
    }
}

/// The latent attention's buffers, in [`Workspace::mla`].
pub struct MlaWorkspace<B: Backend> {
    q_a: B::Buffer,
    q_a_normed: B::Buffer,
    q_pe: B::Buffer,
    q_full: B::Buffer,
    kv: B::Buffer,
    c: B::Buffer,
    c_normed: B::Buffer,
    k_pe: B::Buffer,
    latent: B::Buffer,
    out_latent: B::Buffer,
}

impl<B: Backend> Default for MlaWorkspace<B> {
    fn default() -> Self {
        MlaWorkspace {
            q_a: Default::default(),
            q_a_normed: Default::default(),
            q_pe: Default::default(),
            q_full: Default::default(),
            kv: Default::default(),
            c: Default::default(),
            c_normed: Default::default(),
            k_pe: Default::default(),
            latent: Default::default(),
            out_latent: Default::default(),
        }
    }
}
