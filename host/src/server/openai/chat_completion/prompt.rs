//! A chat's prompt: its messages and tools parsed, and rendered by the
//! model's chat template (or a tenant's `render-prompt` plugin) into
//! token ids. Chat completions, Responses, Anthropic's Messages, render
//! and `/tokenize` all render chats here, so the same conversation gets
//! the same tokens whichever endpoint it came to.

use super::protocol::{parse_messages, ChatCompletionRequest, ChatFields};
use crate::server::errors::ApiError;
use crate::server::openai::tenant::TenantCtx;
use crate::server::openai::{check_prompt_size, off_runtime, protocol, structured, tools};
use crate::server::AppState;
use serde_json::{json, Value};

/// The prompt of a chat request (a chat completion, or the chat request a
/// Responses or Anthropic request becomes; `body` is its JSON, which the
/// tools' parser and a tenant's render plugin read): its messages and tools parsed,
/// a named or required tool choice made the output's constraint (which
/// `format_field`, the request's own output format, may then not also
/// set), the prompt size checked (naming `size_param`) and the prompt
/// rendered. Returns the prompt's ids and how the output is read for
/// tool calls.
pub(crate) async fn chat_prompt(
    state: &AppState,
    engine: &crate::engine::async_engine::AsyncEngine,
    request: &ChatCompletionRequest,
    body: &Value,
    common: &mut protocol::CommonParams,
    ctx: &mut Option<TenantCtx>,
    format_field: &str,
    size_param: &str,
) -> Result<(Vec<u32>, Option<tools::ToolMode>), ApiError> {
    state.needs_tokenizer("a chat (its template and tokens)")?;
    let messages = parse_messages(request.chat.messages.as_ref())?;
    let tools = request.chat.tools(state.auto_tool_parser())?;
    if let Some((spec, param)) = tools.as_ref().and_then(|t| t.constraint()) {
        if common.structured.is_some() {
            return Err(ApiError::invalid(
                Some("tool_choice".into()),
                format!("a named or 'required' tool_choice already constrains the output; drop {format_field}"),
            ));
        }
        common.structured = Some(structured::RequestedStructure {
            spec,
            param: param.into(),
        });
    }
    check_prompt_size(
        engine.tokenizer(),
        messages.iter().map(|m| m.content.len()).sum(),
        engine.max_model_len(),
        size_param,
    )?;
    // A reasoning parser needs to know how the template's generation
    // prompt left the reasoning (opened, closed, neither).
    let want = state.reasoning_parser().is_some();
    let (ids, generation_prompt) = render_chat(
        engine,
        body,
        &request.chat,
        &messages,
        tools.as_ref(),
        ctx,
        want,
    )
    .await?;
    common.generation_prompt = generation_prompt;
    Ok((ids, tools.and_then(|t| t.mode)))
}

/// A chat's prompt tokens: the tenant's `render-prompt` plugins if one
/// renders it (from `body`, the chat's JSON), else the model's chat
/// template over the validated `messages` (with tools, if the request
/// offers them) as `chat`'s fields ask. With
/// `want_generation_prompt`, also the text the model's template wrote
/// after the conversation to open the reply (its generation prompt), when
/// the host's template rendered it.
pub(crate) async fn render_chat(
    engine: &crate::engine::async_engine::AsyncEngine,
    body: &Value,
    chat: &ChatFields,
    messages: &[crate::tokenizer::chat_template::ChatMessage],
    tools: Option<&tools::ToolRequest>,
    ctx: &mut Option<TenantCtx>,
    want_generation_prompt: bool,
) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let continue_final = continue_final_message(chat, messages)?;
    // Continuing the final message opens no new turn: vLLM refuses both
    // at once, and an absent `add_generation_prompt` is read as false.
    let add_generation_prompt = !continue_final && chat.add_generation_prompt.unwrap_or(true);
    let tok = engine.tokenizer().clone();
    let rendered = match ctx {
        Some(c) if c.has_render_prompt() => {
            // The plugin renders a copy of the body in which every string
            // the client wrote (contents, names, tool definitions, tool
            // calls, kwargs, object keys) has its special-token text
            // swapped for placeholders, and the placeholders in the prompt
            // it returns are encoded as the plain text they stand for: as
            // on the host's own template path, only the plugin's template
            // writes control tokens.
            let (t, copy) = (tok.clone(), body.clone());
            let (protected, plain) = off_runtime(move || {
                let mut copy = copy;
                let mut plain = crate::tokenizer::plain_text::PlainText::default();
                plain
                    .protect(&t, &mut copy)
                    .map_err(|e| ApiError::invalid(Some("messages".into()), format!("{e:#}")))?;
                Ok((copy, plain))
            })
            .await?;
            let template = tok.chat_template().map(|t| t.source().to_string());
            c.render(&protected, template)
                .await
                // A template's error quotes the client's text as written.
                .map_err(|mut e| {
                    e.message = plain.restore(&e.message);
                    e
                })?
                .map(|text| (text, plain))
        }
        _ => None,
    };
    // Rendering and tokenizing a large conversation takes CPU time, which
    // must not hold up the HTTP threads (probes, streams of other clients).
    let input = match rendered {
        Some((text, plain)) => ChatInput::Rendered(text, plain),
        None => {
            if tok.chat_template().is_none() {
                return Err(ApiError::invalid(None, "This model has no chat template; use /v1/completions or load a model whose tokenizer_config.json has one."));
            }
            // The messages as validated (text parts joined), with the
            // fields tool use adds (tool_calls, tool_call_id, name).
            let raw = chat.messages.as_ref().and_then(Value::as_array);
            // gpt-oss's template reads an earlier turn's reasoning as
            // `thinking`.
            let reads_thinking = tok
                .chat_template()
                .is_some_and(|t| t.source().contains("thinking"));
            let normalized: Vec<Value> = messages
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let mut v = raw
                        .and_then(|r| r.get(i))
                        .filter(|v| v.is_object())
                        .cloned()
                        .unwrap_or_else(|| json!({}));
                    v["role"] = json!(m.role);
                    v["content"] = json!(m.content);
                    same_reasoning(&mut v);
                    if reads_thinking && v.get("thinking").is_none_or(Value::is_null) {
                        if let Some(r) = v.get("reasoning").filter(|r| !r.is_null()).cloned() {
                            v["thinking"] = r;
                        }
                    }
                    v
                })
                .collect();
            let source = tok.chat_template().map_or("", |t| t.source());
            let (msgs, mut extra) = tools::template_input(&Value::Array(normalized), tools, source);
            // `reasoning_effort`, which gpt-oss's template reads.
            if let Some(effort) = &chat.reasoning_effort {
                if !REASONING_EFFORTS.contains(&effort.as_str()) {
                    return Err(ApiError::invalid(
                        Some("reasoning_effort".into()),
                        format!(
                            "'reasoning_effort' must be one of {}",
                            REASONING_EFFORTS.join(", ")
                        ),
                    ));
                }
                extra.insert("reasoning_effort".into(), json!(effort));
            }
            // vLLM's `chat_template_kwargs` (`{"enable_thinking": false}`):
            // more template variables, never replacing the request's own.
            match &chat.chat_template_kwargs {
                None | Some(Value::Null) => {}
                Some(Value::Object(kw)) => {
                    for (k, v) in kw {
                        extra.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        Some("chat_template_kwargs".into()),
                        "'chat_template_kwargs' must be an object",
                    ))
                }
            }
            ChatInput::Template(msgs, extra)
        }
    };
    off_runtime(move || {
        let bad = |e: anyhow::Error| ApiError::invalid(Some("messages".into()), format!("{e:#}"));
        match input {
            // A tenant's plugin rendered it from the protected body: what
            // the client wrote comes back as plain text.
            ChatInput::Rendered(text, plain) => Ok((plain.encode(&tok, &text).map_err(bad)?, None)),
            ChatInput::Template(mut msgs, extra) => {
                let template = tok
                    .chat_template()
                    .ok_or_else(|| ApiError::invalid(None, "This model has no chat template."))?;
                // Everything the request gives the template (messages, tool
                // definitions and calls) is plain text: only the template
                // writes control tokens (see `plain_text`).
                let mut plain = crate::tokenizer::plain_text::PlainText::default();
                let mut extra = Value::Object(extra);
                plain.protect(&tok, &mut msgs).map_err(bad)?;
                plain.protect(&tok, &mut extra).map_err(bad)?;
                let Value::Object(extra) = extra else {
                    return Err(ApiError::internal("template variables are not an object"));
                };
                let mut text = template
                    .render_json(&msgs, add_generation_prompt, &extra)
                    .map_err(|e| {
                        ApiError::invalid(
                            Some("messages".into()),
                            format!("the chat template failed: {e:#}"),
                        )
                    })?;
                if continue_final {
                    // The final message (as protected) left open: the
                    // prompt ends where its text does, before whatever
                    // the template closes the turn with, as Hugging Face's
                    // `continue_final_message` (which vLLM uses) cuts it.
                    let last = msgs
                        .as_array()
                        .and_then(|m| m.last())
                        .and_then(|m| m.get("content"))
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    text = cut_after_final_message(&text, last).ok_or_else(|| {
                        ApiError::invalid(
                            Some("continue_final_message".into()),
                            "'continue_final_message' is set but the final message does not appear in the prompt the chat template wrote",
                        )
                    })?;
                }
                // What the template wrote to open the reply: the rendering
                // past the same conversation rendered without it. Only
                // this tells whether the template opened or closed the
                // reasoning; earlier turns and the client's own text may
                // hold the tags too.
                let generation_prompt = if want_generation_prompt && add_generation_prompt {
                    template
                        .render_json(&msgs, false, &extra)
                        .ok()
                        .and_then(|without| text.strip_prefix(without.as_str()).map(str::to_string))
                } else if want_generation_prompt {
                    Some(String::new())
                } else {
                    None
                };
                // The rendered template already holds BOS where the model
                // wants it.
                Ok((plain.encode(&tok, &text).map_err(bad)?, generation_prompt))
            }
        }
    })
    .await
}

/// vLLM's `continue_final_message`: whether the prompt ends inside the
/// final message (an assistant's prefill the model continues) instead of
/// opening a new turn. It takes an assistant's final message and no
/// `add_generation_prompt: true`, as vLLM (and the template library it
/// uses) refuse otherwise.
fn continue_final_message(
    chat: &ChatFields,
    messages: &[crate::tokenizer::chat_template::ChatMessage],
) -> Result<bool, ApiError> {
    if !chat.continue_final_message.unwrap_or(false) {
        return Ok(false);
    }
    let bad = |m: &str| ApiError::invalid(Some("continue_final_message".into()), m);
    if chat.add_generation_prompt == Some(true) {
        return Err(bad(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    match messages.last() {
        Some(m) if m.role == "assistant" && !m.content.trim().is_empty() => Ok(true),
        _ => Err(bad(
            "'continue_final_message' needs the final message to be an assistant's, with text to continue",
        )),
    }
}

/// `text` up to the end of the last place `last` (the final message's
/// text) appears in it, or of its trimmed form (templates often strip
/// messages); None if it does not appear.
fn cut_after_final_message(text: &str, last: &str) -> Option<String> {
    let at = |needle: &str| {
        (!needle.is_empty())
            .then(|| text.rfind(needle).map(|i| i + needle.len()))
            .flatten()
    };
    let end = at(last).or_else(|| at(last.trim()))?;
    Some(text[..end].to_string())
}

/// An assistant message's reasoning under both its names: vLLM 0.32's
/// `reasoning` and the older `reasoning_content` (what templates read), so
/// a template finds it whichever one the client wrote.
fn same_reasoning(m: &mut Value) {
    let Some(o) = m.as_object_mut() else {
        return;
    };
    let given = |k: &str| o.get(k).filter(|v| !v.is_null()).cloned();
    match (given("reasoning"), given("reasoning_content")) {
        (Some(r), None) => {
            o.insert("reasoning_content".into(), r);
        }
        (None, Some(r)) => {
            o.insert("reasoning".into(), r);
        }
        _ => {}
    }
}

/// The `reasoning_effort` values a chat request may give (vLLM's).
const REASONING_EFFORTS: &[&str] = &["low", "medium", "high"];

/// A chat prompt before tokenizing: rendered by a tenant's plugin (with
/// the placeholders of the body it was given), or the model template's
/// input (messages and extra variables).
enum ChatInput {
    Rendered(String, crate::tokenizer::plain_text::PlainText),
    Template(Value, serde_json::Map<String, Value>),
}
