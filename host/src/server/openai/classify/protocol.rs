//! `/classify`'s body, as vLLM takes it.

use crate::server::errors::ApiError;
use serde::Deserialize;
use serde_json::Value;

/// `/classify`'s body, as vLLM's `ClassificationRequest` takes text.
#[derive(Deserialize)]
pub(crate) struct ClassifyRequest {
    pub(crate) model: Option<String>,
    pub(crate) input: Value,
    #[serde(default)]
    pub(crate) truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) priority: Option<i64>,
    #[serde(default)]
    pub(crate) use_activation: Option<bool>,
    /// vLLM's older name for `use_activation`.
    #[serde(default)]
    pub(crate) activation: Option<bool>,
}

/// `input`: a string or a non-empty list of strings.
pub(crate) fn inputs(v: &Value) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("input".into()),
            "'input' must be a string or a non-empty array of strings",
        )
    };
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|x| x.as_str().map(str::to_owned).ok_or_else(bad))
            .collect(),
        _ => Err(bad()),
    }
}
