//! Dense (f32 / f16 / bf16) matmul.
//!
//! Register-tiled SIMD dot products (4 weight rows × up to 4 activation
//! rows) that widen f16/bf16 to f32 in registers, so the weights stream in
//! their storage size. For prefill-sized `m` the activations are walked in
//! blocks that stay in L2 while a task's weight rows stay in L1.
//!
//! The `gemm` crate was measured as the alternative for large `m`: on this
//! project's Zen 4 it was no faster at m = 64 (≈ 75–85 GFLOP/s both, and
//! half the speed on 576×1536), and it allocates packing buffers on every
//! call, which the allocation-free contract of `Weight::matmul` forbids.

// The SIMD kernels index register tiles `acc[r][i]` by row and activation
// on purpose: iterator chains would obscure which registers are live.
#![allow(clippy::needless_range_loop)]

use super::layout::ABuf;
use super::{GgmlType, OutPtr};
use crate::cpu::pool::ThreadPool;
use crate::cpu::SimdLevel;

/// Activation rows per cache block (64 rows of a few thousand f32 stay in L2).
const M_BLOCK: usize = 64;

const T_F32: u8 = 0;
const T_F16: u8 = 1;
const T_BF16: u8 = 2;

fn tcode(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::F32 => T_F32,
        GgmlType::F16 => T_F16,
        _ => T_BF16,
    }
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Converts one row of `ty` elements (raw little-endian bytes) to f32.
pub(crate) fn row_to_f32(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
}

/// A shareable raw pointer to a buffer tasks use disjoint parts of.
#[derive(Clone, Copy)]
struct SPtr<T>(*mut T);
// SAFETY: tasks touch disjoint ranges; the pool joins before the borrow ends.
unsafe impl<T> Send for SPtr<T> {}
unsafe impl<T> Sync for SPtr<T> {}

/// `out[i][n] = Σ_k x[i][k] · W[n][k]` for a dense `W` (`rows × cols`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    ty: GgmlType,
    w: &ABuf,
    rows: usize,
    cols: usize,
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) {
    let o = OutPtr(out.as_mut_ptr());
    let wp = SPtr(w.ptr() as *mut u8);
    let xp = SPtr(x.as_ptr() as *mut f32);
    let t = tcode(ty);
    pool.run_ranges(rows, 4, &|r0, r1| {
        let (wp, xp, o) = (wp, xp, o);
        // SAFETY: rows r0..r1 are in range; outputs are disjoint per task.
        unsafe { run_rows(t, level, wp.0, cols, xp.0, m, r0, r1, o.0, rows) }
    });
}

/// Output columns per GEMM panel (two AVX-512 vectors).
const GEMM_NR: usize = 32;
/// Activation rows per GEMM register tile: `GEMM_MR × 2` accumulators, two
/// weight vectors and a broadcast fill 27 of the 32 AVX-512 registers.
const GEMM_MR: usize = 12;
/// Inner-dimension block: a packed panel of `GEMM_KC × GEMM_NR` f32 (24 KiB)
/// stays in L1 while the tiles of a row block stream past it.
const GEMM_KC: usize = 192;
/// Activation rows per block: `GEMM_MC × GEMM_KC` f32 (384 KiB) stay in L2
/// while a task's panels pass over them, each packed once per block.
/// (Measured on the 2-core Zen machine, BERT-base shapes at m = 512, one
/// thread's on-CPU time: 192 × 512 gave 223–274 GFLOP/s, 256 × 256 203–274,
/// 256 × 96 202–216, 768 × 64 152–166.)
const GEMM_MC: usize = 512;

/// `out[i][n] = Σ_k x[i][k] · W[n][k]` for a dense `W`, as [`matmul`], by a
/// cache-blocked GEMM for prefill-sized `m`: per block of activation rows and
/// of the inner dimension, each task packs its columns' weights, widened to
/// f32, one `[k][32]` panel at a time, and runs 12 × 32 register tiles of
/// broadcast activations against it.
///
/// Every output element is `Σ_k` in ascending `k` as one f32 FMA chain per
/// block of [`GEMM_KC`], the blocks' sums added in order: a function of its
/// activation row and weight row alone (not of `m`, the tile, the task or
/// the thread count), but not rounded as [`matmul`]'s dot products are, so
/// a caller must route a row here or there by a property of the row itself
/// (the engine: encoder rows, which never decode). Without AVX-512 it is
/// [`matmul`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    ty: GgmlType,
    w: &ABuf,
    rows: usize,
    cols: usize,
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(
        level,
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16
    ) {
        assert!(
            x.len() >= m * cols && out.len() >= m * rows,
            "gemm: x or out shorter than {m} rows"
        );
        let o = OutPtr(out.as_mut_ptr());
        let wp = SPtr(w.ptr() as *mut u8);
        let xp = SPtr(x.as_ptr() as *mut f32);
        let t = tcode(ty);
        pool.run_ranges(rows, GEMM_NR, &|r0, r1| {
            let (wp, xp, o) = (wp, xp, o);
            // SAFETY: the level has AVX-512; columns r0..r1 are in range and
            // owned by this task; x holds m rows of cols (asserted above).
            unsafe { x86::gemm_cols(t, wp.0, rows, cols, xp.0, m, r0, r1, o.0) }
        });
        return;
    }
    matmul(ty, w, rows, cols, level, pool, x, m, out)
}

#[allow(clippy::too_many_arguments)]
unsafe fn run_rows(
    t: u8,
    level: SimdLevel,
    w: *const u8,
    cols: usize,
    x: *const f32,
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mmax = match level {
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => 4,
        SimdLevel::Avx2 => 2,
        SimdLevel::Scalar => 1,
    };
    for mb in (0..m).step_by(M_BLOCK) {
        let me = (mb + M_BLOCK).min(m);
        run_block(t, level, mmax, w, cols, x, mb, me, r0, r1, out, ldo);
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn run_block(
    t: u8,
    level: SimdLevel,
    mmax: usize,
    w: *const u8,
    cols: usize,
    x: *const f32,
    mb: usize,
    me: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut r = r0;
    while r < r1 {
        let rt = if r1 - r >= 4 { 4 } else { 1 };
        let mut i = mb;
        while i < me {
            let mt = (me - i).min(mmax);
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => match t {
                    T_F32 => x86::d512::<T_F32>(rt, mt, w, cols, r, x, i, out, ldo),
                    T_F16 => x86::d512::<T_F16>(rt, mt, w, cols, r, x, i, out, ldo),
                    _ => x86::d512::<T_BF16>(rt, mt, w, cols, r, x, i, out, ldo),
                },
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => match t {
                    T_F32 => x86::d256::<T_F32>(rt, mt, w, cols, r, x, i, out, ldo),
                    T_F16 => x86::d256::<T_F16>(rt, mt, w, cols, r, x, i, out, ldo),
                    _ => x86::d256::<T_BF16>(rt, mt, w, cols, r, x, i, out, ldo),
                },
                _ => scalar_tile(t, rt, mt, w, cols, r, x, i, out, ldo),
            }
            i += mt;
        }
        r += rt;
    }
}

#[inline(always)]
unsafe fn load_scalar(t: u8, w: *const u8, idx: usize) -> f32 {
    match t {
        T_F32 => (w as *const f32).add(idx).read(),
        T_F16 => half::f16::from_bits((w as *const u16).add(idx).read()).to_f32(),
        _ => bf16_to_f32((w as *const u16).add(idx).read()),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn scalar_tile(
    t: u8,
    rt: usize,
    mt: usize,
    w: *const u8,
    cols: usize,
    r0: usize,
    x: *const f32,
    i0: usize,
    out: *mut f32,
    ldo: usize,
) {
    for r in r0..r0 + rt {
        for i in i0..i0 + mt {
            let mut acc = 0.0f32;
            for k in 0..cols {
                acc += load_scalar(t, w, r * cols + k) * *x.add(i * cols + k);
            }
            *out.add(i * ldo + r) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use core::arch::x86_64::*;

    macro_rules! dispatch {
        ($name:ident, $kernel:ident, $($m:literal),+) => {
            /// Calls the kernel instantiated for this tile shape.
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $name<const T: u8>(
                rt: usize, mt: usize, w: *const u8, cols: usize, r0: usize, x: *const f32, i0: usize,
                out: *mut f32, ldo: usize,
            ) {
                match (rt, mt) {
                    $( (4, $m) => $kernel::<T, 4, $m>(w, cols, r0, x, i0, out, ldo), )+
                    $( (1, $m) => $kernel::<T, 1, $m>(w, cols, r0, x, i0, out, ldo), )+
                    _ => unreachable!("tile shape {rt}x{mt}"),
                }
            }
        };
    }
    dispatch!(d512, tile512, 1, 2, 3, 4);
    dispatch!(d256, tile256, 1, 2);

    /// 16 weights at element `idx` widened to f32 (masked lanes zero).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[inline]
    unsafe fn w16<const T: u8>(w: *const u8, idx: usize, mask: __mmask16) -> __m512 {
        match T {
            T_F32 => _mm512_maskz_loadu_ps(mask, (w as *const f32).add(idx)),
            T_F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (w as *const i16).add(idx))),
            _ => {
                let h = _mm256_maskz_loadu_epi16(mask, (w as *const i16).add(idx));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn tile512<const T: u8, const R: usize, const M: usize>(
        w: *const u8,
        cols: usize,
        r0: usize,
        x: *const f32,
        i0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); M]; R];
        let mut k = 0;
        while k < cols {
            let n = (cols - k).min(16);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            let mut xv = [_mm512_setzero_ps(); M];
            for i in 0..M {
                xv[i] = _mm512_maskz_loadu_ps(mask, x.add((i0 + i) * cols + k));
            }
            for r in 0..R {
                let wv = w16::<T>(w, (r0 + r) * cols + k, mask);
                for i in 0..M {
                    acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
                }
            }
            k += 16;
        }
        for r in 0..R {
            for i in 0..M {
                *out.add((i0 + i) * ldo + r0 + r) = _mm512_reduce_add_ps(acc[r][i]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn w8<const T: u8>(w: *const u8, idx: usize) -> __m256 {
        match T {
            T_F32 => _mm256_loadu_ps((w as *const f32).add(idx)),
            T_F16 => _mm256_cvtph_ps(_mm_loadu_si128((w as *const u16).add(idx) as *const __m128i)),
            _ => {
                let h = _mm_loadu_si128((w as *const u16).add(idx) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<const T: u8, const R: usize, const M: usize>(
        w: *const u8,
        cols: usize,
        r0: usize,
        x: *const f32,
        i0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); M]; R];
        let main = cols / 8 * 8;
        let mut k = 0;
        while k < main {
            let mut xv = [_mm256_setzero_ps(); M];
            for i in 0..M {
                xv[i] = _mm256_loadu_ps(x.add((i0 + i) * cols + k));
            }
            for r in 0..R {
                let wv = w8::<T>(w, (r0 + r) * cols + k);
                for i in 0..M {
                    acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
                }
            }
            k += 8;
        }
        for r in 0..R {
            for i in 0..M {
                let mut s = hsum256(acc[r][i]);
                for k in main..cols {
                    s += load_scalar(T, w, (r0 + r) * cols + k) * *x.add((i0 + i) * cols + k);
                }
                *out.add((i0 + i) * ldo + r0 + r) = s;
            }
        }
    }

    thread_local! {
        /// A task's packed weight panels ([`gemm_cols`]), kept between calls.
        static PANELS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Columns `r0..r1` of [`super::gemm`].
    ///
    /// # Safety
    /// AVX-512F is available; `w` holds `rows × cols` elements of type `T`,
    /// `x` holds `m × cols` f32 and `out` `m × rows`, of which this call
    /// alone writes columns `r0..r1`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn gemm_cols(
        t: u8,
        w: *const u8,
        rows: usize,
        cols: usize,
        x: *const f32,
        m: usize,
        r0: usize,
        r1: usize,
        out: *mut f32,
    ) {
        let es = if t == T_F32 { 4 } else { 2 };
        PANELS.with(|cell| {
            let mut buf = cell.borrow_mut();
            if buf.len() < GEMM_KC * GEMM_NR {
                buf.resize(GEMM_KC * GEMM_NR, 0.0);
            }
            let bp = buf.as_mut_ptr();
            for mb in (0..m).step_by(GEMM_MC) {
                let me = (mb + GEMM_MC).min(m);
                for k0 in (0..cols).step_by(GEMM_KC) {
                    let kc = (cols - k0).min(GEMM_KC);
                    for n0 in (r0..r1).step_by(GEMM_NR) {
                        let nw = (r1 - n0).min(GEMM_NR);
                        match t {
                            T_F32 => pack_panel::<T_F32>(w, cols, n0, nw, k0, kc, bp),
                            T_F16 => pack_panel::<T_F16>(w, cols, n0, nw, k0, kc, bp),
                            _ => pack_panel::<T_BF16>(w, cols, n0, nw, k0, kc, bp),
                        }
                        let masks = [lane_mask(nw.min(16)), lane_mask(nw.saturating_sub(16))];
                        // The next panel's weights (from DRAM, for a whole
                        // model) into L2 while this one's tiles run, a few
                        // lines a tile, so that its packing does not wait.
                        let next = n0 + GEMM_NR;
                        let next_rows = r1.saturating_sub(next).min(GEMM_NR);
                        let row_bytes = kc * es;
                        let lines = row_bytes.div_ceil(64);
                        let total = next_rows * lines;
                        let per_tile = total.div_ceil((me - mb).div_ceil(GEMM_MR)).max(1);
                        let mut pf = 0;
                        let prefetch = |pf: &mut usize, upto: usize| {
                            while *pf < upto.min(total) {
                                let (j, l) = (*pf / lines, *pf % lines);
                                let at = ((next + j) * cols + k0) * es + l * 64;
                                _mm_prefetch::<_MM_HINT_T1>(w.add(at) as *const i8);
                                *pf += 1;
                            }
                        };
                        let mut i = mb;
                        while i < me {
                            let upto = pf + per_tile;
                            prefetch(&mut pf, upto);
                            let r = (me - i).min(GEMM_MR);
                            gemm_tile(
                                r,
                                x.add(i * cols + k0),
                                cols,
                                kc,
                                bp,
                                out.add(i * rows + n0),
                                rows,
                                masks,
                                k0 > 0,
                            );
                            i += r;
                        }
                        prefetch(&mut pf, total);
                    }
                }
            }
        });
    }

    fn lane_mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// Packs weight rows `n0..n0 + nw` (at most [`GEMM_NR`]), elements
    /// `k0..k0 + kc`, widened to f32, as `bp[kk · GEMM_NR + j]`; rows `nw..`
    /// of the panel are zero. Whole 16-row, 16-element blocks go through a
    /// register transpose, the rest one element at a time.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[inline]
    unsafe fn pack_panel<const T: u8>(
        w: *const u8,
        cols: usize,
        n0: usize,
        nw: usize,
        k0: usize,
        kc: usize,
        bp: *mut f32,
    ) {
        for jb in (0..GEMM_NR).step_by(16) {
            let full = nw >= jb + 16;
            let mut kk = 0;
            if full {
                while kk + 16 <= kc {
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (j, v) in r.iter_mut().enumerate() {
                        *v = w16::<T>(w, (n0 + jb + j) * cols + k0 + kk, 0xffff);
                    }
                    transpose16(&mut r);
                    for (e, v) in r.iter().enumerate() {
                        _mm512_storeu_ps(bp.add((kk + e) * GEMM_NR + jb), *v);
                    }
                    kk += 16;
                }
            }
            for j in jb..jb + 16 {
                for k in kk..kc {
                    *bp.add(k * GEMM_NR + j) = if j < nw {
                        load_scalar(T, w, (n0 + j) * cols + k0 + k)
                    } else {
                        0.0
                    };
                }
            }
        }
    }

    /// Transposes the 16 × 16 matrix whose rows are `r`, in place.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn transpose16(r: &mut [__m512; 16]) {
        let mut t = [_mm512_setzero_ps(); 16];
        // Pairs of rows interleaved by element, then by element pair.
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            r[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
            r[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
            r[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            r[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
        }
        // Then 128-bit lanes across groups of four rows, and of eight.
        for h in 0..2 {
            for i in 0..4 {
                t[8 * h + i] = _mm512_shuffle_f32x4::<0x88>(r[8 * h + i], r[8 * h + i + 4]);
                t[8 * h + i + 4] = _mm512_shuffle_f32x4::<0xDD>(r[8 * h + i], r[8 * h + i + 4]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[i + 8]);
            r[i + 8] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[i + 8]);
        }
    }

    macro_rules! gemm_tiles {
        ($($r:literal),+) => {
            /// Calls [`gemm_kernel`] for `r` rows.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
            unsafe fn gemm_tile(
                r: usize, a: *const f32, lda: usize, kc: usize, b: *const f32, c: *mut f32,
                ldc: usize, masks: [__mmask16; 2], accumulate: bool,
            ) {
                match r {
                    $( $r => gemm_kernel::<$r>(a, lda, kc, b, c, ldc, masks, accumulate), )+
                    _ => unreachable!("gemm tile of {r} rows"),
                }
            }
        };
    }
    gemm_tiles!(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12);

    /// `c[i][0..32] (+)= Σ_{k < kc} a[i][k] · b[k][0..32]` for `R` rows, the
    /// columns outside `masks` untouched.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[inline]
    unsafe fn gemm_kernel<const R: usize>(
        a: *const f32,
        lda: usize,
        kc: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        masks: [__mmask16; 2],
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for k in 0..kc {
            let b0 = _mm512_loadu_ps(b.add(k * GEMM_NR));
            let b1 = _mm512_loadu_ps(b.add(k * GEMM_NR + 16));
            for i in 0..R {
                let av = _mm512_set1_ps(*a.add(i * lda + k));
                acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
            }
        }
        for i in 0..R {
            for h in 0..2 {
                let p = c.add(i * ldc + h * 16);
                let v = if accumulate {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(masks[h], p), acc[i][h])
                } else {
                    acc[i][h]
                };
                _mm512_mask_storeu_ps(p, masks[h], v);
            }
        }
    }
}
