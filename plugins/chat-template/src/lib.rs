//! Built-in plugin `chat-template` (hook: `render-prompt`).
//!
//! Renders a chat request's `messages` into the prompt with a Jinja chat
//! template, set up as Hugging Face's `apply_chat_template` does: the
//! environment of [`pagoda_chat_template`], shared with the host, without a
//! clock (a plugin has none, so `strftime_now` is undefined; templates that
//! use it test `strftime_now is defined` and fall back to a fixed date, and
//! clients can pass `date_string` through `chat_template_kwargs`). Config
//! (every field optional):
//!
//! ```json
//! {"template": "{% for m in messages %}...{% endfor %}",
//!  "system_prompt": "You are ...", "bos_token": "<s>", "eos_token": "</s>"}
//! ```
//!
//! - `template`: used instead of the model's own template; without it the
//!   model's template (passed by the host) is used.
//! - `system_prompt`: replaces the content of a leading `system` message,
//!   or is inserted as one when the conversation has none.
//! - `bos_token` / `eos_token`: the values of those template variables
//!   (default "").
//!
//! The template sees `messages`, `add_generation_prompt` (the request's
//! `add_generation_prompt` if given, else true), `bos_token`, `eos_token`,
//! the request's `tools` and `documents` if given, and the entries of the
//! request's `chat_template_kwargs` object (vLLM's extension, e.g.
//! `enable_thinking`).
//!
//! Errors are messages for the client; a template's
//! `raise_exception(msg)` is `msg`, verbatim.

use pagoda_chat_template::{json_to_value, ordered_map, Clock, RenderError};
use pagoda_sdk::serde_json::{Map, Value};
use pagoda_sdk::{host, json, metadata, Error, Hook, Metadata, Plugin, Result};
use serde::Deserialize;

/// The plugin's config; see the crate docs.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// A template to use instead of the model's.
    pub template: Option<String>,
    /// A system prompt to put in place of the conversation's.
    pub system_prompt: Option<String>,
    /// The value of `bos_token`.
    pub bos_token: Option<String>,
    /// The value of `eos_token`.
    pub eos_token: Option<String>,
}

/// The JSON Schema of [`Config`].
pub fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "template": {"type": "string", "minLength": 1, "maxLength": 262144},
            "system_prompt": {"type": "string", "maxLength": 65536},
            "bos_token": {"type": "string", "maxLength": 256},
            "eos_token": {"type": "string", "maxLength": 256}
        },
        "additionalProperties": false
    })
}

/// Renders `request` (a chat request body) under `config`, with the
/// model's `model_template` if the config has none.
pub fn render(config: &Config, request: &Value, model_template: Option<&str>) -> Result<String> {
    let source = config
        .template
        .as_deref()
        .or(model_template)
        .ok_or_else(|| {
            Error::msg(
                "no chat template: the model has none and the plugin config sets no \"template\"",
            )
        })?;
    let mut messages = match request.get("messages") {
        Some(Value::Array(m)) => m.clone(),
        _ => return Err(Error::msg("the request has no \"messages\" list")),
    };
    if let Some(prompt) = &config.system_prompt {
        set_system_prompt(&mut messages, prompt);
    }

    let mut vars = Map::new();
    for key in ["tools", "documents"] {
        if let Some(v) = request.get(key).filter(|v| !v.is_null()) {
            vars.insert(key.to_owned(), v.clone());
        }
    }
    if let Some(Value::Object(kwargs)) = request.get("chat_template_kwargs") {
        vars.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    // These are the plugin's to set; the client's kwargs do not override them.
    let add_generation_prompt = request
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    vars.insert("messages".into(), Value::Array(messages));
    vars.insert(
        "add_generation_prompt".into(),
        Value::Bool(add_generation_prompt),
    );
    vars.insert(
        "bos_token".into(),
        json!(config.bos_token.as_deref().unwrap_or("")),
    );
    vars.insert(
        "eos_token".into(),
        json!(config.eos_token.as_deref().unwrap_or("")),
    );

    render_template(source, &vars).map_err(Error::msg)
}

/// Renders template `source` with the variables `vars`. A
/// `raise_exception(msg)` fails with `msg` as the whole message; other
/// errors say whether the template did not compile or failed to render.
fn render_template(source: &str, vars: &Map<String, Value>) -> std::result::Result<String, String> {
    let env = pagoda_chat_template::environment(Clock::None);
    let template = env
        .template_from_str(source)
        .map_err(|e| format!("chat template does not compile: {e}"))?;
    let ctx = ordered_map(vars.iter().map(|(k, v)| (k.as_str(), json_to_value(v))));
    pagoda_chat_template::render(&template, ctx).map_err(|e| match e {
        RenderError::Raised(message) => message,
        e => format!("chat template error: {e}"),
    })
}

/// Replaces the content of a leading system message with `prompt`, or
/// inserts a system message with it.
fn set_system_prompt(messages: &mut Vec<Value>, prompt: &str) {
    match messages.first_mut() {
        Some(Value::Object(first))
            if first.get("role").and_then(Value::as_str) == Some("system") =>
        {
            first.insert("content".into(), json!(prompt));
        }
        _ => messages.insert(0, json!({"role": "system", "content": prompt})),
    }
}

/// The plugin.
#[derive(Default)]
pub struct ChatTemplate;

impl Plugin for ChatTemplate {
    fn metadata() -> Metadata {
        metadata!()
            .hooks([Hook::RenderPrompt])
            .config_schema(schema())
    }

    fn render_prompt(
        &mut self,
        request: Value,
        template: Option<String>,
    ) -> Result<Option<String>> {
        let config: Config = host::config()?;
        render(&config, &request, template.as_deref()).map(Some)
    }
}

pagoda_sdk::export_plugin!(ChatTemplate);

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_sdk::testing;

    /// SmolLM2's template (ChatML with a default system prompt).
    const SMOL: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn config(v: Value) -> Config {
        pagoda_sdk::serde_json::from_value(v).expect("config")
    }

    #[test]
    fn model_template() {
        let req = json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}]});
        assert_eq!(
            render(&Config::default(), &req, Some(SMOL)).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let req = json!({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false});
        assert!(!render(&Config::default(), &req, Some(SMOL))
            .unwrap()
            .ends_with("assistant\n"));
    }

    #[test]
    fn system_prompt_inserted_and_replaced() {
        let c = config(json!({"system_prompt": "Be brief."}));
        let req = json!({"messages": [{"role": "user", "content": "Hi"}]});
        let out = render(&c, &req, Some(SMOL)).unwrap();
        assert!(
            out.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"),
            "{out}"
        );
        let req = json!({"messages": [{"role": "system", "content": "Be long."}, {"role": "user", "content": "Hi"}]});
        let out = render(&c, &req, Some(SMOL)).unwrap();
        assert!(
            out.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user"),
            "{out}"
        );
        assert!(!out.contains("Be long."));
    }

    #[test]
    fn config_template_and_tokens() {
        let c = config(json!({
            "template": "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[INST] {{ m.content | trim }} [/INST]\n  {% else %}\n{{ m.content }}{{ eos_token }}\n  {% endif %}\n{% endfor %}",
            "bos_token": "<s>", "eos_token": "</s>"
        }));
        let req = json!({"messages": [
            {"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}
        ]});
        // trim_blocks + lstrip_blocks: block tags leave no whitespace behind.
        assert_eq!(
            render(&c, &req, Some(SMOL)).unwrap(),
            "<s>[INST] a [/INST]\nb</s>\n[INST] c [/INST]\n"
        );
    }

    #[test]
    fn raise_exception_message_is_the_error() {
        let c = config(
            json!({"template": "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"}),
        );
        let err = render(
            &c,
            &json!({"messages": [{"role": "assistant", "content": "x"}]}),
            None,
        )
        .unwrap_err();
        assert_eq!(err.message(), "Conversation must start with user");
        assert_eq!(
            render(
                &c,
                &json!({"messages": [{"role": "user", "content": "x"}]}),
                None
            )
            .unwrap(),
            "ok"
        );
    }

    #[test]
    fn tools_kwargs_and_tojson() {
        let c = config(
            json!({"template": "{{ tools | tojson }}|{{ enable_thinking }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0].content.strip().upper() }}"}),
        );
        let req = json!({
            "messages": [{"role": "user", "content": " hé \"q\" "}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2.5}}}],
            "chat_template_kwargs": {"enable_thinking": false}
        });
        assert_eq!(
            render(&c, &req, None).unwrap(),
            "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"b\": 1, \"a\": 2.5}}}]|False|{\n  \"role\": \"user\",\n  \"content\": \" hé \\\"q\\\" \"\n}|HÉ \"Q\""
        );
    }

    #[test]
    fn errors() {
        let req = json!({"messages": []});
        assert!(render(&Config::default(), &req, None)
            .unwrap_err()
            .message()
            .contains("no chat template"));
        assert!(render(&Config::default(), &json!({}), Some(SMOL))
            .unwrap_err()
            .message()
            .contains("messages"));
        let c = config(json!({"template": "{% for %}"}));
        let err = render(&c, &req, None).unwrap_err();
        assert!(
            err.message().starts_with("chat template does not compile"),
            "{}",
            err.message()
        );
        let c = config(json!({"template": "{{ 1 + 'a' }}"}));
        let err = render(&c, &req, None).unwrap_err();
        assert!(
            err.message().starts_with("chat template error"),
            "{}",
            err.message()
        );
        // No clock in a plugin.
        let c = config(
            json!({"template": "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}{{ date_string }}{% endif %}"}),
        );
        let req = json!({"messages": [], "chat_template_kwargs": {"date_string": "26 Jul 2024"}});
        assert_eq!(render(&c, &req, None).unwrap(), "26 Jul 2024");
    }

    #[test]
    fn hook_uses_host_config() {
        testing::reset();
        testing::set_config(json!({"template": "{{ messages | length }}"}));
        let out = ChatTemplate
            .render_prompt(json!({"messages": [1, 2, 3]}), Some(SMOL.into()))
            .unwrap();
        assert_eq!(out.as_deref(), Some("3"));
    }
}
