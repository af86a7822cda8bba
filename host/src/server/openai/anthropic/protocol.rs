//! Anthropic Messages requests as chat requests, and the pieces of a
//! Messages response: what the chat path computes (messages, tools, tool
//! choice, sampling fields, template kwargs), written the way Anthropic's
//! clients send and read it.
//!
//! A request becomes a chat body that the chat path parses as its own
//! (`parse_common`, `tools::parse`, `parse_messages`, `render_chat`), so
//! both APIs render the same prompt from the same conversation.

use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use crate::server::openai::tool_parsers::ParsedToolCall;
use serde_json::{json, Map, Value};

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message)
}

/// Which endpoint the body is for: `count_tokens` takes no `max_tokens`
/// and generates nothing.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Endpoint {
    Messages,
    CountTokens,
}

/// The chat body a Messages request is served as.
pub fn chat_body(body: &Value, endpoint: Endpoint) -> Result<Value, ApiError> {
    let f = Fields::of(body)?;
    let mut chat = Map::new();
    if let Some(m) = f.str("model")? {
        chat.insert("model".into(), json!(m));
    }
    if endpoint == Endpoint::Messages {
        match f.i64("max_tokens")? {
            None => return Err(invalid(
                "max_tokens",
                "max_tokens: Field required (the Messages API needs the most tokens to generate)",
            )),
            Some(n) if n < 1 => {
                return Err(invalid(
                    "max_tokens",
                    format!("max_tokens: must be at least 1, got {n}"),
                ))
            }
            Some(n) => {
                chat.insert("max_tokens".into(), json!(n));
            }
        }
        for key in ["temperature", "top_p", "top_k", "stream"] {
            if let Some(v) = f.0.get(key).filter(|v| !v.is_null()) {
                chat.insert(key.into(), v.clone());
            }
        }
        let stops = f.strings("stop_sequences")?;
        if !stops.is_empty() {
            chat.insert("stop".into(), json!(stops));
        }
        if let Some(user) = f
            .object("metadata")?
            .and_then(|m| m.get("user_id"))
            .and_then(Value::as_str)
        {
            chat.insert("user".into(), json!(user));
        }
        if let Some(rf) = response_format(&f)? {
            chat.insert("response_format".into(), rf);
        }
    }
    refuse_unsupported(&f)?;
    let mut messages = Vec::new();
    let mut system = system_text(f.0.get("system"))?;
    let list = match f.0.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(invalid("messages", "messages: must not be empty")),
        None | Some(Value::Null) => return Err(invalid("messages", "messages: Field required")),
        Some(_) => return Err(invalid("messages", "messages: must be a list of messages")),
    };
    let mut turns = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages.{i}");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            invalid(
                &format!("{param}.role"),
                format!("{param}.role: must be 'user' or 'assistant'"),
            )
        })?;
        match role {
            "user" => user_turn(m.get("content"), &param, &mut turns)?,
            "assistant" => turns.push(assistant_turn(m.get("content"), &param)?),
            // vLLM folds system turns into the system prompt; so do we.
            "system" => system.push_str(&system_text(m.get("content"))?),
            other => {
                return Err(invalid(
                    &format!("{param}.role"),
                    format!("{param}.role: '{other}' is not one of 'user', 'assistant'"),
                ))
            }
        }
    }
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.extend(turns);
    if messages.is_empty() {
        return Err(invalid("messages", "messages: must not be empty"));
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = chat_tools(f.0.get("tools"))? {
        chat.insert("tools".into(), tools);
    }
    if let Some(choice) = f.object("tool_choice")? {
        let (choice, parallel) = tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if !parallel {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    let kwargs = template_kwargs(&f)?;
    if !kwargs.is_empty() {
        chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
    }
    Ok(Value::Object(chat))
}

/// Refuses what this server does not do, rather than ignoring it.
fn refuse_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    let given = |v: &Value| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty());
    if f.0.get("mcp_servers").is_some_and(given) {
        return Err(invalid(
            "mcp_servers",
            "mcp_servers: MCP connectors are not supported by this server",
        ));
    }
    if f.0.get("container").is_some_and(|v| !v.is_null()) {
        return Err(invalid(
            "container",
            "container: code-execution containers are not supported by this server",
        ));
    }
    Ok(())
}

/// `system` (a string or text blocks) as one string.
fn system_text(v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match block_type(b) {
                    "text" => out.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                    other => {
                        return Err(invalid(
                            "system",
                            format!("system.{j}: blocks of type '{other}' are not supported in the system prompt; send text"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(invalid(
            "system",
            "system: must be a string or a list of text blocks",
        )),
    }
}

fn block_type(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("(none)")
}

/// The refusal of a block this server cannot take.
fn unsupported_block(param: &str, kind: &str) -> ApiError {
    match kind {
        "image" | "document" => invalid(
            param,
            format!("{param}: '{kind}' blocks are not supported: this model reads text only"),
        ),
        _ => invalid(
            param,
            format!("{param}: content blocks of type '{kind}' are not supported here"),
        ),
    }
}

/// A user turn: its `tool_result` blocks as tool messages (in order, as
/// the chat templates expect them right after the calls), then its text,
/// if any, as a user message.
fn user_turn(content: Option<&Value>, param: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let blocks = match content {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(invalid(
                &format!("{param}.content"),
                format!("{param}.content: must be a string or a list of content blocks"),
            ))
        }
    };
    let mut text = String::new();
    let mut has_text = false;
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}.content.{j}");
        match block_type(b) {
            "text" => {
                has_text = true;
                text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""));
            }
            "tool_result" => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        invalid(
                            &format!("{bp}.tool_use_id"),
                            format!("{bp}.tool_use_id: Field required"),
                        )
                    })?;
                let mut result = tool_result_text(b.get("content"), &bp)?;
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    result = format!("Error: {result}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            other => return Err(unsupported_block(&bp, other)),
        }
    }
    if has_text {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// A `tool_result`'s content: a string or text blocks.
fn tool_result_text(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (k, b) in blocks.iter().enumerate() {
                match block_type(b) {
                    "text" => parts.push(b.get("text").and_then(Value::as_str).unwrap_or("")),
                    other => return Err(unsupported_block(&format!("{param}.content.{k}"), other)),
                }
            }
            Ok(parts.join("\n"))
        }
        Some(_) => Err(invalid(
            &format!("{param}.content"),
            format!("{param}.content: must be a string or a list of text blocks"),
        )),
    }
}

/// An assistant turn: text, its `tool_use` blocks as tool calls, and its
/// thinking as `reasoning_content` (what reasoning models' templates read)
/// and `reasoning` (vLLM 0.32's name for it).
fn assistant_turn(content: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    let blocks = match content {
        Some(Value::String(s)) => return Ok(json!({"role": "assistant", "content": s})),
        Some(Value::Array(b)) => b,
        _ => {
            return Err(invalid(
                &format!("{param}.content"),
                format!("{param}.content: must be a string or a list of content blocks"),
            ))
        }
    };
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}.content.{j}");
        match block_type(b) {
            "text" => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            "thinking" => {
                reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
            }
            // Opaque: nothing of it can be shown to the model.
            "redacted_thinking" => {}
            "tool_use" => {
                let field = |k: &str| {
                    b.get(k).and_then(Value::as_str).ok_or_else(|| {
                        invalid(&format!("{bp}.{k}"), format!("{bp}.{k}: Field required"))
                    })
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({
                    "id": field("id")?,
                    "type": "function",
                    "function": {"name": field("name")?, "arguments": input.to_string()},
                }));
            }
            other => return Err(unsupported_block(&bp, other)),
        }
    }
    let mut m = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
        m["reasoning"] = json!(reasoning);
    }
    Ok(m)
}

/// Anthropic's client tools as chat function tools. Anthropic's built-in
/// tools (`bash_…`, `text_editor_…`, `web_search_…`, …) are refused.
fn chat_tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("tools", "tools: must be a list of tools")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools.{i}");
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(kind) => {
                return Err(invalid(
                    &format!("{param}.type"),
                    format!("{param}.type: Anthropic's built-in tool '{kind}' is not supported; define the tool with name, description and input_schema"),
                ))
            }
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                invalid(
                    &format!("{param}.name"),
                    format!("{param}.name: Field required"),
                )
            })?;
        let schema = match t.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            _ => {
                return Err(invalid(
                    &format!("{param}.input_schema"),
                    format!("{param}.input_schema: a JSON schema object is required"),
                ))
            }
        };
        let mut function = Map::new();
        function.insert("name".into(), json!(name));
        if let Some(d) = t.get("description").filter(|d| d.is_string()) {
            function.insert("description".into(), d.clone());
        }
        function.insert("parameters".into(), schema);
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice` in the chat form, and whether parallel calls are allowed.
fn tool_choice(o: &Map<String, Value>) -> Result<(Value, bool), ApiError> {
    let parallel = !o
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid(
                    "tool_choice.name",
                    "tool_choice.name: Field required for {\"type\": \"tool\"}",
                )
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(invalid(
                "tool_choice",
                "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'",
            ))
        }
    };
    Ok((choice, parallel))
}

/// The template variables: vLLM's `chat_template_kwargs`, and `thinking`
/// as `enable_thinking` (what Qwen3-style templates read), unless the
/// kwargs set it already.
fn template_kwargs(f: &Fields<'_>) -> Result<Map<String, Value>, ApiError> {
    let mut kw = f
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    if let Some(t) = f.object("thinking")? {
        let on = match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive" | "between_tools") => true,
            Some("disabled") => false,
            _ => {
                return Err(invalid(
                    "thinking.type",
                    "thinking.type: must be 'enabled' or 'disabled'",
                ))
            }
        };
        kw.entry("enable_thinking").or_insert(json!(on));
    }
    Ok(kw)
}

/// Structured output: `output_config.format` (or the older top-level
/// `output_format`) `{"type": "json_schema", "schema": …}` as a chat
/// `response_format`.
fn response_format(f: &Fields<'_>) -> Result<Option<Value>, ApiError> {
    let format = match f.object("output_config")? {
        Some(c) => c.get("format").filter(|v| !v.is_null()),
        None => None,
    }
    .or_else(|| f.0.get("output_format").filter(|v| !v.is_null()));
    let Some(format) = format else {
        return Ok(None);
    };
    match (
        format.get("type").and_then(Value::as_str),
        format.get("schema"),
    ) {
        (Some("json_schema"), Some(schema @ Value::Object(_))) => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }))),
        _ => Err(invalid(
            "output_config.format",
            "output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}",
        )),
    }
}

/// A fresh `tool_use` id, in Anthropic's shape.
pub fn tool_use_id() -> String {
    format!("toolu_{:024x}", rand::random::<u128>() >> 32)
}

/// A fresh message id, in Anthropic's shape.
pub fn message_id() -> String {
    format!("msg_{:032x}", rand::random::<u128>())
}

/// The `tool_use` blocks of parsed calls, or None if some call's
/// arguments are not a JSON object (an output cut short by `max_tokens`):
/// that output is then answered as text.
pub fn tool_use_blocks(calls: &[ParsedToolCall]) -> Option<Vec<Value>> {
    calls
        .iter()
        .map(|c| {
            let input: Value = serde_json::from_str(&c.arguments).ok()?;
            input.is_object().then(
                || json!({"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": input}),
            )
        })
        .collect()
}

/// `(stop_reason, stop_sequence)` of a finished choice: the engine's
/// finish reason and the stop string that ended it, if one did.
pub fn stop_reason(
    finish: Option<&str>,
    stop: Option<&Value>,
    called: bool,
) -> (&'static str, Value) {
    match finish {
        Some("length") => ("max_tokens", Value::Null),
        _ if called => ("tool_use", Value::Null),
        Some("stop") => match stop.and_then(Value::as_str) {
            Some(s) => ("stop_sequence", json!(s)),
            None => ("end_turn", Value::Null),
        },
        _ => ("end_turn", Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Value {
        chat_body(&v, Endpoint::Messages).expect("converts")
    }

    #[test]
    fn max_tokens_is_required_for_messages_only() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let e = chat_body(&body, Endpoint::Messages).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("max_tokens"), "{}", e.message);
        assert!(chat_body(&body, Endpoint::CountTokens).is_ok());
    }

    #[test]
    fn system_messages_and_sampling_fields_map_to_chat() {
        let c = chat(json!({
            "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "again"}],
            "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 3, "stream": true,
            "metadata": {"user_id": "u1"},
        }));
        assert_eq!(c["max_tokens"], 9);
        assert_eq!(c["stop"], json!(["\n\n"]));
        assert_eq!(c["top_k"], 3);
        assert_eq!(c["stream"], true);
        assert_eq!(c["user"], "u1");
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"},
            ])
        );
    }

    #[test]
    fn tool_use_and_tool_result_become_calls_and_tool_messages() {
        let c = chat(json!({
            "max_tokens": 9,
            "tools": [{"name": "get_weather", "description": "d",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "and so?"}]},
            ],
        }));
        assert_eq!(
            c["tools"][0],
            json!({"type": "function", "function": {"name": "get_weather", "description": "d",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
        );
        assert_eq!(
            c["tool_choice"],
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(c["parallel_tool_calls"], false);
        let m = &c["messages"];
        assert_eq!(m[1]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(m[1]["reasoning_content"], "hmm");
        assert_eq!(m[1]["reasoning"], "hmm");
        assert_eq!(
            m[2],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(m[3], json!({"role": "user", "content": "and so?"}));
    }

    #[test]
    fn tool_choice_kinds_map_to_chat_choices() {
        for (t, want) in [
            ("auto", json!("auto")),
            ("any", json!("required")),
            ("none", json!("none")),
        ] {
            let c = chat(
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": t}}),
            );
            assert_eq!(c["tool_choice"], want, "{t}");
        }
    }

    #[test]
    fn images_built_in_tools_and_bad_fields_are_refused() {
        let image = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]});
        let e = chat_body(&image, Endpoint::Messages).unwrap_err();
        assert!(e.message.contains("text only"), "{}", e.message);
        let builtin = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "bash_20250124", "name": "bash"}]});
        assert!(chat_body(&builtin, Endpoint::Messages).is_err());
        let role = json!({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]});
        assert!(chat_body(&role, Endpoint::Messages).is_err());
        let thinking = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "sometimes"}});
        assert!(chat_body(&thinking, Endpoint::Messages).is_err());
    }

    #[test]
    fn thinking_sets_enable_thinking_unless_the_kwargs_do() {
        let c = chat(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        );
        assert_eq!(c["chat_template_kwargs"], json!({"enable_thinking": true}));
        let c = chat(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": true}}),
        );
        assert_eq!(c["chat_template_kwargs"], json!({"enable_thinking": true}));
    }

    #[test]
    fn stop_reasons_follow_the_finish() {
        assert_eq!(stop_reason(Some("length"), None, false).0, "max_tokens");
        assert_eq!(stop_reason(Some("stop"), None, true).0, "tool_use");
        assert_eq!(
            stop_reason(Some("stop"), Some(&json!("END")), false),
            ("stop_sequence", json!("END"))
        );
        assert_eq!(stop_reason(Some("stop"), None, false).0, "end_turn");
    }
}
