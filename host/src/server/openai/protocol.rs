//! Parsing and validation of OpenAI requests. Bodies are read as JSON
//! values and fields are taken one by one, so a wrong type is reported with
//! the field's name in `param`; unknown fields are ignored, as OpenAI does.

use crate::engine::core::RequestOptions;
use crate::engine::request::SamplingParams;
use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;

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
    pub structured: Option<crate::server::openai::structured::RequestedStructure>,
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

/// Parses the sampling fields common to completions and chat. Fields the
/// request leaves out stay unset in the [`SamplingParams`], so that the
/// model's defaults (its `generation_config.json`) can fill them.
///
/// A request without `model` gets `default_model` (the first served name),
/// as vLLM does: lm-eval's `gguf` adapter and llama.cpp-era clients send
/// none.
pub fn parse_common(
    f: &Fields<'_>,
    chat: bool,
    default_model: Option<&str>,
) -> Result<CommonParams, ApiError> {
    let model = f
        .str("model")?
        .or(default_model)
        .ok_or_else(|| ApiError::invalid(Some("model".into()), "'model' is required"))?
        .to_string();
    let mut p = SamplingParams::default();
    let max_tokens = if chat {
        match f.usize("max_completion_tokens")? {
            Some(x) => Some(x),
            None => f.usize("max_tokens")?,
        }
    } else {
        f.usize("max_tokens")?
    };
    p.max_tokens = max_tokens;
    if let Some(n) = f.usize("n")? {
        p.n = n;
    }
    p.temperature = f.f32("temperature")?;
    p.top_p = f.f32("top_p")?;
    p.top_k = f
        .i64("top_k")?
        .map(|x| {
            i32::try_from(x)
                .map_err(|_| ApiError::invalid(Some("top_k".into()), "'top_k' is out of range"))
        })
        .transpose()?;
    p.min_p = f.f32("min_p")?;
    p.repetition_penalty = f.f32("repetition_penalty")?;
    if let Some(x) = f.f32("presence_penalty")? {
        p.presence_penalty = x;
    }
    if let Some(x) = f.f32("frequency_penalty")? {
        p.frequency_penalty = x;
    }
    if let Some(bias) = f.object("logit_bias")? {
        for (k, v) in bias {
            let t: u32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    Some("logit_bias".into()),
                    format!("logit_bias key '{k}' is not a token id"),
                )
            })?;
            let b = v.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    Some("logit_bias".into()),
                    "logit_bias values must be numbers",
                )
            })?;
            p.logit_bias.push((t, b as f32));
        }
    }
    // An empty list is kept (and refused by validation), as vLLM refuses it.
    if f.get("allowed_token_ids").is_some() {
        p.allowed_token_ids = Some(f.u32s("allowed_token_ids")?);
    }
    p.seed = f.u64("seed")?;
    p.stop = f.strings("stop")?;
    p.stop_token_ids = f.u32s("stop_token_ids")?;
    if let Some(x) = f.bool("ignore_eos")? {
        p.ignore_eos = x;
    }
    if let Some(x) = f.usize("min_tokens")? {
        p.min_tokens = x;
    }
    if let Some(x) = f.bool("skip_special_tokens")? {
        p.skip_special_tokens = x;
    }
    if let Some(x) = f.bool("include_stop_str_in_output")? {
        p.include_stop_str_in_output = x;
    }
    if chat {
        if f.bool("logprobs")?.unwrap_or(false) {
            p.logprobs = Some(f.logprob_count("top_logprobs")?.unwrap_or(0));
        } else if f.logprob_count("top_logprobs")?.is_some_and(|k| k > 0) {
            return Err(ApiError::invalid(
                Some("top_logprobs".into()),
                "'top_logprobs' requires 'logprobs' to be true",
            ));
        }
    } else {
        p.logprobs = f.logprob_count("logprobs")?;
        if f.str("suffix")?.is_some() {
            return Err(ApiError::invalid(
                Some("suffix".into()),
                "'suffix' is not supported",
            ));
        }
    }
    // vLLM 0.32's `logprob_token_ids`: the scores of these ids at every
    // step stand in for the top alternatives (`top_logprobs` is then
    // unused, as in vLLM). It needs logprobs asked for.
    if f.get("logprob_token_ids").is_some() {
        let ids = f.u32s("logprob_token_ids")?;
        if p.logprobs.is_none() {
            return Err(ApiError::invalid(
                Some("logprob_token_ids".into()),
                if chat {
                    "'logprob_token_ids' requires 'logprobs' to be true"
                } else {
                    "'logprob_token_ids' requires 'logprobs'"
                },
            ));
        }
        if !ids.is_empty() {
            p.logprobs = Some(0);
            p.logprob_token_ids = ids;
        }
    }
    if let Some(best_of) = f.usize("best_of")? {
        if best_of != p.n {
            return Err(ApiError::invalid(
                Some("best_of".into()),
                "'best_of' other than n is not supported",
            ));
        }
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let echo = f.bool("echo")?.unwrap_or(false);
    let prompt_logprobs = f.logprob_count("prompt_logprobs")?;
    if stream && prompt_logprobs.is_some() {
        // As vLLM: prompt logprobs come whole, in the final body.
        return Err(ApiError::invalid(
            Some("prompt_logprobs".into()),
            "'prompt_logprobs' is not available when 'stream' is true; use 'echo' with 'logprobs' to stream the prompt's scores",
        ));
    }
    // The engine scores the prompt for either view, with enough
    // alternatives for both.
    p.prompt_logprobs = match (echo && !chat, p.logprobs) {
        (true, Some(k)) => Some(k.max(prompt_logprobs.unwrap_or(0))),
        _ => prompt_logprobs,
    };
    let include_usage = match f.object("stream_options")? {
        // As vLLM does: options of a stream that was not asked for are a
        // client mistake, not something to ignore.
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                Some("stream_options".into()),
                "'stream_options' is only allowed when 'stream' is true",
            ))
        }
        Some(o) => Fields(o).bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let continuous_usage = include_usage
        && match f.object("stream_options")? {
            Some(o) => Fields(o).bool("continuous_usage_stats")?.unwrap_or(false),
            None => false,
        };
    let priority = f.i64("priority")?.unwrap_or(0);
    let cache_salt = match f.str("cache_salt")? {
        Some(s) => salt_of(s),
        None => 0,
    };
    let structured = crate::server::openai::structured::parse(f)?;
    Ok(CommonParams {
        structured,
        model,
        max_tokens_given: max_tokens.is_some(),
        params: p,
        opts: RequestOptions {
            cache_salt,
            priority,
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
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        echo,
        prompt_logprobs,
        tokens_as_ids: f.bool("return_tokens_as_token_ids")?.unwrap_or(false),
        bad_words: f.strings("bad_words")?,
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
