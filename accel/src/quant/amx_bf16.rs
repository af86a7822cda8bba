//! Quantized matmuls for *wide* rows on the AMX-BF16 tile unit: weights
//! dequantized to bf16 per row tile, activations rounded to bf16, products
//! accumulated in f32 across the whole row by the tile unit.
//!
//! # Why a second kernel
//! The int8 kernels ([`super::qkern`], [`super::amx`]) scale every 32-element
//! block's integer dot product in f32, exactly as a single row would, so a
//! row's result never depends on its batch. That per-block float epilogue is
//! most of a prompt's cost. Here the tile unit sums across blocks itself and
//! there is no epilogue, at the price of different rounding: a wide row's
//! result is not its int8 result. It is still a function of the row alone
//! (each output element is the same sequence of tile instructions whatever
//! the batch, the row's place in it, or the thread), so callers that route
//! a row by a property of the row itself (the engine: prompt positions) keep
//! batch invariance.
//!
//! # Tiles
//! - A (activations): 16 wide rows × the 32 values of one lane block, as
//!   bf16, in the order the weight codes of that block are unpacked
//!   ([`super::amx::chunk_of`]); built once per matmul ([`WideAct`]).
//! - B (weights): the 16 rows of a row tile × one lane block, as bf16 pairs
//!   (`B[p][n]` = elements `2p, 2p + 1` of row `n`), dequantized from the
//!   unpacked codes per row tile.
//! - C: 16 wide rows × 16 output columns of f32, accumulated over every lane
//!   block and stored once.

use super::amx::{chunk_of, grow_abuf, slot, transpose16, unpack};
use super::bf16::{pack_bf16, zero_c, ActOut};
use super::layout::{group_lanes, ABuf, QMat, K_Q4_0, K_Q4_1, K_Q8_0};
use super::OutPtr;
use crate::cpu::amx::{release_tiles, TileConfig};
use crate::cpu::pool::ThreadPool;
use core::arch::x86_64::*;
use std::arch::asm;
use std::cell::RefCell;

/// Rows per tile (weight rows of a row tile, activation rows of a token
/// tile) and bytes per tile row.
const ROWS: usize = 16;
/// Bytes of one 16 × 64 tile.
const TILE: usize = 1024;
/// Token tiles accumulated at once (C registers 0–3).
const GROUP: usize = 4;

/// Every register 16 rows × 64 bytes: 0–3 C, 4–5 A, 6 B.
static CONFIG: TileConfig = TileConfig::new([(16, 64); 8]);

/// The wide rows' activations as A tiles: row `t` (of the wide rows, padded
/// to whole groups of token tiles with zeros) at `t · lanes · 64` bytes,
/// lane slot `i` at `+ 64 i`.
#[derive(Default)]
pub(crate) struct WideAct {
    buf: Option<ABuf>,
    /// Wide rows, before padding.
    rows: usize,
}

impl WideAct {
    /// Rounds rows `wide` of `x` (`cols` values each) for weights of kind
    /// `kind` with `lanes` lane blocks.
    ///
    /// # Safety
    /// The CPU must have AVX-512 and AVX512-BF16
    /// ([`crate::cpu::amx::has_bf16`]); every index in `wide` must be a row
    /// of `x`.
    pub(crate) unsafe fn build(
        &mut self,
        pool: &ThreadPool,
        kind: u8,
        x: &[f32],
        cols: usize,
        lanes: usize,
        wide: &[usize],
    ) {
        let padded = wide.len().div_ceil(ROWS * GROUP) * ROWS * GROUP;
        let pitch = lanes * 64;
        let buf = grow_abuf(&mut self.buf, padded * pitch);
        self.rows = wide.len();
        let out = ActOut(buf.bytes_mut().as_mut_ptr());
        let fill = |t0: usize, t1: usize| {
            let out = &out;
            for t in t0..t1 {
                // SAFETY: row `t` of the buffer (sized above) is this
                // task's; `x` holds row `wide[t]` (the caller's contract).
                unsafe {
                    let dst = out.0.add(t * pitch);
                    if t >= wide.len() {
                        std::ptr::write_bytes(dst, 0, pitch);
                        continue;
                    }
                    let row = &x[wide[t] * cols..(wide[t] + 1) * cols];
                    fill_row(kind, row, lanes, dst);
                }
            }
        };
        if wide.len() >= 2 * ROWS && pool.threads() > 1 {
            pool.run_ranges(padded, 1, &fill);
        } else {
            fill(0, padded);
        }
    }
}

/// One activation row into A-tile order (see [`WideAct`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn fill_row(kind: u8, row: &[f32], lanes: usize, dst: *mut u8) {
    let mut tmp = [0.0f32; 32];
    for i in 0..lanes {
        let (g, s) = (i / 16, i % 16);
        let b = 16 * g + slot(group_lanes(lanes, g), s);
        let block = &row[32 * b..32 * b + 32];
        for kk in 0..8 {
            let c = chunk_of(kind, kk);
            tmp[4 * kk..4 * kk + 4].copy_from_slice(&block[4 * c..4 * c + 4]);
        }
        let v = pack_bf16(
            _mm512_loadu_ps(tmp.as_ptr()),
            _mm512_loadu_ps(tmp.as_ptr().add(16)),
        );
        _mm512_storeu_si512(dst.add(64 * i) as *mut __m512i, v);
    }
}

/// Per-thread buffers: unpacked codes, their scales, the B tiles of one row
/// tile, and C tiles on their way out.
#[derive(Default)]
struct Scratch {
    a: Option<ABuf>,
    dw: Vec<f32>,
    mw: Vec<f32>,
    b: Option<ABuf>,
    c: Option<ABuf>,
}

impl Scratch {
    /// Grows the buffers for a weight of `lanes` lane blocks.
    fn reserve(&mut self, lanes: usize) {
        let pitch = lanes.div_ceil(16) * 16 * 32;
        grow_abuf(&mut self.a, ROWS * pitch);
        grow_abuf(&mut self.b, lanes * TILE);
        grow_abuf(&mut self.c, GROUP * TILE);
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

/// Dequantizes the unpacked row tile (`codes`, `pitch` bytes per row; scales
/// `dw`, mins `mw`, `[row][block]`) into B tiles, one per lane slot, at
/// `b + TILE · i`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,fma,f16c")]
unsafe fn build_b<const K: u8>(
    codes: *const u8,
    pitch: usize,
    dw: &[f32],
    mw: &[f32],
    lanes: usize,
    b: *mut u8,
) {
    let off = match K {
        K_Q4_0 => 8.0,
        K_Q8_0 => 128.0,
        _ => 0.0,
    };
    for i in 0..lanes {
        let (g, s) = (i / 16, i % 16);
        let blk = 16 * g + slot(group_lanes(lanes, g), s);
        let mut rows = [_mm512_setzero_ps(); ROWS];
        for (n, r) in rows.iter_mut().enumerate() {
            let c = codes.add(n * pitch + 32 * i);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(c as *const __m128i)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                c.add(16) as *const __m128i
            )));
            let d = _mm512_set1_ps(dw[n * lanes + blk]);
            let (lo, hi) = if K == K_Q4_1 {
                let m = _mm512_set1_ps(mw[n * lanes + blk]);
                (_mm512_fmadd_ps(d, lo, m), _mm512_fmadd_ps(d, hi, m))
            } else {
                let o = _mm512_set1_ps(off);
                (
                    _mm512_mul_ps(d, _mm512_sub_ps(lo, o)),
                    _mm512_mul_ps(d, _mm512_sub_ps(hi, o)),
                )
            };
            *r = _mm512_castsi512_ps(pack_bf16(lo, hi));
        }
        // Row `n`'s pairs are lane `p` of `rows[n]`; B wants pair `p` of
        // all 16 rows in tile row `p`.
        let t = transpose16(&rows);
        let dst = b.add(TILE * i);
        for (p, v) in t.iter().enumerate() {
            _mm512_storeu_ps(dst.add(64 * p) as *mut f32, *v);
        }
    }
}

/// Computes output columns `r0..r1` (whole row tiles) of the wide rows into
/// `out` (row `wide[t]` of `m × ldo`).
///
/// # Safety
/// The CPU level must be [`crate::cpu::SimdLevel::Amx`] with
/// [`crate::cpu::amx::has_bf16`]; `act` must have been built for `q` and
/// `wide`; each task must own its output columns.
pub(crate) unsafe fn run_rows<const K: u8>(
    q: &QMat,
    act: &WideAct,
    wide: &[usize],
    r0: usize,
    r1: usize,
    out: OutPtr,
    ldo: usize,
) {
    debug_assert!(r0.is_multiple_of(ROWS) && (r1 - r0).is_multiple_of(ROWS));
    if r0 == r1 || wide.is_empty() {
        return;
    }
    let lanes = q.lanes;
    let pitch = lanes.div_ceil(16) * 16 * 32;
    let apitch = lanes * 64;
    let n_tiles = act.rows.div_ceil(ROWS);
    let Some(abase) = act.buf.as_ref().map(|b| b.ptr()) else {
        return;
    };
    SCRATCH.with_borrow_mut(|s| {
        s.reserve(lanes);
        let codes = s.a.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        let bbuf = s.b.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        let cbuf = s.c.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        // SAFETY (whole block): AMX-BF16 is configured below and released
        // at the end on this thread; rows `r0..r1` exist; the buffers are
        // sized above; A holds whole groups of token tiles (padded).
        unsafe {
            CONFIG.load();
            for rt in (r0..r1).step_by(ROWS) {
                unpack::<K>(q, rt, codes, pitch, &mut s.dw, &mut s.mw);
                build_b::<K>(codes, pitch, &s.dw, &s.mw, lanes, bbuf);
                for tg in (0..n_tiles).step_by(GROUP) {
                    let a = abase.add(tg * ROWS * apitch);
                    products(a, apitch, bbuf, lanes, (n_tiles - tg).min(GROUP), cbuf);
                    for u in 0..(n_tiles - tg).min(GROUP) {
                        for r in 0..ROWS {
                            let t = (tg + u) * ROWS + r;
                            if t >= wide.len() {
                                break;
                            }
                            std::ptr::copy_nonoverlapping(
                                cbuf.add(u * TILE + 64 * r) as *const f32,
                                out.0.add(wide[t] * ldo + rt),
                                ROWS,
                            );
                        }
                    }
                }
            }
            release_tiles();
        }
    });
}

/// C tile `u` (at `c + TILE · u`) = Σ over lane slots `i` of A (token tile
/// `u` of `a`, rows `apitch` apart, slot `i`) × B tile `i`, for `ng` live
/// token tiles (all four C tiles are stored).
///
/// # Safety
/// [`CONFIG`] is loaded on this thread; `a` holds a whole group of
/// [`GROUP`] token tiles of `lanes` slots, `b` `lanes` tiles, `c` `GROUP`
/// tiles.
#[inline]
unsafe fn products(a: *const u8, apitch: usize, b: *const u8, lanes: usize, ng: usize, c: *mut u8) {
    let tile_rows = ROWS * apitch;
    // SAFETY (each block): the caller's contract; tile rows are 64 bytes.
    unsafe {
        zero_c();
        for i in 0..lanes {
            let (ai, bi) = (a.add(64 * i), b.add(TILE * i));
            if ng == 1 {
                asm!(
                    "tileloadd tmm6, [{b} + {s64}*1]",
                    "tileloadd tmm4, [{a} + {pa}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    a = in(reg) ai,
                    b = in(reg) bi,
                    pa = in(reg) apitch,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly),
                );
            } else {
                // Two or three live token tiles run as four: A is padded
                // to whole groups with zero rows, whose products are
                // computed and dropped.
                asm!(
                    "tileloadd tmm6, [{b} + {s64}*1]",
                    "tileloadd tmm4, [{a} + {pa}*1]",
                    "tileloadd tmm5, [{a1} + {pa}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm5, tmm6",
                    "tileloadd tmm4, [{a2} + {pa}*1]",
                    "tileloadd tmm5, [{a3} + {pa}*1]",
                    "tdpbf16ps tmm2, tmm4, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm6",
                    a = in(reg) ai,
                    a1 = in(reg) ai.add(tile_rows),
                    a2 = in(reg) ai.add(2 * tile_rows),
                    a3 = in(reg) ai.add(3 * tile_rows),
                    b = in(reg) bi,
                    pa = in(reg) apitch,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
        }
        asm!(
            "tilestored [{c} + {s64}*1], tmm0",
            "tilestored [{c} + {s64}*1 + 1024], tmm1",
            "tilestored [{c} + {s64}*1 + 2048], tmm2",
            "tilestored [{c} + {s64}*1 + 3072], tmm3",
            c = in(reg) c,
            s64 = in(reg) 64usize,
            options(nostack),
        );
    }
}
