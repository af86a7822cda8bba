//! A `/v1/chat/completions` request: the sampling fields every generation
//! endpoint shares ([`crate::server::openai::protocol`]) and the chat's
//! own, its `messages` above all. Responses and Anthropic's Messages
//! requests are served as this request.

use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use crate::server::openai::protocol::{
    parse_common, CommonParams, EndpointSampling, SamplingRequest,
};
use crate::server::openai::structured;
use crate::server::openai::tool_parsers::ToolCallParser;
use crate::server::openai::tools::{self, ToolRequest};
use crate::server::openai::wire::{from_body, Count, LogprobCount};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A chat completion request, typed.
#[derive(Debug, Clone)]
pub struct ChatCompletionRequest {
    pub sampling: SamplingRequest,
    pub chat: ChatFields,
}

/// What a chat request adds to the shared sampling fields: its
/// conversation and how the template renders it.
#[derive(Deserialize, Serialize, Debug, Clone, Default)]
pub struct ChatFields {
    /// As written: [`parse_messages`] checks each message's role and text,
    /// and the template also reads the fields tool use adds (`tool_calls`,
    /// `tool_call_id`, `name`, `reasoning`).
    pub messages: Option<Value>,
    /// `max_tokens`' newer name; it wins where both are given.
    pub max_completion_tokens: Option<Count>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<LogprobCount>,
    /// Whether the template opens the assistant's turn (default true).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the prompt ends inside the final (assistant's) message.
    pub continue_final_message: Option<bool>,
    /// `low`, `medium` or `high`, which gpt-oss's template reads.
    pub reasoning_effort: Option<String>,
    /// vLLM's: more template variables (`{"enable_thinking": false}`);
    /// must be an object where the host's template renders the prompt.
    pub chat_template_kwargs: Option<Value>,
    /// The functions offered, as written ([`ChatFields::tools`] checks
    /// them; templates render the list as sent).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

impl ChatFields {
    /// The request's tools, validated; `auto_parser` is the server's
    /// `--tool-call-parser` under `--enable-auto-tool-choice`.
    pub fn tools(
        &self,
        auto_parser: Option<ToolCallParser>,
    ) -> Result<Option<ToolRequest>, ApiError> {
        tools::parse_fields(
            self.tools.as_ref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
            auto_parser,
        )
    }
}

impl ChatCompletionRequest {
    /// Reads a chat body; a field of the wrong type is a 400 naming it.
    pub fn from_body(body: &Value) -> Result<Self, ApiError> {
        Ok(ChatCompletionRequest {
            sampling: from_body(body)?,
            chat: from_body(body)?,
        })
    }

    /// The request's sampling as the engine takes it, with the output
    /// format the body's structured-output fields ask for.
    pub fn common(
        &self,
        body: &Value,
        default_model: Option<&str>,
    ) -> Result<CommonParams, ApiError> {
        let structured = structured::parse(&Fields::of(body)?)?;
        parse_common(
            &self.sampling,
            self.endpoint_sampling(),
            structured,
            default_model,
        )
    }

    /// How a chat reads its token budget and logprobs.
    pub fn endpoint_sampling(&self) -> EndpointSampling {
        EndpointSampling::Chat {
            logprobs: self.chat.logprobs,
            top_logprobs: self.chat.top_logprobs,
            max_completion_tokens: self.chat.max_completion_tokens,
        }
    }

    /// The request as a chat body (the fields it sets), for what reads
    /// chats as JSON: a tenant's `render-prompt` plugin.
    pub fn to_json(&self) -> Value {
        let mut out = serde_json::Map::new();
        for part in [
            serde_json::to_value(&self.sampling),
            serde_json::to_value(&self.chat),
        ] {
            if let Ok(Value::Object(m)) = part {
                out.extend(m.into_iter().filter(|(_, v)| !v.is_null()));
            }
        }
        Value::Object(out)
    }
}

/// The chat roles OpenAI and the chat templates of the served model
/// families know (`ipython` is Llama 3's tool-result role).
const KNOWN_ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "ipython",
];

/// One chat message as the template sees it.
pub fn parse_messages(
    messages: Option<&Value>,
) -> Result<Vec<crate::tokenizer::chat_template::ChatMessage>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages".into()), m);
    let list = match messages.filter(|v| !v.is_null()) {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(bad("'messages' must not be empty".into())),
        Some(_) => return Err(bad("'messages' must be a list of messages".into())),
        None => return Err(bad("'messages' is required".into())),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("messages[{i}].role must be a string")))?;
        // An unknown role would be rendered into the prompt as written, so
        // a client could open turns the template never meant to have.
        if !KNOWN_ROLES.contains(&role) {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].role")),
                format!(
                    "messages[{i}].role '{role}' is not one of {}",
                    KNOWN_ROLES.join(", ")
                ),
            ));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content[{j}] must be a text part"
                            )))
                        }
                    }
                }
                s
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )))
            }
        };
        out.push(crate::tokenizer::chat_template::ChatMessage {
            role: role.to_string(),
            content,
        });
    }
    Ok(out)
}
