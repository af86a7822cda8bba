//! The request [`Plugin::route`](crate::Plugin::route) receives.

use crate::set_key;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The chat endpoint's path.
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
/// The (legacy) completions endpoint's path.
pub const COMPLETIONS: &str = "/v1/completions";

/// The body fields that ask for structured output: OpenAI's, vLLM's, and
/// the `guided_*` ones older clients send. The host accepts only one.
pub const STRUCTURED_OUTPUT_FIELDS: &[&str] = &[
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
];

/// The request `route` sees: the endpoint and the client's OpenAI request
/// body as parsed. The body is kept as JSON (rather than a typed struct) so
/// that fields this SDK does not know about survive a
/// [`RouteDecision::modify`](crate::RouteDecision::modify) unchanged; the
/// accessors cover the fields plugins usually look at.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// `"/v1/chat/completions"` or `"/v1/completions"`.
    pub endpoint: String,
    /// The OpenAI request body.
    pub body: Value,
}

impl RouteRequest {
    /// A request for `endpoint` with `body`.
    pub fn new(endpoint: impl Into<String>, body: Value) -> RouteRequest {
        RouteRequest {
            endpoint: endpoint.into(),
            body,
        }
    }

    /// Parses the JSON text the host passes to `route`.
    pub fn from_json(text: &str) -> crate::Result<RouteRequest> {
        crate::parse_json(text, "route request")
    }

    /// Whether this is a chat request (`/v1/chat/completions`).
    pub fn is_chat(&self) -> bool {
        self.endpoint == CHAT_COMPLETIONS
    }

    /// A field of the body.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.body.get(key)
    }

    /// Sets a field of the body.
    pub fn set(&mut self, key: &str, value: impl Into<Value>) {
        set_key(&mut self.body, key, value.into());
    }

    /// Removes a field of the body, returning it.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        self.body.as_object_mut()?.remove(key)
    }

    /// The requested model.
    pub fn model(&self) -> Option<&str> {
        self.get("model")?.as_str()
    }

    /// Sets the model.
    pub fn set_model(&mut self, model: impl Into<String>) {
        self.set("model", model.into());
    }

    /// Runs the request with the tenant's LoRA adapter `name`: one
    /// uploaded for this tenant (`PUT /admin/v1/tenants/ID/adapters/NAME`)
    /// or one the server shares with it (`--lora-modules`). A request
    /// names its adapter in `model`, as vLLM's API does, so this sets
    /// `model`; the host resolves the name among this tenant's adapters
    /// only, so a plugin can never reach another tenant's (an adapter the
    /// tenant does not have fails the request with 404 `model_not_found`).
    /// A name the host could never store (1 to 64 of `A-Z a-z 0-9 _ - .`,
    /// not starting with `.`) is refused here, and the request is left
    /// unchanged.
    pub fn set_adapter(&mut self, name: &str) -> crate::Result<()> {
        let valid = !name.is_empty()
            && name.len() <= 64
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if !valid {
            return Err(crate::Error::msg(format!(
                "'{name}' is not an adapter name (1-64 of A-Z a-z 0-9 _ - ., not starting with '.')"
            )));
        }
        self.set_model(name);
        Ok(())
    }

    /// `max_tokens`, if given as a non-negative integer.
    pub fn max_tokens(&self) -> Option<u64> {
        self.get("max_tokens")?.as_u64()
    }

    /// Sets `max_tokens`.
    pub fn set_max_tokens(&mut self, n: u64) {
        self.set("max_tokens", n);
    }

    /// `max_completion_tokens` (the chat API's newer name for `max_tokens`),
    /// if given as a non-negative integer.
    pub fn max_completion_tokens(&self) -> Option<u64> {
        self.get("max_completion_tokens")?.as_u64()
    }

    /// Sets `max_completion_tokens`.
    pub fn set_max_completion_tokens(&mut self, n: u64) {
        self.set("max_completion_tokens", n);
    }

    /// `temperature`, if given as a number.
    pub fn temperature(&self) -> Option<f64> {
        self.get("temperature")?.as_f64()
    }

    /// Sets `temperature`.
    pub fn set_temperature(&mut self, t: f64) {
        self.set("temperature", t);
    }

    /// Whether the client asked for a streamed response.
    pub fn stream(&self) -> bool {
        self.get("stream").and_then(Value::as_bool).unwrap_or(false)
    }

    /// The chat request's messages (`None` for completions requests).
    pub fn messages(&self) -> Option<&Vec<Value>> {
        self.get("messages")?.as_array()
    }

    /// The chat request's messages, mutable.
    pub fn messages_mut(&mut self) -> Option<&mut Vec<Value>> {
        self.body.get_mut("messages")?.as_array_mut()
    }

    /// The structured output the client asked for, as `(field, value)`
    /// (see [`STRUCTURED_OUTPUT_FIELDS`]); `response_format` of type `text`
    /// asks for none.
    pub fn structured_output(&self) -> Option<(&'static str, &Value)> {
        STRUCTURED_OUTPUT_FIELDS.iter().find_map(|&k| {
            let v = self.get(k).filter(|v| !v.is_null())?;
            let plain_text =
                k == "response_format" && v.get("type").and_then(Value::as_str) == Some("text");
            (!plain_text).then_some((k, v))
        })
    }

    /// Replaces whatever structured output the client asked for with
    /// `constraint`, a vLLM `structured_outputs` object such as
    /// `{"json": schema}`, `{"regex": "..."}`, `{"choice": [...]}` or
    /// `{"grammar": "..."}` (Lark). The engine then enforces it token by
    /// token, so the tenant's clients get output of that shape whatever
    /// they sent. The host checks it like a client's: a constraint that
    /// does not compile fails the request with a 400.
    pub fn force_structured_output(&mut self, constraint: Value) {
        for k in STRUCTURED_OUTPUT_FIELDS {
            self.remove(k);
        }
        self.set("structured_outputs", constraint);
    }

    /// Every piece of prompt text the client sent: each message's `content`
    /// (a string, or the `text` of its parts) for chat, each prompt string
    /// for completions. For checks such as blocked words.
    pub fn prompt_texts(&self) -> Vec<&str> {
        let mut out = Vec::new();
        if let Some(messages) = self.messages() {
            for m in messages {
                collect_text(m.get("content"), &mut out);
            }
        }
        collect_text(self.get("prompt"), &mut out);
        out
    }
}

/// Pushes the strings in a `content`/`prompt` value: a string, a list of
/// strings, or a list of content parts with `text`.
fn collect_text<'a>(v: Option<&'a Value>, out: &mut Vec<&'a str>) {
    match v {
        Some(Value::String(s)) => out.push(s),
        Some(Value::Array(items)) => {
            for item in items {
                match item {
                    Value::String(s) => out.push(s),
                    Value::Object(part) => {
                        if let Some(Value::String(s)) = part.get("text") {
                            out.push(s);
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accessors() {
        let mut r = RouteRequest::from_json(
            r#"{"endpoint":"/v1/chat/completions","body":{"model":"fast","max_tokens":900,
                "temperature":1.5,"stream":true,"messages":[
                {"role":"system","content":"sys"},
                {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url"}]}]}}"#,
        )
        .unwrap();
        assert!(r.is_chat());
        assert!(r.stream());
        assert_eq!(r.model(), Some("fast"));
        assert_eq!(r.max_tokens(), Some(900));
        assert_eq!(r.max_completion_tokens(), None);
        assert_eq!(r.temperature(), Some(1.5));
        assert_eq!(r.prompt_texts(), vec!["sys", "hi"]);
        r.set_model("smol");
        r.set_max_tokens(10);
        r.set_temperature(1.0);
        assert_eq!(r.body["model"], "smol");
        assert_eq!(r.body["max_tokens"], 10);
        assert_eq!(r.body["temperature"], 1.0);
        assert_eq!(r.messages().unwrap().len(), 2);
    }

    #[test]
    fn structured_output_is_found_and_forced() {
        let mut r = RouteRequest::new(
            CHAT_COMPLETIONS,
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a+"}),
        );
        assert_eq!(
            r.structured_output().map(|(k, _)| k),
            Some("response_format")
        );
        r.force_structured_output(json!({"choice": ["yes", "no"]}));
        assert_eq!(
            r.structured_output(),
            Some(("structured_outputs", &json!({"choice": ["yes", "no"]})))
        );
        assert_eq!(r.get("response_format"), None);
        assert_eq!(r.get("guided_regex"), None);
        let text = RouteRequest::new(
            CHAT_COMPLETIONS,
            json!({"response_format": {"type": "text"}}),
        );
        assert_eq!(text.structured_output(), None);
    }

    #[test]
    fn set_adapter_names_the_adapter_as_the_model_and_refuses_bad_names() {
        let mut r = RouteRequest::new(CHAT_COMPLETIONS, json!({"model": "smol", "max_tokens": 4}));
        r.set_adapter("support-v2.1").unwrap();
        assert_eq!(r.model(), Some("support-v2.1"));
        assert_eq!(r.body["max_tokens"], 4);
        let long = "x".repeat(65);
        for bad in ["", ".hidden", "a/b", "../etc", "sp ace", long.as_str()] {
            let e = r.set_adapter(bad).expect_err(bad);
            assert!(
                e.message().contains("not an adapter name"),
                "{bad}: {}",
                e.message()
            );
            assert_eq!(r.model(), Some("support-v2.1"), "{bad} changed the request");
        }
    }

    #[test]
    fn completions_prompts() {
        let r = RouteRequest::new(COMPLETIONS, json!({"prompt": ["a", "b"]}));
        assert!(!r.is_chat());
        assert_eq!(r.prompt_texts(), vec!["a", "b"]);
        let r = RouteRequest::new(COMPLETIONS, json!({"prompt": "c"}));
        assert_eq!(r.prompt_texts(), vec!["c"]);
    }
}
