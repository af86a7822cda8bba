//! AWQ checkpoints (AutoAWQ's GEMM layout, as vLLM loads them).
//!
//! Per linear layer `p`, 4-bit, groups of `g` input features:
//! - `p.qweight`: I32 `[in, out / 8]`, packed along the output in AWQ's
//!   nibble order: nibble `i` (bits `4i`) of word `(k, c)` holds output
//!   `8c + ORDER[i]`, `ORDER = [0, 2, 4, 6, 1, 3, 5, 7]` (the order AWQ's
//!   GEMM kernel dequantizes eight values in);
//! - `p.qzeros`: I32 `[in / g, out / 8]`, the same packing;
//! - `p.scales`: `[in / g, out]` (F16).
//!
//! Value: `w[n][k] = scales[k / g][n] · (q[k][n] − zero[k / g][n])`.
//!
//! `modules_to_not_convert` names layers kept in float: a module is skipped
//! when one of its entries occurs in its name, as vLLM checks it.

use super::{bool_field, int_field, IntLinear, TensorStore, LANE};
use anyhow::{bail, Context, Result};
use pagoda_accel::Affine;
use serde_json::Value;

/// Which output of its word each nibble holds.
const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// An AWQ `quantization_config` (or `quant_config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct Awq {
    pub group_size: usize,
    /// `modules_to_not_convert`.
    pub skip: Vec<String>,
}

impl Awq {
    /// Reads `bits` (`w_bit`), `group_size` (`q_group_size`), `zero_point`
    /// and `version`.
    pub fn from_config(q: &Value) -> Result<Awq> {
        let bits = int_field(q, &["bits", "w_bit"])?.context("'bits' is missing")?;
        if bits != 4 {
            bail!("AWQ with bits = {bits} is not supported: AWQ checkpoints are 4-bit");
        }
        let group_size = match int_field(q, &["group_size", "q_group_size"])? {
            Some(g) if g > 0 => g as usize,
            Some(g) => bail!("'group_size' {g} must be positive"),
            None => bail!("'group_size' is missing"),
        };
        if !bool_field(q, "zero_point", true)? {
            bail!("AWQ without zero points (zero_point: false) is not supported");
        }
        match q.get("version").and_then(Value::as_str).map(str::to_ascii_lowercase) {
            None => {}
            Some(v) if v == "gemm" => {}
            Some(v) => bail!(
                "AWQ version '{v}' is not supported: Pagoda reads the GEMM layout (version 'gemm'), which AutoAWQ writes by default"
            ),
        }
        let skip = match q.get("modules_to_not_convert") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .context("'modules_to_not_convert' entries must be strings")
                })
                .collect::<Result<_>>()?,
            Some(v) => bail!("'modules_to_not_convert' must be a list, got {v}"),
        };
        Ok(Awq { group_size, skip })
    }

    pub(super) fn describe(&self) -> String {
        format!("awq int4, group {}", self.group_size)
    }

    pub(super) fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<IntLinear>> {
        let skipped = self.skip.iter().any(|m| prefix.contains(m.as_str()));
        let Some(qweight) =
            super::quantized_or_dense(store, prefix, "qweight", skipped, &self.describe())?
        else {
            return Ok(None);
        };
        let g = self.group_size;
        IntLinear::check_group(prefix, cols, g)?;
        if rows % 8 != 0 {
            bail!("{prefix}: {rows} output features do not pack 8 to an int32");
        }
        let (words_per_row, groups) = (rows / 8, cols / g);
        qweight.expect_shape(&[cols, words_per_row])?;
        let qzeros = store.require(&format!("{prefix}.qzeros"))?;
        qzeros.expect_shape(&[groups, words_per_row])?;
        let scales = store.require(&format!("{prefix}.scales"))?;
        scales.expect_shape(&[groups, rows])?;
        let scales = scales.f32s()?;
        // Unpacks a [n_in, out / 8] word tensor into [n_in, out] codes.
        let unpack = |words: Vec<i32>| -> Vec<u8> {
            let mut out = vec![0u8; words.len() * 8];
            for (i, &w) in words.iter().enumerate() {
                let (row, c) = (i / words_per_row, i % words_per_row);
                for (nib, &o) in ORDER.iter().enumerate() {
                    out[row * rows + 8 * c + o] = ((w as u32 >> (4 * nib)) & 15) as u8;
                }
            }
            out
        };
        let q = unpack(qweight.i32s()?);
        let z = unpack(qzeros.i32s()?);
        let lanes = cols / LANE;
        let mut codes = vec![0u8; rows * cols];
        for k in 0..cols {
            for n in 0..rows {
                codes[n * cols + k] = q[k * rows + n];
            }
        }
        let mut lane_scales = vec![0f32; rows * lanes];
        let mut lane_zeros = vec![0i32; rows * lanes];
        for n in 0..rows {
            for l in 0..lanes {
                let grp = l * LANE / g;
                lane_scales[n * lanes + l] = scales[grp * rows + n];
                lane_zeros[n * lanes + l] = z[grp * rows + n] as i32;
            }
        }
        Ok(Some(IntLinear {
            rows,
            cols,
            bits: 4,
            codes,
            scales: lane_scales,
            zeros: lane_zeros,
            affine: Affine::default(),
        }))
    }
}
