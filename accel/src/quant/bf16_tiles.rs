//! Quantized matmuls on the AMX-BF16 tile unit, one kernel for every batch
//! size: weights are dequantized per 16-row tile to bf16 through per-block
//! lookup tables, activations are rounded to bf16, and the tile unit
//! accumulates whole rows in f32.
//!
//! # Why one kernel for every row
//! The engine's exactness rule is that a sequence decodes the same tokens
//! alone or in a batch. The int8 kernels ([`super::qkern`], [`super::amx`])
//! meet it by scaling each 32-element block's integer product in f32 exactly
//! as a single row would, and that per-block, per-token float epilogue makes
//! a 16-row decode step cost 4–5× a 1-row one. Here the per-block work is
//! on the weights only (the lookup tables and the unpacking, paid once per
//! call whatever the number of rows), and the tile unit sums across blocks
//! itself, so 16 rows cost little more than one. Every output element is
//! the same sequence of tile instructions whatever the batch, the row's
//! place in it, or the thread, so the result is a function of the row alone.
//!
//! # Numerics
//! A weight is `d · q + m` (Q4_1), `d · (q − 8)` (Q4_0) or `d · q` (Q8_0),
//! computed in f32 and rounded to bf16 (Q4: to nearest, ties away from zero,
//! by adding half an ulp to the bits; Q8_0: `vcvtne2ps2bf16`, ties to even);
//! activations are rounded to nearest even. Products are exact in f32 and
//! accumulate in f32. Against an f64 reference the error is bounded by about
//! 2⁻⁸ · Σ|w · x|: the same order as the 8-bit activation codes of the int8
//! kernels, without their block-wise loss on small activations.
//!
//! # Layout ([`TileMat`])
//! One record per (16-row tile, 32-element block), tiles in row order and
//! blocks in column order, so a thread streams its tiles front to back:
//! - Q4_0 / Q4_1: 256 bytes of codes as four 64-byte vectors; word `i` of
//!   vector `z` holds element `i` of rows `4z .. 4z + 4` in its four
//!   nibbles (row `4z + k` in bits `4k .. 4k + 4`). Then 16 f16 scales and,
//!   for Q4_1, 16 f16 mins.
//! - Q8_0: 16 rows × 32 signed codes, then 16 f16 scales.
//!
//! Rows past the matrix's end (the last tile's padding) are zero.
//!
//! # Dequantizing a Q4 row block
//! The block's 16 possible values are one FMA over `[0, 1, …, 15]`; with
//! half an ulp added to their f32 bits, value `q`'s bf16 is the high half of
//! dword `q`, i.e. word `2q + 1`. Shifting the code vector puts a row's
//! nibble in bits 1–4 of each word, an OR sets bit 0, and one `vpermw`
//! (which reads index bits 0–4) looks up all 32 elements: five vector
//! instructions per 32 weights, against about twice that for converting
//! codes to floats.
//!
//! # Tiles
//! - A (weights): 16 rows × one block's 32 bf16, in element order.
//! - B (activations): 16 element pairs × N tokens (N = m below 16, else 16;
//!   the configuration follows N so that one decoding row loads 64 bytes).
//! - C: 16 rows × N tokens of f32, accumulated over every block.
//!
//! Up to 16 tokens, three row tiles share each B tile ([`PASS`]); beyond
//! that, up to four token tiles share each A tile (C registers 0–3), and
//! past 64 tokens a row tile's A tiles are kept for the next group.
//!
//! # Cost
//! Whole-model matmuls of SmolLM2-135M on 2 threads of a Sapphire Rapids
//! Xeon: 16 rows in 6.6–7.2 ms against the int8 tiles' 12.1, but one row
//! in 3.9–4.4 ms against the VNNI kernel's 2.15. Dequantizing is about
//! five vector instructions per 32 weights where VNNI spends about one, and
//! the tile instructions do not overlap with them. Which family an engine
//! uses is therefore chosen from its batch size
//! ([`crate::cpu::weight_level`]).

use super::bf16::{pack_bf16, zero_c, ActOut};
use super::layout::{ABuf, K_Q4_0, K_Q4_1, K_Q8_0};
use super::OutPtr;
use crate::cpu::amx::{release_tiles, TileConfig};
use crate::cpu::pool::ThreadPool;
use crate::quant::GgmlType;
use core::arch::x86_64::*;
use std::arch::asm;
use std::cell::RefCell;

/// Weight rows per tile and elements per block.
const ROWS: usize = 16;
const BLOCK: usize = 32;
/// Bytes of one A tile (16 rows × 64).
const A_TILE: usize = 1024;
/// Token tiles sharing an A tile (C registers 0–3).
const GROUP: usize = 4;

/// The storage kind code of `ty`, if this kernel takes it.
pub(crate) fn kind_of(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_0 => Some(K_Q4_0),
        GgmlType::Q4_1 => Some(K_Q4_1),
        GgmlType::Q8_0 => Some(K_Q8_0),
        _ => None,
    }
}

/// Bytes of one record's codes.
const fn code_bytes(kind: u8) -> usize {
    if kind == K_Q8_0 {
        ROWS * BLOCK
    } else {
        ROWS * BLOCK / 2
    }
}

/// Bytes of one (tile, block) record: codes, scales, and mins for Q4_1.
const fn record_bytes(kind: u8) -> usize {
    code_bytes(kind) + 2 * ROWS + if kind == K_Q4_1 { 2 * ROWS } else { 0 }
}

/// GGUF bytes of one 32-element block of `kind`.
const fn gguf_block_bytes(kind: u8) -> usize {
    match kind {
        K_Q4_0 => 18,
        K_Q4_1 => 20,
        _ => 34,
    }
}

/// A Q4_0, Q4_1 or Q8_0 matrix in the tile layout (see the module docs).
pub(crate) struct TileMat {
    pub(crate) kind: u8,
    pub(crate) rows: usize,
    /// Blocks per row.
    pub(super) blocks: usize,
    data: ABuf,
}

impl TileMat {
    /// Repacks `rows` GGUF rows of `cols` elements (`bytes`, already
    /// validated by the caller) of kind `kind`.
    pub(crate) fn from_gguf(kind: u8, rows: usize, cols: usize, bytes: &[u8]) -> TileMat {
        let bb = gguf_block_bytes(kind);
        let blocks = cols / BLOCK;
        TileMat::build(kind, rows, cols, |r, b| {
            &bytes[(r * blocks + b) * bb..(r * blocks + b + 1) * bb]
        })
    }

    /// Builds from a source of GGUF blocks (`block(row, b)`).
    fn build<'s>(
        kind: u8,
        rows: usize,
        cols: usize,
        block: impl Fn(usize, usize) -> &'s [u8],
    ) -> TileMat {
        TileMat::build_owned(kind, rows, cols, |r, b, out| {
            out.copy_from_slice(block(r, b))
        })
    }

    fn build_owned(
        kind: u8,
        rows: usize,
        cols: usize,
        mut block: impl FnMut(usize, usize, &mut [u8]),
    ) -> TileMat {
        let blocks = cols / BLOCK;
        let tiles = rows.div_ceil(ROWS);
        let rb = record_bytes(kind);
        let mut data = ABuf::zeroed(tiles * blocks * rb);
        let buf = data.bytes_mut();
        let mut src = [0u8; 34];
        let bb = gguf_block_bytes(kind);
        for t in 0..tiles {
            for b in 0..blocks {
                let rec = &mut buf[(t * blocks + b) * rb..(t * blocks + b + 1) * rb];
                for n in 0..ROWS.min(rows - t * ROWS) {
                    block(t * ROWS + n, b, &mut src[..bb]);
                    let (d, rest) = src.split_at(2);
                    let cb = code_bytes(kind);
                    rec[cb + 2 * n..cb + 2 * n + 2].copy_from_slice(d);
                    let qs = if kind == K_Q4_1 {
                        rec[cb + 2 * ROWS + 2 * n..cb + 2 * ROWS + 2 * n + 2]
                            .copy_from_slice(&rest[..2]);
                        &rest[2..18]
                    } else if kind == K_Q4_0 {
                        &rest[..16]
                    } else {
                        &rest[..32]
                    };
                    if kind == K_Q8_0 {
                        rec[n * BLOCK..(n + 1) * BLOCK].copy_from_slice(qs);
                    } else {
                        let (z, k) = (n / 4, n % 4);
                        for i in 0..BLOCK {
                            let code = if i < 16 { qs[i] & 0xf } else { qs[i - 16] >> 4 };
                            let at = 64 * z + 2 * i + k / 2;
                            rec[at] |= code << (4 * (k % 2));
                        }
                    }
                }
            }
        }
        TileMat {
            kind,
            rows,
            blocks,
            data,
        }
    }

    /// Writes block `b` of row `r` back in its GGUF form.
    fn gguf_block(&self, r: usize, b: usize, out: &mut [u8]) {
        let rb = record_bytes(self.kind);
        let (t, n) = (r / ROWS, r % ROWS);
        let rec = &self.data.bytes()[(t * self.blocks + b) * rb..(t * self.blocks + b + 1) * rb];
        let cb = code_bytes(self.kind);
        out[..2].copy_from_slice(&rec[cb + 2 * n..cb + 2 * n + 2]);
        let qs = if self.kind == K_Q4_1 {
            out[2..4].copy_from_slice(&rec[cb + 2 * ROWS + 2 * n..cb + 2 * ROWS + 2 * n + 2]);
            &mut out[4..20]
        } else {
            &mut out[2..]
        };
        if self.kind == K_Q8_0 {
            qs.copy_from_slice(&rec[n * BLOCK..(n + 1) * BLOCK]);
        } else {
            let (z, k) = (n / 4, n % 4);
            let code = |i: usize| (rec[64 * z + 2 * i + k / 2] >> (4 * (k % 2))) & 0xf;
            for (j, q) in qs.iter_mut().enumerate() {
                *q = code(j) | code(j + 16) << 4;
            }
        }
    }

    /// Bytes the matrix occupies.
    pub(crate) fn size_bytes(&self) -> usize {
        self.data.len()
    }

    /// Dequantizes row `r` into `out[..cols]`, with the formats' own
    /// arithmetic (`d · q + m`, `d · (q − 8)`, `d · q`), not this kernel's
    /// bf16 rounding: this serves the embedding lookup.
    pub(crate) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let mut blk = [0u8; 34];
        let bb = gguf_block_bytes(self.kind);
        for b in 0..self.blocks {
            self.gguf_block(r, b, &mut blk[..bb]);
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let o = &mut out[b * BLOCK..(b + 1) * BLOCK];
            match self.kind {
                K_Q4_1 => {
                    let m = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    for j in 0..16 {
                        o[j] = d * (blk[4 + j] & 0xf) as f32 + m;
                        o[j + 16] = d * (blk[4 + j] >> 4) as f32 + m;
                    }
                }
                K_Q4_0 => {
                    for j in 0..16 {
                        o[j] = d * ((blk[2 + j] & 0xf) as i32 - 8) as f32;
                        o[j + 16] = d * ((blk[2 + j] >> 4) as i32 - 8) as f32;
                    }
                }
                _ => {
                    for j in 0..32 {
                        o[j] = d * (blk[2 + j] as i8) as f32;
                    }
                }
            }
        }
    }
}

/// The activations of one call as B tiles: token tile `tt`, block `b` at
/// `(tt · blocks + b) · 16 · n` dwords, pair `p` of token `t` at `+ p · n + t`.
#[derive(Default)]
pub(crate) struct TileAct {
    buf: Option<ABuf>,
    /// Tokens per tile (C's and B's columns).
    n: usize,
}

impl TileAct {
    /// Rounds `m` rows of `x` (`cols` each) into B tiles.
    ///
    /// # Safety
    /// The CPU must have AVX-512 and AVX512-BF16.
    pub(crate) unsafe fn build(&mut self, pool: &ThreadPool, x: &[f32], m: usize, cols: usize) {
        let n = m.min(ROWS);
        let tiles = m.div_ceil(n);
        let blocks = cols / BLOCK;
        let len = tiles * blocks * ROWS * n * 4;
        let buf = super::amx::grow_abuf(&mut self.buf, len);
        if !m.is_multiple_of(n) {
            // The last tile's missing tokens must be zeros, not stale data.
            let from = (tiles - 1) * blocks * ROWS * n * 4;
            buf.bytes_mut()[from..len].fill(0);
        }
        self.n = n;
        let out = ActOut(buf.bytes_mut().as_mut_ptr() as *mut u32);
        if n == ROWS {
            // Whole token tiles: one 16 × 16 transpose per block instead of
            // 16 scatters.
            let fill = |t0: usize, t1: usize| {
                let out = &out;
                for tt in t0..t1 {
                    let live = (m - tt * ROWS).min(ROWS);
                    let rows = &x[tt * ROWS * cols..(tt * ROWS + live) * cols];
                    // SAFETY: the tile's rows exist; its B tiles are this task's.
                    unsafe { fill_tile(rows, live, cols, tt, blocks, out.0) };
                }
            };
            if tiles > 1 && pool.threads() > 1 {
                pool.run_ranges(tiles, 1, &fill);
            } else {
                fill(0, tiles);
            }
            return;
        }
        // A partial tile of `m < 16` tokens: each token scattered down its
        // column (one plain store per block for a single token).
        for i in 0..m {
            // SAFETY: row `i` of `x` exists; the buffer holds `m` columns.
            unsafe { fill_token(&x[i * cols..(i + 1) * cols], i, n, blocks, out.0) };
        }
    }
}

/// Token tile `tt` (`live` rows of `cols` in `rows`): each block's 16
/// tokens' bf16 pairs, transposed into the block's B tile (pair-major);
/// missing tokens are zeros.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,fma,f16c")]
unsafe fn fill_tile(
    rows: &[f32],
    live: usize,
    cols: usize,
    tt: usize,
    blocks: usize,
    out: *mut u32,
) {
    for b in 0..blocks {
        let mut v = [_mm512_setzero_ps(); ROWS];
        for (t, r) in v.iter_mut().enumerate().take(live) {
            let src = rows.as_ptr().add(t * cols + b * BLOCK);
            let p = pack_bf16(_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
            *r = _mm512_castsi512_ps(p);
        }
        let dst = out.add((tt * blocks + b) * ROWS * ROWS);
        for (p, row) in super::amx::transpose16(&v).iter().enumerate() {
            _mm512_storeu_ps(dst.add(p * ROWS) as *mut f32, *row);
        }
    }
}

/// Token `t` of a partial tile of `n` tokens: each block's 32 values as 16
/// bf16 pairs, down column `t` of the block's B tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn fill_token(row: &[f32], t: usize, n: usize, blocks: usize, out: *mut u32) {
    let stride = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(n as i32),
    );
    for b in 0..blocks {
        let src = row.as_ptr().add(b * BLOCK);
        let v = pack_bf16(_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
        let base = out.add(b * ROWS * n + t);
        if n == 1 {
            _mm512_storeu_si512(base as *mut __m512i, v);
        } else {
            _mm512_i32scatter_epi32::<4>(base as *mut i32, stride, v);
        }
    }
}

/// Per-thread buffers: A tiles and C tiles on their way out.
#[derive(Default)]
struct Scratch {
    a: Option<ABuf>,
    c: Option<ABuf>,
}

impl Scratch {
    /// Grows the buffers for a weight of `blocks` blocks per row.
    fn reserve(&mut self, blocks: usize) {
        super::amx::grow_abuf(&mut self.a, blocks.max((LAG + 1) * PASS) * A_TILE);
        super::amx::grow_abuf(&mut self.c, 2 * GROUP * A_TILE);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Grows this thread's [`run_tiles`] buffers for a weight of `blocks`
/// blocks per row, so that a later call for it allocates nothing.
pub(crate) fn reserve_thread_scratch(blocks: usize) {
    SCRATCH.with_borrow_mut(|s| s.reserve(blocks));
}

/// Row tiles per pass when all tokens fit one token tile: they share each
/// B tile load and keep three independent accumulators (see
/// [`products_rows`] for why not four).
const PASS: usize = 3;
/// Blocks between dequantizing a record and its products.
const LAG: usize = 3;

/// Computes row tiles `t0..t1` of `q` for all `m` tokens of `act` into
/// `out` (`m × ldo`, rows past `q.rows` not written).
///
/// # Safety
/// The CPU must have AMX-BF16 and AVX512-BF16 (level
/// [`crate::cpu::SimdLevel::AmxBf16`]); `act` must have been built for `m`
/// rows of `q.cols`; each task must own its output columns.
pub(crate) unsafe fn run_tiles<const K: u8>(
    q: &TileMat,
    act: &TileAct,
    m: usize,
    t0: usize,
    t1: usize,
    out: OutPtr,
    ldo: usize,
) {
    let Some(bbase) = act.buf.as_ref().map(|b| b.ptr()) else {
        return;
    };
    let n = act.n;
    let blocks = q.blocks;
    // C and B rows are `n` tokens wide: one decoding row loads 64 bytes of
    // activations per block, not a kilobyte of mostly zeros.
    let cb = (4 * n) as u16;
    let config = TileConfig::new([
        (16, cb),
        (16, cb),
        (16, cb),
        (16, cb),
        (16, cb),
        (16, 64),
        (16, 64),
        (16, 64),
    ]);
    SCRATCH.with_borrow_mut(|s| {
        s.reserve(blocks);
        let abuf = s.a.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        let cbuf = s.c.as_mut().expect("reserved").bytes_mut().as_mut_ptr();
        // SAFETY (whole block): the caller guarantees AMX-BF16; the tiles
        // are released below on this thread; records `t0..t1` exist; the
        // buffers are sized above; B holds every block of each token tile.
        unsafe {
            config.load();
            let mut sink = Sink {
                q,
                m,
                n,
                out,
                ldo,
                c: cbuf,
                stashed: None,
            };
            if m <= n {
                for p0 in (t0..t1).step_by(PASS) {
                    pass::<K>(q, bbase, p0, (t1 - p0).min(PASS), abuf, &mut sink);
                }
            } else {
                for t in t0..t1 {
                    tile_all_tokens::<K>(q, bbase, t, m.div_ceil(n), abuf, &mut sink);
                }
            }
            sink.finish();
            release_tiles();
        }
    });
}

/// Where C tiles go: the output, through one of two staging slots.
struct Sink<'a> {
    q: &'a TileMat,
    m: usize,
    n: usize,
    out: OutPtr,
    ldo: usize,
    /// Two slots of [`GROUP`] C tiles.
    c: *mut u8,
    /// The tiles stored by the last [`Sink::drain`], not yet written out.
    stashed: Option<Stashed>,
}

/// C tiles waiting in a staging slot: `count` tiles of row tile `t + i`
/// (`by_rows`) or token tile `tt + i`.
struct Stashed {
    slot: usize,
    count: usize,
    t: usize,
    tt: usize,
    by_rows: bool,
}

impl Sink<'_> {
    /// Stores C registers `0..count` (see [`Stashed`]) into the free slot,
    /// then writes out the tiles the previous call stored. Reading a tile
    /// right after `tilestored` wrote it stalls until the stores drain; a
    /// pass later they have.
    ///
    /// # Safety
    /// [`run_tiles`]'s configuration is loaded; the tiles are in range.
    unsafe fn drain(&mut self, count: usize, t: usize, tt: usize, by_rows: bool) {
        let slot = self.stashed.as_ref().map_or(0, |p| 1 - p.slot);
        // SAFETY: the caller's contract; `c` holds two slots.
        unsafe {
            store_c(self.c.add(slot * GROUP * A_TILE), count);
            self.finish();
        }
        self.stashed = Some(Stashed {
            slot,
            count,
            t,
            tt,
            by_rows,
        });
    }

    /// Writes out the stashed tiles, if any.
    ///
    /// # Safety
    /// The stashed tiles' rows and tokens are in range of the output.
    unsafe fn finish(&mut self) {
        let Some(p) = self.stashed.take() else {
            return;
        };
        // SAFETY: the caller's contract.
        unsafe {
            for i in 0..p.count {
                let (t, tt) = if p.by_rows {
                    (p.t + i, p.tt)
                } else {
                    (p.t, p.tt + i)
                };
                let rows = (self.q.rows - t * ROWS).min(ROWS);
                let live = (self.m - tt * self.n).min(self.n);
                let c = self.c.add((p.slot * GROUP + i) * A_TILE) as *const f32;
                let out = self.out.0.add(tt * self.n * self.ldo + t * ROWS);
                if rows == ROWS {
                    write_rows(c, live, out, self.ldo);
                    continue;
                }
                for r in 0..rows {
                    for k in 0..live {
                        *out.add(k * self.ldo + r) = *c.add(16 * r + k);
                    }
                }
            }
        }
    }
}

/// A C tile of 16 rows into the output runs of its first `live` tokens
/// (16 floats each): a gather per token for a few tokens, one transpose
/// for more.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn write_rows(c: *const f32, live: usize, out: *mut f32, ldo: usize) {
    if live <= 4 {
        let rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(16),
        );
        for k in 0..live {
            _mm512_storeu_ps(out.add(k * ldo), _mm512_i32gather_ps::<4>(rows, c.add(k)));
        }
        return;
    }
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, v) in r.iter_mut().enumerate() {
        *v = _mm512_loadu_ps(c.add(16 * i));
    }
    for (k, v) in super::amx::transpose16(&r).iter().take(live).enumerate() {
        _mm512_storeu_ps(out.add(k * ldo), *v);
    }
}

/// Row tiles `p0..p0 + count` (at most [`PASS`]) for one token tile: each
/// block's records are dequantized one block before their products run,
/// so the tile loads never wait on the stores that wrote them.
///
/// # Safety
/// As [`run_tiles`], with its configuration loaded; `abuf` holds `2 · PASS`
/// tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
unsafe fn pass<const K: u8>(
    q: &TileMat,
    bbase: *const u8,
    p0: usize,
    count: usize,
    abuf: *mut u8,
    sink: &mut Sink<'_>,
) {
    let rb = record_bytes(K);
    let blocks = q.blocks;
    let btile = ROWS * sink.n * 4;
    let data = q.data.ptr();
    zero_c();
    for b in 0..blocks + LAG {
        if b < blocks {
            for i in 0..count {
                let rec = data.add(((p0 + i) * blocks + b) * rb);
                // Four record streams at once are more than the hardware
                // prefetchers keep ahead of; ask for the records two blocks on.
                if b + 2 < blocks {
                    let ahead = rec.add(2 * rb);
                    for l in (0..rb).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(l) as *const i8);
                    }
                }
                dequant::<K>(rec, abuf.add(((b % (LAG + 1)) * PASS + i) * A_TILE));
            }
        }
        if b >= LAG {
            let a = abuf.add(((b - LAG) % (LAG + 1)) * PASS * A_TILE);
            products_rows(
                a,
                bbase.add((b - LAG) * btile),
                4 * sink.n,
                count,
                b % 2 == 1,
            );
        }
    }
    sink.drain(count, p0, 0, true);
}

/// Row tile `t` for all `tiles` token tiles: the whole row's A tiles are
/// dequantized once, during the first group of four token tiles, and
/// reused by the others.
///
/// # Safety
/// As [`pass`]; `abuf` holds `blocks` tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
unsafe fn tile_all_tokens<const K: u8>(
    q: &TileMat,
    bbase: *const u8,
    t: usize,
    tiles: usize,
    abuf: *mut u8,
    sink: &mut Sink<'_>,
) {
    let rb = record_bytes(K);
    let blocks = q.blocks;
    let btile = ROWS * sink.n * 4;
    let recs = q.data.ptr().add(t * blocks * rb);
    for tg in (0..tiles).step_by(GROUP) {
        let ng = (tiles - tg).min(GROUP);
        zero_c();
        // The first group dequantizes as it goes, `LAG` blocks ahead of
        // its products (as [`pass`] does); later groups reuse the tiles.
        let lag = if tg == 0 { LAG } else { 0 };
        for b in 0..blocks + lag {
            if tg == 0 && b < blocks {
                dequant::<K>(recs.add(b * rb), abuf.add(b * A_TILE));
            }
            if b >= lag {
                let pb = b - lag;
                let bt = bbase.add((tg * blocks + pb) * btile);
                products_tokens(abuf.add(pb * A_TILE), bt, blocks * btile, 4 * sink.n, ng);
            }
        }
        sink.drain(ng, t, tg, false);
    }
}

/// Widens 16 f16 at `src` into `dst` behind an `asm!` the compiler cannot
/// see through. Each row then broadcasts its scale straight from memory
/// (a load, no ALU work); left to itself, LLVM keeps the vector in a
/// register and extracts every lane with shuffles, which compete with the
/// lookups for the one shuffle port and cost a third of the dequantization.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn store_opaque(dst: &mut [f32; 16], src: *const u8) {
    // SAFETY: `src` holds 32 readable bytes (the caller's record) and `dst`
    // 64 writable ones; the level guarantees AVX-512.
    unsafe {
        asm!(
            "vcvtph2ps {t}, ymmword ptr [{src}]",
            "vmovups zmmword ptr [{dst}], {t}",
            src = in(reg) src,
            dst = in(reg) dst.as_mut_ptr(),
            t = out(zmm_reg) _,
            options(nostack, preserves_flags),
        );
    }
}

/// `*x` in every lane, loaded by `vbroadcastss` from memory (see
/// [`store_opaque`]: LLVM would otherwise merge neighbouring scalars into
/// one load and split them again with shuffles).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn broadcast(x: &f32) -> __m512 {
    let v: __m512;
    // SAFETY: `x` is a valid f32; the level guarantees AVX-512.
    unsafe {
        asm!(
            "vbroadcastss {v}, dword ptr [{p}]",
            p = in(reg) x as *const f32,
            v = out(zmm_reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

/// Record `rec`'s 16 rows as one A tile at `a`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")]
#[inline]
unsafe fn dequant<const K: u8>(rec: *const u8, a: *mut u8) {
    let cb = code_bytes(K);
    let mut ds = [0.0f32; 16];
    store_opaque(&mut ds, rec.add(cb));
    if K == K_Q8_0 {
        for (n, d) in ds.iter().enumerate() {
            let c = rec.add(n * BLOCK);
            let d = broadcast(d);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c as *const __m128i)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                c.add(16) as *const __m128i
            )));
            let v = pack_bf16(_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d));
            _mm512_storeu_si512(a.add(64 * n) as *mut __m512i, v);
        }
        return;
    }
    let mut ms = [0.0f32; 16];
    if K == K_Q4_1 {
        store_opaque(&mut ms, rec.add(cb + 32));
    }
    let iota = if K == K_Q4_1 {
        _mm512_setr_ps(
            0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
        )
    } else {
        _mm512_setr_ps(
            -8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.,
        )
    };
    let half = _mm512_set1_epi32(0x8000);
    let one = _mm512_set1_epi16(1);
    for z in 0..4 {
        let w = _mm512_loadu_si512(rec.add(64 * z) as *const __m512i);
        // One row, with its code vector shifted so the nibble sits in bits 1–4.
        macro_rules! row {
            ($k:literal, $idx:expr) => {{
                let n = 4 * z + $k;
                let v = if K == K_Q4_1 {
                    _mm512_fmadd_ps(iota, broadcast(&ds[n]), broadcast(&ms[n]))
                } else {
                    _mm512_mul_ps(iota, broadcast(&ds[n]))
                };
                // Value `q`'s bf16 (rounded half away) is word `2q + 1`.
                let table = _mm512_add_epi32(_mm512_castps_si512(v), half);
                let idx = _mm512_or_si512($idx, one);
                _mm512_storeu_si512(
                    a.add(64 * n) as *mut __m512i,
                    _mm512_permutexvar_epi16(idx, table),
                );
            }};
        }
        // Row `4z + k`'s nibble into index bits 1–4.
        row!(0, _mm512_slli_epi16::<1>(w));
        row!(1, _mm512_srli_epi16::<3>(w));
        row!(2, _mm512_srli_epi16::<7>(w));
        row!(3, _mm512_srli_epi16::<11>(w));
    }
}

/// One tile load and one product: `tileloadd $reg` from `$addr` (rows
/// `$stride` bytes apart), then `$dp` (a `tdpbf16ps` reading it).
macro_rules! load_and_multiply {
    ($reg:literal, $dp:expr, $addr:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd ", $reg, ", [{p} + {s}*1]"),
            $dp,
            p = in(reg) $addr,
            s = in(reg) $stride,
            options(nostack, readonly),
        )
    };
}

/// `C_i += A_i × B` for `count` (at most [`PASS`]) row tiles: A tile `i`
/// at `a + i · A_TILE` (64-byte rows), one B tile at `b` (rows `brow`
/// bytes apart), loaded into register 3 for even blocks and 4 for odd ones.
///
/// # Why these registers
/// Tile registers are not renamed: a load into a register that an earlier
/// product still reads waits for that product. Each of a block's products
/// gets its own A register (5, 6, 7), and consecutive blocks alternate B
/// registers, so no load waits on a product of the same or the previous
/// block (whole-model matmuls, 2 threads: m = 1 4.2 → 3.8 ms with three
/// A registers instead of a reused one).
///
/// # Safety
/// [`run_tiles`]'s configuration is loaded; the addresses are in bounds.
#[inline]
unsafe fn products_rows(a: *const u8, b: *const u8, brow: usize, count: usize, odd: bool) {
    // SAFETY (each): the caller's contract.
    unsafe {
        macro_rules! block {
            ($b:literal) => {{
                asm!(
                    concat!("tileloadd ", $b, ", [{b} + {s}*1]"),
                    b = in(reg) b,
                    s = in(reg) brow,
                    options(nostack, readonly)
                );
                load_and_multiply!("tmm5", concat!("tdpbf16ps tmm0, tmm5, ", $b), a, 64usize);
                if count > 1 {
                    let a1 = a.add(A_TILE);
                    load_and_multiply!("tmm6", concat!("tdpbf16ps tmm1, tmm6, ", $b), a1, 64usize);
                }
                if count > 2 {
                    let a2 = a.add(2 * A_TILE);
                    load_and_multiply!("tmm7", concat!("tdpbf16ps tmm2, tmm7, ", $b), a2, 64usize);
                }
            }};
        }
        if odd {
            block!("tmm4");
        } else {
            block!("tmm3");
        }
    }
}

/// `C_u += A × B_u` for the `ng` token tiles of a group: A at `a` (64-byte
/// rows), B tile `u` at `b + u · tile_stride` (rows `brow` bytes apart).
///
/// # Safety
/// [`run_tiles`]'s configuration is loaded; the addresses are in bounds;
/// the tiles are 16 tokens wide (registers 6 and 7 have A's shape).
#[inline]
unsafe fn products_tokens(a: *const u8, b: *const u8, tile_stride: usize, brow: usize, ng: usize) {
    // SAFETY (each): the caller's contract. Register 5 holds A; B tiles
    // rotate through 4, 6, 7 (4 again for the fourth).
    unsafe {
        asm!("tileloadd tmm5, [{a} + {s}*1]", a = in(reg) a, s = in(reg) 64usize, options(nostack, readonly));
        load_and_multiply!("tmm4", "tdpbf16ps tmm0, tmm5, tmm4", b, brow);
        if ng > 1 {
            load_and_multiply!(
                "tmm6",
                "tdpbf16ps tmm1, tmm5, tmm6",
                b.add(tile_stride),
                brow
            );
        }
        if ng > 2 {
            load_and_multiply!(
                "tmm7",
                "tdpbf16ps tmm2, tmm5, tmm7",
                b.add(2 * tile_stride),
                brow
            );
        }
        if ng > 3 {
            load_and_multiply!(
                "tmm4",
                "tdpbf16ps tmm3, tmm5, tmm4",
                b.add(3 * tile_stride),
                brow
            );
        }
    }
}

/// Stores C register `$reg` at `$c` (64-byte rows).
macro_rules! store_tile {
    ($reg:literal, $c:expr) => {
        asm!(
            concat!("tilestored [{c} + {s}*1], ", $reg),
            c = in(reg) $c,
            s = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// Stores C registers `0..ng` at `c + u · A_TILE` (64-byte rows).
///
/// # Safety
/// [`run_tiles`]'s configuration is loaded; `c` holds `GROUP` tiles.
#[inline]
unsafe fn store_c(c: *mut u8, ng: usize) {
    // SAFETY (each): the caller's contract.
    unsafe {
        store_tile!("tmm0", c);
        if ng > 1 {
            store_tile!("tmm1", c.add(A_TILE));
        }
        if ng > 2 {
            store_tile!("tmm2", c.add(2 * A_TILE));
        }
        if ng > 3 {
            store_tile!("tmm3", c.add(3 * A_TILE));
        }
    }
}
