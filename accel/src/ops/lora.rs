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
    /// `Bᵀ`: `[rank, out]`, row-major, so that the expansion runs along
    /// contiguous rows (one `axpy` per rank) rather than `out` short dots.
    pub b: &'a [f32],
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// The most LoRA rank the kernel's stack scratch holds.
pub const MAX_LORA_RANK: usize = 512;

/// Adds the LoRA deltas of a projection to `out`: for every token `t` whose
/// slot `token_slots[t]` has factors (`slot_of` gives them), and every output `j` of
/// `0..out_dim`, `out[t·out_stride + col + j] += Σ_k bᵀ[k,j] · scale ·
/// Σ_i a[k,i] · x[t·in_dim + i]`. Tokens without a slot (`u16::MAX`, or a
/// slot without factors) are left alone. `order` is scratch for the visiting
/// order. With `pool`, tokens are split across its threads (each token's
/// bits are the same either way).
///
/// # Panics
/// If a slot's factors are not `rank × in_dim` and `rank × out_dim`, or
/// the rank is above [`MAX_LORA_RANK`] (the loader refuses both).
#[allow(clippy::too_many_arguments)]
pub fn lora_add<'a>(
    x: &[f32],
    in_dim: usize,
    token_slots: &[u16],
    slot_of: impl Fn(u16) -> Option<LoraFactors<'a>> + Sync,
    out: &mut [f32],
    out_stride: usize,
    col: usize,
    out_dim: usize,
    order: &mut Vec<u32>,
    pool: Option<&crate::ThreadPool>,
) {
    order.clear();
    order.extend(
        (0..token_slots.len() as u32).filter(|&t| slot_of(token_slots[t as usize]).is_some()),
    );
    // Stable: each slot's tokens keep their order.
    order.sort_by_key(|&t| token_slots[t as usize]);
    // The same path for every token of the process, so a token's bits do
    // not depend on its batch.
    let avx2 = crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2;
    struct Out(*mut f32, usize);
    // SAFETY: every token writes only its own row of `out`, and each token
    // appears once in `order`, so ranges of `order` write disjoint rows.
    unsafe impl Sync for Out {}
    let o = Out(out.as_mut_ptr(), out.len());
    let run = |r0: usize, r1: usize| {
        let o = &o;
        let mut h = [0f32; MAX_LORA_RANK];
        for &t in &order[r0..r1] {
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
            assert_eq!(f.b.len(), out_dim * f.rank, "lora Bᵀ is not rank × out");
            let xt = &x[t * in_dim..(t + 1) * in_dim];
            let start = t * out_stride + col;
            assert!(start + out_dim <= o.1, "lora_add: out is too short");
            // SAFETY: in bounds (checked above) and this token's alone.
            let row = unsafe { std::slice::from_raw_parts_mut(o.0.add(start), out_dim) };
            apply(&f, xt, row, &mut h[..f.rank], avx2);
        }
    };
    match pool {
        // A token's delta is tens of thousands of multiply-adds: worth
        // splitting from two tokens on.
        Some(pool) if order.len() >= 2 && pool.threads() > 1 => {
            pool.run_ranges(order.len(), 1, &run)
        }
        _ => run(0, order.len()),
    }
}

/// One token's delta: `h = scale · A x`, then `row += Σ_k h[k] · Bᵀ[k]`.
fn apply(f: &LoraFactors<'_>, x: &[f32], row: &mut [f32], h: &mut [f32], avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: `avx2` is true only where the CPU has AVX2 and FMA
        // (`simd_level`).
        unsafe { apply_avx2(f, x, row, h) };
        return;
    }
    let _ = avx2;
    let in_dim = x.len();
    for (k, hk) in h.iter_mut().enumerate() {
        *hk = f.scale * dot(&f.a[k * in_dim..(k + 1) * in_dim], x);
    }
    let out_dim = row.len();
    for (k, &c) in h.iter().enumerate() {
        for (o, &b) in row.iter_mut().zip(&f.b[k * out_dim..(k + 1) * out_dim]) {
            *o += c * b;
        }
    }
}

/// [`apply`] with AVX2 FMA: eight-lane dot products for the shrink, and
/// eight-lane `axpy`s for the expansion.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply_avx2(f: &LoraFactors<'_>, x: &[f32], row: &mut [f32], h: &mut [f32]) {
    use std::arch::x86_64::*;
    let in_dim = x.len();
    let out_dim = row.len();
    let lanes = in_dim / 8 * 8;
    for (k, hk) in h.iter_mut().enumerate() {
        let a = &f.a[k * in_dim..(k + 1) * in_dim];
        // SAFETY: every load reads 8 floats below `lanes` ≤ the slices' length.
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < lanes {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(x.as_ptr().add(i)),
                acc,
            );
            i += 8;
        }
        let mut lanes8 = [0f32; 8];
        _mm256_storeu_ps(lanes8.as_mut_ptr(), acc);
        let mut s = ((lanes8[0] + lanes8[4]) + (lanes8[1] + lanes8[5]))
            + ((lanes8[2] + lanes8[6]) + (lanes8[3] + lanes8[7]));
        for j in lanes..in_dim {
            s += a[j] * x[j];
        }
        *hk = f.scale * s;
    }
    let lanes = out_dim / 8 * 8;
    for (k, &c) in h.iter().enumerate() {
        let bt = &f.b[k * out_dim..(k + 1) * out_dim];
        let cv = _mm256_set1_ps(c);
        let mut j = 0;
        // SAFETY: as above, below `lanes` ≤ both lengths.
        while j < lanes {
            let o = row.as_mut_ptr().add(j);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(cv, _mm256_loadu_ps(bt.as_ptr().add(j)), _mm256_loadu_ps(o)),
            );
            j += 8;
        }
        for j in lanes..out_dim {
            row[j] += c * bt[j];
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

    /// `m` (`[rows, cols]`) transposed.
    fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols * rows)
            .map(|i| m[(i % rows) * cols + i / rows])
            .collect()
    }

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
        // The kernel takes Bᵀ.
        let transposed: Vec<Option<Vec<f32>>> = factors
            .iter()
            .map(|f| f.as_ref().map(|(_, b, r, _)| transpose(b, out_dim, *r)))
            .collect();
        let slots: Vec<Option<LoraFactors>> = factors
            .iter()
            .zip(&transposed)
            .map(|(f, bt)| {
                f.as_ref()
                    .zip(bt.as_ref())
                    .map(|((a, _, r, s), bt)| LoraFactors {
                        a,
                        b: bt,
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
            None,
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
    fn the_simd_and_scalar_paths_agree() {
        if crate::cpu::simd_level() < crate::cpu::SimdLevel::Avx2 {
            eprintln!("note: no AVX2 here; only the scalar path runs");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        // Lengths off the 8-lane grid, so the tails run too.
        let (in_dim, out_dim, r) = (77, 45, 5);
        let mut v =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let (a, b, x, base) = (v(r * in_dim), v(r * out_dim), v(in_dim), v(out_dim));
        let f = LoraFactors {
            a: &a,
            b: &b,
            rank: r,
            scale: 1.5,
        };
        let (mut scalar, mut simd) = (base.clone(), base.clone());
        apply(&f, &x, &mut scalar, &mut [0f32; 5], false);
        apply(&f, &x, &mut simd, &mut [0f32; 5], true);
        for (i, (s, v)) in scalar.iter().zip(&simd).enumerate() {
            assert!((s - v).abs() < 1e-4, "output {i}: scalar {s}, simd {v}");
        }
        assert_ne!(scalar, base);
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
            None,
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
            None,
        );
        assert_eq!(&batch[2 * out_dim..3 * out_dim], &alone[..]);
        // Split across threads, the same bits.
        let pool = crate::ThreadPool::new(2);
        let mut split = vec![0f32; 5 * out_dim];
        lora_add(
            &x,
            in_dim,
            &[0, u16::MAX, 0, 0, u16::MAX],
            slot_of,
            &mut split,
            out_dim,
            0,
            out_dim,
            &mut Vec::new(),
            Some(&pool),
        );
        assert_eq!(split, batch);
    }
}
