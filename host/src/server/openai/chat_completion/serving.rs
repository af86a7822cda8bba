//! `POST /v1/chat/completions` and vLLM's `/v1/chat/completions/batch`.

use super::prompt::chat_prompt;
use super::protocol::{parse_messages, ChatCompletionRequest};
use crate::server::errors::ApiError;
use crate::server::openai::engine_io::{generate, Api, RunPrompt};
use crate::server::openai::pipeline::{generation_engine, prepare, ChatPrompt, PromptRequest};
use crate::server::openai::{admit, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::Value;
use std::sync::Arc;

/// `POST /v1/chat/completions`.
pub async fn chat(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = random_id("chatcmpl");
    let (body, mut ctx) = admit(&state, tenant, &id, "/v1/chat/completions", body).await?;
    let request = ChatCompletionRequest::from_body(&body)?;
    let common = request.common(&body, state.default_model())?;
    let prompt = PromptRequest::Chat(ChatPrompt {
        request: &request,
        json: &body,
        format_field: "the structured-output field",
        size_param: "messages",
    });
    let p = prepare(&state, common, prompt, &mut ctx, "/v1/chat/completions").await?;
    generate(state, p.common, p.prompts, Api::Chat, id, ctx, p.tools).await
}

/// `POST /v1/chat/completions/batch`, vLLM's: `messages` is a list of
/// conversations, each answered as its own chat would be (same fields,
/// same sampling), in one response whose choice `i` answers conversation
/// `i`, with the usage summed. As in vLLM, it neither streams nor offers
/// tools, and each conversation gets one choice.
pub async fn chat_batch(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = random_id("chatcmpl");
    let (body, mut ctx) = admit(&state, tenant, &id, "/v1/chat/completions/batch", body).await?;
    let request = ChatCompletionRequest::from_body(&body)?;
    let refuse = |param: &str, m: &str| Err(ApiError::invalid(Some(param.into()), m));
    if request.sampling.stream.unwrap_or(false) {
        return refuse("stream", "the batch endpoint does not stream; send each conversation to /v1/chat/completions to stream it");
    }
    let given = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    if given("tools") || given("tool_choice") {
        return refuse("tools", "the batch endpoint offers no tools; send each conversation to /v1/chat/completions to use them");
    }
    if request.sampling.n.is_some_and(|n| n.0 != 1) {
        return refuse(
            "n",
            "the batch endpoint answers each conversation once: 'n' must be 1",
        );
    }
    let conversations = match &request.chat.messages {
        Some(Value::Array(c)) if !c.is_empty() && c.iter().all(Value::is_array) => c.clone(),
        _ => {
            return refuse(
                "messages",
                "'messages' must be a non-empty list of conversations, each a list of messages",
            )
        }
    };
    if conversations.len() > 256 {
        return refuse("messages", "at most 256 conversations per request");
    }
    let mut common = request.common(&body, state.default_model())?;
    // A tenant's own adapter serves its batches as it serves its chats.
    let engine = generation_engine(
        &state,
        &common.model,
        ctx.as_ref(),
        "/v1/chat/completions/batch",
    )?;
    let mut prompts = Vec::with_capacity(conversations.len());
    for (i, conversation) in conversations.into_iter().enumerate() {
        // Each conversation is rendered as the chat it stands for.
        let mut one = body.clone();
        one["messages"] = conversation.clone();
        let mut one_request = request.clone();
        one_request.chat.messages = Some(conversation);
        let (ids, _) = chat_prompt(
            &state,
            engine,
            &one_request,
            &one,
            &mut common,
            &mut ctx,
            "the structured-output field",
            "messages",
        )
        .await
        .map_err(|mut e| {
            e.message = format!("conversation {i}: {}", e.message);
            e
        })?;
        let echo = if common.echo {
            parse_messages(one_request.chat.messages.as_ref())?
                .pop()
                .filter(|m| m.role == "assistant" && !m.content.is_empty())
                .map(|m| m.content)
        } else {
            None
        };
        prompts.push(RunPrompt { ids, echo });
    }
    generate(state, common, prompts, Api::Chat, id, ctx, None).await
}
