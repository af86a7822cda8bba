//! Anthropic's Messages API, as vLLM serves it: `POST /v1/messages`
//! (system prompt, multi-turn, tools and tool results, `tool_choice`,
//! streaming with Anthropic's events, thinking blocks from the reasoning
//! parser) and `POST /v1/messages/count_tokens`, on the chat path: a
//! request is translated into a chat request and served by the chat
//! path's parsing, template rendering, tool enforcement and generation.
//!
//! Keys come as `x-api-key: KEY` (Anthropic's clients) or
//! `Authorization: Bearer KEY`, for the same tenants and `--api-key` as
//! the OpenAI routes; errors are in Anthropic's shape
//! (`{"type": "error", "error": {"type", "message"}}`).

pub mod protocol;
mod stream;

use super::chat_completion::protocol::ChatCompletionRequest;
use super::engine_io::{collect, sse_response, start_run, Api, Run, RunPrompt};
use super::pipeline::{self, ChatPrompt, PromptRequest};
use super::tools::{self, ToolMode};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::tenant::TenantCtx;
use crate::server::{AppState, Body};
use bytes::Bytes;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, AUTHORIZATION};
use hyper::{Method, Request, Response};
use protocol::Endpoint;
use serde_json::{json, Value};
use std::sync::Arc;

const MESSAGES: &str = "/v1/messages";
const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// Anthropic's error type for a status.
fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error's body in Anthropic's shape.
pub fn error_body(e: &ApiError) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(e.status.as_u16()), "message": e.message},
    })
}

/// An error as Anthropic's API answers it: the status, its body, and
/// `Retry-After` where the error has one.
pub fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(&error_body(e));
    *r.status_mut() = e.status;
    if let Some(s) = e.retry_after {
        r.headers_mut()
            .insert(hyper::header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

/// The key of `x-api-key`, handed to the server's authentication as a
/// bearer token when the request has none: the same tenants and
/// `--api-key` as the OpenAI routes, whichever header carries the key.
fn authenticate(
    state: &AppState,
    req: &mut Request<Incoming>,
) -> Result<Option<Arc<crate::tenants::Tenant>>, ApiError> {
    if crate::server::auth::bearer_token(req.headers()).is_none() {
        let key = req
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .and_then(|k| HeaderValue::from_str(&format!("Bearer {k}")).ok());
        if let Some(v) = key {
            req.headers_mut().insert(AUTHORIZATION, v);
        }
    }
    crate::server::authenticate(state, req).map_err(|mut e| {
        if e.code == "invalid_api_key" {
            e.message = e.message.replace(
                "'Authorization: Bearer KEY'",
                "'x-api-key: KEY' (or 'Authorization: Bearer KEY')",
            );
        }
        e
    })
}

/// `/v1/messages` and `/v1/messages/…`: every answer, errors included, in
/// Anthropic's shape.
pub async fn route(state: Arc<AppState>, mut req: Request<Incoming>) -> Response<Body> {
    let unread_body = crate::server::has_body(&req);
    let path = req.uri().path().to_string();
    let result = async {
        let tenant = authenticate(&state, &mut req)?;
        if !matches!(path.as_str(), MESSAGES | COUNT_TOKENS) {
            return Err(ApiError::not_found(&path));
        }
        if req.method() != Method::POST {
            return Err(ApiError::method_not_allowed(req.method().as_str(), &path));
        }
        let body = crate::server::read_json(&state, req).await?;
        if path == COUNT_TOKENS {
            count_tokens(state, body, tenant).await
        } else {
            messages(state, body, tenant).await
        }
    }
    .await;
    match result {
        Ok(r) => r,
        Err(e) => {
            let mut r = error_response(&e);
            // As the other routes do: a body left unread closes the
            // connection, and the client should know before it reuses it.
            if unread_body && matches!(e.status.as_u16(), 401 | 403 | 404 | 405) {
                r.headers_mut()
                    .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
            }
            r
        }
    }
}

/// A Messages request, made ready to run: the chat request it is, its
/// prompt rendered by the chat path.
struct Prepared {
    common: super::protocol::CommonParams,
    prompts: Vec<RunPrompt>,
    mode: Option<ToolMode>,
    ctx: Option<TenantCtx>,
}

/// Admits the request (tenant limits, model allowlist, route plugins),
/// translates it and renders its prompt exactly as `/v1/chat/completions`
/// would render the same conversation.
async fn prepare(
    state: &Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    id: &str,
    endpoint: Endpoint,
) -> Result<Prepared, ApiError> {
    let path = match endpoint {
        Endpoint::Messages => MESSAGES,
        Endpoint::CountTokens => COUNT_TOKENS,
    };
    let (body, mut ctx) = super::admit(state, tenant, id, path, body).await?;
    let chat = protocol::chat_body(&body, endpoint)?;
    let request = ChatCompletionRequest::from_body(&chat)?;
    let common = request.common(&chat, state.default_model())?;
    let prompt = PromptRequest::Chat(ChatPrompt {
        request: &request,
        json: &chat,
        format_field: "output_config.format",
        size_param: "messages",
    });
    let p = pipeline::prepare(state, common, prompt, &mut ctx, "/v1/messages").await?;
    Ok(Prepared {
        common: p.common,
        prompts: p.prompts,
        mode: p.tools,
        ctx,
    })
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt
/// `/v1/messages` would run for the same body. For a tenant it is
/// admitted and its tokens counted, as `/tokenize` is.
async fn count_tokens(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = protocol::message_id();
    let p = prepare(&state, body, tenant, &id, Endpoint::CountTokens).await?;
    let tokens: usize = p.prompts.iter().map(|r| r.ids.len()).sum();
    if let Some(c) = &p.ctx {
        c.admission.charge(tokens as u64, 0);
    }
    Ok(json_response(&json!({"input_tokens": tokens})))
}

/// `POST /v1/messages`.
async fn messages(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = protocol::message_id();
    let p = prepare(&state, body, tenant, &id, Endpoint::Messages).await?;
    let stream = p.common.stream;
    let model = p.common.model.clone();
    let run = start_run(
        state,
        p.common,
        p.prompts,
        Api::Chat,
        id.clone(),
        p.ctx,
        p.mode,
    )
    .await?;
    if stream {
        return Ok(stream_message(run, id, model));
    }
    let run = collect(run).await?;
    Ok(json_response(&final_message(&run, &id, &model)))
}

/// The message object around `content`.
fn message(id: &str, model: &str, content: Vec<Value>, stop: (&str, Value), usage: Value) -> Value {
    let stop_reason = match stop.0 {
        "" => Value::Null,
        s => json!(s),
    };
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop.1,
        "usage": usage,
    })
}

fn usage(input: usize, output: usize) -> Value {
    json!({"input_tokens": input, "output_tokens": output})
}

/// A finished run as a Messages response: its thinking, its text, and
/// the `tool_use` blocks its output holds.
fn final_message(run: &Run, id: &str, model: &str) -> Value {
    let c = &run.choices[0];
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(
            json!({"type": "thinking", "thinking": c.reasoning, "signature": stream::signature()}),
        );
    }
    let calls = run
        .tools
        .as_ref()
        .map(|m| tools::extract(m, &c.text))
        .filter(|p| !p.calls.is_empty())
        .and_then(|p| protocol::tool_use_blocks(&p.calls).map(|b| (p.content, b)));
    let called = calls.is_some();
    match calls {
        Some((text, blocks)) => {
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                content.push(json!({"type": "text", "text": t}));
            }
            content.extend(blocks);
        }
        None => {
            let text = tools::uncalled_text(run.tools.as_ref(), &c.text);
            if !text.is_empty() {
                content.push(json!({"type": "text", "text": text}));
            }
        }
    }
    let stop = protocol::stop_reason(c.finish_reason, c.stop_reason.as_ref(), called);
    message(id, model, content, stop, usage(run.prompt_tokens, c.tokens))
}

/// Streams the message's events: a task reads the engine outputs (through
/// the tenant's `on-chunk` plugins) and sends the frames; a client that
/// goes away drops the receiver, the task ends and the run's guard aborts
/// the engine request. Text and thinking stream as generated, and so do
/// the arguments of a named tool (`tool_choice` `tool`); with `auto`,
/// text streams until a call may have begun, and calls (and with `any`
/// the whole output) go out once complete.
fn stream_message(mut run: Run, id: String, model: String) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let mode = run.tools.clone();
        let start = message(
            &id,
            &model,
            vec![],
            ("", Value::Null),
            usage(run.prompt_tokens, 0),
        );
        for b in [
            stream::event("message_start", json!({"message": start})),
            stream::event("ping", json!({})),
        ] {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        let mut blocks = stream::Blocks::default();
        // Answer bytes sent as text (with `auto`, what cannot be a call).
        let mut sent = 0usize;
        let mut tool_open = false;
        while run.remaining > 0 {
            let Some(mut o) = run.rx.recv().await else {
                let e = ApiError::unavailable("the engine stopped before the message finished");
                let _ = tx.send(stream::error_event(&e)).await;
                return;
            };
            if let Err(e) = run.on_chunk(&mut o).await {
                let _ = tx.send(stream::error_event(&e)).await;
                return;
            }
            let Some(i) = run.absorb(&mut o) else {
                continue;
            };
            let mut out = Vec::new();
            let reasoning = std::mem::take(&mut run.choices[i].new_reasoning);
            blocks.thinking(&reasoning, &mut out);
            match &mode {
                None => blocks.text(&o.new_text, &mut out),
                Some(ToolMode::Named(name)) => {
                    if !o.new_text.is_empty() {
                        if !tool_open {
                            blocks.tool_use(&protocol::tool_use_id(), name, &mut out);
                            tool_open = true;
                        }
                        blocks.input_json(&o.new_text, &mut out);
                    }
                }
                Some(ToolMode::Auto(p)) if o.finish_reason.is_none() => {
                    let text = &run.choices[i].text;
                    let hold = p.hold_from(text);
                    // Whitespace before a call is dropped, as unstreamed.
                    let hold = text.get(..hold).map_or(0, |t| t.trim_end().len());
                    if hold > sent {
                        if let Some(t) = text.get(sent..hold) {
                            blocks.text(t, &mut out);
                            sent = hold;
                        }
                    }
                }
                Some(_) => {}
            }
            for b in out {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
        }
        run.guard.disarm();
        if let Err(e) = run.meter().await {
            let _ = tx.send(stream::error_event(&e)).await;
            return;
        }
        let mut out = Vec::new();
        let c = &run.choices[0];
        let called = match &mode {
            None => false,
            Some(ToolMode::Named(name)) => {
                if !tool_open {
                    blocks.tool_use(&protocol::tool_use_id(), name, &mut out);
                }
                true
            }
            Some(m) => {
                let parsed = tools::extract(m, &c.text);
                let calls = Some(&parsed.calls)
                    .filter(|c| !c.is_empty())
                    .and_then(|c| protocol::tool_use_blocks(c));
                match calls {
                    Some(list) => {
                        for b in list {
                            let name = b["name"].as_str().unwrap_or_default();
                            let id = b["id"].as_str().unwrap_or_default();
                            blocks.tool_use(id, name, &mut out);
                            blocks.input_json(&b["input"].to_string(), &mut out);
                        }
                        true
                    }
                    None => {
                        let rest = c.text.get(sent..).unwrap_or("");
                        blocks.text(&tools::uncalled_text(Some(m), rest), &mut out);
                        false
                    }
                }
            }
        };
        let (reason, sequence) =
            protocol::stop_reason(c.finish_reason, c.stop_reason.as_ref(), called);
        blocks.finish(reason, sequence, run.prompt_tokens, c.tokens, &mut out);
        for b in out {
            if tx.send(b).await.is_err() {
                return;
            }
        }
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(Frame::data(b)), rx))
    });
    sse_response(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_anthropics_shape_and_types() {
        let e = ApiError::invalid(Some("max_tokens".into()), "max_tokens: Field required");
        assert_eq!(
            error_body(&e),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}})
        );
        for (e, t) in [
            (ApiError::invalid_api_key(), "authentication_error"),
            (ApiError::forbidden("no"), "permission_error"),
            (ApiError::model_not_found("x"), "not_found_error"),
            (ApiError::overloaded("busy"), "rate_limit_error"),
            (ApiError::unavailable("loading"), "overloaded_error"),
            (ApiError::internal("bug"), "api_error"),
            (ApiError::too_large(1), "request_too_large"),
        ] {
            assert_eq!(error_body(&e)["error"]["type"], t, "{e:?}");
        }
        let r = error_response(&ApiError::overloaded("busy"));
        assert_eq!(r.status().as_u16(), 429);
        assert!(r.headers().contains_key(hyper::header::RETRY_AFTER));
    }
}
