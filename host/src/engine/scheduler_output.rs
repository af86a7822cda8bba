//! What the scheduler decided for one step, as plain data for the model
//! runner (vLLM v1's `core/sched/output.py`): the requests it sees for the
//! first time, how many tokens of each scheduled sequence to compute, the
//! blocks their K/V goes to, and which requests left. Logical facts only:
//! the runner lays the device's metadata ([`pagoda_accel::StepBatch`]) out
//! from them and from the state it keeps per request, so a request that
//! runs for a thousand steps is described once.

use crate::engine::request::SamplingParams;

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: u64,
    /// Tokens already in the cache before this step; the step runs tokens
    /// `start..start + num_tokens`.
    pub start: usize,
    pub num_tokens: usize,
    /// The step reaches the end of the sequence, so a token is sampled.
    pub sample: bool,
    /// How many of the step's last tokens have logits: the sampling row,
    /// and the prompt rows whose log-probabilities the request asked for
    /// ([`ScheduledSeq::logits_from`] is the first one's position).
    pub logit_rows: usize,
    /// Of the `num_tokens`, how many at the end are drafts to verify
    /// (speculative decoding): the first `num_drafts` of those the runner
    /// proposed after the sequence's last step. Each has a logit row, as
    /// the last real token does.
    pub num_drafts: usize,
    /// Slots reserved past the step's tokens for a draft model's K/V: the
    /// most drafts it may propose after this step (0 when none may be).
    pub lookahead: usize,
    /// The sequence was admitted this step (new, or back from preemption):
    /// `start` tokens of it were found in the prefix cache.
    pub admitted: bool,
    /// The sequence's blocks changed: its table keeps its first `keep`
    /// entries and gains [`SchedulerOutput::new_blocks`]`[blocks]`.
    pub blocks: Option<BlockUpdate>,
    /// Its recurrent-state slot, for a hybrid model's linear layers
    /// ([`crate::engine::kv_cache::KvCacheManager::state_slot`]; 0 when the
    /// model has none).
    pub state_slot: u32,
    /// The checkpoint of the recurrent state to copy into `state_slot`
    /// before the step: where the sequence's prefix-cache hit ends.
    pub restore_state: Option<u32>,
    /// The checkpoint slot to copy `state_slot` into after the step, which
    /// ends on a block boundary ([`crate::engine::kv_cache::state_checkpoints`]).
    pub save_state: Option<u32>,
}

impl ScheduledSeq {
    /// The position of the first row with logits.
    pub fn logits_from(&self) -> usize {
        self.start + self.num_tokens - self.logit_rows
    }
}

/// How a sequence's block table changed since the runner last saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockUpdate {
    /// Entries kept from the table the runner holds (fewer than it holds
    /// when rejected drafts gave their blocks back).
    pub keep: usize,
    /// Where the blocks appended after them lie in
    /// [`SchedulerOutput::new_blocks`].
    pub from: usize,
    pub len: usize,
}

/// A request the runner has not seen: what it needs to sample for it for
/// the rest of its life.
#[derive(Clone, Debug)]
pub struct NewRequest {
    pub id: u64,
    /// The prompt (the runner appends what it samples).
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    /// The seed of its random stream; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Ids that end the output (banned while `min_tokens` is not reached).
    pub eos_ids: Vec<u32>,
    /// Generation ends at this total length (prompt + output).
    pub max_len: usize,
    /// Whether its prompt positions run on the prompt kernel.
    pub prompt_kernel: bool,
    /// Whether it follows a grammar (drafts are then never proposed).
    pub structured: bool,
    /// The LoRA adapter it runs with, if any.
    pub lora: Option<std::sync::Arc<crate::engine::lora::LoadedLora>>,
    /// A pooling request: the runner reads its last prompt row's hidden
    /// state instead of sampling.
    pub pooling: bool,
}

/// A step's plan.
#[derive(Debug, Default)]
pub struct SchedulerOutput {
    /// Requests scheduled for the first time, before their sequences.
    pub new_requests: Vec<NewRequest>,
    /// The sequences to run, in the order of the step's rows.
    pub seqs: Vec<ScheduledSeq>,
    /// Tokens the step runs, drafts included.
    pub num_tokens: usize,
    /// Block ids appended to tables (see [`ScheduledSeq::blocks`]).
    pub new_blocks: Vec<u32>,
    /// Sequences preempted since the last step: their blocks are gone and
    /// their drafts void; they come back as scheduled sequences later.
    pub preempted: Vec<u64>,
    /// Requests that left the engine since the last step.
    pub finished: Vec<u64>,
    /// Sequences running once the step was planned (speculative decoding
    /// pauses above a batch size).
    pub num_running: usize,
}

impl SchedulerOutput {
    /// Empties it, keeping its allocations.
    pub fn clear(&mut self) {
        self.new_requests.clear();
        self.seqs.clear();
        self.num_tokens = 0;
        self.new_blocks.clear();
        self.preempted.clear();
        self.finished.clear();
        self.num_running = 0;
    }

    /// Whether the runner has anything to do: a sequence to run, or state
    /// to drop.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty() && self.preempted.is_empty() && self.finished.is_empty()
    }
}
