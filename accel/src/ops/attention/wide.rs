//! The wide kernel: many rows (prefill), rows in the lanes.

use super::micro::{pv_tile, qk_tile};
use super::plan::{Tile, KT, MAX_HEAD_DIM, WIDE_ROWS};
use super::sink_inv;
use crate::ops::simd::Simd;

/// The wide kernel: rows in the lanes (see the module docs). Layouts, with
/// `rp` = rows rounded up to whole vectors: `qt[d][rp]` (scaled, transposed
/// queries), `acct[d][rp]`, `st[KT][rp]` (scores, then probabilities).
#[inline(always)]
pub(super) unsafe fn wide_tile<S: Simd>(t: &Tile<'_, '_>) {
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
            let head = t.kvh * g + r % g;
            let inv = sink_inv(*m.add(r), *lsum.add(r), c.sinks.map(|s| s[head]));
            let dst = c.out.0.add(c.offset(token0 + r / g, head));
            for i in 0..d {
                *dst.add(i) = *acct.add(i * rp + r) * inv;
            }
        }
    }
}
