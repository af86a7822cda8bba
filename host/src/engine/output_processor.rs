//! The output processor (vLLM v1's `engine/output_processor.py`): turns the
//! engine core's token ids into what each request's client sees, in the
//! front end rather than on the engine thread. It detokenizes incrementally
//! (UTF-8 safe), applies the stop strings, and releases only the text that
//! can no longer turn into one. A stop string ends the output there: the
//! processor reports it, and its caller aborts the request in the engine
//! core (which may have run a step past it; those tokens are dropped).

use crate::engine::core_output::EngineCoreOutput;
pub use crate::engine::core_output::StopReason;
use crate::engine::request::{FinishReason, SamplingParams, TokenLogprob};
use crate::tokenizer::detokenizer::IncrementalDetokenizer;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::sync::Arc;

/// What one step produced for one request, as its client sees it: the new
/// tokens and text since the last output, and the finish reason once it is
/// done.
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
    /// Of its output tokens so far, accepted drafts.
    pub num_spec_accepted: usize,
    /// When the request was first scheduled (admission to the running set),
    /// for queue and prefill times.
    pub scheduled_at: Option<std::time::Instant>,
    /// A pooling request's final output: the raw pooled hidden state
    /// (see [`crate::engine::pooling::PoolerConfig::finish`]).
    pub pooled: Option<Vec<f32>>,
}

/// The strings that end a request's output, from its parameters.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
}

impl StopStrings {
    /// Those of `params`.
    pub fn of(params: &SamplingParams) -> StopStrings {
        StopStrings {
            stop: params.stop.clone(),
            include_stop_str_in_output: params.include_stop_str_in_output,
        }
    }
}

/// One request's text so far.
struct TextState {
    detok: IncrementalDetokenizer,
    /// Text generated and not yet released (held back while it could be
    /// the start of a stop string).
    pending: String,
    stop: Vec<String>,
    include_stop_str_in_output: bool,
}

/// The front end's per-request detokenizers and stop strings.
#[derive(Default)]
pub struct OutputProcessor {
    requests: HashMap<u64, TextState>,
}

/// What [`OutputProcessor::process`] made of an engine output.
pub struct Processed {
    pub output: StepOutput,
    /// A stop string ended the request while the engine core still runs
    /// it: abort it there.
    pub abort_in_core: bool,
}

impl OutputProcessor {
    /// Starts following engine request `id`, whose text `detok` decodes
    /// ([`OutputProcessor::detokenizer`]) and `stop` ends (its `stop`
    /// strings and `include_stop_str_in_output`, from its parameters).
    pub fn add(&mut self, id: u64, detok: IncrementalDetokenizer, stop: StopStrings) {
        self.requests.insert(
            id,
            TextState {
                detok,
                pending: String::new(),
                stop: stop.stop,
                include_stop_str_in_output: stop.include_stop_str_in_output,
            },
        );
    }

    /// The detokenizer for a request with prompt `prompt_ids`, sampled by
    /// `params` (it keeps only the prompt's last few tokens, as context).
    pub fn detokenizer(
        tokenizer: Arc<Tokenizer>,
        prompt_ids: &[u32],
        params: &SamplingParams,
    ) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(tokenizer, prompt_ids, params.skip_special_tokens)
    }

    /// Whether it follows request `id`.
    pub fn contains(&self, id: u64) -> bool {
        self.requests.contains_key(&id)
    }

    /// Stops following request `id` (its client went away).
    pub fn remove(&mut self, id: u64) {
        self.requests.remove(&id);
    }

    /// Turns an engine output into the client's: its tokens' text, cut at
    /// the first stop string they complete (the tokens after it are
    /// dropped). `None` for a request it does not follow (one already
    /// finished by a stop string, which the engine ran a little longer).
    pub fn process(&mut self, out: EngineCoreOutput) -> Option<Processed> {
        let state = self.requests.get_mut(&out.id)?;
        let mut out = out;
        let engine_finish = out.finish_reason;
        let mut finish = engine_finish;
        let mut stop_reason = out.stop_reason.take();
        let mut text_stop = false;
        let mut new_text = String::new();
        // Output tokens before this output's, for the count at a cut.
        let before = out.num_output_tokens - out.new_token_ids.len();
        let mut kept = out.new_token_ids.len();
        for (j, &token) in out.new_token_ids.iter().enumerate() {
            let delta = state.detok.push(token).unwrap_or_default();
            state.pending.push_str(&delta);
            let last = j + 1 == out.new_token_ids.len();
            // The engine's own stop (EOS, a stop token, a grammar) comes
            // first; a stop string beats the length limit, as it does in
            // vLLM.
            let engine_stopped = last && engine_finish == Some(FinishReason::Stop);
            if !engine_stopped && !state.stop.is_empty() {
                if let Some(s) = find_stop(state, delta.len()) {
                    finish = Some(FinishReason::Stop);
                    stop_reason = Some(StopReason::Text(s));
                    text_stop = true;
                    kept = j + 1;
                    break;
                }
            }
        }
        out.new_token_ids.truncate(kept);
        out.logprobs.truncate(kept);
        let num_output_tokens = before + kept;
        match finish {
            Some(FinishReason::Abort) => {
                // An aborted request's held-back text is not released.
            }
            Some(_) => {
                if !text_stop {
                    state.pending.push_str(&state.detok.finish());
                }
                new_text = std::mem::take(&mut state.pending);
            }
            None => {
                // Hold back what could still be the start of a stop string.
                let hold = state
                    .stop
                    .iter()
                    .map(|s| s.len().saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                let cut =
                    floor_char_boundary(&state.pending, state.pending.len().saturating_sub(hold));
                let rest = state.pending.split_off(cut);
                new_text = std::mem::replace(&mut state.pending, rest);
            }
        }
        if finish.is_some() {
            self.requests.remove(&out.id);
        }
        Some(Processed {
            abort_in_core: text_stop && engine_finish.is_none(),
            output: StepOutput {
                id: out.id,
                external_id: out.external_id,
                new_token_ids: out.new_token_ids,
                new_text,
                logprobs: out.logprobs,
                prompt_logprobs: out.prompt_logprobs,
                finish_reason: finish,
                stop_reason,
                num_prompt_tokens: out.num_prompt_tokens,
                num_cached_tokens: out.num_cached_tokens,
                num_spec_accepted: out.num_spec_accepted.min(num_output_tokens),
                num_output_tokens,
                scheduled_at: out.scheduled_at,
                pooled: out.pooled,
            },
        })
    }
}

/// The earliest stop string that the text just added (the last
/// `delta_len` bytes of the pending text) completed, if any: the pending
/// text is cut at it (after it, with `include_stop_str_in_output`).
fn find_stop(state: &mut TextState, delta_len: usize) -> Option<String> {
    // Only the tail can hold a stop string that the new text completed.
    let longest = state.stop.iter().map(String::len).max().unwrap_or(0);
    let from = floor_char_boundary(
        &state.pending,
        state.pending.len().saturating_sub(delta_len + longest),
    );
    let (at, s) = state
        .stop
        .iter()
        .filter_map(|s| {
            state.pending[from..]
                .find(s.as_str())
                .map(|i| (from + i, s))
        })
        .min_by_key(|(i, _)| *i)?;
    let keep = if state.include_stop_str_in_output {
        at + s.len()
    } else {
        at
    };
    let s = s.clone();
    state.pending.truncate(keep);
    Some(s)
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
