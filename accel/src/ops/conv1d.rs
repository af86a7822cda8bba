//! The short causal convolution of Gated DeltaNet layers (Qwen3-Next,
//! Qwen3.5): a depthwise conv1d of `kernel` taps over each channel of the
//! projected q, k and v, followed by SiLU, as transformers'
//! `Qwen3NextGatedDeltaNet` applies `conv1d` then `silu`.
//!
//! A sequence's output at token `t` reads its inputs at `t - kernel + 1 ..=
//! t`; the inputs before the step's first token come from the sequence's
//! conv state (its last `kernel - 1` inputs, kept in a state slot between
//! steps), or are zero for a sequence that starts at position 0 (the zero
//! padding of the whole-prompt convolution). So a prompt run in one step,
//! in chunks, or token by token gives the same numbers: each output is the
//! same `kernel` products summed in the same order, whichever step holds
//! its inputs.

use super::recurrent::{check_slots, RecurrentSeq, SendPtr};
use super::simd::{check_level, dispatch, Kernel, Simd};
use crate::cpu::{simd_level, SimdLevel};
use crate::ThreadPool;

/// Channels one task convolves: a multiple of every lane count, and small
/// enough that a decode step of one sequence still spreads over the pool.
const CHANNEL_BLOCK: usize = 256;

/// The convolution's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSpec {
    /// Channels (`2 · key_dim + value_dim` for Gated DeltaNet).
    pub channels: usize,
    /// Taps (`linear_conv_kernel_dim`).
    pub kernel: usize,
}

impl ConvSpec {
    /// Values of one sequence's conv state: its last `kernel - 1` inputs,
    /// `[kernel - 1, channels]`, oldest first.
    pub fn state_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }
}

/// Causal depthwise conv1d of every sequence's tokens, then SiLU:
/// `out[t][c] = silu(Σ_j weight[j][c] · in(t - (kernel-1) + j)[c])`, where
/// `in(i)` is row `i` of the sequence's tokens in `x` (`x[row · x_stride +
/// c]`, so `x` may be a wider projection's output whose first `channels`
/// columns are the conv's input) for `i ≥ 0`, and its conv state before
/// that. `weight` is `[kernel, channels]`, tap-major (transformers'
/// `conv1d.weight` `[channels, 1, kernel]` transposed, so taps of adjacent
/// channels are adjacent); tap `kernel - 1` multiplies the current token.
///
/// `state` holds one conv state per slot (`[slots, kernel - 1, channels]`);
/// each sequence reads and updates the one at `seq.slot`, except that a
/// sequence whose first token is at position 0 starts from zeros whatever
/// its slot holds. `out` is `[tokens, channels]`.
///
/// # Panics
/// If a length disagrees with the shapes, `kernel < 2`, or two sequences
/// share a slot.
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d_silu(
    pool: &ThreadPool,
    spec: ConvSpec,
    x: &[f32],
    x_stride: usize,
    weight: &[f32],
    seqs: &[RecurrentSeq],
    state: &mut [f32],
    out: &mut [f32],
) {
    causal_conv1d_silu_at(
        simd_level(),
        pool,
        spec,
        x,
        x_stride,
        weight,
        seqs,
        state,
        out,
    )
}

/// [`causal_conv1d_silu`] at an explicit SIMD level (tests cover every
/// level).
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_conv1d_silu_at(
    level: SimdLevel,
    pool: &ThreadPool,
    spec: ConvSpec,
    x: &[f32],
    x_stride: usize,
    weight: &[f32],
    seqs: &[RecurrentSeq],
    state: &mut [f32],
    out: &mut [f32],
) {
    check_level(level);
    let ConvSpec { channels, kernel } = spec;
    assert!(
        channels > 0 && kernel >= 2,
        "causal_conv1d: {channels} channels, kernel {kernel}"
    );
    assert!(x_stride >= channels, "causal_conv1d: x_stride < channels");
    assert_eq!(weight.len(), kernel * channels, "causal_conv1d: weight");
    let tokens: usize = seqs.iter().map(|s| s.q_start + s.q_len).max().unwrap_or(0);
    assert!(
        tokens == 0 || x.len() >= (tokens - 1) * x_stride + channels,
        "causal_conv1d: x holds fewer than {tokens} rows"
    );
    assert!(
        out.len() >= tokens * channels,
        "causal_conv1d: out holds fewer than {tokens} rows"
    );
    let slot_len = spec.state_len();
    check_slots("causal_conv1d", seqs, state.len(), slot_len);

    let blocks = channels.div_ceil(CHANNEL_BLOCK);
    let (out_p, state_p) = (SendPtr(out.as_mut_ptr()), SendPtr(state.as_mut_ptr()));
    pool.run(seqs.len() * blocks, &|task| {
        let seq = &seqs[task / blocks];
        let c0 = (task % blocks) * CHANNEL_BLOCK;
        let c1 = (c0 + CHANNEL_BLOCK).min(channels);
        let (out_p, state_p) = (&out_p, &state_p);
        // SAFETY: `check_level` confirmed the CPU supports `level`. The
        // task writes rows `seq.q_start..+q_len` of `out` and slot
        // `seq.slot` of `state`, columns `c0..c1` only: sequences' rows
        // and slots are disjoint (checked above and by the caller's
        // layout) and blocks split the columns, so no two tasks touch the
        // same element, and `pool.run` returns before the borrows end.
        unsafe {
            dispatch(
                level,
                ConvTask {
                    x,
                    x_stride,
                    weight,
                    channels,
                    kernel,
                    seq,
                    c0,
                    c1,
                    out: out_p.0,
                    state: state_p.0.add(seq.slot * slot_len),
                },
            )
        }
    });
}

struct ConvTask<'a> {
    x: &'a [f32],
    x_stride: usize,
    weight: &'a [f32],
    channels: usize,
    kernel: usize,
    seq: &'a RecurrentSeq,
    c0: usize,
    c1: usize,
    out: *mut f32,
    /// This sequence's slot, `[kernel - 1, channels]`.
    state: *mut f32,
}

impl Kernel for ConvTask<'_> {
    type Output = ();
    #[inline(always)]
    unsafe fn run<S: Simd>(self) {
        let (ch, k, hist) = (self.channels, self.kernel, self.kernel - 1);
        let (q0, n) = (self.seq.q_start, self.seq.q_len);
        let fresh = self.seq.start_pos == 0;
        let l = S::LANES;
        let w = self.weight.as_ptr();
        // Input `i` of this step (negative: the history) at channel `c`.
        // SAFETY (all accesses of this function): rows `q0..q0 + n` of `x`
        // and `out` and the slot's `hist` rows exist (checked by the
        // caller), and every column is below `c1 <= channels`.
        let input = |i: isize, c: usize| -> *const f32 {
            if i >= 0 {
                unsafe { self.x.as_ptr().add((q0 + i as usize) * self.x_stride + c) }
            } else {
                unsafe { self.state.add((hist as isize + i) as usize * ch + c) }
            }
        };
        let zero = [0.0f32; 16];
        for t in 0..n {
            let o = unsafe { self.out.add((q0 + t) * ch) };
            let mut c = self.c0;
            while c + l <= self.c1 {
                unsafe {
                    let mut acc = S::zero();
                    for j in 0..k {
                        let i = t as isize + j as isize - hist as isize;
                        let xv = if i < 0 && fresh {
                            S::load(zero.as_ptr())
                        } else {
                            S::load(input(i, c))
                        };
                        acc = S::fma(S::load(w.add(j * ch + c)), xv, acc);
                    }
                    let e = S::exp(S::sub(S::zero(), acc));
                    S::store(o.add(c), S::div(acc, S::add(S::splat(1.0), e)));
                }
                c += l;
            }
            while c < self.c1 {
                unsafe {
                    let mut acc = 0.0f32;
                    for j in 0..k {
                        let i = t as isize + j as isize - hist as isize;
                        let xv = if i < 0 && fresh { 0.0 } else { *input(i, c) };
                        acc = S::fma1(*w.add(j * ch + c), xv, acc);
                    }
                    *o.add(c) = acc / (1.0 + (-acc).exp());
                }
                c += 1;
            }
        }
        // The new history: the last `hist` inputs, i.e. inputs `n - hist ..
        // n`. Row `r` takes input `n - hist + r`, which is either a token of
        // this step or the old history's row `r + n`; rows are rewritten in
        // increasing order, so an old row is read before it is overwritten.
        for r in 0..hist {
            let i = n as isize - hist as isize + r as isize;
            unsafe {
                let dst = self.state.add(r * ch);
                if i < 0 && fresh {
                    for c in self.c0..self.c1 {
                        *dst.add(c) = 0.0;
                    }
                } else {
                    let src = input(i, 0);
                    for c in self.c0..self.c1 {
                        *dst.add(c) = *src.add(c);
                    }
                }
            }
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

    /// The whole-sequence convolution in f64 with zero padding, written from
    /// its definition (PyTorch's `conv1d` with `padding = kernel - 1`, first
    /// `len` outputs, then SiLU); `w` is `[channels][kernel]` as transformers
    /// stores it.
    fn reference(x: &[Vec<f32>], w: &[Vec<f32>]) -> Vec<Vec<f64>> {
        let k = w[0].len();
        (0..x.len())
            .map(|t| {
                (0..w.len())
                    .map(|c| {
                        let mut s = 0.0f64;
                        for (j, &wj) in w[c].iter().enumerate() {
                            // padded index t + j  ->  input t + j - (k - 1)
                            if t + j >= k - 1 {
                                s += wj as f64 * x[t + j - (k - 1)][c] as f64;
                            }
                        }
                        s / (1.0 + (-s).exp())
                    })
                    .collect()
            })
            .collect()
    }

    /// Runs a sequence through the op in steps of the given sizes (one
    /// sequence per call, in slot 1 of a 3-slot state), with the input rows
    /// at a stride wider than the channels; returns the outputs.
    fn run_in_steps(
        level: SimdLevel,
        pool: &ThreadPool,
        x: &[Vec<f32>],
        w: &[Vec<f32>],
        steps: &[usize],
    ) -> Vec<Vec<f32>> {
        let (ch, k) = (w.len(), w[0].len());
        let spec = ConvSpec {
            channels: ch,
            kernel: k,
        };
        let stride = ch + 5;
        let tw: Vec<f32> = (0..k).flat_map(|j| w.iter().map(move |r| r[j])).collect();
        // Garbage in every slot: a fresh sequence must not read it.
        let mut state = vec![1e3f32; 3 * spec.state_len()];
        let mut outs = Vec::new();
        let mut pos = 0;
        for &n in steps {
            // The step's rows sit after two rows of another sequence's.
            let mut xs = vec![f32::NAN; (n + 2) * stride];
            for i in 0..n {
                xs[(i + 2) * stride..(i + 2) * stride + ch].copy_from_slice(&x[pos + i]);
            }
            let mut out = vec![f32::NAN; (n + 2) * ch];
            let seqs = [RecurrentSeq {
                q_start: 2,
                q_len: n,
                start_pos: pos,
                slot: 1,
            }];
            causal_conv1d_silu_at(
                level, pool, spec, &xs, stride, &tw, &seqs, &mut state, &mut out,
            );
            assert!(
                out[..2 * ch].iter().all(|v| v.is_nan()),
                "wrote another sequence's rows"
            );
            outs.extend(out[2 * ch..].chunks(ch).map(|r| r.to_vec()));
            pos += n;
        }
        assert!(
            state[..spec.state_len()]
                .iter()
                .chain(&state[2 * spec.state_len()..])
                .all(|&v| v == 1e3),
            "touched another slot"
        );
        outs
    }

    #[test]
    fn conv_matches_reference_whole_chunked_and_token_by_token() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let pool = ThreadPool::new(3);
        // Channel counts around the lane widths and the task block.
        for &(ch, k, len) in &[
            (1usize, 2usize, 5usize),
            (37, 4, 23),
            (300, 4, 40),
            (64, 3, 9),
        ] {
            let x: Vec<Vec<f32>> = (0..len)
                .map(|_| (0..ch).map(|_| rng.random_range(-4.0..4.0)).collect())
                .collect();
            let w: Vec<Vec<f32>> = (0..ch)
                .map(|_| (0..k).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let want = reference(&x, &w);
            let mut splits = vec![vec![len], vec![1; len]];
            let mut uneven = vec![];
            let mut left = len;
            for n in [2usize, 1, 5, 3, 7].iter().cycle() {
                let n = (*n).min(left);
                uneven.push(n);
                left -= n;
                if left == 0 {
                    break;
                }
            }
            splits.push(uneven);
            for level in levels() {
                let mut first = None;
                for steps in &splits {
                    let got = run_in_steps(level, &pool, &x, &w, steps);
                    for t in 0..len {
                        for c in 0..ch {
                            let (g, r) = (got[t][c] as f64, want[t][c]);
                            assert!(
                                (g - r).abs() <= 1e-5 * r.abs().max(1.0),
                                "{level:?} ch {ch} k {k} steps {steps:?} [{t}][{c}]: {g} vs {r}"
                            );
                        }
                    }
                    // Same products in the same order: the split changes no bit.
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert_eq!(f, &got, "{level:?}: split {steps:?} changed bits"),
                    }
                }
            }
        }
    }

    #[test]
    fn conv_runs_sequences_of_a_batch_independently() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (ch, k) = (40usize, 4usize);
        let spec = ConvSpec {
            channels: ch,
            kernel: k,
        };
        let w: Vec<f32> = (0..k * ch).map(|_| rng.random_range(-1.0..1.0)).collect();
        let lens = [3usize, 1, 6];
        let starts = [0usize, 9, 2];
        let slots = [2usize, 0, 1];
        let total: usize = lens.iter().sum();
        let x: Vec<f32> = (0..total * ch)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let state0: Vec<f32> = (0..3 * spec.state_len())
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let mut seqs = Vec::new();
        let mut q = 0;
        for i in 0..3 {
            seqs.push(RecurrentSeq {
                q_start: q,
                q_len: lens[i],
                start_pos: starts[i],
                slot: slots[i],
            });
            q += lens[i];
        }
        let (pool1, pool3) = (ThreadPool::new(1), ThreadPool::new(3));
        let (mut s_all, mut o_all) = (state0.clone(), vec![0f32; total * ch]);
        causal_conv1d_silu(&pool3, spec, &x, ch, &w, &seqs, &mut s_all, &mut o_all);
        // Each sequence alone, on one thread, gives the same bits.
        let (mut s_one, mut o_one) = (state0.clone(), vec![0f32; total * ch]);
        for s in &seqs {
            causal_conv1d_silu(&pool1, spec, &x, ch, &w, &[*s], &mut s_one, &mut o_one);
        }
        assert_eq!(o_all, o_one);
        assert_eq!(s_all, s_one);
        // The sequence at a later position used its slot's history: its
        // first output differs from a fresh start's.
        let mut fresh = seqs[1];
        fresh.start_pos = 0;
        let (mut s_f, mut o_f) = (state0.clone(), vec![0f32; total * ch]);
        causal_conv1d_silu(&pool1, spec, &x, ch, &w, &[fresh], &mut s_f, &mut o_f);
        assert_ne!(o_f[3 * ch..4 * ch], o_all[3 * ch..4 * ch]);
    }

    #[test]
    #[should_panic(expected = "share slot")]
    fn conv_refuses_shared_slots() {
        let spec = ConvSpec {
            channels: 4,
            kernel: 2,
        };
        let seqs = [
            RecurrentSeq {
                q_start: 0,
                q_len: 1,
                start_pos: 0,
                slot: 0,
            },
            RecurrentSeq {
                q_start: 1,
                q_len: 1,
                start_pos: 0,
                slot: 0,
            },
        ];
        let mut state = vec![0f32; 4];
        let mut out = vec![0f32; 8];
        causal_conv1d_silu(
            &ThreadPool::new(1),
            spec,
            &[0.0; 8],
            4,
            &[0.0; 8],
            &seqs,
            &mut state,
            &mut out,
        );
    }
}
