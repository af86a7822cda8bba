//! The operations of encoder models (BERT and its kin) that decoders do not
//! use: LayerNorm with a bias, GELU (the erf form) and tanh, attention in
//! both directions within each sequence, and the pooling of a sequence's
//! rows into one (CLS, mean or last token).
//!
//! Encoder rows are prefill-only: each sequence's whole prompt is in the
//! step, its K and V are read from the step's own rows and nothing is kept
//! after it. Every function here has a naive reference in the tests below.

use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;

/// An element-wise activation ([`crate::Backend::activation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · Φ(x) = x/2 · (1 + erf(x/√2))`: transformers' `gelu`.
    GeluErf,
    /// `tanh(x)`: BERT's pooler.
    Tanh,
}

/// How a sequence's rows become one ([`crate::Backend::pool_seqs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqPooling {
    /// The first row (`[CLS]`).
    First,
    /// The mean of every row.
    Mean,
    /// The last row.
    Last,
}

/// The bit a packed token id's token type starts at: an encoder's prompt
/// carries `id | token_type << TOKEN_TYPE_SHIFT` (vLLM's packing), so the
/// type of each token travels with it through the scheduler untouched.
pub const TOKEN_TYPE_SHIFT: u32 = 30;

/// The id and the token type of a packed token (see [`TOKEN_TYPE_SHIFT`]).
pub fn unpack_token(t: u32) -> (u32, u32) {
    (t & ((1 << TOKEN_TYPE_SHIFT) - 1), t >> TOKEN_TYPE_SHIFT)
}

/// LayerNorm of each row of `x` (rows of `weight.len()`): `(x - mean) /
/// sqrt(var + eps) · weight + bias`, the biased variance as torch computes
/// it. Mean and variance are accumulated in f64.
///
/// # Panics
/// If the lengths disagree.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(
        d > 0 && bias.len() == d,
        "layer_norm: weight and bias differ"
    );
    assert!(
        x.len() == out.len() && x.len().is_multiple_of(d),
        "layer_norm: x and out are not whole rows of {d}"
    );
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
        let var = xr
            .iter()
            .map(|&v| {
                let c = f64::from(v) - mean;
                c * c
            })
            .sum::<f64>()
            / d as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for ((o, &v), (&w, &b)) in or.iter_mut().zip(xr).zip(weight.iter().zip(bias)) {
            *o = ((f64::from(v) - mean) * inv) as f32 * w + b;
        }
    }
}

/// Applies `act` to every element of `x`, at the detected SIMD level.
pub fn activation_inplace(x: &mut [f32], act: Activation) {
    activation_at(simd_level(), x, act)
}

/// [`activation_inplace`] at an explicit SIMD level (tests cover every
/// level).
pub(crate) fn activation_at(level: SimdLevel, x: &mut [f32], act: Activation) {
    check_level(level);
    match act {
        // SAFETY: `check_level` confirmed the CPU supports `level`.
        Activation::GeluErf => unsafe { dispatch(level, Gelu { x }) },
        Activation::Tanh => {
            for v in x {
                *v = v.tanh();
            }
        }
    }
}

/// A gated linear unit: `out[r][j] = act(x[r][j]) · x[r][ffn + j]` for
/// `x: [rows, 2·ffn]` (each row `[input (ffn) | gate (ffn)]`, the fused
/// projection's output) and `out: [rows, ffn]`: ModernBERT's MLP, whose
/// `Wi` output splits into the activated input and its gate.
///
/// # Panics
/// If the lengths do not describe the same number of rows.
pub fn act_mul(x: &[f32], ffn: usize, act: Activation, out: &mut [f32]) {
    assert!(ffn > 0, "act_mul: ffn must be positive");
    assert!(
        x.len() == 2 * out.len() && out.len().is_multiple_of(ffn),
        "act_mul: x is not twice out in whole rows of {ffn}"
    );
    for (xr, or) in x.chunks_exact(2 * ffn).zip(out.chunks_exact_mut(ffn)) {
        let (input, gate) = xr.split_at(ffn);
        or.copy_from_slice(input);
        activation_inplace(or, act);
        for (o, &g) in or.iter_mut().zip(gate) {
            *o *= g;
        }
    }
}

/// GELU, `x/2 · (1 + erf(x/√2))`, over whole vectors then a scalar tail
/// that runs the same code one lane wide.
struct Gelu<'a> {
    x: &'a mut [f32],
}

impl Kernel for Gelu<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let l = S::LANES;
        let n = self.x.len();
        let p = self.x.as_mut_ptr();
        let mut i = 0;
        // SAFETY: i + l <= n.
        unsafe {
            while i + l <= n {
                S::store(p.add(i), gelu_erf::<S>(S::load(p.add(i))));
                i += l;
            }
        }
        for v in &mut self.x[i..] {
            // SAFETY: Scalar needs no instruction set.
            *v = unsafe { gelu_erf::<super::simd::Scalar>(*v) };
        }
    }
}

/// `x/2 · (1 + erf(x/√2))` lane-wise, with erf as FreeBSD's `s_erff.c`
/// (the scalar `erff` this replaced) computes it: a rational approximation
/// of `erf(a)/a - 1` below 0.84375, of `erf(a) - erx` below 1.25, and of
/// `log(a · erfc(a)) + a² + 0.5625` in two pieces below 6 (with `exp`
/// taken of `-a² - 0.5625 + R/S` as one argument, `-a²` exact by FMA, rather
/// than split at a truncated `a`); 1 from 6 on. Every branch is computed for
/// every lane and the lane's own one selected. Within about 1e-7 of the
/// exact value (the test checks 2e-7 · max(1, |x|) against an f64
/// integration of the normal density).
// The coefficients as s_erff.c prints them (each rounds to its f32).
#[allow(clippy::excessive_precision)]
#[inline(always)]
unsafe fn gelu_erf<S: Simd>(x: S::V) -> S::V {
    let c = |v: f32| unsafe { S::splat(v) };
    // Horner's rule: coefficients from the constant term up.
    let poly = |z: S::V, k: &[f32]| unsafe {
        let mut acc = S::splat(k[k.len() - 1]);
        for &ki in k[..k.len() - 1].iter().rev() {
            acc = S::fma(acc, z, S::splat(ki));
        }
        acc
    };
    unsafe {
        let u = S::mul(x, c(std::f32::consts::FRAC_1_SQRT_2));
        let a = S::abs(u);
        let one = c(1.0);
        // |u| < 0.84375: erf(a) = a + a · P(a²)/Q(a²).
        let z = S::mul(a, a);
        let r = poly(
            z,
            &[
                1.2837916613e-01,
                -3.2504209876e-01,
                -2.8481749818e-02,
                -5.7702702470e-03,
                -2.3763017452e-05,
            ],
        );
        let q = poly(
            z,
            &[
                1.0,
                3.9791721106e-01,
                6.5022252500e-02,
                5.0813062117e-03,
                1.3249473704e-04,
                -3.9602282413e-06,
            ],
        );
        let y_small = S::fma(a, S::div(r, q), a);
        // |u| < 1.25: erf(a) = erx + P(a - 1)/Q(a - 1).
        let s1 = S::sub(a, one);
        let p = poly(
            s1,
            &[
                -2.3621185683e-03,
                4.1485610604e-01,
                -3.7220788002e-01,
                3.1834661961e-01,
                -1.1089469492e-01,
                3.5478305072e-02,
                -2.1663755178e-03,
            ],
        );
        let q = poly(
            s1,
            &[
                1.0,
                1.0642088205e-01,
                5.4039794207e-01,
                7.1828655899e-02,
                1.2617121637e-01,
                1.3637083583e-02,
                1.1984500103e-02,
            ],
        );
        let y_mid = S::add(c(8.4506291151e-01), S::div(p, q));
        // |u| < 6: erf(a) = 1 - exp(-a² - 0.5625 + R(1/a²)/S(1/a²)) / a.
        let s2 = S::div(one, z);
        let ra = poly(
            s2,
            &[
                -9.8649440333e-03,
                -6.9385856390e-01,
                -1.0558626175e+01,
                -6.2375331879e+01,
                -1.6239666748e+02,
                -1.8460508728e+02,
                -8.1287437439e+01,
                -9.8143291473e+00,
            ],
        );
        let sa = poly(
            s2,
            &[
                1.0,
                1.9651271820e+01,
                1.3765776062e+02,
                4.3456588745e+02,
                6.4538726807e+02,
                4.2900814819e+02,
                1.0863500214e+02,
                6.5702495575e+00,
                -6.0424413532e-02,
            ],
        );
        let rb = poly(
            s2,
            &[
                -9.8649431020e-03,
                -7.9928326607e-01,
                -1.7757955551e+01,
                -1.6063638306e+02,
                -6.3756646729e+02,
                -1.0250950928e+03,
                -4.8351919556e+02,
            ],
        );
        let sb = poly(
            s2,
            &[
                1.0,
                3.0338060379e+01,
                3.2579251099e+02,
                1.5367296143e+03,
                3.1998581543e+03,
                2.5530502930e+03,
                4.7452853394e+02,
                -2.2440952301e+01,
            ],
        );
        let near = c(f32::from_bits(0x4036db6d)); // 1/0.35
        let rs = S::select_lt(a, near, S::div(ra, sa), S::div(rb, sb));
        let e = S::exp(S::add(S::fma(S::sub(S::zero(), a), a, c(-0.5625)), rs));
        let y_far = S::sub(one, S::div(e, a));
        let y = S::select_lt(
            a,
            c(0.84375),
            y_small,
            S::select_lt(a, c(1.25), y_mid, S::select_lt(a, c(6.0), y_far, one)),
        );
        let erf = S::select_lt(u, S::zero(), S::sub(S::zero(), y), y);
        S::mul(S::mul(c(0.5), x), S::add(one, erf))
    }
}

/// One sequence of an encoder step: rows `start..start + len` of the
/// step's q, k and v.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderSeq {
    pub start: usize,
    pub len: usize,
}

/// Attention in both directions within each sequence: every row of `q`
/// (`[tokens, n_heads · head_dim]`) attends over every row of its own
/// sequence in `k` and `v` (`[tokens, n_kv_heads · head_dim]`; query head
/// `h` reads key head `h / (n_heads / n_kv_heads)`), scores scaled by
/// `scale`, into `out` (`[tokens, n_heads · head_dim]`). Rows outside every
/// sequence are left alone. Spread over `pool` by (sequence, head).
///
/// Each task copies its head's keys transposed (`[head_dim][len]`) and its
/// values (`[len][head_dim]`), both zero-padded to whole vectors, then runs
/// tiles of up to 4 query rows as two small matrix products with the SIMD
/// lanes along keys (`Q·Kᵀ`: a broadcast q element against a vector of
/// keys) and along the head dimension (`P·V`), the softmax between them
/// lane-wise. Padded keys get a score of `-inf`, so their weight is exactly
/// 0. A row's result is a function of its q row and its sequence's k and v
/// alone (not of the tile, the other sequences or the thread count).
///
/// # Panics
/// If the shapes disagree or a sequence lies past the buffers.
#[allow(clippy::too_many_arguments)]
pub fn bidirectional_attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    seqs: &[EncoderSeq],
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    bidirectional_attention_at(
        simd_level(),
        pool,
        q,
        k,
        v,
        n_heads,
        n_kv_heads,
        head_dim,
        seqs,
        scale,
        window,
        out,
    )
}

/// [`bidirectional_attention`] at an explicit SIMD level (tests cover
/// every level).
#[allow(clippy::too_many_arguments)]
pub(crate) fn bidirectional_attention_at(
    level: SimdLevel,
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    seqs: &[EncoderSeq],
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    check_level(level);
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "bidirectional_attention: {n_heads} query heads over {n_kv_heads} key heads"
    );
    assert!(head_dim > 0, "bidirectional_attention: head_dim is 0");
    let (qw, kw) = (n_heads * head_dim, n_kv_heads * head_dim);
    let tokens = seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0);
    assert!(
        q.len() >= tokens * qw
            && out.len() >= tokens * qw
            && k.len() >= tokens * kw
            && v.len() >= tokens * kw,
        "bidirectional_attention: buffers shorter than the step's {tokens} rows"
    );
    let group = n_heads / n_kv_heads;
    let work: Vec<(EncoderSeq, usize)> = seqs
        .iter()
        .filter(|s| s.len > 0)
        .flat_map(|s| (0..n_heads).map(move |h| (*s, h)))
        .collect();
    struct Out(*mut f32);
    // SAFETY: each task writes only the head columns of its own sequence's
    // rows, and no two tasks share a (sequence, head).
    unsafe impl Sync for Out {}
    let o = Out(out.as_mut_ptr());
    let task = |i0: usize, i1: usize| {
        let o = &o;
        let mut scratch = Vec::new();
        for &(seq, h) in &work[i0..i1] {
            let head = HeadAttention {
                q,
                k,
                v,
                qw,
                kw,
                head_dim,
                h,
                kh: h / group,
                seq,
                scale,
                window,
                out: o.0,
                scratch: &mut scratch,
            };
            // SAFETY: `check_level` confirmed the level; the bounds were
            // checked above and the task owns its output columns.
            unsafe { dispatch(level, head) }
        }
    };
    if work.len() < 2 || pool.threads() == 1 {
        task(0, work.len());
    } else {
        pool.run_ranges(work.len(), 1, &task);
    }
}

/// Query rows per tile of [`HeadAttention`].
const ATT_ROWS: usize = 4;
/// Vectors per register tile (of keys in `Q·Kᵀ`, of the head dimension in
/// `P·V`).
const ATT_VECS: usize = 4;

/// One (sequence, head) of [`bidirectional_attention`].
struct HeadAttention<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    qw: usize,
    kw: usize,
    head_dim: usize,
    h: usize,
    kh: usize,
    seq: EncoderSeq,
    scale: f32,
    /// Keys at most this far from the query on either side (ModernBERT's
    /// local layers); None: the whole sequence.
    window: Option<usize>,
    out: *mut f32,
    scratch: &'a mut Vec<f32>,
}

impl Kernel for HeadAttention<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let l = S::LANES;
        let step = l * ATT_VECS;
        let (hd, len, s0) = (self.head_dim, self.seq.len, self.seq.start);
        // Keys padded to whole register tiles, the head dimension too.
        let lp = len.div_ceil(step) * step;
        let hp = hd.div_ceil(step) * step;
        let need = hd * lp + len * hp + ATT_ROWS * lp;
        let mut buf = std::mem::take(&mut *self.scratch);
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        let (kt, rest) = buf.split_at_mut(hd * lp);
        let (vp, sc) = rest.split_at_mut(len * hp);
        let sc = &mut sc[..ATT_ROWS * lp];
        kt.fill(0.0);
        vp.fill(0.0);
        let kc = self.kh * hd;
        for j in 0..len {
            let kr = &self.k[(s0 + j) * self.kw + kc..(s0 + j) * self.kw + kc + hd];
            for (d, &x) in kr.iter().enumerate() {
                kt[d * lp + j] = x;
            }
            vp[j * hp..j * hp + hd]
                .copy_from_slice(&self.v[(s0 + j) * self.kw + kc..(s0 + j) * self.kw + kc + hd]);
        }
        let mut r = 0;
        while r < len {
            let rows = (len - r).min(ATT_ROWS);
            // SAFETY: the tile's rows lie in the sequence; every pointer
            // below stays inside kt, vp, sc, q and the task's out columns.
            unsafe {
                match rows {
                    4 => self.tile::<S, 4>(r, kt, vp, sc, lp, hp),
                    3 => self.tile::<S, 3>(r, kt, vp, sc, lp, hp),
                    2 => self.tile::<S, 2>(r, kt, vp, sc, lp, hp),
                    _ => self.tile::<S, 1>(r, kt, vp, sc, lp, hp),
                }
            }
            r += rows;
        }
        *self.scratch = buf;
    }
}

impl HeadAttention<'_> {
    /// Rows `r0..r0 + R` of the sequence.
    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize>(
        &self,
        r0: usize,
        kt: &[f32],
        vp: &[f32],
        sc: &mut [f32],
        lp: usize,
        hp: usize,
    ) {
        let l = S::LANES;
        let (hd, len, s0) = (self.head_dim, self.seq.len, self.seq.start);
        let qc = self.h * hd;
        let qrow: [*const f32; R] =
            std::array::from_fn(|i| self.q[(s0 + r0 + i) * self.qw + qc..].as_ptr());
        unsafe {
            // Scores: sc[i][j] = scale · q_i · k_j.
            let mut j = 0;
            while j < lp {
                let mut acc = [[S::zero(); ATT_VECS]; R];
                for d in 0..hd {
                    let kp = kt.as_ptr().add(d * lp + j);
                    let mut kv = [S::zero(); ATT_VECS];
                    for (c, x) in kv.iter_mut().enumerate() {
                        *x = S::load(kp.add(c * l));
                    }
                    for (i, a) in acc.iter_mut().enumerate() {
                        let qb = S::splat(*qrow[i].add(d));
                        for c in 0..ATT_VECS {
                            a[c] = S::fma(qb, kv[c], a[c]);
                        }
                    }
                }
                let s = S::splat(self.scale);
                for (i, a) in acc.iter().enumerate() {
                    for (c, &x) in a.iter().enumerate() {
                        S::store(sc.as_mut_ptr().add(i * lp + j + c * l), S::mul(x, s));
                    }
                }
                j += l * ATT_VECS;
            }
            // Softmax of each row over its len keys; padded keys weigh 0.
            let mut inv = [0.0f32; R];
            for (i, z) in inv.iter_mut().enumerate() {
                let row = &mut sc[i * lp..(i + 1) * lp];
                row[len..].fill(f32::NEG_INFINITY);
                // Keys outside the window weigh 0 as the padding does (and
                // add exact zeros to the output's sums).
                if let Some(w) = self.window {
                    let at = r0 + i;
                    row[..at.saturating_sub(w)].fill(f32::NEG_INFINITY);
                    row[(at + w + 1).min(len)..len].fill(f32::NEG_INFINITY);
                }
                let mut m = S::splat(f32::NEG_INFINITY);
                for c in (0..lp).step_by(l) {
                    m = S::max(m, S::load(row.as_ptr().add(c)));
                }
                let m = S::splat(S::hmax(m));
                let mut sum = S::zero();
                for c in (0..lp).step_by(l) {
                    let p = S::exp(S::sub(S::load(row.as_ptr().add(c)), m));
                    S::store(row.as_mut_ptr().add(c), p);
                    sum = S::add(sum, p);
                }
                *z = 1.0 / S::hsum(sum);
            }
            // Output: out_i = Σ_j p_ij · v_j / Σ_j p_ij.
            let mut d0 = 0;
            while d0 < hp {
                let mut acc = [[S::zero(); ATT_VECS]; R];
                for j in 0..len {
                    let vr = vp.as_ptr().add(j * hp + d0);
                    let mut vv = [S::zero(); ATT_VECS];
                    for (c, x) in vv.iter_mut().enumerate() {
                        *x = S::load(vr.add(c * l));
                    }
                    for (i, a) in acc.iter_mut().enumerate() {
                        let pb = S::splat(*sc.as_ptr().add(i * lp + j));
                        for c in 0..ATT_VECS {
                            a[c] = S::fma(pb, vv[c], a[c]);
                        }
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    let z = S::splat(inv[i]);
                    let orow = self.out.add((s0 + r0 + i) * self.qw + qc);
                    let mut tmp = [0.0f32; 64];
                    for (c, &x) in a.iter().enumerate() {
                        let e0 = d0 + c * l;
                        if e0 >= hd {
                            break;
                        }
                        let y = S::mul(x, z);
                        if e0 + l <= hd {
                            S::store(orow.add(e0), y);
                        } else {
                            S::store(tmp.as_mut_ptr(), y);
                            std::ptr::copy_nonoverlapping(tmp.as_ptr(), orow.add(e0), hd - e0);
                        }
                    }
                }
                d0 += l * ATT_VECS;
            }
        }
    }
}

/// Pools rows `seq.start..seq.start + seq.len` of `x` (rows of `d`) into
/// `out` (`d` values) as `how` says; the mean is accumulated in f64.
///
/// # Panics
/// If the sequence is empty or lies past `x`.
pub fn pool_rows(x: &[f32], d: usize, seq: EncoderSeq, how: SeqPooling, out: &mut [f32]) {
    assert!(seq.len > 0, "pool_rows: an empty sequence");
    let row = |r: usize| &x[r * d..(r + 1) * d];
    match how {
        SeqPooling::First => out[..d].copy_from_slice(row(seq.start)),
        SeqPooling::Last => out[..d].copy_from_slice(row(seq.start + seq.len - 1)),
        SeqPooling::Mean => {
            for (c, o) in out[..d].iter_mut().enumerate() {
                let s: f64 = (seq.start..seq.start + seq.len)
                    .map(|r| f64::from(x[r * d + c]))
                    .sum();
                *o = (s / seq.len as f64) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// f64 LayerNorm written from its definition.
    #[test]
    fn layer_norm_matches_a_naive_f64_reference() {
        let mut rng = StdRng::seed_from_u64(7);
        let (m, d) = (5, 37);
        let x = rand_vec(&mut rng, m * d);
        let w = rand_vec(&mut rng, d);
        let b = rand_vec(&mut rng, d);
        let mut out = vec![0.0; m * d];
        layer_norm(&x, &w, &b, 1e-7, &mut out);
        for r in 0..m {
            let row: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            for c in 0..d {
                let want = (row[c] - mean) / (var + 1e-7).sqrt() * w[c] as f64 + b[c] as f64;
                let got = out[r * d + c] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "row {r} col {c}: {got} vs {want}"
                );
            }
        }
    }

    /// GELU at every SIMD level against Φ computed by numerical integration
    /// of the normal density (Simpson's rule in f64), within 2e-7 ·
    /// max(1, |x|), on a grid through every branch of the erf (|x/√2|
    /// around 0.84375, 1.25, 1/0.35 and 6) and odd vector tails; and tanh
    /// against f64's.
    #[test]
    fn activations_match_their_definitions() {
        let mut xs: Vec<f32> = (-1000..=1000).map(|i| i as f32 * 0.01).collect();
        xs.extend([1e-30f32, -1e-30, 0.0, -0.0, 1e-6, 30.0, -30.0]);
        let want: Vec<f64> = xs
            .iter()
            .map(|&x| {
                let x = x as f64;
                // Φ(x) = 1/2 + ∫₀ˣ φ(t) dt.
                let n = 2000;
                let h = x / n as f64;
                let phi = |t: f64| (-t * t / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
                let mut s = phi(0.0) + phi(x);
                for i in 1..n {
                    s += phi(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
                }
                x * (0.5 + s * h / 3.0)
            })
            .collect();
        for level in levels() {
            for len in [xs.len(), 13, 5] {
                let mut g = xs[..len].to_vec();
                activation_at(level, &mut g, Activation::GeluErf);
                for ((&x, &got), &w) in xs.iter().zip(&g).zip(&want) {
                    let tol = 2e-7 * (x.abs() as f64).max(1.0);
                    assert!(
                        (got as f64 - w).abs() <= tol,
                        "{level:?}: gelu({x}) = {got}, want {w}"
                    );
                    // The scalar erff it replaced, to within the same.
                    let old = 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                    assert!(
                        (got - old).abs() as f64 <= tol,
                        "{level:?}: gelu({x}) = {got}, erff's {old}"
                    );
                }
            }
        }
        let mut g = vec![f32::NAN, f32::INFINITY];
        activation_inplace(&mut g, Activation::GeluErf);
        assert!(g[0].is_nan() && g[1] == f32::INFINITY, "{g:?}");
        let mut t = xs.clone();
        activation_inplace(&mut t, Activation::Tanh);
        for (&x, &got) in xs.iter().zip(&t) {
            assert!((got as f64 - (x as f64).tanh()).abs() < 1e-6);
        }
    }

    /// Attention of every row over its whole sequence, in f64 from the
    /// definition, with two sequences side by side and grouped heads.
    #[test]
    fn bidirectional_attention_matches_a_naive_reference() {
        let mut rng = StdRng::seed_from_u64(11);
        for (n_heads, n_kv, hd, lens) in
            [(4, 2, 8, [5, 31]), (2, 2, 64, [70, 1]), (3, 1, 20, [18, 2])]
        {
            let seqs = [
                EncoderSeq {
                    start: 0,
                    len: lens[0],
                },
                EncoderSeq {
                    start: lens[0],
                    len: lens[1],
                },
            ];
            let t = lens[0] + lens[1];
            let q = rand_vec(&mut rng, t * n_heads * hd);
            let k = rand_vec(&mut rng, t * n_kv * hd);
            let v = rand_vec(&mut rng, t * n_kv * hd);
            let scale = 1.0 / (hd as f32).sqrt();
            // No window, one that cuts the long sequence and not the
            // short, and none wider than the sequences.
            for (threads, level, window) in [1, 2]
                .into_iter()
                .flat_map(|t| levels().into_iter().map(move |l| (t, l)))
                .flat_map(|(t, l)| [None, Some(3), Some(4), Some(80)].map(|w| (t, l, w)))
            {
                let pool = ThreadPool::new(threads);
                let mut out = vec![0.0; t * n_heads * hd];
                bidirectional_attention_at(
                    level, &pool, &q, &k, &v, n_heads, n_kv, hd, &seqs, scale, window, &mut out,
                );
                for s in &seqs {
                    for r in s.start..s.start + s.len {
                        // Keys within the window's distance on either side.
                        let seen: Vec<usize> = (s.start..s.start + s.len)
                            .filter(|&j| window.is_none_or(|w| j.abs_diff(r) <= w))
                            .collect();
                        for h in 0..n_heads {
                            let kh = h / (n_heads / n_kv);
                            let sc: Vec<f64> = seen
                                .iter()
                                .map(|&j| {
                                    (0..hd)
                                        .map(|c| {
                                            q[r * n_heads * hd + h * hd + c] as f64
                                                * k[j * n_kv * hd + kh * hd + c] as f64
                                        })
                                        .sum::<f64>()
                                        * scale as f64
                                })
                                .collect();
                            let max = sc.iter().cloned().fold(f64::MIN, f64::max);
                            let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                            let z: f64 = e.iter().sum();
                            for c in 0..hd {
                                let want: f64 = seen
                                    .iter()
                                    .zip(&e)
                                    .map(|(&j, p)| p / z * v[j * n_kv * hd + kh * hd + c] as f64)
                                    .sum();
                                let got = out[r * n_heads * hd + h * hd + c] as f64;
                                assert!(
                                (got - want).abs() < 1e-5,
                                "{level:?} threads {threads} window {window:?} row {r} head {h} col {c}: {got} vs {want}"
                            );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The gated unit against f64 from its definition (GELU through erf
    /// as `libm`'s f64 gives it, tanh through f64's).
    #[test]
    fn act_mul_matches_its_definition() {
        let mut rng = StdRng::seed_from_u64(13);
        let (m, ffn) = (3, 11);
        let x = rand_vec(&mut rng, m * 2 * ffn);
        for act in [Activation::GeluErf, Activation::Tanh] {
            let mut out = vec![0.0; m * ffn];
            act_mul(&x, ffn, act, &mut out);
            for r in 0..m {
                for j in 0..ffn {
                    let a = f64::from(x[r * 2 * ffn + j]);
                    let g = f64::from(x[r * 2 * ffn + ffn + j]);
                    let fa = match act {
                        Activation::GeluErf => {
                            0.5 * a * (1.0 + libm::erf(a / std::f64::consts::SQRT_2))
                        }
                        Activation::Tanh => a.tanh(),
                    };
                    let got = f64::from(out[r * ffn + j]);
                    assert!(
                        (got - fa * g).abs() < 1e-5,
                        "{act:?} row {r} col {j}: {got} vs {}",
                        fa * g
                    );
                }
            }
        }
    }

    fn levels() -> Vec<SimdLevel> {
        let mut v = vec![SimdLevel::Scalar];
        if crate::cpu::simd_level() >= SimdLevel::Avx2 {
            v.push(SimdLevel::Avx2);
        }
        if crate::cpu::simd_level() >= SimdLevel::Avx512Vnni {
            v.push(SimdLevel::Avx512Vnni);
        }
        v
    }

    #[test]
    fn pooling_takes_first_mean_and_last_rows() {
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect(); // 4 rows of 3
        let seq = EncoderSeq { start: 1, len: 3 };
        let mut out = vec![0.0; 3];
        pool_rows(&x, 3, seq, SeqPooling::First, &mut out);
        assert_eq!(out, [3.0, 4.0, 5.0]);
        pool_rows(&x, 3, seq, SeqPooling::Last, &mut out);
        assert_eq!(out, [9.0, 10.0, 11.0]);
        pool_rows(&x, 3, seq, SeqPooling::Mean, &mut out);
        assert_eq!(out, [6.0, 7.0, 8.0]);
    }

    #[test]
    fn packed_tokens_unpack() {
        assert_eq!(unpack_token(17 | (1 << TOKEN_TYPE_SHIFT)), (17, 1));
        assert_eq!(unpack_token(17), (17, 0));
    }
}
