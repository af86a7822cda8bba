//! A Responses request, typed ([`ResponsesRequest`]), and what it becomes
//! in the chat request it is served as: its `input` items as chat
//! messages, its tools (`namespace` tools flattened) as chat tools,
//! `text.format` as a `response_format`; and what this server refuses.

use crate::server::errors::ApiError;
use crate::server::openai::wire::{Count, LogprobCount, Number, Object};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// A `/v1/responses` body. The fields the response object echoes are
/// echoed from the body as written.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// Text, or a list of items ([`input_messages`] reads them).
    pub input: Option<Value>,
    /// A system message for this turn only.
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub stream: Option<bool>,
    /// Whether the response is kept (default true).
    pub store: Option<bool>,
    pub background: Option<bool>,
    /// `message.output_text.logprobs` asks for the answer's logprobs.
    pub include: Option<Vec<String>>,
    pub top_logprobs: Option<LogprobCount>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub max_output_tokens: Option<Count>,
    pub parallel_tool_calls: Option<bool>,
    pub reasoning: Option<ReasoningConfig>,
    /// Function and `namespace` tools, as written ([`chat_tools`] reads
    /// them with `tool_choice`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// `text.format`: the answer's format.
    pub text: Option<Object>,
    /// Refused: conversations are not kept here.
    pub conversation: Option<Value>,
}

/// `reasoning`.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(expecting = "an object")]
pub struct ReasoningConfig {
    /// `low`, `medium` or `high`: chat's `reasoning_effort`.
    pub effort: Option<String>,
}

impl ResponsesRequest {
    /// Whether `include` asks for the answer's logprobs.
    pub fn wants_logprobs(&self) -> bool {
        self.include
            .iter()
            .flatten()
            .any(|i| i == "message.output_text.logprobs")
    }

    /// Refuses what this server does not do, rather than ignoring it.
    /// `reasoning` tells whether the server runs a reasoning parser.
    pub fn refuse_unsupported(&self, reasoning: bool) -> Result<(), ApiError> {
        if self.background.unwrap_or(false) {
            // As OpenAI and vLLM: a background response is fetched from
            // the store, so it must be stored; and it is polled, not
            // streamed.
            if !self.store.unwrap_or(true) {
                return Err(invalid(
                    "background",
                    "background responses need 'store' to be true",
                ));
            }
            if self.stream.unwrap_or(false) {
                return Err(invalid(
                    "background",
                    "background responses are not streamed here; poll GET /v1/responses/{id}",
                ));
            }
        }
        if !reasoning && self.reasoning.is_some() {
            return Err(invalid(
                "reasoning",
                "'reasoning' needs a server started with --reasoning-parser (deepseek_r1, qwen3 or openai_gptoss)",
            ));
        }
        if self.conversation.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(invalid(
                "conversation",
                "conversations are not supported; continue with previous_response_id",
            ));
        }
        Ok(())
    }
}

pub(crate) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message)
}

/// The text of a message's `content`: a string, or input/output text parts.
pub(crate) fn content_text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
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
pub(crate) fn item_str<'a>(item: &'a Value, key: &str, param: &str) -> Result<&'a str, ApiError> {
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
pub(crate) fn input_messages(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
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
pub(crate) fn reasoning_text(item: &Value, param: &str) -> Result<String, ApiError> {
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
pub(crate) fn flat_name(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_string(),
    }
}

/// One `message` input item as a chat message.
pub(crate) fn input_message(item: &Value, param: &str) -> Result<Value, ApiError> {
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
pub(crate) fn input_item_list(v: Option<&Value>) -> Vec<Value> {
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
pub(crate) fn chat_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<(Option<Value>, Option<Value>, Namespaces), ApiError> {
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
    let tools = match tools.filter(|v| !v.is_null()) {
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
    let choice = match tool_choice.filter(|v| !v.is_null()) {
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
pub(crate) type Namespaces = HashMap<String, (String, String)>;

/// A `function_call` output item, and the chat tool call it stands for in
/// the stored conversation.
pub(crate) fn function_call_item(
    call: &crate::server::openai::tool_parsers::ParsedToolCall,
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

/// `text.format` as a chat `response_format` (an object).
pub(crate) fn response_format(
    text: Option<&Object>,
) -> Result<Option<Map<String, Value>>, ApiError> {
    let Some(Object(text)) = text else {
        return Ok(None);
    };
    let Some(format) = text.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = format.get("type").and_then(Value::as_str);
    let object = |v: Value| match v {
        Value::Object(m) => Some(m),
        _ => None,
    };
    Ok(match kind {
        Some("text") => None,
        Some("json_object") => object(json!({"type": "json_object"})),
        Some("json_schema") => object(json!({"type": "json_schema", "json_schema": {
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
