//! `POST /v1/responses`: OpenAI's Responses API over the same engine as
//! chat. A request (`instructions`, `input` as text or messages,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format`) becomes a
//! chat request; the answer is a `response` object, or, streamed, its
//! events (`response.created` … `response.output_text.delta` …
//! `response.completed`). `previous_response_id` continues a conversation
//! kept in a bounded in-memory store per tenant, whose input items
//! `GET /v1/responses/{id}/input_items` lists. `background: true` (with
//! `store`) answers at once with a queued response that generation
//! completes in the store, and `POST /v1/responses/{id}/cancel` stops.
//! Function tools may come grouped in `namespace` tools (as Codex sends
//! them); `reasoning` input items continue a reasoning model's turn;
//! `include: ["message.output_text.logprobs"]` returns (and streams) the
//! answer's logprobs. `POST /v1/responses/render` gives the prompt's token
//! ids without generating. Built-in tools, files and images are refused
//! with a 400.

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
    /// The request's own `input`, as items (`input_items` lists them).
    input_items: Vec<Value>,
}

/// Responses created with `store` (the default): what
/// `previous_response_id`, `GET /v1/responses/{id}` and `DELETE` find.
/// Bounded per tenant (the oldest go first), and a tenant sees only its own.
#[derive(Default)]
pub struct ResponseStore {
    by_tenant: Mutex<HashMap<String, VecDeque<Stored>>>,
    /// Background responses still generating, by (tenant, id): what
    /// cancelling one wakes. Whoever takes an entry out (the generation
    /// finishing, or a cancel) writes the response's final state.
    running: Mutex<HashMap<(String, String), Arc<tokio::sync::Notify>>>,
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

    /// Stores (or replaces) `id`'s response for `tenant`.
    fn put(
        &self,
        tenant: &str,
        id: String,
        response: Value,
        conversation: Vec<Value>,
        input_items: Vec<Value>,
    ) {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        let list = map.entry(tenant.to_string()).or_default();
        list.retain(|s| s.id != id);
        if list.len() >= STORED_PER_TENANT {
            list.pop_front();
        }
        list.push_back(Stored {
            id,
            response,
            conversation,
            input_items,
        });
    }

    /// Replaces a stored response object, keeping its conversation and
    /// input items (a background response's progress).
    fn set_response(&self, tenant: &str, id: &str, response: Value) {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map
            .get_mut(tenant)
            .and_then(|l| l.iter_mut().find(|s| s.id == id))
        {
            s.response = response;
        }
    }

    fn input_items(&self, tenant: &str, id: &str) -> Option<Vec<Value>> {
        self.find(tenant, id, |s| s.input_items.clone())
    }

    fn start_background(&self, tenant: &str, id: &str) -> Arc<tokio::sync::Notify> {
        let n = Arc::new(tokio::sync::Notify::new());
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        map.insert((tenant.to_string(), id.to_string()), Arc::clone(&n));
        n
    }

    /// Takes `id` out of the running background responses; whether it was
    /// there (the caller then owns its final state).
    fn finish_background(&self, tenant: &str, id: &str) -> Option<Arc<tokio::sync::Notify>> {
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&(tenant.to_string(), id.to_string()))
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

/// `GET /v1/responses/{id}/input_items`: the items of the request's
/// `input`, as OpenAI lists them: `order` (`desc`, the default, or `asc`),
/// `limit` (1 to 100, default 20) and `after` (an item id) from `query`.
pub fn input_items(
    state: &AppState,
    id: &str,
    query: Option<&str>,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    let mut items = state
        .responses
        .input_items(key, id)
        .ok_or_else(|| response_not_found(id))?;
    let (mut order, mut limit, mut after) = ("desc".to_string(), 20usize, None);
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.split_once('='))
    {
        match k {
            "order" if v == "asc" || v == "desc" => order = v.to_string(),
            "order" => return Err(invalid("order", "'order' must be 'asc' or 'desc'")),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| invalid("limit", "'limit' must be an integer from 1 to 100"))?
            }
            "after" => after = Some(crate::server::percent_decode(v)),
            _ => {}
        }
    }
    if order == "desc" {
        items.reverse();
    }
    if let Some(a) = after {
        let at = items
            .iter()
            .position(|i| i["id"] == a.as_str())
            .ok_or_else(|| invalid("after", format!("no input item '{a}' in this response")))?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    Ok(json_response(&json!({
        "object": "list",
        "first_id": items.first().map(|i| i["id"].clone()),
        "last_id": items.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": items,
    })))
}

/// `POST /v1/responses/{id}/cancel`: stops a background response that is
/// still generating (its status becomes `cancelled`); one that finished is
/// returned as it is. Only background responses can be cancelled.
pub fn cancel(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    let mut response = state
        .responses
        .response(key, id)
        .ok_or_else(|| response_not_found(id))?;
    if response["background"] != json!(true) {
        return Err(invalid(
            "response_id",
            "Only responses created with background: true can be cancelled.",
        ));
    }
    if let Some(wake) = state.responses.finish_background(key, id) {
        response["status"] = json!("cancelled");
        state.responses.set_response(key, id, response.clone());
        // The generation stops (and its engine requests are aborted).
        wake.notify_one();
    }
    Ok(json_response(&response))
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
    // A `reasoning` item's text, for the assistant turn that follows it.
    let mut reasoning: Option<String> = None;
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
                    // A reasoning model's thinking (from an earlier
                    // response's `output`): it goes with the assistant
                    // turn after it, as chat's `reasoning_content`, for
                    // the template to keep or drop. Encrypted reasoning
                    // (OpenAI's own) cannot be read and is refused.
                    "reasoning" => {
                        let text = reasoning_text(item, &param)?;
                        reasoning.get_or_insert_with(String::new).push_str(&text);
                        continue;
                    }
                    "function_call" => {
                        let call = json!({
                            "id": item_str(item, "call_id", &param)?,
                            "type": "function",
                            "function": {
                                "name": flat_name(
                                    item.get("namespace").and_then(Value::as_str),
                                    item_str(item, "name", &param)?,
                                ),
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
                            format!("input items of type '{other}' are not supported; send messages, reasoning, function_call or function_call_output"),
                        ))
                    }
                }
                // The reasoning belongs to the assistant turn it precedes.
                if let Some(r) = reasoning.take() {
                    match out.last_mut() {
                        Some(m) if m["role"] == "assistant" => {
                            m["reasoning_content"] = json!(r);
                            m["reasoning"] = json!(r);
                        }
                        // Before another role's turn it has no turn of its
                        // own to go with, and is dropped (as templates drop
                        // earlier turns' reasoning).
                        _ => {}
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

/// The text of a `reasoning` input item: its `content` (reasoning_text
/// parts), else its `summary` (summary_text parts).
fn reasoning_text(item: &Value, param: &str) -> Result<String, ApiError> {
    let parts = |key: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    let content = parts("content");
    if !content.is_empty() {
        return Ok(content);
    }
    let summary = parts("summary");
    if summary.is_empty() && item.get("encrypted_content").is_some_and(|v| !v.is_null()) {
        return Err(invalid(
            &format!("{param}.encrypted_content"),
            "encrypted reasoning cannot be read by this server; send the reasoning's content or summary",
        ));
    }
    Ok(summary)
}

/// The chat name of a function inside a `namespace` tool: `ns.name`.
fn flat_name(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_string(),
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

/// The request's `input` as the items `input_items` lists: a string is one
/// user message; every item gets an id if it has none.
fn input_item_list(v: Option<&Value>) -> Vec<Value> {
    let items = match v {
        Some(Value::String(s)) => vec![json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": s}]})],
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    };
    items
        .into_iter()
        .map(|mut item| {
            if item.get("id").is_none_or(Value::is_null) {
                item["id"] = json!(format!("msg_{:032x}", rand::random::<u128>()));
            }
            if item.get("type").is_none() {
                item["type"] = json!("message");
            }
            // A message's text as a part list, as OpenAI lists it.
            if item["type"] == "message" {
                if let Some(t) = item
                    .get("content")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                {
                    let kind = if item["role"] == "assistant" {
                        "output_text"
                    } else {
                        "input_text"
                    };
                    item["content"] = json!([{"type": kind, "text": t}]);
                }
                if item.get("status").is_none() {
                    item["status"] = json!("completed");
                }
            }
            item
        })
        .collect()
}

/// Responses' function tools (`{"type": "function", "name", ...}`) and
/// `tool_choice` in the chat form, for the chat path's parsing, schema
/// enforcement and templates. Built-in tools are refused.
fn chat_tools(f: &Fields<'_>) -> Result<(Option<Value>, Option<Value>, Namespaces), ApiError> {
    let mut namespaces = Namespaces::new();
    let function = |t: &Value, name: String| {
        let mut function = Map::new();
        function.insert("name".into(), json!(name));
        for key in ["description", "parameters", "strict"] {
            if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), v.clone());
            }
        }
        json!({"type": "function", "function": function})
    };
    let tools = match f.0.get("tools").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::Array(list)) if list.is_empty() => None,
        Some(Value::Array(list)) => {
            let mut out = Vec::new();
            for (i, t) in list.iter().enumerate() {
                let kind = t.get("type").and_then(Value::as_str).unwrap_or("(none)");
                let name = |t: &Value, param: &str| -> Result<String, ApiError> {
                    t.get("name")
                        .and_then(Value::as_str)
                        .filter(|n| !n.is_empty())
                        .map(str::to_string)
                        .ok_or_else(|| invalid(param, "a tool needs a non-empty 'name'"))
                };
                match kind {
                    "function" => out.push(function(t, name(t, &format!("tools[{i}].name"))?)),
                    // A group of function tools under one name (OpenAI's
                    // `namespace` tool, as Codex sends MCP servers' tools):
                    // the model sees each as `ns.name`; its calls come back
                    // with `name` and `namespace` apart.
                    "namespace" => {
                        let ns = name(t, &format!("tools[{i}].name"))?;
                        let inner = t.get("tools").and_then(Value::as_array).ok_or_else(|| {
                            invalid(&format!("tools[{i}].tools"), "a namespace tool needs a list of 'tools'")
                        })?;
                        for (j, sub) in inner.iter().enumerate() {
                            let param = format!("tools[{i}].tools[{j}]");
                            if sub.get("type").and_then(Value::as_str).unwrap_or("function") != "function" {
                                return Err(invalid(
                                    &format!("{param}.type"),
                                    "a namespace holds function tools only here",
                                ));
                            }
                            let sub_name = name(sub, &format!("{param}.name"))?;
                            let flat = flat_name(Some(&ns), &sub_name);
                            namespaces.insert(flat.clone(), (ns.clone(), sub_name));
                            out.push(function(sub, flat));
                        }
                    }
                    _ => {
                        return Err(invalid(
                            &format!("tools[{i}].type"),
                            format!("built-in tools ('{kind}') are not supported on /v1/responses; only function (and namespace) tools"),
                        ))
                    }
                }
            }
            Some(Value::Array(out))
        }
        Some(_) => return Err(invalid("tools", "'tools' must be a list")),
    };
    let choice = match f.0.get("tool_choice").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::String(s)) => Some(json!(s)),
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => {
                let name = flat_name(o.get("namespace").and_then(Value::as_str), name);
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
    Ok((tools, choice, namespaces))
}

/// The functions of `namespace` tools: their chat name (`ns.name`) →
/// (namespace, name).
type Namespaces = HashMap<String, (String, String)>;

/// A `function_call` output item, and the chat tool call it stands for in
/// the stored conversation.
fn function_call_item(
    call: &super::tool_parsers::ParsedToolCall,
    status: &str,
    namespaces: &Namespaces,
) -> (Value, Value) {
    let call_id = format!("call_{:024x}", rand::random::<u128>() >> 32);
    let mut item = json!({
        "type": "function_call", "id": format!("fc_{:032x}", rand::random::<u128>()),
        "call_id": call_id, "name": call.name, "arguments": call.arguments, "status": status,
    });
    if let Some((ns, name)) = namespaces.get(&call.name) {
        item["name"] = json!(name);
        item["namespace"] = json!(ns);
    }
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
        // As OpenAI and vLLM: a background response is fetched from the
        // store, so it must be stored; and it is polled, not streamed.
        if !f.bool("store")?.unwrap_or(true) {
            return Err(invalid(
                "background",
                "background responses need 'store' to be true",
            ));
        }
        if f.bool("stream")?.unwrap_or(false) {
            return Err(invalid(
                "background",
                "background responses are not streamed here; poll GET /v1/responses/{id}",
            ));
        }
    }
    if !reasoning && f.0.get("reasoning").is_some_and(|r| !r.is_null()) {
        return Err(invalid(
            "reasoning",
            "'reasoning' needs a server started with --reasoning-parser (deepseek_r1, qwen3 or openai_gptoss)",
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
    background: bool,
    /// `namespace` tools' functions, to name their calls apart.
    namespaces: Namespaces,
    /// `include` asked for the answer's logprobs.
    logprobs: bool,
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
            "parallel_tool_calls": self.parallel_tool_calls, "background": self.background,
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

fn message_item(id: &str, status: &str, text: Option<&str>, logprobs: Value) -> Value {
    let content: Vec<Value> = text
        .map(|t| json!({"type": "output_text", "text": t, "annotations": [], "logprobs": logprobs}))
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
    respond(state, body, tenant, false).await
}

/// `POST /v1/responses/render`: the token ids a Responses request's prompt
/// would have (its conversation, instructions and tools as the chat
/// template renders them), generating nothing; the shape of
/// `/v1/chat/completions/render`'s answer.
pub async fn render(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    respond(state, body, tenant, true).await
}

/// A Responses request served (or, with `render_only`, only rendered).
async fn respond(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    render_only: bool,
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
    let input_items = input_item_list(f.0.get("input"));
    let stream = f.bool("stream")?.unwrap_or(false);
    let store = f.bool("store")?.unwrap_or(true);
    let background = f.bool("background")?.unwrap_or(false);
    // `include: ["message.output_text.logprobs"]` (with `top_logprobs`
    // alternatives per token): the answer's logprobs, as chat's.
    let include: Vec<String> = match f.get("include") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| invalid("include", "'include' must be a list of strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid("include", "'include' must be a list of strings")),
    };
    let logprobs = include.iter().any(|i| i == "message.output_text.logprobs");
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
    // `reasoning.effort`, as chat's `reasoning_effort` (which gpt-oss's
    // template reads).
    if let Some(effort) = f.0.get("reasoning").and_then(|r| r.get("effort")) {
        if !effort.is_null() {
            chat.insert("reasoning_effort".into(), effort.clone());
        }
    }
    if logprobs {
        chat.insert("logprobs".into(), json!(true));
        if let Some(k) = f.0.get("top_logprobs").filter(|v| !v.is_null()) {
            chat.insert("top_logprobs".into(), k.clone());
        }
    }
    let (chat_tools, chat_choice, namespaces) = chat_tools(&f)?;
    // A forced call (named or required) is the whole output, so a
    // `text.format` beside it has no text to shape; instructor's
    // RESPONSES_TOOLS mode sends both, the format being the tool's own
    // schema. The tool's constraint applies.
    let forced = chat_choice
        .as_ref()
        .is_some_and(|c| c.is_object() || c == "required");
    if let Some(rf) = response_format(&f)?.filter(|_| !forced) {
        chat.insert("response_format".into(), rf);
    }
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
    let engine = state.engine_as(&common.model, ctx.as_ref())?.clone();
    super::embeddings::refuse_generation(&engine, "/v1/responses")?;
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
    if render_only {
        let mut sampling = Map::new();
        if let Some(m) = common.params.max_tokens {
            sampling.insert("max_tokens".into(), json!(m));
        }
        if let Some(t) = common.params.temperature {
            sampling.insert("temperature".into(), json!(t));
        }
        return Ok(json_response(
            &json!({"request_id": id, "model": common.model,
            "token_ids": ids, "sampling_params": sampling, "features": null}),
        ));
    }
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
        background,
        namespaces,
        logprobs,
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
    if background {
        return Ok(json_response(&run_in_background(
            state,
            run,
            echo,
            store_key,
            messages,
            input_items,
        )));
    }
    let remember = move |assistant: Value, response: &Value| {
        if store {
            let mut conversation = messages;
            conversation.push(assistant);
            state
                .responses
                .put(&store_key, id, response.clone(), conversation, input_items);
        }
    };
    if !stream {
        let run = collect(run).await?;
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let (items, assistant) = final_output(&run, &msg_id, &echo);
        let out = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &out);
        return Ok(json_response(&out));
    }
    Ok(stream_events(run, echo, remember))
}

/// `background: true`: stores the response as `queued` and answers with
/// it at once; the generation goes on in a task that stores the finished
/// response, unless `cancel` (which wakes the task) got there first. The
/// task drops the run when cancelled, which aborts its engine requests.
fn run_in_background(
    state: Arc<AppState>,
    run: Run,
    echo: Echo,
    store_key: String,
    messages: Vec<Value>,
    input_items: Vec<Value>,
) -> Value {
    let queued = echo.object("queued", vec![], Value::Null, Value::Null);
    let id = echo.id.clone();
    state.responses.put(
        &store_key,
        id.clone(),
        queued.clone(),
        messages.clone(),
        input_items.clone(),
    );
    let wake = state.responses.start_background(&store_key, &id);
    let answer = queued.clone();
    tokio::spawn(async move {
        let mut in_progress = queued;
        in_progress["status"] = json!("in_progress");
        state
            .responses
            .set_response(&store_key, &id, in_progress.clone());
        let result = tokio::select! {
            r = collect(run) => r,
            // Cancelled: `cancel` wrote the final state.
            _ = wake.notified() => return,
        };
        if state.responses.finish_background(&store_key, &id).is_none() {
            return;
        }
        match result {
            Ok(run) => {
                let (status, incomplete) = status_of(run.choices[0].finish_reason);
                let msg_id = format!("msg_{:032x}", rand::random::<u128>());
                let (items, assistant) = final_output(&run, &msg_id, &echo);
                let out = echo.object(status, items, usage_of(&run), incomplete);
                let mut conversation = messages;
                conversation.push(assistant);
                state
                    .responses
                    .put(&store_key, id, out, conversation, input_items);
            }
            Err(e) => {
                let mut failed = in_progress;
                failed["status"] = json!("failed");
                failed["error"] = json!({"code": e.code, "message": e.message});
                state.responses.set_response(&store_key, &id, failed);
            }
        }
    });
    answer
}

/// The output items of a finished run (its text as a message, or the
/// function calls its output holds, after any text), and the assistant
/// turn that `previous_response_id` continues from.
fn final_output(run: &Run, msg_id: &str, echo: &Echo) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let (mut items, assistant) = answer_output(run, msg_id, echo);
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

/// The answer's logprobs in an `output_text` part: with `include`, its
/// tokens' (as chat's `logprobs.content`), else an empty list.
fn text_logprobs(run: &Run, lps: &[crate::engine::request::TokenLogprob], echo: &Echo) -> Value {
    if !echo.logprobs {
        return json!([]);
    }
    match run.logprobs_json(None, lps, 0) {
        Value::Object(mut o) => o.remove("content").unwrap_or(json!([])),
        _ => json!([]),
    }
}

/// [`final_output`]'s answer: its text as a message, or its function calls.
fn answer_output(run: &Run, msg_id: &str, echo: &Echo) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let lp = || text_logprobs(run, &c.logprobs, echo);
    let parsed = run
        .tools
        .as_ref()
        .map(|m| super::tools::extract(m, &c.text));
    match parsed {
        Some(p) if !p.calls.is_empty() => {
            let mut items = Vec::new();
            if let Some(text) = p.content.as_deref().filter(|t| !t.is_empty()) {
                items.push(message_item(msg_id, "completed", Some(text), json!([])));
            }
            let mut calls = Vec::new();
            for call in &p.calls {
                let (item, chat) = function_call_item(call, "completed", &echo.namespaces);
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
            vec![message_item(msg_id, "completed", Some(""), json!([]))],
            json!({"role": "assistant", "content": ""}),
        ),
        _ => {
            let text = super::tools::uncalled_text(run.tools.as_ref(), &c.text);
            (
                vec![message_item(msg_id, "completed", Some(&text), lp())],
                json!({"role": "assistant", "content": text}),
            )
        }
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
        let logprobs = part.get("logprobs").cloned().unwrap_or_else(|| json!([]));
        ev.push((
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": logprobs}),
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
                "text": text, "logprobs": part.get("logprobs").cloned().unwrap_or_else(|| json!([]))}),
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
                json!({"output_index": 0, "item": message_item(&msg_id, "in_progress", None, json!([]))}),
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
                // With `include`, each delta carries its tokens' logprobs.
                let delta = json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                    "delta": o.new_text, "logprobs": text_logprobs(&run, &o.logprobs, &echo)});
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
        if let Err(e) = run.meter().await {
            let data = json!({"code": e.code, "message": e.message, "param": null});
            let _ = tx.send(event("error", &mut seq, data)).await;
            return;
        }
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let (items, assistant) = final_output(&run, &msg_id, &echo);
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
        // `response.completed` whatever the status (an `incomplete` one
        // cut by max_output_tokens included), as vLLM ends its streams:
        // the openai SDK's `responses.stream().get_final_response()`
        // returns only after that event, and raises without it.
        let response = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &response);
        closing.push(("response.completed", json!({"response": response})));
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
