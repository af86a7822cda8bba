//! What a request asks for ([`SamplingParams`]) and the engine's record of
//! it while it runs ([`Request`]).

use std::time::Instant;

/// How to pick tokens and when to stop, with vLLM's names and defaults.
///
/// The `Option` fields are the ones a model may give defaults for in its
/// `generation_config.json` ([`SamplingDefaults`]): `None` means "not set".
/// The engine fills them from the model's defaults when it admits the
/// request ([`SamplingParams::apply_defaults`]); what is still unset then
/// reads as vLLM's built-in default through the accessor of the same name
/// ([`SamplingParams::temperature()`] and so on). A value the request sets
/// always wins over the model's.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Completions to return for the prompt.
    pub n: usize,
    /// Tokens to generate at most. `None`: the model's `max_new_tokens`,
    /// else up to the end of the context (either capped to the room the
    /// prompt leaves). A value set here that does not fit is an error.
    /// 0 runs the prompt and generates nothing: a request that only
    /// scores its prompt (`prompt_logprobs`), as evaluation harnesses send.
    pub max_tokens: Option<usize>,
    /// Tokens to generate before EOS or stop token ids may end the output.
    pub min_tokens: usize,
    /// 0 means greedy. Unset: the model's default, else 1.
    pub temperature: Option<f32>,
    /// Unset: the model's default, else 1 (off).
    pub top_p: Option<f32>,
    /// 0 or -1 disables top-k. Unset: the model's default, else off.
    pub top_k: Option<i32>,
    /// Unset: the model's default, else 0 (off).
    pub min_p: Option<f32>,
    /// Multiplicative penalty (>1 discourages) on tokens of the prompt and
    /// output. Unset: the model's default, else 1 (off).
    pub repetition_penalty: Option<f32>,
    /// Additive penalty on tokens that appeared in the output.
    pub presence_penalty: f32,
    /// Additive penalty scaled by how often a token appeared in the output.
    pub frequency_penalty: f32,
    /// Added to the logits of the given tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be sampled (vLLM's `allowed_token_ids`);
    /// `None` allows every token. Never empty.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences the output must not contain (vLLM's `bad_words`,
    /// tokenized): the last token of each is banned whenever the output
    /// ends with the tokens before it, so a one-token word is always
    /// banned. Each is non-empty.
    pub bad_words_token_ids: Vec<Vec<u32>>,
    /// Makes sampling reproducible.
    pub seed: Option<u64>,
    /// Strings that end the output (not included unless asked).
    pub stop: Vec<String>,
    /// Token ids that end the output, besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (the tokenizer's and the generation
    /// config's `eos_token_id`).
    pub ignore_eos: bool,
    /// Return this many top alternatives (plus the chosen token) per step.
    pub logprobs: Option<usize>,
    /// Return the log-probability of every prompt token after the first
    /// (given the tokens before it), with this many top alternatives, as
    /// vLLM's `prompt_logprobs`. Such a request computes its whole prompt
    /// (no prefix-cache hits), since cached positions have no logits.
    pub prompt_logprobs: Option<usize>,
    /// vLLM's `logprob_token_ids`: with `logprobs`, each step lists these
    /// ids' log-probabilities (in this order) as its alternatives, instead
    /// of the likeliest tokens: how a scorer compares label tokens.
    pub logprob_token_ids: Vec<u32>,
    pub skip_special_tokens: bool,
    pub include_stop_str_in_output: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            n: 1,
            max_tokens: None,
            min_tokens: 0,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            repetition_penalty: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words_token_ids: Vec::new(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logprob_token_ids: Vec::new(),
            skip_special_tokens: true,
            include_stop_str_in_output: false,
        }
    }
}

/// Defaults for what a request leaves unset, as a model's Hugging Face
/// `generation_config.json` recommends them (see
/// [`crate::engine::generation_config`]). Every field is optional: `None`
/// leaves vLLM's built-in default in place.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// `max_new_tokens`: the default `max_tokens`.
    pub max_tokens: Option<usize>,
    /// `eos_token_id`: ids that end generation as EOS does (unless
    /// `ignore_eos`), besides the tokenizer's own.
    pub eos_token_ids: Vec<u32>,
}

impl SamplingDefaults {
    /// Whether it sets nothing at all.
    pub fn is_empty(&self) -> bool {
        *self == SamplingDefaults::default()
    }

    /// A front end's own fallbacks placed under these defaults: each field
    /// of `fallback` is kept only where these defaults leave that field
    /// unset. Apply the result to a request with
    /// [`SamplingParams::apply_defaults`] and the engine applies the
    /// model's defaults to the rest, so the order is always: the request,
    /// then the model, then the front end's fallback.
    pub fn fallback_under(&self, fallback: SamplingDefaults) -> SamplingDefaults {
        fn keep<T>(model: &Option<T>, fallback: Option<T>) -> Option<T> {
            if model.is_some() {
                None
            } else {
                fallback
            }
        }
        SamplingDefaults {
            temperature: keep(&self.temperature, fallback.temperature),
            top_p: keep(&self.top_p, fallback.top_p),
            top_k: keep(&self.top_k, fallback.top_k),
            min_p: keep(&self.min_p, fallback.min_p),
            repetition_penalty: keep(&self.repetition_penalty, fallback.repetition_penalty),
            max_tokens: keep(&self.max_tokens, fallback.max_tokens),
            eos_token_ids: Vec::new(),
        }
    }

    /// The sampling fields it sets, as `name=value` in vLLM's names, for
    /// the start-up log.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut put = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                out.push(format!("{name}={v}"));
            }
        };
        put("temperature", self.temperature.map(|x| x.to_string()));
        put("top_p", self.top_p.map(|x| x.to_string()));
        put("top_k", self.top_k.map(|x| x.to_string()));
        put("min_p", self.min_p.map(|x| x.to_string()));
        put(
            "repetition_penalty",
            self.repetition_penalty.map(|x| x.to_string()),
        );
        put("max_tokens", self.max_tokens.map(|x| x.to_string()));
        if !self.eos_token_ids.is_empty() {
            out.push(format!("eos_token_id={:?}", self.eos_token_ids));
        }
        out
    }
}

/// A parameter that fails validation: which one, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// The offending field, as the API names it.
    pub param: &'static str,
    pub message: String,
}

fn bad(param: &'static str, message: String) -> ParamError {
    ParamError { param, message }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            ..Default::default()
        }
    }

    /// Fills every field the request left unset from `d`; fields it set
    /// are kept. Idempotent. The engine calls this with the model's
    /// defaults when it admits a request, on every path (the OpenAI
    /// server, the offline `LLM` API, `pagoda generate`, the benchmarks).
    pub fn apply_defaults(&mut self, d: &SamplingDefaults) {
        fn fill<T: Copy>(field: &mut Option<T>, default: Option<T>) {
            if field.is_none() {
                *field = default;
            }
        }
        fill(&mut self.temperature, d.temperature);
        fill(&mut self.top_p, d.top_p);
        fill(&mut self.top_k, d.top_k);
        fill(&mut self.min_p, d.min_p);
        fill(&mut self.repetition_penalty, d.repetition_penalty);
        fill(&mut self.max_tokens, d.max_tokens);
    }

    /// The temperature in effect: as set, else vLLM's 1.
    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }

    /// The nucleus mass in effect: as set, else 1 (off).
    pub fn top_p(&self) -> f32 {
        self.top_p.unwrap_or(1.0)
    }

    /// The top-k in effect: as set, else 0 (off).
    pub fn top_k(&self) -> i32 {
        self.top_k.unwrap_or(0)
    }

    /// The min-p in effect: as set, else 0 (off).
    pub fn min_p(&self) -> f32 {
        self.min_p.unwrap_or(0.0)
    }

    /// The repetition penalty in effect: as set, else 1 (off).
    pub fn repetition_penalty(&self) -> f32 {
        self.repetition_penalty.unwrap_or(1.0)
    }

    /// Checks every field against its range.
    pub fn validate(&self, vocab_size: usize) -> Result<(), ParamError> {
        if self.n == 0 || self.n > 128 {
            return Err(bad(
                "n",
                format!("n must be between 1 and 128, got {}", self.n),
            ));
        }
        let temperature = self.temperature();
        if !(temperature.is_finite() && (0.0..=100.0).contains(&temperature)) {
            return Err(bad(
                "temperature",
                format!("temperature must be between 0 and 100, got {temperature}"),
            ));
        }
        let top_p = self.top_p();
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = self.top_k();
        if top_k < -1 {
            return Err(bad(
                "top_k",
                format!("top_k must be -1 (disabled) or positive, got {top_k}"),
            ));
        }
        let min_p = self.min_p();
        if !(0.0..=1.0).contains(&min_p) {
            return Err(bad(
                "min_p",
                format!("min_p must be in [0, 1], got {min_p}"),
            ));
        }
        let rp = self.repetition_penalty();
        if !(rp.is_finite() && rp > 0.0 && rp <= 10.0) {
            return Err(bad(
                "repetition_penalty",
                format!("repetition_penalty must be in (0, 10], got {rp}"),
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(bad(
                "presence_penalty",
                format!(
                    "presence_penalty must be in [-2, 2], got {}",
                    self.presence_penalty
                ),
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(bad(
                "frequency_penalty",
                format!(
                    "frequency_penalty must be in [-2, 2], got {}",
                    self.frequency_penalty
                ),
            ));
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= vocab_size {
                return Err(bad(
                    "logit_bias",
                    format!("logit_bias names token {t}, beyond the vocabulary of {vocab_size}"),
                ));
            }
            if !(-100.0..=100.0).contains(&b) {
                return Err(bad(
                    "logit_bias",
                    format!("logit_bias values must be in [-100, 100], got {b}"),
                ));
            }
        }
        if let Some(allowed) = &self.allowed_token_ids {
            if allowed.is_empty() {
                return Err(bad(
                    "allowed_token_ids",
                    "allowed_token_ids must not be empty".into(),
                ));
            }
            if let Some(&t) = allowed.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(bad(
                    "allowed_token_ids",
                    format!("allowed token {t} is beyond the vocabulary of {vocab_size}"),
                ));
            }
        }
        for word in &self.bad_words_token_ids {
            if word.is_empty() {
                return Err(bad("bad_words", "bad words must not be empty".into()));
            }
            if let Some(&t) = word.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(bad(
                    "bad_words",
                    format!("bad word token {t} is beyond the vocabulary of {vocab_size}"),
                ));
            }
        }
        for &t in &self.stop_token_ids {
            if t as usize >= vocab_size {
                return Err(bad(
                    "stop_token_ids",
                    format!("stop token {t} is beyond the vocabulary of {vocab_size}"),
                ));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(bad("stop", "stop strings must not be empty".into()));
        }
        // The server holds requests to `--max-logprobs` (which may be
        // unlimited, vLLM's -1); here only what the vocabulary can give.
        if let Some(k) = self.logprobs {
            if k > vocab_size {
                return Err(bad(
                    "logprobs",
                    format!("at most {vocab_size} logprobs per token (the vocabulary), got {k}"),
                ));
            }
        }
        if !self.logprob_token_ids.is_empty() {
            if self.logprobs.is_none() {
                return Err(bad(
                    "logprob_token_ids",
                    "logprob_token_ids needs logprobs".into(),
                ));
            }
            if self.logprob_token_ids.len() > MAX_LOGPROB_TOKEN_IDS {
                return Err(bad(
                    "logprob_token_ids",
                    format!(
                        "at most {MAX_LOGPROB_TOKEN_IDS} logprob_token_ids, got {}",
                        self.logprob_token_ids.len()
                    ),
                ));
            }
            if let Some(&t) = self
                .logprob_token_ids
                .iter()
                .find(|&&t| t as usize >= vocab_size)
            {
                return Err(bad(
                    "logprob_token_ids",
                    format!(
                        "logprob_token_ids names token {t}, beyond the vocabulary of {vocab_size}"
                    ),
                ));
            }
        }
        if let Some(k) = self.prompt_logprobs {
            if k > vocab_size {
                return Err(bad(
                    "prompt_logprobs",
                    format!(
                        "at most {vocab_size} prompt logprobs per token (the vocabulary), got {k}"
                    ),
                ));
            }
        }
        if let Some(m) = self.max_tokens {
            if self.min_tokens > m {
                return Err(bad(
                    "min_tokens",
                    format!("min_tokens ({}) exceeds max_tokens ({m})", self.min_tokens),
                ));
            }
        }
        Ok(())
    }

    /// Whether sampling is plain argmax: temperature 0, or below 1e-5 as
    /// vLLM treats it (dividing logits by so small a temperature would
    /// overflow them to infinity), or top-k of 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature() < GREEDY_BELOW_TEMPERATURE || self.top_k() == 1
    }
}

/// The most top alternatives a request may ask for per token when the
/// server is not given `--max-logprobs` (vLLM's default).
pub const MAX_LOGPROBS: usize = 20;

/// The most ids `logprob_token_ids` may name (vLLM's
/// `MAX_LOGPROB_TOKEN_IDS`).
pub const MAX_LOGPROB_TOKEN_IDS: usize = 128;

/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_BELOW_TEMPERATURE: f32 = 1e-5;

/// Why a sequence stopped, as the OpenAI API reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// max_tokens or the context length.
    Length,
    /// Aborted by the client or the server.
    Abort,
}

impl FinishReason {
    /// The OpenAI name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// One token's log-probability and the best alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// 1 + how many tokens the model found likelier (vLLM's `rank`).
    pub rank: u32,
    /// The top alternatives, best first, as `(token_id, logprob)`.
    pub top: Vec<(u32, f32)>,
}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    Finished(FinishReason),
}

/// The engine's record of one sequence.
pub struct Request {
    /// The engine's id for this sequence.
    pub id: u64,
    /// The caller's id.
    pub external_id: String,
    /// Prompt followed by the generated tokens.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    pub num_cached_prompt: usize,
    /// Output tokens that were accepted drafts (speculative decoding).
    pub num_spec_accepted: usize,
    pub params: SamplingParams,
    /// Generation ends at this total length (prompt + output).
    pub max_len: usize,
    pub salt: u64,
    /// Whether the prompt positions run on the prompt kernel (see
    /// [`crate::engine::kv_cache::CacheKey::prompt_kernel`]).
    pub prompt_kernel: bool,
    pub priority: i64,
    /// The tenant the request is served for, and its share.
    pub tenant: crate::engine::fair_share::TenantShare,
    /// Admission order, for FCFS and for tie-breaks.
    pub arrival: u64,
    pub arrived_at: Instant,
    pub first_scheduled_at: Option<Instant>,
    pub status: RequestStatus,
    pub num_preemptions: u32,
    /// Eos ids of the model, unless `ignore_eos`.
    pub eos_ids: Vec<u32>,
    /// The seed of its random stream (the model runner keeps the stream):
    /// the request's own, else one derived from `--seed`; `None` draws one
    /// from the OS.
    pub(crate) seed: Option<u64>,
    /// Where the output stands in its structured-output grammar, if it has
    /// one. The engine takes it out for the steps that sample.
    pub(crate) grammar: Option<crate::engine::structured_output::GrammarMatcher>,
    /// While the output is still reasoning: the tokens that end it (see
    /// [`RequestOptions::reasoning_end`](crate::engine::core::RequestOptions)).
    /// Cleared once generated; the grammar applies from then on.
    pub(crate) reasoning_end: Option<Vec<u32>>,
    /// With `prompt_logprobs`: those of prompt tokens `1..=len()` so far
    /// (entry `i` scores token `i + 1`), until an output takes them.
    pub(crate) prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// Whether the prompt logprobs are complete (they may have been handed
    /// out already): a preempted request does not compute them again.
    pub(crate) prompt_logprobs_done: bool,
    /// Speculative decoding: how many drafts the runner proposed for the
    /// next step to verify (the runner holds the drafts themselves).
    pub(crate) num_drafts: usize,
    /// Whether the model runner knows the request (it was sent as new).
    pub(crate) announced: bool,
    /// How many entries of its block table the runner holds as they are
    /// now, and whether the table shrank below what was sent (rejected
    /// drafts gave blocks back), so the next step sends the change.
    pub(crate) blocks_sent: usize,
    pub(crate) blocks_shrunk: bool,
    /// The LoRA adapter it runs with, if any.
    pub lora: Option<std::sync::Arc<crate::engine::lora::LoadedLora>>,
    /// A pooling request: its prompt runs, the runner returns the pooled
    /// hidden state instead of sampling, and it leaves at once.
    pub pooling: bool,
}

/// Shortest prompt whose positions run on the prompt kernel where the model
/// has one. That kernel first dequantizes every weight to bf16, a fixed
/// cost of about 15 ms for the demo model on 2 threads, so short prompts
/// are faster on the exact kernels. Prompt tokens/s, `pagoda bench latency
/// --input-len N --output-len 2`, demo model, 2 threads, prompt kernel
/// against exact: N = 32: 1317 / 1574; 48: 1703 / 1567; 64: 2121 / 1786;
/// 128: 2632 / 1833; 256: 2673 / 1764.
pub const PROMPT_KERNEL_MIN_LEN: usize = 48;

impl Request {
    /// What besides its tokens decides which cached blocks it may share.
    pub fn cache_key(&self) -> crate::engine::kv_cache::CacheKey {
        crate::engine::kv_cache::CacheKey {
            salt: self.salt,
            prompt_len: self.prompt_len,
            prompt_kernel: self.prompt_kernel,
            lora: self.lora.as_ref().map_or(0, |l| l.id),
            owner: crate::engine::kv_cache::SHARED_OWNER,
        }
    }

    /// The first position whose logits are still wanted for prompt
    /// logprobs (position `p` scores token `p + 1`), if any are.
    pub fn prompt_logprobs_from(&self) -> Option<usize> {
        match &self.prompt_logprobs {
            Some(done) if !self.prompt_logprobs_done => Some(done.len()),
            _ => None,
        }
    }

    /// Records the score of the prompt token after position `pos`, unless
    /// it has one (a preempted request runs its prompt again).
    pub(crate) fn record_prompt_logprob(&mut self, pos: usize, score: TokenLogprob) {
        let want = self.prompt_len.saturating_sub(1);
        if let Some(done) = &mut self.prompt_logprobs {
            if pos == done.len() && pos < want {
                done.push(score);
            }
            self.prompt_logprobs_done |= done.len() >= want;
        }
    }

    /// The prompt logprobs, once complete, for the output that carries
    /// them (the first after the prompt ran).
    pub(crate) fn take_prompt_logprobs(&mut self) -> Option<Vec<TokenLogprob>> {
        if self.prompt_logprobs_done {
            self.prompt_logprobs.take()
        } else {
            None
        }
    }

    /// Whether drafts may be proposed for it after a step that samples
    /// its next token: its sampling depends on nothing a draft would change
    /// mid-step (no grammar, no penalties or bad words over the output, no
    /// EOS ban still to lift then). The runner decides how many (see
    /// [`crate::engine::spec_decode::Speculator::draft_len`]).
    pub(crate) fn may_draft_after_step(&self) -> bool {
        let p = &self.params;
        self.grammar.is_none()
            && p.bad_words_token_ids.is_empty()
            && p.repetition_penalty() == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && self.num_output() + 1 >= p.min_tokens
    }

    /// Tokens generated so far.
    pub fn output_ids(&self) -> &[u32] {
        &self.token_ids[self.prompt_len..]
    }

    /// Tokens generated so far, counted.
    pub fn num_output(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    /// Whether the request has finished.
    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }
}
