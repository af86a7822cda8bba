//! The draft-model proposer: a smaller model beside the target, on the
//! same device, drafting each sequence's next tokens one batched
//! single-token step at a time. Its K/V lives in a pool of its own with as
//! many blocks as the target's, addressed by the same block tables, so a
//! draft's K/V slot is the slot its verified token will have; the scheduler
//! reserves those slots ahead ([`ScheduledSeq::lookahead`]) and the next
//! step gives back those of rejected drafts.
//!
//! [`ScheduledSeq::lookahead`]: crate::engine::scheduler_output::ScheduledSeq::lookahead

use crate::engine::models::{Model, Workspace};
use crate::engine::request::SamplingParams;
use crate::engine::sampler::Sampler;
use crate::engine::spec_decode::SpecState;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, StepBatch};
use rand::rngs::StdRng;

/// One sequence as the draft model sees it.
pub struct DraftSeq<'a> {
    /// Prompt and output so far, the token sampled this step included.
    pub token_ids: &'a [u32],
    pub block_table: &'a [u32],
    pub params: &'a SamplingParams,
    /// The request's random stream: drafts drawn from the draft model's
    /// distribution take from it, as verification does.
    pub rng: &'a mut StdRng,
    pub spec: &'a mut SpecState,
}

/// Where the draft model finds the sequences it drafts for (the model
/// runner's batch).
pub trait DraftSeqs {
    /// Request `id`, if it is still running.
    fn draft_seq(&mut self, id: u64) -> Option<DraftSeq<'_>>;
}

/// One sequence of the step just run, for the draft model.
#[derive(Clone, Copy, Debug)]
pub struct DraftPlan {
    pub id: u64,
    /// Tokens whose target K/V is now in the cache.
    pub computed: usize,
    /// Drafts to propose (its slots are reserved); 0 to only catch up.
    pub k: usize,
}

/// The draft model: its weights, its KV pool, its activations, and the
/// buffers its steps reuse.
pub struct DraftModel<B: Backend> {
    forward: DraftForward<B>,
    batch: StepBatch,
    /// Sequences still drafting, with how many drafts each makes.
    drafting: Vec<(u64, usize)>,
    sampler: Sampler,
}

impl<B: Backend> DraftModel<B> {
    /// The draft `model` over its pool `kv`.
    pub fn new(model: Model<B>, kv: B::Kv) -> DraftModel<B> {
        DraftModel {
            forward: DraftForward {
                model,
                kv,
                ws: Workspace::default(),
                step: B::Step::default(),
            },
            batch: StepBatch::default(),
            drafting: Vec::new(),
            sampler: Sampler::default(),
        }
    }

    /// Bytes of its weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.forward.model.weight_bytes()
    }

    /// Drafts after a step: the draft model first catches up on every
    /// planned sequence's tokens whose draft K/V it lacks (prompt chunks,
    /// verified drafts, the newly sampled token), then drafts `k` tokens
    /// for each sequence that has `k > 0`, one batched single-token step at
    /// a time, each chosen as the request samples (see [`Sampler::draft`])
    /// and fed back for the one after. The drafts land in each sequence's
    /// [`SpecState`].
    ///
    /// # Errors
    /// If the device failed.
    pub fn propose(
        &mut self,
        backend: &mut B,
        seqs: &mut dyn DraftSeqs,
        plan: &[DraftPlan],
        block_size: usize,
        sample_drafts: bool,
    ) -> Result<()> {
        let vocab = self.forward.model.config().vocab_size;
        let mut batch = std::mem::take(&mut self.batch);
        let mut drafting = std::mem::take(&mut self.drafting);
        batch.clear();
        drafting.clear();
        for p in plan {
            let Some(s) = seqs.draft_seq(p.id) else {
                continue;
            };
            let end = if p.k > 0 { p.computed + 1 } else { p.computed };
            let from = s.spec.draft_computed.min(end);
            if from == end {
                continue;
            }
            batch.push_seq(
                &s.token_ids[from..end],
                from,
                s.block_table,
                block_size,
                0,
                usize::from(p.k > 0),
            );
            s.spec.draft_computed = end;
            if p.k > 0 {
                drafting.push((p.id, p.k));
            }
        }
        let result = self.draft_steps(
            backend,
            seqs,
            &mut batch,
            &mut drafting,
            vocab,
            block_size,
            sample_drafts,
        );
        self.batch = batch;
        self.drafting = drafting;
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn draft_steps(
        &mut self,
        backend: &mut B,
        seqs: &mut dyn DraftSeqs,
        batch: &mut StepBatch,
        drafting: &mut Vec<(u64, usize)>,
        vocab: usize,
        block_size: usize,
        sample_drafts: bool,
    ) -> Result<()> {
        for j in 0.. {
            let logits = self.forward.run(backend, batch)?;
            batch.clear();
            let mut more = false;
            for (&(id, k), row) in drafting.iter().zip(logits.chunks_exact_mut(vocab)) {
                let Some(s) = seqs.draft_seq(id) else {
                    continue;
                };
                let token = self.sampler.draft(
                    row,
                    s.params,
                    s.rng,
                    &mut s.spec.draft_probs,
                    sample_drafts,
                );
                s.spec.drafts.push(token);
                if j + 1 < k {
                    let pos = s.token_ids.len() + j;
                    batch.push_seq(&[token], pos, s.block_table, block_size, 0, 1);
                    s.spec.draft_computed = pos + 1;
                    more = true;
                }
            }
            if !more {
                return Ok(());
            }
            // Sequences done drafting leave the next steps' rows.
            drafting.retain(|&(_, k)| j + 1 < k);
        }
        Ok(())
    }
}

/// The draft model's forward pass over its own pool and activations.
struct DraftForward<B: Backend> {
    model: Model<B>,
    kv: B::Kv,
    ws: Workspace<B>,
    step: B::Step,
}

impl<B: Backend> DraftForward<B> {
    /// Runs the draft model over `batch` and returns the logits of its
    /// logit rows, one `vocab`-wide row each, in host memory.
    fn run<'a>(&'a mut self, backend: &'a mut B, batch: &StepBatch) -> Result<&'a mut [f32]> {
        let n_logits = batch.logit_rows.len();
        if batch.num_tokens() > 0 {
            backend
                .upload_step(batch, &mut self.step)
                .context("uploading the draft step's metadata")?;
            self.model
                .forward(
                    backend,
                    &self.step,
                    batch.num_tokens(),
                    n_logits,
                    &mut self.kv,
                    // A hybrid draft model is refused at load: its state
                    // would need rolling back with each rejected draft.
                    &mut crate::engine::models::StateCache::default(),
                    &mut self.ws,
                )
                .context("running the draft model")?;
        }
        let len = n_logits * self.model.config().vocab_size;
        backend.reserve(&mut self.ws.logits, len)?;
        backend
            .to_host(&mut self.ws.logits, len)
            .context("reading the draft logits back")
    }
}
