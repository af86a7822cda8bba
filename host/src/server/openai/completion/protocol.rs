//! What `/v1/completions` takes beyond the shared sampling fields
//! ([`crate::server::openai::protocol`]): its `prompt`.

use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use serde_json::Value;

/// A completions prompt: a string, a list of strings, a list of token ids
/// or a list of lists of token ids.
#[derive(Debug, Clone)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// Parses `prompt` of a completions request.
pub fn parse_prompts(f: &Fields<'_>) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("prompt".into()),
            "'prompt' must be a string, a list of strings, or token ids",
        )
    };
    let v = f
        .get("prompt")
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
