//! MXFP4 weights (OCP microscaling FP4), kept 4-bit in memory, and their
//! matmul kernel.
//!
//! Storage is ggml's `block_mxfp4` (GGUF type 39), 17 bytes per 32 values:
//! byte 0 is an e8m0 exponent `e`, bytes `1..17` the 4-bit e2m1 codes, with
//! element `j < 16` the low nibble of `qs[j]` and element `j + 16` its high
//! nibble (the Q4_0 order). A code's value is its e2m1 value (`{0, 0.5, 1,
//! 1.5, 2, 3, 4, 6}`, bit 3 the sign) times `2^(e − 127)`. Like ggml, the
//! kernel uses doubled codes (`{0, 1, 2, 3, 4, 6, 8, 12}`, small integers)
//! times `2^(e − 128)`, which is the same number, exactly.
//!
//! Hugging Face checkpoints (gpt-oss, `quant_method: "mxfp4"`) store the same
//! values as `{name}_blocks` (16 bytes per block) and `{name}_scales` (one
//! `e` per block), but with the elements of a block in byte order, low nibble
//! first: element `2i` is the low and `2i + 1` the high nibble of byte `i`.
//! [`from_hf_blocks`] re-packs that into the ggml order.
//!
//! Two products, one per source format, each that format's reference:
//!
//! - GGUF files ([`matmul_q8`], what [`super::Weight::from_raw`] builds)
//!   quantize the activations to 8 bits per 32 as ggml's Q8_0 (like
//!   Pagoda's other GGUF kernels, [`super::act`]) and take the integer dot
//!   of the doubled codes with them, scaled per block by `2^(e − 128)`
//!   times the activation scale: llama.cpp's `vec_dot_mxfp4_q8_0`, which
//!   defines what a GGUF file computes. The weights are re-laid out at
//!   load ([`interleave`]) so that `vpdpbusd` sums whole blocks per lane.
//! - Hugging Face checkpoints (`quant_method` `mxfp4`,
//!   [`super::Weight::from_mxfp4_f32_act`]) keep f32 activations
//!   ([`matmul`]): their reference is transformers, which multiplies the
//!   dequantized experts with unquantized activations, and Pagoda serves
//!   such a checkpoint as the f32 model of its decoded values (within the
//!   f32 tolerance); 8-bit activations would move logprobs by their
//!   rounding, far beyond it.
//!
//! The f32 product decodes each block to 32 f32 weights (a nibble table
//! lookup and one multiply by the power of two, both exact: every value is
//! an f32) and accumulates them against the activations, so a row's result
//! equals the dequantized f32 matrix's up to summation order. Each product
//! has AVX-512, AVX2 and scalar paths, the scalar one the reference; the
//! SIMD level is picked per call like the other kernels.

use super::layout::ABuf;
use super::{act, grow, MatmulScratch, OutPtr};
use crate::cpu::pool::ThreadPool;
use crate::cpu::SimdLevel;

/// Elements per block.
pub(crate) const BLOCK_LEN: usize = 32;
/// Bytes per block: one e8m0 exponent and 16 bytes of codes.
pub(crate) const BLOCK_BYTES: usize = 17;

/// The doubled e2m1 values of the 16 codes (bit 3 is the sign).
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Activation rows handled together per weight row (each decoded block is
/// reused for this many rows).
const M_TILE: usize = 4;

/// `2^(e − 128)` as f32, exactly (subnormal for `e < 2`).
#[inline]
pub(crate) fn half_scale(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// Decodes one 17-byte block into its 32 values.
#[inline]
pub(crate) fn decode_block(block: &[u8], out: &mut [f32]) {
    let d = half_scale(block[0]);
    for j in 0..16 {
        let b = block[1 + j];
        out[j] = KVALUES[(b & 0x0f) as usize] as f32 * d;
        out[j + 16] = KVALUES[(b >> 4) as usize] as f32 * d;
    }
}

/// Dequantizes one stored row (`cols / 32` blocks) into `out[..cols]`.
pub(crate) fn dequantize_row(row: &[u8], out: &mut [f32]) {
    for (b, o) in row
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        decode_block(b, o);
    }
}

/// Re-packs Hugging Face MXFP4 blocks into ggml's block layout: `blocks`
/// holds `n` blocks of 16 code bytes (element `2i` the low nibble of byte
/// `i`, `2i + 1` the high one), `scales` their `n` e8m0 exponents; the
/// result is `n` 17-byte blocks (see the module docs). `None` if the
/// lengths disagree.
pub fn from_hf_blocks(blocks: &[u8], scales: &[u8]) -> Option<Vec<u8>> {
    if blocks.len() != scales.len().checked_mul(16)? {
        return None;
    }
    let mut out = vec![0u8; scales.len() * BLOCK_BYTES];
    for ((src, &e), dst) in blocks
        .chunks_exact(16)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        dst[0] = e;
        // Element `k` of the block is nibble `k % 2` of byte `k / 2`.
        let code = |k: usize| (src[k / 2] >> (4 * (k % 2))) & 0x0f;
        for j in 0..16 {
            dst[1 + j] = code(j) | (code(j + 16) << 4);
        }
    }
    Some(out)
}

/// `out[i][r] = Σ_k x[i][k] · W[r][k]` for the `rows × cols` MXFP4 matrix
/// `w` (rows of `cols / 32` blocks), `x: [m, cols]`, `out: [m, rows]`.
/// The callers checked the lengths and that `m`, `rows` and `cols` are
/// nonzero.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    w: &ABuf,
    rows: usize,
    cols: usize,
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) {
    let row_bytes = cols / BLOCK_LEN * BLOCK_BYTES;
    let wb = w.bytes();
    let o = OutPtr(out.as_mut_ptr());
    pool.run_ranges(rows, 4, &|r0, r1| {
        let o = &o;
        for r in r0..r1 {
            let row = &wb[r * row_bytes..(r + 1) * row_bytes];
            let mut i0 = 0;
            while i0 < m {
                let mt = (m - i0).min(M_TILE);
                let xs = &x[i0 * cols..(i0 + mt) * cols];
                let mut acc = [0f32; M_TILE];
                row_dot(level, row, xs, cols, mt, &mut acc);
                for (i, &a) in acc[..mt].iter().enumerate() {
                    // SAFETY: `(i0 + i) · rows + r` is inside `out` (m × rows
                    // elements), and only the task owning row `r` writes it.
                    unsafe { *o.0.add((i0 + i) * rows + r) = a };
                }
                i0 += mt;
            }
        }
    });
}

/// The dot products of one weight row with the `mt` activation rows in
/// `xs` (`mt × cols`), into `acc[..mt]`.
fn row_dot(level: SimdLevel, row: &[u8], xs: &[f32], cols: usize, mt: usize, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if level.has_avx512() {
            // SAFETY: the level (clamped to the CPU's by the caller) has
            // AVX-512 F/BW/VL; the slices hold whole blocks.
            return unsafe { x86::row_dot512(row, xs, cols, mt, acc) };
        }
        if level >= SimdLevel::Avx2 {
            // SAFETY: as above, with AVX2 and FMA.
            return unsafe { x86::row_dot256(row, xs, cols, mt, acc) };
        }
    }
    let _ = level;
    row_dot_scalar(row, xs, cols, mt, acc)
}

/// The reference path: decode a block, then multiply-add it in order.
fn row_dot_scalar(row: &[u8], xs: &[f32], cols: usize, mt: usize, acc: &mut [f32]) {
    let mut wv = [0f32; BLOCK_LEN];
    for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
        decode_block(block, &mut wv);
        for (i, a) in acc[..mt].iter_mut().enumerate() {
            let xb = &xs[i * cols + b * BLOCK_LEN..][..BLOCK_LEN];
            for (w, v) in wv.iter().zip(xb) {
                *a += w * v;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Q8 activations (GGUF files): ggml's `vec_dot_mxfp4_q8_0`, re-laid out.
// ---------------------------------------------------------------------------

/// Blocks per group of the interleaved layout (one 32-bit lane each).
const GROUP: usize = 16;

/// The doubled codes plus 12 (`{0..=24}`, unsigned): `vpdpbusd` and
/// `pmaddubsw` multiply unsigned by signed bytes, so the kernels multiply
/// `kv + 12` by the activation codes and subtract `12 · Σ x` per block.
const KVALUES_U: [u8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

/// Re-lays GGUF blocks (`rows × cols`, see the module docs) out for the
/// Q8-activation kernel: each row keeps its `cols / 32 · 17` bytes, as
/// groups of 16 blocks (the last one `gl ≤ 16`): the `gl` exponents, then
/// the codes interleaved 4 bytes at a time across blocks, `4·gl` bytes per
/// step `c` in `0..4`, block `j` at `4j..4j + 4` holding code bytes
/// `qs[4c..4c + 4]` (elements `4c + t` in the low and `16 + 4c + t` in the
/// high nibbles). The activations' codes are in the same order
/// ([`super::act`] with 32-element lanes): chunk `c` of a group, elements
/// `4c..4c + 4` of each block, is `4·gl` contiguous bytes. So one load of
/// codes feeds two `vpdpbusd` (low nibbles with chunk `c`, high ones with
/// chunk `c + 4`), and 32-bit lane `j` ends up with block `j`'s whole
/// integer dot product.
pub(crate) fn interleave(bytes: &[u8], rows: usize, cols: usize) -> ABuf {
    let nb = cols / BLOCK_LEN;
    let row_bytes = nb * BLOCK_BYTES;
    let mut buf = ABuf::zeroed(rows * row_bytes);
    let out = buf.bytes_mut();
    for (src, dst) in bytes
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        for g in 0..nb.div_ceil(GROUP) {
            let gl = (nb - GROUP * g).min(GROUP);
            let base = GROUP * g * BLOCK_BYTES;
            for j in 0..gl {
                let blk = &src[(GROUP * g + j) * BLOCK_BYTES..][..BLOCK_BYTES];
                dst[base + j] = blk[0];
                for c in 0..4 {
                    let at = base + gl + c * 4 * gl + 4 * j;
                    dst[at..at + 4].copy_from_slice(&blk[1 + 4 * c..5 + 4 * c]);
                }
            }
        }
    }
    buf
}

/// Dequantizes one row of the [`interleave`]d layout into `out[..cols]`.
pub(crate) fn dequantize_interleaved_row(row: &[u8], out: &mut [f32]) {
    let nb = row.len() / BLOCK_BYTES;
    for g in 0..nb.div_ceil(GROUP) {
        let gl = (nb - GROUP * g).min(GROUP);
        let base = GROUP * g * BLOCK_BYTES;
        for j in 0..gl {
            let d = half_scale(row[base + j]);
            let o = &mut out[(GROUP * g + j) * BLOCK_LEN..][..BLOCK_LEN];
            for c in 0..4 {
                for t in 0..4 {
                    let b = row[base + gl + c * 4 * gl + 4 * j + t];
                    o[4 * c + t] = KVALUES[(b & 0x0f) as usize] as f32 * d;
                    o[16 + 4 * c + t] = KVALUES[(b >> 4) as usize] as f32 * d;
                }
            }
        }
    }
}

/// The quantized activations of one matmul, each row padded to whole
/// groups of 16 blocks: per row `stride` code bytes in [`super::act`]'s
/// order as if the row's last group were whole (chunk `c` of a group at
/// `64c`, zero codes in the missing lanes), and per block (`groups · 16`
/// per row, zero past `nb`) the scale and the code sum. The zero lanes
/// make a tail group's products `0 · (2^(e − 128) · 0) = +0` whatever
/// weight bytes sit in them, so the kernels read every group whole.
#[derive(Clone, Copy)]
struct QAct {
    q: *const i8,
    d: *const f32,
    sum: *const i32,
    /// Code bytes per row (`groups · 512`).
    stride: usize,
    /// Blocks per row, and per row of `d` and `sum` (`groups · 16`).
    nb: usize,
    npad: usize,
}
// SAFETY: read only, while the scratch that owns the buffers is borrowed
// by the matmul.
unsafe impl Send for QAct {}
unsafe impl Sync for QAct {}

/// `out[i][r] = Σ_k x[i][k] · W[r][k]` with `x` quantized to 8 bits per
/// 32-element block as ggml's Q8_0 ([`super::act`]: scale `amax / 127`,
/// codes rounded to nearest even), for the [`interleave`]d `w`. Per
/// block, the integer dot of the doubled codes with the activation codes
/// (exact) is scaled by `(2^(e − 128) · d_x)` (one rounding) and added to
/// partial sum `b mod 16` (one rounding); the 16 partial sums are added
/// pairwise ([`reduce16`]). Every level follows that order, so every
/// level gives the same bits, for every batch size and thread count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_q8(
    w: &ABuf,
    rows: usize,
    cols: usize,
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let nb = cols / BLOCK_LEN;
    let full = nb / GROUP;
    let npad = nb.div_ceil(GROUP) * GROUP;
    let stride = npad * BLOCK_LEN;
    grow(&mut scratch.aq, m * stride);
    grow(&mut scratch.ad, m * npad);
    grow(&mut scratch.asum, m * npad);
    grow(&mut scratch.ascaled, nb);
    for i in 0..m {
        let q = &mut scratch.aq[i * stride..(i + 1) * stride];
        act::quantize_row(
            level,
            BLOCK_LEN,
            &x[i * cols..(i + 1) * cols],
            &mut q[..cols],
            &mut scratch.ad[i * npad..i * npad + nb],
            &mut scratch.asum[i * npad..i * npad + nb],
            &mut scratch.ascaled[..nb],
        );
        // Spread a tail group's chunks (`4·gl` bytes apart) to whole-group
        // places (64 apart), last first (each lands at or after where it
        // was, past its predecessors), and zero what lies between.
        let gl = nb - GROUP * full;
        if gl > 0 {
            let t = &mut q[full * GROUP * BLOCK_LEN..];
            for c in (0..8).rev() {
                t.copy_within(c * 4 * gl..(c + 1) * 4 * gl, c * 64);
                t[c * 64 + 4 * gl..(c + 1) * 64].fill(0);
            }
            scratch.ad[i * npad + nb..(i + 1) * npad].fill(0.0);
            scratch.asum[i * npad + nb..(i + 1) * npad].fill(0);
        }
    }
    let a = QAct {
        q: scratch.aq.as_ptr(),
        d: scratch.ad.as_ptr(),
        sum: scratch.asum.as_ptr(),
        stride,
        nb,
        npad,
    };
    let row_bytes = nb * BLOCK_BYTES;
    let wb = w.bytes();
    let o = OutPtr(out.as_mut_ptr());
    // One contiguous run of rows per thread: each streams its own part of
    // the matrix front to back.
    let threads = pool.threads().min(rows.div_ceil(4)).max(1);
    let per = rows.div_ceil(threads);
    pool.run(threads, &|t| {
        let (o, a) = (&o, &a);
        let (r0, r1) = (t * per, ((t + 1) * per).min(rows));
        // SAFETY: the level was clamped to the CPU's by the caller; the
        // activations were quantized above (whole groups, zero padded);
        // the weights' buffer (`ABuf`) has a zero line past its end for
        // the whole-group reads of the last row's tail; only this task
        // writes the outputs of rows `r0..r1`.
        unsafe { rows_q8(level, wb.as_ptr(), row_bytes, r0, r1, a, m, o.0, rows) };
    });
}

/// The 16 partial sums of a row added pairwise: `s[j] + s[j + 8]`, then
/// `+ 4`, `+ 2`, `+ 1` apart.
#[inline]
fn reduce16(s: &[f32; GROUP]) -> f32 {
    let mut v = *s;
    let mut h = GROUP / 2;
    while h > 0 {
        for j in 0..h {
            v[j] += v[j + h];
        }
        h /= 2;
    }
    v[0]
}

/// Output rows `r0..r1` of all `m` activation rows at `level`.
///
/// # Safety
/// As [`matmul_q8`] sets up: `a` holds `m` quantized rows, `wb` rows
/// `r0..r1` of `row_bytes` each (padded past the end), `out` `m × rows`.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_q8(
    level: SimdLevel,
    wb: *const u8,
    row_bytes: usize,
    r0: usize,
    r1: usize,
    a: &QAct,
    m: usize,
    out: *mut f32,
    rows: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if level.has_avx512() {
            return x86::rows_q8_512(wb, row_bytes, r0, r1, a, m, out, rows);
        }
        if level >= SimdLevel::Avx2 {
            return x86::rows_q8_256(wb, row_bytes, r0, r1, a, m, out, rows);
        }
    }
    let _ = level;
    for r in r0..r1 {
        let row = std::slice::from_raw_parts(wb.add(r * row_bytes), row_bytes);
        for i in 0..m {
            *out.add(i * rows + r) = row_q8_scalar(row, a, i);
        }
    }
}

/// The reference path: one weight row against activation row `i`, one
/// block at a time.
unsafe fn row_q8_scalar(row: &[u8], a: &QAct, i: usize) -> f32 {
    let nb = a.nb;
    let mut s = [0f32; GROUP];
    for g in 0..nb.div_ceil(GROUP) {
        let gl = (nb - GROUP * g).min(GROUP);
        let base = GROUP * g * BLOCK_BYTES;
        let xq = a.q.add(i * a.stride + GROUP * g * BLOCK_LEN);
        for j in 0..gl {
            let mut dot = 0i32;
            for c in 0..4 {
                for t in 0..4 {
                    let b = row[base + gl + c * 4 * gl + 4 * j + t];
                    let lo = *xq.add(c * 64 + 4 * j + t) as i32;
                    let hi = *xq.add((c + 4) * 64 + 4 * j + t) as i32;
                    dot += KVALUES[(b & 0x0f) as usize] as i32 * lo
                        + KVALUES[(b >> 4) as usize] as i32 * hi;
                }
            }
            let blk = i * a.npad + GROUP * g + j;
            s[j] += dot as f32 * (half_scale(row[base + j]) * *a.d.add(blk));
        }
    }
    reduce16(&s)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{half_scale, QAct, BLOCK_BYTES, BLOCK_LEN, GROUP, KVALUES, KVALUES_U, M_TILE};
    use std::arch::x86_64::*;

    /// The 16 doubled codes as bytes, for `pshufb`.
    #[inline]
    unsafe fn lut() -> __m128i {
        _mm_loadu_si128(KVALUES.as_ptr() as *const __m128i)
    }

    /// The doubled values of a block's 32 codes: elements `0..16` and
    /// `16..32` as two vectors of 16 signed bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn codes(p: *const u8, lut: __m128i) -> (__m128i, __m128i) {
        let q = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
        (_mm_shuffle_epi8(lut, lo), _mm_shuffle_epi8(lut, hi))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,avx2")]
    pub(super) unsafe fn row_dot512(
        row: &[u8],
        xs: &[f32],
        cols: usize,
        mt: usize,
        acc: &mut [f32],
    ) {
        match mt {
            1 => row_dot512_n::<1>(row, xs, cols, acc),
            2 => row_dot512_n::<2>(row, xs, cols, acc),
            3 => row_dot512_n::<3>(row, xs, cols, acc),
            _ => row_dot512_n::<M_TILE>(row, xs, cols, acc),
        }
    }

    /// One block's weights: elements `0..16` and `16..32`, decoded and
    /// scaled (exact, the same numbers as [`super::decode_block`]): the
    /// table of the 16 doubled values times the block's scale, looked up
    /// by `vpermps`, which reads only the low 4 bits of each index, so the
    /// zero-extended code bytes index the low nibbles as they are and,
    /// shifted right by 4, the high ones.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,avx2")]
    #[inline]
    unsafe fn weights512(block: *const u8, table: __m512) -> (__m512, __m512) {
        let t = _mm512_mul_ps(table, _mm512_set1_ps(half_scale(*block)));
        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(1) as *const __m128i));
        (
            _mm512_permutexvar_ps(q, t),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), t),
        )
    }

    /// [`row_dot512`] for `MT` activation rows, with four independent sums
    /// per row (the low and high halves of even and of odd blocks, kept in
    /// registers) so consecutive multiply-adds do not wait on each other.
    /// The order of the additions is the same for every `MT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,avx2")]
    #[inline]
    unsafe fn row_dot512_n<const MT: usize>(row: &[u8], xs: &[f32], cols: usize, acc: &mut [f32]) {
        let mut kv = [0f32; 16];
        for (k, &v) in kv.iter_mut().zip(&KVALUES) {
            *k = v as f32;
        }
        let lut = _mm512_loadu_ps(kv.as_ptr());
        let mut s = [[_mm512_setzero_ps(); 4]; MT];
        let nb = row.len() / BLOCK_BYTES;
        let (rp, xp) = (row.as_ptr(), xs.as_ptr());
        let mut b = 0;
        while b + 2 <= nb {
            let (w0, w1) = weights512(rp.add(b * BLOCK_BYTES), lut);
            let (w2, w3) = weights512(rp.add((b + 1) * BLOCK_BYTES), lut);
            for (i, si) in s.iter_mut().enumerate() {
                let x = xp.add(i * cols + b * BLOCK_LEN);
                si[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), si[0]);
                si[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), si[1]);
                si[2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x.add(32)), si[2]);
                si[3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x.add(48)), si[3]);
            }
            b += 2;
        }
        if b < nb {
            let (w0, w1) = weights512(rp.add(b * BLOCK_BYTES), lut);
            for (i, si) in s.iter_mut().enumerate() {
                let x = xp.add(i * cols + b * BLOCK_LEN);
                si[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), si[0]);
                si[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), si[1]);
            }
        }
        for (a, si) in acc[..MT].iter_mut().zip(&s) {
            let v = _mm512_add_ps(_mm512_add_ps(si[0], si[1]), _mm512_add_ps(si[2], si[3]));
            *a = _mm512_reduce_add_ps(v);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_dot256(
        row: &[u8],
        xs: &[f32],
        cols: usize,
        mt: usize,
        acc: &mut [f32],
    ) {
        let lut = lut();
        // Four independent sums per activation row (one per quarter of a
        // block), the same order for every `mt`.
        let mut s = [[_mm256_setzero_ps(); 4]; M_TILE];
        for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
            let d = _mm256_set1_ps(half_scale(block[0]));
            let (lo, hi) = codes(block.as_ptr().add(1), lut);
            let f = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
            let w = [
                f(lo),
                f(_mm_srli_si128::<8>(lo)),
                f(hi),
                f(_mm_srli_si128::<8>(hi)),
            ];
            for (i, si) in s[..mt].iter_mut().enumerate() {
                let xp = xs.as_ptr().add(i * cols + b * BLOCK_LEN);
                for (k, wk) in w.iter().enumerate() {
                    si[k] = _mm256_fmadd_ps(*wk, _mm256_loadu_ps(xp.add(8 * k)), si[k]);
                }
            }
        }
        for (a, si) in acc[..mt].iter_mut().zip(&s) {
            let v = _mm256_add_ps(_mm256_add_ps(si[0], si[1]), _mm256_add_ps(si[2], si[3]));
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_shuffle_ps::<1>(h, h));
            *a = _mm_cvtss_f32(h);
        }
    }
    // --- Q8 activations ---------------------------------------------------

    /// `2^(e − 128)` of 16 exponents, exactly as [`half_scale`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    #[inline]
    unsafe fn half_scales512(e: __m512i) -> __m512 {
        let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
        let sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub))
    }

    /// [`super::rows_q8`] with AVX-512 VNNI, a group of 16 blocks per
    /// step, every group read whole (see [`QAct`]; masked loads stalled
    /// for tens of cycles each on Zen 4).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows_q8_512(
        wb: *const u8,
        row_bytes: usize,
        r0: usize,
        r1: usize,
        a: &QAct,
        m: usize,
        out: *mut f32,
        rows: usize,
    ) {
        for r in r0..r1 {
            let rp = wb.add(r * row_bytes);
            prefetch_ahead(rp, row_bytes);
            let mut i0 = 0;
            while i0 < m {
                let mt = (m - i0).min(M_TILE);
                match mt {
                    1 => tile512::<1>(rp, a, i0, out, rows, r),
                    2 => tile512::<2>(rp, a, i0, out, rows, r),
                    3 => tile512::<3>(rp, a, i0, out, rows, r),
                    _ => tile512::<M_TILE>(rp, a, i0, out, rows, r),
                }
                i0 += mt;
            }
        }
    }

    /// Bytes ahead of the row being read that [`prefetch_ahead`] asks for.
    const PREFETCH: usize = 1024;

    /// Prefetches the lines [`PREFETCH`] bytes past those of the row at
    /// `rp`: each thread streams its rows front to back, and the stream of
    /// every expert matrix starts cold. (A prefetch past the matrix's end
    /// cannot fault.) Into L2 only, as the other quantized kernels do (see
    /// [`crate::ops::simd::prefetch`]): decode bench `MXFP4` (1B shapes, Zen 4,
    /// 1 thread, alternating) 30.6–31.5 → 26.4–28.4 ms a step for one
    /// token; for 8 tokens 116–124 → 123–131 (the 49152-row head 20%
    /// slower), which routed experts, seeing a token or two each, do not
    /// meet.
    #[inline(always)]
    unsafe fn prefetch_ahead(rp: *const u8, row_bytes: usize) {
        let mut off = 0;
        while off < row_bytes {
            crate::ops::simd::prefetch(rp.wrapping_add(PREFETCH + off));
            off += 64;
        }
    }

    /// One weight row against activation rows `i0..i0 + MT`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn tile512<const MT: usize>(
        rp: *const u8,
        a: &QAct,
        i0: usize,
        out: *mut f32,
        rows: usize,
        r: usize,
    ) {
        let nb = a.nb;
        let mut s = [_mm512_setzero_ps(); MT];
        let full = nb / GROUP;
        for g in 0..full {
            group512::<MT>(rp, a, i0, g, GROUP, &mut s);
        }
        if nb > GROUP * full {
            group512::<MT>(rp, a, i0, full, nb - GROUP * full, &mut s);
        }
        for (i, si) in s.iter().enumerate() {
            *out.add((i0 + i) * rows + r) = hsum16(*si);
        }
    }

    /// [`super::reduce16`] in registers: the same additions.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[inline]
    unsafe fn hsum16(v: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
    }

    /// The last three steps of [`super::reduce16`] on `s[j] + s[j + 8]`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum8(v: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
    }

    /// Group `g` (`gl` blocks) of one weight row into the partial sums
    /// `s`: 16 lanes read whole, those past `gl` meeting zero activations.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn group512<const MT: usize>(
        rp: *const u8,
        a: &QAct,
        i0: usize,
        g: usize,
        gl: usize,
        s: &mut [__m512; MT],
    ) {
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_U.as_ptr() as *const __m128i));
        let m4 = _mm512_set1_epi8(0x0f);
        let twelve = _mm512_set1_epi32(12);
        let wg = rp.add(GROUP * g * BLOCK_BYTES);
        let hs = half_scales512(_mm512_cvtepu8_epi32(_mm_loadu_si128(wg as *const __m128i)));
        let mut u = [_mm512_setzero_si512(); 8];
        for c in 0..4 {
            let q = _mm512_loadu_si512(wg.add(gl + c * 4 * gl) as *const __m512i);
            u[c] = _mm512_shuffle_epi8(lut, _mm512_and_si512(q, m4));
            u[c + 4] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4));
        }
        for (i, si) in s.iter_mut().enumerate() {
            let r = i0 + i;
            let xg = a.q.add(r * a.stride + GROUP * g * BLOCK_LEN);
            let x = |c: usize| _mm512_loadu_si512(xg.add(64 * c) as *const __m512i);
            let mut d0 = _mm512_setzero_si512();
            let mut d1 = _mm512_setzero_si512();
            for c in 0..4 {
                d0 = _mm512_dpbusd_epi32(d0, u[c], x(c));
                d1 = _mm512_dpbusd_epi32(d1, u[c + 4], x(c + 4));
            }
            let blk = r * a.npad + GROUP * g;
            let sum = _mm512_loadu_si512(a.sum.add(blk) as *const __m512i);
            let d = _mm512_loadu_ps(a.d.add(blk));
            let dot = _mm512_sub_epi32(_mm512_add_epi32(d0, d1), _mm512_mullo_epi32(sum, twelve));
            *si = _mm512_add_ps(
                *si,
                _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(hs, d)),
            );
        }
    }

    /// `2^(e − 128)` of 8 exponents, exactly as [`half_scale`].
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn half_scales256(e: __m256i) -> __m256 {
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small))
    }

    /// [`super::rows_q8`] with AVX2: a group as two halves of 8 blocks,
    /// read whole like [`rows_q8_512`].
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows_q8_256(
        wb: *const u8,
        row_bytes: usize,
        r0: usize,
        r1: usize,
        a: &QAct,
        m: usize,
        out: *mut f32,
        rows: usize,
    ) {
        for r in r0..r1 {
            let rp = wb.add(r * row_bytes);
            prefetch_ahead(rp, row_bytes);
            let mut i0 = 0;
            while i0 < m {
                let mt = (m - i0).min(M_TILE);
                match mt {
                    1 => tile256::<1>(rp, a, i0, out, rows, r),
                    2 => tile256::<2>(rp, a, i0, out, rows, r),
                    3 => tile256::<3>(rp, a, i0, out, rows, r),
                    _ => tile256::<M_TILE>(rp, a, i0, out, rows, r),
                }
                i0 += mt;
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile256<const MT: usize>(
        rp: *const u8,
        a: &QAct,
        i0: usize,
        out: *mut f32,
        rows: usize,
        r: usize,
    ) {
        let nb = a.nb;
        let mut s = [[_mm256_setzero_ps(); 2]; MT];
        for g in 0..nb.div_ceil(GROUP) {
            let gl = (nb - GROUP * g).min(GROUP);
            group256::<MT>(rp, a, i0, g, gl, &mut s);
        }
        for (i, si) in s.iter().enumerate() {
            *out.add((i0 + i) * rows + r) = hsum8(_mm256_add_ps(si[0], si[1]));
        }
    }

    /// Group `g` (`gl` blocks) of one weight row: lanes `8h..8h + 8` in
    /// `s[i][h]`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn group256<const MT: usize>(
        rp: *const u8,
        a: &QAct,
        i0: usize,
        g: usize,
        gl: usize,
        s: &mut [[__m256; 2]; MT],
    ) {
        let lut =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_U.as_ptr() as *const __m128i));
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let twelve = _mm256_set1_epi32(12);
        let wg = rp.add(GROUP * g * BLOCK_BYTES);
        for h in 0..2 {
            let ex = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wg.add(8 * h) as *const __m128i));
            let hs = half_scales256(ex);
            let mut u = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let q = _mm256_loadu_si256(wg.add(gl + c * 4 * gl + 32 * h) as *const __m256i);
                u[c] = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m4));
                u[c + 4] =
                    _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4));
            }
            for (i, si) in s.iter_mut().enumerate() {
                let r = i0 + i;
                let xg = a.q.add(r * a.stride + GROUP * g * BLOCK_LEN + 32 * h);
                let x = |c: usize| _mm256_loadu_si256(xg.add(64 * c) as *const __m256i);
                // Pair sums are at most 2 · 24 · 127, four of them fit i16.
                let p = |c: usize| _mm256_maddubs_epi16(u[c], x(c));
                let lo =
                    _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
                let hi =
                    _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
                let dot =
                    _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
                let blk = r * a.npad + GROUP * g + 8 * h;
                let sum = _mm256_loadu_si256(a.sum.add(blk) as *const __m256i);
                let dot = _mm256_sub_epi32(dot, _mm256_mullo_epi32(sum, twelve));
                let d = _mm256_loadu_ps(a.d.add(blk));
                si[h] = _mm256_add_ps(
                    si[h],
                    _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(hs, d)),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, MatmulScratch, Weight};

    /// A deterministic xorshift stream.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
    }

    /// The value of a code and exponent from the OCP definition, in f64:
    /// sign bit 3, then e2m1 with exponent bias 1 (subnormal when the
    /// exponent bits are 0), times `2^(e − 127)`. Independent of the
    /// tables above.
    fn ocp_value(code: u8, e: u8) -> f64 {
        let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
        let (ex, man) = ((code >> 1) & 3, code & 1);
        let mag = if ex == 0 {
            man as f64 * 0.5
        } else {
            (1.0 + man as f64 * 0.5) * 2f64.powi(ex as i32 - 1)
        };
        sign * mag * 2f64.powi(e as i32 - 127)
    }

    /// Random ggml blocks for `rows × cols`, exponents in a range around 127
    /// so products stay finite.
    fn random_blocks(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
        let mut v = vec![0u8; rows * cols / 32 * BLOCK_BYTES];
        for block in v.chunks_exact_mut(BLOCK_BYTES) {
            block[0] = 117 + (rng.next() % 16) as u8;
            for b in &mut block[1..] {
                *b = rng.next() as u8;
            }
        }
        v
    }

    /// Naive reference: each element decoded from the ggml layout by its
    /// definition, products summed in f64.
    fn reference(bytes: &[u8], rows: usize, cols: usize, x: &[f32], m: usize) -> Vec<f64> {
        let row_bytes = cols / 32 * BLOCK_BYTES;
        let mut out = vec![0f64; m * rows];
        for i in 0..m {
            for r in 0..rows {
                let mut s = 0f64;
                for k in 0..cols {
                    let block = &bytes[r * row_bytes + k / 32 * BLOCK_BYTES..][..BLOCK_BYTES];
                    let j = k % 32;
                    let code = if j < 16 {
                        block[1 + j] & 0x0f
                    } else {
                        block[1 + j - 16] >> 4
                    };
                    s += ocp_value(code, block[0]) * x[i * cols + k] as f64;
                }
                out[i * rows + r] = s;
            }
        }
        out
    }

    #[test]
    fn half_scale_is_two_to_the_e_minus_128() {
        for e in 0..=255u8 {
            assert_eq!(half_scale(e) as f64, 2f64.powi(e as i32 - 128), "e = {e}");
        }
    }

    #[test]
    fn kernel_matches_a_naive_f64_reference_at_every_level() {
        let pool = ThreadPool::new(3);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        // Rows not a multiple of any tile or panel; batch 1 and more than a
        // tile of activation rows, with a ragged last tile.
        for &(rows, cols, m) in &[
            (1, 32, 1),
            (7, 64, 1),
            (13, 96, 2),
            (33, 256, 5),
            (5, 2880, 1),
            (19, 160, 9),
        ] {
            let bytes = random_blocks(&mut rng, rows, cols);
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f() as f32).collect();
            let want = reference(&bytes, rows, cols, &x, m);
            let w = Weight::from_mxfp4_f32_act(rows, cols, &bytes).expect("weight");
            assert_eq!(w.size_bytes(), rows * cols / 32 * 17);
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
                let mut out = vec![f32::NAN; m * rows];
                w.matmul_at(level, &pool, &x, m, &mut out, &mut MatmulScratch::default());
                for (k, (&g, &r)) in out.iter().zip(&want).enumerate() {
                    // f32 accumulation over `cols` terms of magnitude up to
                    // |w|·|x|: bound the error by cols · eps · Σ|w·x|.
                    let i = k / rows;
                    let row = k % rows;
                    let mut abs = 0f64;
                    for c in 0..cols {
                        let mut d = [0f32; 32];
                        let off = row * cols / 32 * BLOCK_BYTES + c / 32 * BLOCK_BYTES;
                        decode_block(&bytes[off..off + BLOCK_BYTES], &mut d);
                        abs += (d[c % 32] as f64 * x[i * cols + c] as f64).abs();
                    }
                    let tol = abs * cols as f64 * f32::EPSILON as f64 + 1e-30;
                    assert!(
                        (g as f64 - r).abs() <= tol,
                        "{level:?} [{rows}x{cols}] m={m} out[{k}]: {g} vs {r} (tol {tol})"
                    );
                }
            }
        }
    }

    /// A row's result does not depend on how many activation rows come
    /// with it (decode, batched decode and prefill give the same numbers),
    /// at every level, bitwise.
    #[test]
    fn results_are_bitwise_the_same_at_every_batch_size() {
        let pool = ThreadPool::new(3);
        let mut rng = Rng(44);
        let (rows, cols, m) = (23, 2912, 9);
        let bytes = random_blocks(&mut rng, rows, cols);
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f() as f32).collect();
        let w = Weight::from_mxfp4_f32_act(rows, cols, &bytes).expect("weight");
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
            let mut all = vec![f32::NAN; m * rows];
            w.matmul_at(level, &pool, &x, m, &mut all, &mut MatmulScratch::default());
            for i in 0..m {
                for take in [1, 2, 3] {
                    let n = take.min(m - i);
                    let mut part = vec![f32::NAN; n * rows];
                    let xs = &x[i * cols..(i + n) * cols];
                    w.matmul_at(
                        level,
                        &pool,
                        xs,
                        n,
                        &mut part,
                        &mut MatmulScratch::default(),
                    );
                    let want = &all[i * rows..(i + n) * rows];
                    for (j, (&a, &b)) in part.iter().zip(want).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{level:?} from row {i}, out {j}, batch of {n}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn dequantize_row_matches_the_definition() {
        let mut rng = Rng(42);
        let (rows, cols) = (3, 64);
        let bytes = random_blocks(&mut rng, rows, cols);
        let w = Weight::from_mxfp4_f32_act(rows, cols, &bytes).expect("weight");
        let mut out = vec![0f32; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut out);
            // Row r against one-hot activations through the reference.
            for (k, &v) in out.iter().enumerate() {
                let mut x = vec![0f32; cols];
                x[k] = 1.0;
                let want = reference(&bytes, rows, cols, &x, 1)[r];
                assert_eq!(v as f64, want, "row {r} col {k}");
            }
        }
    }

    #[test]
    fn interleaved_rows_dequantize_to_the_ggml_rows() {
        let mut rng = Rng(43);
        // One block, a short tail, a whole group, a group and a tail.
        for cols in [32, 96, 512, 768] {
            let rows = 3;
            let bytes = random_blocks(&mut rng, rows, cols);
            let q8 = Weight::from_raw(GgmlType::MXFP4, rows, cols, &bytes).expect("weight");
            let f = Weight::from_mxfp4_f32_act(rows, cols, &bytes).expect("weight");
            assert_eq!(q8.size_bytes(), f.size_bytes());
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                q8.dequantize_row(r, &mut a);
                f.dequantize_row(r, &mut b);
                assert_eq!(a, b, "cols {cols} row {r}");
            }
        }
    }

    #[test]
    fn hf_blocks_repack_to_the_ggml_order() {
        // HF: element 2i is the low nibble of byte i. Put code (k % 16) at
        // element k, for 32 elements, and scale 130.
        let mut hf = [0u8; 16];
        for k in 0..32usize {
            hf[k / 2] |= ((k % 16) as u8) << (4 * (k % 2));
        }
        let g = from_hf_blocks(&hf, &[130]).expect("lengths");
        assert_eq!(g.len(), 17);
        assert_eq!(g[0], 130);
        let mut vals = [0f32; 32];
        decode_block(&g, &mut vals);
        for (k, &v) in vals.iter().enumerate() {
            assert_eq!(v as f64, ocp_value((k % 16) as u8, 130), "element {k}");
        }
        assert!(from_hf_blocks(&hf[..15], &[130]).is_none());
    }
}
