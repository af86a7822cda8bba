//! A small lane abstraction the activation and attention kernels are written
//! against once, then instantiated for AVX-512 (16 lanes), AVX2 (8 lanes) and
//! plain scalar code (1 lane).
//!
//! Every method is `#[inline(always)]` and has no `#[target_feature]` of its
//! own: a kernel generic over [`Simd`] is itself `#[inline(always)]` and is
//! called from a small entry function carrying the `#[target_feature]`
//! attribute, so the whole kernel, intrinsics included, is compiled into that
//! entry with the wider instruction set enabled. Callers must only reach an
//! entry for a level the CPU supports (see [`crate::cpu::simd_level`]); that
//! is the safety contract of every `unsafe fn` here.

#![allow(clippy::missing_safety_doc)]

use crate::cpu::SimdLevel;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Vector operations over `LANES` f32 lanes. Pointers are unaligned and must
/// be valid for `LANES` elements.
pub(crate) trait Simd: Copy + 'static {
    /// f32 lanes per vector.
    const LANES: usize;
    /// The register type.
    type V: Copy;

    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, fused where the hardware has it.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Sum of the lanes.
    unsafe fn hsum(v: Self::V) -> f32;
    /// Maximum of the lanes.
    unsafe fn hmax(v: Self::V) -> f32;
    /// Lane-wise `if a > b { -inf } else { s }`: the causal mask, with `a`
    /// the key positions and `b` the query positions.
    unsafe fn mask_gt(a: Self::V, b: Self::V, s: Self::V) -> Self::V;
    /// Lane-wise `if a < b { x } else { y }` (false where either is NaN).
    unsafe fn select_lt(a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    /// Lane-wise `|v|`.
    unsafe fn abs(v: Self::V) -> Self::V;
    /// Lane-wise `e^x`, within a couple of ulp; exactly 0 below about -87.3
    /// (so masked `-inf` scores contribute nothing) and finite above 88.3.
    unsafe fn exp(x: Self::V) -> Self::V;
    /// `a * b + c` on one value, rounded exactly as one lane of
    /// [`Simd::fma`] is (fused or not alike), so a kernel's scalar tail
    /// computes what its vector lanes do.
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32;
    /// `LANES` IEEE half floats at `p`, widened.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// `LANES` bfloat16 values at `p`, widened.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// Widens `n` IEEE half floats at `src` into f32 at `dst`.
    unsafe fn f16_to_f32(src: *const u16, dst: *mut f32, n: usize);
    /// Widens `n` bfloat16 values at `src` into f32 at `dst`.
    unsafe fn bf16_to_f32(src: *const u16, dst: *mut f32, n: usize);
}

/// Plain Rust, one lane: the fallback for CPUs without AVX2 and the path the
/// other levels are tested against.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Simd for Scalar {
    const LANES: usize = 1;
    type V = f32;

    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        unsafe { p.read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        unsafe { p.write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        // Not `mul_add`: without hardware FMA that is a slow libm call.
        a * b + c
    }
    #[inline(always)]
    unsafe fn hsum(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn hmax(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn mask_gt(a: f32, b: f32, s: f32) -> f32 {
        if a > b {
            f32::NEG_INFINITY
        } else {
            s
        }
    }
    #[inline(always)]
    unsafe fn select_lt(a: f32, b: f32, x: f32, y: f32) -> f32 {
        if a < b {
            x
        } else {
            y
        }
    }
    #[inline(always)]
    unsafe fn abs(v: f32) -> f32 {
        v.abs()
    }
    #[inline(always)]
    unsafe fn exp(x: f32) -> f32 {
        x.exp()
    }
    #[inline(always)]
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> f32 {
        unsafe { half::f16::from_bits(*p).to_f32() }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> f32 {
        unsafe { bf16_bits_to_f32(*p) }
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        for i in 0..n {
            unsafe { *dst.add(i) = half::f16::from_bits(*src.add(i)).to_f32() };
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        for i in 0..n {
            unsafe { *dst.add(i) = bf16_bits_to_f32(*src.add(i)) };
        }
    }
}

/// bf16 is the top half of an f32, so widening is a shift.
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

// Constants of the vector exp: x = n·ln2 + r with |r| ≤ ln2/2, e^r from a
// degree-7 polynomial (the Cephes expf coefficients), 2^n built in the
// exponent bits. ln2 is split in two so n·ln2 is subtracted without losing r.
const EXP_LO: f32 = -87.33654;
const EXP_HI: f32 = 88.3;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// AVX2 + FMA + F16C, 8 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }
    #[inline(always)]
    unsafe fn mask_gt(a: __m256, b: __m256, s: __m256) -> __m256 {
        unsafe {
            let m = _mm256_cmp_ps::<_CMP_GT_OQ>(a, b);
            _mm256_blendv_ps(s, _mm256_set1_ps(f32::NEG_INFINITY), m)
        }
    }
    #[inline(always)]
    unsafe fn select_lt(a: __m256, b: __m256, x: __m256, y: __m256) -> __m256 {
        unsafe { _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)) }
    }
    #[inline(always)]
    unsafe fn abs(v: __m256) -> __m256 {
        unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), v) }
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        unsafe {
            let lo = _mm256_set1_ps(EXP_LO);
            let xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(EXP_HI));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let r2 = _mm256_mul_ps(r, r);
            let y = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            let y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
            _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo))
        }
    }
    #[inline(always)]
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
        // One fused rounding, as `_mm256_fmadd_ps` (an FMA instruction here:
        // the entry enables `fma`).
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        unsafe {
            let mut i = 0;
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.add(i) as *const __m128i);
                _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
            Scalar::f16_to_f32(src.add(i), dst.add(i), n - i);
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        unsafe {
            let mut i = 0;
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.add(i) as *const __m128i);
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
                i += 8;
            }
            Scalar::bf16_to_f32(src.add(i), dst.add(i), n - i);
        }
    }
}

/// AVX-512 F/BW/VL (+ FMA, F16C), 16 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn hmax(v: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(v) }
    }
    #[inline(always)]
    unsafe fn mask_gt(a: __m512, b: __m512, s: __m512) -> __m512 {
        unsafe {
            let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b);
            _mm512_mask_blend_ps(m, s, _mm512_set1_ps(f32::NEG_INFINITY))
        }
    }
    #[inline(always)]
    unsafe fn select_lt(a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), y, x) }
    }
    #[inline(always)]
    unsafe fn abs(v: __m512) -> __m512 {
        unsafe { _mm512_abs_ps(v) }
    }
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        unsafe {
            let lo = _mm512_set1_ps(EXP_LO);
            let xc = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(EXP_HI));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
            );
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
            let mut p = _mm512_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            let r2 = _mm512_mul_ps(r, r);
            let y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
            let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            let y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
            let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
            _mm512_mask_blend_ps(under, y, _mm512_setzero_ps())
        }
    }
    #[inline(always)]
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        unsafe {
            let mut i = 0;
            while i + 16 <= n {
                let h = _mm256_loadu_si256(src.add(i) as *const __m256i);
                _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
                i += 16;
            }
            Avx2::f16_to_f32(src.add(i), dst.add(i), n - i);
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u16, dst: *mut f32, n: usize) {
        unsafe {
            let mut i = 0;
            while i + 16 <= n {
                let h = _mm256_loadu_si256(src.add(i) as *const __m256i);
                let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(dst.add(i), _mm512_castsi512_ps(w));
                i += 16;
            }
            Avx2::bf16_to_f32(src.add(i), dst.add(i), n - i);
        }
    }
}

/// Hints the CPU to bring the cache line holding `p` into its outer caches
/// only (`prefetcht2`): the software prefetch of the quantized matmuls'
/// weights and of decode attention's KV cache. Both read their data once
/// per step, so all a prefetch has to do is take the DRAM latency out of
/// the loads, and a line fetched into L2 does that (an L2 hit's latency
/// hides behind the arithmetic). `prefetcht0` fetched into L1, where each
/// line in flight holds one of the core's few L1 miss buffers, and memory
/// and arithmetic then ran in series: on Zen 4 (decode bench, 1B shapes,
/// Q4_0, 4 tokens, 1 thread) 54–58 ms a step with `prefetcht0` against 37
/// with `prefetcht2`, the arithmetic alone taking ~34. Decode attention
/// (`cargo bench -p pagoda-accel --bench attention -- decode`, 2 threads,
/// alternating): b16 ctx256 32/8×64 0.63–0.71 → 0.51–0.61 ms, b16 ctx192
/// 9/3×64 0.205–0.242 → 0.154–0.176. Never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64, and prefetching has no memory effects.
    unsafe {
        _mm_prefetch::<_MM_HINT_T2>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A kernel written once over [`Simd`]; [`dispatch`] runs it at a level.
pub(crate) trait Kernel {
    /// What the kernel returns.
    type Output;
    /// Runs the kernel with lanes `S`. Implementations are
    /// `#[inline(always)]` so that they compile into the `#[target_feature]`
    /// entry below.
    ///
    /// # Safety
    /// The CPU must support the instructions `S` uses.
    unsafe fn run<S: Simd>(self) -> Self::Output;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn entry_avx512<K: Kernel>(k: K) -> K::Output {
    unsafe { k.run::<Avx512>() }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn entry_avx2<K: Kernel>(k: K) -> K::Output {
    unsafe { k.run::<Avx2>() }
}

/// Runs `k` with the lanes of `level`.
///
/// # Safety
/// `level` must be at most [`crate::cpu::simd_level`] (what this CPU
/// supports): the public kernels pass `simd_level()` itself, the
/// level-explicit internal entries call [`check_level`] first.
#[inline(always)]
pub(crate) unsafe fn dispatch<K: Kernel>(level: SimdLevel, k: K) -> K::Output {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => unsafe { entry_avx512(k) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { entry_avx2(k) },
        _ => unsafe { k.run::<Scalar>() },
    }
}

/// Asserts that `level` can run on this CPU, so that a level-explicit entry
/// given a wrong level panics instead of executing illegal instructions.
pub(crate) fn check_level(level: SimdLevel) {
    assert!(
        level <= crate::cpu::simd_level(),
        "SIMD level {level:?} requested but only {:?} is available",
        crate::cpu::simd_level()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies each level's vector primitives to whole vectors of `x`.
    struct Probe<'a> {
        x: &'a [f32],
        exp: &'a mut [f32],
        /// `fma` of triples of `x`: lane 0 of the vector op, then `fma1`.
        fma: &'a mut [[f32; 2]],
        /// 16-bit values, read one vector at a time as f16 and as bf16.
        bits: &'a [u16],
        f16: &'a mut [f32],
        bf16: &'a mut [f32],
    }

    impl Kernel for Probe<'_> {
        type Output = ();
        #[inline(always)]
        unsafe fn run<S: Simd>(self) {
            let l = S::LANES;
            unsafe {
                for i in (0..self.x.len() - self.x.len() % l).step_by(l) {
                    S::store(
                        self.exp.as_mut_ptr().add(i),
                        S::exp(S::load(self.x.as_ptr().add(i))),
                    );
                }
                let mut lane = [0.0f32; 16];
                for (t, out) in self.fma.iter_mut().enumerate() {
                    let (a, b, c) = (self.x[3 * t], self.x[3 * t + 1], self.x[3 * t + 2]);
                    S::store(
                        lane.as_mut_ptr(),
                        S::fma(S::splat(a), S::splat(b), S::splat(c)),
                    );
                    *out = [lane[0], S::fma1(a, b, c)];
                }
                for i in (0..self.bits.len()).step_by(l) {
                    let at = self.bits.as_ptr().add(i);
                    S::store(self.f16.as_mut_ptr().add(i), S::load_f16(at));
                    S::store(self.bf16.as_mut_ptr().add(i), S::load_bf16(at));
                }
            }
        }
    }

    #[test]
    fn exp_fma1_and_widening_at_every_level() {
        let mut x: Vec<f32> = (0..4096)
            .map(|i| -100.0 + i as f32 * (188.0 / 4096.0))
            .collect();
        x[..8].copy_from_slice(&[
            f32::NEG_INFINITY,
            -87.4,
            -87.3,
            -20.0,
            -1e-3,
            0.0,
            1e-3,
            88.0,
        ]);
        // Triples for fma: a product that rounds differently fused.
        let e = 1.0 + f32::EPSILON * 2048.0;
        let mut y: Vec<f32> = vec![e, e, -(1.0 + f32::EPSILON * 4096.0)];
        y.extend((0..300).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173));
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
            if level > crate::cpu::simd_level() {
                continue;
            }
            let mut e = vec![f32::NAN; x.len()];
            let mut fma = vec![[0.0f32; 2]; y.len() / 3];
            // Every sign, exponent (subnormals, infinities, NaNs) and the
            // low and high mantissa bits.
            let bits: Vec<u16> = (0..1024u16).map(|i| (i << 6) | (i & 0x3f)).collect();
            let (mut f16, mut bf16) = (vec![0.0f32; bits.len()], vec![0.0f32; bits.len()]);
            unsafe {
                dispatch(
                    level,
                    Probe {
                        x: &x,
                        exp: &mut e,
                        fma: &mut fma,
                        bits: &bits,
                        f16: &mut f16,
                        bf16: &mut bf16,
                    },
                )
            };
            for (&xi, &ei) in x.iter().zip(&e) {
                let want = (xi as f64).exp();
                if xi < EXP_LO {
                    // Vector code flushes to exactly 0; libm may return a
                    // subnormal-sized value.
                    assert!((0.0..1.2e-38).contains(&ei), "{level:?} exp({xi}) = {ei}");
                } else {
                    assert!(
                        ((ei as f64) - want).abs() <= 4e-7 * want,
                        "{level:?} exp({xi}) = {ei}, want {want}"
                    );
                }
            }
            for (t, &[vector, scalar]) in fma.iter().enumerate() {
                assert_eq!(
                    vector.to_bits(),
                    scalar.to_bits(),
                    "{level:?} fma of triple {t}: lane {vector}, fma1 {scalar}"
                );
            }
            for (k, &b) in bits.iter().enumerate() {
                let (want16, want_bf) = (half::f16::from_bits(b), half::bf16::from_bits(b));
                for (got, want) in [(f16[k], want16.to_f32()), (bf16[k], want_bf.to_f32())] {
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{level:?} widening {b:#06x}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
