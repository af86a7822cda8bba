//! The small kernel: few rows (decode, short chunks), keys in the lanes.

use super::in_place::{ChunkAt, Reader};
use super::micro::{pv_group, qk_direct, qk_keys};
use super::plan::{Tile, KT, MAX_HEAD_DIM, SMALL_ROWS};
use super::sink_inv;
use crate::ops::simd::Simd;

/// The small kernel (see the module docs). It computes exactly the wide
/// kernel's arithmetic per row (see "Batch invariance" there), laid out for
/// few rows: scores with the chunk's keys in the lanes (K is stored
/// transposed), `P·V` with head dimensions in the lanes.
// Row loops index several per-row arrays (`pos`, `vis`, `m`, ...) at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn small_tile<S: Simd>(t: &Tile<'_, '_>) {
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
            // Rows that see the same keys (a query's q heads) accumulate
            // together, up to 4 (2 with AVX2's 16 registers), so that each
            // value row is read and widened once for all of them. A row
            // with nothing visible has alpha 1 and p 0: its accumulator
            // would come out unchanged, so it is skipped.
            let most = if l >= 16 { 4 } else { 2 };
            let mut r = 0;
            while r < rows {
                let nv = vis[r];
                let mut k = 1;
                while k < most && r + k < rows && vis[r + k] == nv {
                    k += 1;
                }
                if nv > 0 {
                    let (a, p) = (acc.add(r * d), sc.add(r * KT));
                    let al = |q: usize| alpha[r + q];
                    match k {
                        1 => pv_rows::<S, 1>(&reader, a, &[al(0)], p, nv, d, vp),
                        2 => pv_rows::<S, 2>(&reader, a, &std::array::from_fn(al), p, nv, d, vp),
                        3 => pv_rows::<S, 3>(&reader, a, &std::array::from_fn(al), p, nv, d, vp),
                        _ => pv_rows::<S, 4>(&reader, a, &std::array::from_fn(al), p, nv, d, vp),
                    }
                }
                r += k;
            }
            c0 += n;
        }
        for r in 0..rows {
            // Every row sees its own position, so its sum is positive.
            let head = t.kvh * g + r % g;
            let inv = sink_inv(m[r], lsum[r], c.sinks.map(|s| s[head]));
            let dst = c.out.0.add(c.offset(token0 + r / g, head));
            for i in 0..d {
                *dst.add(i) = *acc.add(r * d + i) * inv;
            }
        }
    }
}

/// `R` rows' `P·V` accumulation (see [`pv_group`]) through whichever
/// reader holds the chunk's values.
#[inline(always)]
unsafe fn pv_rows<S: Simd, const R: usize>(
    reader: &Reader<'_>,
    acc: *mut f32,
    alpha: &[f32; R],
    p: *const f32,
    n: usize,
    d: usize,
    vp: *const f32,
) {
    unsafe {
        match reader {
            Reader::F32(r) => r.accumulate::<S, R>(acc, alpha, p, KT, n, d),
            Reader::F16(r) => r.accumulate::<S, R>(acc, alpha, p, KT, n, d),
            Reader::Bf16(r) => r.accumulate::<S, R>(acc, alpha, p, KT, n, d),
            Reader::Scratch => {
                let vals = |j: usize, i: usize| S::load(vp.add(j * d + i));
                let val = |j: usize, i: usize| *vp.add(j * d + i);
                pv_group::<S, R>(acc, alpha, p, KT, &vals, &val, n, d)
            }
        }
    }
}
