//! The gated RMSNorm on a Gated DeltaNet layer's output (transformers'
//! `Qwen3NextRMSNormGated`): each value head's output is RMS-normalized,
//! scaled by the weight (used as is, not `1 + w` like the model's other
//! norms), then multiplied by `silu(z)`, the head's output gate.

use super::recurrent::SendPtr;
use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;

/// Rows below which the norm runs on the calling thread (a decode step's
/// few rows cost less than waking the pool).
const PAR_MIN_ROWS: usize = 64;

/// `out[r][g·d + i] = weight[i] · x[r][g·d + i] / √(mean_i(x[r][g·d + i]²)
/// + eps) · silu(z[r·z_stride + z_col + g·d + i])` for `rows` rows of
/// `width` (`d = weight.len()`, `width` a multiple of `d`: one group per
/// value head). `x` and `out` are `[rows, width]`; `z` may be a wider
/// projection's output (`z_stride ≥ z_col + width`).
///
/// # Panics
/// If a length disagrees with the shapes.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_gated(
    pool: &ThreadPool,
    x: &[f32],
    z: &[f32],
    z_stride: usize,
    z_col: usize,
    weight: &[f32],
    eps: f32,
    rows: usize,
    width: usize,
    out: &mut [f32],
) {
    rms_norm_gated_at(
        simd_level(),
        pool,
        x,
        z,
        z_stride,
        z_col,
        weight,
        eps,
        rows,
        width,
        out,
    )
}

/// [`rms_norm_gated`] at an explicit SIMD level (tests cover every level).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_gated_at(
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    z: &[f32],
    z_stride: usize,
    z_col: usize,
    weight: &[f32],
    eps: f32,
    rows: usize,
    width: usize,
    out: &mut [f32],
) {
    check_level(level);
    let d = weight.len();
    assert!(
        d > 0 && width.is_multiple_of(d),
        "rms_norm_gated: width {width} is not a multiple of the weight's {d}"
    );
    assert!(
        x.len() >= rows * width && out.len() >= rows * width,
        "rms_norm_gated: x or out holds fewer than {rows} rows of {width}"
    );
    assert!(
        z_col + width <= z_stride
            && (rows == 0 || z.len() >= (rows - 1) * z_stride + z_col + width),
        "rms_norm_gated: z holds fewer than {rows} rows of {width} at column {z_col}"
    );
    let o = SendPtr(out.as_mut_ptr());
    let task = |r0: usize, r1: usize| {
        let o = &o;
        // SAFETY: `check_level` confirmed the CPU supports `level`; each
        // range writes only its own rows of `out`, and the region ends
        // before the borrow of `out` does.
        unsafe {
            dispatch(
                level,
                GatedNorm {
                    x,
                    z,
                    z_stride,
                    z_col,
                    weight,
                    eps,
                    width,
                    r0,
                    r1,
                    out: o.0,
                },
            )
        }
    };
    if rows < PAR_MIN_ROWS || pool.threads() == 1 {
        task(0, rows);
    } else {
        pool.run_ranges(rows, 16, &task);
    }
}

struct GatedNorm<'a> {
    x: &'a [f32],
    z: &'a [f32],
    z_stride: usize,
    z_col: usize,
    weight: &'a [f32],
    eps: f32,
    width: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
}

impl Kernel for GatedNorm<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let d = self.weight.len();
        let l = S::LANES;
        let w = self.weight.as_ptr();
        for r in self.r0..self.r1 {
            for g in (0..self.width).step_by(d) {
                // SAFETY: the caller checked that rows `r0..r1` of `x`,
                // `out` and `z` hold `width` values from these offsets.
                unsafe {
                    let xs = self.x.as_ptr().add(r * self.width + g);
                    let zs = self.z.as_ptr().add(r * self.z_stride + self.z_col + g);
                    let os = self.out.add(r * self.width + g);
                    let mut acc = S::zero();
                    let mut i = 0;
                    while i + l <= d {
                        let v = S::load(xs.add(i));
                        acc = S::fma(v, v, acc);
                        i += l;
                    }
                    let mut ss = S::hsum(acc);
                    for j in i..d {
                        ss = S::fma1(*xs.add(j), *xs.add(j), ss);
                    }
                    let inv = 1.0 / (ss / d as f32 + self.eps).sqrt();
                    let iv = S::splat(inv);
                    let mut i = 0;
                    while i + l <= d {
                        let n = S::mul(S::mul(S::load(xs.add(i)), iv), S::load(w.add(i)));
                        let zv = S::load(zs.add(i));
                        let e = S::exp(S::sub(S::zero(), zv));
                        let silu = S::div(zv, S::add(S::splat(1.0), e));
                        S::store(os.add(i), S::mul(n, silu));
                        i += l;
                    }
                    for j in i..d {
                        let zv = *zs.add(j);
                        *os.add(j) = *xs.add(j) * inv * *w.add(j) * (zv / (1.0 + (-zv).exp()));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn gated_norm_matches_f64_reference_at_every_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let levels: Vec<SimdLevel> = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect();
        let pool = ThreadPool::new(3);
        for &(rows, heads, d) in &[
            (1usize, 1usize, 16usize),
            (3, 4, 13),
            (100, 2, 128),
            (70, 3, 40),
        ] {
            let width = heads * d;
            let (z_stride, z_col) = (width + 9, 5);
            let x: Vec<f32> = (0..rows * width)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let z: Vec<f32> = (0..rows * z_stride)
                .map(|_| rng.random_range(-12.0..12.0))
                .collect();
            let w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5..1.5)).collect();
            let eps = 1e-6;
            for &level in &levels {
                let mut out = vec![f32::NAN; rows * width];
                rms_norm_gated_at(
                    level, &pool, &x, &z, z_stride, z_col, &w, eps, rows, width, &mut out,
                );
                for r in 0..rows {
                    for h in 0..heads {
                        let xs = &x[r * width + h * d..][..d];
                        let ms = xs.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
                        let inv = 1.0 / (ms + eps as f64).sqrt();
                        for i in 0..d {
                            let zv = z[r * z_stride + z_col + h * d + i] as f64;
                            let want = w[i] as f64 * xs[i] as f64 * inv * zv / (1.0 + (-zv).exp());
                            let got = out[r * width + h * d + i] as f64;
                            assert!(
                                (got - want).abs() <= 2e-6 * want.abs().max(1.0),
                                "{level:?} rows {rows} d {d} [{r}][{h}][{i}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
