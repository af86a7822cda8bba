//! What the engine core hands its front ends after each step (vLLM v1's
//! `EngineCoreOutput`): token ids, their logprobs and the token-level stop
//! decisions (EOS, stop token ids, a completed grammar, the length limit).
//! No text: detokenization and stop strings are the front end's, in the
//! [output processor](crate::engine::output_processor), off the engine
//! thread.

use crate::engine::request::{FinishReason, Request, TokenLogprob};

/// Why a sequence stopped on `Stop`, when it was not EOS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of its `stop_token_ids` (decided by the engine core).
    Token(u32),
    /// One of its `stop` strings (decided by the output processor).
    Text(String),
}

/// What one step produced for one request: the new token ids since the
/// last output, and the finish reason once the engine is done with it.
#[derive(Clone, Debug)]
pub struct EngineCoreOutput {
    pub id: u64,
    pub external_id: String,
    pub new_token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// With `prompt_logprobs`, on the first output after the prompt ran:
    /// the scores of prompt tokens 1.. (the first token has none).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
    pub num_output_tokens: usize,
    /// Of its output tokens so far, accepted drafts.
    pub num_spec_accepted: usize,
    /// When the request was first scheduled (admission to the running set),
    /// for queue and prefill times.
    pub scheduled_at: Option<std::time::Instant>,
    /// A pooling request's final output: the raw pooled hidden state.
    pub pooled: Option<Vec<f32>>,
}

impl EngineCoreOutput {
    /// Extends this output with the next token's (several tokens come out
    /// of one step when drafts were verified).
    pub fn append(&mut self, next: EngineCoreOutput) {
        self.new_token_ids.extend_from_slice(&next.new_token_ids);
        self.logprobs.extend(next.logprobs);
        if next.prompt_logprobs.is_some() {
            self.prompt_logprobs = next.prompt_logprobs;
        }
        if next.pooled.is_some() {
            self.pooled = next.pooled;
        }
        self.finish_reason = next.finish_reason;
        self.stop_reason = next.stop_reason;
        self.num_output_tokens = next.num_output_tokens;
        self.num_spec_accepted = next.num_spec_accepted;
    }

    /// Appends a sampled token to `req` and applies the token-level stop
    /// conditions: EOS and stop token ids (once `min_tokens` are out), a
    /// grammar that allows nothing more (`grammar_complete`, which ends the
    /// output as EOS would), then the length limit. Returns the output to
    /// emit, with the finish reason once `req` is done (the caller then
    /// removes it from the scheduler).
    pub fn token(
        req: &mut Request,
        token: u32,
        logprob: Option<TokenLogprob>,
        grammar_complete: bool,
    ) -> EngineCoreOutput {
        req.token_ids.push(token);
        let p = &req.params;
        let n_out = req.num_output();
        let mut finish = None;
        let mut stop_reason = None;
        if n_out >= p.min_tokens {
            if req.eos_ids.contains(&token) {
                finish = Some(FinishReason::Stop);
            } else if p.stop_token_ids.contains(&token) {
                finish = Some(FinishReason::Stop);
                stop_reason = Some(StopReason::Token(token));
            }
        }
        if finish.is_none() && grammar_complete {
            finish = Some(FinishReason::Stop);
        }
        if finish.is_none() && req.token_ids.len() >= req.max_len {
            finish = Some(FinishReason::Length);
        }
        EngineCoreOutput {
            id: req.id,
            external_id: req.external_id.clone(),
            new_token_ids: vec![token],
            logprobs: logprob.into_iter().collect(),
            prompt_logprobs: req.take_prompt_logprobs(),
            finish_reason: finish,
            stop_reason,
            num_prompt_tokens: req.prompt_len,
            num_cached_tokens: req.num_cached_prompt,
            num_spec_accepted: req.num_spec_accepted,
            num_output_tokens: n_out,
            scheduled_at: req.first_scheduled_at,
            pooled: None,
        }
    }

    /// The final output of a request that generates nothing (`max_tokens`
    /// 0): its prompt ran, and the prompt logprobs it asked for are
    /// complete.
    pub fn prompt_only(req: &mut Request) -> EngineCoreOutput {
        EngineCoreOutput {
            id: req.id,
            external_id: req.external_id.clone(),
            new_token_ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: req.take_prompt_logprobs(),
            finish_reason: Some(FinishReason::Length),
            stop_reason: None,
            num_prompt_tokens: req.prompt_len,
            num_cached_tokens: req.num_cached_prompt,
            num_spec_accepted: req.num_spec_accepted,
            num_output_tokens: 0,
            scheduled_at: req.first_scheduled_at,
            pooled: None,
        }
    }

    /// The final output of a request aborted before it finished.
    pub fn aborted(req: Request) -> EngineCoreOutput {
        EngineCoreOutput {
            id: req.id,
            new_token_ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: None,
            finish_reason: Some(FinishReason::Abort),
            stop_reason: None,
            num_prompt_tokens: req.prompt_len,
            num_cached_tokens: req.num_cached_prompt,
            num_spec_accepted: req.num_spec_accepted,
            num_output_tokens: req.token_ids.len() - req.prompt_len,
            scheduled_at: req.first_scheduled_at,
            pooled: None,
            external_id: req.external_id,
        }
    }
}
