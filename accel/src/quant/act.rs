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

/// The explicit AVX2 version of [`quantize_row_impl`], bit-identical to it
/// for the reasons [`quantize_row_avx512`] gives (`vroundps` rounds ties to
/// even). The compiler's vectorization of the generic loop left it at
/// several percent of a forced-AVX2 decode step once the matmul kernels
/// were reworked (issue 31).
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
    use core::arch::x86_64::*;
    let lanes = x.len() / l;
    // 8-float vectors per lane block: 4 (L = 32) or 2 (L = 16).
    let nv = l / 8;
    let sign = _mm256_set1_ps(-0.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // After the two saturating packs the 32-bit elements hold chunks
    // 0, 2, 4, 6, 1, 3, 5, 7 (the packs work within 128-bit halves).
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut tmp = [0i32; 8];
    for b in 0..lanes {
        let p = x.as_ptr().add(b * l);
        let mut v = [_mm256_setzero_ps(); 4];
        let mut mx = _mm256_setzero_ps();
        for k in 0..nv {
            v[k] = _mm256_loadu_ps(p.add(8 * k));
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        let mut qi = [_mm256_setzero_si256(); 4];
        let mut acc = _mm256_setzero_si256();
        for k in 0..nv {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v[k], id),
            );
            qi[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            acc = _mm256_add_epi32(acc, qi[k]);
        }
        // Codes are within [-127, 127], so the packs never saturate.
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(
                _mm256_packs_epi32(qi[0], qi[1]),
                _mm256_packs_epi32(qi[2], qi[3]),
            ),
            order,
        );
        _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, bytes);
        let a4 = _mm_add_epi32(
            _mm256_castsi256_si128(acc),
            _mm256_extracti128_si256::<1>(acc),
        );
        let a2 = _mm_add_epi32(a4, _mm_unpackhi_epi64(a4, a4));
        let total = _mm_cvtsi128_si32(_mm_add_epi32(a2, _mm_shuffle_epi32::<1>(a2)));
        d[b] = db;
        sum[b] = total;
        s[b] = db * total as f32;
        let (g, j) = (b / 16, b % 16);
        let gl = (lanes - 16 * g).min(16);
        let base = 16 * g * l;
        for c in 0..l / 4 {
            let at = base + c * 4 * gl + 4 * j;
            q[at..at + 4].copy_from_slice(&tmp[c].to_ne_bytes().map(|u| u as i8));
        }
    }
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
