//! The OpenAI-compatible API (and the Anthropic Messages API, served
//! over the same pipeline), laid out as vLLM's `entrypoints/openai/`: one
//! folder per endpoint, each with its `protocol` (the request and
//! response shapes) and its `serving` (the handlers), and the parts they
//! share beside them: [`pipeline`] (the steps every generation request
//! takes before it runs), [`engine_io`] (a generation run: submission,
//! collection, response bodies and SSE streams), [`pooling`] (a pooling
//! run), [`protocol`] (the sampling fields common to the generation
//! endpoints), [`wire`] and [`fields`] (reading a body's fields), [`tools`], [`tool_parsers`], [`structured`],
//! [`reasoning`], [`harmony`] and [`tenant`] (a tenant's admission and
//! plugins).

pub mod anthropic;
pub mod chat_completion;
pub mod classify;
pub mod completion;
pub mod embeddings;
pub mod engine_io;
pub mod fields;
pub mod harmony;
pub mod pipeline;
pub mod pooling;
pub mod protocol;
pub mod reasoning;
pub mod responses;
pub mod score;
pub mod structured;
pub mod tenant;
pub mod tokenize;
pub mod tool_parsers;
pub mod tools;
pub mod wire;

use crate::server::errors::ApiError;
use crate::server::AppState;
use serde_json::Value;
use std::sync::Arc;
use tenant::TenantCtx;

pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn random_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// Refuses a prompt of `bytes` bytes that cannot fit in the context, from
/// its size alone: a multi-megabyte prompt is answered at once instead of
/// being tokenized whole first.
pub(crate) fn check_prompt_size(
    tok: &crate::tokenizer::Tokenizer,
    bytes: usize,
    max_len: usize,
    param: &str,
) -> Result<(), ApiError> {
    if tok.surely_longer_than(bytes, max_len) {
        return Err(ApiError::context_length(
            param,
            format!(
                "This model's maximum context length is {max_len} tokens, and the {param} ({bytes} bytes) is far longer than that. Please reduce the length of the {param}."
            ),
        ));
    }
    Ok(())
}

/// For a tenant's request: admission, the model allowlist, and `route`.
pub(crate) async fn admit(
    state: &Arc<AppState>,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    id: &str,
    endpoint: &str,
    body: Value,
) -> Result<(Value, Option<TenantCtx>), ApiError> {
    let Some(t) = tenant else {
        return Ok((body, None));
    };
    let mut ctx = TenantCtx::admit(state, &t, id)?;
    if let Some(m) = body.get("model").and_then(Value::as_str) {
        ctx.check_model(m)?;
    }
    let body = ctx.route(endpoint, body).await?;
    Ok((body, Some(ctx)))
}

/// Runs CPU work (tokenizing, rendering a template) on the blocking pool,
/// off the HTTP threads.
pub(crate) async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("a tokenizer task failed: {e}")))?
}
