//! The model runner: owns the batch ([`InputBatch`]), which it updates
//! from each step's [`SchedulerOutput`]; lays the step out for the device
//! ([`pagoda_accel::StepBatch`]); runs the model; samples every row that
//! samples (through the grammar masks computed while the forward runs);
//! proposes the drafts of speculative decoding; and hands back what it
//! sampled as plain data ([`ModelRunnerOutput`]), from which the scheduler
//! updates. One call per step, as in vLLM v1's `GPUModelRunner`.
//!
//! [`ModelRunner`] is generic over the device's [`Backend`]; the engine core
//! holds it as a [`ModelExecutor`], so nothing above the runner knows which
//! device it runs on.

pub mod input_batch;
pub mod lora_slots;

use crate::engine::config::ModelConfig;
use crate::engine::models::{Model, Workspace};
use crate::engine::runner_output::{ModelRunnerOutput, PromptScore};
use crate::engine::sampler::Sampler;
use crate::engine::scheduler_output::{ScheduledSeq, SchedulerOutput};
use crate::engine::spec_decode::draft_model::{DraftModel, DraftPlan, DraftSeq, DraftSeqs};
use crate::engine::spec_decode::{Proposer, Speculator};
use crate::engine::structured_output::GuidedRow;
use anyhow::{Context, Result};
use input_batch::InputBatch;
use lora_slots::LoraSlots;
use pagoda_accel::{Backend, StepBatch};

/// What the engine core needs of a model on a device.
pub trait ModelExecutor: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Whether long prompts may run on a prompt kernel whose numbers differ
    /// from the generation kernels' (see
    /// [`pagoda_accel::Backend::has_prompt_kernel`]).
    fn has_prompt_kernel(&self) -> bool;
    /// Runs one step: takes the scheduler's decisions into the batch,
    /// runs the model over the scheduled tokens, samples one id for each
    /// sequence that reaches its end (several where drafts were verified)
    /// and scores the prompt tokens asked for, then proposes the next
    /// drafts. `guided` holds the constrained rows, in row order, with
    /// their matchers: their masks are computed on a thread of their own
    /// while the forward runs.
    ///
    /// # Errors
    /// If the device failed.
    fn execute(
        &mut self,
        plan: &SchedulerOutput,
        guided: &mut [GuidedRow],
    ) -> Result<&mut ModelRunnerOutput>;
    /// Turns speculative decoding on (or off): after each step the runner
    /// drafts for every sequence that may speculate.
    fn set_speculator(&mut self, speculator: Option<Speculator>);
    /// Makes room for `slots` LoRA adapters at once (`--max-loras`), or
    /// says why the model or the device cannot take adapters.
    fn enable_lora(&mut self, slots: usize) -> Result<()>;
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
    /// Tokens per KV block.
    block_size: usize,
    /// The running requests, one row each.
    batch: InputBatch,
    /// The step laid out for the device (reused).
    step_batch: StepBatch,
    sampler: Sampler,
    output: ModelRunnerOutput,
    /// A verification's ids and logprobs (reused).
    verified: (Vec<u32>, Vec<Option<crate::engine::request::TokenLogprob>>),
    speculator: Option<Speculator>,
    draft: Option<DraftModel<B>>,
    /// The sequences the draft model runs after a step (reused).
    draft_plan: Vec<DraftPlan>,
    /// Which adapter sits in which of the model's LoRA slots.
    lora_slots: LoraSlots,
    /// The step's distinct adapters, and the slots to load (reused).
    lora_needed: Vec<std::sync::Arc<crate::engine::lora::LoadedLora>>,
    lora_loads: Vec<(usize, std::sync::Arc<crate::engine::lora::LoadedLora>)>,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner for `model` over the pool `kv` of `block_size`-token
    /// blocks, both on `backend`'s device.
    pub fn new(backend: B, model: Model<B>, kv: B::Kv, block_size: usize) -> ModelRunner<B> {
        ModelRunner {
            backend,
            model,
            kv,
            ws: Workspace::default(),
            step: B::Step::default(),
            block_size,
            batch: InputBatch::default(),
            step_batch: StepBatch::default(),
            sampler: Sampler::default(),
            output: ModelRunnerOutput::default(),
            verified: Default::default(),
            speculator: None,
            draft: None,
            draft_plan: Vec::new(),
            lora_slots: LoraSlots::default(),
            lora_needed: Vec::new(),
            lora_loads: Vec::new(),
        }
    }

    /// [`ModelRunner::new`] with activation buffers already sized (by the
    /// start-up profile forward).
    pub fn with_workspace(
        backend: B,
        model: Model<B>,
        kv: B::Kv,
        block_size: usize,
        ws: Workspace<B>,
    ) -> ModelRunner<B> {
        ModelRunner {
            ws,
            ..ModelRunner::new(backend, model, kv, block_size)
        }
    }

    /// Adds a draft model, which proposes the drafts when the speculator's
    /// proposer is [`Proposer::DraftModel`].
    pub fn with_draft(mut self, draft: DraftModel<B>) -> ModelRunner<B> {
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

impl<B: Backend> ModelRunner<B> {
    /// Makes the adapters of the step's sequences resident in the model's
    /// LoRA slots, loading those that are not.
    fn activate_loras(&mut self, seqs: &[ScheduledSeq]) -> Result<()> {
        self.lora_needed.clear();
        for s in seqs {
            if let Some(l) = self.batch.get(s.id).and_then(|r| r.lora.as_ref()) {
                if !self.lora_needed.iter().any(|n| n.id == l.id) {
                    self.lora_needed.push(std::sync::Arc::clone(l));
                }
            }
        }
        if self.lora_needed.is_empty() {
            return Ok(());
        }
        self.lora_loads.clear();
        self.lora_slots
            .assign(&self.lora_needed, &mut self.lora_loads)?;
        for (slot, lora) in self.lora_loads.drain(..) {
            self.model
                .set_lora(&self.backend, slot, Some(&lora.adapter))
                .with_context(|| {
                    format!("loading LoRA adapter {:?} into slot {slot}", lora.name)
                })?;
        }
        Ok(())
    }

    /// Runs the model over the laid-out step: K/V for every token, and the
    /// logits of its logit rows.
    fn forward(&mut self) -> Result<()> {
        let batch = &self.step_batch;
        if batch.num_tokens() == 0 {
            return Ok(());
        }
        let b = &mut self.backend;
        b.upload_step(batch, &mut self.step)
            .context("uploading the step's metadata")?;
        self.model
            .forward(
                b,
                &self.step,
                batch.num_tokens(),
                batch.logit_rows.len(),
                &mut self.kv,
                &mut self.ws,
            )
            .context("running the model")
    }

    /// Appends what the step sampled to each request's row, and records
    /// how its drafts fared.
    fn take_sampled(&mut self, seqs: &[ScheduledSeq]) {
        for (i, s) in seqs.iter().enumerate() {
            let sampled = self.output.sampled(i);
            let Some(r) = self.batch.get_mut(s.id) else {
                continue;
            };
            // Every sampled id but the last (the target's own token after
            // them) confirms a draft.
            let accepted = sampled.len().saturating_sub(1).min(s.num_drafts);
            if s.num_drafts > 0 {
                r.spec.verified(accepted);
            }
            // Draft K/V past the verified tokens belongs to rejected drafts.
            let computed = s.start + s.num_tokens - s.num_drafts + accepted;
            r.spec.draft_computed = r.spec.draft_computed.min(computed);
            for &t in sampled {
                r.append(t);
            }
        }
    }

    /// Drafts the next tokens of every sequence that sampled and may
    /// speculate (see [`Speculator::draft_len`]), by prompt lookup or with
    /// the draft model, and says in the output how many each got.
    fn propose(&mut self, plan: &SchedulerOutput) -> Result<()> {
        let Some(speculator) = &self.speculator else {
            return Ok(());
        };
        let running = plan.num_running;
        self.draft_plan.clear();
        for (i, s) in plan.seqs.iter().enumerate() {
            let sampled = self.output.sampled(i).len();
            let Some(r) = self.batch.get_mut(s.id) else {
                continue;
            };
            let accepted = sampled.saturating_sub(1).min(s.num_drafts);
            let computed = s.start + s.num_tokens - s.num_drafts + accepted;
            let mut k = 0;
            if s.sample {
                let may = r.may_speculate() && computed + 1 == r.token_ids.len();
                let room = r.max_len.saturating_sub(r.token_ids.len() + 1);
                k = speculator.draft_len(&mut r.spec, may, room, running);
            }
            match speculator.proposer() {
                Proposer::Ngram(p) => p.propose(&r.token_ids, k, &mut r.spec.drafts),
                Proposer::DraftModel => self.draft_plan.push(DraftPlan {
                    id: s.id,
                    computed,
                    // Drafts need the K/V slots the scheduler reserved.
                    k: k.min(s.lookahead),
                }),
            }
        }
        if let (Proposer::DraftModel, Some(draft)) = (speculator.proposer(), &mut self.draft) {
            draft.propose(
                &mut self.backend,
                &mut self.batch,
                &self.draft_plan,
                self.block_size,
                speculator.samples_drafts(),
            )?;
        }
        for seq in &mut self.output.seqs {
            seq.num_drafts = self.batch.get(seq.id).map_or(0, |r| r.spec.drafts.len());
        }
        Ok(())
    }
}

impl DraftSeqs for InputBatch {
    fn draft_seq(&mut self, id: u64) -> Option<DraftSeq<'_>> {
        let r = self.get_mut(id)?;
        Some(DraftSeq {
            token_ids: &r.token_ids,
            block_table: &r.block_table,
            params: &r.params,
            rng: &mut r.rng,
            spec: &mut r.spec,
        })
    }
}

impl<B: Backend> ModelExecutor for ModelRunner<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn has_prompt_kernel(&self) -> bool {
        self.model.has_prompt_kernel()
    }

    fn execute(
        &mut self,
        plan: &SchedulerOutput,
        guided: &mut [GuidedRow],
    ) -> Result<&mut ModelRunnerOutput> {
        self.batch.update(plan);
        self.output.clear();
        if plan.seqs.is_empty() {
            return Ok(&mut self.output);
        }
        self.activate_loras(&plan.seqs)?;
        self.batch.lay_out(
            &plan.seqs,
            self.block_size,
            &self.lora_slots,
            &mut self.step_batch,
        );
        if guided.is_empty() {
            self.forward()?;
        } else {
            // The masks are computed on their own thread while the forward
            // runs, so constrained decoding costs the step little more than
            // the longer of the two.
            std::thread::scope(|scope| {
                let masks = scope.spawn(|| {
                    for g in guided.iter_mut() {
                        g.mask = Some(g.matcher.compute_mask());
                    }
                });
                let ran = self.forward();
                if masks.join().is_err() {
                    return Err(anyhow::anyhow!("computing a grammar's token mask panicked"));
                }
                ran
            })?;
        }
        let vocab = self.model.config().vocab_size;
        let len = self.step_batch.logit_rows.len() * vocab;
        let b = &mut self.backend;
        b.reserve(&mut self.ws.logits, len)?;
        let logits = b
            .to_host(&mut self.ws.logits, len)
            .context("reading the logits back")?;
        sample_step(
            &mut self.sampler,
            &mut self.output,
            &mut self.verified,
            logits,
            vocab,
            &plan.seqs,
            &mut self.batch,
            guided,
        );
        self.take_sampled(&plan.seqs);
        self.propose(plan)?;
        Ok(&mut self.output)
    }

    fn set_speculator(&mut self, speculator: Option<Speculator>) {
        self.speculator = speculator;
    }

    fn enable_lora(&mut self, slots: usize) -> Result<()> {
        self.model.enable_lora(&self.backend, slots)?;
        self.lora_slots = LoraSlots::new(slots);
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes() + self.draft.as_ref().map_or(0, DraftModel::weight_bytes)
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
/// where it has one; a sequence with drafts has them verified against its
/// last `num_drafts + 1` rows.
#[allow(clippy::too_many_arguments)]
fn sample_step(
    sampler: &mut Sampler,
    out: &mut ModelRunnerOutput,
    verified: &mut (Vec<u32>, Vec<Option<crate::engine::request::TokenLogprob>>),
    logits: &mut [f32],
    vocab: usize,
    seqs: &[ScheduledSeq],
    batch: &mut InputBatch,
    guided: &mut [GuidedRow],
) {
    let mut next_row = 0;
    let mut next_guided = 0;
    for s in seqs {
        // The sequence's logit rows, in plan order: prompt rows whose
        // logprobs were asked for, then the sampling row.
        let first_row = next_row;
        next_row += s.logit_rows;
        out.begin(s.id);
        let Some(r) = batch.get_mut(s.id) else {
            continue;
        };
        if let Some(k) = r.params.prompt_logprobs {
            for i in 0..s.logit_rows {
                let pos = s.logits_from() + i;
                if pos + 1 >= r.prompt_len {
                    break;
                }
                let next = r.token_ids[pos + 1];
                let row = &logits[(first_row + i) * vocab..(first_row + i + 1) * vocab];
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
        if !s.sample || r.token_ids.len() >= r.max_len {
            continue;
        }
        let (mut req, spec) = r.split();
        if s.num_drafts > 0 {
            // Drafts never carry a grammar (see `RequestState::may_speculate`):
            // their rows are the sequence's last `num_drafts + 1`.
            let first = row - s.num_drafts;
            let (tokens, logprobs) = verified;
            tokens.clear();
            logprobs.clear();
            sampler.verify(
                &mut logits[first * vocab..(row + 1) * vocab],
                vocab,
                &spec.drafts[..s.num_drafts],
                &spec.draft_probs,
                &mut req,
                tokens,
                logprobs,
            );
            for (&t, l) in tokens.iter().zip(logprobs.drain(..)) {
                out.push(t, l);
            }
            continue;
        }
        let row_logits = &mut logits[row * vocab..(row + 1) * vocab];
        let mask = match guide.map(|g| g.mask.take()) {
            None => None,
            Some(Some(Ok(mask))) => Some(mask),
            Some(Some(Err(e))) => {
                out.fail(e);
                continue;
            }
            Some(None) => {
                out.fail("no mask was computed".into());
                continue;
            }
        };
        let sampled = sampler.sample(row_logits, &mut req, mask.as_ref());
        out.push(sampled.token, sampled.logprob);
    }
}
