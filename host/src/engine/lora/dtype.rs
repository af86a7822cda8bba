//! `--lora-dtype`: the storage type of adapters' factors on the device.

use anyhow::{bail, Result};
use pagoda_accel::GgmlType;

/// How adapters' factors are stored (vLLM's `--lora-dtype`). Arithmetic is
/// f32 whatever the storage: a half type only rounds the factors once, at
/// upload, and halves the bytes a decode step streams for them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoraDtype {
    /// The base model's own float type (f32, bf16 or f16); bf16 beside a
    /// quantized base, as vLLM runs quantized models in a half type.
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl LoraDtype {
    /// vLLM's spellings: `auto`, `bfloat16`, `float16`, `float32` (and
    /// `bf16`, `half`, `fp16`, `f32`, `float`).
    pub fn parse(s: &str) -> Result<LoraDtype> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => LoraDtype::Auto,
            "bfloat16" | "bf16" => LoraDtype::Bf16,
            "float16" | "half" | "fp16" | "f16" => LoraDtype::F16,
            "float32" | "float" | "fp32" | "f32" => LoraDtype::F32,
            other => bail!("--lora-dtype {other}: expected auto, bfloat16, float16 or float32"),
        })
    }

    /// The storage type beside a base whose projections are `base`.
    pub fn resolve(self, base: GgmlType) -> GgmlType {
        match self {
            LoraDtype::Auto => match base {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => base,
                _ => GgmlType::BF16,
            },
            LoraDtype::F32 => GgmlType::F32,
            LoraDtype::Bf16 => GgmlType::BF16,
            LoraDtype::F16 => GgmlType::F16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_a_float_base_and_halves_beside_a_quantized_one() {
        let auto = LoraDtype::parse("auto").unwrap();
        assert_eq!(auto.resolve(GgmlType::F32), GgmlType::F32);
        assert_eq!(auto.resolve(GgmlType::F16), GgmlType::F16);
        assert_eq!(auto.resolve(GgmlType::Q4_1), GgmlType::BF16);
        assert_eq!(
            LoraDtype::parse("float32").unwrap().resolve(GgmlType::Q4_1),
            GgmlType::F32
        );
        assert_eq!(
            LoraDtype::parse("bfloat16").unwrap().resolve(GgmlType::F32),
            GgmlType::BF16
        );
        let e = LoraDtype::parse("int8").unwrap_err().to_string();
        assert!(e.contains("--lora-dtype int8"), "{e}");
    }
}
