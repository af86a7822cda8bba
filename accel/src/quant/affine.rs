//! What a checkpoint's quantization scheme puts around its integer matrix.
//!
//! GGUF blocks carry everything a matmul needs, but the Hugging Face
//! schemes spread a linear layer over more than one tensor:
//!
//! - GPTQ with `desc_act` quantizes the input columns in a data-dependent
//!   order, so a group's columns are scattered across the row. The loader
//!   sorts the columns by group (making each group contiguous, so it fits
//!   the 32-wide blocks) and records the order here; the matmul gathers its
//!   input in that order, which leaves `W · x` unchanged.
//! - Per-channel int8 schemes (compressed-tensors W8A8, ModelSlim) scale
//!   each output row by an f32 that no f16 block scale can hold exactly:
//!   the blocks get scale 1 and the row's scale is applied to the output.
//! - Static W8A8 (ModelSlim, compressed-tensors with a static
//!   `input_scale`) quantizes the input to int8 with a fixed scale and zero
//!   offset, and folds the offset's correction and the layer's bias into an
//!   integer bias: the input is rounded onto that grid here, and the bias
//!   is added after the scale.
//!
//! So a matrix with an [`Affine`] computes
//! `y = out_scale ⊙ (W · Q(P x)) + out_bias`, where `P` gathers the input
//! columns and `Q` rounds them onto the static int8 grid.

use super::WeightError;

/// Static int8 quantization of a linear layer's input: `q = clamp(round(x /
/// scale + offset), −128, 127)`, and the matmul sees `(q − offset) · scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StaticActQuant {
    /// The step between representable inputs.
    pub scale: f32,
    /// The integer zero point (an integer value held as f32).
    pub offset: f32,
}

impl StaticActQuant {
    /// Rounds `v` onto the grid, as the int8 kernels of the scheme's own
    /// runtime would see it (round half to even, as `torch.round` does).
    fn apply(self, v: f32) -> f32 {
        let q = (v / self.scale + self.offset)
            .round_ties_even()
            .clamp(-128.0, 127.0);
        (q - self.offset) * self.scale
    }
}

/// The transforms around a matrix; see the module docs. Every part is
/// optional, and a default `Affine` is the identity.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Affine {
    /// Column order: stored column `j` holds input feature `in_perm[j]`.
    pub in_perm: Option<Vec<u32>>,
    /// Static int8 rounding of the input.
    pub act_quant: Option<StaticActQuant>,
    /// One factor per output row, applied to the product.
    pub out_scale: Option<Vec<f32>>,
    /// One term per output row, added after the scale.
    pub out_bias: Option<Vec<f32>>,
}

impl Affine {
    /// Whether the transform changes nothing.
    pub fn is_identity(&self) -> bool {
        self.in_perm.is_none()
            && self.act_quant.is_none()
            && self.out_scale.is_none()
            && self.out_bias.is_none()
    }

    /// Checks the parts against a `[rows, cols]` matrix: vector lengths,
    /// that the order is a permutation, and that the static scale is a
    /// positive finite number with an integer offset.
    pub fn check(&self, rows: usize, cols: usize) -> Result<(), WeightError> {
        let bad = |what: String| Err(WeightError::Affine { rows, cols, what });
        if let Some(p) = &self.in_perm {
            if p.len() != cols {
                return bad(format!("column order has {} entries", p.len()));
            }
            let mut seen = vec![false; cols];
            for &c in p {
                match seen.get_mut(c as usize) {
                    Some(s) if !*s => *s = true,
                    _ => return bad(format!("column order is not a permutation (column {c})")),
                }
            }
        }
        if let Some(a) = self.act_quant {
            if !(a.scale.is_finite() && a.scale > 0.0) {
                return bad(format!("input scale {} is not positive", a.scale));
            }
            if !(a.offset.is_finite() && a.offset.fract() == 0.0 && a.offset.abs() <= 128.0) {
                return bad(format!(
                    "input offset {} is not an int8 zero point",
                    a.offset
                ));
            }
        }
        for (name, v) in [
            ("output scales", &self.out_scale),
            ("output biases", &self.out_bias),
        ] {
            if let Some(v) = v {
                if v.len() != rows {
                    return bad(format!("{} {name} for {rows} rows", v.len()));
                }
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return bad(format!("{name}: row {i} is {}", v[i]));
                }
            }
        }
        Ok(())
    }

    /// Whether the input must be rewritten before the product.
    pub(crate) fn touches_input(&self) -> bool {
        self.in_perm.is_some() || self.act_quant.is_some()
    }

    /// Writes `m` rows of `x` (`cols` wide), gathered and rounded, into `buf`.
    pub(crate) fn prepare_input(&self, x: &[f32], m: usize, cols: usize, buf: &mut [f32]) {
        for (src, dst) in x[..m * cols]
            .chunks_exact(cols)
            .zip(buf[..m * cols].chunks_exact_mut(cols))
        {
            match &self.in_perm {
                Some(p) => {
                    for (d, &c) in dst.iter_mut().zip(p) {
                        *d = src[c as usize];
                    }
                }
                None => dst.copy_from_slice(src),
            }
            if let Some(a) = self.act_quant {
                for d in dst.iter_mut() {
                    *d = a.apply(*d);
                }
            }
        }
    }

    /// Applies the output scale and bias to `m` rows of `out` (`rows` wide).
    pub(crate) fn finish_output(&self, out: &mut [f32], m: usize, rows: usize) {
        if self.out_scale.is_none() && self.out_bias.is_none() {
            return;
        }
        for row in out[..m * rows].chunks_exact_mut(rows) {
            if let Some(s) = &self.out_scale {
                for (o, &s) in row.iter_mut().zip(s) {
                    *o *= s;
                }
            }
            if let Some(b) = &self.out_bias {
                for (o, &b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
    }

    /// Turns a dequantized stored row `r` into the layer's weights in input
    /// order: scaled by the row's factor and scattered back through the
    /// column order.
    pub(crate) fn finish_row(&self, r: usize, row: &mut [f32]) {
        if let Some(s) = &self.out_scale {
            for v in row.iter_mut() {
                *v *= s[r];
            }
        }
        if let Some(p) = &self.in_perm {
            let stored = row.to_vec();
            for (&c, v) in p.iter().zip(stored) {
                row[c as usize] = v;
            }
        }
    }

    /// The bytes the transform holds.
    pub(crate) fn size_bytes(&self) -> usize {
        4 * (self.in_perm.as_ref().map_or(0, Vec::len)
            + self.out_scale.as_ref().map_or(0, Vec::len)
            + self.out_bias.as_ref().map_or(0, Vec::len))
    }

    /// Stacks the transforms of matrices stacked along rows: the input side
    /// must agree (one input feeds them all); scales and biases concatenate,
    /// a part without them contributing 1s and 0s. `None` when the input
    /// sides differ, so the parts cannot share one matmul.
    pub(crate) fn concat(parts: &[(Option<&Affine>, usize)]) -> Option<Option<Affine>> {
        if parts.iter().all(|(a, _)| a.is_none_or(Affine::is_identity)) {
            return Some(None);
        }
        let id = Affine::default();
        let get = |a: Option<&Affine>| -> Affine { a.cloned().unwrap_or_else(|| id.clone()) };
        let first = get(parts[0].0);
        let mut out = Affine {
            in_perm: first.in_perm.clone(),
            act_quant: first.act_quant,
            out_scale: None,
            out_bias: None,
        };
        for (a, _) in parts {
            let a = get(*a);
            if a.in_perm != out.in_perm || a.act_quant != out.act_quant {
                return None;
            }
        }
        let any_scale = parts
            .iter()
            .any(|(a, _)| a.is_some_and(|a| a.out_scale.is_some()));
        let any_bias = parts
            .iter()
            .any(|(a, _)| a.is_some_and(|a| a.out_bias.is_some()));
        let stack = |pick: fn(&Affine) -> &Option<Vec<f32>>, fill: f32| -> Vec<f32> {
            let mut v = Vec::new();
            for (a, rows) in parts {
                match a.and_then(|a| pick(a).as_ref()) {
                    Some(x) => v.extend_from_slice(x),
                    None => v.extend(std::iter::repeat_n(fill, *rows)),
                }
            }
            v
        };
        if any_scale {
            out.out_scale = Some(stack(|a| &a.out_scale, 1.0));
        }
        if any_bias {
            out.out_bias = Some(stack(|a| &a.out_bias, 0.0));
        }
        Some(Some(out))
    }
}
