//! The bodies of `/tokenize` and `/detokenize`, as vLLM takes them. A
//! `/tokenize` body with `messages` is a chat, read as
//! [`crate::server::openai::chat_completion::protocol::ChatFields`].

use crate::server::openai::wire::TokenIds;
use serde::Deserialize;

/// `/tokenize` (besides a chat's fields).
#[derive(Deserialize, Debug, Clone, Default)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    /// Whether the tokenizer adds its special tokens (default true).
    pub add_special_tokens: Option<bool>,
}

/// `/detokenize`.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<TokenIds>,
}

/// The `model` a `/tokenize` or `/detokenize` body names, read first to
/// find the engine whose tokenizer serves the rest.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct ModelName {
    pub model: Option<String>,
}
