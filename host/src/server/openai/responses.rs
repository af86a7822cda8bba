//! `POST /v1/responses`: OpenAI's Responses API over the same engine as
//! chat. A request (`instructions`, `input` as text or messages,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format`) becomes a
//! chat request; the answer is a `response` object, or, streamed, its
//! events (`response.created` … `response.output_text.delta` …
//! `response.completed`). `previous_response_id` continues a conversation
//! kept in a bounded in-memory store per tenant. Built-in tools, files,
//! images, background mode and reasoning are refused with a 400.

use super::{
    check_prompt_size, collect, now_secs, parse_common, parse_messages, render_chat, start_run,
    Api, Run, RunPrompt,
};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::protocol::Fields;
use crate::server::{AppState, Body};
use bytes::Bytes;
use hyper::body::Frame;
use hyper::Response;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Stored responses per tenant; the oldest go first beyond this.
const STORED_PER_TENANT: usize = 512;

/// One stored response: the response object as the client got it, and
/// the conversation `previous_response_id` continues (the messages it was
/// generated from, then its answer).
struct Stored {
    id: String,
    response: Value,
    conversation: Vec<Value>,
}

/// Responses created with `store` (the default): what
/// `previous_response_id`, `GET /v1/responses/{id}` and `DELETE` find.
/// Bounded per tenant (the oldest go first), and a tenant sees only its own.
#[derive(Default)]
pub struct ResponseStore {
    by_tenant: Mutex<HashMap<String, VecDeque<Stored>>>,
}

impl ResponseStore {
    fn find<T>(&self, tenant: &str, id: &str, f: impl FnOnce(&Stored) -> T) -> Option<T> {
        let map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        map.get(tenant)?.iter().find(|s| s.id == id).map(f)
    }

    fn conversation(&self, tenant: &str, id: &str) -> Option<Vec<Value>> {
        self.find(tenant, id, |s| s.conversation.clone())
    }

    /// The response object stored under `id` for `tenant`.
    pub fn response(&self, tenant: &str, id: &str) -> Option<Value> {
        self.find(tenant, id, |s| s.response.clone())
    }

    /// Forgets `id` for `tenant`; whether it was there.
    pub fn delete(&self, tenant: &str, id: &str) -> bool {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = map.get_mut(tenant) else {
            return false;
        };
        let before = list.len();
        list.retain(|s| s.id != id);
        list.len() != before
    }

    fn put(&self, tenant: &str, id: String, response: Value, conversation: Vec<Value>) {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        let list = map.entry(tenant.to_string()).or_default();
        if list.len() >= STORED_PER_TENANT {
            list.pop_front();
        }
        list.push_back(Stored {
            id,
            response,
            conversation,
        });
    }
}

/// A 404 in OpenAI's shape for a response id this tenant has not stored.
fn response_not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid(
        Some("response_id".to_string()),
        format!("Response with id '{id}' not found."),
    );
    e.status = hyper::StatusCode::NOT_FOUND;
    e
}

/// `GET /v1/responses/{id}`: a stored response of the caller's tenant.
pub fn retrieve(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    match state.responses.response(key, id) {
        Some(r) => Ok(json_response(&r)),
        None => Err(response_not_found(id)),
    }
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    if state.responses.delete(key, id) {
        Ok(json_response(
            &json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(response_not_found(id))
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message)
}

/// The text of a message's `content`: a string, or input/output text parts.
fn content_text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(invalid(
                            &format!("{param}[{j}]"),
                            format!(
                                "content parts of type {} are not supported; send input_text",
                                kind.unwrap_or("(none)")
                            ),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(invalid(
            param,
            "content must be a string or a list of parts",
        )),
    }
}

/// `input` as chat messages.
fn input_messages(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match v {
        None | Some(Value::Null) => Err(invalid("input", "'input' is required")),
        Some(Value::String(s)) => Ok(vec![json!({"role": "user", "content": s})]),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                if kind != "message" {
                    return Err(invalid(
                        &param,
                        format!("input items of type '{kind}' are not supported; send messages"),
                    ));
                }
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                    invalid(&format!("{param}.role"), "each input message needs a role")
                })?;
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(invalid(
                        &format!("{param}.role"),
                        format!("role '{role}' is not one of user, assistant, system, developer"),
                    ));
                }
                // Chat templates know `system`; `developer` is its newer name.
                let role = if role == "developer" { "system" } else { role };
                let content = content_text(item.get("content"), &format!("{param}.content"))?;
                Ok(json!({"role": role, "content": content}))
            })
            .collect(),
        Some(_) => Err(invalid(
            "input",
            "'input' must be a string or a list of messages",
        )),
    }
}

/// `text.format` as a chat `response_format`.
fn response_format(f: &Fields<'_>) -> Result<Option<Value>, ApiError> {
    let Some(text) = f.object("text")? else {
        return Ok(None);
    };
    let Some(format) = text.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = format.get("type").and_then(Value::as_str);
    Ok(match kind {
        Some("text") => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => Some(json!({"type": "json_schema", "json_schema": {
            "name": format.get("name").cloned().unwrap_or(json!("response")),
            "schema": format.get("schema").cloned().unwrap_or(Value::Null),
            "strict": format.get("strict").cloned().unwrap_or(Value::Null),
        }})),
        _ => {
            return Err(invalid(
                "text.format.type",
                "'text.format.type' must be 'text', 'json_object' or 'json_schema'",
            ))
        }
    })
}

/// Refuses what this server does not do, rather than ignoring it.
fn refuse_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    if let Some(tools) = f.0.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            return Err(invalid(
                "tools",
                "tools on /v1/responses (built-in or function) are not supported; use /v1/chat/completions for function calling",
            ));
        }
    }
    if f.bool("background")?.unwrap_or(false) {
        return Err(invalid(
            "background",
            "background responses are not supported",
        ));
    }
    if f.0.get("reasoning").is_some_and(|r| !r.is_null()) {
        return Err(invalid(
            "reasoning",
            "'reasoning' is not supported: the model does not produce reasoning items",
        ));
    }
    if f.0.get("conversation").is_some_and(|r| !r.is_null()) {
        return Err(invalid(
            "conversation",
            "conversations are not supported; continue with previous_response_id",
        ));
    }
    Ok(())
}

/// What the response object echoes of the request.
struct Echo {
    id: String,
    model: String,
    created: u64,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    previous: Value,
    text: Value,
}

impl Echo {
    /// The response object with this status, output, usage and
    /// `incomplete_details`.
    fn object(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: Value) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "previous_response_id": self.previous, "text": self.text,
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": true,
            "incomplete_details": incomplete, "error": null, "metadata": {},
            "usage": usage,
        })
    }
}

fn usage_of(run: &Run) -> Value {
    let output: usize = run.choices.iter().map(|c| c.tokens).sum();
    json!({
        "input_tokens": run.prompt_tokens,
        "input_tokens_details": {"cached_tokens": run.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": run.prompt_tokens + output,
    })
}

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content: Vec<Value> = text
        .map(|t| json!({"type": "output_text", "text": t, "annotations": []}))
        .into_iter()
        .collect();
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// `(status, incomplete_details)` for a finish reason.
fn status_of(finish: Option<&str>) -> (&'static str, Value) {
    match finish {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("abort") => ("cancelled", Value::Null),
        _ => ("completed", Value::Null),
    }
}

/// `POST /v1/responses`.
pub async fn responses(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let id = format!("resp_{:032x}", rand::random::<u128>());
    let store_key = tenant.as_ref().map_or_else(String::new, |t| t.id.clone());
    let (body, mut ctx) = super::admit(&state, tenant, &id, "/v1/responses", body).await?;
    let f = Fields::of(&body)?;
    refuse_unsupported(&f)?;
    let model = f
        .str("model")?
        .ok_or_else(|| invalid("model", "'model' is required"))?
        .to_string();
    let previous = f.str("previous_response_id")?.map(str::to_string);
    let mut messages: Vec<Value> = match &previous {
        Some(p) => state.responses.conversation(&store_key, p).ok_or_else(|| {
            invalid(
                "previous_response_id",
                format!("Previous response with id '{p}' not found."),
            )
        })?,
        None => Vec::new(),
    };
    // Instructions apply to this turn only, as OpenAI's do.
    let instructions = f.str("instructions")?.map(str::to_string);
    if let Some(i) = &instructions {
        messages.retain(|m| m.get("role").and_then(Value::as_str) != Some("system"));
        messages.insert(0, json!({"role": "system", "content": i}));
    }
    messages.extend(input_messages(f.0.get("input"))?);
    let stream = f.bool("stream")?.unwrap_or(false);
    let store = f.bool("store")?.unwrap_or(true);
    // The chat request this response is served as.
    let mut chat = Map::new();
    chat.insert("model".into(), json!(model));
    chat.insert("messages".into(), Value::Array(messages.clone()));
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
        ("user", "user"),
    ] {
        if let Some(v) = f.0.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), v.clone());
        }
    }
    if let Some(rf) = response_format(&f)? {
        chat.insert("response_format".into(), rf);
    }
    let chat = Value::Object(chat);
    let cf = Fields::of(&chat)?;
    let common = parse_common(&cf, true, state.default_model()).map_err(|mut e| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
        }
        e
    })?;
    if let Some(c) = &ctx {
        c.check_model(&common.model)?;
    }
    let engine = state.engine_for(&common.model)?.clone();
    let parsed = parse_messages(&cf)?;
    check_prompt_size(
        engine.tokenizer(),
        parsed.iter().map(|m| m.content.len()).sum(),
        engine.max_model_len(),
        "input",
    )?;
    let ids = render_chat(&engine, &chat, &parsed, None, &mut ctx).await?;
    let echo = Echo {
        id: id.clone(),
        model: model.clone(),
        created: now_secs(),
        instructions: json!(instructions),
        max_output_tokens: f.0.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        temperature: f.0.get("temperature").cloned().unwrap_or(Value::Null),
        top_p: f.0.get("top_p").cloned().unwrap_or(Value::Null),
        previous: json!(previous),
        text: f
            .0
            .get("text")
            .cloned()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
    };
    let run = start_run(
        state.clone(),
        common,
        vec![RunPrompt::new(ids)],
        Api::Chat,
        id.clone(),
        ctx,
        None,
    )
    .await?;
    let remember = move |text: &str, response: &Value| {
        if store {
            let mut conversation = messages;
            conversation.push(json!({"role": "assistant", "content": text}));
            state
                .responses
                .put(&store_key, id, response.clone(), conversation);
        }
    };
    if !stream {
        let run = collect(run).await?;
        let c = &run.choices[0];
        let (status, incomplete) = status_of(c.finish_reason);
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let out = echo.object(
            status,
            vec![message_item(&msg_id, "completed", Some(&c.text))],
            usage_of(&run),
            incomplete,
        );
        remember(&c.text, &out);
        return Ok(json_response(&out));
    }
    Ok(stream_events(run, echo, remember))
}

/// One SSE event of the Responses API.
fn event(kind: &str, seq: &mut u64, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*seq);
    *seq += 1;
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// Streams the response's events: a task reads the engine outputs (through
/// the tenant's `on-chunk` plugins) and sends the frames; a client that
/// goes away drops the receiver, the task ends and the run's guard aborts
/// the engine request.
fn stream_events(
    mut run: Run,
    echo: Echo,
    remember: impl FnOnce(&str, &Value) + Send + 'static,
) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let mut seq = 0u64;
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let opening = [
            (
                "response.created",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
            (
                "response.in_progress",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
            (
                "response.output_item.added",
                json!({"output_index": 0, "item": message_item(&msg_id, "in_progress", None)}),
            ),
            (
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            ),
        ];
        for (kind, data) in opening {
            if tx.send(event(kind, &mut seq, data)).await.is_err() {
                return;
            }
        }
        while run.remaining > 0 {
            let Some(mut o) = run.rx.recv().await else {
                let err = ApiError::unavailable("the engine stopped before the response finished");
                let _ = tx
                    .send(event(
                        "error",
                        &mut seq,
                        json!({"code": err.code, "message": err.message, "param": null}),
                    ))
                    .await;
                return;
            };
            if let Err(e) = run.on_chunk(&mut o).await {
                let data = json!({"code": e.code, "message": e.message, "param": null});
                let _ = tx.send(event("error", &mut seq, data)).await;
                return;
            }
            if run.absorb(&o).is_none() {
                continue;
            }
            if !o.new_text.is_empty() {
                let delta = json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                    "delta": o.new_text, "logprobs": []});
                if tx
                    .send(event("response.output_text.delta", &mut seq, delta))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        run.guard.disarm();
        let c = &run.choices[0];
        let text = c.text.clone();
        let (status, incomplete) = status_of(c.finish_reason);
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let item = message_item(&msg_id, "completed", Some(&text));
        let done_kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        let closing = [
            (
                "response.output_text.done",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                "text": text, "logprobs": []}),
            ),
            (
                "response.content_part.done",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "part": part}),
            ),
            (
                "response.output_item.done",
                json!({"output_index": 0, "item": item.clone()}),
            ),
            (
                done_kind,
                json!({"response": echo.object(status, vec![item], usage_of(&run), incomplete)}),
            ),
        ];
        if let Some((_, last)) = closing.last() {
            remember(&text, &last["response"]);
        }
        for (kind, data) in closing {
            if tx.send(event(kind, &mut seq, data)).await.is_err() {
                return;
            }
        }
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(Frame::data(b)), rx))
    });
    super::sse_response(frames)
}
