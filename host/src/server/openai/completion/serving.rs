//! `POST /v1/completions`.

use super::protocol::{parse_prompts, CompletionRequest, PromptInput};
use crate::server::errors::ApiError;
use crate::server::openai::engine_io::{generate, Api, RunPrompt};
use crate::server::openai::{admit, check_prompt_size, off_runtime, pooling, random_id};
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
    let (body, ctx) = admit(&state, tenant, &id, "/v1/completions", body).await?;
    let request = CompletionRequest::from_body(&body)?;
    let common = request.common(&body, state.default_model())?;
    if let Some(c) = &ctx {
        c.check_model(&common.model)?;
    }
    let engine = state.engine_as(&common.model, ctx.as_ref())?;
    pooling::refuse_generation(engine, "/v1/completions")?;
    let prompts = parse_prompts(request.completion.prompt.as_ref())?;
    let tok = engine.tokenizer().clone();
    let max_len = engine.max_model_len();
    for p in &prompts {
        if let PromptInput::Text(t) = p {
            if state.config_skip_tokenizer_init() {
                return Err(ApiError::invalid(
                    Some("prompt".into()),
                    "this server was started with --skip-tokenizer-init: 'prompt' must be token ids",
                ));
            }
            check_prompt_size(&tok, t.len(), max_len, "prompt")?;
        }
    }
    let echo = common.echo;
    // Tokenizing is CPU work: off the HTTP threads.
    let run_prompts = off_runtime(move || {
        let bad_prompt =
            |e: anyhow::Error| ApiError::invalid(Some("prompt".into()), format!("{e:#}"));
        let mut run_prompts = Vec::with_capacity(prompts.len());
        for p in prompts {
            let (ids, text) = match p {
                PromptInput::Text(t) => (tok.encode(&t, true).map_err(bad_prompt)?, Some(t)),
                PromptInput::Tokens(t) => (t, None),
            };
            // A prompt of token ids echoes as their text, special tokens
            // included, as it was read.
            let echo = match (echo, text) {
                (false, _) => None,
                (true, Some(t)) => Some(t),
                (true, None) => Some(tok.decode(&ids, false).map_err(bad_prompt)?),
            };
            run_prompts.push(RunPrompt { ids, echo });
        }
        Ok(run_prompts)
    })
    .await?;
    generate(state, common, run_prompts, Api::Completions, id, ctx, None).await
}
