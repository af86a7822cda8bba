//! Batched quantized matmuls on the AMX-INT8 tile unit (Sapphire Rapids and
//! later), bitwise equal to the AVX-512 VNNI kernel of [`super::qkern`].
//!
//! # Why bitwise
//! A batch of 16 decoding sequences must produce, row for row, what each
//! sequence produces alone (m = 1, the VNNI kernel). The VNNI kernel
//! computes an exact 32-bit integer dot product per (weight row, token, lane
//! block), then, in f32:
//! - per group of 16 lane blocks, lane `j` accumulates block `16g + j`:
//!   `acc_j = fma(float(dot), d_w · d_a, acc_j)` (plus `fma(m_w, s_a, acc_j)`
//!   for types with a min) in groups of more than 8 lanes, and the rounded
//!   products added (`acc_j + (float(dot) · (d_w · d_a))`) in shorter ones;
//! - the 16 lane accumulators are summed by the VNNI kernel's `hsum16`'s tree.
//!
//! The tile unit computes the same integer dot products (exact, so in any
//! order), and the epilogue here performs the same float operations in the
//! same order, only vectorized across 16 tokens instead of 16 lane blocks.
//!
//! # Tiles
//! - A (weights, unsigned codes): 16 rows × the 32 codes of one lane block,
//!   unpacked per row tile from the panel layout into a per-thread buffer.
//! - B (activations, signed codes): 8 rows of 16 tokens × 4 codes of one
//!   lane block, built once per matmul ([`ActTiles`]).
//! - C: 16 rows × 16 tokens of i32, stored for the f32 epilogue.
//!
//! The order of the 32 codes inside a block only has to agree between A and
//! B, so it is whatever makes unpacking A cheapest (see [`chunk_of`]), and
//! blocks within a full group are stored in the order a 4 × 4 transpose
//! leaves them ([`slot`]).
//!
//! # Cost
//! The per-block float epilogue is the same work the VNNI kernel does; what
//! the tiles save is its integer work (nibble unpacking and `vpdpbusd` per
//! 4 tokens), at the price of unpacking A, storing C (1 KiB per block and
//! row tile) and reading it back. On SmolLM2 shapes at 16 tokens that nets
//! 1.3–1.6× on 576-column matrices and nothing on 1536-column ones (see
//! [`worth`]); prefill-sized batches of 576 columns gain 1.7×. Running the next unit's
//! tile products interleaved with this unit's epilogue was measured to gain
//! nothing (the tile instructions stall the core until they complete), so
//! the phases simply alternate.

#![allow(clippy::needless_range_loop)]

use super::layout::{
    code_bits, group_lanes, has_min, lane_at, off_shift, ABuf, QMat, K_Q4_0, K_Q4_1, K_Q8_0, PANEL,
};
use super::OutPtr;
use crate::cpu::amx::{release_tiles, TileConfig};
use crate::cpu::pool::ThreadPool;
use core::arch::x86_64::*;
use std::arch::asm;
use std::cell::RefCell;

/// Whether the tile kernel beats the VNNI one for `m` activation rows of
/// `lanes` lane blocks. Measured on a Sapphire Rapids-class Xeon (SmolLM2
/// shapes, `cargo bench -p pagoda-accel --bench matmul`): a tile always
/// holds 16 tokens, so below about 12 the padding costs more than the
/// integer work saved. With more than 32 lanes (over 1024 columns) a row
/// tile's C tiles outgrow L1 and the VNNI kernel, whose per-row costs shrink
/// with row length, keeps up: 576 × 1536 on 2 threads, VNNI against tiles,
/// m = 16: 58 vs 59 µs; m = 64: 231 vs 254 µs; m = 512: 2003 vs 1910 µs;
/// m = 2048: 7977 vs 7717 µs. On 576 columns the tiles win from m = 12 up
/// (1536 × 576, m = 16: 92 vs 73 µs; m = 64: 375 vs 222 µs).
pub(crate) fn worth(m: usize, lanes: usize) -> bool {
    m >= 12 && (lanes <= 32 || m >= 128)
}

/// Whether the tile kernel handles weights of kind `k` (the 32-element
/// types with f16 scales).
pub(crate) fn supports(k: u8) -> bool {
    matches!(k, K_Q4_0 | K_Q4_1 | K_Q8_0)
}

/// Tokens per tile (C's columns) and weight rows per tile (C's rows).
const TOK: usize = 16;
const ROWS: usize = 16;
/// Bytes of one B tile (8 rows × 64) and one C tile (16 rows × 64).
const B_BYTES: usize = 512;
const C_BYTES: usize = 1024;
/// Token tiles per activation cache block: 128 tokens of a 1536-column
/// matrix are 192 KiB of B tiles, which stay in L2 while a task's row tiles
/// pass over them.
const TILES_PER_BLOCK: usize = 8;

/// Registers 0–3: C; 4–5: A (16 rows × 32 bytes); 6–7: B (8 rows × 64).
static CONFIG: TileConfig = TileConfig::new([
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 64),
    (16, 32),
    (16, 32),
    (8, 64),
    (8, 64),
]);

/// Which 4-code chunk of a lane block (elements `4c..4c + 4`) the tiles'
/// `kk`-th group of 4 codes holds. A 4-bit unit holds chunks `2s` (low
/// nibbles) and `2s + 1` (high), and unpacking puts a block's four low
/// nibble dwords before its four high ones.
pub(super) fn chunk_of(kind: u8, kk: usize) -> usize {
    if code_bits(kind) == 8 {
        kk
    } else {
        2 * (kk % 4) + kk / 4
    }
}

/// Where lane `j` of a group of `gl` lanes sits among the group's 16 block
/// slots: a full group is unpacked by a 4 × 4 transpose that leaves lane
/// `4q + r` at slot `4r + q` (its own inverse); a short one keeps order.
pub(super) fn slot(gl: usize, j: usize) -> usize {
    if gl == 16 {
        4 * (j % 4) + j / 4
    } else {
        j
    }
}

/// The activations of one matmul rearranged into B tiles, with their
/// per-block scales transposed so that the epilogue loads 16 tokens' values
/// at once. Indexed by token tile `tt` and block slot `i` (`16g + slot`).
#[derive(Default)]
pub(crate) struct ActTiles {
    /// B tiles, `B_BYTES` each, at `(tt · lanes + i) · B_BYTES`.
    q: Vec<BLine>,
    /// Activation scale per `(tt · lanes + i) · TOK + token`.
    d: Vec<f32>,
    /// Scaled sums (f32 bits, min types) or code sums (i32), as `d`.
    x: Vec<u32>,
}

/// One 64-byte line of B tiles (aligned so tile rows never split lines).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BLine([u8; 64]);

impl Default for BLine {
    fn default() -> BLine {
        BLine([0; 64])
    }
}

/// Raw views of [`ActTiles`] that token-tile tasks fill disjointly.
struct TilesOut {
    q: *mut u8,
    d: *mut f32,
    x: *mut u32,
}
// SAFETY: each task writes only its own token tiles' ranges.
unsafe impl Sync for TilesOut {}

/// Quantized activations as laid out by [`super::act`] (read-only views).
pub(crate) struct ActQuant<'a> {
    /// Codes, `cols` per row, in the weights' interleaved order.
    pub(crate) q: &'a [i8],
    /// Scale per row and lane block.
    pub(crate) d: &'a [f32],
    /// Sum of the codes per row and lane block.
    pub(crate) sum: &'a [i32],
    /// `d · sum` per row and lane block (the min types' term).
    pub(crate) scaled: &'a [f32],
}

impl ActTiles {
    /// Rearranges `m` rows of quantized activations (`cols` codes and
    /// `lanes` blocks each) for weights of kind `kind`; tokens past `m` in
    /// the last tile are zero.
    pub(crate) fn build(
        &mut self,
        pool: &ThreadPool,
        kind: u8,
        m: usize,
        cols: usize,
        lanes: usize,
        a: &ActQuant<'_>,
    ) {
        let tiles = m.div_ceil(TOK);
        super::grow(&mut self.q, tiles * lanes * B_BYTES / 64);
        super::grow(&mut self.d, tiles * lanes * TOK);
        super::grow(&mut self.x, tiles * lanes * TOK);
        let out = TilesOut {
            q: self.q.as_mut_ptr() as *mut u8,
            d: self.d.as_mut_ptr(),
            x: self.x.as_mut_ptr(),
        };
        let fill = |t0: usize, t1: usize| {
            let out = &out;
            for tt in t0..t1 {
                for i in 0..lanes {
                    let (g, s) = (i / 16, i % 16);
                    let gl = group_lanes(lanes, g);
                    let j = slot(gl, s);
                    let b = 16 * g + j;
                    let at = tt * lanes + i;
                    for tok in 0..TOK {
                        let row = tt * TOK + tok;
                        let live = row < m;
                        for kk in 0..8 {
                            let off =
                                row * cols + 16 * g * 32 + chunk_of(kind, kk) * 4 * gl + 4 * j;
                            let v = if live {
                                u32::from_le_bytes([
                                    a.q[off] as u8,
                                    a.q[off + 1] as u8,
                                    a.q[off + 2] as u8,
                                    a.q[off + 3] as u8,
                                ])
                            } else {
                                0
                            };
                            // SAFETY: within tile `at`, written by this task only.
                            unsafe {
                                std::ptr::write_unaligned(
                                    out.q.add(at * B_BYTES + kk * 64 + tok * 4) as *mut u32,
                                    v,
                                )
                            };
                        }
                        let (d, x) = if live {
                            let x = if has_min(kind) {
                                a.scaled[row * lanes + b].to_bits()
                            } else {
                                a.sum[row * lanes + b] as u32
                            };
                            (a.d[row * lanes + b], x)
                        } else {
                            (0.0, 0)
                        };
                        // SAFETY: as above.
                        unsafe {
                            *out.d.add(at * TOK + tok) = d;
                            *out.x.add(at * TOK + tok) = x;
                        }
                    }
                }
            }
        };
        if tiles > 1 && pool.threads() > 1 {
            pool.run_ranges(tiles, 1, &fill);
        } else {
            fill(0, tiles);
        }
    }
}

/// Per-thread buffers: the unpacked row tile, its scales, and C tiles.
#[derive(Default)]
struct Scratch {
    /// 16 rows of unpacked codes, `pitch` bytes each (32 per block slot).
    a: Option<ABuf>,
    /// Weight scales and mins as f32, `[row][block]`.
    dw: Vec<f32>,
    mw: Vec<f32>,
    /// One C tile per block slot.
    c: Option<ABuf>,
}

impl Scratch {
    /// Grows the buffers for a weight of `lanes` lane blocks.
    fn reserve(&mut self, lanes: usize) {
        let pitch = lanes.div_ceil(16) * 16 * 32;
        grow_abuf(&mut self.a, ROWS * pitch);
        grow_abuf(&mut self.c, lanes * C_BYTES);
        super::grow(&mut self.dw, ROWS * lanes);
        super::grow(&mut self.mw, ROWS * lanes);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Grows this thread's [`run_rows`] buffers for a weight of `lanes` lane
/// blocks, so that a later call for it allocates nothing.
pub(crate) fn reserve_thread_scratch(lanes: usize) {
    SCRATCH.with_borrow_mut(|s| s.reserve(lanes));
}

/// Grows `buf` to at least `len` bytes (never shrinks, so warm calls
/// allocate nothing).
pub(super) fn grow_abuf(buf: &mut Option<ABuf>, len: usize) -> &mut ABuf {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = Some(ABuf::zeroed(len));
    }
    buf.as_mut().expect("set above")
}

/// Computes output rows `r0..r1` (`r0` and `r1 − r0` multiples of 16) for
/// all `m` tokens of `t` into `out` (`m × ldo`).
///
/// # Safety
/// The CPU level must be [`crate::cpu::SimdLevel::Amx`]; `t` must have been
/// built for `q` and `m`; each task must own its output columns.
pub(crate) unsafe fn run_rows<const K: u8>(
    q: &QMat,
    t: &ActTiles,
    m: usize,
    r0: usize,
    r1: usize,
    out: OutPtr,
    ldo: usize,
) {
    debug_assert!(r0.is_multiple_of(ROWS) && (r1 - r0).is_multiple_of(ROWS));
    if r0 == r1 {
        return;
    }
    let lanes = q.lanes;
    let pitch = lanes.div_ceil(16) * 16 * 32;
    let tiles = m.div_ceil(TOK);
    SCRATCH.with_borrow_mut(|s| {
        s.reserve(lanes);
        let abuf = s.a.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        let cbuf = s.c.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        // SAFETY (whole block): the caller guarantees AMX (tiles released
        // below on this thread); rows r0..r1 exist; buffers are sized above;
        // `t` holds every slot of each token tile.
        unsafe {
            CONFIG.load();
            for tb in (0..tiles).step_by(TILES_PER_BLOCK) {
                for rt in (r0..r1).step_by(ROWS) {
                    unpack::<K>(q, rt, abuf, pitch, &mut s.dw, &mut s.mw);
                    for tt in tb..(tb + TILES_PER_BLOCK).min(tiles) {
                        let b = (t.q.as_ptr() as *const u8).add(tt * lanes * B_BYTES);
                        let p = Products {
                            a: abuf,
                            pitch,
                            b,
                            c: cbuf,
                        };
                        p.run(lanes);
                        let ahead = (tt == tb).then_some(q);
                        epilogue::<K>(t, tt, lanes, cbuf, &s.dw, &s.mw, m, rt, out, ldo, ahead);
                    }
                }
            }
            release_tiles();
        }
    });
}

/// Unpacks rows `r0..r0 + 16` of `q` into `a` (block slot `i` of row `n` at
/// `n · pitch + 32 i`, codes in [`chunk_of`] order) and their scales (and
/// mins) into `dw` (`mw`) as f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(super) unsafe fn unpack<const K: u8>(
    q: &QMat,
    r0: usize,
    a: *mut u8,
    pitch: usize,
    dw: &mut [f32],
    mw: &mut [f32],
) {
    let lanes = q.lanes;
    let qs = q.qs.ptr();
    let units = if code_bits(K) == 8 { 8 } else { 4 };
    let gbytes = 16 * units * 4;
    // The rows read here were prefetched during the previous row tile's
    // epilogue (see `prefetch_row`): the access pattern inside a panel
    // (unit `k` of row `j` at `(8k + j) · 64`) defeats the hardware
    // prefetchers.
    for n in 0..ROWS {
        let r = r0 + n;
        let panel = qs.add(r / PANEL * PANEL * q.qs_row);
        let row = a.add(n * pitch);
        for g in 0..lanes.div_ceil(16) {
            let gl = group_lanes(lanes, g);
            let stride = 4 * gl;
            // Unit `k` of this row's group `g` (see `QMat::qs_index`).
            let unit = |k: usize| panel.add(PANEL * g * gbytes + (k * PANEL + r % PANEL) * stride);
            let dst = row.add(16 * g * 32);
            // Units of a short group are `4 · gl` bytes: masked loads zero
            // the missing lanes.
            let lm: __mmask16 = if gl == 16 { 0xffff } else { (1u16 << gl) - 1 };
            let ld = |k: usize| _mm512_maskz_loadu_epi32(lm, unit(k) as *const i32);
            let (first, second) = if code_bits(K) == 8 {
                (
                    transpose4(ld(0), ld(1), ld(2), ld(3)),
                    transpose4(ld(4), ld(5), ld(6), ld(7)),
                )
            } else {
                let z = transpose4(ld(0), ld(1), ld(2), ld(3));
                let m = _mm512_set1_epi8(0x0f);
                (
                    z.map(|v| _mm512_and_si512(v, m)),
                    z.map(|v| _mm512_and_si512(_mm512_srli_epi16::<4>(v), m)),
                )
            };
            if gl == 16 {
                for rr in 0..4 {
                    store_pairs(dst, rr, first[rr], second[rr]);
                }
            } else {
                // Lane by lane, in order: 128-bit lane `L` of `first[r]`
                // and `second[r]` is lane `4L + r`'s block.
                for j in 0..gl {
                    let (l, r) = (j / 4, j % 4);
                    let keep: __mmask16 = 0xf << (4 * l);
                    let at = dst.wrapping_add(32 * j).wrapping_sub(16 * l);
                    _mm512_mask_storeu_epi32(at as *mut i32, keep, first[r]);
                    _mm512_mask_storeu_epi32(at.wrapping_add(16) as *mut i32, keep, second[r]);
                }
            }
        }
        // Scales (and mins) as f32, 16 blocks at a time.
        for b0 in (0..lanes).step_by(16) {
            let k = (lanes - b0).min(16);
            let mask: __mmask16 = if k == 16 { 0xffff } else { (1u16 << k) - 1 };
            let lb = lane_at(lanes, r, b0);
            let d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                mask,
                q.d.ptr().add(2 * lb) as *const i16,
            ));
            _mm512_mask_storeu_ps(dw.as_mut_ptr().add(n * lanes + b0), mask, d);
            if K == K_Q4_1 {
                let mn = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    mask,
                    q.m.ptr().add(2 * lb) as *const i16,
                ));
                _mm512_mask_storeu_ps(mw.as_mut_ptr().add(n * lanes + b0), mask, mn);
            }
        }
    }
}

/// Prefetches into L2 the `r`-th `qs_row`-byte slice of the codes (a row
/// tile's two panels are one contiguous run of 16 such slices, though rows
/// interleave inside them) and row `r`'s scales and mins, if row `r`
/// exists. The epilogue issues these for the next row tile, one slice per
/// output row: spread out, they keep a few misses in flight while the
/// vector units work, where a burst at the start of unpacking stalled on
/// fill buffers (16 × 16/256 decode, 3 alternating runs: 737–776 →
/// 773–785 output tok/s).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn prefetch_row<const K: u8>(q: &QMat, r: usize) {
    if r >= q.rows {
        return;
    }
    let at = q.qs.ptr().add(r * q.qs_row);
    for off in (0..q.qs_row).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(at.add(off) as *const i8);
    }
    let lb = lane_at(q.lanes, r, 0);
    _mm_prefetch::<_MM_HINT_T1>(q.d.ptr().add(2 * lb) as *const i8);
    if K == K_Q4_1 {
        _mm_prefetch::<_MM_HINT_T1>(q.m.ptr().add(2 * lb) as *const i8);
    }
}

/// The 4 × 16 dword transpose of four units: returns `z` with 128-bit lane
/// `L` of `z[r]` = dword `4L + r` of each unit, in unit order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn transpose4(v0: __m512i, v1: __m512i, v2: __m512i, v3: __m512i) -> [__m512i; 4] {
    let x0 = _mm512_unpacklo_epi32(v0, v1);
    let x1 = _mm512_unpackhi_epi32(v0, v1);
    let y0 = _mm512_unpacklo_epi32(v2, v3);
    let y1 = _mm512_unpackhi_epi32(v2, v3);
    [
        _mm512_unpacklo_epi64(x0, y0),
        _mm512_unpackhi_epi64(x0, y0),
        _mm512_unpacklo_epi64(x1, y1),
        _mm512_unpackhi_epi64(x1, y1),
    ]
}

/// Stores lanes `4L + r` (L = 0..4) of a transposed group: block `4L + r`'s
/// 32 codes are 128-bit lane `L` of `first` then of `second`, at slot
/// `4r + L`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn store_pairs(dst: *mut u8, r: usize, first: __m512i, second: __m512i) {
    let i01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    let i23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    let p01 = _mm512_permutex2var_epi64(first, i01, second);
    let p23 = _mm512_permutex2var_epi64(first, i23, second);
    _mm512_storeu_si512(dst.add(32 * 4 * r) as *mut __m512i, p01);
    _mm512_storeu_si512(dst.add(32 * (4 * r + 2)) as *mut __m512i, p23);
}

/// The tile products of one unit: C tile `i` (at `c + i · C_BYTES`) = A
/// slot `i` (rows of `a`, `pitch` apart) × B tile `i` (at `b + i · B_BYTES`).
struct Products {
    a: *const u8,
    pitch: usize,
    b: *const u8,
    c: *mut u8,
}

/// One `asm!` of tile instructions for slot `$i` onwards of a [`Products`]:
/// `{a}`, `{b}` and `{c}` are the slot's A, B and C addresses, `{pa}` the A
/// row pitch and `{s64}` the B and C row pitch.
macro_rules! tile_asm {
    ($p:expr, $i:expr, $($line:literal),+ $(,)?) => {
        asm!(
            $($line),+,
            a = in(reg) $p.a.add(32 * $i),
            b = in(reg) $p.b.add(B_BYTES * $i),
            c = in(reg) $p.c.add(C_BYTES * $i),
            pa = in(reg) $p.pitch,
            s64 = in(reg) 64usize,
            options(nostack),
        )
    };
}

impl Products {
    /// Computes slots `0..lanes`, four at a time where it can (loads into
    /// alternating registers overlap the previous product).
    ///
    /// # Safety
    /// AMX is configured with [`CONFIG`] on this thread, and the slots are
    /// in bounds of all three buffers.
    #[inline]
    unsafe fn run(&self, lanes: usize) {
        let mut i = 0;
        while i + 4 <= lanes {
            // SAFETY: the caller guarantees the configuration and bounds.
            unsafe {
                tile_asm!(
                    self,
                    i,
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "tileloadd tmm4, [{a} + {pa}*1]",
                    "tileloadd tmm6, [{b} + {s64}*1]",
                    "tileloadd tmm5, [{a} + {pa}*1 + 32]",
                    "tileloadd tmm7, [{b} + {s64}*1 + 512]",
                    "tdpbusd tmm0, tmm4, tmm6",
                    "tdpbusd tmm1, tmm5, tmm7",
                    "tileloadd tmm4, [{a} + {pa}*1 + 64]",
                    "tileloadd tmm6, [{b} + {s64}*1 + 1024]",
                    "tileloadd tmm5, [{a} + {pa}*1 + 96]",
                    "tileloadd tmm7, [{b} + {s64}*1 + 1536]",
                    "tdpbusd tmm2, tmm4, tmm6",
                    "tdpbusd tmm3, tmm5, tmm7",
                    "tilestored [{c} + {s64}*1], tmm0",
                    "tilestored [{c} + {s64}*1 + 1024], tmm1",
                    "tilestored [{c} + {s64}*1 + 2048], tmm2",
                    "tilestored [{c} + {s64}*1 + 3072], tmm3",
                );
            }
            i += 4;
        }
        while i < lanes {
            // SAFETY: as above, one slot.
            unsafe {
                tile_asm!(
                    self,
                    i,
                    "tilezero tmm0",
                    "tileloadd tmm4, [{a} + {pa}*1]",
                    "tileloadd tmm6, [{b} + {s64}*1]",
                    "tdpbusd tmm0, tmm4, tmm6",
                    "tilestored [{c} + {s64}*1], tmm0",
                );
            }
            i += 1;
        }
    }
}

/// Scales and sums the C tiles of row tile `r0` × token tile `tt` exactly as
/// the VNNI kernel does (see the module docs) and stores the live tokens.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn epilogue<const K: u8>(
    t: &ActTiles,
    tt: usize,
    lanes: usize,
    c: *const u8,
    dw: &[f32],
    mw: &[f32],
    m: usize,
    r0: usize,
    out: OutPtr,
    ldo: usize,
    ahead: Option<&QMat>,
) {
    let live = (m - tt * TOK).min(TOK);
    // Row `n`'s 16 token sums, transposed below into 16 tokens' row runs.
    let mut sums = [_mm512_setzero_ps(); ROWS];
    let td = t.d.as_ptr().add(tt * lanes * TOK);
    let tx = t.x.as_ptr().add(tt * lanes * TOK);
    for n in 0..ROWS {
        let mut acc = [_mm512_setzero_ps(); 16];
        for g in 0..lanes.div_ceil(16) {
            let gl = group_lanes(lanes, g);
            let cg = c.add(16 * g * C_BYTES + n * 64);
            let (dg, xg) = (td.add(16 * g * TOK), tx.add(16 * g * TOK));
            let wd = dw.as_ptr().add(n * lanes + 16 * g);
            let wm = mw.as_ptr().add(n * lanes + 16 * g);
            // One lane block: `$j` is a literal so that `acc` stays in
            // registers (any run-time index would put it on the stack).
            macro_rules! step {
                ($j:literal, $fused:expr) => {{
                    let i = slot(gl, $j);
                    let mut iv = _mm512_load_si512(cg.add(i * C_BYTES) as *const __m512i);
                    let x = _mm512_loadu_si512(xg.add(i * TOK) as *const __m512i);
                    if !has_min(K) {
                        // u = q + offset: subtract offset · Σa exactly.
                        let sh = match off_shift(K) {
                            3 => _mm512_slli_epi32::<3>(x),
                            _ => _mm512_slli_epi32::<7>(x),
                        };
                        iv = _mm512_sub_epi32(iv, sh);
                    }
                    let da = _mm512_loadu_ps(dg.add(i * TOK));
                    let scale = _mm512_mul_ps(_mm512_set1_ps(*wd.add($j)), da);
                    let v = _mm512_cvtepi32_ps(iv);
                    if $fused {
                        acc[$j] = _mm512_fmadd_ps(v, scale, acc[$j]);
                        if has_min(K) {
                            let mv = _mm512_set1_ps(*wm.add($j));
                            acc[$j] = _mm512_fmadd_ps(mv, _mm512_castsi512_ps(x), acc[$j]);
                        }
                    } else {
                        acc[$j] = _mm512_add_ps(acc[$j], _mm512_mul_ps(v, scale));
                        if has_min(K) {
                            let mv = _mm512_set1_ps(*wm.add($j));
                            acc[$j] =
                                _mm512_add_ps(acc[$j], _mm512_mul_ps(mv, _mm512_castsi512_ps(x)));
                        }
                    }
                }};
            }
            macro_rules! steps {
                ($($j:literal)*) => {
                    if gl == 16 {
                        $( step!($j, true); )*
                    } else {
                        $( if $j < gl {
                            if gl > 8 { step!($j, true) } else { step!($j, false) }
                        } )*
                    }
                };
            }
            steps!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }
        // `hsum16`'s tree, token-wise.
        let mut s8 = [_mm512_setzero_ps(); 8];
        for k in 0..8 {
            s8[k] = _mm512_add_ps(acc[k], acc[k + 8]);
        }
        let mut s4 = [_mm512_setzero_ps(); 4];
        for k in 0..4 {
            s4[k] = _mm512_add_ps(s8[k], s8[k + 4]);
        }
        let s2 = [_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3])];
        sums[n] = _mm512_add_ps(s2[0], s2[1]);
        if let Some(q) = ahead {
            prefetch_row::<K>(q, r0 + ROWS + n);
        }
    }
    // One 64-byte store per token instead of a 16-line scatter per row.
    let by_token = transpose16(&sums);
    for tok in 0..live {
        _mm512_storeu_ps(out.0.add((tt * TOK + tok) * ldo + r0), by_token[tok]);
    }
}

/// The transpose of a 16 × 16 f32 matrix held as 16 row vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
pub(super) unsafe fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    // Stage 1: interleave element pairs of rows (2k, 2k + 1).
    let mut a = [_mm512_setzero_ps(); 16];
    for k in 0..8 {
        a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    // Stage 2: 4 × 4 blocks within each 128-bit lane, rows 4q..4q + 4.
    let mut b = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let (x0, x1, y0, y1) = (a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
        let d = |u: __m512, v: __m512| {
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u), _mm512_castps_pd(v)))
        };
        let e = |u: __m512, v: __m512| {
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u), _mm512_castps_pd(v)))
        };
        b[4 * q] = d(x0, y0);
        b[4 * q + 1] = e(x0, y0);
        b[4 * q + 2] = d(x1, y1);
        b[4 * q + 3] = e(x1, y1);
    }
    // Now 128-bit lane L of b[4q + c] holds column 4L + c of rows
    // 4q..4q + 4. Stages 3 and 4 gather lane L of the four row groups.
    let mut c = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        // Lanes (0, 1) and (2, 3) of row groups (0, 1) and (2, 3).
        c[k] = _mm512_shuffle_f32x4::<0b01_00_01_00>(b[k], b[4 + k]);
        c[4 + k] = _mm512_shuffle_f32x4::<0b11_10_11_10>(b[k], b[4 + k]);
        c[8 + k] = _mm512_shuffle_f32x4::<0b01_00_01_00>(b[8 + k], b[12 + k]);
        c[12 + k] = _mm512_shuffle_f32x4::<0b11_10_11_10>(b[8 + k], b[12 + k]);
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        // Column 4L + k: lane L of groups 0, 1 (from c[k] or c[4 + k]) then 2, 3.
        out[k] = _mm512_shuffle_f32x4::<0b10_00_10_00>(c[k], c[8 + k]);
        out[4 + k] = _mm512_shuffle_f32x4::<0b11_01_11_01>(c[k], c[8 + k]);
        out[8 + k] = _mm512_shuffle_f32x4::<0b10_00_10_00>(c[4 + k], c[12 + k]);
        out[12 + k] = _mm512_shuffle_f32x4::<0b11_01_11_01>(c[4 + k], c[12 + k]);
    }
    out
}
