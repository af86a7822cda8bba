//! The sampling fields every generation endpoint takes (completions,
//! chat, and the chat request a Responses or Messages request becomes):
//! the typed request part ([`SamplingRequest`], read by
//! [`crate::server::openai::wire::from_body`], which names a field of the
//! wrong type in `param`; unknown fields are ignored, as OpenAI does), and
//! its validated form for the engine ([`CommonParams`]).

use crate::engine::core::RequestOptions;
use crate::engine::request::SamplingParams;
use crate::server::errors::ApiError;
use crate::server::openai::structured::RequestedStructure;
use crate::server::openai::wire::{
    Count, Int, LogprobCount, Number, Object, Seed, Strings, TokenIds,
};
use serde::{Deserialize, Serialize};

/// What both endpoints share once parsed: the sampling parameters, engine
/// options and streaming flags.
#[derive(Debug, Clone)]
pub struct CommonParams {
    pub model: String,
    pub params: SamplingParams,
    pub opts: RequestOptions,
    pub stream: bool,
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` (with `include_usage`):
    /// every chunk carries the usage so far, as vLLM sends it.
    pub continuous_usage: bool,
    /// vLLM's `return_token_ids`: each choice carries its prompt's and its
    /// output's token ids.
    pub return_token_ids: bool,
    /// `max_tokens` was given (else the model's `max_new_tokens`, else the
    /// endpoint's default).
    pub max_tokens_given: bool,
    /// The structured output asked for, if any (compiled before submission).
    pub structured: Option<RequestedStructure>,
    /// `echo`. Completions: each choice's text (and, with `logprobs`, its
    /// logprobs) starts with the prompt. Chat (vLLM's): each message starts
    /// with the final message's text when that is an assistant's.
    pub echo: bool,
    /// vLLM's `prompt_logprobs` as asked: how many alternatives to list
    /// beside each prompt token in the response's `prompt_logprobs`.
    pub prompt_logprobs: Option<usize>,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name each token
    /// `token_id:{id}` instead of its text, so that clients can match
    /// tokens that do not decode on their own.
    pub tokens_as_ids: bool,
    /// A chat's generation prompt: what the model's template wrote after
    /// the conversation to open the reply (None where it is not known: a
    /// completion, or a prompt a tenant's plugin rendered). A reasoning
    /// parser reads it to tell whether the template opened or closed the
    /// reasoning.
    pub generation_prompt: Option<String>,
    /// vLLM's `bad_words`, as written: tokenized with the served model's
    /// tokenizer into [`SamplingParams::bad_words_token_ids`] before
    /// submission.
    pub bad_words: Vec<String>,
}

/// The sampling fields the generation endpoints share, as the client
/// wrote them (each endpoint's own fields are in its folder's
/// `protocol.rs`). Read from the body by [`from_body`]: a wrong type is a
/// 400 naming the field.
#[derive(Deserialize, Serialize, Debug, Clone, Default)]
pub struct SamplingRequest {
    pub model: Option<String>,
    pub max_tokens: Option<Count>,
    pub n: Option<Count>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub top_k: Option<Int>,
    pub min_p: Option<Number>,
    pub repetition_penalty: Option<Number>,
    pub presence_penalty: Option<Number>,
    pub frequency_penalty: Option<Number>,
    /// Token id (as a string key) → bias.
    pub logit_bias: Option<Object>,
    pub allowed_token_ids: Option<TokenIds>,
    pub seed: Option<Seed>,
    pub stop: Option<Strings>,
    pub stop_token_ids: Option<TokenIds>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<Count>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM 0.32's: the scores of these ids at every step stand in for
    /// the top alternatives.
    pub logprob_token_ids: Option<TokenIds>,
    pub best_of: Option<Count>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub echo: Option<bool>,
    pub prompt_logprobs: Option<LogprobCount>,
    pub priority: Option<Int>,
    pub cache_salt: Option<String>,
    pub return_token_ids: Option<bool>,
    pub return_tokens_as_token_ids: Option<bool>,
    pub bad_words: Option<Strings>,
}

/// `stream_options`.
#[derive(Deserialize, Serialize, Debug, Clone, Default)]
#[serde(expecting = "an object")]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's: every chunk carries the usage so far.
    pub continuous_usage_stats: Option<bool>,
}

/// What the generation endpoints read differently: how many tokens a
/// completion may have and how logprobs are asked for.
#[derive(Debug, Clone, Copy)]
pub enum EndpointSampling {
    /// `/v1/completions`: `logprobs` is a count; `suffix` is refused.
    Completion {
        logprobs: Option<LogprobCount>,
        suffix: bool,
    },
    /// Chat-shaped requests: `logprobs` is a flag with `top_logprobs`
    /// alternatives, and `max_completion_tokens` is `max_tokens`' newer
    /// name.
    Chat {
        logprobs: Option<bool>,
        top_logprobs: Option<LogprobCount>,
        max_completion_tokens: Option<Count>,
    },
}

/// The engine's view of a generation request's sampling fields. Fields
/// the request leaves out stay unset in the [`SamplingParams`], so that
/// the model's defaults (its `generation_config.json`) can fill them.
///
/// A request without `model` gets `default_model` (the first served name),
/// as vLLM does: lm-eval's `gguf` adapter and llama.cpp-era clients send
/// none.
pub fn parse_common(
    s: &SamplingRequest,
    endpoint: EndpointSampling,
    structured: Option<RequestedStructure>,
    default_model: Option<&str>,
) -> Result<CommonParams, ApiError> {
    let invalid = |param: &str, m: &str| ApiError::invalid(Some(param.into()), m);
    let chat = matches!(endpoint, EndpointSampling::Chat { .. });
    let model = s
        .model
        .as_deref()
        .or(default_model)
        .ok_or_else(|| invalid("model", "'model' is required"))?
        .to_string();
    let mut p = SamplingParams::default();
    let max_tokens = match endpoint {
        EndpointSampling::Chat {
            max_completion_tokens,
            ..
        } => max_completion_tokens.or(s.max_tokens),
        EndpointSampling::Completion { .. } => s.max_tokens,
    }
    .map(|c| c.0);
    p.max_tokens = max_tokens;
    if let Some(Count(n)) = s.n {
        p.n = n;
    }
    let number = |x: Option<Number>| x.map(|x| x.0);
    p.temperature = number(s.temperature);
    p.top_p = number(s.top_p);
    p.top_k = s
        .top_k
        .map(|Int(x)| i32::try_from(x).map_err(|_| invalid("top_k", "'top_k' is out of range")))
        .transpose()?;
    p.min_p = number(s.min_p);
    p.repetition_penalty = number(s.repetition_penalty);
    if let Some(Number(x)) = s.presence_penalty {
        p.presence_penalty = x;
    }
    if let Some(Number(x)) = s.frequency_penalty {
        p.frequency_penalty = x;
    }
    if let Some(Object(bias)) = &s.logit_bias {
        for (k, v) in bias {
            let t: u32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    Some("logit_bias".into()),
                    format!("logit_bias key '{k}' is not a token id"),
                )
            })?;
            let b = v
                .as_f64()
                .ok_or_else(|| invalid("logit_bias", "logit_bias values must be numbers"))?;
            p.logit_bias.push((t, b as f32));
        }
    }
    // An empty list is kept (and refused by validation), as vLLM refuses it.
    p.allowed_token_ids = s.allowed_token_ids.as_ref().map(|t| t.0.clone());
    p.seed = s.seed.map(|x| x.0);
    p.stop = s.stop.as_ref().map(|x| x.0.clone()).unwrap_or_default();
    p.stop_token_ids = s
        .stop_token_ids
        .as_ref()
        .map(|x| x.0.clone())
        .unwrap_or_default();
    if let Some(x) = s.ignore_eos {
        p.ignore_eos = x;
    }
    if let Some(Count(x)) = s.min_tokens {
        p.min_tokens = x;
    }
    if let Some(x) = s.skip_special_tokens {
        p.skip_special_tokens = x;
    }
    if let Some(x) = s.include_stop_str_in_output {
        p.include_stop_str_in_output = x;
    }
    match endpoint {
        EndpointSampling::Chat {
            logprobs,
            top_logprobs,
            ..
        } => {
            if logprobs.unwrap_or(false) {
                p.logprobs = Some(top_logprobs.map_or(0, |k| k.0));
            } else if top_logprobs.is_some_and(|k| k.0 > 0) {
                return Err(invalid(
                    "top_logprobs",
                    "'top_logprobs' requires 'logprobs' to be true",
                ));
            }
        }
        EndpointSampling::Completion { logprobs, suffix } => {
            p.logprobs = logprobs.map(|k| k.0);
            if suffix {
                return Err(invalid("suffix", "'suffix' is not supported"));
            }
        }
    }
    // vLLM 0.32's `logprob_token_ids`: the scores of these ids at every
    // step stand in for the top alternatives (`top_logprobs` is then
    // unused, as in vLLM). It needs logprobs asked for.
    if let Some(TokenIds(ids)) = &s.logprob_token_ids {
        if p.logprobs.is_none() {
            return Err(invalid(
                "logprob_token_ids",
                if chat {
                    "'logprob_token_ids' requires 'logprobs' to be true"
                } else {
                    "'logprob_token_ids' requires 'logprobs'"
                },
            ));
        }
        if !ids.is_empty() {
            p.logprobs = Some(0);
            p.logprob_token_ids = ids.clone();
        }
    }
    if let Some(Count(best_of)) = s.best_of {
        if best_of != p.n {
            return Err(invalid(
                "best_of",
                "'best_of' other than n is not supported",
            ));
        }
    }
    let stream = s.stream.unwrap_or(false);
    let echo = s.echo.unwrap_or(false);
    let prompt_logprobs = s.prompt_logprobs.map(|k| k.0);
    if stream && prompt_logprobs.is_some() {
        // As vLLM: prompt logprobs come whole, in the final body.
        return Err(invalid(
            "prompt_logprobs",
            "'prompt_logprobs' is not available when 'stream' is true; use 'echo' with 'logprobs' to stream the prompt's scores",
        ));
    }
    // The engine scores the prompt for either view, with enough
    // alternatives for both.
    p.prompt_logprobs = match (echo && !chat, p.logprobs) {
        (true, Some(k)) => Some(k.max(prompt_logprobs.unwrap_or(0))),
        _ => prompt_logprobs,
    };
    let (include_usage, continuous_usage) = match &s.stream_options {
        // As vLLM does: options of a stream that was not asked for are a
        // client mistake, not something to ignore.
        Some(_) if !stream => {
            return Err(invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ))
        }
        Some(o) => {
            let include = o.include_usage.unwrap_or(false);
            (
                include,
                include && o.continuous_usage_stats.unwrap_or(false),
            )
        }
        None => (false, false),
    };
    Ok(CommonParams {
        structured,
        model,
        max_tokens_given: max_tokens.is_some(),
        params: p,
        opts: RequestOptions {
            cache_salt: s.cache_salt.as_deref().map_or(0, salt_of),
            priority: s.priority.map_or(0, |x| x.0),
            grammar: None,
            tenant: Default::default(),
            sample_index: 0,
            reasoning_end: None,
            lora: None,
            pooling: false,
        },
        stream,
        include_usage,
        continuous_usage,
        return_token_ids: s.return_token_ids.unwrap_or(false),
        echo,
        prompt_logprobs,
        tokens_as_ids: s.return_tokens_as_token_ids.unwrap_or(false),
        bad_words: s
            .bad_words
            .as_ref()
            .map(|x| x.0.clone())
            .unwrap_or_default(),
        generation_prompt: None,
    })
}

/// Hashes a salt string (the tenant and `cache_salt`) into the prefix
/// cache's salt.
pub fn salt_of(s: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}
