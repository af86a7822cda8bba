//! What one step computed, as plain data for the scheduler (vLLM v1's
//! `outputs.py`): the ids sampled for each scheduled sequence, their
//! logprobs, the prompt-token scores asked for, and how many drafts the
//! runner proposed for each sequence's next step. The vectors are reused
//! from step to step, so a warm greedy step allocates nothing.

use crate::engine::request::TokenLogprob;

/// What one step sampled, sequence by sequence in plan order.
#[derive(Default)]
pub struct ModelRunnerOutput {
    /// One entry per scheduled sequence, in plan order.
    pub seqs: Vec<SeqSampled>,
    tokens: Vec<u32>,
    logprobs: Vec<Option<TokenLogprob>>,
    /// The prompt-token scores the step computed, for requests that asked
    /// for prompt logprobs.
    pub prompt_logprobs: Vec<PromptScore>,
    /// The pooled hidden states of the pooling requests that reached
    /// their end this step, by request id.
    pub pooled: Vec<(u64, Vec<f32>)>,
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
    /// Drafts proposed for its next step to verify.
    pub num_drafts: usize,
}

/// The score of the prompt token after position `pos` of request `id`.
pub struct PromptScore {
    pub id: u64,
    pub pos: usize,
    pub score: TokenLogprob,
}

impl ModelRunnerOutput {
    /// Empties it, keeping its allocations.
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.tokens.clear();
        self.logprobs.clear();
        self.prompt_logprobs.clear();
        self.pooled.clear();
    }

    /// Takes request `id`'s pooled hidden state, if the step made one.
    pub fn take_pooled(&mut self, id: u64) -> Option<Vec<f32>> {
        let i = self.pooled.iter().position(|(p, _)| *p == id)?;
        Some(self.pooled.swap_remove(i).1)
    }

    /// Opens sequence `id`'s entry; what is pushed until the next call is
    /// its.
    pub fn begin(&mut self, id: u64) {
        self.seqs.push(SeqSampled {
            id,
            first: self.tokens.len(),
            len: 0,
            failure: None,
            num_drafts: 0,
        });
    }

    /// Appends a sampled id (and its logprob, if asked for) to the
    /// sequence opened last.
    pub fn push(&mut self, token: u32, logprob: Option<TokenLogprob>) {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        if let Some(s) = self.seqs.last_mut() {
            s.len += 1;
        }
    }

    /// Marks the sequence opened last as failed.
    pub fn fail(&mut self, why: String) {
        if let Some(s) = self.seqs.last_mut() {
            s.failure = Some(why);
        }
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
