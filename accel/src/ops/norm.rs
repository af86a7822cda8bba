//! RMSNorm and residual adds.
//!
//! These are memory-bound and a tiny share of a step's time, so they are plain
//! loops shaped for the auto-vectorizer rather than hand-written SIMD.

/// Partial sums kept apart so the compiler can vectorize the reduction
/// (float adds are not reassociated otherwise); 16 = one AVX-512 register.
const ACC: usize = 16;

/// Sum of squares of `x`, in f32 with `ACC` independent partial sums (the
/// same precision llama.cpp uses; the partial sums also keep the rounding
/// error well below the f32 epsilon times the row length).
#[inline]
fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; ACC];
    let chunks = x.chunks_exact(ACC);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..ACC {
            acc[i] += c[i] * c[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for &v in tail {
        s += v * v;
    }
    s
}

/// RMSNorm: `out[i] = x[i] / sqrt(mean(x_row²) + eps) * weight[i]`, for every
/// row of `x` (rows of length `weight.len()`).
///
/// `x` and `out` are `[n_rows, dim]` with `dim = weight.len()`.
///
/// # Panics
/// If `x.len() != out.len()` or `x.len()` is not a multiple of `dim`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm: length not a multiple of dim"
    );
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let inv = 1.0 / (sum_sq(xr) / dim as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// [`rms_norm`] writing the result back into `x`.
///
/// # Panics
/// If `x.len()` is not a multiple of `weight.len()`.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm_inplace: length not a multiple of dim"
    );
    for xr in x.chunks_exact_mut(dim) {
        let inv = 1.0 / (sum_sq(xr) / dim as f32 + eps).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// `x += y` elementwise (the residual adds).
///
/// # Panics
/// If the lengths differ.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add_inplace: lengths differ");
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
        let dim = w.len();
        let mut out = Vec::new();
        for row in x.chunks(dim) {
            let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            out.extend(row.iter().zip(w).map(|(&v, &w)| v as f64 * inv * w as f64));
        }
        out
    }

    #[test]
    fn rms_norm_matches_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for &(rows, dim) in &[(1usize, 1usize), (3, 7), (2, 64), (5, 4096), (1, 33)] {
            let x: Vec<f32> = (0..rows * dim)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let w: Vec<f32> = (0..dim).map(|_| rng.random_range(0.5..1.5)).collect();
            let eps = 1e-5;
            let want = reference(&x, &w, eps);
            let mut out = vec![0.0; x.len()];
            rms_norm(&x, &w, eps, &mut out);
            let mut inplace = x.clone();
            rms_norm_inplace(&mut inplace, &w, eps);
            for i in 0..x.len() {
                let tol = 1e-5 * want[i].abs().max(1.0);
                assert!(
                    (out[i] as f64 - want[i]).abs() < tol,
                    "{rows}x{dim} [{i}]: {} vs {}",
                    out[i],
                    want[i]
                );
                assert_eq!(out[i], inplace[i]);
            }
        }
    }

    #[test]
    fn rms_norm_eps_dominates_zero_rows() {
        let x = vec![0.0f32; 8];
        let w = vec![1.0f32; 4];
        let mut out = vec![1.0; 8];
        rms_norm(&x, &w, 1e-6, &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn add_inplace_adds() {
        let mut x = vec![1.0f32, 2.0, 3.0];
        add_inplace(&mut x, &[0.5, -2.0, 4.0]);
        assert_eq!(x, [1.5, 0.0, 7.0]);
    }
}
