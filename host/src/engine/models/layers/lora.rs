//! LoRA adapters on a layer's projections: for every adapter slot, the
//! factors of each module it adapts, on the device. A step's tokens carry
//! their adapter slot ([`pagoda_accel::StepBatch::lora_slots`]); with a
//! projection's matmul, each module adds `scale · B (A x)` to its columns
//! of the output for the tokens of each slot
//! ([`pagoda_accel::Backend::matmul_lora`], which may compute the deltas
//! beside the matmul). The base weights are never copied or merged.

use crate::engine::lora::{LoraAdapter, LoraModule};
use anyhow::Result;
use pagoda_accel::{Backend, DeviceLora, GgmlType, HostMatrix, LoraSlice};

/// One layer's adapters, by module and slot.
pub struct LayerLora<B: Backend> {
    layer: usize,
    /// Per module (in [`LoraModule::ALL`]'s order): one entry per slot.
    modules: [Vec<Option<DeviceLora<B::Matrix>>>; 7],
    /// How the factors are stored (`--lora-dtype`, resolved).
    ty: GgmlType,
}

/// `m` (`[rows, cols]`, row-major) transposed.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

fn index(m: LoraModule) -> usize {
    LoraModule::ALL.iter().position(|&x| x == m).unwrap_or(0)
}

impl<B: Backend> LayerLora<B> {
    /// Layer `layer` with `slots` empty adapter slots, whose factors will
    /// be stored as `ty` (F32, BF16 or F16).
    pub fn new(layer: usize, slots: usize, ty: GgmlType) -> LayerLora<B> {
        LayerLora {
            layer,
            ty,
            modules: std::array::from_fn(|_| (0..slots).map(|_| None).collect()),
        }
    }

    /// Puts `adapter`'s factors for this layer in `slot` (or empties it).
    pub fn set(&mut self, b: &B, slot: usize, adapter: Option<&LoraAdapter>) -> Result<()> {
        for m in LoraModule::ALL {
            let Some(entry) = self.modules[index(m)].get_mut(slot) else {
                anyhow::bail!(
                    "LoRA slot {slot} is beyond the {} slots",
                    self.modules[0].len()
                );
            };
            *entry = match adapter.and_then(|a| a.modules.get(&(self.layer, m)).map(|w| (a, w))) {
                None => None,
                Some((a, w)) => Some(DeviceLora {
                    a: b.upload_matrix(&HostMatrix::from_f32_as(self.ty, w.rank, w.in_dim, &w.a)?)?,
                    // The kernels take Bᵀ (`[rank, out]`): the expansion
                    // then runs along contiguous rows.
                    b: b.upload_matrix(&HostMatrix::from_f32_as(
                        self.ty,
                        w.rank,
                        w.out_dim,
                        &transpose(&w.b, w.out_dim, w.rank),
                    )?)?,
                    rank: w.rank,
                    scale: a.scaling,
                }),
            };
        }
        Ok(())
    }

    /// The adapted ones of `parts` (each a module with its output columns
    /// `col..col + out_dim` of one projection, at most three), as
    /// [`pagoda_accel::Backend::matmul_lora`] takes them; held inline, so
    /// a decode step allocates nothing for them.
    pub fn slices(&self, parts: &[(LoraModule, usize, usize)]) -> LoraSlices<'_, B::Matrix> {
        let mut out = LoraSlices::none();
        for &(m, col, out_dim) in parts {
            if self.adapts(m) && out.len < out.items.len() {
                out.items[out.len] = LoraSlice {
                    slots: &self.modules[index(m)],
                    col,
                    out_dim,
                };
                out.len += 1;
            }
        }
        out
    }

    /// Whether any slot adapts module `m`.
    fn adapts(&self, m: LoraModule) -> bool {
        self.modules[index(m)].iter().any(Option::is_some)
    }
}

/// Up to three [`LoraSlice`]s of one projection (q|k|v at most), without a
/// heap allocation; derefs to the slice [`Backend::matmul_lora`] takes.
pub struct LoraSlices<'a, M> {
    items: [LoraSlice<'a, M>; 3],
    len: usize,
}

impl<'a, M> LoraSlices<'a, M> {
    /// No slices: the projection has no adapter.
    pub fn none() -> LoraSlices<'a, M> {
        let empty = || LoraSlice {
            slots: &[],
            col: 0,
            out_dim: 0,
        };
        LoraSlices {
            items: [empty(), empty(), empty()],
            len: 0,
        }
    }
}

impl<'a, M> std::ops::Deref for LoraSlices<'a, M> {
    type Target = [LoraSlice<'a, M>];
    fn deref(&self) -> &[LoraSlice<'a, M>] {
        &self.items[..self.len]
    }
}
