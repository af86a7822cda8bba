//! The register-blocked inner loops of both kernels: scores (`Q·Kᵀ`) and
//! `P·V`, with keys in the lanes for the small kernel ([`qk_keys`],
//! [`pv_group`]) and rows in the lanes for the wide one ([`qk_tile`],
//! [`pv_tile`]).

use super::plan::KT;
use crate::ops::simd::Simd;

/// Scores `sc[r][j] = Σ_i qs[r][i] · k_j[i]` for all `rows` and the keys
/// `j` of `n` rounded up to whole vectors: keys in the lanes, each lane one
/// FMA per head dimension in order (the wide kernel's sequence).
/// `keys(v, i)` returns element `i` of the keys of vector `v` (keys
/// `v · LANES ..`), from the transposed scratch or straight from the cache.
#[inline(always)]
pub(super) unsafe fn qk_keys<S: Simd>(
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
pub(super) unsafe fn qk_direct<S: Simd>(
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

/// For each of `R` rows that see the same `n` value rows (the q heads of one
/// query in a GQA group): `acc = acc * alpha + Σ_j p[j] · v_j`, row `r`'s
/// accumulator at `acc + r·d` and its weights at `p + r·ps`, four vectors
/// of each accumulator held in registers at a time. `vals(j, i)` returns
/// elements `i .. i + LANES` of value row `j` and `val(j, i)` element `i`
/// alone (for a head dimension that is not a whole number of vectors).
/// Each value vector is loaded (and widened from f16/bf16) once for all `R`
/// rows, where row by row it was loaded once per row (1B Llama shapes, 4 q
/// heads per KV head); every row gets the same operations in the same
/// order whatever `R`, so its bits do not depend on the grouping.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn pv_group<S: Simd, const R: usize>(
    acc: *mut f32,
    alpha: &[f32; R],
    p: *const f32,
    ps: usize,
    vals: &impl Fn(usize, usize) -> S::V,
    val: &impl Fn(usize, usize) -> f32,
    n: usize,
    d: usize,
) {
    let l = S::LANES;
    let nv = d - d % l;
    unsafe {
        let mut i = 0;
        while i + 4 * l <= nv {
            let mut a = [[S::zero(); 4]; R];
            for (r, ar) in a.iter_mut().enumerate() {
                let av = S::splat(alpha[r]);
                for (k, ak) in ar.iter_mut().enumerate() {
                    *ak = S::mul(S::load(acc.add(r * d + i + k * l)), av);
                }
            }
            for j in 0..n {
                let v: [S::V; 4] = std::array::from_fn(|k| vals(j, i + k * l));
                for (r, ar) in a.iter_mut().enumerate() {
                    let pj = S::splat(*p.add(r * ps + j));
                    for (ak, vk) in ar.iter_mut().zip(&v) {
                        *ak = S::fma(pj, *vk, *ak);
                    }
                }
            }
            for (r, ar) in a.iter().enumerate() {
                for (k, ak) in ar.iter().enumerate() {
                    S::store(acc.add(r * d + i + k * l), *ak);
                }
            }
            i += 4 * l;
        }
        for r in 0..R {
            let (acc, alpha, p) = (acc.add(r * d), alpha[r], p.add(r * ps));
            let av = S::splat(alpha);
            let mut i = i;
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
}

/// `st[j][r] = Σ_i qt[i][r] · kt[i][j]` for `j < n`, all `rp` rows: blocks
/// of 2 row vectors × 8 (AVX-512) or 4 keys, accumulated in registers.
#[inline(always)]
pub(super) unsafe fn qk_tile<S: Simd>(
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
pub(super) unsafe fn pv_tile<S: Simd>(
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
