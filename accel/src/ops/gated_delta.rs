//! The gated delta rule of Gated DeltaNet layers (Yang, Kautz & Hatamizadeh,
//! "Gated Delta Networks", 2024), as Qwen3-Next and Qwen3.5 use it
//! (transformers' `torch_recurrent_gated_delta_rule` and
//! `torch_chunk_gated_delta_rule` with `use_qk_l2norm_in_kernel`).
//!
//! Each value head `h` keeps a state `S` of `[k_dim, v_dim]` and reads query
//! and key head `h / (n_v_heads / n_k_heads)` (transformers'
//! `repeat_interleave`). Per token, with `q` and `k` L2-normalized (`x /
//! √(Σx² + 1e-6)`) and `q` scaled by `1/√k_dim`,
//!
//! ```text
//! g    = -exp(A_log[h]) · softplus(a + dt_bias[h])   (log decay, ≤ 0)
//! β    = sigmoid(b)
//! S   ← e^g · S
//! u    = β · (v - Sᵀk)
//! S   ← S + k uᵀ
//! out  = Sᵀq
//! ```
//!
//! # Two forms
//! Decoding one token runs that recurrence. A prompt runs the chunked form:
//! within a chunk of `L` tokens starting from state `S₀`, with `Gₜ` the
//! cumulative sum of the chunk's `g`, the `u`s solve the unit
//! lower-triangular system
//! `uₜ + Σ_{j<t} βₜ e^{Gₜ-Gⱼ} (kₜ·kⱼ) uⱼ = βₜ (vₜ - e^{Gₜ} S₀ᵀkₜ)`
//! (forward substitution), then `outₜ = e^{Gₜ} S₀ᵀqₜ + Σ_{j≤t} e^{Gₜ-Gⱼ}
//! (qₜ·kⱼ) uⱼ` and `S_L = e^{G_L} S₀ + Σⱼ e^{G_L-Gⱼ} kⱼ uⱼᵀ`. It is the same
//! recurrence unrolled (substitute `S_{t-1} = e^{G_{t-1}} S₀ + Σ_{j<t}
//! e^{G_{t-1}-Gⱼ} kⱼ uⱼᵀ`), so the forms agree up to f32 rounding. Only
//! differences `Gₜ - Gⱼ ≤ 0` are exponentiated, so nothing overflows however
//! strong the decay.
//!
//! # The chunk grid
//! Chunks are cut at multiples of [`CHUNK`] absolute positions, not
//! relative to the step: a prompt split by the scheduler at multiples of
//! `CHUNK` computes exactly the bits of the whole prompt in one step (the
//! property a state checkpoint at such a boundary needs to restore a
//! prefix-cache hit to what a cold run computes). A piece of one token (a
//! decode, or a step ending one token past a boundary) runs the recurrence.

pub use super::recurrent::RecurrentSeq;
use super::recurrent::{check_slots, SendPtr};
use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;
use std::cell::RefCell;

/// Tokens per chunk of the chunked form (transformers' and FLA's
/// `chunk_size`).
pub const CHUNK: usize = 64;

/// The `eps` of the L2 normalization of q and k (FLA's `l2norm`, which
/// transformers mirrors): inside the square root, added to the sum of
/// squares.
const L2_EPS: f32 = 1e-6;

/// The shape of a Gated DeltaNet layer's heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedDeltaSpec {
    /// Query/key heads (`linear_num_key_heads`).
    pub n_k_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of `n_k_heads`.
    pub n_v_heads: usize,
    /// `linear_key_head_dim`.
    pub k_dim: usize,
    /// `linear_value_head_dim`.
    pub v_dim: usize,
}

impl GatedDeltaSpec {
    /// Width of a token's q, k and v: `[q heads | k heads | v heads]`.
    pub fn qkv_width(&self) -> usize {
        2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim
    }

    /// Width of a token's output, `n_v_heads · v_dim`.
    pub fn out_width(&self) -> usize {
        self.n_v_heads * self.v_dim
    }

    /// Values of one sequence's state: `[n_v_heads, k_dim, v_dim]`.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.k_dim * self.v_dim
    }

    fn check(&self) {
        assert!(
            self.n_k_heads > 0
                && self.k_dim > 0
                && self.v_dim > 0
                && self.n_v_heads.is_multiple_of(self.n_k_heads)
                && self.n_v_heads > 0,
            "gated_delta_rule: bad shape {self:?} (value heads must be a positive multiple of key heads)"
        );
    }
}

/// Runs the gated delta rule over every sequence of a step (see the module
/// documentation).
///
/// - `qkv`: `[tokens, spec.qkv_width()]`, the convolution's output;
/// - `ba`: per token, at `row · ba_stride + ba_col`, the `n_v_heads` beta
///   logits `b` then the `n_v_heads` decay inputs `a`;
/// - `a_log`, `dt_bias`: `[n_v_heads]`, the layer's `A_log` and `dt_bias`;
/// - `state`: `[slots, spec.state_len()]`; each sequence reads and updates
///   its slot (from zero at position 0);
/// - `out`: `[tokens, spec.out_width()]`, each value head's `Sᵀq`.
///
/// Sequences and value heads run in parallel on `pool`; the result does not
/// depend on the pool's size.
///
/// # Panics
/// If a length disagrees with the shapes, or sequences share a slot or rows.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    pool: &ThreadPool,
    spec: GatedDeltaSpec,
    qkv: &[f32],
    ba: &[f32],
    ba_stride: usize,
    ba_col: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    seqs: &[RecurrentSeq],
    state: &mut [f32],
    out: &mut [f32],
) {
    gated_delta_rule_at(
        simd_level(),
        pool,
        spec,
        qkv,
        ba,
        ba_stride,
        ba_col,
        a_log,
        dt_bias,
        seqs,
        state,
        out,
    )
}

/// [`gated_delta_rule`] at an explicit SIMD level (tests cover every level).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_delta_rule_at(
    level: SimdLevel,
    pool: &ThreadPool,
    spec: GatedDeltaSpec,
    qkv: &[f32],
    ba: &[f32],
    ba_stride: usize,
    ba_col: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    seqs: &[RecurrentSeq],
    state: &mut [f32],
    out: &mut [f32],
) {
    check_level(level);
    spec.check();
    let nv = spec.n_v_heads;
    let tokens: usize = seqs.iter().map(|s| s.q_start + s.q_len).max().unwrap_or(0);
    assert!(
        qkv.len() >= tokens * spec.qkv_width(),
        "gated_delta_rule: qkv holds fewer than {tokens} rows"
    );
    assert!(
        ba_col + 2 * nv <= ba_stride
            && (tokens == 0 || ba.len() >= (tokens - 1) * ba_stride + ba_col + 2 * nv),
        "gated_delta_rule: ba holds fewer than {tokens} rows of 2 x {nv} at column {ba_col}"
    );
    assert!(
        a_log.len() == nv && dt_bias.len() == nv,
        "gated_delta_rule: A_log and dt_bias must hold {nv} values"
    );
    assert!(
        out.len() >= tokens * spec.out_width(),
        "gated_delta_rule: out holds fewer than {tokens} rows"
    );
    let slot_len = spec.state_len();
    check_slots("gated_delta_rule", seqs, state.len(), slot_len);
    let head_len = spec.k_dim * spec.v_dim;
    let (out_p, state_p) = (SendPtr(out.as_mut_ptr()), SendPtr(state.as_mut_ptr()));
    reserve_scratch(pool, Scratch::len(&spec));
    pool.run(seqs.len() * nv, &|task| {
        let (seq, h) = (&seqs[task / nv], task % nv);
        let (out_p, state_p) = (&out_p, &state_p);
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let need = Scratch::len(&spec);
            if s.len() < need {
                s.resize(need, 0.0);
            }
            // SAFETY: `check_level` confirmed the CPU supports `level`.
            // The task writes only head `h`'s columns of its sequence's
            // rows of `out` and head `h`'s part of its sequence's slot:
            // sequences' rows and slots are disjoint (`check_slots`) and
            // heads split both, so no two tasks touch the same element;
            // `pool.run` returns before the borrows end.
            unsafe {
                dispatch(
                    level,
                    HeadTask {
                        spec,
                        qkv,
                        ba,
                        ba_stride,
                        ba_col,
                        // `-exp(A_log)` in f32, as transformers computes it.
                        neg_a: -a_log[h].exp(),
                        dt_bias: dt_bias[h],
                        seq,
                        h,
                        state: state_p.0.add(seq.slot * slot_len + h * head_len),
                        out: out_p.0,
                        scratch: &mut s[..need],
                    },
                )
            }
        })
    });
}

thread_local! {
    /// Each pool thread's chunk buffers ([`Scratch`]): grown on every
    /// thread of the pool at once ([`reserve_scratch`]), then reused, so a
    /// warm step allocates nothing.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The pools (by id) whose every thread holds a [`SCRATCH`] of at least
/// the length noted.
static RESERVED: std::sync::Mutex<Vec<(u64, usize)>> = std::sync::Mutex::new(Vec::new());

/// Grows [`SCRATCH`] to `need` on every thread of `pool`, unless that was
/// done: which thread runs a task is up to timing, so growing on first use
/// would let a later step allocate on a thread that had no task before.
fn reserve_scratch(pool: &ThreadPool, need: usize) {
    let mut reserved = RESERVED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let i = match reserved.iter().position(|(id, _)| *id == pool.id()) {
        Some(i) if reserved[i].1 >= need => return,
        Some(i) => i,
        None => {
            reserved.push((pool.id(), 0));
            reserved.len() - 1
        }
    };
    pool.broadcast(&|_| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < need {
                s.resize(need, 0.0);
            }
        })
    });
    reserved[i].1 = need;
}

/// The per-chunk buffers, carved from one slice.
struct Scratch;

impl Scratch {
    /// `qn`, `kn`: `[CHUNK, k_dim]`; `u`, `qs`: `[CHUNK, v_dim]`; `g`,
    /// `beta`, `w`: `[CHUNK]`; `kwt`: `[k_dim, CHUNK]`; `cm`: `[CHUNK,
    /// CHUNK]`.
    fn len(spec: &GatedDeltaSpec) -> usize {
        3 * CHUNK * spec.k_dim + 2 * CHUNK * spec.v_dim + 3 * CHUNK + CHUNK * CHUNK
    }
}

struct HeadTask<'a> {
    spec: GatedDeltaSpec,
    qkv: &'a [f32],
    ba: &'a [f32],
    ba_stride: usize,
    ba_col: usize,
    neg_a: f32,
    dt_bias: f32,
    seq: &'a RecurrentSeq,
    h: usize,
    /// This head's `[k_dim, v_dim]` state.
    state: *mut f32,
    /// The whole `out`, `[tokens, out_width]`.
    out: *mut f32,
    scratch: &'a mut [f32],
}

/// `y[..n] += a · x[..n]`.
#[inline(always)]
unsafe fn axpy<S: Simd>(a: f32, x: *const f32, y: *mut f32, n: usize) {
    let l = S::LANES;
    let mut i = 0;
    unsafe {
        let av = S::splat(a);
        while i + l <= n {
            S::store(y.add(i), S::fma(av, S::load(x.add(i)), S::load(y.add(i))));
            i += l;
        }
        while i < n {
            *y.add(i) = S::fma1(a, *x.add(i), *y.add(i));
            i += 1;
        }
    }
}

/// `c[r·ldc + x] += Σ_p a[r·lda + p] · b[p·ldb + x]` for `r < m`, `x < n`,
/// `p < k`: the chunked form's small matrix products. Register-blocked (up
/// to 4 rows × 2 vectors of accumulators), so each loaded vector of `b`
/// feeds up to 8 FMAs and `c` is loaded and stored once per block rather
/// than once per `p` as a sequence of axpys would. Each element still sums
/// its products in increasing `p`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_acc<S: Simd>(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mut r = 0;
    unsafe {
        while r + 4 <= m {
            gemm_rows::<S, 4>(n, k, a.add(r * lda), lda, b, ldb, c.add(r * ldc), ldc);
            r += 4;
        }
        let (a, c) = (a.add(r * lda), c.add(r * ldc));
        match m - r {
            3 => gemm_rows::<S, 3>(n, k, a, lda, b, ldb, c, ldc),
            2 => gemm_rows::<S, 2>(n, k, a, lda, b, ldb, c, ldc),
            1 => gemm_rows::<S, 1>(n, k, a, lda, b, ldb, c, ldc),
            _ => {}
        }
    }
}

/// [`gemm_acc`] for exactly `R` rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows<S: Simd, const R: usize>(
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let l = S::LANES;
    let mut x = 0;
    unsafe {
        while x + 2 * l <= n {
            let mut acc = [[S::zero(); 2]; R];
            for (rr, acc) in acc.iter_mut().enumerate() {
                acc[0] = S::load(c.add(rr * ldc + x));
                acc[1] = S::load(c.add(rr * ldc + x + l));
            }
            for p in 0..k {
                let b0 = S::load(b.add(p * ldb + x));
                let b1 = S::load(b.add(p * ldb + x + l));
                for (rr, acc) in acc.iter_mut().enumerate() {
                    let av = S::splat(*a.add(rr * lda + p));
                    acc[0] = S::fma(av, b0, acc[0]);
                    acc[1] = S::fma(av, b1, acc[1]);
                }
            }
            for (rr, acc) in acc.iter().enumerate() {
                S::store(c.add(rr * ldc + x), acc[0]);
                S::store(c.add(rr * ldc + x + l), acc[1]);
            }
            x += 2 * l;
        }
        while x + l <= n {
            let mut acc = [S::zero(); R];
            for (rr, acc) in acc.iter_mut().enumerate() {
                *acc = S::load(c.add(rr * ldc + x));
            }
            for p in 0..k {
                let b0 = S::load(b.add(p * ldb + x));
                for (rr, acc) in acc.iter_mut().enumerate() {
                    *acc = S::fma(S::splat(*a.add(rr * lda + p)), b0, *acc);
                }
            }
            for (rr, acc) in acc.iter().enumerate() {
                S::store(c.add(rr * ldc + x), *acc);
            }
            x += l;
        }
        while x < n {
            for rr in 0..R {
                let mut s = *c.add(rr * ldc + x);
                for p in 0..k {
                    s = S::fma1(*a.add(rr * lda + p), *b.add(p * ldb + x), s);
                }
                *c.add(rr * ldc + x) = s;
            }
            x += 1;
        }
    }
}

/// `Σ x[i]·y[i]` over `..n`.
#[inline(always)]
unsafe fn dot<S: Simd>(x: *const f32, y: *const f32, n: usize) -> f32 {
    let l = S::LANES;
    let mut i = 0;
    unsafe {
        let mut acc = S::zero();
        while i + l <= n {
            acc = S::fma(S::load(x.add(i)), S::load(y.add(i)), acc);
            i += l;
        }
        let mut s = S::hsum(acc);
        while i < n {
            s = S::fma1(*x.add(i), *y.add(i), s);
            i += 1;
        }
        s
    }
}

/// `y[..n] = a · y[..n]`.
#[inline(always)]
unsafe fn scale<S: Simd>(a: f32, y: *mut f32, n: usize) {
    let l = S::LANES;
    let mut i = 0;
    unsafe {
        let av = S::splat(a);
        while i + l <= n {
            S::store(y.add(i), S::mul(av, S::load(y.add(i))));
            i += l;
        }
        while i < n {
            *y.add(i) *= a;
            i += 1;
        }
    }
}

/// `y[..n] = β · (v[..n] - e · y[..n])`: a token's `u` from `Sᵀk` in `y`.
#[inline(always)]
unsafe fn delta<S: Simd>(beta: f32, e: f32, v: *const f32, y: *mut f32, n: usize) {
    let l = S::LANES;
    let mut i = 0;
    unsafe {
        let (bv, nev) = (S::splat(beta), S::splat(-e));
        while i + l <= n {
            let d = S::fma(nev, S::load(y.add(i)), S::load(v.add(i)));
            S::store(y.add(i), S::mul(bv, d));
            i += l;
        }
        while i < n {
            *y.add(i) = beta * S::fma1(-e, *y.add(i), *v.add(i));
            i += 1;
        }
    }
}

/// `softplus(x) = ln(1 + eˣ)`, linear above 20 like PyTorch's (threshold
/// 20), where the two agree in f32 anyway and `eˣ` would lose precision.
#[inline(always)]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl HeadTask<'_> {
    /// Fills the scratch's `qn`, `kn`, `g` and `beta` for the `len` tokens
    /// from step row `r0` on.
    #[inline(always)]
    unsafe fn prepare<S: Simd>(&mut self, r0: usize, len: usize) {
        let GatedDeltaSpec {
            n_k_heads: nk,
            n_v_heads: nv,
            k_dim: dk,
            v_dim: dv,
        } = self.spec;
        let w = self.spec.qkv_width();
        let kh = self.h / (nv / nk);
        let q_scale = 1.0 / (dk as f32).sqrt();
        let (qn, rest) = self.scratch.split_at_mut(CHUNK * dk);
        let (kn, rest) = rest.split_at_mut(CHUNK * dk);
        let rest = &mut rest[2 * CHUNK * dv..];
        let (g, rest) = rest.split_at_mut(CHUNK);
        let beta = &mut rest[..CHUNK];
        for j in 0..len {
            let row = self.seq.q_start + r0 + j;
            let q = &self.qkv[row * w + kh * dk..][..dk];
            let k = &self.qkv[row * w + (nk + kh) * dk..][..dk];
            // SAFETY: q and k hold dk values each.
            let (qq, kk) = unsafe {
                (
                    dot::<S>(q.as_ptr(), q.as_ptr(), dk),
                    dot::<S>(k.as_ptr(), k.as_ptr(), dk),
                )
            };
            let qi = 1.0 / (qq + L2_EPS).sqrt() * q_scale;
            let ki = 1.0 / (kk + L2_EPS).sqrt();
            for i in 0..dk {
                qn[j * dk + i] = q[i] * qi;
                kn[j * dk + i] = k[i] * ki;
            }
            let at = row * self.ba_stride + self.ba_col;
            let (b, a) = (self.ba[at + self.h], self.ba[at + nv + self.h]);
            beta[j] = 1.0 / (1.0 + (-b).exp());
            g[j] = self.neg_a * softplus(a + self.dt_bias);
        }
    }

    /// This head's `v` of step row `r` of the sequence.
    #[inline(always)]
    fn v_ptr(&self, r: usize) -> *const f32 {
        let GatedDeltaSpec {
            n_k_heads: nk,
            k_dim: dk,
            v_dim: dv,
            ..
        } = self.spec;
        let row = self.seq.q_start + r;
        self.qkv[row * self.spec.qkv_width() + 2 * nk * dk + self.h * dv..][..dv].as_ptr()
    }

    /// This head's columns of `out` at step row `r` of the sequence.
    #[inline(always)]
    fn out_ptr(&self, r: usize) -> *mut f32 {
        let row = self.seq.q_start + r;
        // SAFETY: the caller checked that `out` holds the step's rows.
        unsafe {
            self.out
                .add(row * self.spec.out_width() + self.h * self.spec.v_dim)
        }
    }

    /// One token (row `r`) through the recurrence; its `qn`, `kn`, `g`,
    /// `beta` are the scratch's first.
    #[inline(always)]
    /// `zero`: the state is all zeros (a sequence's first piece), so its
    /// products are skipped; they would add exact zeros.
    unsafe fn recurrent<S: Simd>(&mut self, r: usize, zero: bool) {
        let (dk, dv) = (self.spec.k_dim, self.spec.v_dim);
        let v = self.v_ptr(r);
        let o = self.out_ptr(r);
        let sc = self.scratch.as_mut_ptr();
        // SAFETY: the scratch holds the layout of `Scratch::len`; the state
        // holds dk rows of dv; `v` and `o` hold dv values.
        unsafe {
            let (qn, kn) = (sc, sc.add(CHUNK * dk));
            let kv = sc.add(2 * CHUNK * dk);
            let gb = sc.add(2 * CHUNK * dk + 2 * CHUNK * dv);
            let (g, beta) = (*gb, *gb.add(CHUNK));
            let d = g.exp();
            // Sᵀk on the undecayed state, decayed once: e^g·(Sᵀk) = (e^g S)ᵀk.
            std::ptr::write_bytes(kv, 0, dv);
            if !zero {
                for i in 0..dk {
                    axpy::<S>(*kn.add(i), self.state.add(i * dv), kv, dv);
                }
            }
            delta::<S>(beta, d, v, kv, dv);
            // S ← e^g S + k uᵀ, and out = Sᵀq over the new rows, in one pass.
            std::ptr::write_bytes(o, 0, dv);
            let l = S::LANES;
            let dvv = S::splat(d);
            for i in 0..dk {
                let row = self.state.add(i * dv);
                let (ki, qi) = (*kn.add(i), *qn.add(i));
                let (kiv, qiv) = (S::splat(ki), S::splat(qi));
                let mut c = 0;
                while c + l <= dv {
                    let s = S::fma(kiv, S::load(kv.add(c)), S::mul(dvv, S::load(row.add(c))));
                    S::store(row.add(c), s);
                    S::store(o.add(c), S::fma(qiv, s, S::load(o.add(c))));
                    c += l;
                }
                while c < dv {
                    let s = S::fma1(ki, *kv.add(c), d * *row.add(c));
                    *row.add(c) = s;
                    *o.add(c) = S::fma1(qi, s, *o.add(c));
                    c += 1;
                }
            }
        }
    }

    /// The `len` tokens from row `r0` through the chunked form (module
    /// documentation); their `qn`, `kn`, `g`, `beta` fill the scratch.
    #[inline(always)]
    /// `zero` as in [`HeadTask::recurrent`].
    unsafe fn chunk<S: Simd>(&mut self, r0: usize, len: usize, zero: bool) {
        let (dk, dv) = (self.spec.k_dim, self.spec.v_dim);
        let sc = self.scratch.as_mut_ptr();
        // SAFETY: as in `recurrent`; every index below stays under `len <=
        // CHUNK` rows of its buffer.
        unsafe {
            let (qn, kn) = (sc, sc.add(CHUNK * dk));
            let u = sc.add(2 * CHUNK * dk);
            let qs = u.add(CHUNK * dv);
            let g = qs.add(CHUNK * dv);
            let beta = g.add(CHUNK);
            let w = beta.add(CHUNK);
            let kwt = w.add(CHUNK);
            let cm = kwt.add(dk * CHUNK);
            // G: the cumulative log decay within the chunk, in place.
            for j in 1..len {
                *g.add(j) += *g.add(j - 1);
            }
            // S₀ᵀkⱼ into u, S₀ᵀqⱼ into qs: [len, dk] · [dk, dv] products.
            std::ptr::write_bytes(u, 0, len * dv);
            std::ptr::write_bytes(qs, 0, len * dv);
            if !zero {
                gemm_acc::<S>(len, dv, dk, kn, dk, self.state, dv, u, dv);
                gemm_acc::<S>(len, dv, dk, qn, dk, self.state, dv, qs, dv);
            }
            // Right-hand sides βₜ(vₜ - e^{Gₜ} S₀ᵀkₜ), and the system's
            // coefficients, negated: cm[t][j] = -βₜ e^{Gₜ-Gⱼ} (kₜ·kⱼ), j < t.
            for t in 0..len {
                let (gt, bt, kt) = (*g.add(t), *beta.add(t), kn.add(t * dk));
                delta::<S>(bt, gt.exp(), self.v_ptr(r0 + t), u.add(t * dv), dv);
                for j in 0..t {
                    *cm.add(t * CHUNK + j) =
                        -(bt * (gt - *g.add(j)).exp() * dot::<S>(kt, kn.add(j * dk), dk));
                }
            }
            // Forward substitution, 4 rows at a time: the terms of the rows
            // solved before the block as one product, then the block's own
            // triangle. Each uₜ still adds its terms in increasing j.
            for t0 in (0..len).step_by(4) {
                let rows = (len - t0).min(4);
                gemm_acc::<S>(
                    rows,
                    dv,
                    t0,
                    cm.add(t0 * CHUNK),
                    CHUNK,
                    u,
                    dv,
                    u.add(t0 * dv),
                    dv,
                );
                for t in t0 + 1..t0 + rows {
                    for j in t0..t {
                        axpy::<S>(*cm.add(t * CHUNK + j), u.add(j * dv), u.add(t * dv), dv);
                    }
                }
            }
            // outₜ = e^{Gₜ} S₀ᵀqₜ + Σ_{j≤t} e^{Gₜ-Gⱼ} (qₜ·kⱼ) uⱼ: the
            // coefficients as a lower-triangular [len, len] matrix (zero
            // above the diagonal), times U, added to the scaled S₀ᵀqₜ.
            for t in 0..len {
                let (gt, qt) = (*g.add(t), qn.add(t * dk));
                for j in 0..len {
                    *cm.add(t * CHUNK + j) = if j <= t {
                        (gt - *g.add(j)).exp() * dot::<S>(qt, kn.add(j * dk), dk)
                    } else {
                        0.0
                    };
                }
                let o = self.out_ptr(r0 + t);
                std::ptr::copy_nonoverlapping(qs.add(t * dv), o, dv);
                scale::<S>(gt.exp(), o, dv);
            }
            let ow = self.spec.out_width();
            let o0 = self.out_ptr(r0);
            for t in (0..len).step_by(4) {
                // Rows t..t+4 have no coefficients past column t+3.
                let rows = (len - t).min(4);
                let k = (t + 4).min(len);
                gemm_acc::<S>(
                    rows,
                    dv,
                    k,
                    cm.add(t * CHUNK),
                    CHUNK,
                    u,
                    dv,
                    o0.add(t * ow),
                    ow,
                );
            }
            // S ← e^{G_L} S₀ + Kwᵀ U with Kw[j] = e^{G_L-Gⱼ} kⱼ.
            let gl = *g.add(len - 1);
            for j in 0..len {
                *w.add(j) = (gl - *g.add(j)).exp();
            }
            for i in 0..dk {
                for j in 0..len {
                    *kwt.add(i * CHUNK + j) = *w.add(j) * *kn.add(j * dk + i);
                }
            }
            scale::<S>(gl.exp(), self.state, dk * dv);
            gemm_acc::<S>(dk, dv, len, kwt, CHUNK, u, dv, self.state, dv);
        }
    }
}

impl Kernel for HeadTask<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(mut self) {
        let (n, p0) = (self.seq.q_len, self.seq.start_pos);
        let head_len = self.spec.k_dim * self.spec.v_dim;
        if p0 == 0 {
            // SAFETY: the state pointer holds this head's dk·dv values.
            unsafe { std::ptr::write_bytes(self.state, 0, head_len) };
        }
        let mut r = 0;
        while r < n {
            let len = (CHUNK - (p0 + r) % CHUNK).min(n - r);
            // SAFETY: the scratch and pointers are as the callees require.
            unsafe {
                self.prepare::<S>(r, len);
                // Only a sequence's first piece can start from zeros.
                let zero = p0 == 0 && r == 0;
                if len == 1 {
                    self.recurrent::<S>(r, zero);
                } else {
                    self.chunk::<S>(r, len, zero);
                }
            }
            r += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn levels() -> Vec<SimdLevel> {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
            .into_iter()
            .filter(|&l| l <= simd_level())
            .collect()
    }

    /// A layer's inputs for `tokens` tokens: q/k/v (the conv output), the
    /// b/a logits at column 3 of rows 2·nv + 5 wide, A_log and dt_bias.
    struct Inputs {
        spec: GatedDeltaSpec,
        qkv: Vec<f32>,
        ba: Vec<f32>,
        ba_stride: usize,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
    }

    const BA_COL: usize = 3;

    fn inputs(rng: &mut rand::rngs::StdRng, spec: GatedDeltaSpec, tokens: usize) -> Inputs {
        let nv = spec.n_v_heads;
        let ba_stride = 2 * nv + 5;
        Inputs {
            spec,
            // SiLU outputs: mostly positive, a few negative.
            qkv: (0..tokens * spec.qkv_width())
                .map(|_| rng.random_range(-0.3..2.0))
                .collect(),
            ba: (0..tokens * ba_stride)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect(),
            ba_stride,
            // A in (0.5, 16) as transformers initializes it: decays from
            // barely to strongly forgetting.
            a_log: (0..nv).map(|_| rng.random_range(-0.7f32..2.7)).collect(),
            dt_bias: (0..nv).map(|_| rng.random_range(-1.0..1.0)).collect(),
        }
    }

    /// The recurrence in f64, token by token from `s0` (`[nv][dk][dv]`),
    /// written from transformers' `torch_recurrent_gated_delta_rule` with
    /// `use_qk_l2norm_in_kernel` and the layer's g and beta; heads repeat as
    /// `repeat_interleave` does. Returns each token's output and the final
    /// state.
    fn reference(inp: &Inputs, rows: std::ops::Range<usize>, s0: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let GatedDeltaSpec {
            n_k_heads: nk,
            n_v_heads: nv,
            k_dim: dk,
            v_dim: dv,
        } = inp.spec;
        let w = inp.spec.qkv_width();
        let mut s = s0.to_vec();
        let mut out = Vec::new();
        for r in rows {
            let x = &inp.qkv[r * w..(r + 1) * w];
            for h in 0..nv {
                let kh = h / (nv / nk);
                let l2 = |v: &[f32]| -> Vec<f64> {
                    let n = v.iter().map(|&a| a as f64 * a as f64).sum::<f64>();
                    v.iter().map(|&a| a as f64 / (n + 1e-6).sqrt()).collect()
                };
                let q: Vec<f64> = l2(&x[kh * dk..(kh + 1) * dk])
                    .iter()
                    .map(|a| a / (dk as f64).sqrt())
                    .collect();
                let k = l2(&x[(nk + kh) * dk..(nk + kh + 1) * dk]);
                let v: Vec<f64> = x[2 * nk * dk + h * dv..][..dv]
                    .iter()
                    .map(|&a| a as f64)
                    .collect();
                let b = inp.ba[r * inp.ba_stride + BA_COL + h] as f64;
                let a = inp.ba[r * inp.ba_stride + BA_COL + nv + h] as f64;
                let beta = 1.0 / (1.0 + (-b).exp());
                let xa = a + inp.dt_bias[h] as f64;
                let g = -(inp.a_log[h] as f64).exp() * (1.0 + xa.exp()).ln();
                let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
                for e in st.iter_mut() {
                    *e *= g.exp();
                }
                let mut kv = vec![0.0; dv];
                for i in 0..dk {
                    for c in 0..dv {
                        kv[c] += st[i * dv + c] * k[i];
                    }
                }
                for i in 0..dk {
                    for c in 0..dv {
                        st[i * dv + c] += k[i] * (v[c] - kv[c]) * beta;
                    }
                }
                for c in 0..dv {
                    out.push((0..dk).map(|i| st[i * dv + c] * q[i]).sum::<f64>());
                }
            }
        }
        (out, s)
    }

    /// Runs one sequence's `tokens` rows through the op in steps of the
    /// given sizes, from position `p0` with state `s0` in slot 2 of 3
    /// (the other slots must stay untouched). Returns outputs and final
    /// state.
    fn run_steps(
        level: SimdLevel,
        pool: &ThreadPool,
        inp: &Inputs,
        p0: usize,
        s0: &[f32],
        steps: &[usize],
    ) -> (Vec<f32>, Vec<f32>) {
        let spec = inp.spec;
        let sl = spec.state_len();
        let mut state = vec![7.0f32; 3 * sl];
        if p0 > 0 {
            state[2 * sl..].copy_from_slice(s0);
        }
        let tokens = inp.qkv.len() / spec.qkv_width();
        let mut out = vec![f32::NAN; tokens * spec.out_width()];
        let mut r = 0;
        for &n in steps {
            let seqs = [RecurrentSeq {
                q_start: r,
                q_len: n,
                start_pos: p0 + r,
                slot: 2,
            }];
            gated_delta_rule_at(
                level,
                pool,
                spec,
                &inp.qkv,
                &inp.ba,
                inp.ba_stride,
                BA_COL,
                &inp.a_log,
                &inp.dt_bias,
                &seqs,
                &mut state,
                &mut out,
            );
            r += n;
        }
        assert_eq!(r, tokens);
        assert!(
            state[..2 * sl].iter().all(|&v| v == 7.0),
            "touched another slot"
        );
        (out, state[2 * sl..].to_vec())
    }

    /// Largest error relative to the reference's scale (its largest
    /// magnitude, at least 1).
    fn max_err(got: &[f32], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        got.iter()
            .zip(want)
            .map(|(&g, &w)| {
                assert!(g.is_finite(), "non-finite output");
                (g as f64 - w).abs() / scale
            })
            .fold(0.0, f64::max)
    }

    /// Tolerance of the f32 kernels against the f64 recurrence, relative to
    /// the outputs' scale: measured up to ~1e-6 over these cases.
    const TOL: f64 = 2e-5;

    fn splits(tokens: usize) -> Vec<Vec<usize>> {
        let mut uneven = Vec::new();
        let mut left = tokens;
        for &n in [1usize, 7, 63, 2, 70, 1, 5, 130].iter().cycle() {
            let n = n.min(left);
            uneven.push(n);
            left -= n;
            if left == 0 {
                break;
            }
        }
        vec![vec![tokens], vec![1; tokens], uneven]
    }

    #[test]
    fn gated_delta_forms_match_f64_recurrence() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let pool = ThreadPool::new(3);
        let cases = [
            // (nk, nv, dk, dv, tokens, start position)
            (2usize, 4usize, 16usize, 16usize, 150usize, 0usize),
            (1, 3, 20, 12, 70, 0),
            (2, 2, 8, 24, 9, 0),
            // From a non-zero state, off the chunk grid.
            (2, 4, 16, 16, 150, 37),
            (1, 2, 128, 128, 80, 100),
        ];
        let mut worst = 0.0f64;
        for &(nk, nv, dk, dv, tokens, p0) in &cases {
            let spec = GatedDeltaSpec {
                n_k_heads: nk,
                n_v_heads: nv,
                k_dim: dk,
                v_dim: dv,
            };
            let inp = inputs(&mut rng, spec, tokens);
            let s0: Vec<f32> = if p0 == 0 {
                vec![0.0; spec.state_len()]
            } else {
                (0..spec.state_len())
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect()
            };
            let s0d: Vec<f64> = s0.iter().map(|&v| v as f64).collect();
            let (want, want_s) = reference(&inp, 0..tokens, &s0d);
            for level in levels() {
                for steps in splits(tokens) {
                    let (out, s) = run_steps(level, &pool, &inp, p0, &s0, &steps);
                    let (eo, es) = (max_err(&out, &want), max_err(&s, &want_s));
                    worst = worst.max(eo).max(es);
                    assert!(
                        eo < TOL && es < TOL,
                        "{level:?} {spec:?} p0 {p0} steps {steps:?}: out err {eo:e}, state err {es:e}"
                    );
                }
            }
        }
        eprintln!("gated delta rule: worst relative error {worst:e}");
    }

    #[test]
    fn gated_delta_chunked_and_recurrent_agree() {
        // The chunked form against the recurrence in f32 directly (same
        // inputs, 64-token prompt vs 64 decodes), with real head sizes.
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let pool = ThreadPool::new(2);
        let spec = GatedDeltaSpec {
            n_k_heads: 2,
            n_v_heads: 4,
            k_dim: 128,
            v_dim: 128,
        };
        let inp = inputs(&mut rng, spec, 64);
        let s0 = vec![0.0; spec.state_len()];
        let (chunked, sc) = run_steps(simd_level(), &pool, &inp, 0, &s0, &[64]);
        let (recurrent, sr) = run_steps(simd_level(), &pool, &inp, 0, &s0, &[1; 64]);
        let as64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let (eo, es) = (
            max_err(&chunked, &as64(&recurrent)),
            max_err(&sc, &as64(&sr)),
        );
        eprintln!("chunked vs recurrent: out {eo:e}, state {es:e}");
        assert!(eo < TOL && es < TOL, "out {eo:e}, state {es:e}");
        // ...and they are different computations (else this test proves
        // nothing about the chunked form).
        assert_ne!(chunked, recurrent);
    }

    #[test]
    fn gated_delta_steps_on_the_chunk_grid_give_the_bits_of_one_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        let pool = ThreadPool::new(3);
        let spec = GatedDeltaSpec {
            n_k_heads: 1,
            n_v_heads: 2,
            k_dim: 32,
            v_dim: 16,
        };
        let inp = inputs(&mut rng, spec, 200);
        let s0 = vec![0.0; spec.state_len()];
        let whole = run_steps(simd_level(), &pool, &inp, 0, &s0, &[200]);
        let grid = run_steps(simd_level(), &pool, &inp, 0, &s0, &[64, 128, 8]);
        assert_eq!(whole, grid);
        // Off the grid the chunks differ, and so (slightly) do the bits.
        let off = run_steps(simd_level(), &pool, &inp, 0, &s0, &[50, 150]);
        assert_ne!(whole.0, off.0);
    }

    #[test]
    fn gated_delta_batches_sequences_independently() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let spec = GatedDeltaSpec {
            n_k_heads: 2,
            n_v_heads: 6,
            k_dim: 24,
            v_dim: 20,
        };
        let lens = [70usize, 1, 5, 1];
        let starts = [0usize, 40, 64, 3];
        let slots = [3usize, 0, 2, 1];
        let total: usize = lens.iter().sum();
        let inp = inputs(&mut rng, spec, total);
        let state0: Vec<f32> = (0..4 * spec.state_len())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut seqs = Vec::new();
        let mut q = 0;
        for i in 0..lens.len() {
            seqs.push(RecurrentSeq {
                q_start: q,
                q_len: lens[i],
                start_pos: starts[i],
                slot: slots[i],
            });
            q += lens[i];
        }
        let run =
            |pool: &ThreadPool, seqs: &[RecurrentSeq], state: &mut Vec<f32>, out: &mut Vec<f32>| {
                gated_delta_rule(
                    pool,
                    spec,
                    &inp.qkv,
                    &inp.ba,
                    inp.ba_stride,
                    BA_COL,
                    &inp.a_log,
                    &inp.dt_bias,
                    seqs,
                    state,
                    out,
                )
            };
        let n_out = total * spec.out_width();
        let (mut s_all, mut o_all) = (state0.clone(), vec![0f32; n_out]);
        run(&ThreadPool::new(3), &seqs, &mut s_all, &mut o_all);
        let (mut s_one, mut o_one) = (state0.clone(), vec![0f32; n_out]);
        let pool1 = ThreadPool::new(1);
        for s in &seqs {
            run(&pool1, &[*s], &mut s_one, &mut o_one);
        }
        assert_eq!(o_all, o_one);
        assert_eq!(s_all, s_one);
        // Each against the f64 recurrence from its slot (zero for the
        // sequence at position 0, whose slot held garbage).
        let sl = spec.state_len();
        for s in &seqs {
            let s0: Vec<f64> = if s.start_pos == 0 {
                vec![0.0; sl]
            } else {
                state0[s.slot * sl..(s.slot + 1) * sl]
                    .iter()
                    .map(|&v| v as f64)
                    .collect()
            };
            let (want, want_s) = reference(&inp, s.q_start..s.q_start + s.q_len, &s0);
            let ow = spec.out_width();
            let got = &o_all[s.q_start * ow..(s.q_start + s.q_len) * ow];
            assert!(max_err(got, &want) < TOL, "{s:?}");
            assert!(
                max_err(&s_all[s.slot * sl..(s.slot + 1) * sl], &want_s) < TOL,
                "{s:?}"
            );
        }
    }

    #[test]
    fn cpu_backend_maps_slots_and_positions_from_the_step() {
        use crate::backend::{Backend, StepBatch};
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        let spec = GatedDeltaSpec {
            n_k_heads: 1,
            n_v_heads: 2,
            k_dim: 16,
            v_dim: 8,
        };
        let mut be = crate::CpuBackend::new(crate::CpuContext::new(2), simd_level());
        let sl = spec.state_len();
        // Slot 0: sequence B's state after its first 10 tokens; slot 1:
        // garbage, where sequence A starts fresh.
        let b_state: Vec<f32> = (0..sl).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut state = b_state.clone();
        state.extend(std::iter::repeat_n(5.0f32, sl));
        // Step 1: A's prompt (5 tokens from 0), B's 3 tokens from 10.
        // Step 2: A's next token.
        let inp1 = inputs(&mut rng, spec, 8);
        let inp2 = inputs(&mut rng, spec, 1);
        let run = |be: &mut crate::CpuBackend,
                   inp: &Inputs,
                   batch: &StepBatch,
                   slots: &[u32],
                   state: &mut Vec<f32>| {
            let mut step = Default::default();
            be.upload_step(batch, &mut step).unwrap();
            let mut out = vec![0f32; batch.num_tokens() * spec.out_width()];
            be.gated_delta_rule(
                spec,
                &inp.qkv,
                &inp.ba,
                inp.ba_stride,
                BA_COL,
                &inp.a_log,
                &inp.dt_bias,
                state,
                slots,
                &step,
                &mut out,
            )
            .unwrap();
            out
        };
        let mut b1 = StepBatch::default();
        b1.push_seq(&[1; 5], 0, &[0], 16, 0, 1);
        b1.push_seq(&[1; 3], 10, &[1], 16, 0, 1);
        let o1 = run(&mut be, &inp1, &b1, &[1, 0], &mut state);
        let mut b2 = StepBatch::default();
        b2.push_seq(&[1], 5, &[0], 16, 0, 1);
        // The second step's layer parameters must be the first's.
        let inp2 = Inputs {
            a_log: inp1.a_log.clone(),
            dt_bias: inp1.dt_bias.clone(),
            ..inp2
        };
        let o2 = run(&mut be, &inp2, &b2, &[1], &mut state);
        let ow = spec.out_width();
        let (want_b, want_b_state) = reference(
            &inp1,
            5..8,
            &b_state.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        );
        assert!(max_err(&o1[5 * ow..], &want_b) < TOL);
        assert!(max_err(&state[..sl], &want_b_state) < TOL);
        let (want_a, a_state) = reference(&inp1, 0..5, &vec![0.0; sl]);
        assert!(max_err(&o1[..5 * ow], &want_a) < TOL);
        let (want_a2, a_state2) = reference(&inp2, 0..1, &a_state);
        assert!(max_err(&o2, &want_a2) < TOL);
        assert!(max_err(&state[sl..], &a_state2) < TOL);
    }
}
