//! The model runner: runs one step's flattened batch (which the scheduler
//! laid out, [`pagoda_accel::StepBatch`]) through the model on a device,
//! then samples the rows that sample and hands back the sampled ids
//! ([`ModelRunnerOutput`]), from which the scheduler updates.
//!
//! The two halves are separate calls, as in vLLM v1 (`execute_model`, then
//! `sample_tokens`): the engine core computes the step's grammar masks
//! while the forward runs, and passes them to the second.
//!
//! [`ModelRunner`] is generic over the device's [`Backend`]; the engine core
//! holds it as a [`ModelExecutor`], so nothing above the runner knows which
//! device it runs on.

use crate::engine::config::ModelConfig;
use crate::engine::models::{Model, Workspace};
use crate::engine::request::{Request, TokenLogprob};
use crate::engine::sampler::Sampler;
use crate::engine::scheduler::ScheduledSeq;
use crate::engine::structured_output::GuidedRow;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, StepBatch};

/// Where the runner finds the requests it samples for: their sampling
/// parameters, random state and output so far. The scheduler owns them.
pub trait SamplingStates {
    /// The request `id`, if it is still in the engine.
    fn request_mut(&mut self, id: u64) -> Option<&mut Request>;
}

/// What one step sampled, sequence by sequence in plan order. Its vectors
/// are reused from step to step, so a warm greedy step allocates nothing.
#[derive(Default)]
pub struct ModelRunnerOutput {
    /// One entry per scheduled sequence, in plan order.
    pub seqs: Vec<SeqSampled>,
    tokens: Vec<u32>,
    logprobs: Vec<Option<TokenLogprob>>,
    /// The prompt-token scores the step computed, for requests that asked
    /// for prompt logprobs.
    pub prompt_logprobs: Vec<PromptScore>,
    /// The drafts being verified, copied out of their request.
    drafts: Vec<u32>,
}

/// One sequence's share of a [`ModelRunnerOutput`].
#[derive(Clone, Debug)]
pub struct SeqSampled {
    pub id: u64,
    /// Where its sampled ids lie in the output (none when the step did not
    /// reach the end of the sequence, or nothing was left to generate).
    first: usize,
    len: usize,
    /// Why nothing could be sampled for a sequence that should have been:
    /// its grammar's mask could not be computed.
    pub failure: Option<String>,
}

/// The score of the prompt token after position `pos` of request `id`.
pub struct PromptScore {
    pub id: u64,
    pub pos: usize,
    pub score: TokenLogprob,
}

impl ModelRunnerOutput {
    fn clear(&mut self) {
        self.seqs.clear();
        self.tokens.clear();
        self.logprobs.clear();
        self.prompt_logprobs.clear();
    }

    /// The ids sampled for sequence `i` of the plan, in order.
    pub fn sampled(&self, i: usize) -> &[u32] {
        let s = &self.seqs[i];
        &self.tokens[s.first..s.first + s.len]
    }

    /// Takes the logprob of the `j`-th id sampled for sequence `i`, if the
    /// request asked for logprobs.
    pub fn take_logprob(&mut self, i: usize, j: usize) -> Option<TokenLogprob> {
        let s = &self.seqs[i];
        self.logprobs.get_mut(s.first + j).and_then(Option::take)
    }
}

/// What the engine core needs of a model on a device.
pub trait ModelExecutor: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Whether long prompts may run on a prompt kernel whose numbers differ
    /// from the generation kernels' (see
    /// [`pagoda_accel::Backend::has_prompt_kernel`]).
    fn has_prompt_kernel(&self) -> bool;
    /// Runs one step's forward: K/V for every token of `batch`, and the
    /// logits of `batch.logit_rows`, kept for [`ModelExecutor::sample_tokens`].
    fn execute_model(&mut self, batch: &StepBatch) -> Result<()>;
    /// Samples from the logits of the last [`ModelExecutor::execute_model`]:
    /// one id for each sequence of `seqs` (the step's plan) that reaches
    /// its end, and the prompt-token scores asked for. `guided` holds the
    /// masks of the constrained rows, by row, in row order.
    fn sample_tokens(
        &mut self,
        seqs: &[ScheduledSeq],
        requests: &mut dyn SamplingStates,
        guided: &mut [GuidedRow],
    ) -> Result<&mut ModelRunnerOutput>;
    /// Runs the draft model (speculative decoding's `draft_model`) over
    /// `batch`, in its own KV pool under the same block tables, and returns
    /// the logits of `batch.logit_rows`, one `vocab`-wide row each, in host
    /// memory.
    ///
    /// # Errors
    /// If no draft model is loaded, or the device failed.
    fn draft_step(&mut self, batch: &StepBatch) -> Result<&mut [f32]>;
    /// Bytes of weights on the device.
    fn weight_bytes(&self) -> usize;
    /// The projections' storage type, for logs ("Q4_1").
    fn weight_type(&self) -> &'static str;
    /// The device, for logs.
    fn describe_device(&self) -> String;
}

/// A draft model beside the target, on the same device: its weights, its
/// KV pool (as many blocks as the target's, addressed by the same block
/// tables) and its activations.
pub struct DraftRunner<B: Backend> {
    model: Model<B>,
    kv: B::Kv,
    ws: Workspace<B>,
    step: B::Step,
}

impl<B: Backend> DraftRunner<B> {
    /// The draft `model` over its pool `kv`.
    pub fn new(model: Model<B>, kv: B::Kv) -> DraftRunner<B> {
        DraftRunner {
            model,
            kv,
            ws: Workspace::default(),
            step: B::Step::default(),
        }
    }
}

/// Runs `model` on `backend` over the KV pool `kv`.
pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: B::Kv,
    ws: Workspace<B>,
    step: B::Step,
    sampler: Sampler,
    output: ModelRunnerOutput,
    /// How many logit rows the last forward computed.
    num_logit_rows: usize,
    draft: Option<DraftRunner<B>>,
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
            sampler: Sampler::default(),
            output: ModelRunnerOutput::default(),
            num_logit_rows: 0,
            draft: None,
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

    /// Adds a draft model, which [`ModelExecutor::draft_step`] runs.
    pub fn with_draft(mut self, draft: DraftRunner<B>) -> ModelRunner<B> {
        self.draft = Some(draft);
        self
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

    fn execute_model(&mut self, batch: &StepBatch) -> Result<()> {
        let n_logits = batch.logit_rows.len();
        let b = &mut self.backend;
        self.num_logit_rows = n_logits;
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
        Ok(())
    }

    fn sample_tokens(
        &mut self,
        seqs: &[ScheduledSeq],
        requests: &mut dyn SamplingStates,
        guided: &mut [GuidedRow],
    ) -> Result<&mut ModelRunnerOutput> {
        let vocab = self.model.config().vocab_size;
        let len = self.num_logit_rows * vocab;
        let b = &mut self.backend;
        b.reserve(&mut self.ws.logits, len)?;
        let logits = b
            .to_host(&mut self.ws.logits, len)
            .context("reading the logits back")?;
        sample_step(
            &mut self.sampler,
            &mut self.output,
            logits,
            vocab,
            seqs,
            requests,
            guided,
        );
        Ok(&mut self.output)
    }

    fn draft_step(&mut self, batch: &StepBatch) -> Result<&mut [f32]> {
        let Some(d) = &mut self.draft else {
            anyhow::bail!("no draft model is loaded");
        };
        let n_logits = batch.logit_rows.len();
        let b = &mut self.backend;
        if batch.num_tokens() > 0 {
            b.upload_step(batch, &mut d.step)
                .context("uploading the draft step's metadata")?;
            d.model
                .forward(
                    b,
                    &d.step,
                    batch.num_tokens(),
                    n_logits,
                    &mut d.kv,
                    &mut d.ws,
                )
                .context("running the draft model")?;
        }
        let len = n_logits * d.model.config().vocab_size;
        b.reserve(&mut d.ws.logits, len)?;
        b.to_host(&mut d.ws.logits, len)
            .context("reading the draft logits back")
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes() + self.draft.as_ref().map_or(0, |d| d.model.weight_bytes())
    }

    fn weight_type(&self) -> &'static str {
        self.model.weight_type()
    }

    fn describe_device(&self) -> String {
        self.backend.describe()
    }
}

/// Samples one step's rows into `out`: for every sequence of `seqs`, the
/// prompt rows whose logprobs were asked for are scored, and the sampling
/// row (a sequence's last) gives its next id, through its grammar's mask
/// where it has one.
fn sample_step(
    sampler: &mut Sampler,
    out: &mut ModelRunnerOutput,
    logits: &mut [f32],
    vocab: usize,
    seqs: &[ScheduledSeq],
    requests: &mut dyn SamplingStates,
    guided: &mut [GuidedRow],
) {
    out.clear();
    let mut next_row = 0;
    let mut next_guided = 0;
    for s in seqs {
        // The sequence's logit rows, in plan order: prompt rows whose
        // logprobs were asked for, then the sampling row.
        let first_row = next_row;
        next_row += s.logit_rows;
        let mut entry = SeqSampled {
            id: s.id,
            first: out.tokens.len(),
            len: 0,
            failure: None,
        };
        let Some(req) = requests.request_mut(s.id) else {
            out.seqs.push(entry);
            continue;
        };
        if let (Some(k), Some(_)) = (req.params.prompt_logprobs, req.prompt_logprobs_from()) {
            for r in 0..s.logit_rows {
                let pos = s.logits_from() + r;
                if pos + 1 >= req.prompt_len {
                    break;
                }
                let next = req.token_ids[pos + 1];
                let row = &logits[(first_row + r) * vocab..(first_row + r + 1) * vocab];
                let score = sampler.score(row, next, k);
                out.prompt_logprobs.push(PromptScore {
                    id: s.id,
                    pos,
                    score,
                });
            }
        }
        let row = next_row - 1;
        let guide = match guided.get_mut(next_guided) {
            Some(g) if s.sample && g.row == row => {
                next_guided += 1;
                Some(g)
            }
            _ => None,
        };
        // max_tokens 0: the prompt ran (and was scored); nothing is
        // generated.
        if !s.sample || req.token_ids.len() >= req.max_len {
            out.seqs.push(entry);
            continue;
        }
        if s.num_drafts > 0 {
            // Drafts never carry a grammar (see `Request::may_speculate`):
            // their rows are the sequence's last `num_drafts + 1`.
            let first = row - s.num_drafts;
            out.drafts.clear();
            out.drafts
                .extend_from_slice(&req.spec.drafts[..s.num_drafts]);
            sampler.verify(
                &mut logits[first * vocab..(row + 1) * vocab],
                vocab,
                &out.drafts,
                req,
                &mut out.tokens,
                &mut out.logprobs,
            );
            entry.len = out.tokens.len() - entry.first;
            out.seqs.push(entry);
            continue;
        }
        let row_logits = &mut logits[row * vocab..(row + 1) * vocab];
        let mask = match guide.map(|g| g.mask.take()) {
            None => None,
            Some(Some(Ok(mask))) => Some(mask),
            Some(Some(Err(e))) => {
                entry.failure = Some(e);
                out.seqs.push(entry);
                continue;
            }
            Some(None) => {
                entry.failure = Some("no mask was computed".into());
                out.seqs.push(entry);
                continue;
            }
        };
        let sampled = sampler.sample(row_logits, req, mask.as_ref());
        out.tokens.push(sampled.token);
        out.logprobs.push(sampled.logprob);
        entry.len = 1;
        out.seqs.push(entry);
    }
}
