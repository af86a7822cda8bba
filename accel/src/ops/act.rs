//! Activations: SiLU·mul for the gated MLP, the sigmoid output gate of the
//! hybrid Qwen models' attention, and (log-)softmax for sampling.
//!
//! Both are dominated by `exp`, which libm computes one element at a time;
//! with an FFN of 14k and a 1000-token prompt that is ~14M calls per layer, so
//! these use the vector `exp` of [`super::simd`] at the detected SIMD level.

use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};

/// SwiGLU's gating: `out[r][i] = silu(gate[r][i]) * up[r][i]` where
/// `silu(g) = g / (1 + e^-g)`.
///
/// `gate_up` is `[n_rows, 2*ffn]`, each row `[gate (ffn) | up (ffn)]` (the
/// fused gate/up projection's output); `out` is `[n_rows, ffn]`.
///
/// # Panics
/// If the lengths do not describe the same number of rows.
pub fn silu_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    silu_mul_at(simd_level(), gate_up, ffn, out)
}

/// [`silu_mul`] at an explicit SIMD level (tests cover every level).
pub(crate) fn silu_mul_at(level: SimdLevel, gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    check_level(level);
    assert!(ffn > 0, "silu_mul: ffn must be positive");
    assert_eq!(
        gate_up.len(),
        2 * out.len(),
        "silu_mul: gate_up must be twice out"
    );
    assert_eq!(
        out.len() % ffn,
        0,
        "silu_mul: out is not a whole number of rows"
    );
    // SAFETY: `check_level` confirmed the CPU supports `level`.
    unsafe { dispatch(level, SiluMul { gate_up, ffn, out }) }
}

/// GPT-OSS's clamped SwiGLU: with `g = min(gate, limit)` and `u =
/// clamp(up, -limit, limit)`, `out = (u + 1) · g · sigmoid(alpha · g)`.
///
/// `gate_up` is `[n_rows, 2*ffn]`, each row `[gate (ffn) | up (ffn)]`
/// (the checkpoint's interleaved columns are split at load); `out` is
/// `[n_rows, ffn]`. Scalar f32, as transformers computes it.
///
/// # Panics
/// If the lengths do not describe the same number of rows.
pub fn swiglu_clamped(gate_up: &[f32], ffn: usize, alpha: f32, limit: f32, out: &mut [f32]) {
    assert!(ffn > 0, "swiglu_clamped: ffn must be positive");
    assert_eq!(
        gate_up.len(),
        2 * out.len(),
        "swiglu_clamped: gate_up must be twice out"
    );
    for (gu, o) in gate_up.chunks_exact(2 * ffn).zip(out.chunks_exact_mut(ffn)) {
        let (g, u) = gu.split_at(ffn);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
            *o = (u + 1.0) * glu;
        }
    }
}

struct SiluMul<'a> {
    gate_up: &'a [f32],
    ffn: usize,
    out: &'a mut [f32],
}

impl Kernel for SiluMul<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let ffn = self.ffn;
        let l = S::LANES;
        for (gu, o) in self
            .gate_up
            .chunks_exact(2 * ffn)
            .zip(self.out.chunks_exact_mut(ffn))
        {
            let (g, u) = gu.split_at(ffn);
            let mut i = 0;
            // SAFETY: i + l <= ffn, and g, u, o all hold ffn elements.
            unsafe {
                while i + l <= ffn {
                    let gv = S::load(g.as_ptr().add(i));
                    let e = S::exp(S::sub(S::zero(), gv));
                    let s = S::div(gv, S::add(S::splat(1.0), e));
                    S::store(o.as_mut_ptr().add(i), S::mul(s, S::load(u.as_ptr().add(i))));
                    i += l;
                }
            }
            for j in i..ffn {
                o[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
            }
        }
    }
}

/// Softmax over all of `x`, in place. Subtracts the maximum first, so large
/// logits do not overflow. `x` must hold at least one finite value.
pub fn softmax_inplace(x: &mut [f32]) {
    softmax_at(simd_level(), x, false)
}

/// `x[i] - log(Σ e^x)` over all of `x`, in place: log-probabilities, without
/// the underflow of taking `log` of a softmax.
pub fn log_softmax_inplace(x: &mut [f32]) {
    softmax_at(simd_level(), x, true)
}

/// Softmax (`log == false`) or log-softmax at an explicit SIMD level.
pub(crate) fn softmax_at(level: SimdLevel, x: &mut [f32], log: bool) {
    check_level(level);
    if x.is_empty() {
        return;
    }
    // SAFETY: `check_level` confirmed the CPU supports `level`.
    unsafe { dispatch(level, Softmax { x, log }) }
}

struct Softmax<'a> {
    x: &'a mut [f32],
    log: bool,
}

/// Elements summed in f32 lanes before the partial sum is added in f64:
/// keeps the sum accurate over a 150k-entry vocabulary at no cost.
const SUM_BLOCK: usize = 1024;

impl Kernel for Softmax<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let x = self.x;
        let n = x.len();
        let l = S::LANES;
        let p = x.as_mut_ptr();
        let nv = n - n % l;
        // SAFETY (all pointer accesses below): indices stay below `nv`, a
        // multiple of the lane count not above `n`, or go through `x[..]`.
        let mut mx = f32::NEG_INFINITY;
        unsafe {
            let mut m = S::splat(f32::NEG_INFINITY);
            for i in (0..nv).step_by(l) {
                m = S::max(m, S::load(p.add(i)));
            }
            mx = mx.max(S::hmax(m));
        }
        for &v in &x[nv..] {
            mx = mx.max(v);
        }
        let mv = unsafe { S::splat(mx) };
        let mut total = 0.0f64;
        let mut start = 0;
        while start < nv {
            let end = (start + SUM_BLOCK).min(nv);
            unsafe {
                let mut s = S::zero();
                for i in (start..end).step_by(l) {
                    let e = S::exp(S::sub(S::load(p.add(i)), mv));
                    if !self.log {
                        S::store(p.add(i), e);
                    }
                    s = S::add(s, e);
                }
                total += S::hsum(s) as f64;
            }
            start = end;
        }
        for v in &mut x[nv..] {
            let e = (*v - mx).exp();
            if !self.log {
                *v = e;
            }
            total += e as f64;
        }
        if self.log {
            let lse = mx + (total.ln() as f32);
            for v in x.iter_mut() {
                *v -= lse;
            }
        } else {
            let inv = (1.0 / total) as f32;
            for v in x.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// The output gate of gated attention (Qwen3-Next, Qwen3.5):
/// `x[r][j] *= sigmoid(gate[r·gate_stride + gate_col + j])` for `rows` rows
/// of `width` (`x: [rows, width]`; the gate may sit inside a wider
/// projection's output). Plain scalar code: it touches each attention
/// output once, next to a matmul over the same rows.
///
/// # Panics
/// If `x` or `gate` holds fewer than `rows` rows of `width`.
pub fn mul_sigmoid(
    x: &mut [f32],
    gate: &[f32],
    gate_stride: usize,
    gate_col: usize,
    rows: usize,
    width: usize,
) {
    assert!(
        x.len() >= rows * width,
        "mul_sigmoid: x holds fewer than {rows} rows of {width}"
    );
    assert!(
        gate_col + width <= gate_stride
            && (rows == 0 || gate.len() >= (rows - 1) * gate_stride + gate_col + width),
        "mul_sigmoid: gate holds fewer than {rows} rows of {width} at column {gate_col}"
    );
    for (r, xr) in x[..rows * width].chunks_exact_mut(width).enumerate() {
        let g = &gate[r * gate_stride + gate_col..][..width];
        for (v, &g) in xr.iter_mut().zip(g) {
            // torch's float32 sigmoid: 1 / (1 + e^-g).
            *v *= 1.0 / (1.0 + (-g).exp());
        }
    }
}

/// GeGLU with the tanh approximation of GELU (transformers'
/// `gelu_pytorch_tanh`, Gemma's MLP): `out[r][i] = gelu_tanh(gate[r][i]) ·
/// up[r][i]`, where `gelu_tanh(g) = g/2 · (1 + tanh(√(2/π) · (g + 0.044715
/// g³)))`, in float32 as torch computes it. `gate_up` is `[rows, 2·ffn]`,
/// each row `[gate | up]`; `out` is `[rows, ffn]`.
///
/// # Panics
/// If the lengths do not describe the same number of rows.
pub fn gelu_tanh_mul(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    assert!(ffn > 0, "gelu_tanh_mul: ffn must be positive");
    assert_eq!(
        gate_up.len(),
        2 * out.len(),
        "gelu_tanh_mul: gate_up must be twice out"
    );
    assert_eq!(
        out.len() % ffn,
        0,
        "gelu_tanh_mul: out is not a whole number of rows"
    );
    // torch's constants: kBeta = √2 · (2/√π) · ½, kKappa = 0.044715.
    let beta = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    let kappa = 0.044715f32;
    for (gu, o) in gate_up.chunks_exact(2 * ffn).zip(out.chunks_exact_mut(ffn)) {
        let (g, u) = gu.split_at(ffn);
        for ((o, &x), &u) in o.iter_mut().zip(g).zip(u) {
            let inner = beta * (x + kappa * x * x * x);
            *o = 0.5 * x * (1.0 + inner.tanh()) * u;
        }
    }
}

/// `x[i] *= s` for every element.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// Logit soft-capping (Gemma's `final_logit_softcapping`): `x[i] =
/// tanh(x[i] / cap) · cap`, as transformers computes it.
pub fn softcap_inplace(x: &mut [f32], cap: f32) {
    for v in x {
        *v = (*v / cap).tanh() * cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn levels() -> Vec<SimdLevel> {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect()
    }

    #[test]
    fn swiglu_clamped_matches_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let (alpha, limit) = (1.702f32, 7.0f32);
        for &(rows, ffn) in &[(1usize, 1usize), (3, 13), (2, 64)] {
            let mut gu: Vec<f32> = (0..rows * 2 * ffn)
                .map(|_| rng.random_range(-12.0..12.0))
                .collect();
            // Both sides of both clamps, and exp's overflow region.
            gu[0] = -100.0;
            gu[ffn] = 9.0;
            if ffn > 2 {
                gu[1] = 8.5;
                gu[ffn + 1] = -8.5;
            }
            let mut out = vec![f32::NAN; rows * ffn];
            swiglu_clamped(&gu, ffn, alpha, limit, &mut out);
            for r in 0..rows {
                for i in 0..ffn {
                    let g = (gu[r * 2 * ffn + i] as f64).min(limit as f64);
                    let u = (gu[r * 2 * ffn + ffn + i] as f64).clamp(-7.0, 7.0);
                    let want = (u + 1.0) * g / (1.0 + (-(g * alpha as f64)).exp());
                    let got = out[r * ffn + i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                        "{rows}x{ffn} [{r},{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn silu_mul_matches_reference_at_every_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for level in levels() {
            for &(rows, ffn) in &[(1usize, 1usize), (3, 13), (2, 64), (4, 1000)] {
                let mut gu: Vec<f32> = (0..rows * 2 * ffn)
                    .map(|_| rng.random_range(-12.0..12.0))
                    .collect();
                // Extremes: exp overflow/underflow regions.
                gu[0] = -100.0;
                if ffn > 2 {
                    gu[1] = 95.0;
                    gu[2] = 0.0;
                }
                let mut out = vec![f32::NAN; rows * ffn];
                silu_mul_at(level, &gu, ffn, &mut out);
                for r in 0..rows {
                    for i in 0..ffn {
                        let g = gu[r * 2 * ffn + i] as f64;
                        let u = gu[r * 2 * ffn + ffn + i] as f64;
                        let want = g / (1.0 + (-g).exp()) * u;
                        let got = out[r * ffn + i] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                            "{level:?} {rows}x{ffn} [{r},{i}] g={g} u={u}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    fn reference(x: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        let soft = x.iter().map(|&v| (v as f64 - m).exp() / s).collect();
        let log = x.iter().map(|&v| v as f64 - m - s.ln()).collect();
        (soft, log)
    }

    #[test]
    fn softmax_and_log_softmax_match_reference_at_every_level() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for level in levels() {
            for &n in &[1usize, 5, 16, 17, 100, 3000, 152_064] {
                let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-20.0..20.0)).collect();
                // Large logits must not overflow (small n); a moderately
                // dominant one keeps the rest measurable (large n); -inf
                // (masked) must give exactly 0.
                x[0] = if n <= 17 { 1000.0 } else { 30.0 };
                if n > 3 {
                    x[3] = f32::NEG_INFINITY;
                }
                let (soft, log) = reference(&x);
                let mut s = x.clone();
                softmax_at(level, &mut s, false);
                let mut ls = x.clone();
                softmax_at(level, &mut ls, true);
                let total: f64 = s.iter().map(|&v| v as f64).sum();
                assert!((total - 1.0).abs() < 1e-5, "{level:?} n={n} sum {total}");
                for i in 0..n {
                    // x - max is rounded to f32 before exp, an error of
                    // half an ulp of |x - max| in the exponent.
                    let rel = 1e-6 + 1.2e-7 * log[i].abs().min(100.0);
                    assert!(
                        (s[i] as f64 - soft[i]).abs() <= rel * soft[i] + 1e-37,
                        "{level:?} n={n} softmax[{i}]: {} vs {}",
                        s[i],
                        soft[i]
                    );
                    if log[i].is_finite() {
                        assert!(
                            (ls[i] as f64 - log[i]).abs() <= 1e-4 + 1e-6 * log[i].abs(),
                            "{level:?} n={n} log_softmax[{i}]: {} vs {}",
                            ls[i],
                            log[i]
                        );
                    } else {
                        assert_eq!(ls[i], f32::NEG_INFINITY);
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_of_moderate_logits_is_accurate() {
        // With no single dominant logit every entry is tested at full
        // relative precision.
        for level in levels() {
            let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
            let (soft, _) = reference(&x);
            let mut s = x.clone();
            softmax_at(level, &mut s, false);
            for i in 0..x.len() {
                assert!(
                    (s[i] as f64 - soft[i]).abs() <= 2e-6 * soft[i],
                    "{level:?} [{i}]"
                );
            }
        }
    }

    #[test]
    fn mul_sigmoid_gates_each_column_by_its_own_gate_inside_a_wider_row() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (rows, width, stride, col) = (3usize, 5usize, 12usize, 4usize);
        let x: Vec<f32> = (0..rows * width)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let mut gate: Vec<f32> = (0..rows * stride)
            .map(|_| rng.random_range(-8.0..8.0))
            .collect();
        gate[col] = -100.0;
        gate[stride + col + 1] = 100.0;
        let mut got = x.clone();
        mul_sigmoid(&mut got, &gate, stride, col, rows, width);
        for r in 0..rows {
            for j in 0..width {
                let g = gate[r * stride + col + j] as f64;
                let want = x[r * width + j] as f64 / (1.0 + (-g).exp());
                let d = (got[r * width + j] as f64 - want).abs();
                assert!(
                    d <= 1e-6 * want.abs().max(1e-3),
                    "[{r},{j}]: {} vs {want}",
                    got[r * width + j]
                );
            }
        }
        assert!(
            got[0].abs() < 1e-30,
            "a very negative gate closes the output"
        );
        assert_eq!(
            got[width + 1],
            x[width + 1],
            "a very positive gate passes it"
        );
    }

    #[test]
    fn gelu_tanh_mul_softcap_and_scale_match_f64() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for &(rows, ffn) in &[(1usize, 1usize), (3, 13), (2, 64)] {
            let gu: Vec<f32> = (0..rows * 2 * ffn)
                .map(|_| rng.random_range(-8.0..8.0))
                .collect();
            let mut out = vec![f32::NAN; rows * ffn];
            gelu_tanh_mul(&gu, ffn, &mut out);
            for r in 0..rows {
                for i in 0..ffn {
                    let g = gu[r * 2 * ffn + i] as f64;
                    let u = gu[r * 2 * ffn + ffn + i] as f64;
                    let c = (2.0 / std::f64::consts::PI).sqrt();
                    let want = 0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u;
                    let got = out[r * ffn + i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "gelu_tanh({g})·{u}: {got} vs {want}"
                    );
                }
            }
        }
        let x: Vec<f32> = (0..50).map(|_| rng.random_range(-200.0..200.0)).collect();
        let mut y = x.clone();
        softcap_inplace(&mut y, 30.0);
        for (&a, &b) in x.iter().zip(&y) {
            let want = (a as f64 / 30.0).tanh() * 30.0;
            assert!(
                (b as f64 - want).abs() < 1e-5,
                "softcap({a}) = {b}, want {want}"
            );
            assert!(b.abs() <= 30.0);
        }
        let mut z = x.clone();
        scale_inplace(&mut z, 2.5);
        for (&a, &b) in x.iter().zip(&z) {
            assert_eq!(b, a * 2.5);
        }
    }
}
