//! [`WeightSource`] over a GGUF file: maps the HF tensor names the model
//! asks for onto GGUF's (`blk.N.attn_q.weight`, …).

use super::gguf::GgufFile;
use super::{DType, WeightSource};
use anyhow::{bail, Context, Result};
use pagoda_accel::{GgmlType, HostMatrix};

/// A GGUF file seen as a source of named weights.
pub struct GgufWeights<'a> {
    file: &'a GgufFile,
    dtype: DType,
}

impl<'a> GgufWeights<'a> {
    /// `dtype` converts float tensors; quantized tensors always stay as
    /// stored (each backend lays them out for its kernels at upload).
    pub fn new(file: &'a GgufFile, dtype: DType) -> Self {
        GgufWeights { file, dtype }
    }
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

impl WeightSource for GgufWeights<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>> {
        if let Some((gname, e)) = gguf_expert_name(name) {
            return self.expert_matrix(&gname, e, rows, cols);
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
        let gname = gguf_name(name).with_context(|| format!("no GGUF name for tensor '{name}'"))?;
        let t = self.file.tensor(&gname)?;
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

    fn contains(&self, name: &str) -> bool {
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
    use super::gguf_name;

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
