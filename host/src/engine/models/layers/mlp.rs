//! The gated feed-forward block of the Llama family: `down(silu(gate(x)) ·
//! up(x))`, optionally with biases; Gemma's GeGLU puts GELU's tanh
//! approximation in SiLU's place.

use super::lora::LayerLora;
use super::projection::Projection;
use super::{load_matrix, load_vector, Workspace};
use crate::engine::config::Activation;
use crate::engine::lora::LoraModule;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, BackendError, Rows};

use crate::engine::loader::WeightSource;

/// One SwiGLU feed-forward block.
pub struct GatedMlp<B: Backend> {
    gate_up: Projection<B>,
    /// gate|up biases side by side (`mlp_bias`).
    gate_up_bias: Option<B::Vector>,
    down: B::Matrix,
    down_bias: Option<B::Vector>,
    hidden: usize,
    ffn: usize,
    act: Activation,
}

impl<B: Backend> GatedMlp<B> {
    /// Loads `{prefix}.gate_proj`, `up_proj` and `down_proj` (HF names),
    /// `ffn` wide over a model of width `hidden`, with their biases when
    /// `bias` is set.
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        prefix: &str,
        hidden: usize,
        ffn: usize,
        bias: bool,
    ) -> Result<GatedMlp<B>> {
        let p = |s: &str| format!("{prefix}.{s}");
        let gate_up = Projection::new(
            backend,
            vec![
                source.matrix(&p("gate_proj.weight"), ffn, hidden)?,
                source.matrix(&p("up_proj.weight"), ffn, hidden)?,
            ],
        )
        .with_context(|| format!("{}: {prefix} gate/up", source.describe()))?;
        let (gate_up_bias, down_bias) = if bias {
            let mut b = source.vector(&p("gate_proj.bias"), ffn)?;
            b.extend(source.vector(&p("up_proj.bias"), ffn)?);
            (
                Some(backend.upload_vector(&b)?),
                Some(load_vector(backend, source, &p("down_proj.bias"), hidden)?),
            )
        } else {
            (None, None)
        };
        let down = load_matrix(backend, source, &p("down_proj.weight"), hidden, ffn)?;
        Ok(GatedMlp {
            gate_up,
            gate_up_bias,
            down,
            down_bias,
            hidden,
            ffn,
            act: Activation::Silu,
        })
    }

    /// The block with `act` in place of SiLU.
    pub fn with_activation(mut self, act: Activation) -> GatedMlp<B> {
        self.act = act;
        self
    }

    /// `out = act(gate) · up` for `m` rows of `gate_up` (`[m, 2·ffn]`).
    fn activate(
        &self,
        b: &mut B,
        gate_up: &B::Buffer,
        m: usize,
        out: &mut B::Buffer,
    ) -> Result<(), BackendError> {
        match self.act {
            Activation::Silu => {
                b.silu_mul(gate_up, m, self.ffn, out);
                Ok(())
            }
            Activation::GeluTanh => b.gelu_tanh_mul(gate_up, m, self.ffn, out),
        }
    }

    /// The projections, for load-time facts (sizes, kernels).
    pub fn matrices(&self) -> impl Iterator<Item = &B::Matrix> {
        self.gate_up
            .parts()
            .iter()
            .chain(std::iter::once(&self.down))
    }

    /// Runs the block on the `m` rows of `x`, into `out` (`[m, hidden]`),
    /// with `rows` saying which of the step's rows `x` holds.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_rows(
        &self,
        b: &mut B,
        x: &B::Buffer,
        m: usize,
        step: &B::Step,
        out: &mut B::Buffer,
        gate_up: &mut B::Buffer,
        act: &mut B::Buffer,
        tmp: &mut B::Buffer,
    ) -> Result<(), BackendError> {
        let f = self.ffn;
        b.reserve(gate_up, m * 2 * f)?;
        b.reserve(act, m * f)?;
        b.reserve(out, m * self.hidden)?;
        self.gate_up.matmul(b, x, m, gate_up, tmp, step)?;
        if let Some(bias) = &self.gate_up_bias {
            b.add_bias(gate_up, bias, m, 2 * f);
        }
        self.activate(b, gate_up, m, act)?;
        b.matmul(&self.down, act, m, out, step, Rows::Tokens);
        if let Some(bias) = &self.down_bias {
            b.add_bias(out, bias, m, self.hidden);
        }
        Ok(())
    }

    /// Runs the block on the step's `n` normed hidden states in `ws.h`,
    /// leaving the result in `ws.proj`, with the LoRA deltas of `lora` on
    /// gate, up and down for the tokens whose adapter has them.
    pub fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n: usize,
        ws: &mut Workspace<B>,
        lora: Option<&LayerLora<B>>,
    ) -> Result<(), BackendError> {
        let Some(l) = lora else {
            return self.forward_rows(
                b,
                &ws.h,
                n,
                step,
                &mut ws.proj,
                &mut ws.gate_up,
                &mut ws.act,
                &mut ws.split_tmp,
            );
        };
        let (f, d) = (self.ffn, self.hidden);
        b.reserve(&mut ws.gate_up, n * 2 * f)?;
        b.reserve(&mut ws.act, n * f)?;
        b.reserve(&mut ws.proj, n * d)?;
        let gate_up = l.slices(&[(LoraModule::Gate, 0, f), (LoraModule::Up, f, f)]);
        self.gate_up.matmul_lora(
            b,
            &ws.h,
            n,
            &mut ws.gate_up,
            &mut ws.split_tmp,
            self.gate_up_bias.as_ref(),
            &gate_up,
            step,
        )?;
        self.activate(b, &ws.gate_up, n, &mut ws.act)?;
        let down = l.slices(&[(LoraModule::Down, 0, d)]);
        b.matmul_lora(
            &self.down,
            &ws.act,
            n,
            &mut ws.proj,
            self.down_bias.as_ref(),
            &down,
            step,
        )
    }
}
