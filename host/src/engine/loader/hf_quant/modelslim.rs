//! Ascend ModelSlim (msModelSlim) W8A8 checkpoints, as vllm-ascend loads
//! them (`--quantization ascend`).
//!
//! `quant_model_description.json` names the scheme (`model_quant_type`:
//! `W8A8` or `W8A8_DYNAMIC`) and the type of every tensor (`W8A8`,
//! `W8A8_DYNAMIC`, or `FLOAT` for layers left dense). Per quantized linear
//! layer `p`, `p.weight` is I8 `[out, in]` and
//!
//! - static `W8A8`: `p.input_scale` and `p.input_offset` (one value each:
//!   the input is quantized as `x_q = clamp(round(x / input_scale +
//!   input_offset), −128, 127)`), `p.deq_scale` `[out]` (F32, or I64
//!   holding the f32's bits, as ModelSlim writes it for f16 models) and
//!   `p.quant_bias` I32 `[out]`; the NPU computes `y = deq_scale · (x_q ·
//!   w + quant_bias)`, the offset's correction and any float bias folded
//!   into `quant_bias`;
//! - `W8A8_DYNAMIC`: `p.weight_scale` and `p.weight_offset` `[out, 1]`;
//!   the input is quantized per token at run time, and `y = x · ((w −
//!   weight_offset) · weight_scale)`.
//!
//! In Pagoda's terms the static weight is `w · deq_scale / input_scale`
//! (the scale per row, outside the blocks), the input is rounded onto the
//! same grid as on the NPU, and `deq_scale · (input_offset · Σ_k w +
//! quant_bias)` is the bias added after the product.

use super::{IntLinear, TensorStore, LANE};
use anyhow::{bail, Context, Result};
use pagoda_accel::{Affine, StaticActQuant};
use serde_json::Value;
use std::collections::HashMap;

/// The description file next to the weights.
pub(super) const DESCRIPTION: &str = "quant_model_description.json";

/// How one tensor is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Static,
    Dynamic,
    Float,
}

/// A ModelSlim checkpoint's description.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSlim {
    /// The model-wide type (what layers without an entry get).
    default: Kind,
    /// `{prefix}.weight` → its type.
    tensors: HashMap<String, Kind>,
}

fn kind(s: &str) -> Result<Kind> {
    Ok(match s {
        "W8A8" => Kind::Static,
        "W8A8_DYNAMIC" => Kind::Dynamic,
        "FLOAT" => Kind::Float,
        other => {
            bail!("ModelSlim type '{other}' is not supported (W8A8, W8A8_DYNAMIC and FLOAT are)")
        }
    })
}

impl ModelSlim {
    /// Reads `model_quant_type` and the per-tensor types of the weights.
    pub fn from_description(d: &Value) -> Result<ModelSlim> {
        let obj = d.as_object().context("not a JSON object")?;
        let default = kind(
            obj.get("model_quant_type")
                .and_then(Value::as_str)
                .context("'model_quant_type' is missing")?,
        )?;
        let mut tensors = HashMap::new();
        for (name, v) in obj {
            if let (Some(prefix), Some(s)) = (name.strip_suffix(".weight"), v.as_str()) {
                tensors.insert(
                    prefix.to_string(),
                    kind(s).with_context(|| format!("entry '{name}'"))?,
                );
            }
        }
        Ok(ModelSlim { default, tensors })
    }

    pub(super) fn describe(&self) -> String {
        match self.default {
            Kind::Static => "ModelSlim W8A8 (static input scales)".to_string(),
            Kind::Dynamic => "ModelSlim W8A8_DYNAMIC".to_string(),
            Kind::Float => "ModelSlim FLOAT".to_string(),
        }
    }

    fn kind_of(&self, prefix: &str) -> Kind {
        self.tensors.get(prefix).copied().unwrap_or(self.default)
    }

    pub(super) fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<IntLinear>> {
        let k = self.kind_of(prefix);
        if k == Kind::Float {
            return Ok(None);
        }
        if cols % LANE != 0 {
            bail!("{prefix}: {cols} input features are not a multiple of 32, which Pagoda's int8 blocks need");
        }
        let w = store.require(&format!("{prefix}.weight"))?;
        w.expect_shape(&[rows, cols])?;
        let w = w.i8s().with_context(|| {
            format!("{DESCRIPTION} says '{prefix}.weight' is {k:?} W8A8, so it must be int8")
        })?;
        let codes: Vec<u8> = w.iter().map(|&q| (q as i32 + 128) as u8).collect();
        let lanes = cols / LANE;
        let per_row = |name: &str| -> Result<Vec<f32>> {
            let t = store.require(&format!("{prefix}.{name}"))?;
            if t.shape != [rows, 1] && t.shape != [rows] {
                t.expect_shape(&[rows, 1])?;
            }
            t.f32s()
        };
        let (zeros, affine) = match k {
            Kind::Dynamic => {
                let offset = per_row("weight_offset")?;
                if let Some(o) = offset.iter().find(|o| o.fract() != 0.0) {
                    bail!("tensor '{prefix}.weight_offset' holds {o}, not an integer");
                }
                let zeros = (0..rows * lanes)
                    .map(|i| 128 + offset[i / lanes] as i32)
                    .collect();
                let affine = Affine {
                    out_scale: Some(per_row("weight_scale")?),
                    ..Affine::default()
                };
                (zeros, affine)
            }
            _ => {
                let input_scale = store.require(&format!("{prefix}.input_scale"))?.scalar()?;
                let input_offset = store.require(&format!("{prefix}.input_offset"))?.scalar()?;
                let deq = store.require(&format!("{prefix}.deq_scale"))?;
                if deq.shape != [rows] {
                    deq.expect_shape(&[rows])?;
                }
                let deq: Vec<f32> = match deq.dtype {
                    // The f32's bit pattern in the low half of each int64.
                    safetensors::Dtype::I64 => deq
                        .data
                        .chunks_exact(8)
                        .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                        .collect(),
                    _ => deq.f32s()?,
                };
                let qb = store.require(&format!("{prefix}.quant_bias"))?;
                qb.expect_shape(&[rows])?;
                let qb = qb.i32s()?;
                if !(input_scale.is_finite() && input_scale > 0.0) {
                    bail!("tensor '{prefix}.input_scale' is {input_scale}; it must be positive");
                }
                let bias = (0..rows)
                    .map(|n| {
                        let sum: i64 = w[n * cols..(n + 1) * cols].iter().map(|&q| q as i64).sum();
                        deq[n] * (input_offset as i64 * sum + qb[n] as i64) as f32
                    })
                    .collect();
                let affine = Affine {
                    act_quant: Some(StaticActQuant {
                        scale: input_scale,
                        offset: input_offset,
                    }),
                    out_scale: Some(deq.iter().map(|&d| d / input_scale).collect()),
                    out_bias: Some(bias),
                    ..Affine::default()
                };
                (vec![128; rows * lanes], affine)
            }
        };
        Ok(Some(IntLinear {
            rows,
            cols,
            bits: 8,
            codes,
            scales: vec![1.0; rows * lanes],
            zeros,
            affine,
        }))
    }

    /// Zeros for the float bias `name` (`….q_proj.bias`) of a static W8A8
    /// layer that has none: ModelSlim folds the bias into `quant_bias`.
    pub(super) fn folded_bias(
        &self,
        store: &dyn TensorStore,
        name: &str,
        len: usize,
    ) -> Result<Option<Vec<f32>>> {
        let Some(prefix) = name.strip_suffix(".bias") else {
            return Ok(None);
        };
        if self.kind_of(prefix) == Kind::Static
            && store.raw(&format!("{prefix}.quant_bias"))?.is_some()
        {
            return Ok(Some(vec![0.0; len]));
        }
        Ok(None)
    }
}
