//! Typed access to the fields of a JSON request object, with OpenAI-style
//! errors that name the field. Every endpoint's parser reads its body
//! through [`Fields`], so it lives apart from any one endpoint's parsing.

use crate::server::errors::ApiError;
use serde_json::{Map, Value};

/// A logprob count of `-1`: the whole vocabulary, as vLLM reads it.
pub const ALL_LOGPROBS: usize = usize::MAX;

/// Typed access to a request object's fields, with OpenAI-style errors.
pub struct Fields<'a>(pub &'a Map<String, Value>);

fn type_error(name: &str, want: &str) -> ApiError {
    ApiError::invalid(Some(name.to_string()), format!("'{name}' must be {want}"))
}

impl<'a> Fields<'a> {
    /// The body as an object, or a 400.
    pub fn of(v: &'a Value) -> Result<Fields<'a>, ApiError> {
        v.as_object()
            .map(Fields)
            .ok_or_else(|| ApiError::invalid(None, "The request body must be a JSON object."))
    }

    /// The field's value; absent and `null` alike are `None`, as OpenAI
    /// treats them.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        match self.0.get(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| type_error(name, "a string")))
            .transpose()
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| type_error(name, "a boolean")))
            .transpose()
    }

    pub fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| type_error(name, "a number"))
            })
            .transpose()
    }

    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_i64()
                    .or_else(|| {
                        v.as_f64()
                            .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                            .map(|f| f as i64)
                    })
                    .ok_or_else(|| type_error(name, "an integer"))
            })
            .transpose()
    }

    pub fn usize(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            None => Ok(None),
            Some(x) if x >= 0 => Ok(Some(x as usize)),
            Some(x) => Err(ApiError::invalid(
                Some(name.to_string()),
                format!("'{name}' must be non-negative, got {x}"),
            )),
        }
    }

    /// A count of logprobs per token (`logprobs`, `top_logprobs`,
    /// `prompt_logprobs`): a non-negative integer, or vLLM's `-1` for the
    /// whole vocabulary, returned as [`ALL_LOGPROBS`] until the vocabulary
    /// size is known.
    pub fn logprob_count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            None => Ok(None),
            Some(-1) => Ok(Some(ALL_LOGPROBS)),
            Some(x) if x >= 0 => Ok(Some(x as usize)),
            Some(x) => Err(ApiError::invalid(
                Some(name.to_string()),
                format!(
                    "'{name}' must be a non-negative value or -1 (the whole vocabulary), got {x}"
                ),
            )),
        }
    }

    pub fn u64(&self, name: &str) -> Result<Option<u64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) => Ok(Some(x)),
                None => match v.as_i64() {
                    // OpenAI accepts negative seeds; keep their bits.
                    Some(x) => Ok(Some(x as u64)),
                    None => Err(type_error(name, "an integer")),
                },
            },
        }
    }

    /// A string or a list of strings (`stop`).
    pub fn strings(&self, name: &str) -> Result<Vec<String>, ApiError> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| type_error(name, "a string or a list of strings"))
                })
                .collect(),
            Some(_) => Err(type_error(name, "a string or a list of strings")),
        }
    }

    pub fn u32s(&self, name: &str) -> Result<Vec<u32>, ApiError> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| type_error(name, "a list of token ids"))
                })
                .collect(),
            Some(_) => Err(type_error(name, "a list of token ids")),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        self.get(name)
            .map(|v| v.as_object().ok_or_else(|| type_error(name, "an object")))
            .transpose()
    }
}
