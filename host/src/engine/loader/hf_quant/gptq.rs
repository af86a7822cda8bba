//! GPTQ checkpoints (AutoGPTQ / GPTQModel, as vLLM loads them).
//!
//! Per linear layer `p`, with `b` bits and `G` groups:
//! - `p.qweight`: I32 `[in · b / 32, out]`, packed along the input: word
//!   `(r, n)` holds input rows `r · 32/b + j` at bits `j · b`;
//! - `p.qzeros`: I32 `[G, out · b / 32]`, packed along the output the same
//!   way; the "gptq" (v1) format stores `zero − 1`, "gptq_v2" the zero;
//! - `p.scales`: `[G, out]` (F16);
//! - `p.g_idx`: I32 `[in]`, the group of each input feature. With
//!   `desc_act` the features were quantized in a data-dependent order, so
//!   a group's features are scattered; otherwise `g_idx[k] = k / group`.
//!
//! Value: `w[n][k] = scales[g][n] · (q[k][n] − zero[g][n])`, `g = g_idx[k]`.
//!
//! Layers left unquantized are named by GPTQModel's `dynamic` rules whose
//! key starts with `-:` (a regular expression over the module name, matched
//! at its start as Python's `re.match` does); they keep a float `weight`.

use super::{bool_field, int_field, unpack_words, IntLinear, TensorStore, LANE};
use anyhow::{bail, Context, Result};
use pagoda_accel::Affine;
use regex::Regex;
use serde_json::Value;

/// A GPTQ `quantization_config`.
#[derive(Clone, Debug)]
pub struct Gptq {
    pub bits: u32,
    /// Input features per group; `None` for one group per row (`-1`).
    pub group_size: Option<usize>,
    pub desc_act: bool,
    pub sym: bool,
    /// Whether `qzeros` holds `zero − 1` (the v1 "gptq" format).
    pub zeros_minus_one: bool,
    /// Modules the `dynamic` rules leave unquantized.
    skip: Vec<Regex>,
}

impl PartialEq for Gptq {
    fn eq(&self, o: &Gptq) -> bool {
        let pats = |g: &Gptq| {
            g.skip
                .iter()
                .map(|r| r.as_str().to_string())
                .collect::<Vec<_>>()
        };
        (
            self.bits,
            self.group_size,
            self.desc_act,
            self.sym,
            self.zeros_minus_one,
        ) == (o.bits, o.group_size, o.desc_act, o.sym, o.zeros_minus_one)
            && pats(self) == pats(o)
    }
}

impl Gptq {
    /// Reads `bits`, `group_size`, `desc_act`, `sym` and
    /// `checkpoint_format` ("gptq" or "gptq_v2").
    pub fn from_config(q: &Value) -> Result<Gptq> {
        let bits = int_field(q, &["bits", "w_bit"])?.context("'bits' is missing")?;
        if bits != 4 && bits != 8 {
            bail!("GPTQ with bits = {bits} is not supported: Pagoda loads 4- and 8-bit GPTQ");
        }
        let group_size = match int_field(q, &["group_size"])?.unwrap_or(-1) {
            -1 => None,
            g if g > 0 => Some(g as usize),
            g => bail!("'group_size' {g} must be positive or -1"),
        };
        let zeros_minus_one = match q.get("checkpoint_format").and_then(Value::as_str) {
            None | Some("gptq") => true,
            Some("gptq_v2") => false,
            Some(other) => bail!(
                "GPTQ checkpoint_format '{other}' is not supported (gptq and gptq_v2 are); marlin-packed checkpoints need repacking to gptq"
            ),
        };
        let mut skip = Vec::new();
        if let Some(d) = q.get("dynamic").filter(|d| !d.is_null()) {
            let rules = d
                .as_object()
                .context("'dynamic' must be an object of module rules")?;
            for key in rules.keys() {
                if let Some(p) = key.strip_prefix("-:") {
                    skip.push(
                        Regex::new(&format!("^(?:{p})")).with_context(|| {
                            format!("dynamic rule '{key}' is not a valid pattern")
                        })?,
                    );
                }
            }
        }
        Ok(Gptq {
            skip,
            bits: bits as u32,
            group_size,
            desc_act: bool_field(q, "desc_act", false)?,
            sym: bool_field(q, "sym", true)?,
            zeros_minus_one,
        })
    }

    pub(super) fn describe(&self) -> String {
        format!(
            "gptq int{}, {}{}{}",
            self.bits,
            self.group_size
                .map_or("one group per row".to_string(), |g| format!("group {g}")),
            if self.desc_act { ", desc_act" } else { "" },
            if self.sym { "" } else { ", asymmetric" }
        )
    }

    pub(super) fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<IntLinear>> {
        let skipped = self.skip.iter().any(|r| r.is_match(prefix));
        let Some(qweight) =
            super::quantized_or_dense(store, prefix, "qweight", skipped, &self.describe())?
        else {
            return Ok(None);
        };
        let b = self.bits;
        let per = (32 / b) as usize;
        let group = self.group_size.unwrap_or(cols);
        IntLinear::check_group(prefix, cols, group)?;
        if rows % per != 0 {
            bail!("{prefix}: {rows} output features do not pack {per} to an int32");
        }
        let groups = cols / group;
        qweight.expect_shape(&[cols / per, rows])?;
        let qzeros = store.require(&format!("{prefix}.qzeros"))?;
        qzeros.expect_shape(&[groups, rows / per])?;
        let scales = store.require(&format!("{prefix}.scales"))?;
        scales.expect_shape(&[groups, rows])?;
        let scales = scales.f32s()?;
        let g_idx = match store.raw(&format!("{prefix}.g_idx"))? {
            Some(t) => {
                t.expect_shape(&[cols])?;
                let g = t.i32s()?;
                if let Some(k) = g.iter().position(|&g| g < 0 || g as usize >= groups) {
                    bail!(
                        "tensor '{prefix}.g_idx': feature {k} is in group {}, but there are {groups} groups",
                        g[k]
                    );
                }
                g.into_iter().map(|g| g as usize).collect()
            }
            None => (0..cols).map(|k| k / group).collect::<Vec<_>>(),
        };

        // Features sorted by group (stable), so each group is contiguous;
        // the identity unless desc_act scattered them.
        let mut order: Vec<u32> = (0..cols as u32).collect();
        order.sort_by_key(|&k| g_idx[k as usize]);
        let lane_group: Vec<usize> = order
            .chunks_exact(LANE)
            .enumerate()
            .map(|(l, lane)| {
                let g = g_idx[lane[0] as usize];
                if lane.iter().any(|&k| g_idx[k as usize] != g) {
                    bail!(
                        "tensor '{prefix}.g_idx': the features of group {g} are not a multiple of 32 (lane {l} mixes groups); Pagoda runs quantized weights in blocks of 32"
                    );
                }
                Ok(g)
            })
            .collect::<Result<_>>()?;

        // Code of input feature k, output n: word (k / per, n), field k % per.
        let words = qweight.i32s()?;
        let mask = (1u32 << b) - 1;
        let z: Vec<u8> = unpack_words(&qzeros.i32s()?, b).collect();
        let lanes = cols / LANE;
        let mut codes = vec![0u8; rows * cols];
        for (j, &k) in order.iter().enumerate() {
            let (r, shift) = (k as usize / per, b as usize * (k as usize % per));
            for (n, &w) in words[r * rows..(r + 1) * rows].iter().enumerate() {
                codes[n * cols + j] = ((w as u32 >> shift) & mask) as u8;
            }
        }
        let mut lane_scales = vec![0f32; rows * lanes];
        let mut lane_zeros = vec![0i32; rows * lanes];
        let offset = i32::from(self.zeros_minus_one);
        for n in 0..rows {
            for (l, &g) in lane_group.iter().enumerate() {
                lane_scales[n * lanes + l] = scales[g * rows + n];
                lane_zeros[n * lanes + l] = z[g * rows + n] as i32 + offset;
            }
        }
        let identity = order.iter().enumerate().all(|(j, &k)| j as u32 == k);
        Ok(Some(IntLinear {
            rows,
            cols,
            bits: b,
            codes,
            scales: lane_scales,
            zeros: lane_zeros,
            affine: Affine {
                in_perm: (!identity).then_some(order),
                ..Affine::default()
            },
        }))
    }
}
