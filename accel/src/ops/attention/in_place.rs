//! How the small kernel reads a chunk straight from the cache, widening
//! as it loads ([`Reader`]), when every vector of keys lies in one block.

use super::kv::KvView;
use super::micro::{pv_group, qk_keys};
use super::plan::{Ctx, KT};
use crate::ops::simd::{Scalar, Simd};

/// How the small kernel reads one cache element type in place.
pub(super) trait Widen {
    /// The cache's storage type.
    type Raw: Copy;
    /// `S::LANES` elements at `p`, widened to f32.
    unsafe fn load<S: Simd>(p: *const Self::Raw) -> S::V;
}

pub(super) struct FromF32;
pub(super) struct FromF16;
pub(super) struct FromBf16;

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
pub(super) struct ChunkAt {
    /// Element 0 of the keys of vector `v` (their element `i` is `i · bs`
    /// further: K slabs are transposed).
    kvec: [usize; KT],
    /// Value row `j`.
    vrow: [usize; KT],
}

impl ChunkAt {
    /// No chunk (the scratch path).
    pub(super) const EMPTY: ChunkAt = ChunkAt {
        kvec: [0; KT],
        vrow: [0; KT],
    };

    /// Offsets for positions `start..start + n` of KV head `kvh`.
    #[inline(always)]
    pub(super) fn new(
        c: &Ctx<'_>,
        table: &[u32],
        kvh: usize,
        start: usize,
        n: usize,
        lanes: usize,
    ) -> Self {
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
pub(super) struct InPlace<'a, W: Widen> {
    k: *const W::Raw,
    v: *const W::Raw,
    at: &'a ChunkAt,
    bs: usize,
}

/// Where the small kernel reads a chunk from: in place, by cache type, or
/// from the scratch it was gathered into.
pub(super) enum Reader<'a> {
    F32(InPlace<'a, FromF32>),
    F16(InPlace<'a, FromF16>),
    Bf16(InPlace<'a, FromBf16>),
    Scratch,
}

impl<'a> Reader<'a> {
    #[inline(always)]
    pub(super) fn new(c: &Ctx<'_>, at: &'a ChunkAt, in_place: bool) -> Reader<'a> {
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
    pub(super) unsafe fn scores<S: Simd>(
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

    /// [`pv_group`] for the first `n` value rows of a chunk.
    #[inline(always)]
    pub(super) unsafe fn accumulate<S: Simd, const R: usize>(
        &self,
        acc: *mut f32,
        alpha: &[f32; R],
        p: *const f32,
        ps: usize,
        n: usize,
        d: usize,
    ) {
        let vals = |j: usize, i: usize| unsafe { W::load::<S>(self.v.add(self.at.vrow[j] + i)) };
        let val =
            |j: usize, i: usize| unsafe { W::load::<Scalar>(self.v.add(self.at.vrow[j] + i)) };
        unsafe { pv_group::<S, R>(acc, alpha, p, ps, &vals, &val, n, d) }
    }
}
