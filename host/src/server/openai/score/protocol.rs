//! The bodies of `/score` and the rerank routes, as vLLM takes them.

use crate::server::errors::ApiError;
use serde::Deserialize;
use serde_json::Value;

/// `/score`'s body, as vLLM's `ScoreRequest`.
#[derive(Deserialize)]
pub(crate) struct ScoreRequest {
    pub(crate) model: Option<String>,
    pub(crate) text_1: Value,
    pub(crate) text_2: Value,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// `/rerank`'s body, as vLLM's `RerankRequest`.
#[derive(Deserialize)]
pub(crate) struct RerankRequest {
    pub(crate) model: Option<String>,
    pub(crate) query: Value,
    pub(crate) documents: Value,
    #[serde(default)]
    pub(crate) top_n: Option<i64>,
    /// Whether each result carries its document (default true, as vLLM
    /// always includes it).
    #[serde(default)]
    pub(crate) return_documents: Option<bool>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// The fields both take.
#[derive(Deserialize)]
pub(crate) struct Common {
    #[serde(default)]
    pub(crate) truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) priority: Option<i64>,
    #[serde(default)]
    pub(crate) use_activation: Option<bool>,
    /// vLLM's older names for `use_activation`.
    #[serde(default)]
    pub(crate) activation: Option<bool>,
    #[serde(default)]
    pub(crate) softmax: Option<bool>,
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ScoreRoute {
    /// `/score`, `/v1/score`.
    Score,
    /// `/rerank`, `/v1/rerank`, `/v2/rerank`.
    Rerank,
}

/// A string or a list of strings.
pub(crate) fn texts(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some(param.into()),
            format!("'{param}' must be a string or an array of strings"),
        )
    };
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => items
            .iter()
            .map(|x| x.as_str().map(str::to_owned).ok_or_else(bad))
            .collect(),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn texts_take_a_string_or_strings() {
        assert_eq!(
            texts(&json!("a"), "text_1").ok(),
            Some(vec!["a".to_string()])
        );
        assert_eq!(
            texts(&json!(["a", "b"]), "text_2").ok().map(|v| v.len()),
            Some(2)
        );
        assert!(texts(&json!([1]), "text_2").is_err());
        assert!(texts(&json!({"a": 1}), "text_2").is_err());
    }
}
