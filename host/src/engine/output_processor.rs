//! The output processor: turns each sampled token into what the request's
//! client sees. It appends the token, detokenizes incrementally (UTF-8
//! safe), applies the stop conditions (EOS, stop token ids, stop strings,
//! the length limit) and releases only the text that can no longer turn into
//! a stop string. The engine core calls it once per sampled token; nothing
//! else shapes outputs.

use crate::engine::request::{FinishReason, Request, TokenLogprob};

/// Why a sequence stopped on `Stop`, when it was not EOS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// What one step produced for one request: the new tokens and text since
/// the last output, and the finish reason once it is done.
#[derive(Clone, Debug)]
pub struct StepOutput {
    pub id: u64,
    pub external_id: String,
    pub new_token_ids: Vec<u32>,
    pub new_text: String,
    pub logprobs: Vec<TokenLogprob>,
    /// With `prompt_logprobs`, on the first output after the prompt ran:
    /// the scores of prompt tokens 1.. (the first token has none).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
    pub num_output_tokens: usize,
    /// When the request was first scheduled (admission to the running set),
    /// for queue and prefill times.
    pub scheduled_at: Option<std::time::Instant>,
}

impl StepOutput {
    /// Extends this output with the next token's (several tokens come out
    /// of one step when drafts were verified).
    pub fn append(&mut self, next: StepOutput) {
        self.new_token_ids.extend_from_slice(&next.new_token_ids);
        self.new_text.push_str(&next.new_text);
        self.logprobs.extend(next.logprobs);
        if next.prompt_logprobs.is_some() {
            self.prompt_logprobs = next.prompt_logprobs;
        }
        self.finish_reason = next.finish_reason;
        self.stop_reason = next.stop_reason;
        self.num_output_tokens = next.num_output_tokens;
    }
}

/// Appends a sampled token to `req`, applies the stop conditions and
/// returns the output to emit: the new token and the text that can no
/// longer turn into a stop string, with the finish reason once `req` is
/// done (the caller then removes it from the scheduler). `grammar_complete`
/// says the request's structured-output grammar allows nothing more, which
/// ends the output as EOS would.
pub fn process_token(
    req: &mut Request,
    token: u32,
    logprob: Option<TokenLogprob>,
    grammar_complete: bool,
) -> StepOutput {
    req.token_ids.push(token);
    let delta = req.detok.push(token).unwrap_or_default();
    req.pending_text.push_str(&delta);
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
    if finish.is_none() && !p.stop.is_empty() {
        // Only the tail can hold a stop string that the new text completed.
        let longest = p.stop.iter().map(String::len).max().unwrap_or(0);
        let from = floor_char_boundary(
            &req.pending_text,
            req.pending_text.len().saturating_sub(delta.len() + longest),
        );
        let found = p
            .stop
            .iter()
            .filter_map(|s| {
                req.pending_text[from..]
                    .find(s.as_str())
                    .map(|i| (from + i, s))
            })
            .min_by_key(|(i, _)| *i);
        if let Some((at, s)) = found {
            let keep = if p.include_stop_str_in_output {
                at + s.len()
            } else {
                at
            };
            req.pending_text.truncate(keep);
            finish = Some(FinishReason::Stop);
            stop_reason = Some(StopReason::Text(s.clone()));
        }
    }
    if finish.is_none() && (req.token_ids.len() >= req.max_len) {
        finish = Some(FinishReason::Length);
    }
    let new_text = if finish.is_some() {
        if stop_reason
            .as_ref()
            .is_none_or(|r| !matches!(r, StopReason::Text(_)))
        {
            req.pending_text.push_str(&req.detok.finish());
        }
        std::mem::take(&mut req.pending_text)
    } else {
        // Hold back what could still be the start of a stop string.
        let hold = p
            .stop
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        let cut = floor_char_boundary(
            &req.pending_text,
            req.pending_text.len().saturating_sub(hold),
        );
        let rest = req.pending_text.split_off(cut);
        std::mem::replace(&mut req.pending_text, rest)
    };
    StepOutput {
        id: req.id,
        external_id: req.external_id.clone(),
        new_token_ids: vec![token],
        new_text,
        logprobs: logprob.into_iter().collect(),
        prompt_logprobs: req.take_prompt_logprobs(),
        finish_reason: finish,
        stop_reason,
        num_prompt_tokens: req.prompt_len,
        num_cached_tokens: req.num_cached_prompt,
        num_output_tokens: n_out,
        scheduled_at: req.first_scheduled_at,
    }
}

/// The final output of a request that generates nothing (`max_tokens` 0):
/// its prompt ran, and the prompt logprobs it asked for are complete.
pub fn prompt_only(req: &mut Request) -> StepOutput {
    StepOutput {
        id: req.id,
        external_id: req.external_id.clone(),
        new_token_ids: Vec::new(),
        new_text: String::new(),
        logprobs: Vec::new(),
        prompt_logprobs: req.take_prompt_logprobs(),
        finish_reason: Some(FinishReason::Length),
        stop_reason: None,
        num_prompt_tokens: req.prompt_len,
        num_cached_tokens: req.num_cached_prompt,
        num_output_tokens: 0,
        scheduled_at: req.first_scheduled_at,
    }
}

/// The final output of a request aborted before it finished.
pub fn aborted(req: Request) -> StepOutput {
    StepOutput {
        id: req.id,
        new_token_ids: Vec::new(),
        new_text: String::new(),
        logprobs: Vec::new(),
        prompt_logprobs: None,
        finish_reason: Some(FinishReason::Abort),
        stop_reason: None,
        num_prompt_tokens: req.prompt_len,
        num_cached_tokens: req.num_cached_prompt,
        num_output_tokens: req.token_ids.len() - req.prompt_len,
        scheduled_at: req.first_scheduled_at,
        external_id: req.external_id,
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
