//! LoRA deltas for a batch that mixes adapters (the idea of Punica's BGMV
//! and S-LoRA's kernels): every token of a step carries the slot of its
//! request's adapter (or none), and each adapted projection adds
//! `scale · B (A x)` to the token's output columns, with its own adapter's
//! factors. Tokens are visited slot by slot, so one adapter's factors stay
//! in cache while its tokens run; the base weights are never copied or
//! merged. A token's result does not depend on which other tokens share
//! the step.

/// One adapter's factors for one projection.
#[derive(Clone, Copy, Debug)]
pub struct LoraFactors<'a> {
    /// `[rank, in]`, row-major.
    pub a: &'a [f32],
    /// `[out, rank]`, row-major.
    pub b: &'a [f32],
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// The most LoRA rank the kernel's stack scratch holds.
pub const MAX_LORA_RANK: usize = 512;

/// Adds the LoRA deltas of a projection to `out`: for every token `t` whose
/// slot `token_slots[t]` has factors (`slot_of` gives them), and every output `j` of
/// `0..out_dim`, `out[t·out_stride + col + j] += scale · Σ_k b[j,k] ·
/// Σ_i a[k,i] · x[t·in_dim + i]`. Tokens without a slot (`u16::MAX`, or a
/// slot with `None`) are left alone. `order` is scratch for the visiting
/// order.
///
/// # Panics
/// If a slot's factors are not `rank × in_dim` and `out_dim × rank`, or
/// the rank is above [`MAX_LORA_RANK`] (the loader refuses both).
#[allow(clippy::too_many_arguments)]
pub fn lora_add<'a>(
    x: &[f32],
    in_dim: usize,
    token_slots: &[u16],
    slot_of: impl Fn(u16) -> Option<LoraFactors<'a>>,
    out: &mut [f32],
    out_stride: usize,
    col: usize,
    out_dim: usize,
    order: &mut Vec<u32>,
) {
    order.clear();
    order.extend(
        (0..token_slots.len() as u32).filter(|&t| slot_of(token_slots[t as usize]).is_some()),
    );
    // Stable: each slot's tokens keep their order.
    order.sort_by_key(|&t| token_slots[t as usize]);
    let mut h = [0f32; MAX_LORA_RANK];
    for &t in order.iter() {
        let t = t as usize;
        let Some(f) = slot_of(token_slots[t]) else {
            continue;
        };
        assert!(
            f.rank <= MAX_LORA_RANK,
            "LoRA rank {} above the kernel's",
            f.rank
        );
        assert_eq!(f.a.len(), f.rank * in_dim, "lora A is not rank × in");
        assert_eq!(f.b.len(), out_dim * f.rank, "lora B is not out × rank");
        let xt = &x[t * in_dim..(t + 1) * in_dim];
        let h = &mut h[..f.rank];
        for (k, hk) in h.iter_mut().enumerate() {
            *hk = dot(&f.a[k * in_dim..(k + 1) * in_dim], xt);
        }
        let row = &mut out[t * out_stride + col..t * out_stride + col + out_dim];
        for (j, o) in row.iter_mut().enumerate() {
            *o += f.scale * dot(&f.b[j * f.rank..(j + 1) * f.rank], h);
        }
    }
}

/// `Σ a[i]·b[i]` in eight lanes (which the compiler vectorizes), then
/// their sum.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The definition, in f64.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        x: &[f32],
        in_dim: usize,
        token_slots: &[u16],
        factors: &[Option<(Vec<f32>, Vec<f32>, usize, f32)>],
        out: &mut [f64],
        out_stride: usize,
        col: usize,
        out_dim: usize,
    ) {
        for (t, &s) in token_slots.iter().enumerate() {
            let Some(Some((a, b, r, scale))) = factors.get(s as usize) else {
                continue;
            };
            let h: Vec<f64> = (0..*r)
                .map(|k| {
                    (0..in_dim)
                        .map(|i| a[k * in_dim + i] as f64 * x[t * in_dim + i] as f64)
                        .sum()
                })
                .collect();
            for j in 0..out_dim {
                let d: f64 = (0..*r).map(|k| b[j * r + k] as f64 * h[k]).sum();
                out[t * out_stride + col + j] += *scale as f64 * d;
            }
        }
    }

    #[test]
    fn mixed_adapters_match_the_definition_and_leave_base_tokens_alone() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (in_dim, out_dim, stride, col) = (67, 29, 40, 7);
        let ranks = [4usize, 16, 1];
        let factors: Vec<Option<(Vec<f32>, Vec<f32>, usize, f32)>> = ranks
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let mut v = |n: usize| {
                    (0..n)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect::<Vec<f32>>()
                };
                if i == 2 {
                    // A slot that holds no adapter for this projection.
                    return None;
                }
                Some((v(r * in_dim), v(out_dim * r), r, 0.5 + i as f32))
            })
            .collect();
        let slots: Vec<Option<LoraFactors>> = factors
            .iter()
            .map(|f| {
                f.as_ref().map(|(a, b, r, s)| LoraFactors {
                    a,
                    b,
                    rank: *r,
                    scale: *s,
                })
            })
            .collect();
        let m = 23;
        let token_slots: Vec<u16> = (0..m).map(|t| [0u16, 1, u16::MAX, 2, 1][t % 5]).collect();
        let x: Vec<f32> = (0..m * in_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let base: Vec<f32> = (0..m * stride)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut got = base.clone();
        let slot_of = |s: u16| slots.get(s as usize).copied().flatten();
        lora_add(
            &x,
            in_dim,
            &token_slots,
            slot_of,
            &mut got,
            stride,
            col,
            out_dim,
            &mut Vec::new(),
        );
        let mut want: Vec<f64> = base.iter().map(|&v| v as f64).collect();
        naive(
            &x,
            in_dim,
            &token_slots,
            &factors,
            &mut want,
            stride,
            col,
            out_dim,
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((*g as f64 - w).abs() < 1e-4, "element {i}: {g} vs {w}");
            let (t, c) = (i / stride, i % stride);
            let untouched = matches!(token_slots[t], u16::MAX | 2) || c < col || c >= col + out_dim;
            if untouched {
                assert_eq!(*g, base[i], "element {i} must not change");
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_whatever_shares_its_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (in_dim, out_dim, r) = (48, 33, 8);
        let a: Vec<f32> = (0..r * in_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let b: Vec<f32> = (0..out_dim * r)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let slots = [Some(LoraFactors {
            a: &a,
            b: &b,
            rank: r,
            scale: 2.0,
        })];
        let x: Vec<f32> = (0..5 * in_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut alone = vec![0f32; out_dim];
        let slot_of = |s: u16| slots.get(s as usize).copied().flatten();
        lora_add(
            &x[2 * in_dim..3 * in_dim],
            in_dim,
            &[0],
            slot_of,
            &mut alone,
            out_dim,
            0,
            out_dim,
            &mut Vec::new(),
        );
        let mut batch = vec![0f32; 5 * out_dim];
        lora_add(
            &x,
            in_dim,
            &[0, u16::MAX, 0, 0, u16::MAX],
            slot_of,
            &mut batch,
            out_dim,
            0,
            out_dim,
            &mut Vec::new(),
        );
        assert_eq!(&batch[2 * out_dim..3 * out_dim], &alone[..]);
    }
}
