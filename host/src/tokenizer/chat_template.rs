//! Hugging Face–compatible chat templates, rendered with minijinja.
//!
//! The environment (HF's Jinja2 setup: `trim_blocks`/`lstrip_blocks`, Python
//! string/dict methods, `raise_exception`, `strftime_now`, HF's `tojson`) is
//! [`pagoda_chat_template`]'s, shared with the built-in `chat-template`
//! plugin so that both render a template alike. [`ChatTemplate`] compiles a
//! model's template once in it and renders conversations into prompts.

use anyhow::{anyhow, Result};
use minijinja::value::Value;
use minijinja::Environment;
pub use pagoda_chat_template::json_to_value;
use pagoda_chat_template::{ordered_map, Clock, RenderError};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// The name the template is stored under inside its environment.
const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template together with the BOS/EOS token texts it may
/// refer to as `bos_token` and `eos_token`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A message as the template sees it: a dict with `role`, then `content`.
fn message_value(m: &ChatMessage) -> Value {
    ordered_map([
        ("role", Value::from(m.role.as_str())),
        ("content", Value::from(m.content.as_str())),
    ])
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template as found in
    /// `tokenizer.chat_template` / `tokenizer_config.json`). `bos_token` and
    /// `eos_token` are exposed to the template under those names (empty
    /// strings when absent). A syntax error is reported here, not at render.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let mut env = pagoda_chat_template::environment(Clock::System);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| anyhow!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends
    /// the header of an assistant turn. An error raised by the template with
    /// `raise_exception(msg)` is `msg`, verbatim; other errors start with
    /// "chat template: ".
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let msgs = Value::from(messages.iter().map(message_value).collect::<Vec<_>>());
        self.render_values(msgs, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`render`](Self::render), for messages given as JSON (so they may
    /// carry extra fields such as `tool_calls` or a list-valued `content`),
    /// with `extra` variables (e.g. `tools`, `enable_thinking`) added to the
    /// template's context.
    pub fn render_json(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(anyhow!("chat template: messages must be a JSON array"));
        }
        self.render_values(json_to_value(messages), add_generation_prompt, extra)
    }

    fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {e}"))?;
        // The template's own variables come last, so that they win over
        // `extra` entries of the same name (`ordered_map` keeps the last).
        let own = [
            ("messages", messages),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ];
        let ctx = extra
            .iter()
            .map(|(k, v)| (k.as_str(), json_to_value(v)))
            .chain(own);
        pagoda_chat_template::render(&tmpl, ordered_map(ctx)).map_err(|e| match e {
            RenderError::Raised(message) => anyhow!(message),
            e => anyhow!("chat template: {e}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn render_json_with_extra_variables() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ tools | tojson }}|{{ enable_thinking }}|{% for m in messages %}{{ m.role }}:{{ m.content }}{{ m.tool_calls | length }}{% endfor %}|{{ add_generation_prompt }}{{ eos_token }}",
            Some("<s>"),
            Some("</s>"),
        )
        .expect("compile");
        let mut extra = serde_json::Map::new();
        extra.insert("tools".into(), serde_json::json!([{"name": "f", "x": 1.0}]));
        extra.insert("enable_thinking".into(), serde_json::json!(false));
        // The template's own variables are not the caller's to override.
        extra.insert("bos_token".into(), serde_json::json!("BOS?"));
        extra.insert("messages".into(), serde_json::json!("no"));
        let messages =
            serde_json::json!([{"role": "assistant", "content": "c", "tool_calls": [{}, {}]}]);
        let out = t.render_json(&messages, true, &extra).expect("render");
        assert_eq!(
            out,
            "<s>[{\"name\": \"f\", \"x\": 1.0}]|False|assistant:c2|True</s>"
        );
        assert!(t.render_json(&serde_json::json!({}), true, &extra).is_err());
    }

    #[test]
    fn messages_keep_field_order() {
        let t = ChatTemplate::new("{{ messages[0] | tojson }}", None, None).expect("compile");
        let out = t.render(&msgs(&[("user", "hi")]), false).expect("render");
        assert_eq!(out, "{\"role\": \"user\", \"content\": \"hi\"}");
    }

    #[test]
    fn raise_exception_carries_message() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            None,
            None,
        )
        .expect("compile");
        let err = t
            .render(&msgs(&[("assistant", "x")]), false)
            .expect_err("must fail");
        assert_eq!(err.to_string(), "Conversation must start with user");
        assert_eq!(t.render(&msgs(&[("user", "x")]), false).expect("ok"), "ok");
    }

    #[test]
    fn syntax_error_at_compile_time() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
