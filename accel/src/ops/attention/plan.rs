//! The plan of a [`paged_attention`](super::paged_attention) call: the
//! sizes that bound a tile, the validated context ([`Ctx`]) shared by the
//! tasks, how sequences split into tasks ([`Tile`]), and where each chunk
//! of the cache is read from.

use super::kv::KvView;
use crate::ops::simd::{prefetch, Simd};

/// Largest supported head dimension (sizes the stack scratch).
pub const MAX_HEAD_DIM: usize = 256;
/// Cache positions processed per online-softmax step. A multiple of every
/// lane count (16), so a chunk's scores fill whole vectors.
pub(super) const KT: usize = 32;
/// Most rows (query × q head) in a wide tile. 64 rows × 256 dims of
/// transposed queries plus as many accumulators is 128 KiB of stack, and a
/// tile this tall reads each K/V chunk once for 64 rows.
pub(super) const WIDE_ROWS: usize = 64;
/// Most rows in a small tile: small tiles are used below one vector of rows,
/// at most 16 lanes.
pub(super) const SMALL_ROWS: usize = 16;

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

/// `out`'s base pointer, shared by the tasks.
#[derive(Clone, Copy)]
pub(super) struct SyncPtr(pub(super) *mut f32);

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
pub(super) struct Ctx<'a> {
    pub(super) d: usize,
    pub(super) bs: usize,
    pub(super) n_kv: usize,
    pub(super) group: usize,
    pub(super) n_heads: usize,
    pub(super) wide_min_rows: usize,
    pub(super) k: KvView<'a>,
    pub(super) v: KvView<'a>,
    pub(super) q: &'a [f32],
    pub(super) out: SyncPtr,
    pub(super) scale: f32,
    /// A sink logit per q head in each row's softmax denominator.
    pub(super) sinks: Option<&'a [f32]>,
    /// Positions a query sees, itself included (`usize::MAX`: all).
    pub(super) window: usize,
    /// Chunk boundaries for every cache type: a windowed tile starts at a
    /// multiple of this.
    pub(super) window_grid: usize,
    pub(super) seqs: &'a [AttnSeq<'a>],
}

pub(super) fn lcm(a: usize, b: usize) -> usize {
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
pub(super) struct Tile<'c, 'a> {
    pub(super) ctx: &'c Ctx<'a>,
    pub(super) seq: &'c AttnSeq<'a>,
    pub(super) kvh: usize,
    pub(super) q0: usize,
    pub(super) nq: usize,
}

impl Ctx<'_> {
    /// Query tiles a sequence of `q_len` new tokens is split into: one if all
    /// its rows fit the small kernel, else tiles of at most `WIDE_ROWS` rows,
    /// evenly sized.
    pub(super) fn n_tiles(&self, q_len: usize) -> usize {
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
    pub(super) fn task(&self, mut t: usize) -> Tile<'_, '_> {
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
    pub(super) fn window_start(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.window)
    }

    /// Where a tile whose first query sits at `first` starts reading the
    /// cache: 0 without a window, else the chunk boundary at or below the
    /// first query's window (see "Sliding windows" in the module docs).
    #[inline(always)]
    pub(super) fn first_chunk(&self, first: usize) -> usize {
        let lo = self.window_start(first);
        lo - lo % self.window_grid
    }

    /// Offset of `(token, q head)` in `q` / `out`.
    #[inline(always)]
    pub(super) fn offset(&self, token: usize, head: usize) -> usize {
        (token * self.n_heads + head) * self.d
    }

    /// Length of the chunk starting at position `c0` (at most `KT`, up to
    /// `n_keys`). An f32 cache with blocks of 8 or more is read in place, so
    /// its chunks stop at block boundaries; other caches are gathered, so
    /// chunks may span blocks.
    #[inline(always)]
    pub(super) fn chunk_len(&self, c0: usize, n_keys: usize) -> usize {
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
    pub(super) fn prefetch_chunk(&self, table: &[u32], kvh: usize, start: usize, n: usize) {
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
                prefetch(a as *const u8);
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
    pub(super) unsafe fn load_values<S: Simd>(
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
    pub(super) unsafe fn load_keys<S: Simd>(
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
