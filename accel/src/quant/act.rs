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
fn quantize_row_impl(
    l: usize,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [i32],
    s: &mut [f32],
) {
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
unsafe fn quantize_row_avx2(
    l: usize,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [i32],
    s: &mut [f32],
) {
    quantize_row_impl(l, x, q, d, sum, s)
}

/// The explicit AVX-512 version of [`quantize_row_impl`], bit-identical to
/// it: the max of absolute values is exact in any order, `v · id` is one
/// IEEE multiply, `vrndscaleps` rounds ties to even, and the clamp and the
/// conversion of integral floats are exact.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn quantize_row_avx512(
    l: usize,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [i32],
    s: &mut [f32],
) {
    use core::arch::x86_64::*;
    let lanes = x.len() / l;
    let nv = l / 16;
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let mut tmp = [0i8; 32];
    for b in 0..lanes {
        let p = x.as_ptr().add(b * l);
        let v0 = _mm512_loadu_ps(p);
        let v1 = if nv == 2 {
            _mm512_loadu_ps(p.add(16))
        } else {
            _mm512_setzero_ps()
        };
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let db = amax / 127.0;
        let id = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let quant = |v: __m512| {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, id),
            );
            _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi))
        };
        let q0 = quant(v0);
        let q1 = quant(v1);
        let acc = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        _mm_storeu_si128(tmp.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(
            tmp.as_mut_ptr().add(16) as *mut __m128i,
            _mm512_cvtepi32_epi8(q1),
        );
        d[b] = db;
        sum[b] = acc;
        s[b] = db * acc as f32;
        let (g, j) = (b / 16, b % 16);
        let gl = (lanes - 16 * g).min(16);
        let base = 16 * g * l;
        for c in 0..l / 4 {
            let at = base + c * 4 * gl + 4 * j;
            q[at..at + 4].copy_from_slice(&tmp[4 * c..4 * c + 4]);
        }
    }
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
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => unsafe {
            quantize_row_avx512(l, x, q, d, sum, s)
        },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { quantize_row_avx2(l, x, q, d, sum, s) },
        _ => quantize_row_impl(l, x, q, d, sum, s),
    }
}
