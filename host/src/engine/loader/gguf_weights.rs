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
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

impl WeightSource for GgufWeights<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>> {
        let gname = gguf_name(name).with_context(|| format!("no GGUF name for tensor '{name}'"))?;
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
        let want = match self.dtype {
            DType::Auto => return Ok(stored),
            _ if !t.ty.is_float() => return Ok(stored),
            DType::Float32 => GgmlType::F32,
            DType::BFloat16 => GgmlType::BF16,
            DType::Float16 => GgmlType::F16,
        };
        if want == t.ty {
            return Ok(stored);
        }
        let values = stored.dequantize().with_context(ctx)?;
        HostMatrix::from_f32_as(want, rows, cols, &values).with_context(ctx)
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
    }
}
