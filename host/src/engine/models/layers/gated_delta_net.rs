//! The Gated DeltaNet (linear-attention) layer of the hybrid Qwen models:
//! transformers' `Qwen3NextGatedDeltaNet` and `Qwen3_5GatedDeltaNet`.
//!
//! Per token: one projection gives q, k, v (the convolution's channels,
//! `[q heads | k heads | v heads]`), the output gate `z`, and per value
//! head a beta logit `b` and a decay input `a`. q|k|v go through the short
//! causal conv1d and SiLU, then the gated delta rule (its state per value
//! head), whose output is RMS-normalized per head and gated by `silu(z)`
//! before `out_proj`. The conv and delta-rule states live in per-sequence
//! slots the caller owns ([`RecurrentState`]).
//!
//! The two checkpoint forms differ only in how the projection is stored:
//! - Qwen3-Next: `in_proj_qkvz` (`[2·key_dim + 2·value_dim, hidden]`) and
//!   `in_proj_ba` (`[2·n_v_heads, hidden]`), their rows grouped by key
//!   head: for each key head `[q | k | v of its r value heads | z of them]`
//!   and `[b of its r value heads | a of them]` (`r = n_v / n_k`), which
//!   transformers regroups after the matmul (`fix_query_key_value_ordering`).
//!   Here the rows are regrouped once at load instead, so the matmul writes
//!   the layout below directly.
//! - Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, already
//!   in that layout.
//!
//! Both become one projection of `[q | k | v | z | b | a]` per token.

use super::projection::Projection;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{ConvSpec, GatedDeltaSpec};
use pagoda_accel::{Backend, BackendError, HostMatrix, Rows};

use crate::engine::loader::WeightSource;

/// The layer's shape (from the config's `linear_*` keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GdnShape {
    pub hidden: usize,
    pub heads: GatedDeltaSpec,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// `rms_norm_eps`, of the gated norm.
    pub eps: f32,
}

impl GdnShape {
    /// `n_k_heads · k_dim`.
    pub fn key_dim(&self) -> usize {
        self.heads.n_k_heads * self.heads.k_dim
    }
    /// `n_v_heads · v_dim`.
    pub fn value_dim(&self) -> usize {
        self.heads.n_v_heads * self.heads.v_dim
    }
    /// The convolution's channels: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Width of the fused projection's output, `[q | k | v | z | b | a]`.
    pub fn proj_width(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.heads.n_v_heads
    }
    fn conv(&self) -> ConvSpec {
        ConvSpec {
            channels: self.conv_dim(),
            kernel: self.conv_kernel,
        }
    }
}

/// Which checkpoint layout the projections are stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// `in_proj_qkvz` and `in_proj_ba`, grouped by key head.
    Qwen3Next,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Qwen35,
}

/// One layer's recurrent state for every slot: the conv history
/// (`[slots, kernel - 1, conv_dim]`) and the delta rule's matrices
/// (`[slots, n_v_heads, k_dim, v_dim]`).
pub struct RecurrentState<B: Backend> {
    pub conv: B::Buffer,
    pub delta: B::Buffer,
    /// Values of one slot's conv state and delta-rule state.
    pub(crate) conv_len: usize,
    pub(crate) delta_len: usize,
}

impl<B: Backend> RecurrentState<B> {
    /// State for `slots` sequences of a layer of `shape`.
    pub fn alloc(b: &mut B, shape: &GdnShape, slots: usize) -> Result<Self, BackendError> {
        let mut s = RecurrentState {
            conv: B::Buffer::default(),
            delta: B::Buffer::default(),
            conv_len: shape.conv().state_len(),
            delta_len: shape.heads.state_len(),
        };
        b.reserve(&mut s.conv, slots * shape.conv().state_len())?;
        b.reserve(&mut s.delta, slots * shape.heads.state_len())?;
        Ok(s)
    }
}

/// The layer's activations, reused across steps.
pub struct GdnWorkspace<B: Backend> {
    /// The projection's output, `[tokens, proj_width]`.
    proj: B::Buffer,
    /// A split projection's part (see [`Projection::matmul`]).
    split_tmp: B::Buffer,
    /// q|k|v after the convolution.
    qkv: B::Buffer,
    /// The delta rule's output, `[tokens, value_dim]`.
    core: B::Buffer,
    /// After the gated norm.
    normed: B::Buffer,
}

impl<B: Backend> Default for GdnWorkspace<B> {
    fn default() -> Self {
        GdnWorkspace {
            proj: Default::default(),
            split_tmp: Default::default(),
            qkv: Default::default(),
            core: Default::default(),
            normed: Default::default(),
        }
    }
}

/// One Gated DeltaNet layer on the device.
pub struct GatedDeltaNet<B: Backend> {
    shape: GdnShape,
    /// `[q | k | v | z | b | a]` rows.
    in_proj: Projection<B>,
    /// `[kernel, conv_dim]`, tap-major.
    conv_w: B::Vector,
    a_log: B::Vector,
    dt_bias: B::Vector,
    /// The gated norm's weight, `[v_dim]`.
    norm: B::Vector,
    out_proj: B::Matrix,
}

/// Rows `r0..r1` of `m`, borrowing its bytes.
pub(crate) fn row_range<'a>(m: &'a HostMatrix<'_>, r0: usize, r1: usize) -> Result<HostMatrix<'a>> {
    if m.affine().is_some() {
        // The transforms are stated for the whole matrix; slicing them is
        // not implemented.
        bail!("regrouping the rows of a transformed (affine) matrix is not supported");
    }
    let per_row = m.bytes().len() / m.rows();
    Ok(HostMatrix::new(
        m.ty(),
        r1 - r0,
        m.cols(),
        &m.bytes()[r0 * per_row..r1 * per_row],
    )?)
}

impl<B: Backend> GatedDeltaNet<B> {
    /// Loads the layer under `prefix` (`model.layers.N.linear_attn`) with
    /// transformers' tensor names for `form`.
    ///
    /// `conv1d.weight` is read as a `[conv_dim, kernel]` matrix: GGUF
    /// stores it so; a safetensors loader must drop the middle dimension of
    /// transformers' `[conv_dim, 1, kernel]`.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        shape: GdnShape,
        form: GdnForm,
        prefix: &str,
    ) -> Result<GatedDeltaNet<B>> {
        let (d, nv) = (shape.hidden, shape.heads.n_v_heads);
        let (kd, vd, cd) = (shape.key_dim(), shape.value_dim(), shape.conv_dim());
        let p = |s: &str| format!("{prefix}.{s}");
        let in_proj = match form {
            GdnForm::Qwen35 => Projection::new(
                backend,
                vec![
                    source.matrix(&p("in_proj_qkv.weight"), cd, d)?,
                    source.matrix(&p("in_proj_z.weight"), vd, d)?,
                    source.matrix(&p("in_proj_b.weight"), nv, d)?,
                    source.matrix(&p("in_proj_a.weight"), nv, d)?,
                ],
            ),
            GdnForm::Qwen3Next => {
                let qkvz = source.matrix(&p("in_proj_qkvz.weight"), 2 * kd + 2 * vd, d)?;
                let ba = source.matrix(&p("in_proj_ba.weight"), 2 * nv, d)?;
                let GatedDeltaSpec {
                    n_k_heads: nk,
                    k_dim: dk,
                    v_dim: dv,
                    ..
                } = shape.heads;
                let r = nv / nk;
                // Per key head: q (dk) | k (dk) | v (r·dv) | z (r·dv) rows,
                // and b (r) | a (r) rows.
                let group = 2 * dk + 2 * r * dv;
                let offsets = [
                    (0, dk),
                    (dk, dk),
                    (2 * dk, r * dv),
                    (2 * dk + r * dv, r * dv),
                ];
                let mut parts = Vec::with_capacity(6 * nk);
                for &(off, len) in &offsets {
                    for h in 0..nk {
                        let r0 = h * group + off;
                        parts.push(row_range(&qkvz, r0, r0 + len)?);
                    }
                }
                for off in [0, r] {
                    for h in 0..nk {
                        let r0 = h * 2 * r + off;
                        parts.push(row_range(&ba, r0, r0 + r)?);
                    }
                }
                Projection::new(backend, parts)
            }
        }
        .with_context(|| format!("{}: {prefix} input projections", source.describe()))?;
        let conv = source.matrix(&p("conv1d.weight"), cd, shape.conv_kernel)?;
        let conv = conv
            .dequantize()
            .with_context(|| format!("{}: {prefix}.conv1d.weight", source.describe()))?;
        let vector = |name: &str, len| -> Result<B::Vector> {
            Ok(backend.upload_vector(&source.vector(&p(name), len)?)?)
        };
        let out_proj = backend
            .upload_matrix(&source.matrix(&p("out_proj.weight"), d, vd)?)
            .with_context(|| format!("{}: {prefix}.out_proj.weight", source.describe()))?;
        Ok(GatedDeltaNet {
            shape,
            in_proj,
            conv_w: backend.upload_vector(&tap_major(&conv, cd, shape.conv_kernel))?,
            a_log: vector("A_log", nv)?,
            dt_bias: vector("dt_bias", nv)?,
            norm: vector("norm.weight", shape.heads.v_dim)?,
            out_proj,
        })
    }

    /// The layer's shape.
    pub fn shape(&self) -> &GdnShape {
        &self.shape
    }

    /// The projections, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> impl Iterator<Item = &B::Matrix> {
        self.in_proj
            .parts()
            .iter()
            .chain(std::iter::once(&self.out_proj))
    }

    /// Runs the `n` tokens of the step whose normed hidden states are `h`
    /// (`[n, hidden]`) through the layer into `out` (`[n, hidden]`); the
    /// step's sequence `i` reads and updates slot `slots[i]` of `state`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n: usize,
        h: &B::Buffer,
        state: &mut RecurrentState<B>,
        slots: &[u32],
        ws: &mut GdnWorkspace<B>,
        out: &mut B::Buffer,
    ) -> Result<(), BackendError> {
        let s = &self.shape;
        let (w, cd, vd) = (s.proj_width(), s.conv_dim(), s.value_dim());
        b.reserve(&mut ws.proj, n * w)?;
        b.reserve(&mut ws.qkv, n * cd)?;
        b.reserve(&mut ws.core, n * vd)?;
        b.reserve(&mut ws.normed, n * vd)?;
        b.reserve(out, n * s.hidden)?;
        self.in_proj
            .matmul(b, h, n, &mut ws.proj, &mut ws.split_tmp, step)?;
        b.causal_conv1d(
            s.conv(),
            &ws.proj,
            w,
            &self.conv_w,
            &mut state.conv,
            slots,
            step,
            &mut ws.qkv,
        )?;
        b.gated_delta_rule(
            s.heads,
            &ws.qkv,
            &ws.proj,
            w,
            cd + vd,
            &self.a_log,
            &self.dt_bias,
            &mut state.delta,
            slots,
            step,
            &mut ws.core,
        )?;
        b.rms_norm_gated(
            &ws.core,
            &ws.proj,
            w,
            cd,
            &self.norm,
            s.eps,
            n,
            vd,
            &mut ws.normed,
        )?;
        b.matmul(&self.out_proj, &ws.normed, n, out, step, Rows::Tokens);
        Ok(())
    }
}

/// `[channels, kernel]` (the checkpoint's order, one channel's taps
/// together) to `[kernel, channels]` (the kernel's, one tap's channels
/// together).
fn tap_major(w: &[f32], channels: usize, kernel: usize) -> Vec<f32> {
    (0..kernel)
        .flat_map(|j| (0..channels).map(move |c| w[c * kernel + j]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_accel::{CpuBackend, CpuContext, StepBatch};
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    /// Tensors in memory, f32, under their checkpoint names.
    struct Tensors(HashMap<String, (Vec<usize>, Vec<f32>)>);

    impl WeightSource for Tensors {
        fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>> {
            let (shape, v) = self.0.get(name).context(name.to_string())?;
            assert_eq!(shape, &[rows, cols], "{name}");
            Ok(HostMatrix::from_f32(rows, cols, v)?)
        }
        fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
            let (shape, v) = self.0.get(name).context(name.to_string())?;
            assert_eq!(shape, &[len], "{name}");
            Ok(v.clone())
        }
        fn contains(&self, name: &str) -> bool {
            self.0.contains_key(name)
        }
        fn describe(&self) -> String {
            "test tensors".into()
        }
    }

    /// The layer in f64, written from transformers' modeling code: the
    /// projections (regrouped as `fix_query_key_value_ordering` does for
    /// Qwen3-Next), the whole-sequence zero-padded conv1d and SiLU,
    /// `l2norm`, the recurrence of `torch_recurrent_gated_delta_rule` with
    /// `repeat_interleave`d q/k heads, `Qwen3NextRMSNormGated`, `out_proj`.
    fn reference(t: &Tensors, s: &GdnShape, form: GdnForm, x: &[Vec<f32>]) -> Vec<Vec<f64>> {
        let get = |n: &str| &t.0[&format!("l.{n}")].1;
        let mv = |w: &[f32], rows: usize, x: &[f32]| -> Vec<f64> {
            (0..rows)
                .map(|r| {
                    (0..x.len())
                        .map(|c| w[r * x.len() + c] as f64 * x[c] as f64)
                        .sum()
                })
                .collect()
        };
        let GatedDeltaSpec {
            n_k_heads: nk,
            n_v_heads: nv,
            k_dim: dk,
            v_dim: dv,
        } = s.heads;
        let r = nv / nk;
        let (kd, vd, cd) = (s.key_dim(), s.value_dim(), s.conv_dim());
        // Per token: mixed q|k|v (conv input), z [nv][dv], b [nv], a [nv].
        let mut mixed = Vec::new();
        let mut zs = Vec::new();
        let mut bs = Vec::new();
        let mut as_ = Vec::new();
        for xt in x {
            let (mut q, mut k, mut v, mut z, mut b, mut a);
            match form {
                GdnForm::Qwen35 => {
                    let qkv = mv(get("in_proj_qkv.weight"), cd, xt);
                    q = qkv[..kd].to_vec();
                    k = qkv[kd..2 * kd].to_vec();
                    v = qkv[2 * kd..].to_vec();
                    z = mv(get("in_proj_z.weight"), vd, xt);
                    b = mv(get("in_proj_b.weight"), nv, xt);
                    a = mv(get("in_proj_a.weight"), nv, xt);
                }
                GdnForm::Qwen3Next => {
                    let qkvz = mv(get("in_proj_qkvz.weight"), 2 * kd + 2 * vd, xt);
                    let ba = mv(get("in_proj_ba.weight"), 2 * nv, xt);
                    (q, k, v, z, b, a) = (vec![], vec![], vec![], vec![], vec![], vec![]);
                    let g = 2 * dk + 2 * r * dv;
                    for h in 0..nk {
                        let grp = &qkvz[h * g..(h + 1) * g];
                        q.extend_from_slice(&grp[..dk]);
                        k.extend_from_slice(&grp[dk..2 * dk]);
                        v.extend_from_slice(&grp[2 * dk..2 * dk + r * dv]);
                        z.extend_from_slice(&grp[2 * dk + r * dv..]);
                        let bg = &ba[h * 2 * r..(h + 1) * 2 * r];
                        b.extend_from_slice(&bg[..r]);
                        a.extend_from_slice(&bg[r..]);
                    }
                }
            }
            mixed.push([q, k, v].concat());
            zs.push(z);
            bs.push(b);
            as_.push(a);
        }
        // conv1d (weight [cd][kernel]) with kernel-1 zeros of left padding.
        let cw = get("conv1d.weight");
        let kn = s.conv_kernel;
        let conv: Vec<Vec<f64>> = (0..x.len())
            .map(|t| {
                (0..cd)
                    .map(|c| {
                        let mut acc = 0.0;
                        for j in 0..kn {
                            if t + j + 1 >= kn {
                                acc += cw[c * kn + j] as f64 * mixed[t + j + 1 - kn][c];
                            }
                        }
                        acc / (1.0 + (-acc).exp())
                    })
                    .collect()
            })
            .collect();
        let (a_log, dt_bias, norm_w) = (get("A_log"), get("dt_bias"), get("norm.weight"));
        let mut state = vec![vec![0.0f64; dk * dv]; nv];
        let wo = get("out_proj.weight");
        let mut out = Vec::new();
        for t in 0..x.len() {
            let mut normed = vec![0.0; vd];
            for h in 0..nv {
                let kh = h / r;
                let l2 = |v: &[f64]| {
                    let n = v.iter().map(|a| a * a).sum::<f64>();
                    v.iter().map(|a| a / (n + 1e-6).sqrt()).collect::<Vec<_>>()
                };
                let q: Vec<f64> = l2(&conv[t][kh * dk..(kh + 1) * dk])
                    .iter()
                    .map(|v| v / (dk as f64).sqrt())
                    .collect();
                let k = l2(&conv[t][kd + kh * dk..kd + (kh + 1) * dk]);
                let v = &conv[t][2 * kd + h * dv..2 * kd + (h + 1) * dv];
                let beta = 1.0 / (1.0 + (-bs[t][h]).exp());
                let sp = (1.0 + (as_[t][h] + dt_bias[h] as f64).exp()).ln();
                let g = -(a_log[h] as f64).exp() * sp;
                let st = &mut state[h];
                st.iter_mut().for_each(|e| *e *= g.exp());
                let kv: Vec<f64> = (0..dv)
                    .map(|c| (0..dk).map(|i| st[i * dv + c] * k[i]).sum())
                    .collect();
                for i in 0..dk {
                    for c in 0..dv {
                        st[i * dv + c] += k[i] * (v[c] - kv[c]) * beta;
                    }
                }
                let o: Vec<f64> = (0..dv)
                    .map(|c| (0..dk).map(|i| st[i * dv + c] * q[i]).sum())
                    .collect();
                let ms = o.iter().map(|v| v * v).sum::<f64>() / dv as f64;
                let inv = 1.0 / (ms + s.eps as f64).sqrt();
                for c in 0..dv {
                    let z = zs[t][h * dv + c];
                    normed[h * dv + c] = o[c] * inv * norm_w[c] as f64 * z / (1.0 + (-z).exp());
                }
            }
            out.push(
                (0..s.hidden)
                    .map(|r| (0..vd).map(|c| wo[r * vd + c] as f64 * normed[c]).sum())
                    .collect(),
            );
        }
        out
    }

    fn tensors(rng: &mut rand::rngs::StdRng, s: &GdnShape, form: GdnForm) -> Tensors {
        let (d, nv) = (s.hidden, s.heads.n_v_heads);
        let (kd, vd, cd) = (s.key_dim(), s.value_dim(), s.conv_dim());
        let mut m = HashMap::new();
        let mut add = |name: &str, shape: Vec<usize>, lo: f32, hi: f32| {
            let n = shape.iter().product();
            let v = (0..n).map(|_| rng.random_range(lo..hi)).collect();
            m.insert(format!("l.{name}"), (shape, v));
        };
        let sc = 1.0 / (d as f32).sqrt();
        match form {
            GdnForm::Qwen35 => {
                add("in_proj_qkv.weight", vec![cd, d], -sc, sc);
                add("in_proj_z.weight", vec![vd, d], -sc, sc);
                add("in_proj_b.weight", vec![nv, d], -sc, sc);
                add("in_proj_a.weight", vec![nv, d], -sc, sc);
            }
            GdnForm::Qwen3Next => {
                add("in_proj_qkvz.weight", vec![2 * kd + 2 * vd, d], -sc, sc);
                add("in_proj_ba.weight", vec![2 * nv, d], -sc, sc);
            }
        }
        add("conv1d.weight", vec![cd, s.conv_kernel], -0.6, 0.6);
        add("A_log", vec![nv], -0.7, 2.7);
        add("dt_bias", vec![nv], -1.0, 1.0);
        add("norm.weight", vec![s.heads.v_dim], 0.5, 1.5);
        add("out_proj.weight", vec![d, vd], -sc, sc);
        Tensors(m)
    }

    #[test]
    fn gated_delta_net_matches_f64_reference_in_both_forms() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        for form in [GdnForm::Qwen3Next, GdnForm::Qwen35] {
            // The fixtures' shape (2 key heads, 4 value heads of 16), and
            // one with 3 value heads per key head and unequal head sizes.
            for (nk, nv, dk, dv) in [(2usize, 4usize, 16usize, 16usize), (1, 3, 12, 20)] {
                let shape = GdnShape {
                    hidden: 24,
                    heads: GatedDeltaSpec {
                        n_k_heads: nk,
                        n_v_heads: nv,
                        k_dim: dk,
                        v_dim: dv,
                    },
                    conv_kernel: 4,
                    eps: 1e-6,
                };
                let t = tensors(&mut rng, &shape, form);
                let mut be = CpuBackend::new(CpuContext::new(2), pagoda_accel::cpu::simd_level());
                let layer = GatedDeltaNet::load(&be, &t, shape, form, "l").unwrap();
                // Two sequences: A's 9 tokens as prefill chunks of 5 and 3
                // then a decode; B's 5 as 4 then 1, beside A's.
                let len = [9usize, 5];
                let xs: Vec<Vec<Vec<f32>>> = len
                    .iter()
                    .map(|&n| {
                        (0..n)
                            .map(|_| (0..24).map(|_| rng.random_range(-1.5..1.5)).collect())
                            .collect()
                    })
                    .collect();
                let steps: [&[(usize, usize, usize)]; 3] = [
                    &[(0, 0, 5), (1, 0, 4)],
                    &[(0, 5, 3), (1, 4, 1)],
                    &[(0, 8, 1)],
                ];
                // Sequence i in slot 1 - i; slots start as garbage.
                let mut state = RecurrentState::alloc(&mut be, &shape, 2).unwrap();
                state.conv.iter_mut().for_each(|v| *v = 3.0);
                state.delta.iter_mut().for_each(|v| *v = 3.0);
                let mut ws = GdnWorkspace::default();
                let mut got = vec![Vec::new(), Vec::new()];
                for st in steps {
                    let mut batch = StepBatch::default();
                    let mut h = Vec::new();
                    let mut slots = Vec::new();
                    for &(seq, start, n) in st {
                        batch.push_seq(&vec![1; n], start, &[0], 16, 0, 1);
                        h.extend(xs[seq][start..start + n].iter().flatten().copied());
                        slots.push(1 - seq as u32);
                    }
                    let mut step = Default::default();
                    be.upload_step(&batch, &mut step).unwrap();
                    let mut out = Vec::new();
                    let n = batch.num_tokens();
                    layer
                        .forward(&mut be, &step, n, &h, &mut state, &slots, &mut ws, &mut out)
                        .unwrap();
                    let mut row = 0;
                    for &(seq, _, n) in st {
                        for _ in 0..n {
                            got[seq].push(out[row * 24..(row + 1) * 24].to_vec());
                            row += 1;
                        }
                    }
                }
                for seq in 0..2 {
                    let want = reference(&t, &shape, form, &xs[seq]);
                    let scale = want.iter().flatten().fold(1e-3f64, |m, v| m.max(v.abs()));
                    for (tk, (g, w)) in got[seq].iter().zip(&want).enumerate() {
                        for (c, (&g, &w)) in g.iter().zip(w).enumerate() {
                            assert!(
                                (g as f64 - w).abs() <= 1e-5 * scale,
                                "{form:?} {:?} seq {seq} token {tk} [{c}]: {g} vs {w} (scale {scale})",
                                shape.heads
                            );
                        }
                    }
                }
            }
        }
    }
}
