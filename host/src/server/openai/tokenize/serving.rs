//! Prompts without generation: `POST /tokenize` and `/detokenize`, and
//! `/v1/completions/render` and `/v1/chat/completions/render` (the token
//! ids a generation request's prompts would have).

use super::protocol::{DetokenizeRequest, ModelName, TokenizeRequest};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::chat_completion::prompt::render_chat;
use crate::server::openai::chat_completion::protocol::{
    parse_messages, ChatCompletionRequest, ChatFields,
};
use crate::server::openai::completion::protocol::{parse_prompts, CompletionRequest, PromptInput};
use crate::server::openai::tenant::TenantCtx;
use crate::server::openai::wire::from_body;
use crate::server::openai::{admit, check_prompt_size, off_runtime, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// `POST /v1/completions/render` and `/v1/chat/completions/render`: the
/// token ids a generation request's prompts would have, generating
/// nothing, for the endpoint picker of the Kubernetes inference gateway
/// (llm-d), which hashes them into blocks as the KV-cache events do. The
/// shapes are vLLM's: for completions a list with one entry per prompt,
/// for chat one object; each entry carries `request_id`, `model`,
/// `token_ids`, `sampling_params` and `features` (null: text only).
/// Tenant auth, route plugins and the tenant's template plugin apply, as
/// they do to generation.
pub async fn render(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    chat: bool,
) -> Result<Response<Body>, ApiError> {
    let (prefix, endpoint) = if chat {
        ("chatcmpl", "/v1/chat/completions")
    } else {
        ("cmpl", "/v1/completions")
    };
    let id = random_id(prefix);
    let (body, mut ctx) = admit(&state, tenant, &id, endpoint, body).await?;
    let (common, chat_request, prompt) = if chat {
        let r = ChatCompletionRequest::from_body(&body)?;
        (r.common(&body, state.default_model())?, Some(r), None)
    } else {
        let r = CompletionRequest::from_body(&body)?;
        let common = r.common(&body, state.default_model())?;
        (common, None, r.completion.prompt)
    };
    if let Some(c) = &ctx {
        c.check_model(&common.model)?;
    }
    let engine = state.engine_as(&common.model, ctx.as_ref())?.clone();
    let tok = engine.tokenizer().clone();
    let max_len = engine.max_model_len();
    // Only what the request set: vLLM's GenerateRequest refuses a null
    // where a number belongs, and an absent field takes its default there.
    let mut sampling = serde_json::Map::new();
    if let Some(m) = common.params.max_tokens {
        sampling.insert("max_tokens".into(), json!(m));
    }
    if let Some(t) = common.params.temperature {
        sampling.insert("temperature".into(), json!(t));
    }
    sampling.insert("n".into(), json!(common.params.n));
    let sampling = Value::Object(sampling);
    let entry = |request_id: String, ids: Vec<u32>| {
        json!({"request_id": request_id, "model": common.model, "token_ids": ids,
            "sampling_params": sampling, "features": null})
    };
    let out = if let Some(r) = chat_request {
        state.needs_tokenizer("a chat")?;
        let messages = parse_messages(r.chat.messages.as_ref())?;
        let tools = r.chat.tools(state.auto_tool_parser())?;
        let bytes: usize = messages.iter().map(|m| m.content.len()).sum();
        check_prompt_size(&tok, bytes, max_len, "messages")?;
        let (ids, _) = render_chat(
            &engine,
            &body,
            &r.chat,
            &messages,
            tools.as_ref(),
            &mut ctx,
            false,
        )
        .await?;
        entry(id, ids)
    } else {
        let prompts = parse_prompts(prompt.as_ref())?;
        for p in &prompts {
            if let PromptInput::Text(t) = p {
                state.needs_tokenizer("a text prompt")?;
                check_prompt_size(&tok, t.len(), max_len, "prompt")?;
            }
        }
        let all = off_runtime(move || {
            prompts
                .into_iter()
                .map(|p| match p {
                    PromptInput::Text(t) => tok
                        .encode(&t, true)
                        .map_err(|e| ApiError::invalid(Some("prompt".into()), format!("{e:#}"))),
                    PromptInput::Tokens(t) => Ok(t),
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
        Value::Array(
            all.into_iter()
                .enumerate()
                .map(|(i, ids)| entry(format!("{id}-{i}"), ids))
                .collect(),
        )
    };
    Ok(json_response(&out))
}

/// `POST /tokenize`: a prompt's token ids, or a chat's exactly as a chat
/// request would see them (tools, tool calls and the tenant's template
/// plugin included). Bounded like generation (a text that cannot fit the
/// context is refused from its size alone), and for a tenant it is
/// admitted and its tokens counted against the tenant's limits.
pub async fn tokenize(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let (mut ctx, engine) = tokenizer_call(&state, &body, tenant.as_ref(), "tokenize")?;
    let request: TokenizeRequest = from_body(&body)?;
    let tok = engine.tokenizer().clone();
    let add_special = request.add_special_tokens.unwrap_or(true);
    let ids = if body.get("messages").is_some() {
        let chat: ChatFields = from_body(&body)?;
        let messages = parse_messages(chat.messages.as_ref())?;
        let tools = chat.tools(state.auto_tool_parser())?;
        let bytes = serde_json::to_string(&body).map_or(usize::MAX, |s| s.len());
        check_prompt_size(&tok, bytes, engine.max_model_len(), "messages")?;
        let (mut ids, _) = render_chat(
            &engine,
            &body,
            &chat,
            &messages,
            tools.as_ref(),
            &mut ctx,
            false,
        )
        .await?;
        if let Some(bos) = tok.bos_id() {
            if add_special && tok.add_bos() && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    } else {
        let text = request.prompt.ok_or_else(|| {
            ApiError::invalid(Some("prompt".into()), "'prompt' or 'messages' is required")
        })?;
        check_prompt_size(&tok, text.len(), engine.max_model_len(), "prompt")?;
        off_runtime(move || {
            tok.encode(&text, add_special)
                .map_err(|e| ApiError::invalid(Some("prompt".into()), format!("{e:#}")))
        })
        .await?
    };
    if let Some(c) = &ctx {
        c.admission.charge(ids.len() as u64, 0);
    }
    Ok(json_response(
        &json!({"count": ids.len(), "max_model_len": engine.max_model_len(), "tokens": ids}),
    ))
}

/// Where `/tokenize` and `/detokenize` start: the tenant admitted (the call
/// counts against its limits), and the engine of the body's `model` (or
/// the default one).
fn tokenizer_call(
    state: &AppState,
    body: &Value,
    tenant: Option<&Arc<crate::tenants::Tenant>>,
    what: &str,
) -> Result<(Option<TenantCtx>, crate::engine::async_engine::AsyncEngine), ApiError> {
    state.needs_tokenizer(&format!("/{what}"))?;
    let ctx = match tenant {
        Some(t) => Some(TenantCtx::admit(state, t, &random_id(what))?),
        None => None,
    };
    let name: ModelName = from_body(body)?;
    let engine = match name.model.as_deref() {
        Some(m) => state.engine_as(m, ctx.as_ref())?,
        None => state.engine()?,
    };
    Ok((ctx, engine.clone()))
}

/// `POST /detokenize`: token ids back to text. At most a context's worth
/// of ids, decoded off the HTTP threads, and for a tenant admitted and
/// counted against its limits like `/tokenize`.
pub async fn detokenize(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let (ctx, engine) = tokenizer_call(&state, &body, tenant.as_ref(), "detokenize")?;
    let request: DetokenizeRequest = from_body(&body)?;
    let ids = request.tokens.map(|t| t.0).unwrap_or_default();
    if ids.len() > engine.max_model_len() {
        return Err(ApiError::context_length(
            "tokens",
            format!(
                "This model's maximum context length is {} tokens, and {} token ids were given.",
                engine.max_model_len(),
                ids.len()
            ),
        ));
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= engine.vocab_size()) {
        return Err(ApiError::invalid(
            Some("tokens".into()),
            format!("token id {bad} is beyond the vocabulary"),
        ));
    }
    if let Some(c) = &ctx {
        c.admission.charge(ids.len() as u64, 0);
    }
    let tok = engine.tokenizer().clone();
    let text = off_runtime(move || {
        tok.decode(&ids, false)
            .map_err(|e| ApiError::invalid(Some("tokens".into()), format!("{e:#}")))
    })
    .await?;
    Ok(json_response(&json!({"prompt": text})))
}
