//! Activation quantization: each lane block of `L` elements becomes 8-bit
//! codes in `[-127, 127]` with an f32 scale `amax / 127`, laid out in the
//! same interleaved order as the weight codes ([`super::layout`]).
//!
//! One implementation serves every SIMD level (it is only compiled with
//! different target features, and Rust never contracts or reorders float
//! operations), so every kernel sees bit-identical activations.

use crate::cpu::SimdLevel;

/// Quantizes one row `x` (`lanes · l` elements) into `q` (same length),
/// per-lane scales `d`, code sums `sum`, and `s = d · sum`.
#[inline(always)]
fn quantize_row_impl(l: usize, x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], s: &mut [f32]) {
    let lanes = x.len() / l;
    let mut tmp = [0i8; 32];
    for b in 0..lanes {
        let xb = &x[b * l..(b + 1) * l];
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut acc = 0i32;
        for (t, &v) in tmp[..l].iter_mut().zip(xb) {
            // Ties to even matches the SIMD rounding instruction, so this
            // loop vectorizes; the clamp keeps -128 out (AVX2's sign trick
            // needs |a| <= 127) and absorbs rounding of `amax · id` above 127.
            let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i32;
            *t = r as i8;
            acc += r;
        }
        d[b] = db;
        sum[b] = acc;
        s[b] = db * acc as f32;
        // Scatter into the interleaved layout: chunk c of lane j of group g.
        let (g, j) = (b / 16, b % 16);
        let gl = (lanes - 16 * g).min(16);
        let base = 16 * g * l;
        for c in 0..l / 4 {
            let at = base + c * 4 * gl + 4 * j;
            q[at..at + 4].copy_from_slice(&tmp[4 * c..4 * c + 4]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(l: usize, x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], s: &mut [f32]) {
    quantize_row_impl(l, x, q, d, sum, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn quantize_row_avx512(l: usize, x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], s: &mut [f32]) {
    quantize_row_impl(l, x, q, d, sum, s)
}

/// Quantizes one activation row; see [`quantize_row_impl`]. `level` only
/// selects how the (identical) code is compiled.
pub(crate) fn quantize_row(
    level: SimdLevel,
    l: usize,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [i32],
    s: &mut [f32],
) {
    debug_assert_eq!(x.len() % l, 0);
    match level {
        // SAFETY: the level was clamped to what the CPU supports.
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512Vnni => unsafe { quantize_row_avx512(l, x, q, d, sum, s) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { quantize_row_avx2(l, x, q, d, sum, s) },
        _ => quantize_row_impl(l, x, q, d, sum, s),
    }
}
