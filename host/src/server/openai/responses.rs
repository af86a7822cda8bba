//! `POST /v1/responses`: OpenAI's Responses API over the same engine as
//! chat. A request (`instructions`, `input` as text or messages,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format`) becomes a
//! chat request; the answer is a `response` object, or, streamed, its
//! events (`response.created` … `response.output_text.delta` …
//! `response.completed`). `previous_response_id` continues a conversation
//! kept in a bounded in-memory store per tenant. Built-in tools, files,
//! images, background mode and reasoning are refused with a 400.

use super::{collect, now_secs, parse_common, start_run, Api, Run, RunPrompt};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::fields::Fields;
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

/// A string field of an input item, required.
fn item_str<'a>(item: &'a Value, key: &str, param: &str) -> Result<&'a str, ApiError> {
    item.get(key).and_then(Value::as_str).ok_or_else(|| {
        invalid(
            &format!("{param}.{key}"),
            format!("'{key}' is required and must be a string"),
        )
    })
}

/// `input` as chat messages. Besides messages, the items of a function
/// call round trip: the model's `function_call`s (consecutive ones become
/// one assistant turn with several `tool_calls`) and the client's
/// `function_call_output`s (tool turns).
fn input_messages(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    match v {
        None | Some(Value::Null) => return Err(invalid("input", "'input' is required")),
        Some(Value::String(s)) => return Ok(vec![json!({"role": "user", "content": s})]),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let param = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "function_call" => {
                        let call = json!({
                            "id": item_str(item, "call_id", &param)?,
                            "type": "function",
                            "function": {
                                "name": item_str(item, "name", &param)?,
                                "arguments": item_str(item, "arguments", &param)?,
                            },
                        });
                        let joins = out.last().is_some_and(|m| {
                            m["role"] == "assistant" && m.get("tool_calls").is_some()
                        });
                        match out.last_mut() {
                            Some(m) if joins => {
                                if let Some(list) = m["tool_calls"].as_array_mut() {
                                    list.push(call);
                                }
                            }
                            _ => out.push(json!({
                                "role": "assistant", "content": null, "tool_calls": [call],
                            })),
                        }
                    }
                    "function_call_output" => {
                        let output = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            other => content_text(other, &format!("{param}.output"))?,
                        };
                        out.push(json!({
                            "role": "tool",
                            "tool_call_id": item_str(item, "call_id", &param)?,
                            "content": output,
                        }));
                    }
                    "message" => out.push(input_message(item, &param)?),
                    other => {
                        return Err(invalid(
                            &param,
                            format!("input items of type '{other}' are not supported; send messages, function_call or function_call_output"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(invalid(
            "input",
            "'input' must be a string or a list of messages",
        )),
    }
}

/// One `message` input item as a chat message.
fn input_message(item: &Value, param: &str) -> Result<Value, ApiError> {
    let role = item
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(&format!("{param}.role"), "each input message needs a role"))?;
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
}

/// Responses' function tools (`{"type": "function", "name", ...}`) and
/// `tool_choice` in the chat form, for the chat path's parsing, schema
/// enforcement and templates. Built-in tools are refused.
fn chat_tools(f: &Fields<'_>) -> Result<(Option<Value>, Option<Value>), ApiError> {
    let tools = match f.0.get("tools").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::Array(list)) if list.is_empty() => None,
        Some(Value::Array(list)) => {
            let mut out = Vec::new();
            for (i, t) in list.iter().enumerate() {
                let kind = t.get("type").and_then(Value::as_str).unwrap_or("(none)");
                if kind != "function" {
                    return Err(invalid(
                        &format!("tools[{i}].type"),
                        format!("built-in tools ('{kind}') are not supported on /v1/responses; only function tools"),
                    ));
                }
                let mut function = Map::new();
                for key in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                        function.insert(key.into(), v.clone());
                    }
                }
                out.push(json!({"type": "function", "function": function}));
            }
            Some(Value::Array(out))
        }
        Some(_) => return Err(invalid("tools", "'tools' must be a list")),
    };
    let choice = match f.0.get("tool_choice").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::String(s)) => Some(json!(s)),
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name")) {
            (Some("function"), Some(name)) => {
                Some(json!({"type": "function", "function": {"name": name}}))
            }
            _ => {
                return Err(invalid(
                    "tool_choice",
                    "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                ))
            }
        },
        Some(_) => return Err(invalid("tool_choice", "'tool_choice' must be a string or an object")),
    };
    Ok((tools, choice))
}

/// A `function_call` output item, and the chat tool call it stands for in
/// the stored conversation.
fn function_call_item(call: &super::tool_parsers::ParsedToolCall, status: &str) -> (Value, Value) {
    let call_id = format!("call_{:024x}", rand::random::<u128>() >> 32);
    let item = json!({
        "type": "function_call", "id": format!("fc_{:032x}", rand::random::<u128>()),
        "call_id": call_id, "name": call.name, "arguments": call.arguments, "status": status,
    });
    let chat = json!({"id": call_id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}});
    (item, chat)
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
fn refuse_unsupported(f: &Fields<'_>, reasoning: bool) -> Result<(), ApiError> {
    if f.bool("background")?.unwrap_or(false) {
        return Err(invalid(
            "background",
            "background responses are not supported",
        ));
    }
    if !reasoning && f.0.get("reasoning").is_some_and(|r| !r.is_null()) {
        return Err(invalid(
            "reasoning",
            "'reasoning' needs a server started with --reasoning-parser (deepseek_r1 or qwen3)",
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
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
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
            "tools": self.tools, "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
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
        "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens()},
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
    refuse_unsupported(&f, state.reasoning_parser().is_some())?;
    // No model: the first served name, as chat and completions (and
    // vLLM) do.
    let model = match f.str("model")? {
        Some(m) => m.to_string(),
        None => state
            .default_model()
            .ok_or_else(|| invalid("model", "'model' is required"))?
            .to_string(),
    };
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
        ("parallel_tool_calls", "parallel_tool_calls"),
    ] {
        if let Some(v) = f.0.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), v.clone());
        }
    }
    if let Some(rf) = response_format(&f)? {
        chat.insert("response_format".into(), rf);
    }
    let (chat_tools, chat_choice) = chat_tools(&f)?;
    if let Some(t) = chat_tools {
        chat.insert("tools".into(), t);
    }
    if let Some(c) = chat_choice {
        chat.insert("tool_choice".into(), c);
    }
    let chat = Value::Object(chat);
    let cf = Fields::of(&chat)?;
    let mut common = parse_common(&cf, true, state.default_model()).map_err(|mut e| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
        }
        e
    })?;
    if let Some(c) = &ctx {
        c.check_model(&common.model)?;
    }
    let engine = state.engine_for(&common.model)?.clone();
    // Function tools go through the chat path's parsing, schema
    // enforcement (named and required choices) and templates.
    let (ids, mode) = super::chat_prompt(
        &state,
        &engine,
        &chat,
        &mut common,
        &mut ctx,
        "text.format",
        "input",
    )
    .await?;
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
        tools: f
            .0
            .get("tools")
            .cloned()
            .filter(|v| !v.is_null())
            .unwrap_or(json!([])),
        tool_choice: f
            .0
            .get("tool_choice")
            .cloned()
            .filter(|v| !v.is_null())
            .unwrap_or(json!("auto")),
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
    };
    let run = start_run(
        state.clone(),
        common,
        vec![RunPrompt::new(ids)],
        Api::Chat,
        id.clone(),
        ctx,
        mode,
    )
    .await?;
    let remember = move |assistant: Value, response: &Value| {
        if store {
            let mut conversation = messages;
            conversation.push(assistant);
            state
                .responses
                .put(&store_key, id, response.clone(), conversation);
        }
    };
    if !stream {
        let run = collect(run).await?;
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let (items, assistant) = final_output(&run, &msg_id);
        let out = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &out);
        return Ok(json_response(&out));
    }
    Ok(stream_events(run, echo, remember))
}

/// The output items of a finished run (its text as a message, or the
/// function calls its output holds, after any text), and the assistant
/// turn that `previous_response_id` continues from.
fn final_output(run: &Run, msg_id: &str) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let (mut items, assistant) = answer_output(run, msg_id);
    // A reasoning model's thinking comes first, as its own item.
    if !c.reasoning.is_empty() {
        items.insert(
            0,
            json!({"type": "reasoning", "id": format!("rs_{:032x}", rand::random::<u128>()),
                "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": c.reasoning}]}),
        );
    }
    (items, assistant)
}

/// [`final_output`]'s answer: its text as a message, or its function calls.
fn answer_output(run: &Run, msg_id: &str) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let parsed = run
        .tools
        .as_ref()
        .map(|m| super::tools::extract(m, &c.text));
    match parsed {
        Some(p) if !p.calls.is_empty() => {
            let mut items = Vec::new();
            if let Some(text) = p.content.as_deref().filter(|t| !t.is_empty()) {
                items.push(message_item(msg_id, "completed", Some(text)));
            }
            let mut calls = Vec::new();
            for call in &p.calls {
                let (item, chat) = function_call_item(call, "completed");
                items.push(item);
                calls.push(chat);
            }
            (
                items,
                json!({"role": "assistant", "content": p.content, "tool_calls": calls}),
            )
        }
        // A forced call (named or required) that max_tokens cut is no
        // call, and its fragment of JSON is no answer either.
        Some(_) if !matches!(run.tools, Some(super::tools::ToolMode::Auto(_))) => (
            vec![message_item(msg_id, "completed", Some(""))],
            json!({"role": "assistant", "content": ""}),
        ),
        _ => (
            vec![message_item(msg_id, "completed", Some(&c.text))],
            json!({"role": "assistant", "content": c.text}),
        ),
    }
}

/// One SSE event of the Responses API.
fn event(kind: &str, seq: &mut u64, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*seq);
    *seq += 1;
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The events that announce, fill and close one finished output item, at
/// `index`: a message's text part, or a function call's arguments (each
/// sent whole, as one delta).
fn item_events(item: &Value, index: usize) -> Vec<(&'static str, Value)> {
    let id = item["id"].clone();
    let mut open = item.clone();
    open["status"] = json!("in_progress");
    let mut ev = Vec::new();
    if item["type"] == "reasoning" {
        open["content"] = json!([]);
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
    } else if item["type"] == "function_call" {
        open["arguments"] = json!("");
        let args = item["arguments"].clone();
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
        ev.push((
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": args}),
        ));
        ev.push((
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "arguments": args}),
        ));
    } else {
        open["content"] = json!([]);
        let part = item["content"][0].clone();
        let text = part["text"].clone();
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
        ev.push((
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        ));
        ev.push((
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": []}),
        ));
        ev.extend(text_closing(&id, index, &text, &part));
    }
    ev.push((
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    ));
    ev
}

/// The events that close a message's text part.
fn text_closing(
    id: &Value,
    index: usize,
    text: &Value,
    part: &Value,
) -> [(&'static str, Value); 2] {
    [
        (
            "response.output_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "text": text, "logprobs": []}),
        ),
        (
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        ),
    ]
}

/// Streams the response's events: a task reads the engine outputs (through
/// the tenant's `on-chunk` plugins) and sends the frames; a client that
/// goes away drops the receiver, the task ends and the run's guard aborts
/// the engine request. Plain text is streamed as it is generated; with
/// function tools the output is only known to be calls or text once it is
/// complete, so its items are sent at the end.
fn stream_events(
    mut run: Run,
    echo: Echo,
    remember: impl FnOnce(Value, &Value) + Send + 'static,
) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    // Text streams as it comes unless it may turn out to be tool calls or
    // hold reasoning, whose items go out at the end.
    let live_text = run.tools.is_none() && run.reasoning.is_none();
    tokio::spawn(async move {
        let mut seq = 0u64;
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let mut opening = vec![
            (
                "response.created",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
            (
                "response.in_progress",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
        ];
        if live_text {
            opening.push((
                "response.output_item.added",
                json!({"output_index": 0, "item": message_item(&msg_id, "in_progress", None)}),
            ));
            opening.push((
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            ));
        }
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
            if run.absorb(&mut o).is_none() {
                continue;
            }
            if live_text && !o.new_text.is_empty() {
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
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let (items, assistant) = final_output(&run, &msg_id);
        let mut closing: Vec<(&'static str, Value)> = Vec::new();
        if live_text {
            let item = &items[0];
            let part = item["content"][0].clone();
            closing.extend(text_closing(&json!(msg_id), 0, &part["text"], &part));
            closing.push((
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ));
        } else {
            for (i, item) in items.iter().enumerate() {
                closing.extend(item_events(item, i));
            }
        }
        let done_kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        let response = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &response);
        closing.push((done_kind, json!({"response": response})));
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
