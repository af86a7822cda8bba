//! The model runner: runs one step's flattened batch (which the scheduler
//! laid out, [`pagoda_accel::StepBatch`]) through the model on a device, and
//! hands back the logits of the rows that sample.
//!
//! [`ModelRunner`] is generic over the device's [`Backend`]; the engine core
//! holds it as a [`ModelExecutor`], so nothing above the runner knows which
//! device it runs on.

use crate::engine::config::ModelConfig;
use crate::engine::models::{Model, Workspace};
use anyhow::{Context, Result};
use pagoda_accel::{Backend, StepBatch};

/// What the engine core needs of a model on a device.
pub trait ModelExecutor: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Whether long prompts may run on a prompt kernel whose numbers differ
    /// from the generation kernels' (see
    /// [`pagoda_accel::Backend::has_prompt_kernel`]).
    fn has_prompt_kernel(&self) -> bool;
    /// Runs one step. Returns the logits of `batch.logit_rows`, one
    /// `vocab`-wide row each, in order, in host memory.
    fn execute(&mut self, batch: &StepBatch) -> Result<&mut [f32]>;
    /// Bytes of weights on the device.
    fn weight_bytes(&self) -> usize;
    /// The projections' storage type, for logs ("Q4_1").
    fn weight_type(&self) -> &'static str;
    /// The device, for logs.
    fn describe_device(&self) -> String;
}

/// Runs `model` on `backend` over the KV pool `kv`.
pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: B::Kv,
    ws: Workspace<B>,
    step: B::Step,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner for `model` over the pool `kv`, both on `backend`'s device.
    pub fn new(backend: B, model: Model<B>, kv: B::Kv) -> ModelRunner<B> {
        ModelRunner {
            backend,
            model,
            kv,
            ws: Workspace::default(),
            step: B::Step::default(),
        }
    }

    /// [`ModelRunner::new`] with activation buffers already sized (by the
    /// start-up profile forward).
    pub fn with_workspace(
        backend: B,
        model: Model<B>,
        kv: B::Kv,
        ws: Workspace<B>,
    ) -> ModelRunner<B> {
        ModelRunner {
            ws,
            ..ModelRunner::new(backend, model, kv)
        }
    }

    /// The model being run.
    pub fn model(&self) -> &dyn crate::engine::models::CausalLm<B> {
        &*self.model
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
}

impl<B: Backend> ModelExecutor for ModelRunner<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn has_prompt_kernel(&self) -> bool {
        self.model.has_prompt_kernel()
    }

    fn execute(&mut self, batch: &StepBatch) -> Result<&mut [f32]> {
        let n_logits = batch.logit_rows.len();
        let len = n_logits * self.model.config().vocab_size;
        let b = &mut self.backend;
        if batch.num_tokens() > 0 {
            b.upload_step(batch, &mut self.step)
                .context("uploading the step's metadata")?;
            self.model
                .forward(
                    b,
                    &self.step,
                    batch.num_tokens(),
                    n_logits,
                    &mut self.kv,
                    &mut self.ws,
                )
                .context("running the model")?;
        }
        b.reserve(&mut self.ws.logits, len)?;
        b.to_host(&mut self.ws.logits, len)
            .context("reading the logits back")
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    fn weight_type(&self) -> &'static str {
        self.model.weight_type()
    }

    fn describe_device(&self) -> String {
        self.backend.describe()
    }
}
