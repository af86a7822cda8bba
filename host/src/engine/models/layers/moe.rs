//! A sparse mixture-of-experts feed-forward block: a router picks each
//! token's top-k experts (SwiGLU MLPs of their own), and the block's output
//! is their outputs weighted by the router; Qwen2-MoE adds a shared expert
//! behind a sigmoid gate.
//!
//! Every expert's weights are read once per step for all the tokens routed
//! to it: the tokens are grouped by expert ([`Backend::gather_routed`]),
//! each group runs through its expert ([`Backend::grouped_matmul`]), and
//! the results go back to their tokens, weighted
//! ([`Backend::scatter_routed`]). No loop over tokens or experts here.

use super::mlp::GatedMlp;
use super::{load_matrix, load_vector, Workspace};
use crate::engine::config::{ModelConfig, MoeConfig};
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::RouterSpec;
use pagoda_accel::{Backend, BackendError, HostMatrix, Rows};

/// Which of an expert's three projections a tensor name is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

/// HF's per-expert names under `prefix` (Qwen-MoE's and DeepSeek's
/// `mlp`): `{prefix}.experts.E.{gate_proj,up_proj,down_proj}.weight`.
pub fn hf_expert_names(prefix: String) -> impl Fn(usize, ExpertPart) -> String {
    move |e, part| {
        let w = match part {
            ExpertPart::Gate => "gate_proj",
            ExpertPart::Up => "up_proj",
            ExpertPart::Down => "down_proj",
        };
        format!("{prefix}.experts.{e}.{w}.weight")
    }
}

/// The tensor names of one MoE block, as the family writes them.
pub struct MoeNames<'a> {
    /// The router's `[n_experts, hidden]` weight.
    pub router: String,
    /// The tensor of expert `e`'s part.
    pub expert: &'a dyn Fn(usize, ExpertPart) -> String,
    /// The router's `e_score_correction_bias` (DeepSeek-V3).
    pub bias: Option<String>,
    /// The shared expert's prefix (`gate_proj`, … under it), and for
    /// Qwen2-MoE its gate's `[1, hidden]` weight.
    pub shared: Option<(String, Option<String>)>,
}

/// The routed experts' gate and up projections: fused per expert (one
/// grouped matmul) when their storage allows, else apart.
enum GateUp<B: Backend> {
    Fused(Vec<B::Matrix>),
    Split {
        gate: Vec<B::Matrix>,
        up: Vec<B::Matrix>,
    },
}

/// The activation between an expert's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// `silu(gate) · up`.
    SiluMul,
    /// gpt-oss's clamped SwiGLU ([`pagoda_accel::ops::swiglu_clamped`]).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// One sparse MoE block on the device.
pub struct SparseMoe<B: Backend> {
    /// f32, whatever the checkpoint's dtype: the routing is f32 math.
    router: B::Matrix,
    /// Added to the router's logits (gpt-oss's `router.bias`), before both
    /// the choice and the weights.
    router_bias: Option<B::Vector>,
    /// Added to the scores for the choice only.
    bias: Option<B::Vector>,
    spec: RouterSpec,
    gate_up: GateUp<B>,
    down: Vec<B::Matrix>,
    /// Each expert's gate|up bias (`[n_experts, 2·ffn]`) and down bias
    /// (`[n_experts, hidden]`), where the experts have biases (gpt-oss).
    expert_bias: Option<(B::Vector, B::Vector)>,
    act: ExpertAct,
    /// The shared expert, and its sigmoid gate where it has one.
    shared: Option<(GatedMlp<B>, Option<B::Matrix>)>,
    hidden: usize,
    ffn: usize,
}

/// Uploads `m` as f32 (exact for every float type a checkpoint holds).
fn upload_f32<B: Backend>(backend: &B, m: &HostMatrix<'_>) -> Result<B::Matrix> {
    let f = HostMatrix::from_f32(m.rows(), m.cols(), &m.dequantize()?)?;
    Ok(backend.upload_matrix(&f)?)
}

impl<B: Backend> SparseMoe<B> {
    /// Loads the block `names` describes for a model of shape `c`.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        c: &ModelConfig,
        moe: &MoeConfig,
        names: &MoeNames<'_>,
    ) -> Result<SparseMoe<B>> {
        let (d, f, e) = (c.hidden_size, moe.expert_ffn, moe.n_experts);
        let spec = router_spec(source, moe)?;
        let router = upload_f32(backend, &source.matrix(&names.router, e, d)?)
            .with_context(|| format!("{}: tensor '{}'", source.describe(), names.router))?;
        let bias = match (&names.bias, moe.score_bias) {
            (Some(name), true) => Some(load_vector(backend, source, name, e)?),
            _ => None,
        };
        let mut pairs = Vec::with_capacity(e);
        let mut down = Vec::with_capacity(e);
        for x in 0..e {
            pairs.push([
                source.matrix(&(names.expert)(x, ExpertPart::Gate), f, d)?,
                source.matrix(&(names.expert)(x, ExpertPart::Up), f, d)?,
            ]);
            let name = (names.expert)(x, ExpertPart::Down);
            down.push(load_matrix(backend, source, &name, d, f)?);
        }
        let gate_up = if pairs.iter().all(|p| HostMatrix::can_concat(p)) {
            let mut fused = Vec::with_capacity(e);
            for p in &pairs {
                fused.push(backend.upload_matrix(&HostMatrix::concat_rows(p)?)?);
            }
            GateUp::Fused(fused)
        } else {
            let (mut gate, mut up) = (Vec::with_capacity(e), Vec::with_capacity(e));
            for [g, u] in &pairs {
                gate.push(backend.upload_matrix(g)?);
                up.push(backend.upload_matrix(u)?);
            }
            GateUp::Split { gate, up }
        };
        drop(pairs);
        let shared = match (&names.shared, moe.shared_ffn) {
            (Some((prefix, gate_name)), Some(sf)) => {
                let mlp = GatedMlp::load(backend, source, prefix, d, sf, false)?;
                let gate = match (gate_name, moe.shared_gated) {
                    (Some(g), true) => Some(
                        upload_f32(backend, &source.matrix(g, 1, d)?)
                            .with_context(|| format!("{}: tensor '{g}'", source.describe()))?,
                    ),
                    _ => None,
                };
                Some((mlp, gate))
            }
            _ => None,
        };
        Ok(SparseMoe {
            router,
            router_bias: None,
            bias,
            spec,
            gate_up,
            down,
            expert_bias: None,
            act: ExpertAct::SiluMul,
            shared,
            hidden: d,
            ffn: f,
        })
    }

    /// Loads a block whose experts are stored fused, as transformers'
    /// `GptOssExperts` writes them under `prefix` (`model.layers.N.mlp`):
    /// `experts.gate_up_proj` `[experts, hidden, 2·ffn]` (applied as `x @
    /// W`, gate and up in alternating columns), `experts.gate_up_proj_bias`
    /// `[experts, 2·ffn]` (alternating likewise), `experts.down_proj`
    /// `[experts, ffn, hidden]`, `experts.down_proj_bias` `[experts,
    /// hidden]`; and the router's `router.weight` and `router.bias`. The
    /// columns are split into gate|up rows at load, so the device runs
    /// the same grouped matmuls as for per-expert checkpoints; `act` is
    /// the activation between them.
    pub fn load_fused(
        backend: &B,
        source: &dyn WeightSource,
        c: &ModelConfig,
        moe: &MoeConfig,
        prefix: &str,
        act: ExpertAct,
    ) -> Result<SparseMoe<B>> {
        let (d, f, e) = (c.hidden_size, moe.expert_ffn, moe.n_experts);
        let spec = router_spec(source, moe)?;
        let p = |s: &str| format!("{prefix}.{s}");
        let router_name = p("router.weight");
        let router = upload_f32(backend, &source.matrix(&router_name, e, d)?)
            .with_context(|| format!("{}: tensor '{router_name}'", source.describe()))?;
        let router_bias = load_vector(backend, source, &p("router.bias"), e)?;
        let gub = source
            .stacked(&p("experts.gate_up_proj_bias"), &[e, 2 * f])?
            .0;
        let db = source.stacked(&p("experts.down_proj_bias"), &[e, d])?.0;
        let mut gu_bias = Vec::with_capacity(e * 2 * f);
        for b in gub.chunks_exact(2 * f) {
            gu_bias.extend((0..f).map(|j| b[2 * j]));
            gu_bias.extend((0..f).map(|j| b[2 * j + 1]));
        }
        // Row j of gate (j < f) is output 2j of the checkpoint's fused
        // expert, row f + j of up its output 2j + 1.
        let (gate_up, down) = match (
            source.mxfp4_stack(&p("experts.gate_up_proj"), e, 2 * f, d)?,
            source.mxfp4_stack(&p("experts.down_proj"), e, d, f)?,
        ) {
            // MXFP4 checkpoints: the experts stay MXFP4 (17 bytes per 32
            // values), stored `[out, in]` already; only gate and up rows
            // are taken apart.
            (Some(gu), Some(dn)) => {
                let ty = pagoda_accel::GgmlType::MXFP4;
                // Hugging Face's MXFP4 keeps f32 activations, GGUF's are
                // 8-bit as in llama.cpp (see `pagoda_accel::quant::mxfp4`).
                let f32_act = source.mxfp4_f32_activations();
                let (gu_row, dn_mat) = (ty.row_bytes(d)?, d * ty.row_bytes(f)?);
                let mut gate_up = Vec::with_capacity(e);
                let mut rows = vec![0u8; 2 * f * gu_row];
                for w in gu.chunks_exact(2 * f * gu_row) {
                    for j in 0..f {
                        let src = |o: usize| &w[o * gu_row..(o + 1) * gu_row];
                        rows[j * gu_row..(j + 1) * gu_row].copy_from_slice(src(2 * j));
                        rows[(f + j) * gu_row..(f + j + 1) * gu_row]
                            .copy_from_slice(src(2 * j + 1));
                    }
                    gate_up.push(backend.upload_matrix(
                        &HostMatrix::new(ty, 2 * f, d, &rows[..])?.with_f32_activations(f32_act),
                    )?);
                }
                let down = dn
                    .chunks_exact(dn_mat)
                    .map(|w| {
                        backend
                            .upload_matrix(
                                &HostMatrix::new(ty, d, f, w)?.with_f32_activations(f32_act),
                            )
                            .map_err(Into::into)
                    })
                    .collect::<Result<Vec<_>>>()?;
                (gate_up, down)
            }
            _ => {
                let (gu, ty) = source.stacked(&p("experts.gate_up_proj"), &[e, d, 2 * f])?;
                let (dn, down_ty) = source.stacked(&p("experts.down_proj"), &[e, f, d])?;
                let (mut gate_up, mut down) = (Vec::with_capacity(e), Vec::with_capacity(e));
                let mut rows = vec![0f32; 2 * f * d];
                let mut down_rows = vec![0f32; d * f];
                for x in 0..e {
                    // The checkpoint's `[hidden, 2·ffn]` matrix, applied as
                    // `a @ W`.
                    let w = &gu[x * d * 2 * f..(x + 1) * d * 2 * f];
                    for j in 0..f {
                        for k in 0..d {
                            rows[j * d + k] = w[k * 2 * f + 2 * j];
                            rows[(f + j) * d + k] = w[k * 2 * f + 2 * j + 1];
                        }
                    }
                    let m = HostMatrix::from_f32_as(ty, 2 * f, d, &rows)?;
                    gate_up.push(backend.upload_matrix(&m)?);
                    // `[ffn, hidden]` applied as `a @ W`: transposed to
                    // `[hidden, ffn]`.
                    let w = &dn[x * f * d..(x + 1) * f * d];
                    for j in 0..f {
                        for n in 0..d {
                            down_rows[n * f + j] = w[j * d + n];
                        }
                    }
                    let m = HostMatrix::from_f32_as(down_ty, d, f, &down_rows)?;
                    down.push(backend.upload_matrix(&m)?);
                }
                (gate_up, down)
            }
        };
        Ok(SparseMoe {
            router,
            router_bias: Some(router_bias),
            bias: None,
            spec,
            gate_up: GateUp::Fused(gate_up),
            down,
            expert_bias: Some((
                backend.upload_vector(&gu_bias)?,
                backend.upload_vector(&db)?,
            )),
            act,
            shared: None,
            hidden: d,
            ffn: f,
        })
    }

    /// Every matrix of the block, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> Box<dyn Iterator<Item = &B::Matrix> + '_> {
        let gate_up: Box<dyn Iterator<Item = &B::Matrix>> = match &self.gate_up {
            GateUp::Fused(v) => Box::new(v.iter()),
            GateUp::Split { gate, up } => Box::new(gate.iter().chain(up)),
        };
        let shared: Box<dyn Iterator<Item = &B::Matrix>> = match &self.shared {
            Some((mlp, g)) => Box::new(mlp.matrices().chain(g.iter())),
            None => Box::new(std::iter::empty()),
        };
        Box::new(
            std::iter::once(&self.router)
                .chain(gate_up)
                .chain(&self.down)
                .chain(shared),
        )
    }

    /// Runs the block on the step's `n` normed hidden states in `ws.h`,
    /// leaving the result in `ws.proj`.
    pub fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n: usize,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let (d, f, e) = (self.hidden, self.ffn, self.spec.n_experts);
        let pairs = n * self.spec.top_k;
        let w = &mut ws.moe;
        b.reserve(&mut w.router_logits, n * e)?;
        b.reserve(&mut w.x, pairs * d)?;
        b.reserve(&mut w.gate_up, pairs * 2 * f)?;
        b.reserve(&mut w.act, pairs * f)?;
        b.reserve(&mut w.y, pairs * d)?;
        b.reserve(&mut ws.proj, n * d)?;

        b.matmul(
            &self.router,
            &ws.h,
            n,
            &mut w.router_logits,
            step,
            Rows::Tokens,
        );
        if let Some(rb) = &self.router_bias {
            b.add_bias(&mut w.router_logits, rb, n, e);
        }
        b.route_experts(
            &w.router_logits,
            n,
            &self.spec,
            self.bias.as_ref(),
            &mut w.routes,
        );
        b.gather_routed(&ws.h, d, &w.routes, &mut w.x);
        match &self.gate_up {
            GateUp::Fused(gu) => b.grouped_matmul(gu, &w.x, &w.routes, &mut w.gate_up),
            GateUp::Split { gate, up } => {
                b.reserve(&mut w.tmp, pairs * f)?;
                b.grouped_matmul(gate, &w.x, &w.routes, &mut w.tmp);
                b.copy_columns(&w.tmp, f, 0, &mut w.gate_up, 2 * f, 0, f, pairs);
                b.grouped_matmul(up, &w.x, &w.routes, &mut w.tmp);
                b.copy_columns(&w.tmp, f, 0, &mut w.gate_up, 2 * f, f, f, pairs);
            }
        }
        if let Some((gub, _)) = &self.expert_bias {
            b.add_routed_bias(&mut w.gate_up, gub, 2 * f, &w.routes);
        }
        match self.act {
            ExpertAct::SiluMul => b.silu_mul(&w.gate_up, pairs, f, &mut w.act),
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                b.swiglu_clamped(&w.gate_up, pairs, f, alpha, limit, &mut w.act)
            }
        }
        b.grouped_matmul(&self.down, &w.act, &w.routes, &mut w.y);
        if let Some((_, db)) = &self.expert_bias {
            b.add_routed_bias(&mut w.y, db, d, &w.routes);
        }
        b.scatter_routed(&w.y, d, &w.routes, &mut ws.proj);
        if let Some((mlp, gate)) = &self.shared {
            b.reserve(&mut w.shared, n * d)?;
            b.reserve(&mut w.shared_gate, n)?;
            mlp.forward_rows(
                b,
                &ws.h,
                n,
                step,
                &mut w.shared,
                &mut ws.gate_up,
                &mut ws.act,
                &mut ws.split_tmp,
            )?;
            match gate {
                Some(gate) => {
                    b.matmul(gate, &ws.h, n, &mut w.shared_gate, step, Rows::Tokens);
                    b.add_gated(&mut ws.proj, &w.shared, &w.shared_gate, n, d);
                }
                None => b.add(&mut ws.proj, &w.shared, n * d),
            }
        }
        Ok(())
    }
}

/// The router's rule for `moe`, checked; the message names the key.
fn router_spec(source: &dyn WeightSource, moe: &MoeConfig) -> Result<RouterSpec> {
    let spec = RouterSpec {
        n_experts: moe.n_experts,
        top_k: moe.top_k,
        scoring: moe.scoring,
        normalize: moe.normalize,
        scale: moe.routed_scale,
        groups: moe.groups,
    };
    if let Err(why) = spec.check() {
        bail!("{}: {why}", source.describe());
    }
    Ok(spec)
}

/// The buffers of the MoE blocks, in [`Workspace::moe`].
pub struct MoeWorkspace<B: Backend> {
    router_logits: B::Buffer,
    routes: B::Routes,
    /// The tokens' hidden states, grouped by expert (`[n·k, hidden]`).
    x: B::Buffer,
    gate_up: B::Buffer,
    act: B::Buffer,
    /// The experts' outputs, grouped (`[n·k, hidden]`).
    y: B::Buffer,
    tmp: B::Buffer,
    shared: B::Buffer,
    shared_gate: B::Buffer,
}

impl<B: Backend> Default for MoeWorkspace<B> {
    fn default() -> Self {
        MoeWorkspace {
            router_logits: Default::default(),
            routes: Default::default(),
            x: Default::default(),
            gate_up: Default::default(),
            act: Default::default(),
            y: Default::default(),
            tmp: Default::default(),
            shared: Default::default(),
            shared_gate: Default::default(),
        }
    }
}
