//! Paged attention: causal, grouped-query attention of a ragged batch of
//! sequences against a KV cache stored in fixed-size blocks.
//!
//! # Work split
//! The call is split into tasks of (sequence, KV head, query tile) and run on
//! the [`ThreadPool`]. A task handles *all* q heads of its KV head's group at
//! once, so each cached K/V row is read from memory (and widened from
//! f16/bf16) once per group rather than once per q head. Within a task the
//! cache is streamed in chunks of [`KT`] positions with an online softmax
//! (running max and sum per row, accumulator rescaled when the max grows), so
//! nothing is sized by the context length and all scratch lives on the stack.
//!
//! # Two kernels
//! A tile's *rows* are its (query, q head) pairs. Two layouts suit different
//! row counts:
//!
//! * **small** (decode, short chunks: fewer rows than a vector's lanes):
//!   scores are computed with the chunk's keys in the SIMD lanes (FMAs of a
//!   broadcast q element against a vector of keys, which the cache's
//!   transposed K slabs hold contiguously, see [`KvLayout`]), and the output
//!   accumulates `p · v` rows with head dimensions in the lanes. Both read
//!   the cache in place, widening as they load. Putting rows in the lanes
//!   here would leave most lanes idle (a group of 4 fills a quarter of an
//!   AVX-512 register).
//! * **wide** (prefill: up to [`WIDE_ROWS`] rows): rows in the SIMD lanes,
//!   like a small matrix multiply. The tile's queries are transposed once
//!   (`[head_dim][rows]`), so `Q·Kᵀ` is a sequence of FMAs of a broadcast K
//!   element against a row vector with no horizontal reductions, and the
//!   softmax's max/exp/sum and the causal mask are lane-wise too.
//!
//! Both are written once over [`Simd`] and instantiated for AVX-512, AVX2 and
//! scalar code; the level is chosen once per call.
//!
//! # Batch invariance
//! A row's output is bitwise a function of its q vector, its position, the
//! cache up to that position and the scale: it does not depend on `q_len`,
//! the tile or kernel it lands in, the other rows or sequences of the call,
//! or the thread count (at a given SIMD level; levels differ from each
//! other). Chunked prefill, recomputation after preemption and decode thus
//! give the same numbers as one prefill. Both kernels perform, per row, the
//! same sequence of f32 operations:
//!
//! * `q' = q * scale`;
//! * chunks of the cache at absolute positions (`[0, KT)`, `[KT, 2KT)`, …,
//!   or block boundaries for an f32 cache read in place; see
//!   `Ctx::chunk_len`), whatever position the tile starts at — a tile that
//!   ends earlier only drops positions that are masked for the row anyway;
//! * each score `s_j` is `fma(q'_i, k_ji, acc)` over `i = 0..head_dim` in
//!   order from 0 ([`Simd::fma`], fused or not as the level does it);
//! * per chunk: `m' = max(m, max_j s_j)`, `alpha = exp(m - m')` and
//!   `p_j = exp(s_j - m')` with [`Simd::exp`], the chunk sum `Σ p_j` added in
//!   key order, `l = fma(l, alpha, sum)`, and each output element
//!   `acc = acc * alpha` followed by `fma(p_j, v_ji, acc)` in key order;
//! * `out = acc * (1 / l)`.
//!
//! Masked positions get a score of `-inf`: their `p` is exactly 0, which
//! leaves every max, sum and accumulator bit unchanged, so whether a masked
//! key was computed (wide tile), skipped (small tile) or never loaded (a
//! shorter tile) makes no difference. `tests::rows_do_not_depend_on_the_tile_*`
//! check this bitwise for every cache type and level.
//!
//! # Sliding windows
//! With a window of `w` positions (Mistral, and the sliding layers of Qwen2
//! and Gemma-style models), the query at position `pos` attends to
//! `pos + 1 - w ..= pos` only: keys below that get `-inf` like future keys.
//! A tile starts at the first chunk boundary at or below its lowest row's
//! window (boundaries every `lcm(block_size, KT)` positions are chunk
//! starts whatever the cache type), so chunks stay on the same absolute
//! grid. A chunk entirely masked for a row is an exact no-op: the running
//! max starts at `f32::MIN` instead of `-inf`, so a row that has seen
//! nothing yet gets `alpha = exp(0) = 1` and `p = 0`, and a row that has
//! gets `alpha = 1` and `p = 0` as before. The invariance above holds with
//! a window too.
//!
//! # Attention sinks
//! With a sink logit `s_h` per q head (GPT-OSS's `sinks`), each row's
//! softmax denominator gains `exp(s_h)` while the sink contributes no value:
//! `out = Σ_j exp(x_j) v_j / (Σ_j exp(x_j) + exp(s_h))`. The sink is not
//! scaled. It is folded in once, after the last chunk, by the same scalar
//! code in both kernels ([`sink_inv`]): with the row's running max `m` and
//! sum `l`, `m' = max(m, s_h)`, `a = exp(m - m')` and the output scale is
//! `a / (l · a + exp(s_h - m'))`; so the invariance above holds with sinks.

/// Uninitialized stack scratch: it is large (up to 64 KiB) and a decode
/// task is short, so zeroing it would cost a visible share. Every kernel
/// writes each element before reading it, through raw pointers only.
macro_rules! scratch {
    ($n:expr) => {
        std::mem::MaybeUninit::<[f32; $n]>::uninit()
    };
}

mod in_place;
mod kv;
mod layout;
mod micro;
mod plan;
mod small;
#[cfg(test)]
mod tests;
mod wide;
mod write;

use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;
use plan::{lcm, Ctx, SyncPtr, Tile, KT, WIDE_ROWS};
use small::small_tile;
use wide::wide_tile;

pub use kv::{KvDtype, KvElem};
pub use layout::KvLayout;
pub use plan::{AttnSeq, MAX_HEAD_DIM};
pub use write::write_kv;

/// Causal grouped-query attention over a paged KV cache.
///
/// `q` and `out` are `[n_tokens, n_heads * head_dim]`; q head `h` reads KV
/// head `h / (n_heads / n_kv_heads)`. Query `i` of a sequence (`0..q_len`)
/// sits at position `ctx_len - q_len + i` and attends to cache positions
/// `0..=` that position (or, with a `window` of `w`, the last `w` of those),
/// with scores `q·k * scale`. This covers decode
/// (`q_len == 1`), prefill, chunked prefill (`ctx_len > q_len`) and any mix of
/// them in one call. Rows of `out` not covered by a sequence are left as they
/// are. Allocation-free; the work runs on `pool`.
///
/// # Panics
/// If the shapes disagree (cache lengths vs `layout`, `q` vs `out`,
/// `n_heads` not a positive multiple of `n_kv_heads`, a group larger than 64,
/// `head_dim > 256`, a window of 0), a sequence's rows fall outside `q` or overlap another
/// sequence's, `q_len > ctx_len`, or its block table is too short or names a
/// block outside the pool.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: KvElem>(
    pool: &ThreadPool,
    layout: &KvLayout,
    k_cache: &[T],
    v_cache: &[T],
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    paged_attention_at(
        simd_level(),
        pool,
        layout,
        k_cache,
        v_cache,
        q,
        n_heads,
        seqs,
        scale,
        window,
        None,
        out,
    )
}

/// [`paged_attention`] with a sink logit per q head (`sinks`: `n_heads`
/// values) in every row's softmax denominator; see "Attention sinks" in
/// the module docs.
///
/// # Panics
/// As [`paged_attention`], and if `sinks` is not `n_heads` long.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with_sinks<T: KvElem>(
    pool: &ThreadPool,
    layout: &KvLayout,
    k_cache: &[T],
    v_cache: &[T],
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    paged_attention_at(
        simd_level(),
        pool,
        layout,
        k_cache,
        v_cache,
        q,
        n_heads,
        seqs,
        scale,
        window,
        sinks,
        out,
    )
}

/// The factor a row's accumulator is multiplied by at the end: `1 / l`, or
/// with a sink logit `s`, `a / (l · a + exp(s - m'))` where `m' = max(m,
/// s)` and `a = exp(m - m')` (`m`: the row's running max, `l`: its sum).
/// One scalar function for both kernels, so their rows stay bitwise equal.
#[inline(always)]
pub(super) fn sink_inv(m: f32, l: f32, sink: Option<f32>) -> f32 {
    match sink {
        None => 1.0 / l,
        Some(s) => {
            let mm = m.max(s);
            let a = (m - mm).exp();
            a / (l * a + (s - mm).exp())
        }
    }
}

/// [`paged_attention`] at an explicit SIMD level (tests and benchmarks cover
/// every level this way).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_at<T: KvElem>(
    level: SimdLevel,
    pool: &ThreadPool,
    layout: &KvLayout,
    k_cache: &[T],
    v_cache: &[T],
    q: &[f32],
    n_heads: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    check_level(level);
    if let Some(s) = sinks {
        assert_eq!(
            s.len(),
            n_heads,
            "paged_attention: one sink logit per q head"
        );
    }
    assert!(
        window != Some(0),
        "paged_attention: a window of 0 positions"
    );
    let d = layout.head_dim;
    let n_kv = layout.n_kv_heads;
    let bs = layout.block_size;
    assert!(
        d > 0 && d <= MAX_HEAD_DIM,
        "paged_attention: head_dim {d} not in 1..={MAX_HEAD_DIM}"
    );
    assert!(bs > 0, "paged_attention: block_size must be positive");
    assert!(
        n_kv > 0 && n_heads >= n_kv && n_heads.is_multiple_of(n_kv),
        "paged_attention: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}"
    );
    let group = n_heads / n_kv;
    assert!(
        group <= WIDE_ROWS,
        "paged_attention: group size {group} above {WIDE_ROWS}"
    );
    assert_eq!(
        k_cache.len(),
        layout.elems(),
        "paged_attention: k_cache does not match the layout"
    );
    assert_eq!(
        v_cache.len(),
        layout.elems(),
        "paged_attention: v_cache does not match the layout"
    );
    assert_eq!(
        q.len(),
        out.len(),
        "paged_attention: q and out differ in length"
    );
    let row = n_heads * d;
    assert_eq!(
        q.len() % row,
        0,
        "paged_attention: q is not a whole number of rows"
    );
    let n_tokens = q.len() / row;
    for (i, s) in seqs.iter().enumerate() {
        if s.q_len == 0 {
            continue;
        }
        assert!(
            s.q_start + s.q_len <= n_tokens,
            "paged_attention: seq {i} rows outside q"
        );
        assert!(
            s.q_len <= s.ctx_len,
            "paged_attention: seq {i} has q_len > ctx_len"
        );
        // Positions are compared as f32 in the wide kernel's mask.
        assert!(
            s.ctx_len < 1 << 24,
            "paged_attention: seq {i} context too long"
        );
        let blocks = s.ctx_len.div_ceil(bs);
        assert!(
            s.block_table.len() >= blocks,
            "paged_attention: seq {i} block table too short"
        );
        for &b in &s.block_table[..blocks] {
            assert!(
                (b as usize) < layout.num_blocks,
                "paged_attention: seq {i} names block {b}"
            );
        }
    }
    check_disjoint(seqs);

    let lanes = match level {
        SimdLevel::Avx512Vnni | SimdLevel::Amx | SimdLevel::AmxBf16 => 16,
        SimdLevel::Avx2 => 8,
        SimdLevel::Scalar => 1,
    };
    let ctx = Ctx {
        d,
        bs,
        n_kv,
        group,
        n_heads,
        // Below one vector of rows (and below 8 in any case, so the scalar
        // build exercises both kernels) the small kernel wins. The choice
        // changes no result bit (see "Batch invariance" above).
        wide_min_rows: lanes.max(8),
        k: T::view(k_cache),
        v: T::view(v_cache),
        q,
        out: SyncPtr(out.as_mut_ptr()),
        scale,
        sinks,
        window: window.unwrap_or(usize::MAX),
        window_grid: lcm(bs, KT),
        seqs,
    };
    let n_tasks: usize = seqs.iter().map(|s| ctx.n_tiles(s.q_len) * n_kv).sum();
    pool.run(n_tasks, &|t| {
        let task = ctx.task(t);
        // SAFETY: `check_level` confirmed the CPU supports `level`.
        unsafe { dispatch(level, task) }
    });
}

/// Panics if two sequences share rows of `q`/`out`: tasks of different
/// sequences write their rows concurrently, so overlap would be a data race.
/// Batches are normally laid out in order, which is checked in one pass; any
/// other order falls back to comparing all pairs (no allocation to sort).
fn check_disjoint(seqs: &[AttnSeq<'_>]) {
    let mut end = 0;
    let mut ordered = true;
    for s in seqs.iter().filter(|s| s.q_len > 0) {
        if s.q_start < end {
            ordered = false;
            break;
        }
        end = s.q_start + s.q_len;
    }
    if ordered {
        return;
    }
    for (i, a) in seqs.iter().enumerate().filter(|(_, s)| s.q_len > 0) {
        for b in seqs[i + 1..].iter().filter(|s| s.q_len > 0) {
            assert!(
                a.q_start + a.q_len <= b.q_start || b.q_start + b.q_len <= a.q_start,
                "paged_attention: sequences overlap in q"
            );
        }
    }
}

/// The lowest cache position [`paged_attention`] may read for a query whose
/// window starts at `window_start`: the chunk boundary at or below it (see
/// "Sliding windows" above). Blocks wholly below this are never read again
/// by that query or any later one, so a KV manager may give them back.
pub fn window_reads_from(window_start: usize, block_size: usize) -> usize {
    window_start - window_start % lcm(block_size.max(1), KT)
}

impl Kernel for Tile<'_, '_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        if self.nq * self.ctx.group >= self.ctx.wide_min_rows {
            unsafe { wide_tile::<S>(&self) }
        } else {
            unsafe { small_tile::<S>(&self) }
        }
    }
}
