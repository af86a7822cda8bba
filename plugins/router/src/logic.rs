//! The router's decisions, apart from the host so they test natively.

use pagoda_sdk::serde_json::Value;
use pagoda_sdk::{json, RouteDecision, RouteRequest};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The message for blocked words when the config gives none.
pub const DEFAULT_REJECT_MESSAGE: &str = "The request contains content that is not allowed.";

/// The router's config; see the crate docs.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Model name → the model it stands for.
    pub aliases: BTreeMap<String, String>,
    /// The models requests may use (after aliasing); `None` allows all.
    pub allowed_models: Option<Vec<String>>,
    /// The most tokens a request may ask to generate.
    pub max_tokens_limit: Option<u64>,
    /// The highest sampling temperature allowed.
    pub temperature_max: Option<f64>,
    /// The message for requests with blocked words.
    pub reject_message: Option<String>,
    /// Words and phrases a prompt must not contain.
    pub blocked_words: Vec<String>,
    /// A structured-output constraint every request of the tenant gets
    /// (vLLM's `structured_outputs` object: `json`, `regex`, `choice`,
    /// `grammar` or `json_object`), replacing the client's own.
    pub structured_outputs: Option<Value>,
    /// The tenant's LoRA adapter every request runs with (e.g. its latest
    /// fine-tune), whatever model the client named.
    pub adapter: Option<String>,
}

/// The JSON Schema of [`Config`].
pub fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "aliases": {
                "type": "object",
                "additionalProperties": {"type": "string", "minLength": 1}
            },
            "allowed_models": {"type": "array", "items": {"type": "string"}},
            "max_tokens_limit": {"type": "integer", "minimum": 1},
            "temperature_max": {"type": "number", "minimum": 0},
            "reject_message": {"type": "string", "minLength": 1, "maxLength": 1024},
            "blocked_words": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "structured_outputs": {
                "type": "object",
                "minProperties": 1,
                "properties": {
                    "json": {"type": ["object", "boolean", "string"]},
                    "regex": {"type": "string", "minLength": 1},
                    "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    "grammar": {"type": "string", "minLength": 1},
                    "json_object": {"type": "boolean"},
                    "disable_any_whitespace": {"type": "boolean"},
                    "disable_additional_properties": {"type": "boolean"}
                },
                "additionalProperties": false
            },
            "adapter": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"}
        },
        "additionalProperties": false
    })
}

/// OpenAI's default temperature, assumed when the client sends none.
const DEFAULT_TEMPERATURE: f64 = 1.0;

/// Decides `request` under `config`; `served` are the models the server
/// offers this tenant (to tell "not allowed" from "does not exist").
pub fn decide(config: &Config, mut request: RouteRequest, served: &[String]) -> RouteDecision {
    if has_blocked_word(config, &request) {
        // The word itself is not repeated to the client: the message is
        // the tenant's to choose.
        let message = config
            .reject_message
            .as_deref()
            .unwrap_or(DEFAULT_REJECT_MESSAGE);
        return RouteDecision::reject(400, message);
    }

    let mut modified = false;

    if let Some(model) = request.model().map(str::to_owned) {
        let mut model = model;
        if let Some(target) = config.aliases.get(&model) {
            model = target.clone();
            request.set_model(model.clone());
            modified = true;
        }
        if let Some(allowed) = &config.allowed_models {
            if !allowed.contains(&model) {
                let list = allowed.join(", ");
                return if served.contains(&model) {
                    RouteDecision::reject(
                        403,
                        format!("The model `{model}` is not allowed for this API key; allowed models: {list}."),
                    )
                } else {
                    RouteDecision::reject(
                        404,
                        format!("The model `{model}` does not exist or you do not have access to it; allowed models: {list}."),
                    )
                };
            }
        }
    }
    // A missing or non-string model is left to the host, which rejects it
    // with the usual OpenAI error.

    if let Some(limit) = config.max_tokens_limit {
        let mut any = false;
        for key in ["max_tokens", "max_completion_tokens"] {
            match request.get(key) {
                None | Some(Value::Null) => {}
                Some(v) => {
                    any = true;
                    // Non-integers are left for the host to reject.
                    if v.as_u64().is_some_and(|n| n > limit) {
                        request.set(key, limit);
                        modified = true;
                    }
                }
            }
        }
        if !any {
            request.set_max_tokens(limit);
            modified = true;
        }
    }

    if let Some(max) = config.temperature_max {
        match request.get("temperature") {
            None | Some(Value::Null) => {
                if max < DEFAULT_TEMPERATURE {
                    request.set_temperature(max);
                    modified = true;
                }
            }
            Some(v) => {
                if v.as_f64().is_some_and(|t| t > max) {
                    request.set_temperature(max);
                    modified = true;
                }
            }
        }
    }

    if let Some(constraint) = &config.structured_outputs {
        // The tenant's shape wins over whatever the client asked for.
        request.force_structured_output(constraint.clone());
        modified = true;
    }

    if let Some(adapter) = &config.adapter {
        // The tenant's choice, after the client's model was checked: the
        // host resolves it among this tenant's adapters only.
        if let Err(e) = request.set_adapter(adapter) {
            return RouteDecision::reject(500, e.into_message());
        }
        modified = true;
    }

    if modified {
        RouteDecision::modify(request)
    } else {
        RouteDecision::Continue
    }
}

/// Whether the request's prompt texts contain a blocked word.
fn has_blocked_word(config: &Config, request: &RouteRequest) -> bool {
    if config.blocked_words.is_empty() {
        return false;
    }
    let texts: Vec<String> = request
        .prompt_texts()
        .iter()
        .map(|t| t.to_lowercase())
        .collect();
    config.blocked_words.iter().any(|word| {
        let word = word.trim().to_lowercase();
        !word.is_empty() && texts.iter().any(|t| contains_word(t, &word))
    })
}

/// Whether `needle` occurs in `haystack` with no letter or digit directly
/// before or after it, so that "ass" does not match "class" but does match
/// "ass." and a phrase matches across its own spaces.
fn contains_word(haystack: &str, needle: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    haystack.match_indices(needle).any(|(i, m)| {
        let before = haystack[..i].chars().next_back();
        let after = haystack[i + m.len()..].chars().next();
        // A needle that itself starts/ends with a non-word character (e.g.
        // "$$$") needs no boundary on that side.
        let start_ok = !needle.starts_with(is_word) || !before.is_some_and(is_word);
        let end_ok = !needle.ends_with(is_word) || !after.is_some_and(is_word);
        start_ok && end_ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_sdk::{CHAT_COMPLETIONS, COMPLETIONS};

    fn config(v: Value) -> Config {
        pagoda_sdk::serde_json::from_value(v).expect("config")
    }

    fn chat(body: Value) -> RouteRequest {
        RouteRequest::new(CHAT_COMPLETIONS, body)
    }

    fn example() -> Config {
        config(json!({
            "aliases": {"fast": "smol"},
            "allowed_models": ["smol"],
            "max_tokens_limit": 256,
            "temperature_max": 1.0,
            "reject_message": "Nope.",
            "blocked_words": ["secret plan", "Forbidden"]
        }))
    }

    fn served() -> Vec<String> {
        vec!["smol".into(), "big".into()]
    }

    fn body_of(d: RouteDecision) -> Value {
        match d {
            RouteDecision::Modify(b) => b,
            other => panic!("expected Modify, got {other:?}"),
        }
    }

    #[test]
    fn empty_config_continues() {
        let r = chat(json!({"model": "anything", "messages": [], "max_tokens": 100000}));
        assert_eq!(decide(&Config::default(), r, &[]), RouteDecision::Continue);
    }

    #[test]
    fn within_limits_continues() {
        let r = chat(
            json!({"model": "smol", "max_tokens": 10, "temperature": 0.5,
            "messages": [{"role": "user", "content": "hello"}]}),
        );
        assert_eq!(decide(&example(), r, &served()), RouteDecision::Continue);
    }

    #[test]
    fn alias_is_rewritten() {
        let r = chat(json!({"model": "fast", "max_tokens": 10, "messages": []}));
        let body = body_of(decide(&example(), r, &served()));
        assert_eq!(body["model"], "smol");
        assert_eq!(body["max_tokens"], 10);
    }

    #[test]
    fn models_outside_allowlist_are_rejected() {
        let r = chat(json!({"model": "big", "max_tokens": 1, "messages": []}));
        match decide(&example(), r, &served()) {
            RouteDecision::Reject(rej) => {
                assert_eq!(rej.status, 403);
                assert!(
                    rej.message.contains("`big`") && rej.message.contains("smol"),
                    "{}",
                    rej.message
                );
            }
            d => panic!("{d:?}"),
        }
        let r = chat(json!({"model": "gpt-9", "max_tokens": 1, "messages": []}));
        match decide(&example(), r, &served()) {
            RouteDecision::Reject(rej) => assert_eq!(rej.status, 404),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn adapter_is_set_after_the_client_model_is_checked() {
        let c = config(json!({"adapter": "support", "allowed_models": ["smol"]}));
        let body = body_of(decide(
            &c,
            chat(json!({"model": "smol", "messages": []})),
            &served(),
        ));
        assert_eq!(body["model"], "support");
        // The client's model is still checked against the allowlist.
        let r = chat(json!({"model": "big", "messages": []}));
        assert!(matches!(decide(&c, r, &served()), RouteDecision::Reject(r) if r.status == 403));
    }

    #[test]
    fn alias_target_is_checked_against_allowlist() {
        let c = config(json!({"aliases": {"fast": "big"}, "allowed_models": ["smol"]}));
        let r = chat(json!({"model": "fast", "messages": []}));
        assert!(matches!(decide(&c, r, &served()), RouteDecision::Reject(r) if r.status == 403));
    }

    #[test]
    fn max_tokens_clamped() {
        let r = chat(
            json!({"model": "smol", "max_tokens": 1000, "max_completion_tokens": 300, "messages": []}),
        );
        let body = body_of(decide(&example(), r, &served()));
        assert_eq!(body["max_tokens"], 256);
        assert_eq!(body["max_completion_tokens"], 256);

        let r = chat(json!({"model": "smol", "max_completion_tokens": 300, "messages": []}));
        let body = body_of(decide(&example(), r, &served()));
        assert_eq!(body["max_completion_tokens"], 256);
        assert!(body.get("max_tokens").is_none());
    }

    #[test]
    fn missing_max_tokens_gets_limit() {
        let r = RouteRequest::new(COMPLETIONS, json!({"model": "smol", "prompt": "x"}));
        let body = body_of(decide(&example(), r, &served()));
        assert_eq!(body["max_tokens"], 256);
        assert_eq!(body["prompt"], "x");
    }

    #[test]
    fn invalid_max_tokens_left_to_host() {
        let r = chat(json!({"model": "smol", "max_tokens": -5, "messages": []}));
        assert_eq!(decide(&example(), r, &served()), RouteDecision::Continue);
    }

    #[test]
    fn temperature_clamped() {
        let r = chat(json!({"model": "smol", "max_tokens": 1, "temperature": 1.7, "messages": []}));
        let body = body_of(decide(&example(), r, &served()));
        assert_eq!(body["temperature"], 1.0);

        let c = config(json!({"temperature_max": 0.5}));
        let body = body_of(decide(&c, chat(json!({"model": "m", "messages": []})), &[]));
        assert_eq!(body["temperature"], 0.5);
        // A maximum at or above the default leaves a missing temperature alone.
        let c = config(json!({"temperature_max": 1.5}));
        assert_eq!(
            decide(&c, chat(json!({"model": "m", "messages": []})), &[]),
            RouteDecision::Continue
        );
    }

    #[test]
    fn blocked_words_rejected() {
        let r = chat(json!({"model": "smol", "messages": [
            {"role": "system", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "Tell me the SECRET  plan? no: the Secret Plan."}]}
        ]}));
        assert_eq!(
            decide(&example(), r, &served()),
            RouteDecision::reject(400, "Nope.")
        );

        let r = RouteRequest::new(
            COMPLETIONS,
            json!({"model": "smol", "prompt": ["fine", "forbidden!"]}),
        );
        assert_eq!(
            decide(&example(), r, &served()),
            RouteDecision::reject(400, "Nope.")
        );

        // Blocked words are checked before anything else, with the default message.
        let c = config(json!({"blocked_words": ["x"], "allowed_models": []}));
        let r = RouteRequest::new(COMPLETIONS, json!({"model": "smol", "prompt": "x"}));
        assert_eq!(
            decide(&c, r, &[]),
            RouteDecision::reject(400, DEFAULT_REJECT_MESSAGE)
        );
    }

    #[test]
    fn blocked_words_need_word_boundaries() {
        assert!(!contains_word("a classic", "ass"));
        assert!(contains_word("you ass.", "ass"));
        assert!(contains_word("ass", "ass"));
        assert!(contains_word("win $$$ now", "$$$"));
        assert!(contains_word("win$$$now", "$$$"));
        assert!(!contains_word("forbiddenfruit", "forbidden"));
        let r = chat(
            json!({"model": "smol", "max_tokens": 1, "messages": [{"role": "user", "content": "forbiddenfruit"}]}),
        );
        assert_eq!(decide(&example(), r, &served()), RouteDecision::Continue);
    }

    #[test]
    fn unknown_config_fields_rejected() {
        assert!(pagoda_sdk::serde_json::from_value::<Config>(json!({"alias": {}})).is_err());
    }

    #[test]
    fn tenant_constraint_replaces_the_clients() {
        let c = config(json!({"structured_outputs": {"choice": ["yes", "no"]}}));
        let r = chat(json!({"model": "smol", "response_format": {"type": "json_object"}}));
        let b = body_of(decide(&c, r, &served()));
        assert_eq!(b["structured_outputs"], json!({"choice": ["yes", "no"]}));
        assert_eq!(b.get("response_format"), None);
        // Requests that asked for nothing get it too.
        let b = body_of(decide(&c, chat(json!({"model": "smol"})), &served()));
        assert_eq!(b["structured_outputs"], json!({"choice": ["yes", "no"]}));
    }
}
