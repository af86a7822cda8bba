//! The operations of encoder models (BERT and its kin) that decoders do not
//! use: LayerNorm with a bias, GELU (the erf form) and tanh, attention in
//! both directions within each sequence, and the pooling of a sequence's
//! rows into one (CLS, mean or last token).
//!
//! Encoder rows are prefill-only: each sequence's whole prompt is in the
//! step, its K and V are read from the step's own rows and nothing is kept
//! after it. Every function here has a naive reference in the tests below.

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

/// Applies `act` to every element of `x`.
pub fn activation_inplace(x: &mut [f32], act: Activation) {
    match act {
        Activation::GeluErf => {
            for v in x {
                *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
            }
        }
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
/// sequence are left alone. Spread over `pool` by rows.
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
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "bidirectional_attention: {n_heads} query heads over {n_kv_heads} key heads"
    );
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
    // One task per (sequence, query row): rows are independent.
    let mut rows: Vec<(usize, EncoderSeq)> = Vec::new();
    for s in seqs {
        for r in s.start..s.start + s.len {
            rows.push((r, *s));
        }
    }
    struct Out(*mut f32);
    // SAFETY: each task writes only its own row of `out`.
    unsafe impl Sync for Out {}
    let o = Out(out.as_mut_ptr());
    let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
    let task = |i0: usize, i1: usize| {
        let o = &o;
        let mut scores = vec![0.0f32; max_len];
        let mut acc = vec![0.0f32; head_dim];
        for &(r, EncoderSeq { start: s0, len }) in &rows[i0..i1] {
            // SAFETY: row r is in bounds (checked above) and only this
            // task writes it.
            let orow = unsafe { std::slice::from_raw_parts_mut(o.0.add(r * qw), qw) };
            // The keys this row sees: rows j0..j1 of its sequence.
            let i = r - s0;
            let (j0, j1) = match window {
                Some(w) => (i.saturating_sub(w), (i + w + 1).min(len)),
                None => (0, len),
            };
            let seen = j1 - j0;
            for h in 0..n_heads {
                let kh = h / group;
                let qh = &q[r * qw + h * head_dim..r * qw + (h + 1) * head_dim];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in (j0..j1).zip(scores[..seen].iter_mut()) {
                    let kr = &k[(s0 + j) * kw + kh * head_dim..(s0 + j) * kw + (kh + 1) * head_dim];
                    let dot: f32 = qh.iter().zip(kr).map(|(a, b)| a * b).sum();
                    *sc = dot * scale;
                    max = max.max(*sc);
                }
                let mut sum = 0.0f32;
                for sc in &mut scores[..seen] {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                acc.fill(0.0);
                for (j, &p) in (j0..j1).zip(scores[..seen].iter()) {
                    let vr = &v[(s0 + j) * kw + kh * head_dim..(s0 + j) * kw + (kh + 1) * head_dim];
                    for (a, &x) in acc.iter_mut().zip(vr) {
                        *a += p * x;
                    }
                }
                let inv = 1.0 / sum;
                for (d, &a) in orow[h * head_dim..(h + 1) * head_dim].iter_mut().zip(&acc) {
                    *d = a * inv;
                }
            }
        }
    };
    if rows.len() < 16 || pool.threads() == 1 {
        task(0, rows.len());
    } else {
        pool.run_ranges(rows.len(), 4, &task);
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

    /// GELU against Φ computed by numerical integration of the normal
    /// density (Simpson's rule in f64), and tanh against f64's.
    #[test]
    fn activations_match_their_definitions() {
        let xs: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.15).collect();
        let mut g = xs.clone();
        activation_inplace(&mut g, Activation::GeluErf);
        for (&x, &got) in xs.iter().zip(&g) {
            let x = x as f64;
            // Φ(x) = 1/2 + ∫₀ˣ φ(t) dt.
            let n = 2000;
            let h = x / n as f64;
            let phi = |t: f64| (-t * t / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let mut s = phi(0.0) + phi(x);
            for i in 1..n {
                s += phi(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
            }
            let want = x * (0.5 + s * h / 3.0);
            assert!(
                (got as f64 - want).abs() < 1e-6,
                "gelu({x}) = {got}, want {want}"
            );
        }
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
        let (n_heads, n_kv, hd) = (4, 2, 8);
        let seqs = [
            EncoderSeq { start: 0, len: 5 },
            EncoderSeq { start: 5, len: 31 },
        ];
        let t = 36;
        let q = rand_vec(&mut rng, t * n_heads * hd);
        let k = rand_vec(&mut rng, t * n_kv * hd);
        let v = rand_vec(&mut rng, t * n_kv * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        // No window, one that cuts the long sequence and not the short,
        // and none wider than the sequences.
        for (threads, window) in [
            (1, None),
            (2, None),
            (1, Some(3)),
            (2, Some(4)),
            (2, Some(40)),
        ] {
            let pool = ThreadPool::new(threads);
            let mut out = vec![0.0; t * n_heads * hd];
            bidirectional_attention(
                &pool, &q, &k, &v, n_heads, n_kv, hd, &seqs, scale, window, &mut out,
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
                                "threads {threads} window {window:?} row {r} head {h} col {c}: {got} vs {want}"
                            );
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
