//! The steps every generation request takes once its endpoint has read it
//! into a typed request (chat completions, completions, Responses and
//! Anthropic's Messages alike): the model checked against the tenant's
//! allowlist and its engine found ([`generation_engine`]), then the prompt
//! checked for size, rendered and tokenized off the HTTP threads, with
//! the constraints it brings (a forced tool call, the reasoning the
//! template opened) set on the request ([`prepare`]). What is left is
//! [`crate::server::openai::engine_io::start_run`]: submitting it.

use crate::engine::async_engine::AsyncEngine;
use crate::server::errors::ApiError;
use crate::server::openai::chat_completion::prompt::chat_prompt;
use crate::server::openai::chat_completion::protocol::{parse_messages, ChatCompletionRequest};
use crate::server::openai::completion::protocol::{parse_prompts, PromptInput};
use crate::server::openai::engine_io::RunPrompt;
use crate::server::openai::protocol::CommonParams;
use crate::server::openai::tenant::TenantCtx;
use crate::server::openai::tools::ToolMode;
use crate::server::openai::{check_prompt_size, off_runtime, pooling};
use crate::server::AppState;
use serde_json::Value;

/// The engine that serves a generation request for `model`: one the
/// tenant may use, and one that generates (a model served for pooling is
/// refused, naming `endpoint`). The one place a generation endpoint looks
/// its engine up.
pub(crate) fn generation_engine<'s>(
    state: &'s AppState,
    model: &str,
    ctx: Option<&TenantCtx>,
    endpoint: &str,
) -> Result<&'s AsyncEngine, ApiError> {
    if let Some(c) = ctx {
        c.check_model(model)?;
    }
    let engine = state.engine_as(model, ctx)?;
    pooling::refuse_generation(engine, endpoint)?;
    Ok(engine)
}

/// A generation request's prompt, as its endpoint read it.
pub(crate) enum PromptRequest<'a> {
    /// A completions `prompt`: texts or token ids.
    Completion(Option<&'a Value>),
    /// A chat.
    Chat(ChatPrompt<'a>),
}

/// A chat to render: the typed request, its JSON (what a tenant's
/// `render-prompt` plugin renders: the body as the client sent it, or the
/// chat a Responses request is served as), and what the endpoint calls
/// its output-format field and its prompt in errors.
pub(crate) struct ChatPrompt<'a> {
    pub request: &'a ChatCompletionRequest,
    pub json: &'a Value,
    pub format_field: &'a str,
    pub size_param: &'a str,
}

/// A request made ready to submit.
pub(crate) struct Prepared {
    pub common: CommonParams,
    pub prompts: Vec<RunPrompt>,
    /// How a chat's output becomes tool calls, when it offers tools.
    pub tools: Option<ToolMode>,
}

/// Finds the request's engine and turns its prompt into token ids: a
/// completions prompt tokenized (or taken as the ids it is), a chat's
/// messages and tools rendered by the model's template or the tenant's
/// plugin (see [`chat_prompt`]). With `echo`, each prompt carries the text
/// its choices start with.
pub(crate) async fn prepare(
    state: &AppState,
    mut common: CommonParams,
    prompt: PromptRequest<'_>,
    ctx: &mut Option<TenantCtx>,
    endpoint: &str,
) -> Result<Prepared, ApiError> {
    let engine = generation_engine(state, &common.model, ctx.as_ref(), endpoint)?;
    match prompt {
        PromptRequest::Completion(prompt) => {
            let prompts = completion_prompts(state, engine, prompt, common.echo).await?;
            Ok(Prepared {
                common,
                prompts,
                tools: None,
            })
        }
        PromptRequest::Chat(chat) => {
            let (ids, tools) = chat_prompt(
                state,
                engine,
                chat.request,
                chat.json,
                &mut common,
                ctx,
                chat.format_field,
                chat.size_param,
            )
            .await?;
            // vLLM's `echo` on chat: the answer starts with the final
            // message when that is the assistant's own (a prefill, most
            // often continued with `continue_final_message`).
            let echo = if common.echo {
                parse_messages(chat.request.chat.messages.as_ref())?
                    .pop()
                    .filter(|m| m.role == "assistant" && !m.content.is_empty())
                    .map(|m| m.content)
            } else {
                None
            };
            Ok(Prepared {
                common,
                prompts: vec![RunPrompt { ids, echo }],
                tools,
            })
        }
    }
}

/// A completions request's prompts as token ids, each size-checked before
/// it is tokenized (off the HTTP threads).
async fn completion_prompts(
    state: &AppState,
    engine: &AsyncEngine,
    prompt: Option<&Value>,
    echo: bool,
) -> Result<Vec<RunPrompt>, ApiError> {
    let prompts = parse_prompts(prompt)?;
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
    off_runtime(move || {
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
    .await
}
