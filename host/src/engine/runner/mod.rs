//! The model runner: owns the batch ([`InputBatch`]), which it updates
//! from each step's [`SchedulerOutput`]; lays the step out for the device
//! ([`pagoda_accel::StepBatch`]); runs the model; samples every row that
//! samples (through the grammar masks computed while the forward runs);
//! proposes the drafts of speculative decoding; and hands back what it
//! sampled as plain data ([`ModelRunnerOutput`]), from which the scheduler
//! updates. One call per step, as in vLLM v1's `GPUModelRunner`.
//!
//! Rows that plainly sample are sampled together on the device
//! ([`Backend::sample`], from metadata gathered off the batch's rows), so
//! only their ids and logprobs come back. Rows that verify drafts and the
//! prompt rows scored for prompt logprobs are read back and done on the
//! host ([`Sampler`]).
//!
//! [`ModelRunner`] is generic over the device's [`Backend`]; the engine core
//! holds it as a [`ModelExecutor`], so nothing above the runner knows which
//! device it runs on.

pub mod input_batch;
pub mod lora_slots;

use crate::engine::config::ModelConfig;
use crate::engine::models::{Model, StateCache, Workspace};
use crate::engine::request::TokenLogprob;
use crate::engine::runner_output::{ModelRunnerOutput, PromptScore};
use crate::engine::sampler::Sampler;
use crate::engine::scheduler_output::{ScheduledSeq, SchedulerOutput};
use crate::engine::spec_decode::draft_model::{DraftModel, DraftPlan, DraftSeq, DraftSeqs};
use crate::engine::spec_decode::{Proposer, Speculator};
use crate::engine::structured_output::GuidedRow;
use anyhow::{Context, Result};
use input_batch::InputBatch;
use lora_slots::LoraSlots;
use pagoda_accel::ops::sample::{SampledRows, SamplingMetadata, NO_TOKEN};
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
    /// Makes room for `slots` LoRA adapters at once (`--max-loras`),
    /// stored as `dtype` says, or says why the model or the device cannot
    /// take adapters.
    fn enable_lora(&mut self, slots: usize, dtype: crate::engine::lora::LoraDtype) -> Result<()>;
    /// Bytes of weights on the device.
    fn weight_bytes(&self) -> usize;
    /// The projections' storage type, for logs ("Q4_1").
    fn weight_type(&self) -> &'static str;
    /// The device, for logs.
    fn describe_device(&self) -> String;
    /// Bytes of recurrent state one sequence holds (a hybrid model's
    /// linear layers; 0 otherwise), as the memory budget counts it.
    fn state_bytes_per_seq(&self) -> usize;
}

/// Runs `model` on `backend` over the KV pool `kv`.
pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: B::Kv,
    /// The linear layers' per-sequence state (hybrid models; empty
    /// otherwise), beside the KV pool.
    state: StateCache<B>,
    /// The state of the step's drafting sequences before it ran, one slot
    /// each in plan order, to put back where drafts are rejected (grown
    /// when a step has more drafting sequences than slots).
    snapshot: StateCache<B>,
    /// Checkpoints of sequences' state at block boundaries, for prefix-cache
    /// hits (see [`crate::engine::kv_cache::state_checkpoints`]); empty
    /// without prefix caching.
    checkpoints: StateCache<B>,
    /// The accepted part of such sequences' steps, run again over their
    /// restored state (reused).
    rerun: StepBatch,
    ws: Workspace<B>,
    step: B::Step,
    /// Tokens per KV block.
    block_size: usize,
    /// The running requests, one row each.
    batch: InputBatch,
    /// The step laid out for the device (reused).
    step_batch: StepBatch,
    sampler: Sampler,
    /// How each scheduled sequence samples this step (reused).
    paths: Vec<SamplePath>,
    /// What the rows sampled on the device ask for (reused).
    meta: SamplingMetadata,
    /// What they sampled (reused).
    sampled: SampledRows,
    output: ModelRunnerOutput,
    /// A verification's ids and logprobs (reused).
    verified: (Vec<u32>, Vec<Option<TokenLogprob>>),
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
            state: StateCache::default(),
            snapshot: StateCache::default(),
            checkpoints: StateCache::default(),
            rerun: StepBatch::default(),
            ws: Workspace::default(),
            step: B::Step::default(),
            block_size,
            batch: InputBatch::default(),
            step_batch: StepBatch::default(),
            sampler: Sampler::default(),
            paths: Vec::new(),
            meta: SamplingMetadata::default(),
            sampled: SampledRows::default(),
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

    /// Gives the model's linear layers their per-sequence state (see
    /// [`crate::engine::models::CausalLm::alloc_state`]), as many slots as
    /// the KV-cache manager hands out.
    pub fn with_state(mut self, state: StateCache<B>) -> ModelRunner<B> {
        self.state = state;
        self
    }

    /// Gives the runner `checkpoints`, the slots the KV-cache manager files
    /// the state at block boundaries in
    /// ([`crate::engine::kv_cache::KvCacheManager::with_state_checkpoints`]).
    pub fn with_state_checkpoints(mut self, checkpoints: StateCache<B>) -> ModelRunner<B> {
        self.checkpoints = checkpoints;
        self
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
        self.state.slots.clone_from(&batch.state_slots);
        self.model
            .forward(
                b,
                &self.step,
                batch.num_tokens(),
                batch.logit_rows.len(),
                &mut self.kv,
                &mut self.state,
                &mut self.ws,
            )
            .context("running the model")
    }

    /// Starts each sequence whose prefix-cache hit ends at a checkpoint
    /// from that checkpoint's state.
    fn restore_checkpoints(&mut self, seqs: &[ScheduledSeq]) {
        for s in seqs {
            if let Some(c) = s.restore_state {
                self.state
                    .copy_slot(&mut self.backend, &self.checkpoints, c, s.state_slot);
            }
        }
    }

    /// Files the state of each sequence whose step ended on a block
    /// boundary the scheduler chose for a checkpoint. After the forward
    /// pass, so a slot restored from in the same step was read first.
    fn save_checkpoints(&mut self, seqs: &[ScheduledSeq]) {
        for s in seqs {
            if let Some(c) = s.save_state {
                self.checkpoints
                    .copy_slot(&mut self.backend, &self.state, s.state_slot, c);
            }
        }
    }

    /// Snapshots the recurrent state of every sequence that carries drafts
    /// this step (a hybrid model's linear layers advance through every
    /// token they see, rejected drafts included, so a rejection must be
    /// undone from the state before the step).
    fn snapshot_drafting(&mut self, seqs: &[ScheduledSeq]) -> Result<()> {
        if self.state.num_slots() == 0 {
            return Ok(());
        }
        let n = seqs.iter().filter(|s| s.num_drafts > 0).count();
        if n == 0 {
            return Ok(());
        }
        if self.snapshot.num_slots() < n {
            self.snapshot = self
                .model
                .alloc_state(&mut self.backend, n)
                .context("allocating the drafting sequences' state snapshots")?;
        }
        let drafting = seqs.iter().filter(|s| s.num_drafts > 0);
        for (j, s) in drafting.enumerate() {
            self.snapshot
                .copy_slot(&mut self.backend, &self.state, s.state_slot, j as u32);
        }
        Ok(())
    }

    /// Reads the pooled vector of every pooling request whose prompt the
    /// step finished, which the model leaves in `ws.h` for each logit row
    /// ([`crate::engine::models::CausalLm::pooled_width`] values): a
    /// decoder's last final-normed hidden state, an encoder's pooled
    /// sequence, or a classifier's logits.
    fn pool(&mut self, seqs: &[ScheduledSeq]) -> Result<()> {
        let mut any = false;
        for s in seqs {
            any |= s.sample && self.batch.get(s.id).is_some_and(|r| r.pooling);
        }
        if !any {
            return Ok(());
        }
        let d = self.model.pooled_width();
        let rows = self.step_batch.logit_rows.len();
        let hidden = self
            .backend
            .to_host(&mut self.ws.h, rows * d)
            .context("reading the pooled hidden states back")?;
        let mut next_row = 0;
        for s in seqs {
            next_row += s.logit_rows;
            let pooling = self.batch.get(s.id).is_some_and(|r| r.pooling);
            if !(s.sample && pooling) || next_row == 0 {
                continue;
            }
            // The sequence's last logit row is its last token's.
            let row = next_row - 1;
            let v = hidden.get(row * d..(row + 1) * d).with_context(|| {
                format!("pooling row {row} lies past the step's {rows} logit rows")
            })?;
            self.output.pooled.push((s.id, v.to_vec()));
        }
        Ok(())
    }

    /// For each drafting sequence whose drafts were not all accepted, puts
    /// its state back as it was before the step and runs the step's tokens
    /// up to the last accepted draft again (no logits; their K/V, written
    /// again, is what the step wrote), so the state ends where the
    /// sequence now ends. Runs after [`ModelRunner::take_sampled`].
    fn roll_back_rejected(&mut self, seqs: &[ScheduledSeq]) -> Result<()> {
        if self.state.num_slots() == 0 {
            return Ok(());
        }
        self.rerun.clear();
        let mut j = 0u32;
        for (i, s) in seqs.iter().enumerate() {
            if s.num_drafts == 0 {
                continue;
            }
            let snap = j;
            j += 1;
            let accepted = self
                .output
                .sampled(i)
                .len()
                .saturating_sub(1)
                .min(s.num_drafts);
            if accepted == s.num_drafts {
                continue;
            }
            let Some(r) = self.batch.get(s.id) else {
                continue;
            };
            self.state
                .copy_slot(&mut self.backend, &self.snapshot, snap, s.state_slot);
            // The real tokens and the accepted drafts, now in its tokens.
            let end = s.start + s.num_tokens - s.num_drafts + accepted;
            let prompt_kernel_until = if r.prompt_kernel { r.prompt_len } else { 0 };
            self.rerun.push_seq(
                &r.token_ids[s.start..end],
                s.start,
                &r.block_table,
                self.block_size,
                prompt_kernel_until,
                0,
            );
            self.rerun.state_slots.push(s.state_slot);
        }
        if self.rerun.num_tokens() == 0 {
            return Ok(());
        }
        let b = &mut self.backend;
        b.upload_step(&self.rerun, &mut self.step)
            .context("uploading the rolled-back sequences' step")?;
        self.state.slots.clone_from(&self.rerun.state_slots);
        self.model
            .forward(
                b,
                &self.step,
                self.rerun.num_tokens(),
                0,
                &mut self.kv,
                &mut self.state,
                &mut self.ws,
            )
            .context("running the accepted tokens again after rejected drafts")
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
        self.restore_checkpoints(&plan.seqs);
        self.snapshot_drafting(&plan.seqs)?;
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
        self.save_checkpoints(&plan.seqs);
        let vocab = self.model.config().vocab_size;
        let len = self.step_batch.logit_rows.len() * vocab;
        let b = &mut self.backend;
        b.reserve(&mut self.ws.logits, len)?;
        let host_rows = plan_sampling(
            &mut self.meta,
            &mut self.paths,
            vocab,
            &plan.seqs,
            &mut self.batch,
            guided,
        );
        if self.meta.num_rows() > 0 {
            b.sample(&mut self.ws.logits, vocab, &self.meta, &mut self.sampled)
                .context("sampling")?;
        }
        let logits: &mut [f32] = if host_rows > 0 {
            b.to_host(&mut self.ws.logits, host_rows * vocab)
                .context("reading the logits back")?
        } else {
            &mut []
        };
        finish_sampling(
            &mut self.sampler,
            &mut self.output,
            &mut self.verified,
            &mut self.paths,
            &self.meta,
            &self.sampled,
            logits,
            vocab,
            &plan.seqs,
            &mut self.batch,
        );
        self.take_sampled(&plan.seqs);
        // Before any rollback: its forward pass overwrites `ws.h`.
        self.pool(&plan.seqs)?;
        self.roll_back_rejected(&plan.seqs)?;
        self.propose(plan)?;
        Ok(&mut self.output)
    }

    fn set_speculator(&mut self, speculator: Option<Speculator>) {
        self.speculator = speculator;
    }

    fn enable_lora(&mut self, slots: usize, dtype: crate::engine::lora::LoraDtype) -> Result<()> {
        self.model.enable_lora(&self.backend, slots, dtype)?;
        self.lora_slots = LoraSlots::new(slots);
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes() + self.draft.as_ref().map_or(0, DraftModel::weight_bytes)
    }

    fn weight_type(&self) -> &'static str {
        self.model.weight_type()
    }

    fn state_bytes_per_seq(&self) -> usize {
        self.model.state_bytes_per_seq()
    }

    fn describe_device(&self) -> String {
        self.backend.describe()
    }
}

/// How a scheduled sequence's sampling row is served in a step.
enum SamplePath {
    /// Nothing is sampled: a prompt chunk, or no room left to generate.
    Nothing,
    /// Its drafts are verified on the host against its last rows, up to
    /// logit row `last`.
    Verify { last: usize },
    /// Sampled on the device: row `i` of the step's metadata.
    Device(usize),
    /// Sampled on the host from logit row `row`, read back raw: the
    /// device ranks only the likeliest alternatives, and a request with
    /// `logprob_token_ids` asks for chosen ids' scores.
    Host { row: usize },
    /// Its grammar's mask could not be computed.
    Failed(String),
}

/// Decides how each sequence of `seqs` samples, in `paths`, and gathers
/// into `meta` the rows that plainly sample (through their grammar's mask
/// where they have one), drawing each sampled (not greedy) row's uniform
/// from its request's stream now: the draw is the only use of the stream
/// a plain row makes in a step, so drawing it before the op is drawing it
/// where the host sampler did. Returns how many leading logit rows the
/// host needs back: those of prompt logprobs and of drafts to verify.
fn plan_sampling(
    meta: &mut SamplingMetadata,
    paths: &mut Vec<SamplePath>,
    vocab: usize,
    seqs: &[ScheduledSeq],
    batch: &mut InputBatch,
    guided: &mut [GuidedRow],
) -> usize {
    meta.clear(vocab);
    paths.clear();
    let mut host_rows = 0;
    let mut next_row = 0;
    let mut next_guided = 0;
    for s in seqs {
        // The sequence's logit rows, in plan order: prompt rows whose
        // logprobs were asked for, then the sampling row.
        let first_row = next_row;
        next_row += s.logit_rows;
        let Some(r) = batch.get_mut(s.id) else {
            paths.push(SamplePath::Nothing);
            continue;
        };
        if r.params.prompt_logprobs.is_some() {
            let scored = (0..s.logit_rows)
                .take_while(|i| s.logits_from() + i + 1 < r.prompt_len)
                .count();
            if scored > 0 {
                host_rows = host_rows.max(first_row + scored);
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
            paths.push(SamplePath::Nothing);
            continue;
        }
        if s.num_drafts > 0 {
            host_rows = host_rows.max(row + 1);
            paths.push(SamplePath::Verify { last: row });
            continue;
        }
        // No grammar here (the server refuses one beside
        // logprob_token_ids), so no mask to apply on the host.
        if !r.params.logprob_token_ids.is_empty() && guide.is_none() {
            host_rows = host_rows.max(row + 1);
            paths.push(SamplePath::Host { row });
            continue;
        }
        let mask = match guide.map(|g| g.mask.take()) {
            None => None,
            Some(Some(Ok(mask))) => Some(mask),
            Some(Some(Err(e))) => {
                paths.push(SamplePath::Failed(e));
                continue;
            }
            Some(None) => {
                paths.push(SamplePath::Failed("no mask was computed".into()));
                continue;
            }
        };
        r.push_sampling(meta, row, mask.as_ref().map(|m| m.words()));
        paths.push(SamplePath::Device(meta.num_rows() - 1));
    }
    host_rows
}

/// Writes one step's samples into `out`, sequence by sequence in plan
/// order: the scores of the prompt rows whose logprobs were asked for
/// (from `logits`, the leading rows read back), then what `paths` says of
/// its sampling row: the device's sample, a verification of its drafts
/// against its last `num_drafts + 1` rows, or a failure.
#[allow(clippy::too_many_arguments)]
fn finish_sampling(
    sampler: &mut Sampler,
    out: &mut ModelRunnerOutput,
    verified: &mut (Vec<u32>, Vec<Option<TokenLogprob>>),
    paths: &mut [SamplePath],
    meta: &SamplingMetadata,
    sampled: &SampledRows,
    logits: &mut [f32],
    vocab: usize,
    seqs: &[ScheduledSeq],
    batch: &mut InputBatch,
) {
    let mut next_row = 0;
    for (s, path) in seqs.iter().zip(paths.iter_mut()) {
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
        match std::mem::replace(path, SamplePath::Nothing) {
            SamplePath::Nothing => {}
            SamplePath::Failed(e) => out.fail(e),
            SamplePath::Device(i) => {
                let token = sampled.tokens[i];
                if token == NO_TOKEN {
                    out.fail(
                        "no token may be sampled: allowed_token_ids, bad_words, min_tokens and the grammar together exclude every token"
                            .into(),
                    );
                    continue;
                }
                let logprob = sampled.logprobs_of(meta, i).map(|l| TokenLogprob {
                    token_id: token,
                    logprob: l.logprob,
                    rank: l.rank,
                    top: l
                        .top_ids
                        .iter()
                        .copied()
                        .zip(l.top_logprobs.iter().copied())
                        .collect(),
                });
                out.push(token, logprob);
            }
            SamplePath::Host { row } => {
                let (mut req, _) = r.split();
                let sampled =
                    sampler.sample(&mut logits[row * vocab..(row + 1) * vocab], &mut req, None);
                out.push(sampled.token, sampled.logprob);
            }
            SamplePath::Verify { last } => {
                let (mut req, spec) = r.split();
                // Drafts never carry a grammar (see
                // `RequestState::may_speculate`): their rows are the
                // sequence's last `num_drafts + 1`.
                let first = last - s.num_drafts;
                let (tokens, logprobs) = verified;
                tokens.clear();
                logprobs.clear();
                sampler.verify(
                    &mut logits[first * vocab..(last + 1) * vocab],
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
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::input_batch::RequestState;
    use crate::engine::request::SamplingParams;
    use crate::engine::sampler::Sampler;
    use crate::engine::spec_decode::SpecState;
    use crate::engine::structured_output::TokenMask;
    use pagoda_accel::ops::sample::{sample_rows, SampleScratch, SampledRows, SamplingMetadata};
    use pagoda_accel::ThreadPool;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    /// A running request of `prompt` then `output`, seeded with `seed`.
    fn request(params: &SamplingParams, prompt: &[u32], output: &[u32], seed: u64) -> RequestState {
        let mut r = RequestState {
            id: seed,
            token_ids: prompt.to_vec(),
            prompt_len: prompt.len(),
            max_len: usize::MAX,
            params: params.clone(),
            eos_ids: vec![2],
            rng: StdRng::seed_from_u64(seed),
            output_counts: HashMap::new(),
            prompt_kernel: false,
            structured: false,
            block_table: Vec::new(),
            spec: SpecState::default(),
            lora: None,
            pooling: false,
        };
        for &t in output {
            r.append(t);
        }
        r
    }

    fn pick<T: Clone>(rng: &mut StdRng, xs: &[T]) -> T {
        xs[rng.random_range(0..xs.len())].clone()
    }

    /// Parameters with any mix of the processors and truncations on.
    fn random_params(rng: &mut StdRng, vocab: u32, output: &[u32]) -> SamplingParams {
        let ids = |rng: &mut StdRng, n: usize| -> Vec<u32> {
            (0..n).map(|_| rng.random_range(0..vocab)).collect()
        };
        let mut bad_words = Vec::new();
        if rng.random_bool(0.4) {
            bad_words.push(ids(rng, 1));
            // A two-token word whose first token ends the output: its
            // second is banned now.
            if let Some(&last) = output.last() {
                bad_words.push(vec![last, rng.random_range(0..vocab)]);
            }
            bad_words.push(ids(rng, 3));
        }
        let n_bias = rng.random_range(0..4);
        SamplingParams {
            temperature: pick(rng, &[Some(0.0), Some(0.6), None, Some(1.4)]),
            top_k: pick(rng, &[None, Some(-1), Some(1), Some(5), Some(40)]),
            top_p: pick(rng, &[None, Some(0.9), Some(0.5)]),
            min_p: pick(rng, &[None, Some(0.05)]),
            repetition_penalty: pick(rng, &[None, Some(1.2), Some(0.8)]),
            presence_penalty: pick(rng, &[0.0, 0.5]),
            frequency_penalty: pick(rng, &[0.0, -0.4, 0.3]),
            logit_bias: ids(rng, n_bias)
                .into_iter()
                .map(|t| (t, rng.random_range(-8.0f32..8.0)))
                .collect(),
            min_tokens: pick(rng, &[0, 0, 100]),
            stop_token_ids: vec![3],
            logprobs: pick(rng, &[None, Some(0), Some(3)]),
            allowed_token_ids: rng.random_bool(0.3).then(|| {
                let n = rng.random_range(1..vocab as usize / 2);
                ids(rng, n)
            }),
            bad_words_token_ids: bad_words,
            ..SamplingParams::default()
        }
    }

    /// What the runner's device path gives (each request's metadata row
    /// through the batched op) is what the host sampler gives one row at
    /// a time: the same ids, the same logprobs to the bit, and the random
    /// streams left in the same state.
    #[test]
    fn device_sampling_is_bitwise_the_host_sampler() {
        let pool = ThreadPool::new(2);
        let (mut scratch, mut sampled) = (SampleScratch::default(), SampledRows::default());
        let mut meta = SamplingMetadata::default();
        let mut host = Sampler::default();
        let (mut compared, mut excluded) = (0, 0);
        for seed in 0..60u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let vocab = pick(&mut rng, &[50usize, 1000, 32_000]);
            let n = rng.random_range(1..7);
            let logits: Vec<f32> = (0..n * vocab)
                .map(|_| {
                    if seed % 3 == 0 {
                        // Few levels: many exact ties.
                        rng.random_range(0..4) as f32
                    } else {
                        rng.random_range(-5.0f32..5.0)
                    }
                })
                .collect();
            let mut hosts = Vec::new();
            let mut devices = Vec::new();
            let mut masks = Vec::new();
            meta.clear(vocab);
            for i in 0..n {
                let prompt: Vec<u32> = (0..rng.random_range(1..30))
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect();
                let output: Vec<u32> = (0..rng.random_range(0..20))
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect();
                let params = random_params(&mut rng, vocab as u32, &output);
                let stream = seed * 100 + i as u64;
                hosts.push(request(&params, &prompt, &output, stream));
                let mut device = request(&params, &prompt, &output, stream);
                let mask = rng.random_bool(0.3).then(|| {
                    TokenMask::from_allowed(vocab, (0..vocab as u32).filter(|t| t % 3 != 1))
                });
                device.push_sampling(&mut meta, i, mask.as_ref().map(|m| m.words()));
                devices.push(device);
                masks.push(mask);
            }
            let mut batch = logits.clone();
            sample_rows(&pool, &mut batch, vocab, &meta, &mut scratch, &mut sampled);
            for i in 0..n {
                let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
                let (mut req, _) = hosts[i].split();
                let want = host.sample(&mut row, &mut req, masks[i].as_ref());
                if sampled.tokens[i] == pagoda_accel::ops::sample::NO_TOKEN {
                    // Nothing allowed: the host sampler has no answer to
                    // compare with.
                    excluded += 1;
                    continue;
                }
                compared += 1;
                assert_eq!(sampled.tokens[i], want.token, "seed {seed}, row {i}");
                let got = sampled.logprobs_of(&meta, i).map(|l| {
                    (
                        l.logprob.to_bits(),
                        l.rank,
                        l.top_ids.to_vec(),
                        l.top_logprobs
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                    )
                });
                let want = want.logprob.map(|l| {
                    (
                        l.logprob.to_bits(),
                        l.rank,
                        l.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                        l.top.iter().map(|t| t.1.to_bits()).collect::<Vec<_>>(),
                    )
                });
                assert_eq!(got, want, "seed {seed}, row {i}: logprobs");
                assert_eq!(
                    hosts[i].rng.random::<u64>(),
                    devices[i].rng.random::<u64>(),
                    "seed {seed}, row {i}: the streams drew differently"
                );
            }
        }
        assert!(
            compared > 10 * excluded,
            "{compared} rows compared, {excluded} allowed nothing"
        );
    }
}
