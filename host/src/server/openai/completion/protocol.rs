//! A `/v1/completions` request: the sampling fields every generation
//! endpoint shares ([`crate::server::openai::protocol`]) and its own, the
//! `prompt` above all.

use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use crate::server::openai::protocol::{
    parse_common, CommonParams, EndpointSampling, SamplingRequest,
};
use crate::server::openai::structured;
use crate::server::openai::wire::{from_body, LogprobCount};
use serde::Deserialize;
use serde_json::Value;

/// A completions request, typed.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub sampling: SamplingRequest,
    pub completion: CompletionFields,
}

/// What a completions request adds to the shared sampling fields.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct CompletionFields {
    /// As written: [`parse_prompts`] reads its four shapes.
    pub prompt: Option<Value>,
    /// How many alternatives to list per token.
    pub logprobs: Option<LogprobCount>,
    /// Refused: no model served here fills in the middle.
    pub suffix: Option<String>,
}

impl CompletionRequest {
    /// Reads a completions body; a field of the wrong type is a 400
    /// naming it.
    pub fn from_body(body: &Value) -> Result<Self, ApiError> {
        Ok(CompletionRequest {
            sampling: from_body(body)?,
            completion: from_body(body)?,
        })
    }

    /// The request's sampling as the engine takes it, with the output
    /// format the body's structured-output fields ask for.
    pub fn common(
        &self,
        body: &Value,
        default_model: Option<&str>,
    ) -> Result<CommonParams, ApiError> {
        let structured = structured::parse(&Fields::of(body)?)?;
        parse_common(
            &self.sampling,
            EndpointSampling::Completion {
                logprobs: self.completion.logprobs,
                suffix: self.completion.suffix.is_some(),
            },
            structured,
            default_model,
        )
    }
}

/// A completions prompt: a string, a list of strings, a list of token ids
/// or a list of lists of token ids.
#[derive(Debug, Clone)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// Parses `prompt` of a completions request.
pub fn parse_prompts(prompt: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("prompt".into()),
            "'prompt' must be a string, a list of strings, or token ids",
        )
    };
    let v = prompt
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::invalid(Some("prompt".into()), "'prompt' is required"))?;
    let tokens = |a: &Vec<Value>| -> Option<Vec<u32>> {
        a.iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    let out = match v {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::invalid(
                Some("prompt".into()),
                "'prompt' must not be empty",
            ))
        }
        Value::Array(a) if a[0].is_string() => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(|s| PromptInput::Text(s.to_string()))
                    .ok_or_else(bad)
            })
            .collect::<Result<_, _>>()?,
        Value::Array(a) if a[0].is_number() => {
            vec![PromptInput::Tokens(tokens(a).ok_or_else(bad)?)]
        }
        Value::Array(a) if a[0].is_array() => a
            .iter()
            .map(|x| {
                x.as_array()
                    .and_then(tokens)
                    .map(PromptInput::Tokens)
                    .ok_or_else(bad)
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    if out.len() > 256 {
        return Err(ApiError::invalid(
            Some("prompt".into()),
            "at most 256 prompts per request",
        ));
    }
    Ok(out)
}
