//! Speculative decoding: a proposer drafts the next few tokens of a
//! sequence cheaply, the target model verifies all drafts of all sequences
//! in one batched forward (the scheduler gives each draft a slot in the
//! step, the runner samples every drafted row), and the sequence keeps the
//! longest verified prefix plus one token of the target's own. Rejected
//! drafts roll back: their KV slots are freed and never enter the prefix
//! cache.
//!
//! - [`config`]: `--speculative-config` (vLLM's keys) and the seed's
//!   `--speculative-model` / `--num-speculative-tokens`;
//! - [`ngram`]: prompt lookup, the longest suffix match in the history;
//! - [`SpecStats`]: the counters behind vLLM's `vllm:spec_decode_*` metrics.
//!
//! Verification itself (a prefix match under greedy sampling, rejection
//! sampling otherwise) lives in the sampler, next to the distribution it
//! must preserve.

pub mod config;
pub mod ngram;

pub use config::{DraftSampleMethod, SpecMethod, SpeculativeConfig};
pub use ngram::NgramProposer;

pub mod draft_model;
mod state;

pub use state::SpecState;

/// Where a [`Speculator`]'s drafts come from.
#[derive(Clone, Copy, Debug)]
pub enum Proposer {
    /// Prompt lookup, on the host.
    Ngram(NgramProposer),
    /// A draft model beside the target, on the same device
    /// ([`draft_model::DraftModel`]), which the model runner holds.
    DraftModel,
}

/// Drafting policy for the model runner: after each step, every sequence
/// that may speculate gets the drafts its next step verifies.
pub struct Speculator {
    proposer: Proposer,
    /// Drafts per sequence and step.
    k: usize,
    /// No drafts while more sequences than this run.
    max_batch: usize,
    /// Whether a draft model samples its drafts (`draft_sample_method`
    /// `probabilistic`) rather than taking its argmax.
    sample_drafts: bool,
}

impl Speculator {
    /// The speculator `config` describes; `default_max_batch` applies when
    /// it sets no `disable_by_batch_size`.
    pub fn new(config: &SpeculativeConfig, default_max_batch: usize) -> Speculator {
        let proposer = match &config.method {
            SpecMethod::Ngram { min, max } => Proposer::Ngram(NgramProposer::new(*min, *max)),
            SpecMethod::DraftModel { .. } => Proposer::DraftModel,
        };
        Speculator {
            proposer,
            k: config.num_speculative_tokens,
            max_batch: config.disable_by_batch_size.unwrap_or(default_max_batch),
            sample_drafts: config.draft_sample_method == DraftSampleMethod::Probabilistic,
        }
    }

    /// Whether drafts are sampled from the draft model's distribution.
    pub fn samples_drafts(&self) -> bool {
        self.sample_drafts
    }

    /// Where the drafts come from.
    pub fn proposer(&self) -> Proposer {
        self.proposer
    }

    /// Drafts per sequence and step at most (`num_speculative_tokens`).
    pub fn max_drafts(&self) -> usize {
        self.k
    }

    /// The most sequences running with which drafts are still made.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Whether `num_running` sequences are few enough to draft for.
    pub fn drafts_at(&self, num_running: usize) -> bool {
        num_running <= self.max_batch
    }

    /// Clears a sequence's drafts (`spec`) and says how many to draft for
    /// its next step: none while `num_running` sequences fill the batch,
    /// while its drafts are being rejected (the back-off), or when its
    /// sampling cannot be verified draft by draft (`may_speculate`);
    /// otherwise about one more than recent drafts got accepted, within
    /// `num_speculative_tokens` and `room`, what its length limit leaves.
    pub fn draft_len(
        &self,
        spec: &mut SpecState,
        may_speculate: bool,
        room: usize,
        num_running: usize,
    ) -> usize {
        spec.drafts.clear();
        spec.draft_probs.clear();
        if spec.pause > 0 {
            spec.pause -= 1;
            return 0;
        }
        if !self.drafts_at(num_running) || !may_speculate {
            return 0;
        }
        spec.draft_len(self.k).min(room)
    }
}

/// The most drafts per sequence and step: the per-position acceptance
/// counters are a fixed array so that the engine's stats stay `Copy`.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Speculative-decoding counters, as vLLM's metrics name them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verifications: one per sequence and step that carried drafts
    /// (`vllm:spec_decode_num_drafts_total`).
    pub num_drafts: u64,
    /// Drafted tokens verified (`vllm:spec_decode_num_draft_tokens_total`).
    pub num_draft_tokens: u64,
    /// Of those, accepted (`vllm:spec_decode_num_accepted_tokens_total`).
    pub num_accepted_tokens: u64,
    /// Accepted drafts by position in the draft
    /// (`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`).
    pub accepted_per_pos: [u64; MAX_SPECULATIVE_TOKENS],
    /// The most drafts verified at once so far: the positions worth
    /// reporting.
    pub num_positions: usize,
}

impl SpecStats {
    /// Records one verification of `drafted` tokens, the first `accepted`
    /// of which the target agreed with.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.num_drafts += 1;
        self.num_positions = self.num_positions.max(drafted.min(MAX_SPECULATIVE_TOKENS));
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        for p in &mut self.accepted_per_pos[..accepted.min(MAX_SPECULATIVE_TOKENS)] {
            *p += 1;
        }
    }

    /// Accepted over drafted tokens, if any were drafted.
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.num_draft_tokens > 0)
            .then(|| self.num_accepted_tokens as f64 / self.num_draft_tokens as f64)
    }
}
