// The starter plugin: puts a system prompt in front of every chat request
// and logs which model was asked for. Copy this crate to begin a plugin.
//
// Config (all optional): {"system_prompt": "..."}; the tenant's config is
// validated against the schema in `metadata` before it reaches us.

use pagoda_sdk::host::{self, LogLevel};
use pagoda_sdk::{json, metadata, Hook, Metadata, Plugin, Result, RouteDecision, RouteRequest};
use serde::Deserialize;

/// The tenant's config. `#[serde(default)]` makes `{}` (no config) valid.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    system_prompt: String,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            system_prompt: "You are a helpful assistant. Answer briefly.".to_owned(),
        }
    }
}

/// The plugin. A fresh value is made for every request (with `Default`), so
/// fields could hold per-request state; this one needs none.
#[derive(Default)]
pub struct Starter;

impl Plugin for Starter {
    fn metadata() -> Metadata {
        // Name and version come from Cargo.toml. The host calls only the
        // hooks listed here, and validates configs against the schema.
        metadata!().hooks([Hook::Route]).config_schema(json!({
            "type": "object",
            "properties": {
                "system_prompt": {"type": "string", "maxLength": 4096}
            },
            "additionalProperties": false
        }))
    }

    fn route(&mut self, mut request: RouteRequest) -> Result<RouteDecision> {
        // `?` turns a config that does not deserialize into an error, which
        // the SDK reports as a 500 rejection.
        let config: Config = host::config()?;
        host::log(
            LogLevel::Info,
            format!(
                "request for model {:?}",
                request.model().unwrap_or("(none)")
            ),
        );

        // Only chat requests have messages; completions go through as is.
        let Some(messages) = request.messages_mut() else {
            return Ok(RouteDecision::Continue);
        };
        match messages.first_mut() {
            // The client sent its own system message: put ours in front.
            Some(first) if first["role"] == "system" && first["content"].is_string() => {
                let theirs = first["content"].as_str().unwrap_or_default();
                first["content"] = json!(format!("{}\n\n{}", config.system_prompt, theirs));
            }
            // Otherwise add ours as the first message.
            _ => messages.insert(
                0,
                json!({"role": "system", "content": config.system_prompt}),
            ),
        }
        // Modify sends the changed body back; the host validates it again.
        Ok(RouteDecision::modify(request))
    }
}

// Generates the component's exports (abi-version, metadata and the hooks).
pagoda_sdk::export_plugin!(Starter);

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_sdk::testing;

    fn chat(messages: pagoda_sdk::serde_json::Value) -> RouteRequest {
        RouteRequest::new(
            pagoda_sdk::CHAT_COMPLETIONS,
            json!({"model": "smol", "messages": messages}),
        )
    }

    #[test]
    fn inserts_system_prompt() {
        testing::reset();
        testing::set_config(json!({"system_prompt": "Be terse."}));
        let d = Starter
            .route(chat(json!([{"role": "user", "content": "hi"}])))
            .unwrap();
        let RouteDecision::Modify(body) = d else {
            panic!("expected Modify, got {d:?}")
        };
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "Be terse."})
        );
        assert_eq!(body["messages"][1]["content"], "hi");
        assert_eq!(
            testing::take_logs(),
            vec![(LogLevel::Info, "request for model \"smol\"".to_owned())]
        );
    }

    #[test]
    fn prefixes_existing_system_prompt() {
        testing::reset();
        testing::set_config(json!({"system_prompt": "Be terse."}));
        let d = Starter
            .route(chat(json!([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}])))
            .unwrap();
        let RouteDecision::Modify(body) = d else {
            panic!("expected Modify")
        };
        assert_eq!(body["messages"][0]["content"], "Be terse.\n\nBe kind.");
        assert_eq!(body["messages"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn completions_pass_through() {
        testing::reset();
        let r = RouteRequest::new(
            pagoda_sdk::COMPLETIONS,
            json!({"model": "smol", "prompt": "x"}),
        );
        assert_eq!(Starter.route(r).unwrap(), RouteDecision::Continue);
    }
}
