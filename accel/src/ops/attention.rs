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

use std::mem::MaybeUninit;

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;

/// Largest supported head dimension (sizes the stack scratch).
pub const MAX_HEAD_DIM: usize = 256;
/// Cache positions processed per online-softmax step. A multiple of every
/// lane count (16), so a chunk's scores fill whole vectors.
const KT: usize = 32;
/// Most rows (query × q head) in a wide tile. 64 rows × 256 dims of
/// transposed queries plus as many accumulators is 128 KiB of stack, and a
/// tile this tall reads each K/V chunk once for 64 rows.
const WIDE_ROWS: usize = 64;
/// Most rows in a small tile: small tiles are used below one vector of rows,
/// at most 16 lanes.
const SMALL_ROWS: usize = 16;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit float: exact, twice the memory of the 16-bit types.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16: f32's range with 8 bits of mantissa.
    Bf16,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

mod sealed {
    /// The cache reinterpreted as raw storage, so kernels can widen it with
    /// SIMD instead of element by element through [`super::KvElem::to_f32`].
    #[derive(Clone, Copy)]
    pub enum KvView<'a> {
        F32(&'a [f32]),
        F16(&'a [u16]),
        Bf16(&'a [u16]),
    }

    impl KvView<'_> {
        /// Address of element `i` (for prefetching; not dereferenced).
        #[inline(always)]
        pub fn addr(&self, i: usize) -> *const u8 {
            match *self {
                KvView::F32(s) => s.as_ptr().wrapping_add(i) as *const u8,
                KvView::F16(s) | KvView::Bf16(s) => s.as_ptr().wrapping_add(i) as *const u8,
            }
        }
    }

    /// Keeps [`super::KvElem`] to the three types the kernels know how to
    /// read (the trait is public, its implementations are not open).
    pub trait Sealed: Sized {
        fn view(s: &[Self]) -> KvView<'_>;
    }
}
use sealed::KvView;

/// A type the KV cache can be stored in: `f32`, [`half::f16`] or
/// [`half::bf16`].
pub trait KvElem: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The runtime tag of this type.
    const DTYPE: KvDtype;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// [`KvElem::from_f32`] of each element of `src` into `dst` (of equal
    /// length), vectorized where the type allows.
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(x);
        }
    }
}

impl sealed::Sealed for f32 {
    fn view(s: &[f32]) -> KvView<'_> {
        KvView::F32(s)
    }
}
impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32_slice(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl sealed::Sealed for f16 {
    fn view(s: &[f16]) -> KvView<'_> {
        KvView::F16(bytemuck::cast_slice(s))
    }
}
impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    #[inline]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32_slice(dst: &mut [f16], src: &[f32]) {
        // F16C, 8 at a time, with the same rounding as `f16::from_f32`.
        dst.convert_from_f32_slice(src);
    }
}

impl sealed::Sealed for bf16 {
    fn view(s: &[bf16]) -> KvView<'_> {
        KvView::Bf16(bytemuck::cast_slice(s))
    }
}
impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Shape of one layer's K (or V) cache: `[num_blocks, n_kv_heads, slab]`,
/// one contiguous `block_size × head_dim` slab per (block, KV head), so a
/// task streams its KV head's part of a block without striding over the
/// other heads.
///
/// Inside a slab, V is stored by position (`[block_size][head_dim]`) and K
/// transposed (`[head_dim][block_size]`): decode scores put keys in the SIMD
/// lanes (see the module docs), and with K stored this way a vector of keys'
/// `i`-th elements is one load instead of a transpose per chunk.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Token positions per block.
    pub block_size: usize,
    /// KV heads of the layer.
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements in one K (or V) cache of this layout.
    pub fn elems(&self) -> usize {
        self.num_blocks * self.n_kv_heads * self.block_size * self.head_dim
    }

    /// Index of the first element of the slab of `(block, kv_head)`.
    #[inline(always)]
    fn slab(&self, block: usize, kv_head: usize) -> usize {
        (block * self.n_kv_heads + kv_head) * self.block_size * self.head_dim
    }
}

/// Writes new K and V rows into the caches, rounding to `T`.
///
/// `k`, `v`: `[n_tokens, n_kv_heads * head_dim]`; token `t` goes to slot
/// `slot_mapping[t] = block_id * block_size + offset_in_block`.
///
/// # Panics
/// If a length disagrees with `layout` or a slot is outside the pool.
pub fn write_kv<T: KvElem>(
    layout: &KvLayout,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
) {
    let d = layout.head_dim;
    let row = layout.n_kv_heads * d;
    assert_eq!(
        k_cache.len(),
        layout.elems(),
        "write_kv: k_cache does not match the layout"
    );
    assert_eq!(
        v_cache.len(),
        layout.elems(),
        "write_kv: v_cache does not match the layout"
    );
    assert_eq!(
        k.len(),
        slot_mapping.len() * row,
        "write_kv: k has the wrong length"
    );
    assert_eq!(
        v.len(),
        slot_mapping.len() * row,
        "write_kv: v has the wrong length"
    );
    let slots = layout.num_blocks * layout.block_size;
    // K is rounded here in runs of `RUN`, then scattered into its
    // transposed slab.
    const RUN: usize = 64;
    let mut run = [T::from_f32(0.0); RUN];
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let slot = slot as usize;
        assert!(
            slot < slots,
            "write_kv: slot {slot} outside the pool of {slots}"
        );
        let (block, off) = (slot / layout.block_size, slot % layout.block_size);
        for h in 0..layout.n_kv_heads {
            let slab = layout.slab(block, h);
            let src = t * row + h * d;
            // K transposed: element `i` of this position is `block_size` apart
            // from element `i + 1`.
            let k_slab = &mut k_cache[slab..slab + d * layout.block_size];
            let mut cells = k_slab[off..].iter_mut().step_by(layout.block_size);
            for part in k[src..src + d].chunks(RUN) {
                let rounded = &mut run[..part.len()];
                T::from_f32_slice(rounded, part);
                // `rounded` leads the zip, so no cell is taken past its end.
                for (&x, c) in rounded.iter().zip(&mut cells) {
                    *c = x;
                }
            }
            let dst = slab + off * d;
            T::from_f32_slice(&mut v_cache[dst..dst + d], &v[src..src + d]);
        }
    }
}

/// One sequence in a flattened ragged batch.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in `q` and `out`.
    pub q_start: usize,
    /// New tokens (rows of `q`) of this sequence in the batch.
    pub q_len: usize,
    /// Tokens in the cache including the new ones, already written.
    pub ctx_len: usize,
    /// The sequence's blocks: position `p` lives in block
    /// `block_table[p / block_size]` at offset `p % block_size`.
    pub block_table: &'a [u32],
}

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
        out,
    )
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
    out: &mut [f32],
) {
    check_level(level);
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

/// `out`'s base pointer, shared by the tasks.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);

// SAFETY: every task writes only the rows of its own sequence (rows
// `q_start + q0 .. q_start + q0 + nq`) and within them only the columns of its
// own KV head's group of q heads. Sequences' rows are disjoint
// (`check_disjoint`), tiles of a sequence split its rows, and KV heads split
// the columns, so no two tasks touch the same element; nothing reads `out`
// during the call, and `pool.run` returns only after every task finished,
// while the `&mut out` borrow is still held.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Everything a task needs, validated once per call.
struct Ctx<'a> {
    d: usize,
    bs: usize,
    n_kv: usize,
    group: usize,
    n_heads: usize,
    wide_min_rows: usize,
    k: KvView<'a>,
    v: KvView<'a>,
    q: &'a [f32],
    out: SyncPtr,
    scale: f32,
    /// Positions a query sees, itself included (`usize::MAX`: all).
    window: usize,
    /// Chunk boundaries for every cache type: a windowed tile starts at a
    /// multiple of this.
    window_grid: usize,
    seqs: &'a [AttnSeq<'a>],
}

/// The lowest cache position [`paged_attention`] may read for a query whose
/// window starts at `window_start`: the chunk boundary at or below it (see
/// "Sliding windows" above). Blocks wholly below this are never read again
/// by that query or any later one, so a KV manager may give them back.
pub fn window_reads_from(window_start: usize, block_size: usize) -> usize {
    window_start - window_start % lcm(block_size.max(1), KT)
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// One task: the rows of queries `q0..q0 + nq` of a sequence, for the q
/// heads of KV head `kvh`.
struct Tile<'c, 'a> {
    ctx: &'c Ctx<'a>,
    seq: &'c AttnSeq<'a>,
    kvh: usize,
    q0: usize,
    nq: usize,
}

impl Ctx<'_> {
    /// Query tiles a sequence of `q_len` new tokens is split into: one if all
    /// its rows fit the small kernel, else tiles of at most `WIDE_ROWS` rows,
    /// evenly sized.
    fn n_tiles(&self, q_len: usize) -> usize {
        if q_len == 0 {
            0
        } else if q_len * self.group < self.wide_min_rows {
            1
        } else {
            q_len.div_ceil((WIDE_ROWS / self.group).max(1))
        }
    }

    /// Maps task index `t` to its tile. Within a sequence the last query
    /// tiles (which see the most context, hence the most work) come first,
    /// so the pool does not finish on one long task.
    fn task(&self, mut t: usize) -> Tile<'_, '_> {
        for seq in self.seqs {
            let nt = self.n_tiles(seq.q_len);
            let count = nt * self.n_kv;
            if t < count {
                let tile = nt - 1 - t / self.n_kv;
                let q0 = tile * seq.q_len / nt;
                let q1 = (tile + 1) * seq.q_len / nt;
                return Tile {
                    ctx: self,
                    seq,
                    kvh: t % self.n_kv,
                    q0,
                    nq: q1 - q0,
                };
            }
            t -= count;
        }
        unreachable!("task index beyond the planned tasks")
    }

    /// The lowest position the query at `pos` sees.
    #[inline(always)]
    fn window_start(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.window)
    }

    /// Where a tile whose first query sits at `first` starts reading the
    /// cache: 0 without a window, else the chunk boundary at or below the
    /// first query's window (see "Sliding windows" in the module docs).
    #[inline(always)]
    fn first_chunk(&self, first: usize) -> usize {
        let lo = self.window_start(first);
        lo - lo % self.window_grid
    }

    /// Offset of `(token, q head)` in `q` / `out`.
    #[inline(always)]
    fn offset(&self, token: usize, head: usize) -> usize {
        (token * self.n_heads + head) * self.d
    }

    /// Length of the chunk starting at position `c0` (at most `KT`, up to
    /// `n_keys`). An f32 cache with blocks of 8 or more is read in place, so
    /// its chunks stop at block boundaries; other caches are gathered, so
    /// chunks may span blocks.
    #[inline(always)]
    fn chunk_len(&self, c0: usize, n_keys: usize) -> usize {
        let n = KT.min(n_keys - c0);
        match self.k {
            KvView::F32(_) if self.bs >= 8 => n.min(self.bs - c0 % self.bs),
            _ => n,
        }
    }

    /// Asks the CPU to start fetching positions `start..start + n` of KV
    /// head `kvh` from both caches. Blocks are scattered, so the hardware
    /// prefetcher cannot guess the next one; issuing this for the next chunk
    /// before computing the current one overlaps the memory latency with
    /// the arithmetic (decode is bound by reading the cache).
    #[inline(always)]
    fn prefetch_chunk(&self, table: &[u32], kvh: usize, start: usize, n: usize) {
        let (d, bs) = (self.d, self.bs);
        let elem = match self.k {
            KvView::F32(_) => 4,
            _ => 2,
        };
        // Prefetches never fault; the addresses are only computed (with
        // wrapping arithmetic), never dereferenced.
        let lines = |from: *const u8, bytes: usize| {
            let mut a = from as usize & !63;
            while a < from as usize + bytes {
                super::simd::prefetch(a as *const u8);
                a += 64;
            }
        };
        let end = start + n;
        let mut p = start;
        while p < end {
            let seg = (bs - p % bs).min(end - p);
            let slab = (table[p / bs] as usize * self.n_kv + kvh) * bs * d;
            let off = p % bs;
            lines(self.v.addr(slab + off * d), seg * d * elem);
            if seg == bs {
                lines(self.k.addr(slab), bs * d * elem);
            } else {
                // K is transposed: the positions are a run in each of the
                // slab's `d` rows.
                for i in 0..d {
                    lines(self.k.addr(slab + i * bs + off), seg * elem);
                }
            }
            p += seg;
        }
    }

    /// Returns values at positions `start..start + n` of KV head `kvh` as
    /// contiguous f32 rows (`[n][d]`): in place for an f32 chunk within one
    /// block, else widened/gathered into `buf` (room for `KT * d`).
    #[inline(always)]
    unsafe fn load_values<S: Simd>(
        &self,
        table: &[u32],
        kvh: usize,
        start: usize,
        n: usize,
        buf: *mut f32,
    ) -> *const f32 {
        let (d, bs) = (self.d, self.bs);
        let view = self.v;
        let index = |p: usize| (table[p / bs] as usize * self.n_kv + kvh) * bs * d + p % bs * d;
        if let KvView::F32(data) = view {
            if start % bs + n <= bs {
                let base = index(start);
                return data[base..base + n * d].as_ptr();
            }
        }
        let end = start + n;
        let mut p = start;
        let mut dst = buf;
        while p < end {
            // Rows of one block are contiguous: convert them in one run.
            let seg = (bs - p % bs).min(end - p);
            let base = index(p);
            let len = seg * d;
            // SAFETY: the source is bounds-checked by slicing; `dst` stays
            // within the `n * d <= KT * d` elements of `buf`.
            unsafe {
                match view {
                    KvView::F32(data) => {
                        std::ptr::copy_nonoverlapping(data[base..base + len].as_ptr(), dst, len)
                    }
                    KvView::F16(data) => S::f16_to_f32(data[base..base + len].as_ptr(), dst, len),
                    KvView::Bf16(data) => S::bf16_to_f32(data[base..base + len].as_ptr(), dst, len),
                }
                dst = dst.add(len);
            }
            p += seg;
        }
        buf
    }

    /// Writes the keys at positions `start..start + n` of KV head `kvh`,
    /// widened to f32 and transposed, into `kt`: `kt[i · KT + j]` is element
    /// `i` of key `start + j`. Keys from `n` up to a whole vector of `S` are
    /// zero (their scores are computed, then masked).
    #[inline(always)]
    unsafe fn load_keys<S: Simd>(
        &self,
        table: &[u32],
        kvh: usize,
        start: usize,
        n: usize,
        kt: *mut f32,
    ) {
        let (d, bs) = (self.d, self.bs);
        let end = start + n;
        let mut p = start;
        while p < end {
            // A block's part of the chunk is a run in each row of its slab.
            let seg = (bs - p % bs).min(end - p);
            let slab = (table[p / bs] as usize * self.n_kv + kvh) * bs * d;
            let (off, j) = (p % bs, p - start);
            for i in 0..d {
                let at = slab + i * bs + off;
                // SAFETY: the source is bounds-checked by slicing; the
                // destination is within row `i` of `kt` (`j + seg <= KT`).
                unsafe {
                    let dst = kt.add(i * KT + j);
                    match self.k {
                        KvView::F32(data) => {
                            std::ptr::copy_nonoverlapping(data[at..at + seg].as_ptr(), dst, seg)
                        }
                        KvView::F16(data) => S::f16_to_f32(data[at..at + seg].as_ptr(), dst, seg),
                        KvView::Bf16(data) => S::bf16_to_f32(data[at..at + seg].as_ptr(), dst, seg),
                    }
                }
            }
            p += seg;
        }
        let padded = n.div_ceil(S::LANES) * S::LANES;
        for i in 0..d {
            for j in n..padded {
                // SAFETY: `padded <= KT` (KT is a multiple of every lane count).
                unsafe { *kt.add(i * KT + j) = 0.0 };
            }
        }
    }
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

/// Uninitialized stack scratch: it is large (up to 64 KiB) and a decode
/// task is short, so zeroing it would cost a visible share. Every kernel
/// writes each element before reading it, through raw pointers only.
macro_rules! scratch {
    ($n:expr) => {
        MaybeUninit::<[f32; $n]>::uninit()
    };
}

/// The small kernel (see the module docs). It computes exactly the wide
/// kernel's arithmetic per row (see "Batch invariance" there), laid out for
/// few rows: scores with the chunk's keys in the lanes (K is stored
/// transposed), `P·V` with head dimensions in the lanes.
// Row loops index several per-row arrays (`pos`, `vis`, `m`, ...) at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn small_tile<S: Simd>(t: &Tile<'_, '_>) {
    let c = t.ctx;
    let (d, g, l) = (c.d, c.group, S::LANES);
    let rows = t.nq * g;
    debug_assert!(rows <= SMALL_ROWS);
    // Rows rounded up to whole vectors, for the per-row softmax state.
    let rv = rows.div_ceil(l) * l;
    let mut qs = scratch!(SMALL_ROWS * MAX_HEAD_DIM);
    let mut acc = scratch!(SMALL_ROWS * MAX_HEAD_DIM);
    let mut sc = scratch!(SMALL_ROWS * KT);
    let mut vbuf = scratch!(KT * MAX_HEAD_DIM);
    let mut ktb = scratch!(MAX_HEAD_DIM * KT);
    let (qs, acc, sc, kt) = (
        qs.as_mut_ptr() as *mut f32,
        acc.as_mut_ptr() as *mut f32,
        sc.as_mut_ptr() as *mut f32,
        ktb.as_mut_ptr() as *mut f32,
    );
    let vbuf = vbuf.as_mut_ptr() as *mut f32;
    // Per-row state. Rows `rows..rv` are padding with finite values, so the
    // lane-wise updates below compute nothing undefined for them.
    let mut m = [0.0f32; SMALL_ROWS];
    let mut lsum = [0.0f32; SMALL_ROWS];
    let mut alpha = [0.0f32; SMALL_ROWS];
    let mut cmax = [0.0f32; SMALL_ROWS];
    let mut csum = [0.0f32; SMALL_ROWS];
    let mut pos = [0usize; SMALL_ROWS];
    let mut vis = [0usize; SMALL_ROWS];
    // f32::MIN rather than -inf, so that a row that has seen nothing yet
    // (under a window) rescales by exp(0) = 1 instead of exp(NaN).
    m[..rows].fill(f32::MIN);
    let first = t.seq.ctx_len - t.seq.q_len + t.q0;
    let token0 = t.seq.q_start + t.q0;
    // SAFETY (whole body): row `r < rows <= SMALL_ROWS` indexes `d <=
    // MAX_HEAD_DIM` elements of `qs`/`acc` and `KT` of `sc`; chunk rows are
    // `n <= KT` rows of `d` in `kp`/`vp`, `kt` holds `d` rows of `KT`; the
    // state arrays are read in whole vectors up to `rv <= SMALL_ROWS`; scores
    // are written up to `n` rounded up to whole vectors (not above `KT`)
    // before being read.
    unsafe {
        for r in 0..rows {
            let (qi, hh) = (r / g, r % g);
            pos[r] = first + qi;
            // The scale is folded into q once instead of into every score.
            let src = &c.q[c.offset(token0 + qi, t.kvh * g + hh)..][..d];
            for (i, &x) in src.iter().enumerate() {
                *qs.add(r * d + i) = x * c.scale;
                *acc.add(r * d + i) = 0.0;
            }
        }
        let n_keys = first + t.nq;
        // Chunks start at multiples of `min(bs, KT)`, so with blocks a whole
        // number of vectors every vector of keys lies inside one block and
        // the cache can be read in place; otherwise (scalar code, tiny
        // blocks) chunks are gathered into scratch first.
        let in_place = l > 1 && c.bs.is_multiple_of(l);
        let table = t.seq.block_table;
        let mut vp: *const f32 = std::ptr::null();
        let mut c0 = c.first_chunk(first);
        while c0 < n_keys {
            let n = c.chunk_len(c0, n_keys);
            let at = if in_place {
                ChunkAt::new(c, table, t.kvh, c0, n, l)
            } else {
                c.load_keys::<S>(table, t.kvh, c0, n, kt);
                vp = c.load_values::<S>(table, t.kvh, c0, n, vbuf);
                ChunkAt::EMPTY
            };
            let reader = Reader::new(c, &at, in_place);
            if c0 + n < n_keys {
                let n2 = c.chunk_len(c0 + n, n_keys);
                c.prefetch_chunk(table, t.kvh, c0 + n, n2);
            }
            // Scores of all rows against all `n` keys (the causal mask is
            // applied after): every score is the same sequence of FMAs over
            // the head dimensions as in the wide kernel.
            match &reader {
                Reader::F32(r) => r.scores::<S>(qs, rows, d, n, sc),
                Reader::F16(r) => r.scores::<S>(qs, rows, d, n, sc),
                Reader::Bf16(r) => r.scores::<S>(qs, rows, d, n, sc),
                Reader::Scratch if l == 1 => qk_direct::<S>(qs, rows, kt, d, n, sc),
                Reader::Scratch => {
                    let keys = |v: usize, i: usize| S::load(kt.add(i * KT + v * l));
                    qk_keys::<S>(qs, rows, &keys, d, n, sc)
                }
            }
            let padded = n.div_ceil(l) * l;
            for r in 0..rows {
                vis[r] = if pos[r] < c0 {
                    0 // the whole chunk is in this row's future
                } else {
                    (pos[r] + 1 - c0).min(n)
                };
                let sr = sc.add(r * KT);
                // Masked and padding keys get -inf, whose exp is 0: the
                // future, and what lies before the row's window.
                for j in vis[r]..padded {
                    *sr.add(j) = f32::NEG_INFINITY;
                }
                for j in 0..c.window_start(pos[r]).saturating_sub(c0).min(vis[r]) {
                    *sr.add(j) = f32::NEG_INFINITY;
                }
                let mut mx = S::splat(f32::NEG_INFINITY);
                for j in (0..padded).step_by(l) {
                    mx = S::max(mx, S::load(sr.add(j)));
                }
                cmax[r] = S::hmax(mx);
            }
            // The running max and rescale factor, lane-wise over rows as in
            // the wide kernel. A row that sees nothing of this chunk keeps
            // its max (finite: it starts at f32::MIN) and gets
            // `alpha = exp(0) = 1`.
            for r in (0..rv).step_by(l) {
                let mo = S::load(m.as_ptr().add(r));
                let mn = S::max(mo, S::load(cmax.as_ptr().add(r)));
                S::store(alpha.as_mut_ptr().add(r), S::exp(S::sub(mo, mn)));
                S::store(m.as_mut_ptr().add(r), mn);
            }
            for r in 0..rows {
                let sr = sc.add(r * KT);
                let mv = S::splat(m[r]);
                for j in (0..padded).step_by(l) {
                    S::store(sr.add(j), S::exp(S::sub(S::load(sr.add(j)), mv)));
                }
            }
            // Summed in key order, as each lane of the wide kernel does,
            // masked keys included (their exact zeros change no sum). Four
            // rows at a time in registers, so their dependency chains
            // overlap instead of running one after another; a group past
            // the last row re-reads that row and drops the result.
            for r0 in (0..rows).step_by(4) {
                let row = |q: usize| sc.add((r0 + q).min(rows - 1) * KT);
                let (s0, s1, s2, s3) = (row(0), row(1), row(2), row(3));
                let mut a = [0.0f32; 4];
                for j in 0..n {
                    a[0] += *s0.add(j);
                    a[1] += *s1.add(j);
                    a[2] += *s2.add(j);
                    a[3] += *s3.add(j);
                }
                let k = 4.min(rows - r0);
                csum[r0..r0 + k].copy_from_slice(&a[..k]);
            }
            for r in (0..rv).step_by(l) {
                let ls = S::load(lsum.as_ptr().add(r));
                let a = S::load(alpha.as_ptr().add(r));
                S::store(
                    lsum.as_mut_ptr().add(r),
                    S::fma(ls, a, S::load(csum.as_ptr().add(r))),
                );
            }
            for r in 0..rows {
                // A row with nothing visible has alpha 1 and p 0: its
                // accumulator would come out unchanged, so skip it.
                if vis[r] > 0 {
                    let (a, al, p, nv) = (acc.add(r * d), alpha[r], sc.add(r * KT), vis[r]);
                    match &reader {
                        Reader::F32(r) => r.accumulate::<S>(a, al, p, nv, d),
                        Reader::F16(r) => r.accumulate::<S>(a, al, p, nv, d),
                        Reader::Bf16(r) => r.accumulate::<S>(a, al, p, nv, d),
                        Reader::Scratch => {
                            let vals = |j: usize, i: usize| S::load(vp.add(j * d + i));
                            let val = |j: usize, i: usize| *vp.add(j * d + i);
                            pv_row::<S>(a, al, p, &vals, &val, nv, d)
                        }
                    }
                }
            }
            c0 += n;
        }
        for r in 0..rows {
            // Every row sees position 0, so its sum is positive.
            let inv = 1.0 / lsum[r];
            let dst = c.out.0.add(c.offset(token0 + r / g, t.kvh * g + r % g));
            for i in 0..d {
                *dst.add(i) = *acc.add(r * d + i) * inv;
            }
        }
    }
}

/// Scores `sc[r][j] = Σ_i qs[r][i] · k_j[i]` for all `rows` and the keys
/// `j` of `n` rounded up to whole vectors: keys in the lanes, each lane one
/// FMA per head dimension in order (the wide kernel's sequence).
/// `keys(v, i)` returns element `i` of the keys of vector `v` (keys
/// `v · LANES ..`), from the transposed scratch or straight from the cache.
#[inline(always)]
unsafe fn qk_keys<S: Simd>(
    qs: *const f32,
    rows: usize,
    keys: &impl Fn(usize, usize) -> S::V,
    d: usize,
    n: usize,
    sc: *mut f32,
) {
    let nvec = n.div_ceil(S::LANES);
    unsafe {
        let mut r = 0;
        while r < rows {
            let rb = match rows - r {
                4.. => 4,
                2 | 3 => 2,
                _ => 1,
            };
            let mut v = 0;
            while v < nvec {
                let jv = if v + 2 <= nvec { 2 } else { 1 };
                match (rb, jv) {
                    (4, 2) => qk_keys_micro::<S, 4, 2>(qs, r, keys, d, v, sc),
                    (4, _) => qk_keys_micro::<S, 4, 1>(qs, r, keys, d, v, sc),
                    (2, 2) => qk_keys_micro::<S, 2, 2>(qs, r, keys, d, v, sc),
                    (2, _) => qk_keys_micro::<S, 2, 1>(qs, r, keys, d, v, sc),
                    (_, 2) => qk_keys_micro::<S, 1, 2>(qs, r, keys, d, v, sc),
                    _ => qk_keys_micro::<S, 1, 1>(qs, r, keys, d, v, sc),
                }
                v += jv;
            }
            r += rb;
        }
    }
}

/// `RB` rows × `JV` key vectors (from vector `v0`) of [`qk_keys`].
#[inline(always)]
unsafe fn qk_keys_micro<S: Simd, const RB: usize, const JV: usize>(
    qs: *const f32,
    r0: usize,
    keys: &impl Fn(usize, usize) -> S::V,
    d: usize,
    v0: usize,
    sc: *mut f32,
) {
    let l = S::LANES;
    unsafe {
        let mut acc = [[S::zero(); JV]; RB];
        for i in 0..d {
            let mut kv = [S::zero(); JV];
            for (v, kvv) in kv.iter_mut().enumerate() {
                *kvv = keys(v0 + v, i);
            }
            for (rr, accr) in acc.iter_mut().enumerate() {
                let qb = S::splat(*qs.add((r0 + rr) * d + i));
                for v in 0..JV {
                    accr[v] = S::fma(qb, kv[v], accr[v]);
                }
            }
        }
        for (rr, accr) in acc.iter().enumerate() {
            for (v, a) in accr.iter().enumerate() {
                S::store(sc.add((r0 + rr) * KT + (v0 + v) * l), *a);
            }
        }
    }
}

/// Scores for one lane (scalar code): each score is the FMA sequence over
/// the head dimensions, reading `kt[d][KT]` one key at a time.
#[inline(always)]
unsafe fn qk_direct<S: Simd>(
    qs: *const f32,
    rows: usize,
    kt: *const f32,
    d: usize,
    n: usize,
    sc: *mut f32,
) {
    unsafe {
        for r in 0..rows {
            let qr = qs.add(r * d);
            for j in 0..n {
                let mut a = 0.0f32;
                for i in 0..d {
                    a = S::fma1(*qr.add(i), *kt.add(i * KT + j), a);
                }
                *sc.add(r * KT + j) = a;
            }
        }
    }
}

/// `acc = acc * alpha + Σ_j p[j] · v_j` over `n` value rows, four vectors
/// of `acc` held in registers at a time. `vals(j, i)` returns elements
/// `i .. i + LANES` of row `j` and `val(j, i)` element `i` alone (for a
/// head dimension that is not a whole number of vectors).
#[inline(always)]
unsafe fn pv_row<S: Simd>(
    acc: *mut f32,
    alpha: f32,
    p: *const f32,
    vals: &impl Fn(usize, usize) -> S::V,
    val: &impl Fn(usize, usize) -> f32,
    n: usize,
    d: usize,
) {
    let l = S::LANES;
    let nv = d - d % l;
    unsafe {
        let av = S::splat(alpha);
        let mut i = 0;
        while i + 4 * l <= nv {
            let mut a = [S::zero(); 4];
            for (k, ak) in a.iter_mut().enumerate() {
                *ak = S::mul(S::load(acc.add(i + k * l)), av);
            }
            for j in 0..n {
                let pj = S::splat(*p.add(j));
                for (k, ak) in a.iter_mut().enumerate() {
                    *ak = S::fma(pj, vals(j, i + k * l), *ak);
                }
            }
            for (k, ak) in a.iter().enumerate() {
                S::store(acc.add(i + k * l), *ak);
            }
            i += 4 * l;
        }
        while i < nv {
            let mut a = S::mul(S::load(acc.add(i)), av);
            for j in 0..n {
                a = S::fma(S::splat(*p.add(j)), vals(j, i), a);
            }
            S::store(acc.add(i), a);
            i += l;
        }
        for i in nv..d {
            let mut a = *acc.add(i) * alpha;
            for j in 0..n {
                a = S::fma1(*p.add(j), val(j, i), a);
            }
            *acc.add(i) = a;
        }
    }
}

/// How the small kernel reads one cache element type in place.
trait Widen {
    /// The cache's storage type.
    type Raw: Copy;
    /// `S::LANES` elements at `p`, widened to f32.
    unsafe fn load<S: Simd>(p: *const Self::Raw) -> S::V;
}

struct FromF32;
struct FromF16;
struct FromBf16;

impl Widen for FromF32 {
    type Raw = f32;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        unsafe { S::load(p) }
    }
}

impl Widen for FromF16 {
    type Raw = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        unsafe { S::load_f16(p) }
    }
}

impl Widen for FromBf16 {
    type Raw = u16;
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        unsafe { S::load_bf16(p) }
    }
}

/// Element offsets, from the start of a cache, of one chunk's keys and
/// values of one KV head, for reading them in place (when every vector of
/// keys lies inside one block).
struct ChunkAt {
    /// Element 0 of the keys of vector `v` (their element `i` is `i · bs`
    /// further: K slabs are transposed).
    kvec: [usize; KT],
    /// Value row `j`.
    vrow: [usize; KT],
}

impl ChunkAt {
    /// No chunk (the scratch path).
    const EMPTY: ChunkAt = ChunkAt {
        kvec: [0; KT],
        vrow: [0; KT],
    };

    /// Offsets for positions `start..start + n` of KV head `kvh`.
    #[inline(always)]
    fn new(c: &Ctx<'_>, table: &[u32], kvh: usize, start: usize, n: usize, lanes: usize) -> Self {
        let (d, bs) = (c.d, c.bs);
        let mut at = ChunkAt {
            kvec: [0; KT],
            vrow: [0; KT],
        };
        for j in 0..n {
            let p = start + j;
            let slab = (table[p / bs] as usize * c.n_kv + kvh) * bs * d;
            at.vrow[j] = slab + p % bs * d;
            if j % lanes == 0 {
                at.kvec[j / lanes] = slab + p % bs;
            }
        }
        at
    }
}

/// Scores and `P·V` of the small kernel read straight from a cache of
/// element type `W` (see [`ChunkAt`]), so nothing is widened into scratch
/// first.
struct InPlace<'a, W: Widen> {
    k: *const W::Raw,
    v: *const W::Raw,
    at: &'a ChunkAt,
    bs: usize,
}

/// Where the small kernel reads a chunk from: in place, by cache type, or
/// from the scratch it was gathered into.
enum Reader<'a> {
    F32(InPlace<'a, FromF32>),
    F16(InPlace<'a, FromF16>),
    Bf16(InPlace<'a, FromBf16>),
    Scratch,
}

impl<'a> Reader<'a> {
    #[inline(always)]
    fn new(c: &Ctx<'_>, at: &'a ChunkAt, in_place: bool) -> Reader<'a> {
        if !in_place {
            return Reader::Scratch;
        }
        let bs = c.bs;
        // K and V caches always share one element type.
        match (c.k, c.v) {
            (KvView::F32(k), KvView::F32(v)) => Reader::F32(InPlace {
                k: k.as_ptr(),
                v: v.as_ptr(),
                at,
                bs,
            }),
            (KvView::F16(k), KvView::F16(v)) => Reader::F16(InPlace {
                k: k.as_ptr(),
                v: v.as_ptr(),
                at,
                bs,
            }),
            (KvView::Bf16(k), KvView::Bf16(v)) => Reader::Bf16(InPlace {
                k: k.as_ptr(),
                v: v.as_ptr(),
                at,
                bs,
            }),
            _ => unreachable!("the K and V caches share one element type"),
        }
    }
}

// SAFETY (both methods): the offsets come from block tables that
// `paged_attention_at` checked against the pool, and a vector of keys or a
// row of values at such an offset lies inside its block's slab (blocks are a
// whole number of vectors); keys past the chunk are read but masked.
impl<W: Widen> InPlace<'_, W> {
    /// [`qk_keys`] for a chunk of `n` keys.
    #[inline(always)]
    unsafe fn scores<S: Simd>(
        &self,
        qs: *const f32,
        rows: usize,
        d: usize,
        n: usize,
        sc: *mut f32,
    ) {
        let keys =
            |v: usize, i: usize| unsafe { W::load::<S>(self.k.add(self.at.kvec[v] + i * self.bs)) };
        unsafe { qk_keys::<S>(qs, rows, &keys, d, n, sc) }
    }

    /// [`pv_row`] for the first `n` value rows of a chunk.
    #[inline(always)]
    unsafe fn accumulate<S: Simd>(
        &self,
        acc: *mut f32,
        alpha: f32,
        p: *const f32,
        n: usize,
        d: usize,
    ) {
        let vals = |j: usize, i: usize| unsafe { W::load::<S>(self.v.add(self.at.vrow[j] + i)) };
        let val = |j: usize, i: usize| unsafe {
            W::load::<super::simd::Scalar>(self.v.add(self.at.vrow[j] + i))
        };
        unsafe { pv_row::<S>(acc, alpha, p, &vals, &val, n, d) }
    }
}

/// The wide kernel: rows in the lanes (see the module docs). Layouts, with
/// `rp` = rows rounded up to whole vectors: `qt[d][rp]` (scaled, transposed
/// queries), `acct[d][rp]`, `st[KT][rp]` (scores, then probabilities).
#[inline(always)]
unsafe fn wide_tile<S: Simd>(t: &Tile<'_, '_>) {
    let c = t.ctx;
    let (d, g, l) = (c.d, c.group, S::LANES);
    let rows = t.nq * g;
    let rp = rows.div_ceil(l) * l;
    debug_assert!(rp <= WIDE_ROWS);
    let mut qt = scratch!(MAX_HEAD_DIM * WIDE_ROWS);
    let mut acct = scratch!(MAX_HEAD_DIM * WIDE_ROWS);
    let mut st = scratch!(KT * WIDE_ROWS);
    let mut kbuf = scratch!(KT * MAX_HEAD_DIM);
    let mut vbuf = scratch!(KT * MAX_HEAD_DIM);
    let (qt, acct, st) = (
        qt.as_mut_ptr() as *mut f32,
        acct.as_mut_ptr() as *mut f32,
        st.as_mut_ptr() as *mut f32,
    );
    let (kbuf, vbuf) = (kbuf.as_mut_ptr() as *mut f32, vbuf.as_mut_ptr() as *mut f32);
    // Positions as f32 for the lane-wise mask (exact below 2^24, checked).
    let mut posf = [0.0f32; WIDE_ROWS];
    // The lowest position each row sees (its window's start), likewise.
    let mut lof = [0.0f32; WIDE_ROWS];
    // f32::MIN rather than -inf: see the small kernel.
    let mut m = [f32::MIN; WIDE_ROWS];
    let mut lsum = [0.0f32; WIDE_ROWS];
    let mut alpha = [0.0f32; WIDE_ROWS];
    let lof = lof.as_mut_ptr();
    let (posf, m, lsum, alpha) = (
        posf.as_mut_ptr(),
        m.as_mut_ptr(),
        lsum.as_mut_ptr(),
        alpha.as_mut_ptr(),
    );
    let first = t.seq.ctx_len - t.seq.q_len + t.q0;
    let token0 = t.seq.q_start + t.q0;
    // SAFETY (whole body): `rp <= WIDE_ROWS`, `d <= MAX_HEAD_DIM` and chunks
    // of `n <= KT` rows bound every index below; `qt` and `acct` are written
    // for all `d * rp` elements and `st` for all `n * rp` before being read.
    unsafe {
        for r in 0..rp {
            if r < rows {
                let (qi, hh) = (r / g, r % g);
                *posf.add(r) = (first + qi) as f32;
                *lof.add(r) = c.window_start(first + qi) as f32;
                let src = &c.q[c.offset(token0 + qi, t.kvh * g + hh)..][..d];
                for (i, &x) in src.iter().enumerate() {
                    *qt.add(i * rp + r) = x * c.scale;
                }
            } else {
                // Padding lanes: a zero query at the last row's position
                // gives finite scores and is never written out.
                *posf.add(r) = (first + t.nq - 1) as f32;
                *lof.add(r) = c.window_start(first + t.nq - 1) as f32;
                for i in 0..d {
                    *qt.add(i * rp + r) = 0.0;
                }
            }
        }
        for i in 0..d * rp {
            *acct.add(i) = 0.0;
        }
        let n_keys = first + t.nq;
        // Chunks starting below this are partly outside some row's window.
        let last_window = c.window_start(first + t.nq - 1);
        let mut c0 = c.first_chunk(first);
        while c0 < n_keys {
            let n = c.chunk_len(c0, n_keys);
            c.load_keys::<S>(t.seq.block_table, t.kvh, c0, n, kbuf);
            let vp = c.load_values::<S>(t.seq.block_table, t.kvh, c0, n, vbuf);
            if c0 + n < n_keys {
                let n2 = c.chunk_len(c0 + n, n_keys);
                c.prefetch_chunk(t.seq.block_table, t.kvh, c0 + n, n2);
            }
            qk_tile::<S>(qt, rp, kbuf, d, n, st);
            // Only chunks reaching past the first query's position need the
            // causal mask.
            if c0 + n - 1 > first {
                for j in 0..n {
                    let kpos = S::splat((c0 + j) as f32);
                    for r in (0..rp).step_by(l) {
                        let p = st.add(j * rp + r);
                        S::store(p, S::mask_gt(kpos, S::load(posf.add(r)), S::load(p)));
                    }
                }
            }
            if c0 < last_window {
                for j in 0..n {
                    let kpos = S::splat((c0 + j) as f32);
                    for r in (0..rp).step_by(l) {
                        let p = st.add(j * rp + r);
                        S::store(p, S::mask_gt(S::load(lof.add(r)), kpos, S::load(p)));
                    }
                }
            }
            // Online softmax, lane-wise over rows. The running max starts at
            // f32::MIN and only grows, so `mo - mn` is never `-inf - -inf`,
            // even for a row whose window this chunk does not reach.
            for r in (0..rp).step_by(l) {
                let mo = S::load(m.add(r));
                let mut mx = S::splat(f32::NEG_INFINITY);
                for j in 0..n {
                    mx = S::max(mx, S::load(st.add(j * rp + r)));
                }
                let mn = S::max(mo, mx);
                let a = S::exp(S::sub(mo, mn));
                let mut sum = S::zero();
                for j in 0..n {
                    let p = st.add(j * rp + r);
                    let e = S::exp(S::sub(S::load(p), mn));
                    S::store(p, e);
                    sum = S::add(sum, e);
                }
                S::store(lsum.add(r), S::fma(S::load(lsum.add(r)), a, sum));
                S::store(m.add(r), mn);
                S::store(alpha.add(r), a);
            }
            pv_tile::<S>(acct, rp, alpha, st, vp, d, n);
            c0 += n;
        }
        for r in 0..rows {
            let inv = 1.0 / *lsum.add(r);
            let dst = c.out.0.add(c.offset(token0 + r / g, t.kvh * g + r % g));
            for i in 0..d {
                *dst.add(i) = *acct.add(i * rp + r) * inv;
            }
        }
    }
}

/// `st[j][r] = Σ_i qt[i][r] · kt[i][j]` for `j < n`, all `rp` rows: blocks
/// of 2 row vectors × 8 (AVX-512) or 4 keys, accumulated in registers.
#[inline(always)]
unsafe fn qk_tile<S: Simd>(
    qt: *const f32,
    rp: usize,
    k: *const f32,
    d: usize,
    n: usize,
    st: *mut f32,
) {
    let l = S::LANES;
    let nrv = rp / l;
    let mut rv = 0;
    unsafe {
        while rv < nrv {
            if rv + 2 <= nrv {
                qk_rows::<S, 2>(qt, rp, rv * l, k, d, n, st);
                rv += 2;
            } else {
                qk_rows::<S, 1>(qt, rp, rv * l, k, d, n, st);
                rv += 1;
            }
        }
    }
}

#[inline(always)]
unsafe fn qk_rows<S: Simd, const RB: usize>(
    qt: *const f32,
    rp: usize,
    r0: usize,
    k: *const f32,
    d: usize,
    n: usize,
    st: *mut f32,
) {
    let mut j = 0;
    unsafe {
        // 16 accumulators need AVX-512's 32 registers; AVX2 has 16.
        if S::LANES >= 16 {
            while j + 8 <= n {
                qk_micro::<S, 8, RB>(qt, rp, r0, k, d, j, st);
                j += 8;
            }
        }
        while j + 4 <= n {
            qk_micro::<S, 4, RB>(qt, rp, r0, k, d, j, st);
            j += 4;
        }
        while j < n {
            qk_micro::<S, 1, RB>(qt, rp, r0, k, d, j, st);
            j += 1;
        }
    }
}

#[inline(always)]
unsafe fn qk_micro<S: Simd, const JB: usize, const RB: usize>(
    qt: *const f32,
    rp: usize,
    r0: usize,
    k: *const f32,
    d: usize,
    j0: usize,
    st: *mut f32,
) {
    let l = S::LANES;
    unsafe {
        let mut acc = [[S::zero(); RB]; JB];
        for i in 0..d {
            let qrow = qt.add(i * rp + r0);
            let mut qv = [S::zero(); RB];
            for (b, v) in qv.iter_mut().enumerate() {
                *v = S::load(qrow.add(b * l));
            }
            for (jj, accj) in acc.iter_mut().enumerate() {
                let kb = S::splat(*k.add(i * KT + j0 + jj));
                for b in 0..RB {
                    accj[b] = S::fma(kb, qv[b], accj[b]);
                }
            }
        }
        for (jj, accj) in acc.iter().enumerate() {
            for (b, v) in accj.iter().enumerate() {
                S::store(st.add((j0 + jj) * rp + r0 + b * l), *v);
            }
        }
    }
}

/// `acct[i][r] = acct[i][r] · alpha[r] + Σ_j v[j][i] · st[j][r]`: blocks of 2
/// row vectors × 8 (AVX-512) or 4 head dimensions in registers.
#[inline(always)]
unsafe fn pv_tile<S: Simd>(
    acct: *mut f32,
    rp: usize,
    alpha: *const f32,
    st: *const f32,
    v: *const f32,
    d: usize,
    n: usize,
) {
    let l = S::LANES;
    let nrv = rp / l;
    let mut rv = 0;
    unsafe {
        while rv < nrv {
            if rv + 2 <= nrv {
                pv_rows::<S, 2>(acct, rp, rv * l, alpha, st, v, d, n);
                rv += 2;
            } else {
                pv_rows::<S, 1>(acct, rp, rv * l, alpha, st, v, d, n);
                rv += 1;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_rows<S: Simd, const RB: usize>(
    acct: *mut f32,
    rp: usize,
    r0: usize,
    alpha: *const f32,
    st: *const f32,
    v: *const f32,
    d: usize,
    n: usize,
) {
    let mut i = 0;
    unsafe {
        if S::LANES >= 16 {
            while i + 8 <= d {
                pv_micro::<S, 8, RB>(acct, rp, r0, alpha, st, v, d, n, i);
                i += 8;
            }
        }
        while i + 4 <= d {
            pv_micro::<S, 4, RB>(acct, rp, r0, alpha, st, v, d, n, i);
            i += 4;
        }
        while i < d {
            pv_micro::<S, 1, RB>(acct, rp, r0, alpha, st, v, d, n, i);
            i += 1;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_micro<S: Simd, const DB: usize, const RB: usize>(
    acct: *mut f32,
    rp: usize,
    r0: usize,
    alpha: *const f32,
    st: *const f32,
    v: *const f32,
    d: usize,
    n: usize,
    i0: usize,
) {
    let l = S::LANES;
    unsafe {
        let mut a = [S::zero(); RB];
        for (b, ab) in a.iter_mut().enumerate() {
            *ab = S::load(alpha.add(r0 + b * l));
        }
        let mut acc = [[S::zero(); RB]; DB];
        for (ii, acci) in acc.iter_mut().enumerate() {
            for b in 0..RB {
                acci[b] = S::mul(S::load(acct.add((i0 + ii) * rp + r0 + b * l)), a[b]);
            }
        }
        for j in 0..n {
            let mut p = [S::zero(); RB];
            for (b, pb) in p.iter_mut().enumerate() {
                *pb = S::load(st.add(j * rp + r0 + b * l));
            }
            for (ii, acci) in acc.iter_mut().enumerate() {
                let vb = S::splat(*v.add(j * d + i0 + ii));
                for b in 0..RB {
                    acci[b] = S::fma(vb, p[b], acci[b]);
                }
            }
        }
        for (ii, acci) in acc.iter().enumerate() {
            for (b, x) in acci.iter().enumerate() {
                S::store(acct.add((i0 + ii) * rp + r0 + b * l), *x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::seq::{IndexedRandom, SliceRandom};
    use rand::{Rng, SeedableRng};

    fn levels() -> Vec<SimdLevel> {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect()
    }

    /// (q_len, ctx_len) of one sequence in a test batch.
    type SeqShape = (usize, usize);

    struct Case {
        head_dim: usize,
        n_heads: usize,
        n_kv: usize,
        block_size: usize,
        seqs: Vec<SeqShape>,
    }

    /// Plain causal GQA over contiguous per-sequence K/V, in f64.
    /// `k[p][kvh*d + i]` holds the cache's (rounded) values.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[Vec<f64>],
        v: &[Vec<f64>],
        n_heads: usize,
        n_kv: usize,
        d: usize,
        q_start: usize,
        q_len: usize,
        ctx_len: usize,
        scale: f64,
        window: Option<usize>,
        out: &mut [f64],
    ) {
        let g = n_heads / n_kv;
        for i in 0..q_len {
            let pos = ctx_len - q_len + i;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..n_heads {
                let kvh = h / g;
                let qr = &q[((q_start + i) * n_heads + h) * d..][..d];
                let scores: Vec<f64> = (lo..=pos)
                    .map(|p| {
                        let kr = &k[p][kvh * d..][..d];
                        qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum::<f64>() * scale
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let total: f64 = w.iter().sum();
                let o = &mut out[((q_start + i) * n_heads + h) * d..][..d];
                o.fill(0.0);
                for (p, wp) in w.iter().enumerate() {
                    for (oi, vi) in o.iter_mut().zip(&v[lo + p][kvh * d..][..d]) {
                        *oi += wp / total * vi;
                    }
                }
            }
        }
    }

    fn run_case<T: KvElem>(case: &Case, rng: &mut StdRng, shuffle_seqs: bool) {
        run_case_windowed::<T>(case, rng, shuffle_seqs, None)
    }

    fn run_case_windowed<T: KvElem>(
        case: &Case,
        rng: &mut StdRng,
        shuffle_seqs: bool,
        window: Option<usize>,
    ) {
        let (d, n_heads, n_kv, bs) = (case.head_dim, case.n_heads, case.n_kv, case.block_size);
        let blocks_needed: usize = case.seqs.iter().map(|&(_, c)| c.div_ceil(bs)).sum();
        let layout = KvLayout {
            num_blocks: blocks_needed + 5,
            block_size: bs,
            n_kv_heads: n_kv,
            head_dim: d,
        };
        // A shuffled pool: sequences get scattered, non-contiguous blocks.
        let mut free: Vec<u32> = (0..layout.num_blocks as u32).collect();
        free.shuffle(rng);
        // Poison so a read of an unwritten slot shows up as a wrong result.
        let mut k_cache = vec![T::from_f32(1e3); layout.elems()];
        let mut v_cache = vec![T::from_f32(-1e3); layout.elems()];
        let row = n_kv * d;
        let mut tables = Vec::new();
        let mut contig_k = Vec::new();
        let mut contig_v = Vec::new();
        for &(_, ctx) in &case.seqs {
            let table: Vec<u32> = free.drain(..ctx.div_ceil(bs)).collect();
            let k: Vec<f32> = (0..ctx * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v: Vec<f32> = (0..ctx * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let slots: Vec<u32> = (0..ctx)
                .map(|p| table[p / bs] * bs as u32 + (p % bs) as u32)
                .collect();
            write_kv(&layout, &mut k_cache, &mut v_cache, &k, &v, &slots);
            // The reference sees exactly the rounded values the cache holds.
            let round = |x: &[f32]| -> Vec<Vec<f64>> {
                x.chunks(row)
                    .map(|r| r.iter().map(|&a| T::from_f32(a).to_f32() as f64).collect())
                    .collect()
            };
            contig_k.push(round(&k));
            contig_v.push(round(&v));
            tables.push(table);
        }
        let n_tokens: usize = case.seqs.iter().map(|&(q, _)| q).sum();
        let q: Vec<f32> = (0..n_tokens * n_heads * d)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut seqs = Vec::new();
        let mut start = 0;
        for (i, &(q_len, ctx_len)) in case.seqs.iter().enumerate() {
            seqs.push(AttnSeq {
                q_start: start,
                q_len,
                ctx_len,
                block_table: &tables[i],
            });
            start += q_len;
        }
        let scale = 1.0 / (d as f32).sqrt();
        let mut want = vec![0.0f64; q.len()];
        for (i, s) in seqs.iter().enumerate() {
            reference(
                &q,
                &contig_k[i],
                &contig_v[i],
                n_heads,
                n_kv,
                d,
                s.q_start,
                s.q_len,
                s.ctx_len,
                scale as f64,
                window,
                &mut want,
            );
        }
        if shuffle_seqs {
            seqs.shuffle(rng);
        }
        for threads in [1usize, 3] {
            let pool = ThreadPool::new(threads);
            for level in levels() {
                let mut out = vec![f32::NAN; q.len()];
                paged_attention_at(
                    level, &pool, &layout, &k_cache, &v_cache, &q, n_heads, &seqs, scale, window,
                    &mut out,
                );
                for (idx, (&got, &w)) in out.iter().zip(&want).enumerate() {
                    let (tok, rest) = (idx / (n_heads * d), idx % (n_heads * d));
                    assert!(
                        (got as f64 - w).abs() <= 3e-5,
                        "{:?} {level:?} window={window:?} threads={threads} d={d} heads={n_heads}/{n_kv} bs={bs} seqs={:?}: \
                         token {tok} head {} dim {}: {got} vs {w}",
                        T::DTYPE,
                        case.seqs,
                        rest / d,
                        rest % d
                    );
                }
            }
        }
    }

    fn cases() -> Vec<Case> {
        let mut v = Vec::new();
        for &(head_dim, n_heads, n_kv) in &[
            (64usize, 9usize, 3usize),
            (32, 4, 4),
            (80, 8, 2),
            (64, 16, 1),
        ] {
            for &block_size in &[1usize, 4, 16, 32] {
                v.push(Case {
                    head_dim,
                    n_heads,
                    n_kv,
                    block_size,
                    seqs: vec![
                        (1, 1),   // first decode step
                        (1, 37),  // decode
                        (5, 5),   // short prefill
                        (2, 50),  // speculative-style short chunk
                        (3, 19),  // rows = 3 * group: straddles the kernel switch
                        (70, 70), // prefill: several wide tiles
                        (23, 90), // chunked prefill
                        (1, 64),  // decode at a block boundary
                    ],
                });
            }
        }
        v
    }

    #[test]
    fn paged_attention_matches_reference_f32() {
        let mut rng = StdRng::seed_from_u64(11);
        for (i, case) in cases().iter().enumerate() {
            run_case::<f32>(case, &mut rng, i % 3 == 0);
        }
    }

    #[test]
    fn paged_attention_matches_reference_f16() {
        let mut rng = StdRng::seed_from_u64(12);
        for (i, case) in cases().iter().enumerate() {
            run_case::<f16>(case, &mut rng, i % 3 == 1);
        }
    }

    #[test]
    fn paged_attention_matches_reference_bf16() {
        let mut rng = StdRng::seed_from_u64(13);
        for (i, case) in cases().iter().enumerate() {
            run_case::<bf16>(case, &mut rng, i % 3 == 2);
        }
    }

    #[test]
    fn a_sliding_window_matches_the_reference() {
        // Windows of one position, shorter than a chunk, a block and a
        // chunk exactly, and longer than some contexts.
        let mut rng = StdRng::seed_from_u64(15);
        for (i, case) in cases().iter().enumerate() {
            let window = [1usize, 5, 16, 32, 45][i % 5];
            match i % 3 {
                0 => run_case_windowed::<f32>(case, &mut rng, true, Some(window)),
                1 => run_case_windowed::<f16>(case, &mut rng, false, Some(window)),
                _ => run_case_windowed::<bf16>(case, &mut rng, true, Some(window)),
            }
        }
    }

    #[test]
    fn paged_attention_random_shapes() {
        let mut rng = StdRng::seed_from_u64(14);
        for _ in 0..12 {
            let &(head_dim, n_heads, n_kv) = [
                (32usize, 9usize, 3usize),
                (64, 4, 4),
                (80, 8, 2),
                (72, 6, 3),
                (128, 32, 8),
            ]
            .choose(&mut rng)
            .unwrap();
            let block_size = *[1usize, 4, 8, 16, 32, 64].choose(&mut rng).unwrap();
            let n = rng.random_range(1..6);
            let seqs = (0..n)
                .map(|_| {
                    let ctx = rng.random_range(1..160);
                    let q = if rng.random_bool(0.5) {
                        1
                    } else {
                        rng.random_range(1..=ctx)
                    };
                    (q, ctx)
                })
                .collect();
            let case = Case {
                head_dim,
                n_heads,
                n_kv,
                block_size,
                seqs,
            };
            match rng.random_range(0..3) {
                0 => run_case::<f32>(&case, &mut rng, true),
                1 => run_case::<f16>(&case, &mut rng, false),
                _ => run_case::<bf16>(&case, &mut rng, true),
            }
        }
    }

    #[test]
    fn large_scores_stay_finite() {
        // Scores in the hundreds: a softmax without max subtraction (or a
        // rescale bug in the online update) overflows here.
        let d = 64;
        let layout = KvLayout {
            num_blocks: 8,
            block_size: 16,
            n_kv_heads: 1,
            head_dim: d,
        };
        let mut kc = vec![0.0f32; layout.elems()];
        let mut vc = vec![0.0f32; layout.elems()];
        let ctx = 100;
        let k: Vec<f32> = (0..ctx * d)
            .map(|i| if i % d == 0 { (i / d) as f32 } else { 0.0 })
            .collect();
        let v: Vec<f32> = (0..ctx * d).map(|i| (i / d) as f32).collect();
        let table = [3u32, 1, 7, 0, 2, 6, 5];
        let slots: Vec<u32> = (0..ctx as u32)
            .map(|p| table[p as usize / 16] * 16 + p % 16)
            .collect();
        write_kv(&layout, &mut kc, &mut vc, &k, &v, &slots);
        let mut q = vec![0.0f32; 40 * d];
        for t in 0..40 {
            q[t * d] = 10.0;
        }
        let pool = ThreadPool::new(2);
        for level in levels() {
            let mut out = vec![0.0f32; q.len()];
            let seqs = [AttnSeq {
                q_start: 0,
                q_len: 40,
                ctx_len: ctx,
                block_table: &table,
            }];
            paged_attention_at(
                level, &pool, &layout, &kc, &vc, &q, 1, &seqs, 1.0, None, &mut out,
            );
            for t in 0..40 {
                // Score of position p is 10p: the last visible position wins.
                let pos = (ctx - 40 + t) as f32;
                let got = out[t * d];
                assert!(
                    (got - pos).abs() < 1e-3,
                    "{level:?} token {t}: {got} vs ~{pos}"
                );
            }
        }
    }

    #[test]
    fn write_kv_round_trips() {
        fn check<T: KvElem>() {
            let layout = KvLayout {
                num_blocks: 6,
                block_size: 4,
                n_kv_heads: 3,
                head_dim: 8,
            };
            let mut kc = vec![T::from_f32(0.0); layout.elems()];
            let mut vc = vec![T::from_f32(0.0); layout.elems()];
            let row = 3 * 8;
            let slots = [5u32, 23, 0, 14];
            let k: Vec<f32> = (0..slots.len() * row)
                .map(|i| i as f32 * 0.37 - 3.0)
                .collect();
            let v: Vec<f32> = (0..slots.len() * row)
                .map(|i| 7.0 - i as f32 * 0.11)
                .collect();
            write_kv(&layout, &mut kc, &mut vc, &k, &v, &slots);
            let mut written = 0;
            for (t, &slot) in slots.iter().enumerate() {
                let (b, off) = (slot as usize / 4, slot as usize % 4);
                for h in 0..3 {
                    for i in 0..8 {
                        // Slabs of 4 positions × 8 elements: V by position,
                        // K transposed.
                        let slab = (b * 3 + h) * 4 * 8;
                        let src = t * row + h * 8 + i;
                        assert_eq!(
                            kc[slab + i * 4 + off].to_f32(),
                            T::from_f32(k[src]).to_f32()
                        );
                        assert_eq!(
                            vc[slab + off * 8 + i].to_f32(),
                            T::from_f32(v[src]).to_f32()
                        );
                        written += 1;
                    }
                }
            }
            // Nothing else was touched (k values are never exactly 0 here).
            let nonzero = kc.iter().filter(|x| x.to_f32() != 0.0).count();
            assert_eq!(nonzero, written);
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
        assert_eq!(f32::DTYPE, KvDtype::F32);
        assert_eq!(f16::DTYPE, KvDtype::F16);
        assert_eq!(bf16::DTYPE, KvDtype::Bf16);
    }

    #[test]
    fn rows_outside_sequences_are_untouched() {
        let layout = KvLayout {
            num_blocks: 2,
            block_size: 4,
            n_kv_heads: 1,
            head_dim: 16,
        };
        let kc = vec![0.5f32; layout.elems()];
        let vc = vec![0.25f32; layout.elems()];
        let q = vec![1.0f32; 3 * 16];
        let mut out = vec![9.0f32; 3 * 16];
        let table = [1u32];
        let seqs = [AttnSeq {
            q_start: 1,
            q_len: 1,
            ctx_len: 3,
            block_table: &table,
        }];
        paged_attention(
            &ThreadPool::new(2),
            &layout,
            &kc,
            &vc,
            &q,
            1,
            &seqs,
            0.25,
            None,
            &mut out,
        );
        assert!(out[..16].iter().chain(&out[32..]).all(|&x| x == 9.0));
        assert!(out[16..32].iter().all(|&x| (x - 0.25).abs() < 1e-6));
    }

    #[test]
    #[should_panic(expected = "overlap")]
    fn overlapping_sequences_panic() {
        let layout = KvLayout {
            num_blocks: 2,
            block_size: 4,
            n_kv_heads: 1,
            head_dim: 16,
        };
        let kc = vec![0.0f32; layout.elems()];
        let q = vec![0.0f32; 3 * 16];
        let mut out = vec![0.0f32; 3 * 16];
        let table = [0u32];
        let seqs = [
            AttnSeq {
                q_start: 1,
                q_len: 2,
                ctx_len: 2,
                block_table: &table,
            },
            AttnSeq {
                q_start: 0,
                q_len: 2,
                ctx_len: 2,
                block_table: &table,
            },
        ];
        paged_attention(
            &ThreadPool::new(2),
            &layout,
            &kc,
            &kc,
            &q,
            1,
            &seqs,
            1.0,
            None,
            &mut out,
        );
    }

    /// One prompt's K/V in a shuffled pool, plus a second sequence's for
    /// batch mates, for the invariance tests.
    struct Prompt<T> {
        layout: KvLayout,
        k: Vec<T>,
        v: Vec<T>,
        table: Vec<u32>,
        mate_table: Vec<u32>,
        q: Vec<f32>,
        n_heads: usize,
    }

    const PROMPT_LEN: usize = 150;
    const MATE_LEN: usize = 45;

    fn prompt<T: KvElem>(
        rng: &mut StdRng,
        head_dim: usize,
        n_heads: usize,
        n_kv: usize,
        block_size: usize,
    ) -> Prompt<T> {
        let blocks = PROMPT_LEN.div_ceil(block_size) + MATE_LEN.div_ceil(block_size);
        let layout = KvLayout {
            num_blocks: blocks + 3,
            block_size,
            n_kv_heads: n_kv,
            head_dim,
        };
        let mut free: Vec<u32> = (0..layout.num_blocks as u32).collect();
        free.shuffle(rng);
        let table: Vec<u32> = free.drain(..PROMPT_LEN.div_ceil(block_size)).collect();
        let mate_table: Vec<u32> = free.drain(..MATE_LEN.div_ceil(block_size)).collect();
        let mut k = vec![T::from_f32(0.0); layout.elems()];
        let mut v = vec![T::from_f32(0.0); layout.elems()];
        let row = n_kv * head_dim;
        for (t, len) in [(&table, PROMPT_LEN), (&mate_table, MATE_LEN)] {
            // Keys with a drift over the positions, so the running max moves
            // in later chunks and the online rescale is exercised.
            let kv: Vec<f32> = (0..len * row)
                .map(|i| rng.random_range(-1.0..1.0) + (i / row) as f32 * 0.01)
                .collect();
            let vv: Vec<f32> = (0..len * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let slots: Vec<u32> = (0..len)
                .map(|p| t[p / block_size] * block_size as u32 + (p % block_size) as u32)
                .collect();
            write_kv(&layout, &mut k, &mut v, &kv, &vv, &slots);
        }
        // Large enough queries that scores spread over several units.
        let q = (0..PROMPT_LEN * n_heads * head_dim)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        Prompt {
            layout,
            k,
            v,
            table,
            mate_table,
            q,
            n_heads,
        }
    }

    /// The prompt's output rows computed in chunks of `chunk` queries (each
    /// call attending to the cache up to the chunk's end), each call with a
    /// decode row and a short chunk of another sequence around it.
    fn chunked<T: KvElem>(
        p: &Prompt<T>,
        level: SimdLevel,
        pool: &ThreadPool,
        chunk: usize,
        window: Option<usize>,
        rng: &mut StdRng,
    ) -> Vec<f32> {
        let w = p.n_heads * p.layout.head_dim;
        let scale = 1.0 / (p.layout.head_dim as f32).sqrt();
        let mut out = vec![f32::NAN; PROMPT_LEN * w];
        let mut start = 0;
        while start < PROMPT_LEN {
            let len = chunk.min(PROMPT_LEN - start);
            let mate_ctx = rng.random_range(3..=MATE_LEN);
            let mate_q = rng.random_range(1..=3);
            // Rows: [decode mate][our chunk][mate chunk].
            let mut qb: Vec<f32> = (0..w).map(|_| rng.random_range(-3.0..3.0)).collect();
            qb.extend_from_slice(&p.q[start * w..(start + len) * w]);
            qb.extend((0..mate_q * w).map(|_| rng.random_range(-3.0..3.0)));
            let seqs = [
                AttnSeq {
                    q_start: 0,
                    q_len: 1,
                    ctx_len: mate_ctx,
                    block_table: &p.mate_table,
                },
                AttnSeq {
                    q_start: 1,
                    q_len: len,
                    ctx_len: start + len,
                    block_table: &p.table,
                },
                AttnSeq {
                    q_start: 1 + len,
                    q_len: mate_q,
                    ctx_len: MATE_LEN,
                    block_table: &p.mate_table,
                },
            ];
            let mut ob = vec![f32::NAN; qb.len()];
            paged_attention_at(
                level, pool, &p.layout, &p.k, &p.v, &qb, p.n_heads, &seqs, scale, window, &mut ob,
            );
            out[start * w..(start + len) * w].copy_from_slice(&ob[w..(1 + len) * w]);
            start += len;
        }
        out
    }

    /// A query row's output is bitwise the same whatever tile it is
    /// computed in: the prompt in chunks of 1 (decode), 2, 5, 17, 64 and all
    /// 150 queries at once, on 1 or 3 threads, with batch mates.
    fn check_tile_invariance<T: KvElem>(seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        // (head_dim, n_heads, n_kv, block_size): group sizes 3, 4, 1, 2 and
        // 7, head dims with and without a partial vector, an f32 cache read
        // in place in chunks of 8 (block size 8), one gathered (bs 1), and
        // decode reading the cache in place with and without a partial
        // vector of values (bs 16 and 32).
        for &(d, h, kv, bs) in &[
            (64usize, 9usize, 3usize, 16usize),
            (72, 8, 2, 8),
            (40, 4, 4, 1),
            (40, 4, 2, 16),
            (128, 14, 2, 32),
        ] {
            let p = prompt::<T>(&mut rng, d, h, kv, bs);
            // Full attention, and windows below and above a chunk.
            for (level, window) in levels()
                .into_iter()
                .flat_map(|l| [(l, None), (l, Some(20)), (l, Some(71))])
            {
                let want = chunked(&p, level, &ThreadPool::new(1), PROMPT_LEN, window, &mut rng);
                assert!(want.iter().all(|x| x.is_finite()));
                for threads in [1usize, 3] {
                    let pool = ThreadPool::new(threads);
                    for chunk in [1usize, 2, 5, 17, 64, PROMPT_LEN] {
                        let got = chunked(&p, level, &pool, chunk, window, &mut rng);
                        let w = h * d;
                        if let Some(i) =
                            (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits())
                        {
                            panic!(
                                "{:?} {level:?} window={window:?} d={d} heads={h}/{kv} bs={bs} threads={threads}: \
                                 in chunks of {chunk}, position {} head {} dim {} is {} \
                                 but {} in one prefill",
                                T::DTYPE,
                                i / w,
                                i % w / d,
                                i % d,
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_tile_f32() {
        check_tile_invariance::<f32>(21);
    }

    #[test]
    fn rows_do_not_depend_on_the_tile_f16() {
        check_tile_invariance::<f16>(22);
    }

    #[test]
    fn rows_do_not_depend_on_the_tile_bf16() {
        check_tile_invariance::<bf16>(23);
    }
}
