//! `POST /v1/completions`.

use super::protocol::CompletionRequest;
use crate::server::errors::ApiError;
use crate::server::openai::engine_io::{generate, Api};
use crate::server::openai::pipeline::{prepare, PromptRequest};
use crate::server::openai::{admit, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::Value;
use std::sync::Arc;

/// `POST /v1/completions`.
pub async fn completions(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = random_id("cmpl");
    let (body, mut ctx) = admit(&state, tenant, &id, "/v1/completions", body).await?;
    let request = CompletionRequest::from_body(&body)?;
    let common = request.common(&body, state.default_model())?;
    let prompt = PromptRequest::Completion(request.completion.prompt.as_ref());
    let p = prepare(&state, common, prompt, &mut ctx, "/v1/completions").await?;
    generate(
        state,
        p.common,
        p.prompts,
        Api::Completions,
        id,
        ctx,
        p.tools,
    )
    .await
}
