//! Quantized matmul: activation quantization, threading, and the integer
//! dot-product kernels (AVX-512 VNNI, AVX2, scalar) over the repacked layout
//! of [`super::layout`]; batched calls at [`SimdLevel::Amx`] hand whole
//! 16-row tiles to [`super::amx`].
//!
//! Work is split over output rows; each task walks its rows in tiles of `R`
//! rows (8 for decode, else 4) × `M` activation rows (up to 4 with AVX-512,
//! 3 with AVX2), so one load of a weight vector feeds `M`
//! dot products (batched decode and prefill are compute-bound, not
//! memory-bound) while the tile's weight rows stay in L1 across the `m`
//! loop.

// The SIMD kernels index register tiles `acc[r][i]` by row and activation
// on purpose: iterator chains would obscure which registers are live.
#![allow(clippy::needless_range_loop)]

use super::act;
#[cfg(target_arch = "x86_64")]
use super::amx;
use super::layout;
use super::layout::{
    code_bits, group_lanes, has_min, lane_len, off_shift, QMat, K_Q4K, K_Q4_0, K_Q4_1, K_Q6K,
    K_Q8_0, PANEL,
};
use super::prefetch;
use super::{grow, MatmulScratch, OutPtr};
use crate::cpu::pool::ThreadPool;
use crate::cpu::SimdLevel;

/// Raw views of a [`QMat`]'s arrays for the kernels.
#[derive(Clone, Copy)]
pub(crate) struct QPtrs {
    qs: *const u8,
    qs_row: usize,
    qh: *const u8,
    qh_row: usize,
    d: *const u8,
    m: *const u8,
    sd: *const f32,
    nsb: usize,
    lanes: usize,
    /// Whether single-token tiles issue software prefetches (the same
    /// bits either way; see [`super::prefetch`]).
    prefetch: bool,
}

impl QPtrs {
    /// Where the scales of group `g` lie for a row tile from `r0`, whose
    /// rows share one panel (tiles of 8, 4 or 1 rows from a panel's
    /// start): computed once per group rather than once per row, since a
    /// Q6_K group is small enough (256 elements a row) for the panel
    /// index arithmetic to show beside its dot products.
    /// `gl` is the group's lane count, which callers of full groups pass
    /// as the constant 16: every row's offset is then an immediate.
    #[inline(always)]
    fn group_scales<const K: u8>(&self, r0: usize, g: usize, gl: usize) -> GroupScales {
        let j = r0 % PANEL;
        let p0 = r0 - j;
        // A K-quant group's super-blocks: Q4_K's 8 lanes make one, Q6_K's
        // 16 lanes one; the other kinds have none.
        let gsb = if K == K_Q4K || K == K_Q6K {
            gl * lane_len(K) / 256
        } else {
            0
        };
        let spg = layout::sb_per_group(K);
        let gs = GroupScales {
            lane: p0 * self.lanes + PANEL * 16 * g + j * gl,
            gl,
            sb: p0 * self.nsb + PANEL * spg * g + j * gsb,
            gsb,
        };
        debug_assert_eq!(gs.lane, layout::lane_at(self.lanes, r0, 16 * g));
        debug_assert!(self.nsb == 0 || gs.sb == layout::sb_at(K, self.nsb, r0, spg * g));
        gs
    }

    fn new(q: &QMat, prefetch: bool) -> QPtrs {
        QPtrs {
            qs: q.qs.ptr(),
            qs_row: q.qs_row,
            qh: q.qh.ptr(),
            qh_row: q.qh_row,
            d: q.d.ptr(),
            m: q.m.ptr(),
            sd: q.sd.ptr() as *const f32,
            nsb: q.nsb,
            lanes: q.lanes,
            prefetch,
        }
    }
}

/// Where one group's scales lie for the rows of a tile in one panel: row
/// `r0 + ρ` keeps its lanes' scales (and mins) from lane `lane + ρ · gl`
/// and its super-block scales from super-block `sb + ρ · gsb`.
#[derive(Clone, Copy)]
struct GroupScales {
    lane: usize,
    gl: usize,
    sb: usize,
    gsb: usize,
}

/// Where one row's scales of one group lie: its first lane and its first
/// super-block.
#[derive(Clone, Copy)]
struct RowScales {
    lane: usize,
    sb: usize,
}

impl GroupScales {
    #[inline(always)]
    fn row(&self, rho: usize) -> RowScales {
        RowScales {
            lane: self.lane + rho * self.gl,
            sb: self.sb + rho * self.gsb,
        }
    }
}

/// Raw views of the quantized activations in a [`MatmulScratch`].
#[derive(Clone, Copy)]
pub(crate) struct APtrs {
    q: *const i8,
    /// Bytes per activation row (= cols).
    row: usize,
    d: *const f32,
    sum: *const i32,
    s: *const f32,
}

// SAFETY: the pointers are read-only views of buffers the caller of `matmul`
// keeps alive (and unmodified) until the pool has joined.
unsafe impl Send for QPtrs {}
unsafe impl Sync for QPtrs {}
unsafe impl Send for APtrs {}
unsafe impl Sync for APtrs {}

/// Mutable activation buffers shared by the tasks that quantize disjoint rows.
#[derive(Clone, Copy)]
struct ActOut {
    q: *mut i8,
    d: *mut f32,
    sum: *mut i32,
    s: *mut f32,
}
// SAFETY: each task writes only its own rows' ranges.
unsafe impl Send for ActOut {}
unsafe impl Sync for ActOut {}

/// Activation rows per cache block: 64 rows of up to a few thousand bytes
/// stay in L2 while a task's weight rows stream past them.
const M_BLOCK: usize = 64;

/// Multiplies `x` (`m × cols`) by the quantized `q` into `out` (`m × rows`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    q: &QMat,
    level: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let l = lane_len(q.kind);
    let cols = q.cols;
    let lanes = q.lanes;
    grow(&mut scratch.aq, m * cols);
    grow(&mut scratch.ad, m * lanes);
    grow(&mut scratch.asum, m * lanes);
    grow(&mut scratch.ascaled, m * lanes);

    let ao = ActOut {
        q: scratch.aq.as_mut_ptr(),
        d: scratch.ad.as_mut_ptr(),
        sum: scratch.asum.as_mut_ptr(),
        s: scratch.ascaled.as_mut_ptr(),
    };
    let quant_rows = |i0: usize, i1: usize| {
        // Capture the whole (Sync) struct, not its raw-pointer fields.
        let ao = &ao;
        for i in i0..i1 {
            // SAFETY: row `i` of each buffer is in bounds (grown above) and
            // written by this call only.
            unsafe {
                act::quantize_row(
                    level,
                    l,
                    &x[i * cols..(i + 1) * cols],
                    std::slice::from_raw_parts_mut(ao.q.add(i * cols), cols),
                    std::slice::from_raw_parts_mut(ao.d.add(i * lanes), lanes),
                    std::slice::from_raw_parts_mut(ao.sum.add(i * lanes), lanes),
                    std::slice::from_raw_parts_mut(ao.s.add(i * lanes), lanes),
                );
            }
        }
    };
    // Quantizing costs about as much as a few weight rows per activation
    // row; only prefill-sized batches are worth a parallel region.
    if m >= 16 && pool.threads() > 1 {
        pool.run_ranges(m, 1, &|i0, i1| quant_rows(i0, i1));
    } else {
        quant_rows(0, m);
    }

    // Single-token calls prefetch or not as measured (see `prefetch`);
    // the kernels give the same bits either way.
    let plan = if m == 1 {
        prefetch::plan(q.kind, q.size_bytes())
    } else {
        prefetch::Plan::NONE
    };
    let w = QPtrs::new(q, plan.prefetch);
    let a = APtrs {
        q: scratch.aq.as_ptr(),
        row: cols,
        d: scratch.ad.as_ptr(),
        sum: scratch.asum.as_ptr(),
        s: scratch.ascaled.as_ptr(),
    };
    let o = OutPtr(out.as_mut_ptr());
    let rows = q.rows;
    let kind = q.kind;
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Amx && amx::supports(kind) && amx::worth(m, lanes) {
        scratch.reserve_on_threads(pool, super::ThreadBuffers::Amx, lanes);
        let aq = amx::ActQuant {
            q: &scratch.aq[..m * cols],
            d: &scratch.ad[..m * lanes],
            sum: &scratch.asum[..m * lanes],
            scaled: &scratch.ascaled[..m * lanes],
        };
        scratch.tiles.build(pool, kind, m, cols, lanes, &aq);
        let tiles = &scratch.tiles;
        pool.run_ranges(rows, 16, &|r0, r1| {
            // Whole 16-row tiles go to the tile unit, a ragged end to the
            // VNNI kernel: the two agree bitwise.
            let r16 = r0 + (r1 - r0) / 16 * 16;
            // SAFETY: the level is Amx (so the CPU and OS support it), the
            // tiles were built for this matmul, and each task owns its rows.
            unsafe {
                match kind {
                    K_Q4_0 => amx::run_rows::<K_Q4_0>(q, tiles, m, r0, r16, o, rows),
                    K_Q4_1 => amx::run_rows::<K_Q4_1>(q, tiles, m, r0, r16, o, rows),
                    _ => amx::run_rows::<K_Q8_0>(q, tiles, m, r0, r16, o, rows),
                }
                if r16 < r1 {
                    let vnni = SimdLevel::Avx512Vnni;
                    match kind {
                        K_Q4_0 => run_rows::<K_Q4_0>(vnni, q, &w, &a, m, r16, r1, o, rows),
                        K_Q4_1 => run_rows::<K_Q4_1>(vnni, q, &w, &a, m, r16, r1, o, rows),
                        _ => run_rows::<K_Q8_0>(vnni, q, &w, &a, m, r16, r1, o, rows),
                    }
                }
            }
        });
        return;
    }
    let run = |r0: usize, r1: usize| {
        // SAFETY: rows r0..r1 are in range, each task writes only its own
        // output columns, and `level` is supported by this CPU.
        unsafe {
            match kind {
                K_Q4_0 => run_rows::<K_Q4_0>(level, q, &w, &a, m, r0, r1, o, rows),
                K_Q4_1 => run_rows::<K_Q4_1>(level, q, &w, &a, m, r0, r1, o, rows),
                K_Q8_0 => run_rows::<K_Q8_0>(level, q, &w, &a, m, r0, r1, o, rows),
                K_Q4K => run_rows::<K_Q4K>(level, q, &w, &a, m, r0, r1, o, rows),
                _ => run_rows::<K_Q6K>(level, q, &w, &a, m, r0, r1, o, rows),
            }
        }
    };
    let started = plan.start();
    pool.run_ranges(rows, PANEL, &run);
    prefetch::record(plan, started, q.size_bytes());
}

/// Computes output rows `r0..r1` for all `m` activation rows.
#[allow(clippy::too_many_arguments)]
unsafe fn run_rows<const K: u8>(
    level: SimdLevel,
    q: &QMat,
    w: &QPtrs,
    a: &APtrs,
    m: usize,
    r0: usize,
    r1: usize,
    o: OutPtr,
    ldo: usize,
) {
    for mb in (0..m).step_by(M_BLOCK) {
        let me = (mb + M_BLOCK).min(m);
        let mut r = r0;
        while r < r1 {
            // Decode (m = 1) takes 8 rows at a time: twice the independent
            // accumulator chains, half the per-tile overhead, and a whole
            // panel, whose loads are then one sequential stream.
            let rt = if me - mb == 1 && level >= SimdLevel::Avx2 && r1 - r >= 8 {
                8
            } else if r1 - r >= 4 {
                4
            } else {
                1
            };
            let mut i = mb;
            while i < me {
                let mt = (me - i).min(max_m_tile(level));
                // A single token prefetches as the tuner decided. Several
                // (concurrent streams, or a prompt's block of up to M_BLOCK
                // tokens): the first tile of them over these rows prefetches
                // the weights and the others find them in L1. For a prompt
                // block that measured a little slower with `prefetcht0`;
                // with the L2-only prefetch it is faster (decode bench,
                // `DECODE_M=64`, 1B Q4_0, 1 thread, three alternating
                // rounds: median 513–578 → 489–498 ms a step).
                let pf = if me - mb == 1 { w.prefetch } else { i == mb };
                match level {
                    #[cfg(target_arch = "x86_64")]
                    SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => {
                        x86::tile512_dispatch::<K>(rt, mt, pf, w, r, a, i, o.0, ldo)
                    }
                    #[cfg(target_arch = "x86_64")]
                    SimdLevel::Avx2 => x86::tile256_dispatch::<K>(rt, mt, pf, w, r, a, i, o.0, ldo),
                    _ => tile_scalar::<K>(q, r, rt, a, i, mt, o.0, ldo),
                }
                i += mt;
            }
            r += rt;
        }
    }
}

/// Activation rows per tile. AVX-512's 32 registers hold the 4 × 4 integer
/// accumulators plus operands (the float accumulators, touched once per
/// group, may live on the stack). Measured on Zen 4 at m = 16, 4 × 4 beat
/// 4 × 3 and 4 × 2. AVX2's 16 registers hold 4 × 3 16-bit accumulators
/// plus the two nibble vectors and the mask; on a Sapphire Rapids Xeon
/// forced to AVX2 (SmolLM2-135M shapes, m = 16), 4 × 3 beat 4 × 2, 8 × 2
/// and 2 × 4 by 5–15%, and 4 × 4, which spills, by 20–30%.
fn max_m_tile(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => 4,
        SimdLevel::Avx2 => 3,
        SimdLevel::Scalar => 1,
    }
}

/// The portable kernel: the same arithmetic as the SIMD ones, lane by lane.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_scalar<const K: u8>(
    q: &QMat,
    r0: usize,
    rt: usize,
    a: &APtrs,
    i0: usize,
    mt: usize,
    out: *mut f32,
    ldo: usize,
) {
    let l = lane_len(K);
    let lanes = q.lanes;
    let qs_all = q.qs.bytes();
    let qh_all = q.qh.bytes();
    for r in r0..r0 + rt {
        let qs = |o: usize| qs_all[q.qs_index(r, o)];
        let qh = |o: usize| qh_all[q.qh_index(r, o)];
        for i in i0..i0 + mt {
            let aq = std::slice::from_raw_parts(a.q.add(i * a.row), a.row);
            let mut acc = 0.0f32;
            for b in 0..lanes {
                let (g, j) = (b / 16, b % 16);
                let gl = group_lanes(lanes, g);
                let mut dot = 0i32;
                for c in 0..l / 4 {
                    for t in 0..4 {
                        let u = if code_bits(K) == 8 {
                            qs(16 * g * l + c * 4 * gl + 4 * j + t)
                        } else {
                            let byte = qs(16 * g * l / 2 + (c / 2) * 4 * gl + 4 * j + t);
                            let low = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                            if code_bits(K) == 6 {
                                low | (((qh(64 * g + 4 * j + t) >> (2 * c)) & 3) << 4)
                            } else {
                                low
                            }
                        };
                        dot += u as i32 * aq[16 * g * l + c * 4 * gl + 4 * j + t] as i32;
                    }
                }
                let ab = i * lanes + b;
                if !has_min(K) {
                    dot -= *a.sum.add(ab) << off_shift(K);
                }
                let (dw, mw) = q.lane_affine(r, b);
                acc += dot as f32 * (dw * *a.d.add(ab));
                if has_min(K) {
                    acc += mw * *a.s.add(ab);
                }
            }
            *out.add(i * ldo + r) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    // The crate's L2-only line prefetch (`prefetch` here names the tuner).
    use crate::ops::simd::prefetch as prefetch_line;
    use core::arch::x86_64::*;

    macro_rules! dispatch_tiles {
        ($name:ident, $kernel:ident, $($m:literal),+) => {
            /// Calls the kernel instantiated for this tile shape.
            #[allow(clippy::too_many_arguments)]
            /// The tile prefetches its weights where `pf` says so (see
            /// `run_rows` and [`prefetch_weights`]).
            pub(super) unsafe fn $name<const K: u8>(
                rt: usize, mt: usize, pf: bool, w: &QPtrs, r0: usize, a: &APtrs, i0: usize, out: *mut f32, ldo: usize,
            ) {
                match (rt, mt, pf) {
                    (8, 1, true) => $kernel::<K, 8, 1, true>(w, r0, a, i0, out, ldo),
                    (8, 1, false) => $kernel::<K, 8, 1, false>(w, r0, a, i0, out, ldo),
                    (4, 1, true) => $kernel::<K, 4, 1, true>(w, r0, a, i0, out, ldo),
                    (4, 1, false) => $kernel::<K, 4, 1, false>(w, r0, a, i0, out, ldo),
                    (1, 1, true) => $kernel::<K, 1, 1, true>(w, r0, a, i0, out, ldo),
                    (1, 1, false) => $kernel::<K, 1, 1, false>(w, r0, a, i0, out, ldo),
                    $( (4, $m, true) => $kernel::<K, 4, $m, true>(w, r0, a, i0, out, ldo), )+
                    $( (4, $m, false) => $kernel::<K, 4, $m, false>(w, r0, a, i0, out, ldo), )+
                    $( (1, $m, true) => $kernel::<K, 1, $m, true>(w, r0, a, i0, out, ldo), )+
                    $( (1, $m, false) => $kernel::<K, 1, $m, false>(w, r0, a, i0, out, ldo), )+
                    _ => unreachable!("tile shape {rt}x{mt}"),
                }
            }
        };
    }
    dispatch_tiles!(tile512_dispatch, tile512, 2, 3, 4);

    /// Where rows `r0..r0 + R` start: for `qs`, the row's first unit in its
    /// panel before scaling by the group's unit stride, i.e. the panel base
    /// and the row's index in the panel (see [`group_ptrs`]); for `qh`, the
    /// row's first group (its groups lie `PANEL · 64` bytes apart).
    #[inline(always)]
    unsafe fn row_ptrs<const R: usize>(w: &QPtrs, r0: usize) -> ([QRow; R], [*const u8; R]) {
        let mut wrow = [QRow { panel: w.qs, j: 0 }; R];
        let mut hrow = [w.qh; R];
        for r in 0..R {
            let row = r0 + r;
            wrow[r] = QRow {
                panel: w.qs.add(row / PANEL * PANEL * w.qs_row),
                j: row % PANEL,
            };
            hrow[r] = w.qh.add(row / PANEL * PANEL * w.qh_row + row % PANEL * 64);
        }
        (wrow, hrow)
    }

    /// A weight row's place in the panel layout.
    #[derive(Clone, Copy)]
    struct QRow {
        panel: *const u8,
        j: usize,
    }

    /// Each row's first unit of the group that starts at per-row byte
    /// `wbase` with units of `stride` bytes; unit `k` is `k · PANEL · stride`
    /// further on.
    #[inline(always)]
    unsafe fn group_ptrs<const R: usize>(
        wrow: &[QRow; R],
        wbase: usize,
        stride: usize,
    ) -> [*const u8; R] {
        let mut p = [wrow[0].panel; R];
        for r in 0..R {
            p[r] = wrow[r].panel.add(PANEL * wbase + wrow[r].j * stride);
        }
        p
    }
    dispatch_tiles!(tile256_dispatch, tile256, 2, 3);

    /// The vector operations the AVX-512 kernel needs, at two widths: 16
    /// lanes (`Zmm`) for full groups and 8 lanes (`Ymm`, AVX-512VL) for short
    /// last groups, which would otherwise cost a full group's work (a
    /// 576-column row is 18 lanes: a group of 16 and a tail of 2).
    trait Width {
        /// Lanes of 32 bits.
        const LANES: usize;
        type I: Copy;
        type F: Copy;
        type Mask: Copy;
        /// The `4 · n` bytes at `p` (`n` = 1, 2 or 4 lanes) repeated across
        /// the vector.
        unsafe fn bcast(p: *const u8, n: usize) -> Self::I;
        unsafe fn as_f(v: Self::I) -> Self::F;
        /// Lanes `first..first + n` of `v` moved to lanes `0..n` of a
        /// 16-lane vector, zero elsewhere.
        unsafe fn lanes_to_front(v: Self::F, first: usize, n: usize) -> __m512;
        unsafe fn mask(gl: usize) -> Self::Mask;
        unsafe fn zero() -> Self::I;
        unsafe fn zerof() -> Self::F;
        unsafe fn load(m: Self::Mask, p: *const u8) -> Self::I;
        unsafe fn loadf(m: Self::Mask, p: *const f32) -> Self::F;
        /// `LANES` f16 values at `p`, widened to f32 (exactly).
        unsafe fn load_f16(p: *const u16) -> Self::F;
        unsafe fn dpbusd(acc: Self::I, u: Self::I, a: Self::I) -> Self::I;
        /// Low and high nibbles of each byte.
        unsafe fn nibbles(v: Self::I) -> (Self::I, Self::I);
        /// Q6_K: ORs bits 4..6 of chunk `c` (from `qh`) into `v`.
        unsafe fn or_hbits(v: Self::I, qh: Self::I, c: usize) -> Self::I;
        /// `acc − (sum << s)`.
        unsafe fn sub_shl(acc: Self::I, sum: Self::I, s: u32) -> Self::I;
        unsafe fn cvt(v: Self::I) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        /// `acc + a · b`, into a 16-lane accumulator.
        unsafe fn fma_into(acc: __m512, a: Self::F, b: Self::F) -> __m512;
        /// Per-lane scale and min of one row's group at `at` (zero where
        /// masked).
        unsafe fn scales<const K: u8>(
            w: &QPtrs,
            at: RowScales,
            m: Self::Mask,
        ) -> (Self::F, Self::F);
    }

    struct Zmm;
    struct Ymm;

    impl Width for Zmm {
        const LANES: usize = 16;
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn bcast(p: *const u8, n: usize) -> __m512i {
            match n {
                1 => _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)),
                2 => _mm512_set1_epi64(std::ptr::read_unaligned(p as *const i64)),
                _ => _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i)),
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn as_f(v: __m512i) -> __m512 {
            _mm512_castsi512_ps(v)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn lanes_to_front(v: __m512, first: usize, n: usize) -> __m512 {
            let idx = _mm512_add_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(first as i32),
            );
            _mm512_maskz_permutexvar_ps(Self::mask(n), idx, v)
        }
        type I = __m512i;
        type F = __m512;
        type Mask = __mmask16;
        #[inline(always)]
        unsafe fn mask(gl: usize) -> __mmask16 {
            if gl >= 16 {
                0xffff
            } else {
                (1u16 << gl) - 1
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn zero() -> __m512i {
            _mm512_setzero_si512()
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn zerof() -> __m512 {
            _mm512_setzero_ps()
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn load(m: __mmask16, p: *const u8) -> __m512i {
            _mm512_maskz_loadu_epi32(m, p as *const i32)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn loadf(m: __mmask16, p: *const f32) -> __m512 {
            _mm512_maskz_loadu_ps(m, p)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn dpbusd(acc: __m512i, u: __m512i, a: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, u, a)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn nibbles(v: __m512i) -> (__m512i, __m512i) {
            let m = _mm512_set1_epi8(0x0f);
            (
                _mm512_and_si512(v, m),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), m),
            )
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn or_hbits(v: __m512i, qh: __m512i, c: usize) -> __m512i {
            // The 16-bit shifts leak bits across bytes only into positions
            // the 0x30 mask clears.
            let h = match c {
                0 => _mm512_slli_epi16::<4>(qh),
                1 => _mm512_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm512_srli_epi16::<2>(qh),
            };
            _mm512_or_si512(v, _mm512_and_si512(h, _mm512_set1_epi8(0x30)))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn sub_shl(acc: __m512i, sum: __m512i, s: u32) -> __m512i {
            let t = match s {
                3 => _mm512_slli_epi32::<3>(sum),
                5 => _mm512_slli_epi32::<5>(sum),
                _ => _mm512_slli_epi32::<7>(sum),
            };
            _mm512_sub_epi32(acc, t)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn cvt(v: __m512i) -> __m512 {
            _mm512_cvtepi32_ps(v)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn fma_into(acc: __m512, a: __m512, b: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, acc)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn scales<const K: u8>(
            w: &QPtrs,
            at: RowScales,
            mask: __mmask16,
        ) -> (__m512, __m512) {
            let lb = at.lane;
            let zero = _mm512_setzero_ps();
            match K {
                K_Q4_0 | K_Q8_0 => (f16x16(w.d, lb, mask), zero),
                K_Q4_1 => (f16x16(w.d, lb, mask), f16x16(w.m, lb, mask)),
                K_Q4K => {
                    // Q4_K rows have a multiple of 8 lanes, so a 16-lane
                    // group is always whole: plain loads, which fold into
                    // the widening moves.
                    debug_assert_eq!(mask, 0xffff);
                    // The group's 16 scales, then its 16 mins.
                    let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        w.d.add(2 * lb) as *const __m128i,
                    )));
                    let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        w.d.add(2 * lb + 16) as *const __m128i,
                    )));
                    // Lanes 0..8 belong to super-block 2g, lanes 8..16 to
                    // 2g + 1: both blocks' scale and min scale in one
                    // 16-byte load, spread by one permute each.
                    let four = _mm512_castps128_ps512(_mm_loadu_ps(w.sd.add(2 * at.sb)));
                    let sd = _mm512_permutexvar_ps(
                        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                        four,
                    );
                    // −(smin · mn), exactly as (−smin) · mn.
                    let smin = _mm512_permutexvar_ps(
                        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
                        four,
                    );
                    let mv = _mm512_mul_ps(smin, mn);
                    (
                        _mm512_mul_ps(sd, sc),
                        _mm512_castsi512_ps(_mm512_xor_si512(
                            _mm512_castps_si512(mv),
                            _mm512_set1_epi32(i32::MIN),
                        )),
                    )
                }
                _ => {
                    let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(
                        mask,
                        w.d.add(lb) as *const i8,
                    )));
                    (_mm512_mul_ps(_mm512_set1_ps(*w.sd.add(at.sb)), sc), zero)
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn f16x16(p: *const u8, lb: usize, mask: __mmask16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.add(2 * lb) as *const i16))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn f16x8(p: *const u8, lb: usize, mask: __mmask8) -> __m256 {
        _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, p.add(2 * lb) as *const i16))
    }

    impl Width for Ymm {
        const LANES: usize = 8;
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn bcast(p: *const u8, n: usize) -> __m256i {
            match n {
                1 => _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)),
                2 => _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64)),
                _ => _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i)),
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn as_f(v: __m256i) -> __m256 {
            _mm256_castsi256_ps(v)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn lanes_to_front(v: __m256, first: usize, n: usize) -> __m512 {
            Zmm::lanes_to_front(_mm512_zextps256_ps512(v), first, n)
        }
        type I = __m256i;
        type F = __m256;
        type Mask = __mmask8;
        #[inline(always)]
        unsafe fn mask(gl: usize) -> __mmask8 {
            if gl >= 8 {
                0xff
            } else {
                (1u8 << gl) - 1
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn zero() -> __m256i {
            _mm256_setzero_si256()
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn zerof() -> __m256 {
            _mm256_setzero_ps()
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn load(m: __mmask8, p: *const u8) -> __m256i {
            _mm256_maskz_loadu_epi32(m, p as *const i32)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn loadf(m: __mmask8, p: *const f32) -> __m256 {
            _mm256_maskz_loadu_ps(m, p)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn dpbusd(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, u, a)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn nibbles(v: __m256i) -> (__m256i, __m256i) {
            let m = _mm256_set1_epi8(0x0f);
            (
                _mm256_and_si256(v, m),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
            )
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn or_hbits(v: __m256i, qh: __m256i, c: usize) -> __m256i {
            _mm256_or_si256(v, hbits256(qh, c))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn sub_shl(acc: __m256i, sum: __m256i, s: u32) -> __m256i {
            _mm256_sub_epi32(acc, shl256(sum, s))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn cvt(v: __m256i) -> __m256 {
            _mm256_cvtepi32_ps(v)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn fma_into(acc: __m512, a: __m256, b: __m256) -> __m512 {
            _mm512_add_ps(acc, _mm512_zextps256_ps512(_mm256_mul_ps(a, b)))
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
        #[inline]
        unsafe fn scales<const K: u8>(
            w: &QPtrs,
            at: RowScales,
            mask: __mmask8,
        ) -> (__m256, __m256) {
            // Only used for groups of at most 8 lanes: lanes 16g..16g+8, which
            // for Q4_K lie in super-block 2g and for Q6_K in super-block g.
            let lb = at.lane;
            let zero = _mm256_setzero_ps();
            let bytes8 = |p: *const u8| _mm_maskz_loadu_epi8(mask as u16, p.add(lb) as *const i8);
            match K {
                K_Q4_0 | K_Q8_0 => (f16x8(w.d, lb, mask), zero),
                K_Q4_1 => (f16x8(w.d, lb, mask), f16x8(w.m, lb, mask)),
                K_Q4K => {
                    // A group of 8 lanes: its 8 scales, then its 8 mins.
                    let sb = 2 * at.sb;
                    let u8x8 = |p: *const u8| _mm_loadl_epi64(p as *const __m128i);
                    let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8x8(w.d.add(2 * lb))));
                    let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8x8(w.d.add(2 * lb + 8))));
                    (
                        _mm256_mul_ps(_mm256_set1_ps(*w.sd.add(sb)), sc),
                        _mm256_mul_ps(_mm256_set1_ps(-*w.sd.add(sb + 1)), mn),
                    )
                }
                _ => {
                    let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(w.d)));
                    (_mm256_mul_ps(_mm256_set1_ps(*w.sd.add(at.sb)), sc), zero)
                }
            }
        }
    }

    /// How far ahead of its loads a decode tile prefetches: one page.
    const PREFETCH_AHEAD: usize = 4096;
    /// Lines at the start of each page that the decode tiles prefetch.
    const PAGE_LINES: usize = 4;

    /// The decode tiles' software prefetch, given each weight load's
    /// address [`PREFETCH_AHEAD`] on: prefetches it only when it is one of
    /// the first [`PAGE_LINES`] lines of a 4 KiB page. Within a page the
    /// hardware prefetchers follow the stream; at a page's start they stop,
    /// and the tile stalled there (Zen 4, `perf annotate` of a MoE step:
    /// 20% of the samples on the first load of each 4 KiB group). On bench
    /// /moe.sh's shapes this took Q8_0 from 12 to 31 GB/s (1 thread), where
    /// a prefetch for every line had measured from 3× faster to 2.7× slower
    /// than none, by the day (see [`super::super::prefetch`], which still
    /// times this against no prefetching at all). It prefetches into L2
    /// only ([`crate::ops::simd::prefetch`]): 1B Q4_0, 1 thread,
    /// prefetching on, 25.0–25.8 ms a step with `prefetcht0`, 20.4–22.7
    /// with `prefetcht2`.
    #[inline(always)]
    unsafe fn prefetch_page_start(p: *const u8) {
        if (p as usize) & 4095 < 64 * PAGE_LINES {
            prefetch_line(p);
        }
    }

    /// How far ahead of its loads a tile of several tokens prefetches.
    /// Measured on Zen 4 (1B shapes, Q4_0, 8 tokens, 1 thread): with
    /// `prefetcht0` 4 KiB 85–87 ms a step, 8–32 KiB 76–83 ms, none 101–105
    /// ms; into L2 only ([`crate::ops::simd::prefetch`]) 8 and 16 KiB
    /// 65–66 ms, 32 and 64 KiB 63–77.
    const BATCH_AHEAD: usize = 8192;

    /// The software prefetch for a weight load at `p` by a tile of `M`
    /// tokens. A single token's tile is bound by the memory and prefetches
    /// page starts only ([`prefetch_page_start`]). A tile of several tokens
    /// is bound by its arithmetic, and there the hardware prefetchers did
    /// not keep ahead: on the 1B shapes at 8 tokens the first four tokens
    /// cost 70 ms a step and every further four 33–37 (the weights then in
    /// L1), memory and arithmetic in series rather than overlapped.
    /// Prefetching every line it loads [`BATCH_AHEAD`] on into L1 took that
    /// step from 101–105 to 76–83 ms, into L2 only to 65–66 ms (see
    /// [`crate::ops::simd::prefetch`]); a prefetch per line costs a load slot,
    /// which a tile of 32 `vpdpbusd` per 4 loads has to spare. (Page-start
    /// prefetching there measured 1.5× slower: a data-dependent branch per
    /// load, which the single-token tile hides behind memory stalls.)
    /// `D` divides the distance, for a stream that advances `D` times
    /// slower than the weight codes (Q6_K's high bits: half).
    #[inline(always)]
    unsafe fn prefetch_weights<const M: usize, const D: usize>(p: *const u8) {
        if M > 1 {
            prefetch_line(p.wrapping_add(BATCH_AHEAD / D));
        } else {
            prefetch_page_start(p.wrapping_add(PREFETCH_AHEAD / D));
        }
    }

    /// One group (up to 16 lanes) of `R` weight rows × `M` activation rows:
    /// integer dot products per lane, then per-lane scaling into `facc`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn group<
        V: Width,
        const K: u8,
        const R: usize,
        const M: usize,
        const PF: bool,
        const FULL: bool,
    >(
        w: &QPtrs,
        r0: usize,
        a: &APtrs,
        i0: usize,
        g: usize,
        wrow: &[QRow; R],
        hrow: &[*const u8; R],
        arow: &[*const i8; M],
        facc: &mut [[__m512; M]; R],
    ) {
        let l = lane_len(K);
        let lanes = w.lanes;
        // A whole group's lane count as a constant: its strides and the
        // rows' scale offsets become immediates.
        let gl = if FULL { 16 } else { group_lanes(lanes, g) };
        let mask = V::mask(gl);
        let stride = 4 * gl;
        let abase = 16 * g * l;
        let mut iacc = [[V::zero(); M]; R];
        let unit = PANEL * stride;
        if code_bits(K) == 8 {
            let wg = group_ptrs(wrow, 16 * g * 32, stride);
            for c in 0..8 {
                let mut av = [V::zero(); M];
                for i in 0..M {
                    av[i] = V::load(mask, arow[i].add(abase + c * stride) as *const u8);
                }
                for r in 0..R {
                    if PF {
                        prefetch_weights::<M, 1>(wg[r].wrapping_add(c * unit));
                    }
                    let wv = V::load(mask, wg[r].add(c * unit));
                    for i in 0..M {
                        iacc[r][i] = V::dpbusd(iacc[r][i], wv, av[i]);
                    }
                }
            }
        } else {
            let wg = group_ptrs(wrow, 16 * g * l / 2, stride);
            let mut qh = [V::zero(); R];
            if code_bits(K) == 6 {
                for r in 0..R {
                    if PF {
                        prefetch_weights::<M, 2>(hrow[r].wrapping_add(PANEL * 64 * g));
                    }
                    qh[r] = V::load(mask, hrow[r].add(PANEL * 64 * g));
                }
            }
            for s in 0..l / 8 {
                let mut alo = [V::zero(); M];
                let mut ahi = [V::zero(); M];
                for i in 0..M {
                    alo[i] = V::load(mask, arow[i].add(abase + 2 * s * stride) as *const u8);
                    ahi[i] = V::load(mask, arow[i].add(abase + (2 * s + 1) * stride) as *const u8);
                }
                for r in 0..R {
                    if PF {
                        prefetch_weights::<M, 1>(wg[r].wrapping_add(s * unit));
                    }
                    let (mut lo, mut hi) = V::nibbles(V::load(mask, wg[r].add(s * unit)));
                    if code_bits(K) == 6 {
                        lo = V::or_hbits(lo, qh[r], 2 * s);
                        hi = V::or_hbits(hi, qh[r], 2 * s + 1);
                    }
                    for i in 0..M {
                        iacc[r][i] = V::dpbusd(iacc[r][i], lo, alo[i]);
                        iacc[r][i] = V::dpbusd(iacc[r][i], hi, ahi[i]);
                    }
                }
            }
        }
        // Activation scales (and sums or scaled sums) once per activation row.
        let mut da = [V::zerof(); M];
        let mut extra_i = [V::zero(); M];
        let mut extra_f = da;
        for i in 0..M {
            let b = (i0 + i) * lanes + 16 * g;
            da[i] = V::loadf(mask, a.d.add(b));
            if has_min(K) {
                extra_f[i] = V::loadf(mask, a.s.add(b));
            } else {
                extra_i[i] = V::load(mask, a.sum.add(b) as *const u8);
            }
        }
        let gs = w.group_scales::<K>(r0, g, gl);
        for r in 0..R {
            let (dv, mv) = V::scales::<K>(w, gs.row(r), mask);
            for i in 0..M {
                let mut iv = iacc[r][i];
                if !has_min(K) {
                    // u = q + offset: subtract offset · Σa exactly, in integers.
                    iv = V::sub_shl(iv, extra_i[i], off_shift(K));
                }
                facc[r][i] = V::fma_into(facc[r][i], V::cvt(iv), V::mul(dv, da[i]));
                if has_min(K) {
                    facc[r][i] = V::fma_into(facc[r][i], mv, extra_f[i]);
                }
            }
        }
    }

    /// A short last group (`gl` lanes, `R · gl` = one vector) of `R` rows ×
    /// `M` activation rows, with the rows packed side by side: lane
    /// `ρ · gl + j` is row `ρ`'s lane `j`. In the panel layout the `R` rows'
    /// units are contiguous, so one load takes all of them, and each
    /// activation unit is broadcast to every row. Processing such a group
    /// row by row (as [`group`] does) costs as much as a full group of 16
    /// lanes for a fraction of the work: 576 columns are 16 + 2 lanes, and
    /// that tail made SmolLM2's 576-column matmuls 1.8× slower per MAC than
    /// its 1536-column ones.
    ///
    /// Each row's lanes get exactly the arithmetic [`group`] gives them with
    /// `Ymm` (products rounded, then added into lanes `0..gl` of the row's
    /// accumulator, `+0.0` into the rest), so results are bitwise those of
    /// the row-by-row path: batch invariance does not depend on `R`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn tail_packed<V: Width, const K: u8, const R: usize, const M: usize, const PF: bool>(
        w: &QPtrs,
        r0: usize,
        a: &APtrs,
        i0: usize,
        g: usize,
        wrow: &[QRow; R],
        arow: &[*const i8; M],
        facc: &mut [[__m512; M]; R],
    ) {
        let l = lane_len(K);
        let lanes = w.lanes;
        let gl = group_lanes(lanes, g);
        debug_assert_eq!(R * gl, V::LANES);
        debug_assert!(wrow[0].j + R <= PANEL);
        let stride = 4 * gl;
        let unit = PANEL * stride;
        let abase = 16 * g * l;
        let full = V::mask(V::LANES);
        let mut iacc = [V::zero(); M];
        if code_bits(K) == 8 {
            let wp = group_ptrs(&[wrow[0]], 16 * g * 32, stride)[0];
            for c in 0..8 {
                if PF {
                    prefetch_weights::<M, 1>(wp.wrapping_add(c * unit));
                }
                let wv = V::load(full, wp.add(c * unit));
                for i in 0..M {
                    let av = V::bcast(arow[i].add(abase + c * stride) as *const u8, gl);
                    iacc[i] = V::dpbusd(iacc[i], wv, av);
                }
            }
        } else {
            let wp = group_ptrs(&[wrow[0]], 16 * g * l / 2, stride)[0];
            for s in 0..l / 8 {
                if PF {
                    prefetch_weights::<M, 1>(wp.wrapping_add(s * unit));
                }
                let (lo, hi) = V::nibbles(V::load(full, wp.add(s * unit)));
                for i in 0..M {
                    let alo = V::bcast(arow[i].add(abase + 2 * s * stride) as *const u8, gl);
                    let ahi = V::bcast(arow[i].add(abase + (2 * s + 1) * stride) as *const u8, gl);
                    iacc[i] = V::dpbusd(iacc[i], lo, alo);
                    iacc[i] = V::dpbusd(iacc[i], hi, ahi);
                }
            }
        }
        // Per-lane weight scales (and mins): each row's `gl` f16 bits
        // copied side by side, then widened in one instruction. (Widening
        // them one by one in scalar code cost about as much as the tail's
        // dot products: a 576-column row's tail is 2 lanes of 18.)
        let mut dbits = [0u16; 16];
        let mut mbits = [0u16; 16];
        // `gl · R` fills the vector exactly, so this is a constant.
        let gl_c = V::LANES / R;
        let gs = w.group_scales::<K>(r0, g, gl);
        for rho in 0..R {
            let lb = gs.row(rho).lane;
            let at = rho * gl_c;
            std::ptr::copy_nonoverlapping(
                w.d.add(2 * lb),
                dbits.as_mut_ptr().add(at).cast::<u8>(),
                2 * gl_c,
            );
            if K == K_Q4_1 {
                std::ptr::copy_nonoverlapping(
                    w.m.add(2 * lb),
                    mbits.as_mut_ptr().add(at).cast::<u8>(),
                    2 * gl_c,
                );
            }
        }
        let dv = V::load_f16(dbits.as_ptr());
        let mv = V::load_f16(mbits.as_ptr());
        for i in 0..M {
            let b = ((i0 + i) * lanes + 16 * g) * 4;
            let da = V::as_f(V::bcast((a.d as *const u8).add(b), gl));
            let mut iv = iacc[i];
            if !has_min(K) {
                iv = V::sub_shl(iv, V::bcast((a.sum as *const u8).add(b), gl), off_shift(K));
            }
            let p = V::mul(V::cvt(iv), V::mul(dv, da));
            let q = if has_min(K) {
                V::mul(mv, V::as_f(V::bcast((a.s as *const u8).add(b), gl)))
            } else {
                V::zerof()
            };
            for rho in 0..R {
                facc[rho][i] = _mm512_add_ps(facc[rho][i], V::lanes_to_front(p, rho * gl, gl));
                if has_min(K) {
                    facc[rho][i] = _mm512_add_ps(facc[rho][i], V::lanes_to_front(q, rho * gl, gl));
                }
            }
        }
    }

    /// `R` weight rows × `M` activation rows with AVX-512 VNNI: one 64-byte
    /// load per row per chunk, one `vpdpbusd` per (row, activation) pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tile512<const K: u8, const R: usize, const M: usize, const PF: bool>(
        w: &QPtrs,
        r0: usize,
        a: &APtrs,
        i0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut facc = [[_mm512_setzero_ps(); M]; R];
        let (wrow, hrow) = row_ptrs::<R>(w, r0);
        let mut arow = [a.q; M];
        for (i, p) in arow.iter_mut().enumerate() {
            *p = a.q.add((i0 + i) * a.row);
        }
        let ng = w.lanes.div_ceil(16);
        for g in 0..ng {
            let gl = group_lanes(w.lanes, g);
            // A short last group packs its lanes of all R rows into one
            // vector (see `tail_packed`) where they fill it exactly.
            let packable = matches!(K, K_Q4_0 | K_Q4_1 | K_Q8_0) && R > 1;
            if gl == 16 {
                group::<Zmm, K, R, M, PF, true>(w, r0, a, i0, g, &wrow, &hrow, &arow, &mut facc);
            } else if gl > 8 {
                group::<Zmm, K, R, M, PF, false>(w, r0, a, i0, g, &wrow, &hrow, &arow, &mut facc);
            } else if packable && R * gl == 16 {
                tail_packed::<Zmm, K, R, M, PF>(w, r0, a, i0, g, &wrow, &arow, &mut facc);
            } else if packable && R * gl == 8 {
                tail_packed::<Ymm, K, R, M, PF>(w, r0, a, i0, g, &wrow, &arow, &mut facc);
            } else {
                group::<Ymm, K, R, M, PF, false>(w, r0, a, i0, g, &wrow, &hrow, &arow, &mut facc);
            }
        }
        if R == 8 && M == 1 {
            // The decode tile's 8 sums are 8 consecutive outputs.
            let f: [__m512; 8] = std::array::from_fn(|r| facc[r][0]);
            _mm256_storeu_ps(out.add(i0 * ldo + r0), hsum16x8(&f));
            return;
        }
        for r in 0..R {
            for i in 0..M {
                *out.add((i0 + i) * ldo + r0 + r) = hsum16(facc[r][i]);
            }
        }
    }

    /// [`hsum16`] of 8 vectors at once, lane `r` of the result being
    /// `hsum16(v[r])` bit for bit: each level of the tree adds the same
    /// pairs as there (lanes `k` and `k + 8`, `k` and `k + 4`, ...), only
    /// with the vectors' halves shuffled side by side so that one add does
    /// the level for several vectors. About 25 instructions instead of 8 ×
    /// 8, which a decode tile of short rows (576 columns: 18 lanes) felt.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn hsum16x8(v: &[__m512; 8]) -> __m256 {
        // Level 1, per pair (a, b): [a lanes 0..8 | b lanes 0..8] +
        // [a lanes 8..16 | b lanes 8..16], i.e. both vectors' `s8`.
        let s8 = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            )
        };
        let (p01, p23) = (s8(v[0], v[1]), s8(v[2], v[3]));
        let (p45, p67) = (s8(v[4], v[5]), s8(v[6], v[7]));
        // Level 2: 128-bit quarter j of the result is vector j's `s4`
        // (its `s8` lanes k and k + 4).
        let s4 = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            )
        };
        let (q0, q1) = (s4(p01, p23), s4(p45, p67));
        // Level 3: quarter j holds vector j's `s2` in lanes 0..2 and vector
        // j + 4's in lanes 2..4 (`s4` lanes k and k + 2).
        let s2 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(q0, q1),
            _mm512_shuffle_ps::<0xEE>(q0, q1),
        );
        // Level 4: lane 0 of quarter j is vector j's sum, lane 2 vector
        // j + 4's (`s2` lane 0 plus lane 1).
        let s1 = _mm512_add_ps(s2, _mm512_shuffle_ps::<0xB1>(s2, s2));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, s1))
    }

    /// The sum of a vector's 16 lanes, by a fixed tree: lanes `k` and
    /// `k + 8`, then `k` and `k + 4`, `k` and `k + 2`, and the last two. The
    /// AMX kernel ([`super::amx`]) repeats this tree across tokens to stay
    /// bitwise equal to this kernel, so the order is spelled out here rather
    /// than left to `_mm512_reduce_add_ps`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    #[inline]
    pub(super) unsafe fn hsum16(v: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn hbits256(qh: __m256i, c: usize) -> __m256i {
        let v = match c {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<2>(qh),
            2 => qh,
            _ => _mm256_srli_epi16::<2>(qh),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x30))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn shl256(v: __m256i, s: u32) -> __m256i {
        match s {
            3 => _mm256_slli_epi32::<3>(v),
            5 => _mm256_slli_epi32::<5>(v),
            _ => _mm256_slli_epi32::<7>(v),
        }
    }

    /// Per-lane scale and min of half `h` (8 lanes, `hl` valid) of group `g`,
    /// zero on the lanes past `hl`.
    ///
    /// A short half loads all 8 lanes anyway and clears the extra ones: the
    /// scale arrays are [`super::layout::ABuf`]s, padded past their end, and
    /// the lanes past `hl` hold the next row's scales, which may be any f16
    /// (inf or NaN included) and so must not meet the zeros of the masked
    /// activation lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scales256<const K: u8>(
        w: &QPtrs,
        at: RowScales,
        gl: usize,
        h: usize,
        hl: usize,
    ) -> (__m256, __m256) {
        let lb = at.lane + 8 * h;
        let zero = _mm256_setzero_ps();
        let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(hl as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ));
        let clear = |v: __m256| if hl == 8 { v } else { _mm256_and_ps(v, keep) };
        let f16x8 = |p: *const u8| {
            clear(_mm256_cvtph_ps(_mm_loadu_si128(
                p.add(2 * lb) as *const __m128i
            )))
        };
        let u8x8 = |p: *const u8| _mm_loadl_epi64(p.add(lb) as *const __m128i);
        match K {
            K_Q4_0 | K_Q8_0 => (f16x8(w.d), zero),
            K_Q4_1 => (f16x8(w.d), f16x8(w.m)),
            K_Q4K => {
                // A half-group of 8 sub-blocks is exactly one super-block.
                let sb = 2 * (at.sb + h);
                // The group's scales, then its mins (`gl` lanes each).
                let gb = 2 * at.lane + 8 * h;
                let at = |o: usize| _mm_loadl_epi64(w.d.add(gb + o) as *const __m128i);
                let sc = clear(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(at(0))));
                let mn = clear(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(at(gl))));
                (
                    _mm256_mul_ps(_mm256_set1_ps(*w.sd.add(sb)), sc),
                    _mm256_mul_ps(_mm256_set1_ps(-*w.sd.add(sb + 1)), mn),
                )
            }
            _ => {
                let sc = clear(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u8x8(w.d))));
                (_mm256_mul_ps(_mm256_set1_ps(*w.sd.add(at.sb)), sc), zero)
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

    /// Loads 8 lanes of 4 bytes: all of them, or (`FULL` false) the lanes
    /// that `maskv` selects, zero elsewhere.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ld<const FULL: bool>(p: *const u8, maskv: __m256i) -> __m256i {
        if FULL {
            _mm256_loadu_si256(p as *const __m256i)
        } else {
            _mm256_maskload_epi32(p as *const i32, maskv)
        }
    }

    /// The `4 · n` bytes at `p` (`n` = 1, 2 or 4 lanes) repeated across a
    /// 256-bit vector.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn bcast256(p: *const u8, n: usize) -> __m256i {
        match n {
            1 => _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)),
            2 => _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64)),
            _ => _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i)),
        }
    }

    /// `Σ u·a` over one 32-bit lane's 4 byte pairs, as 16-bit pair sums
    /// (`vpmaddubsw`): the caller adds these in 16 bits while they cannot
    /// overflow and widens once with [`widen`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot16(lo: __m256i, alo: __m256i, hi: __m256i, ahi: __m256i) -> __m256i {
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi))
    }

    /// Sums each 32-bit lane's two 16-bit halves into a 32-bit integer.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen(v: __m256i) -> __m256i {
        _mm256_madd_epi16(v, _mm256_set1_epi16(1))
    }

    /// The low and high nibbles of each byte.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn nib256(v: __m256i) -> (__m256i, __m256i) {
        let m = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(v, m),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
        )
    }

    /// Q8_0's signed product of one chunk: the stored codes are `q + 128`,
    /// so flipping the top bit gives `q`; `|q| · (a · sign q)` keeps
    /// `vpmaddubsw`'s pairs within 2 · 128 · 127, which 16 bits hold.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_dot(wv: __m256i, av: __m256i) -> __m256i {
        let ws = _mm256_xor_si256(wv, _mm256_set1_epi8(-128));
        widen(_mm256_maddubs_epi16(
            _mm256_abs_epi8(ws),
            _mm256_sign_epi8(av, ws),
        ))
    }

    /// The integer dot products of half `h` of group `g` (8 lanes, the
    /// first `hl` valid; `FULL` when all 8 are): per row and activation, a
    /// vector of 8 lanes' `Σ u·a`.
    ///
    /// The 4-bit types sum all 8 chunks' `vpmaddubsw` pair sums in 16 bits
    /// and widen once: each 16-bit slot then holds 16 products of a 4-bit
    /// code and a code in [-127, 127], at most 16 · 15 · 127 = 30480 <
    /// 2^15 (act.rs keeps -128 out). That halves the widening `vpmaddwd`s
    /// and 32-bit adds per load, which bound the loop. Q6_K's 6-bit codes
    /// allow two chunks per widening (4 · 63 · 127 = 32004).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_dots<
        const K: u8,
        const R: usize,
        const M: usize,
        const FULL: bool,
        const PF: bool,
    >(
        wrow: &[QRow; R],
        hrow: &[*const u8; R],
        arow: &[*const u8; M],
        gl: usize,
        g: usize,
        h: usize,
        maskv: __m256i,
    ) -> [[__m256i; M]; R] {
        let l = lane_len(K);
        let stride = 4 * gl;
        let unit = PANEL * stride;
        let abase = 16 * g * l + 32 * h;
        let hoff = 32 * h;
        let zi = _mm256_setzero_si256();
        let mut acc = [[zi; M]; R];
        if code_bits(K) == 8 {
            let wg = group_ptrs(wrow, 16 * g * 32, stride);
            for c in 0..8 {
                let mut av = [zi; M];
                for i in 0..M {
                    av[i] = ld::<FULL>(arow[i].add(abase + c * stride), maskv);
                }
                for r in 0..R {
                    let wv = ld::<FULL>(wg[r].add(hoff + c * unit), maskv);
                    for i in 0..M {
                        acc[r][i] = _mm256_add_epi32(acc[r][i], q8_dot(wv, av[i]));
                    }
                }
            }
            return acc;
        }
        let wg = group_ptrs(wrow, 16 * g * l / 2, stride);
        for s in 0..l / 8 {
            let mut alo = [zi; M];
            let mut ahi = [zi; M];
            for i in 0..M {
                alo[i] = ld::<FULL>(arow[i].add(abase + 2 * s * stride), maskv);
                ahi[i] = ld::<FULL>(arow[i].add(abase + (2 * s + 1) * stride), maskv);
            }
            for r in 0..R {
                if FULL && PF && h == 0 {
                    prefetch_weights::<M, 1>(wg[r].wrapping_add(s * unit));
                }
                let (mut lo, mut hi) = nib256(ld::<FULL>(wg[r].add(hoff + s * unit), maskv));
                if code_bits(K) == 6 {
                    let qh = ld::<FULL>(hrow[r].add(PANEL * 64 * g + hoff), maskv);
                    lo = _mm256_or_si256(lo, hbits256(qh, 2 * s));
                    hi = _mm256_or_si256(hi, hbits256(qh, 2 * s + 1));
                }
                for i in 0..M {
                    let p = dot16(lo, alo[i], hi, ahi[i]);
                    acc[r][i] = if code_bits(K) == 6 {
                        _mm256_add_epi32(acc[r][i], widen(p))
                    } else {
                        _mm256_add_epi16(acc[r][i], p)
                    };
                }
            }
        }
        if code_bits(K) == 4 {
            for r in 0..R {
                for i in 0..M {
                    acc[r][i] = widen(acc[r][i]);
                }
            }
        }
        acc
    }

    /// The integer dot products of a short last group of `GL` = 1, 2 or 4
    /// lanes (Q4_0, Q4_1, Q8_0 rows whose width is not a multiple of 512),
    /// with the tile's `R` rows packed side by side: the panel layout stores
    /// a unit of consecutive rows contiguously, so one 32-byte load holds
    /// `8 / GL` rows' lanes and a broadcast activation chunk feeds them all.
    /// Loading each row's few lanes into a masked half-vector instead would
    /// cost a whole half-group per row (a 576-wide row is 16 + 2 lanes).
    ///
    /// Returns each row's lanes moved to the front (lanes `0..GL`, zero
    /// elsewhere), exactly what [`half_dots`] returns for a half of `GL`
    /// valid lanes: the integer sums are exact, so both paths then share the
    /// float epilogue and agree bitwise, whatever the tile shape.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn packed_dots<const K: u8, const R: usize, const M: usize, const GL: usize>(
        wrow: &[QRow; R],
        arow: &[*const u8; M],
        g: usize,
    ) -> [[__m256i; M]; R] {
        debug_assert!((R * GL).is_multiple_of(8) && R * GL <= 32);
        debug_assert!(wrow[0].j + R <= PANEL);
        let l = lane_len(K);
        let stride = 4 * GL;
        let unit = PANEL * stride;
        let abase = 16 * g * l;
        let zi = _mm256_setzero_si256();
        // Vectors of packed rows: R · GL lanes of 8.
        let nv = R * GL / 8;
        let mut acc = [[zi; M]; 4];
        if code_bits(K) == 8 {
            let wp = group_ptrs(&[wrow[0]], 16 * g * 32, stride)[0];
            for c in 0..8 {
                let mut av = [zi; M];
                for i in 0..M {
                    av[i] = bcast256(arow[i].add(abase + c * stride), GL);
                }
                for v in 0..nv {
                    let wv = _mm256_loadu_si256(wp.add(c * unit + 32 * v) as *const __m256i);
                    for i in 0..M {
                        acc[v][i] = _mm256_add_epi32(acc[v][i], q8_dot(wv, av[i]));
                    }
                }
            }
        } else {
            let wp = group_ptrs(&[wrow[0]], 16 * g * l / 2, stride)[0];
            for s in 0..l / 8 {
                let mut alo = [zi; M];
                let mut ahi = [zi; M];
                for i in 0..M {
                    alo[i] = bcast256(arow[i].add(abase + 2 * s * stride), GL);
                    ahi[i] = bcast256(arow[i].add(abase + (2 * s + 1) * stride), GL);
                }
                for v in 0..nv {
                    let wv = _mm256_loadu_si256(wp.add(s * unit + 32 * v) as *const __m256i);
                    let (lo, hi) = nib256(wv);
                    for i in 0..M {
                        acc[v][i] = _mm256_add_epi16(acc[v][i], dot16(lo, alo[i], hi, ahi[i]));
                    }
                }
            }
            for v in 0..nv {
                for i in 0..M {
                    acc[v][i] = widen(acc[v][i]);
                }
            }
        }
        let lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(GL as i32), lane_idx);
        let mut out = [[zi; M]; R];
        for r in 0..R {
            let (v, first) = (r * GL / 8, r * GL % 8);
            let idx = _mm256_add_epi32(lane_idx, _mm256_set1_epi32(first as i32));
            for i in 0..M {
                let x = if first == 0 {
                    acc[v][i]
                } else {
                    _mm256_permutevar8x32_epi32(acc[v][i], idx)
                };
                out[r][i] = _mm256_and_si256(x, keep);
            }
        }
        out
    }

    /// Applies the scales of half `h` of group `g` (`gl` lanes; `hl` valid in this half) to the
    /// integer sums and adds them into the float accumulators. Every path
    /// of [`tile256`] ends here, in this order, so a row's result does not
    /// depend on the tile shape that computed it.
    ///
    /// Always inlined, without a `target_feature` of its own (its callers
    /// have them): as an `#[inline]` function LLVM left the single-token
    /// Q4_K instantiation out of line, its accumulators passed through
    /// memory (18% of a Q4_K_M decode step's samples at
    /// `PAGODA_SIMD=avx2` fell in it, most of them its scale loads' cache
    /// misses, which inlining does not remove: 1–2% faster).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn epilogue<const K: u8, const R: usize, const M: usize>(
        w: &QPtrs,
        r0: usize,
        a: &APtrs,
        i0: usize,
        g: usize,
        gl: usize,
        h: usize,
        hl: usize,
        iacc: &[[__m256i; M]; R],
        facc: &mut [[__m256; M]; R],
    ) {
        let lanes = w.lanes;
        let lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let maskv = _mm256_cmpgt_epi32(_mm256_set1_epi32(hl as i32), lane_idx);
        // Masked loads give the same values as plain ones on the valid
        // lanes and zero elsewhere; plain loads are cheaper where all 8 are.
        let ldf = |p: *const f32| {
            if hl == 8 {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskload_ps(p, maskv)
            }
        };
        let gs = w.group_scales::<K>(r0, g, gl);
        for r in 0..R {
            let (dv, mv) = scales256::<K>(w, gs.row(r), gs.gl, h, hl);
            for i in 0..M {
                let b = (i0 + i) * lanes + 16 * g + 8 * h;
                let da = ldf(a.d.add(b));
                let mut iv = iacc[r][i];
                // Q8_0 already multiplied signed codes; the others
                // subtract offset · Σa as the AVX-512 kernel does.
                if !has_min(K) && K != K_Q8_0 {
                    let su = _mm256_castps_si256(ldf(a.sum.add(b) as *const f32));
                    iv = _mm256_sub_epi32(iv, shl256(su, off_shift(K)));
                }
                facc[r][i] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(iv), _mm256_mul_ps(dv, da), facc[r][i]);
                if has_min(K) {
                    facc[r][i] = _mm256_fmadd_ps(mv, ldf(a.s.add(b)), facc[r][i]);
                }
            }
        }
    }

    /// The AVX2 kernel: each 16-lane group is two halves of 8 lanes;
    /// `vpmaddubsw` (+ `vpmaddwd` to widen) stands in for `vpdpbusd`. See
    /// [`half_dots`] for the integer part, [`packed_dots`] for short last
    /// groups and [`epilogue`] for the float part.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<const K: u8, const R: usize, const M: usize, const PF: bool>(
        w: &QPtrs,
        r0: usize,
        a: &APtrs,
        i0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let lanes = w.lanes;
        let lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let all = _mm256_set1_epi32(-1);
        let mut facc = [[_mm256_setzero_ps(); M]; R];
        let (wrow, hrow) = row_ptrs::<R>(w, r0);
        let mut arow = [a.q as *const u8; M];
        for (i, p) in arow.iter_mut().enumerate() {
            *p = a.q.add((i0 + i) * a.row) as *const u8;
        }
        let packable = matches!(K, K_Q4_0 | K_Q4_1 | K_Q8_0) && R >= 4;
        for g in 0..lanes.div_ceil(16) {
            let gl = group_lanes(lanes, g);
            // A whole group, its lane count a constant: strides and the
            // rows' scale offsets become immediates (as `tile512`'s
            // `group::<.., true>`). In cache that made every kind faster
            // (256 × 2048, 1 thread: Q4_0 15 -> 36 GB/s, Q4_K 28 -> 33,
            // Q6_K 22 -> 23), but Q6_K from DRAM slower (decode bench, 1B
            // shapes: 40 -> 52 ms a step, with or without prefetching), so
            // Q6_K keeps the general path.
            if gl == 16 && K != K_Q6K {
                for h in 0..2 {
                    let iacc = half_dots::<K, R, M, true, PF>(&wrow, &hrow, &arow, 16, g, h, all);
                    epilogue::<K, R, M>(w, r0, a, i0, g, 16, h, 8, &iacc, &mut facc);
                }
                continue;
            }
            let packed =
                gl < 8 && packable && (R * gl).is_multiple_of(8) && matches!(gl, 1 | 2 | 4);
            for h in 0..gl.div_ceil(8) {
                let hl = (gl - 8 * h).min(8);
                let iacc = if packed {
                    match gl {
                        1 => packed_dots::<K, R, M, 1>(&wrow, &arow, g),
                        2 => packed_dots::<K, R, M, 2>(&wrow, &arow, g),
                        _ => packed_dots::<K, R, M, 4>(&wrow, &arow, g),
                    }
                } else if hl == 8 {
                    half_dots::<K, R, M, true, PF>(&wrow, &hrow, &arow, gl, g, h, all)
                } else {
                    let maskv = _mm256_cmpgt_epi32(_mm256_set1_epi32(hl as i32), lane_idx);
                    half_dots::<K, R, M, false, PF>(&wrow, &hrow, &arow, gl, g, h, maskv)
                };
                epilogue::<K, R, M>(w, r0, a, i0, g, gl, h, hl, &iacc, &mut facc);
            }
        }
        for r in 0..R {
            for i in 0..M {
                *out.add((i0 + i) * ldo + r0 + r) = hsum256(facc[r][i]);
            }
        }
    }
}
