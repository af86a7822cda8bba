//! [`WeightSource`] over a GGUF file: maps the HF tensor names the model
//! asks for onto GGUF's (`blk.N.attn_q.weight`, …).

use super::gguf::GgufFile;
use super::{DType, WeightSource};
use crate::engine::config::{Arch, ModelConfig};
use anyhow::{bail, Context, Result};
use pagoda_accel::{GgmlType, HostMatrix};

/// A GGUF file seen as a source of named weights.
pub struct GgufWeights<'a> {
    file: &'a GgufFile,
    dtype: DType,
    hybrid: Option<HybridLayout>,
    /// Gemma 3's layout (see [`gemma_norm`]).
    gemma: bool,
    /// gpt-oss's layout (see [`gpt_oss_name`] and `gpt_oss_stacked`).
    gpt_oss: bool,
}

impl<'a> GgufWeights<'a> {
    /// `dtype` converts float tensors; quantized tensors always stay as
    /// stored (each backend lays them out for its kernels at upload).
    pub fn new(file: &'a GgufFile, dtype: DType) -> Self {
        GgufWeights {
            file,
            dtype,
            hybrid: None,
            gemma: false,
            gpt_oss: false,
        }
    }

    /// Reads the tensors of the model `config` describes: for the hybrid
    /// Qwen models, undoes the layout llama.cpp's converter gives them
    /// (see [`HybridLayout`]).
    pub fn for_model(mut self, config: &ModelConfig) -> Self {
        self.hybrid = HybridLayout::of(config);
        self.gemma = config.arch == Arch::Gemma3;
        self.gpt_oss = config.arch == Arch::GptOss;
        self
    }
}

/// How llama.cpp's converter (`Qwen3NextModel` and, for Qwen3.5, its
/// `_LinearAttentionVReorderBase`) rewrites a hybrid Qwen model's tensors,
/// which [`GgufWeights`] undoes so that the model reads transformers'
/// tensors:
///
/// - every RMSNorm weight but the Gated DeltaNet's gated one is stored as
///   `1 + w` (`attn_norm`, `post_attention_norm`, `output_norm`,
///   `attn_q_norm`, `attn_k_norm`);
/// - `A_log` is stored as `ssm_a` = `-exp(A_log)`, `dt_bias` as
///   `ssm_dt.bias`, the conv1d weight squeezed to `[channels, kernel]`;
/// - Qwen3-Next's `in_proj_qkvz` (q, k, v, z rows grouped by key head) is
///   split into `attn_qkv` (all q, all k, all v) and `attn_gate` (all z);
///   its `in_proj_ba` is kept as `ssm_ba`;
/// - Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` become
///   `attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`, and when there are
///   more value heads than key heads, every per-value-head row block (v
///   rows, z, b, a, A, dt, the conv1d's v channels) and `out_proj`'s
///   columns (`ssm_out`) go from grouped order (key head `k`'s value heads
///   together, head `k·r + j`) to tiled order (slot `j·n_k + k`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HybridLayout {
    n_k_heads: usize,
    n_v_heads: usize,
    k_dim: usize,
    v_dim: usize,
    /// Value heads stored in tiled order (Qwen3.5, Qwen3.5-MoE).
    tiled: bool,
}

impl HybridLayout {
    /// The layout of `config`'s model, if it is a hybrid Qwen one.
    pub fn of(config: &ModelConfig) -> Option<HybridLayout> {
        let h = config.hybrid.as_ref()?;
        Some(HybridLayout {
            n_k_heads: h.n_k_heads,
            n_v_heads: h.n_v_heads,
            k_dim: h.k_dim,
            v_dim: h.v_dim,
            tiled: matches!(config.arch, Arch::Qwen35 | Arch::Qwen35Moe)
                && h.n_v_heads != h.n_k_heads,
        })
    }

    /// Where value head `head` (transformers' order) is stored.
    fn slot(&self, head: usize) -> usize {
        if !self.tiled {
            return head;
        }
        let r = self.n_v_heads / self.n_k_heads;
        (head % r) * self.n_k_heads + head / r
    }

    /// The stored row ranges holding `n_v_heads` blocks of `block` rows
    /// from row `base` on, in transformers' head order.
    fn head_rows(&self, g: &str, base: usize, block: usize) -> Vec<(String, usize, usize)> {
        (0..self.n_v_heads)
            .map(|h| (g.to_string(), base + self.slot(h) * block, block))
            .collect()
    }

    /// Rows of `row_bytes` whose value heads take `head_bytes` each (whole
    /// blocks of their type), with the heads put in transformers' order.
    fn untile_blocks(&self, bytes: &[u8], row_bytes: usize, head_bytes: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len());
        for row in bytes.chunks(row_bytes) {
            for h in 0..self.n_v_heads {
                let at = self.slot(h) * head_bytes;
                out.extend_from_slice(&row[at..at + head_bytes]);
            }
        }
        out
    }

    /// `v` (one value per value head, or `block` per head) in
    /// transformers' head order.
    fn untile(&self, v: &[f32], block: usize) -> Vec<f32> {
        (0..self.n_v_heads)
            .flat_map(|h| {
                let s = self.slot(h) * block;
                v[s..s + block].iter().copied()
            })
            .collect()
    }
}

/// The GGUF name of a norm weight that llama.cpp's converter stores as
/// `1 + w` in the hybrid Qwen models.
fn hybrid_offset_norm(hf: &str) -> Option<String> {
    if hf == "model.norm.weight" {
        return Some("output_norm.weight".into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let g = match tail {
        "input_layernorm.weight" => "attn_norm",
        "post_attention_layernorm.weight" => "post_attention_norm",
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.weight"))
}

/// Gemma 3's norm `hf` as llama.cpp's converter (`Gemma3Model`) names it:
/// every RMSNorm weight (the sandwich norms, the q/k norms and the final
/// one) is stored as `1 + w`, which the reader takes off again.
fn gemma_norm(hf: &str) -> Option<String> {
    if hf == "model.norm.weight" {
        return Some("output_norm.weight".into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let g = match tail {
        "input_layernorm.weight" => "attn_norm",
        "post_attention_layernorm.weight" => "post_attention_norm",
        "pre_feedforward_layernorm.weight" => "ffn_norm",
        "post_feedforward_layernorm.weight" => "post_ffw_norm",
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.weight"))
}

/// The values of MXFP4 blocks as ggml stores them (type 39): per 32
/// values, one e8m0 scale byte `e` (the scale `2^(e - 127)`) and 16 bytes
/// of e2m1 codes, the low nibbles the first 16 values and the high nibbles
/// the next 16. A code's low 3 bits index {0, 0.5, 1, 1.5, 2, 3, 4, 6}, its
/// high bit is the sign. Exact in f32. `e = 255` (NaN in the OCP format)
/// is refused.
pub fn dequantize_mxfp4(blocks: &[u8]) -> Result<Vec<f32>> {
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    if !blocks.len().is_multiple_of(17) {
        bail!(
            "{} bytes of MXFP4 are not a whole number of 17-byte blocks",
            blocks.len()
        );
    }
    let value = |code: u8, scale: f32| {
        let v = E2M1[(code & 7) as usize] * scale;
        if code & 8 != 0 {
            -v
        } else {
            v
        }
    };
    let mut out = Vec::with_capacity(blocks.len() / 17 * 32);
    for (b, block) in blocks.chunks_exact(17).enumerate() {
        let e = block[0];
        if e == 255 {
            bail!("MXFP4 block {b} has the scale byte 255, which is NaN");
        }
        let scale = 2f64.powi(e as i32 - 127) as f32;
        let qs = &block[1..];
        out.extend(qs.iter().map(|&q| value(q & 0x0f, scale)));
        out.extend(qs.iter().map(|&q| value(q >> 4, scale)));
    }
    Ok(out)
}

/// gpt-oss's tensors that llama.cpp's converter (`GptOssModel`) names
/// otherwise than [`gguf_name`]: the sinks (`attn_sinks.weight`), the
/// pre-MLP norm (`post_attention_norm`), the router (`ffn_gate_inp`).
fn gpt_oss_name(hf: &str) -> Option<String> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let g = match tail {
        "self_attn.sinks" => "attn_sinks.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "mlp.router.weight" => "ffn_gate_inp.weight",
        "mlp.router.bias" => "ffn_gate_inp.bias",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// A hybrid Qwen model's Gated DeltaNet tensor (`model.layers.N.
/// linear_attn.X`) as its layer and `X`.
fn linear_attn_part(hf: &str) -> Option<(usize, &str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    Some((layer.parse().ok()?, tail.strip_prefix("linear_attn.")?))
}

/// Translates an HF tensor name into its GGUF name.
pub fn gguf_name(hf: &str) -> Option<String> {
    let direct = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(d) = direct {
        return Some(d.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = tail.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" | "block_sparse_moe.gate" if suffix == "weight" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        "mlp.shared_experts.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_experts.up_proj" => "ffn_up_shexp",
        "mlp.shared_experts.down_proj" => "ffn_down_shexp",
        "self_attn.q_a_proj" => "attn_q_a",
        "self_attn.q_a_layernorm" => "attn_q_a_norm",
        "self_attn.q_b_proj" => "attn_q_b",
        "self_attn.kv_a_proj_with_mqa" => "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm" => "attn_kv_a_norm",
        "self_attn.kv_b_proj" => "attn_kv_b",
        // DeepSeek-V3's router bias.
        "mlp.gate" if suffix == "e_score_correction_bias" => {
            return Some(format!("blk.{layer}.exp_probs_b.bias"))
        }
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Translates an HF expert tensor name (`model.layers.N.mlp.experts.E.
/// gate_proj.weight`, Mixtral's `block_sparse_moe.experts.E.w1.weight`)
/// into the GGUF tensor that stacks every expert's (`blk.N.ffn_gate_exps.
/// weight`) and the expert's index in it.
pub fn gguf_expert_name(hf: &str) -> Option<(String, usize)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let tail = tail
        .strip_prefix("mlp.experts.")
        .or_else(|| tail.strip_prefix("block_sparse_moe.experts."))?;
    let (expert, tail) = tail.split_once('.')?;
    let expert: usize = expert.parse().ok()?;
    let part = match tail {
        "gate_proj.weight" | "w1.weight" => "ffn_gate_exps",
        "up_proj.weight" | "w3.weight" => "ffn_up_exps",
        "down_proj.weight" | "w2.weight" => "ffn_down_exps",
        _ => return None,
    };
    Some((format!("blk.{layer}.{part}.weight"), expert))
}

impl GgufWeights<'_> {
    /// Expert `e`'s `[rows, cols]` slice of the stacked tensor `gname`
    /// (`[experts, rows, cols]`), in its storage type.
    fn expert_matrix(
        &self,
        gname: &str,
        e: usize,
        rows: usize,
        cols: usize,
    ) -> Result<HostMatrix<'_>> {
        let t = self.file.tensor(gname)?;
        let path = self.file.path().display();
        let [n, r, c] = t.shape[..] else {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, not [experts, rows, cols]",
                t.shape
            );
        };
        if (r, c) != (rows, cols) || e >= n {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, but the metadata implies expert {e} of [_, {rows}, {cols}]",
                t.shape
            );
        }
        let ctx = || format!("{path}: tensor '{gname}', expert {e}");
        let bytes = t.ty.row_bytes(cols).with_context(ctx)? * rows;
        let data = t
            .data
            .get(e * bytes..(e + 1) * bytes)
            .with_context(|| format!("{}: shorter than its shape", ctx()))?;
        self.convert(
            HostMatrix::new(t.ty, rows, cols, data).with_context(ctx)?,
            &ctx,
        )
    }

    /// Applies `--dtype` to a float matrix; quantized ones stay as stored.
    fn convert<'m>(
        &self,
        stored: HostMatrix<'m>,
        ctx: &dyn Fn() -> String,
    ) -> Result<HostMatrix<'m>> {
        let ty = stored.ty();
        let want = match self.dtype {
            DType::Auto => return Ok(stored),
            _ if !ty.is_float() => return Ok(stored),
            DType::Float32 => GgmlType::F32,
            DType::BFloat16 => GgmlType::BF16,
            DType::Float16 => GgmlType::F16,
        };
        if want == ty {
            return Ok(stored);
        }
        let values = stored.dequantize().with_context(ctx)?;
        HostMatrix::from_f32_as(want, stored.rows(), stored.cols(), &values).with_context(ctx)
    }
}

impl GgufWeights<'_> {
    /// HF's `kv_b_proj` (`[heads · (nope + v), rank]`) rebuilt from the
    /// halves llama.cpp's converter writes for MLA: `attn_k_b` (each head's
    /// key up-projection transposed, `[heads, rank, nope]`) and `attn_v_b`
    /// (`[heads, v, rank]`); exact, in f32.
    fn kv_b_from_halves(
        &self,
        layer: &str,
        rows: usize,
        rank: usize,
    ) -> Result<HostMatrix<'static>> {
        let path = self.file.path().display();
        let read = |g: &str| -> Result<(Vec<usize>, Vec<f32>)> {
            let t = self.file.tensor(g)?;
            let [h, r, c] = t.shape[..] else {
                bail!(
                    "{path}: tensor '{g}' has shape {:?}, not [heads, rows, cols]",
                    t.shape
                );
            };
            let m = HostMatrix::new(t.ty, h * r, c, t.data)
                .with_context(|| format!("{path}: tensor '{g}'"))?;
            Ok((vec![h, r, c], m.dequantize()?))
        };
        let (ks, k) = read(&format!("blk.{layer}.attn_k_b.weight"))?;
        let (vs, v) = read(&format!("blk.{layer}.attn_v_b.weight"))?;
        let (heads, nope, vd) = (ks[0], ks[2], vs[1]);
        if ks[1] != rank || vs[2] != rank || vs[0] != heads || heads * (nope + vd) != rows {
            bail!(
                "{path}: blk.{layer}.attn_k_b {ks:?} and attn_v_b {vs:?} do not make a kv_b_proj of [{rows}, {rank}] (kv_lora_rank {rank})"
            );
        }
        let mut out = vec![0f32; rows * rank];
        for h in 0..heads {
            let base = h * (nope + vd);
            for i in 0..nope {
                for j in 0..rank {
                    out[(base + i) * rank + j] = k[(h * rank + j) * nope + i];
                }
            }
            let src = &v[h * vd * rank..(h + 1) * vd * rank];
            out[(base + nope) * rank..(base + nope + vd) * rank].copy_from_slice(src);
        }
        Ok(HostMatrix::from_f32(rows, rank, &out)?)
    }
}

impl GgufWeights<'_> {
    /// The `[rows, cols]` matrix made of the listed row ranges (tensor,
    /// first row, rows) of stored `[_, cols]` tensors, in their type when
    /// they share one (whole rows of any block type move intact), else in
    /// f32.
    fn gather_rows(
        &self,
        parts: &[(String, usize, usize)],
        rows: usize,
        cols: usize,
    ) -> Result<HostMatrix<'static>> {
        let path = self.file.path().display();
        let mut stored = Vec::with_capacity(parts.len());
        for (g, r0, n) in parts {
            let t = self.file.tensor(g)?;
            let fits = match t.shape[..] {
                [r, c] => c == cols && r0 + n <= r,
                [c] => c == cols && r0 + n <= 1,
                _ => false,
            };
            if !fits {
                bail!(
                    "{path}: tensor '{g}' has shape {:?}, but the metadata implies rows {r0}..{} of [_, {cols}]",
                    t.shape,
                    r0 + n
                );
            }
            let r = t.shape.len().max(2) - 1;
            let m = HostMatrix::new(t.ty, t.shape[..r].iter().product(), cols, t.data)
                .with_context(|| format!("{path}: tensor '{g}'"))?;
            stored.push((m, *r0, *n));
        }
        if stored.iter().map(|(_, _, n)| n).sum::<usize>() != rows {
            bail!("{path}: the parts of a {rows}-row matrix add up to another number of rows");
        }
        let ty = stored
            .first()
            .map(|(m, ..)| m.ty())
            .unwrap_or(GgmlType::F32);
        if stored.iter().all(|(m, ..)| m.ty() == ty) {
            let per_row = ty.row_bytes(cols)?;
            let mut data = Vec::with_capacity(rows * per_row);
            for (m, r0, n) in &stored {
                data.extend_from_slice(&m.bytes()[r0 * per_row..(r0 + n) * per_row]);
            }
            return Ok(HostMatrix::new(ty, rows, cols, data)?);
        }
        let mut out = Vec::with_capacity(rows * cols);
        for (m, r0, n) in &stored {
            out.extend_from_slice(&m.dequantize()?[r0 * cols..(r0 + n) * cols]);
        }
        Ok(HostMatrix::from_f32(rows, cols, &out)?)
    }

    /// A hybrid Qwen model's Gated DeltaNet matrix `part` of `layer` in
    /// transformers' layout, rebuilt from the converter's (see
    /// [`HybridLayout`]); `None` for the tensors stored as transformers has
    /// them.
    fn hybrid_matrix(
        &self,
        l: &HybridLayout,
        layer: usize,
        part: &str,
        rows: usize,
        cols: usize,
    ) -> Option<Result<HostMatrix<'static>>> {
        let g = |s: &str| format!("blk.{layer}.{s}");
        let (kd, vd) = (l.n_k_heads * l.k_dim, l.n_v_heads * l.v_dim);
        let parts = match part {
            "in_proj_qkv.weight" => {
                let qkv = g("attn_qkv.weight");
                let mut p = vec![(qkv.clone(), 0, 2 * kd)];
                p.extend(l.head_rows(&qkv, 2 * kd, l.v_dim));
                p
            }
            "in_proj_z.weight" => l.head_rows(&g("attn_gate.weight"), 0, l.v_dim),
            "in_proj_b.weight" => l.head_rows(&g("ssm_beta.weight"), 0, 1),
            "in_proj_a.weight" => l.head_rows(&g("ssm_alpha.weight"), 0, 1),
            "conv1d.weight" => {
                let conv = g("ssm_conv1d.weight");
                let mut p = vec![(conv.clone(), 0, 2 * kd)];
                p.extend(l.head_rows(&conv, 2 * kd, l.v_dim));
                p
            }
            // Qwen3-Next: per key head, its q, k, v and z rows.
            "in_proj_qkvz.weight" => {
                let (qkv, z) = (g("attn_qkv.weight"), g("attn_gate.weight"));
                let rv = vd / l.n_k_heads;
                (0..l.n_k_heads)
                    .flat_map(|h| {
                        [
                            (qkv.clone(), h * l.k_dim, l.k_dim),
                            (qkv.clone(), kd + h * l.k_dim, l.k_dim),
                            (qkv.clone(), 2 * kd + h * rv, rv),
                            (z.clone(), h * rv, rv),
                        ]
                    })
                    .collect()
            }
            "in_proj_ba.weight" => vec![(g("ssm_ba.weight"), 0, rows)],
            "out_proj.weight" => {
                return Some(self.untiled_columns(l, &g("ssm_out.weight"), rows, cols))
            }
            _ => return None,
        };
        Some(self.gather_rows(&parts, rows, cols))
    }

    /// `ssm_out` (`[hidden, value heads · v_dim]`) with its columns back in
    /// transformers' head order. When a head's `v_dim` columns are whole
    /// blocks of the stored type (128 of Q8_0's or Q4_0's 32, as in the
    /// published models) the blocks move as they are, so the matrix stays
    /// quantized; where a head would cut through a block (the tiny fixtures'
    /// `v_dim` 16), it comes back in f32.
    fn untiled_columns(
        &self,
        l: &HybridLayout,
        gname: &str,
        rows: usize,
        cols: usize,
    ) -> Result<HostMatrix<'static>> {
        let path = self.file.path().display();
        let t = self.file.tensor(gname)?;
        if t.shape != [rows, cols] || cols != l.n_v_heads * l.v_dim {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, but the metadata implies {:?}",
                t.shape,
                [rows, l.n_v_heads * l.v_dim]
            );
        }
        let ctx = || format!("{path}: tensor '{gname}'");
        let stored = HostMatrix::new(t.ty, rows, cols, t.data).with_context(ctx)?;
        if !l.tiled {
            return Ok(HostMatrix::new(t.ty, rows, cols, stored.bytes().to_vec())?);
        }
        let bl = t.ty.block_len();
        if l.v_dim.is_multiple_of(bl) {
            // Each head's columns are `v_dim / bl` whole blocks of a row.
            let head_bytes = l.v_dim / bl * t.ty.block_bytes();
            let row_bytes = t.ty.row_bytes(cols).with_context(ctx)?;
            let out = l.untile_blocks(stored.bytes(), row_bytes, head_bytes);
            return Ok(HostMatrix::new(t.ty, rows, cols, out).with_context(ctx)?);
        }
        let w = stored.dequantize().with_context(ctx)?;
        let out: Vec<f32> = w.chunks(cols).flat_map(|r| l.untile(r, l.v_dim)).collect();
        Ok(match t.ty.is_float() {
            true => HostMatrix::from_f32_as(t.ty, rows, cols, &out),
            false => HostMatrix::from_f32(rows, cols, &out),
        }
        .with_context(ctx)?)
    }

    /// A 1-D tensor as f32, checked against `len`.
    fn stored_vector(&self, gname: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.file.tensor(gname)?;
        let path = self.file.path().display();
        if t.shape != [len] {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, but the metadata implies [{len}]",
                t.shape
            );
        }
        let v = HostMatrix::new(t.ty, 1, len, t.data)
            .and_then(|m| m.dequantize())
            .with_context(|| format!("{path}: tensor '{gname}'"))?;
        Ok(v)
    }

    /// A hybrid Qwen model's vector `name` as transformers has it; `None`
    /// for the ones stored unchanged.
    fn hybrid_vector(&self, l: &HybridLayout, name: &str, len: usize) -> Option<Result<Vec<f32>>> {
        if let Some(g) = hybrid_offset_norm(name) {
            // Stored as fl(1 + w): for weights in [-0.5, 1] taking the 1
            // off is exact (Sterbenz), and the model adds it back.
            return Some(
                self.stored_vector(&g, len)
                    .map(|v| v.into_iter().map(|x| x - 1.0).collect()),
            );
        }
        let (layer, part) = linear_attn_part(name)?;
        let g = |s: &str| format!("blk.{layer}.{s}");
        let per_head = |gname: String| -> Result<Vec<f32>> {
            if len != l.n_v_heads {
                bail!(
                    "{name}: {len} values, not one per value head ({})",
                    l.n_v_heads
                );
            }
            Ok(l.untile(&self.stored_vector(&gname, len)?, 1))
        };
        Some(match part {
            // ssm_a = -exp(A_log).
            "A_log" => per_head(g("ssm_a")).and_then(|a| {
                a.iter()
                    .map(|&a| match a < 0.0 && a.is_finite() {
                        true => Ok((-(a as f64)).ln() as f32),
                        false => bail!(
                            "{}: tensor '{}' holds {a}; llama.cpp's converter writes -exp(A_log), which is negative",
                            self.file.path().display(),
                            g("ssm_a")
                        ),
                    })
                    .collect()
            }),
            "dt_bias" => per_head(g("ssm_dt.bias")),
            "norm.weight" => self.stored_vector(&g("ssm_norm.weight"), len),
            _ => return None,
        })
    }
}

impl GgufWeights<'_> {
    /// The stored tensor `gname` of exactly `shape` as f32 values.
    fn stored_stack(&self, gname: &str, shape: &[usize]) -> Result<(Vec<f32>, GgmlType)> {
        let path = self.file.path().display();
        // MXFP4 experts (gpt-oss as published): dequantized here, served
        // in f32.
        if let Some((stored, data)) = self.file.mxfp4_tensor(gname) {
            if stored != shape {
                bail!("{path}: tensor '{gname}' has shape {stored:?}, but the metadata implies {shape:?}");
            }
            let v = dequantize_mxfp4(data)
                .with_context(|| format!("{path}: MXFP4 tensor '{gname}'"))?;
            return Ok((v, GgmlType::F32));
        }
        let t = self.file.tensor(gname)?;
        if t.shape != shape {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, but the metadata implies {shape:?}",
                t.shape
            );
        }
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape.iter().product::<usize>() / cols.max(1);
        let v = HostMatrix::new(t.ty, rows, cols, t.data)
            .and_then(|m| m.dequantize())
            .with_context(|| format!("{path}: tensor '{gname}'"))?;
        Ok((v, t.ty))
    }

    /// gpt-oss's fused experts as transformers stores them (see
    /// `SparseMoe::load_fused`), rebuilt from the converter's split:
    /// `ffn_gate_exps`/`ffn_up_exps` (`[experts, ffn, hidden]`, the fused
    /// matrix's even and odd columns, transposed), their biases (`[experts,
    /// ffn]`), `ffn_down_exps` (`[experts, hidden, ffn]`, transposed) and
    /// its bias. Exact (values only move).
    fn gpt_oss_stacked(&self, name: &str, shape: &[usize]) -> Option<Result<(Vec<f32>, GgmlType)>> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, tail) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        if !tail.starts_with("mlp.experts.") {
            return None;
        }
        let g = |s: &str| format!("blk.{layer}.{s}");
        let want = |n: usize| -> Result<()> {
            if shape.len() != n {
                bail!("tensor '{name}': asked for {shape:?}, not {n} dimensions");
            }
            Ok(())
        };
        let ty_of = |a: GgmlType, b: GgmlType| {
            if a == b && a.is_float() {
                a
            } else {
                GgmlType::F32
            }
        };
        Some((|| -> Result<(Vec<f32>, GgmlType)> {
            match tail {
                "mlp.experts.gate_up_proj" => {
                    want(3)?;
                    let (e, d, f2) = (shape[0], shape[1], shape[2]);
                    let f = f2 / 2;
                    let (gate, gt) = self.stored_stack(&g("ffn_gate_exps.weight"), &[e, f, d])?;
                    let (up, ut) = self.stored_stack(&g("ffn_up_exps.weight"), &[e, f, d])?;
                    let mut out = vec![0f32; e * d * f2];
                    for x in 0..e {
                        for j in 0..f {
                            for k in 0..d {
                                let o = x * d * f2 + k * f2 + 2 * j;
                                out[o] = gate[(x * f + j) * d + k];
                                out[o + 1] = up[(x * f + j) * d + k];
                            }
                        }
                    }
                    Ok((out, ty_of(gt, ut)))
                }
                "mlp.experts.gate_up_proj_bias" => {
                    want(2)?;
                    let (e, f) = (shape[0], shape[1] / 2);
                    let (gate, gt) = self.stored_stack(&g("ffn_gate_exps.bias"), &[e, f])?;
                    let (up, ut) = self.stored_stack(&g("ffn_up_exps.bias"), &[e, f])?;
                    let out = (0..e * f).flat_map(|i| [gate[i], up[i]]).collect();
                    Ok((out, ty_of(gt, ut)))
                }
                "mlp.experts.down_proj" => {
                    want(3)?;
                    let (e, f, d) = (shape[0], shape[1], shape[2]);
                    let (down, ty) = self.stored_stack(&g("ffn_down_exps.weight"), &[e, d, f])?;
                    let mut out = vec![0f32; e * f * d];
                    for x in 0..e {
                        for n in 0..d {
                            for j in 0..f {
                                out[(x * f + j) * d + n] = down[(x * d + n) * f + j];
                            }
                        }
                    }
                    Ok((out, ty_of(ty, ty)))
                }
                "mlp.experts.down_proj_bias" => {
                    want(2)?;
                    self.stored_stack(&g("ffn_down_exps.bias"), shape)
                }
                _ => bail!("tensor '{name}' is not one of gpt-oss's fused expert tensors"),
            }
        })())
    }
}

impl WeightSource for GgufWeights<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>> {
        if let Some(l) = &self.hybrid {
            if let Some((layer, part)) = linear_attn_part(name) {
                if let Some(m) = self.hybrid_matrix(l, layer, part, rows, cols) {
                    let m = m.with_context(|| format!("tensor '{name}'"))?;
                    return self.convert(m, &|| format!("{}: tensor '{name}'", self.describe()));
                }
            }
        }
        if let Some((gname, e)) = gguf_expert_name(name) {
            return self.expert_matrix(&gname, e, rows, cols);
        }
        if let Some(gname) = gpt_oss_name(name).filter(|_| self.gpt_oss) {
            let t = self.file.tensor(&gname)?;
            let path = self.file.path().display();
            if t.shape != [rows, cols] {
                bail!(
                    "{path}: tensor '{gname}' has shape {:?}, but the metadata implies {:?}",
                    t.shape,
                    [rows, cols]
                );
            }
            let ctx = || format!("{path}: tensor '{gname}'");
            let stored = HostMatrix::new(t.ty, rows, cols, t.data).with_context(ctx)?;
            return self.convert(stored, &ctx);
        }
        if let Some(layer) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.strip_suffix(".self_attn.kv_b_proj.weight"))
        {
            if !self.contains(name) {
                return self.kv_b_from_halves(layer, rows, cols);
            }
        }
        let gname = gguf_name(name).with_context(|| format!("no GGUF name for tensor '{name}'"))?;
        let t = self.file.tensor(&gname)?;
        let path = self.file.path().display();
        // Gemma 3: the converter keeps only the embedding rows of the
        // tokenizer's tokens; the rows past them (which no token of the
        // tokenizer looks up) come back as zeros.
        if self.gemma && gname == "token_embd.weight" {
            if let [r, c] = t.shape[..] {
                if c == cols && r < rows {
                    let ctx = || format!("{path}: tensor '{gname}' ({r} of {rows} rows)");
                    let per_row = t.ty.row_bytes(cols).with_context(ctx)?;
                    let mut data = t
                        .data
                        .get(..r * per_row)
                        .with_context(|| format!("{}: shorter than its shape", ctx()))?
                        .to_vec();
                    data.resize(rows * per_row, 0);
                    let m = HostMatrix::new(t.ty, rows, cols, data).with_context(ctx)?;
                    return self.convert(m, &ctx);
                }
            }
        }
        // A one-row matrix may be stored as a vector (the shared expert's
        // gate, `ffn_gate_inp_shexp`).
        if t.shape != [rows, cols] && !(rows == 1 && t.shape == [cols]) {
            bail!(
                "{path}: tensor '{gname}' has shape {:?}, but the metadata implies {:?}",
                t.shape,
                [rows, cols]
            );
        }
        let ctx = || format!("{path}: tensor '{gname}'");
        let stored = HostMatrix::new(t.ty, rows, cols, t.data).with_context(ctx)?;
        self.convert(stored, &ctx)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        if let Some(g) = gpt_oss_name(name).filter(|_| self.gpt_oss) {
            return self.stored_vector(&g, len);
        }
        if self.gemma {
            if let Some(g) = gemma_norm(name) {
                // Stored as fl(1 + w); see `hybrid_vector`.
                return Ok(self
                    .stored_vector(&g, len)?
                    .into_iter()
                    .map(|x| x - 1.0)
                    .collect());
            }
        }
        if let Some(l) = &self.hybrid {
            if let Some(v) = self.hybrid_vector(l, name, len) {
                return v;
            }
        }
        let gname = gguf_name(name).with_context(|| format!("no GGUF name for tensor '{name}'"))?;
        self.stored_vector(&gname, len)
    }

    fn stacked(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, GgmlType)> {
        match self.gpt_oss_stacked(name, shape).filter(|_| self.gpt_oss) {
            Some(r) => {
                let (v, ty) = r.with_context(|| self.describe())?;
                let ty = match self.dtype {
                    DType::Auto => ty,
                    DType::Float32 => GgmlType::F32,
                    DType::BFloat16 => GgmlType::BF16,
                    DType::Float16 => GgmlType::F16,
                };
                Ok((v, ty))
            }
            None => bail!(
                "{}: tensor '{name}' is a stack of matrices, which this GGUF file does not provide",
                self.describe()
            ),
        }
    }

    /// gpt-oss's experts where the file stores them as MXFP4 (ggml type
    /// 39, `llama-quantize … MXFP4_MOE`): the blocks are already in the
    /// layout of `GgmlType::MXFP4`, so they stay 4-bit; only rows move
    /// (the gate and up rows interleave again as the fused checkpoint
    /// matrix has them), like quantized tensors under any `--dtype`.
    /// `None` where the file stores them otherwise.
    fn mxfp4_stack(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<u8>>> {
        if !self.gpt_oss {
            return Ok(None);
        }
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return Ok(None);
        };
        let Some((layer, tail)) = rest.split_once('.') else {
            return Ok(None);
        };
        let Ok(layer) = layer.parse::<usize>() else {
            return Ok(None);
        };
        let g = |s: &str| format!("blk.{layer}.{s}");
        let path = self.file.path().display();
        let row_bytes = |c: usize| -> Result<usize> {
            if !c.is_multiple_of(32) {
                bail!(
                    "{path}: tensor '{name}': {c} input features are not whole MXFP4 blocks of 32"
                );
            }
            Ok(c / 32 * 17)
        };
        // The stored stack `gname` of `[n, r, cols]`, checked, if MXFP4.
        let stored = |gname: &str, r: usize| -> Result<Option<&[u8]>> {
            let t = self.file.tensor(gname)?;
            if t.ty != GgmlType::MXFP4 {
                return Ok(None);
            }
            if t.shape != [n, r, cols] {
                bail!(
                    "{path}: tensor '{gname}' has shape {:?}, but the metadata implies {:?}",
                    t.shape,
                    [n, r, cols]
                );
            }
            if t.data.len() != n * r * row_bytes(cols)? {
                bail!(
                    "{path}: MXFP4 tensor '{gname}' holds {} bytes, not {n}×{r} rows of {cols}",
                    t.data.len()
                );
            }
            if let Some(b) = t.data.chunks_exact(17).position(|b| b[0] == 255) {
                bail!("{path}: MXFP4 tensor '{gname}': block {b} has the scale byte 255, which is NaN");
            }
            Ok(Some(t.data))
        };
        match tail {
            "mlp.experts.gate_up_proj" => {
                if !rows.is_multiple_of(2) {
                    bail!("{path}: tensor '{name}': {rows} fused gate and up rows are not even");
                }
                let f = rows / 2;
                let (Some(gate), Some(up)) = (
                    stored(&g("ffn_gate_exps.weight"), f)?,
                    stored(&g("ffn_up_exps.weight"), f)?,
                ) else {
                    return Ok(None);
                };
                let rb = row_bytes(cols)?;
                let mut out = Vec::with_capacity(n * rows * rb);
                for (gr, ur) in gate.chunks_exact(rb).zip(up.chunks_exact(rb)) {
                    out.extend_from_slice(gr);
                    out.extend_from_slice(ur);
                }
                Ok(Some(out))
            }
            "mlp.experts.down_proj" => {
                Ok(stored(&g("ffn_down_exps.weight"), rows)?.map(<[u8]>::to_vec))
            }
            _ => Ok(None),
        }
    }

    fn contains(&self, name: &str) -> bool {
        if let Some(g) = gpt_oss_name(name).filter(|_| self.gpt_oss) {
            return self.file.tensors().iter().any(|t| t.name == g);
        }
        if let Some((g, e)) = gguf_expert_name(name) {
            return self
                .file
                .tensors()
                .iter()
                .any(|t| t.name == g && t.shape.first().is_some_and(|&n| e < n));
        }
        gguf_name(name).is_some_and(|g| self.file.tensors().iter().any(|t| t.name == g))
    }

    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::{dequantize_mxfp4, gguf_name, HybridLayout};

    /// Hand-computed blocks: scale byte 128 (2^1) with codes 0..15 in the
    /// low nibbles and 15 - j in the high ones; scale byte 125 (2^-2) with
    /// code 0x7 (6) and 0xB (-1.5).
    #[test]
    fn mxfp4_blocks_dequantize_to_hand_computed_values() {
        let mut block = vec![128u8];
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize_mxfp4(&block).expect("block");
        let want_lo = [
            0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0,
            -12.0,
        ];
        let want_hi: Vec<f32> = want_lo.iter().rev().copied().collect();
        assert_eq!(&v[..16], &want_lo);
        assert_eq!(&v[16..], &want_hi[..]);
        let mut second = vec![125u8];
        second.extend([0xB7u8; 16]);
        let v = dequantize_mxfp4(&second).expect("block");
        assert!(v[..16].iter().all(|&x| x == 1.5));
        assert!(v[16..].iter().all(|&x| x == -0.375));
        assert!(dequantize_mxfp4(&block[..16]).is_err());
        let mut nan = block.clone();
        nan[0] = 255;
        assert!(dequantize_mxfp4(&nan).is_err());
    }

    /// The converter's reorder: the value-head axis viewed as
    /// `[n_k, r, …]` and transposed to `[r, n_k, …]`; with 2 key heads and
    /// 3 value heads each, transformers' heads 0..6 land in slots
    /// 0, 2, 4, 1, 3, 5.
    #[test]
    fn value_heads_go_from_grouped_to_tiled_slots() {
        let l = HybridLayout {
            n_k_heads: 2,
            n_v_heads: 6,
            k_dim: 4,
            v_dim: 2,
            tiled: true,
        };
        let slots: Vec<usize> = (0..6).map(|h| l.slot(h)).collect();
        assert_eq!(slots, [0, 2, 4, 1, 3, 5]);
        // Stored (tiled) per-head values [h0, h3, h1, h4, h2, h5] read back
        // in transformers' order.
        let stored = [0.0, 3.0, 1.0, 4.0, 2.0, 5.0];
        assert_eq!(l.untile(&stored, 1), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let grouped = HybridLayout { tiled: false, ..l };
        assert_eq!(grouped.untile(&stored, 1), stored);
    }

    /// A quantized `ssm_out` whose heads are whole Q8_0 blocks is put back
    /// in order block by block: what it then holds is the untiled matrix,
    /// still in Q8_0.
    #[test]
    fn whole_quantized_blocks_are_untiled_without_dequantizing() {
        use pagoda_accel::{GgmlType, HostMatrix};
        let l = HybridLayout {
            n_k_heads: 2,
            n_v_heads: 4,
            k_dim: 4,
            v_dim: 32,
            tiled: true,
        };
        let (rows, cols) = (3, 4 * 32);
        let ty = GgmlType::Q8_0;
        let row_bytes = ty.row_bytes(cols).expect("whole blocks");
        // Each block: an f16 scale (1, 2, ...) and 32 distinct codes.
        let mut bytes = Vec::new();
        for b in 0..rows * cols / 32 {
            let scale = half::f16::from_f32(1.0 + b as f32);
            bytes.extend_from_slice(&scale.to_le_bytes());
            bytes.extend((0..32).map(|i| ((i as i32 * 7 + b as i32) % 100 - 50) as i8 as u8));
        }
        let stored = HostMatrix::new(ty, rows, cols, bytes.clone()).expect("Q8_0");
        let want: Vec<f32> = stored
            .dequantize()
            .expect("dequantize")
            .chunks(cols)
            .flat_map(|r| l.untile(r, l.v_dim))
            .collect();
        // One Q8_0 block of 32 per head.
        let moved = l.untile_blocks(&bytes, row_bytes, ty.block_bytes());
        let got = HostMatrix::new(ty, rows, cols, moved).expect("Q8_0");
        assert_eq!(got.dequantize().expect("dequantize"), want);
    }

    #[test]
    fn maps_hf_names_to_gguf_names() {
        assert_eq!(
            gguf_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(
            gguf_name("model.layers.12.self_attn.q_proj.bias").as_deref(),
            Some("blk.12.attn_q.bias")
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(
            gguf_name("model.layers.3.mlp.shared_expert_gate.weight").as_deref(),
            Some("blk.3.ffn_gate_inp_shexp.weight")
        );
        assert_eq!(
            super::gguf_expert_name("model.layers.2.mlp.experts.7.down_proj.weight"),
            Some(("blk.2.ffn_down_exps.weight".to_string(), 7))
        );
        assert_eq!(
            super::gguf_expert_name("model.layers.0.block_sparse_moe.experts.1.w3.weight"),
            Some(("blk.0.ffn_up_exps.weight".to_string(), 1))
        );
    }
}
