//! What `/v1/chat/completions` takes beyond the shared sampling fields
//! ([`crate::server::openai::protocol`]): its `messages`.

use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use serde_json::Value;

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
    f: &Fields<'_>,
) -> Result<Vec<crate::tokenizer::chat_template::ChatMessage>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages".into()), m);
    let list = match f.get("messages") {
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
