//! The embeddings requests (OpenAI's, with vLLM's extra fields, and
//! Cohere's `/v2/embed`) and the encodings of their vectors.

use crate::server::errors::ApiError;
use serde::Deserialize;
use serde_json::{json, Value};

/// The request body, as OpenAI and vLLM define it. Fields vLLM accepts
/// and that change nothing here (`user`) are read and dropped; unknown
/// fields are ignored, as vLLM ignores them.
#[derive(Deserialize)]
pub(crate) struct EmbeddingRequest {
    pub(crate) model: Option<String>,
    pub(crate) input: Value,
    #[serde(default)]
    pub(crate) encoding_format: Option<String>,
    #[serde(default)]
    pub(crate) dimensions: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    pub(crate) user: Option<String>,
    /// vLLM's: keep only the last k tokens of each input (-1: the
    /// context's length).
    #[serde(default)]
    pub(crate) truncate_prompt_tokens: Option<i64>,
    /// vLLM's: whether the tokenizer adds its special tokens (default true).
    #[serde(default)]
    pub(crate) add_special_tokens: Option<bool>,
    /// vLLM's: whether to L2-normalize (default: the model's pooler).
    #[serde(default)]
    pub(crate) normalize: Option<bool>,
    #[serde(default)]
    pub(crate) priority: Option<i64>,
}

/// One input, before or after tokenizing.
pub(crate) enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

pub(crate) const INPUT_SHAPES: &str = "'input' must be a string, an array of strings, an array of token ids, or an array of token-id arrays";

/// Reads `input` in any of its four shapes.
pub(crate) fn parse_input(v: &Value) -> Result<Vec<Input>, ApiError> {
    let bad = || ApiError::invalid(Some("input".into()), INPUT_SHAPES);
    let token = |x: &Value| -> Result<u32, ApiError> {
        x.as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("input".into()),
                    "token ids must be non-negative integers",
                )
            })
    };
    let inputs = match v {
        Value::String(s) => vec![Input::Text(s.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid(
                Some("input".into()),
                "'input' must not be empty",
            ))
        }
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(|s| Input::Text(s.to_owned()))
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Input::Tokens(
                items.iter().map(token).collect::<Result<_, _>>()?,
            )],
            Value::Array(_) => items
                .iter()
                .map(|x| match x {
                    Value::Array(ids) => Ok(Input::Tokens(
                        ids.iter().map(token).collect::<Result<_, _>>()?,
                    )),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(inputs)
}

/// Little-endian float32 bytes in standard base64 (with padding), as
/// vLLM and OpenAI encode `encoding_format: "base64"` (the openai SDK
/// decodes it with `np.frombuffer(base64.b64decode(s), dtype="float32")`).
pub(crate) fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64(&bytes)
}

/// RFC 4648 base64 with padding.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The routes that return pooled vectors: OpenAI's embeddings, vLLM's
/// `/pooling` (the same request; each vector as `data` of an object
/// `"pooling"`), and Cohere's `/v2/embed` as vLLM serves it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PoolingRoute {
    Embeddings,
    Pooling,
    CohereEmbed,
}

/// Cohere's `/v2/embed` body, as vLLM's `CohereEmbedRequest` takes it
/// (texts only: `images` and `inputs` are refused by name).
#[derive(Deserialize)]
pub(crate) struct CohereEmbedRequest {
    pub(crate) model: Option<String>,
    /// Cohere's `search_query`, `search_document`, ...: prompts a model
    /// may prepend per type; the encoders served here have none, so it
    /// changes nothing.
    #[serde(default)]
    #[allow(dead_code)]
    pub(crate) input_type: Option<String>,
    #[serde(default)]
    pub(crate) texts: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) images: Option<Value>,
    #[serde(default)]
    pub(crate) inputs: Option<Value>,
    #[serde(default)]
    pub(crate) output_dimension: Option<i64>,
    #[serde(default)]
    pub(crate) embedding_types: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) truncate: Option<String>,
    #[serde(default)]
    pub(crate) priority: Option<i64>,
}

/// Translates a `/v2/embed` body into the embeddings request it asks
/// for, with the embedding types the response carries.
pub(crate) fn cohere_request(body: Value) -> Result<(EmbeddingRequest, Vec<String>), ApiError> {
    let r: CohereEmbedRequest = serde_json::from_value(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("invalid /v2/embed request: {e} (it takes Cohere's embed fields: model, texts, input_type, embedding_types, output_dimension, truncate)"),
        )
    })?;
    for (name, v) in [("images", &r.images), ("inputs", &r.inputs)] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                Some(name.into()),
                format!("'{name}' (image inputs) is not supported: this model embeds text; give 'texts'"),
            ));
        }
    }
    let Some(texts) = r.texts else {
        return Err(ApiError::invalid(
            Some("texts".into()),
            "'texts' is required",
        ));
    };
    if texts.is_empty() {
        return Err(ApiError::invalid(
            Some("texts".into()),
            "'texts' must not be empty",
        ));
    }
    let types = r.embedding_types.unwrap_or_else(|| vec!["float".into()]);
    for t in &types {
        if !matches!(t.as_str(), "float" | "binary" | "ubinary" | "base64") {
            return Err(ApiError::invalid(
                Some("embedding_types".into()),
                format!("embedding type {t:?} is not supported: give \"float\", \"binary\", \"ubinary\" or \"base64\""),
            ));
        }
    }
    // START keeps the last tokens (vLLM's truncate_prompt_tokens -1); END
    // and NONE keep the input whole, so one over the context is refused.
    let truncate_prompt_tokens = match r.truncate.as_deref() {
        None | Some("END") | Some("NONE") => None,
        Some("START") => Some(-1),
        Some(other) => {
            return Err(ApiError::invalid(
                Some("truncate".into()),
                format!("truncate {other:?}: expected \"NONE\", \"START\" or \"END\""),
            ))
        }
    };
    Ok((
        EmbeddingRequest {
            model: r.model,
            input: json!(texts),
            encoding_format: None,
            dimensions: r.output_dimension,
            user: None,
            truncate_prompt_tokens,
            add_special_tokens: None,
            normalize: None,
            priority: r.priority,
        },
        types,
    ))
}

/// Cohere's bit-packed embedding: one bit per component (1 where it is
/// ≥ 0), eight to a byte from the high bit; `signed` shifts each byte
/// by 128 (Cohere's `binary`, else `ubinary`).
pub(crate) fn pack_bits(v: &[f32], signed: bool) -> Result<Vec<i32>, ApiError> {
    if !v.len().is_multiple_of(8) {
        return Err(ApiError::invalid(
            Some("embedding_types".into()),
            format!(
                "Embedding dimension must be a multiple of 8 for binary embedding types, but got {}.",
                v.len()
            ),
        ));
    }
    Ok(v.chunks(8)
        .map(|c| {
            let byte = c
                .iter()
                .enumerate()
                .fold(0i32, |acc, (i, &x)| acc | (i32::from(x >= 0.0) << (7 - i)));
            if signed {
                byte - 128
            } else {
                byte
            }
        })
        .collect())
}

impl PoolingRoute {
    pub(crate) fn path(self) -> &'static str {
        match self {
            PoolingRoute::Embeddings => "/v1/embeddings",
            PoolingRoute::Pooling => "/pooling",
            PoolingRoute::CohereEmbed => "/v2/embed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        // RFC 4648 §10.
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
        // 1.0f32 is 00 00 80 3f.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
    }

    #[test]
    fn input_shapes() {
        let n = |v: Value| parse_input(&v).map(|i| i.len());
        assert_eq!(n(json!("a")).ok(), Some(1));
        assert_eq!(n(json!(["a", "b"])).ok(), Some(2));
        assert_eq!(n(json!([1, 2, 3])).ok(), Some(1));
        assert_eq!(n(json!([[1], [2, 3]])).ok(), Some(2));
        assert!(n(json!([])).is_err());
        assert!(n(json!(["a", 1])).is_err());
        assert!(n(json!([-1])).is_err());
        assert!(n(json!({"a": 1})).is_err());
    }
}
