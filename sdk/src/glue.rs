//! Wires a [`Plugin`] to the world's exports: JSON in and out, error
//! mapping, and the per-instance plugin value (kept in [`crate::instance`]).

use crate::host::{self, LogLevel};
use crate::instance::with_instance;
use crate::{Plugin, RouteDecision, RouteRequest};
use std::marker::PhantomData;

/// The type [`export_plugin!`](crate::export_plugin) exports for a plugin
/// `P`. Its functions are the hooks as the world declares them (JSON text
/// in and out); they are public so that tests can drive a plugin exactly as
/// the host does.
pub struct Adapter<P>(PhantomData<P>);

impl<P: Plugin> Adapter<P> {
    /// `route` as the host calls it. Errors (a request the SDK cannot parse,
    /// or an `Err` from the plugin) become a 500 rejection and a log line.
    pub fn route(request: &str) -> RouteDecision {
        let result = RouteRequest::from_json(request)
            .and_then(|req| with_instance::<P, _>(|p| p.route(req)));
        match result {
            Ok(decision) => decision,
            Err(e) => {
                let message = e.into_message();
                host::log(LogLevel::Error, format!("route failed: {message}"));
                RouteDecision::reject(500, format!("plugin error: {message}"))
            }
        }
    }

    /// `render-prompt` as the host calls it.
    pub fn render_prompt(
        request: &str,
        template: Option<String>,
    ) -> Result<Option<String>, String> {
        let request =
            crate::parse_json(request, "render-prompt request").map_err(|e| e.into_message())?;
        with_instance::<P, _>(|p| p.render_prompt(request, template)).map_err(|e| e.into_message())
    }

    /// `on-chunk` as the host calls it.
    pub fn on_chunk(choice: u32, text: String, finish: bool) -> String {
        with_instance::<P, _>(|p| p.on_chunk(choice, text, finish))
    }

    /// `post-process` as the host calls it.
    pub fn post_process(choice: u32, text: String) -> Result<String, String> {
        with_instance::<P, _>(|p| p.post_process(choice, text)).map_err(|e| e.into_message())
    }
}

#[cfg(target_arch = "wasm32")]
mod wasm {
    use super::Adapter;
    use crate::bindings::pagoda::plugin::types as wit;
    use crate::{Hook, Plugin, RouteDecision};

    impl<P: Plugin> crate::bindings::Guest for Adapter<P> {
        fn abi_version() -> u32 {
            crate::ABI_VERSION
        }

        fn metadata() -> wit::Metadata {
            let m = P::metadata();
            wit::Metadata {
                name: m.name,
                version: m.version,
                hooks: m
                    .hooks
                    .into_iter()
                    .map(|h| match h {
                        Hook::Route => wit::Hook::Route,
                        Hook::RenderPrompt => wit::Hook::RenderPrompt,
                        Hook::OnChunk => wit::Hook::OnChunk,
                        Hook::PostProcess => wit::Hook::PostProcess,
                    })
                    .collect(),
                config_schema: m.config_schema,
            }
        }

        fn route(request: String) -> wit::RouteDecision {
            match Adapter::<P>::route(&request) {
                RouteDecision::Continue => wit::RouteDecision::Continue,
                RouteDecision::Reject(r) => wit::RouteDecision::Reject(wit::Rejection {
                    status: r.status,
                    message: r.message,
                }),
                RouteDecision::Modify(body) => wit::RouteDecision::Modify(body.to_string()),
            }
        }

        fn render_prompt(
            request: String,
            template: Option<String>,
        ) -> Result<Option<String>, String> {
            Adapter::<P>::render_prompt(&request, template)
        }

        fn on_chunk(choice: u32, text: String, finish: bool) -> String {
            Adapter::<P>::on_chunk(choice, text, finish)
        }

        fn post_process(choice: u32, text: String) -> Result<String, String> {
            Adapter::<P>::post_process(choice, text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::LogLevel;
    use crate::{json, metadata, testing, Error, Hook, Metadata, Result};
    use serde_json::Value;

    /// Counts calls, to show that one value serves a whole request.
    #[derive(Default)]
    struct Counter {
        calls: u32,
    }

    impl Plugin for Counter {
        fn metadata() -> Metadata {
            metadata!().hooks([Hook::Route, Hook::OnChunk])
        }

        fn route(&mut self, request: RouteRequest) -> Result<RouteDecision> {
            match request.model() {
                Some("fail") => Err(Error::msg("no such luck")),
                Some("num") => Ok(RouteDecision::Modify(json!({"n": "x".parse::<u32>()?}))),
                _ => Ok(RouteDecision::Continue),
            }
        }

        fn on_chunk(&mut self, _choice: u32, text: String, _finish: bool) -> String {
            self.calls += 1;
            format!("{text}{}", self.calls)
        }
    }

    #[test]
    fn state_lives_for_one_request() {
        testing::reset();
        assert_eq!(Adapter::<Counter>::on_chunk(0, "a".into(), false), "a1");
        assert_eq!(Adapter::<Counter>::on_chunk(1, "b".into(), true), "b2");
        testing::new_request();
        assert_eq!(Adapter::<Counter>::on_chunk(0, "c".into(), false), "c1");
    }

    #[test]
    fn route_errors_reject_with_500() {
        testing::reset();
        let req = |model: &str| {
            json!({"endpoint": "/v1/completions", "body": {"model": model}}).to_string()
        };
        assert_eq!(
            Adapter::<Counter>::route(&req("ok")),
            RouteDecision::Continue
        );
        assert_eq!(
            Adapter::<Counter>::route(&req("fail")),
            RouteDecision::reject(500, "plugin error: no such luck")
        );
        assert_eq!(
            testing::take_logs(),
            vec![(LogLevel::Error, "route failed: no such luck".to_owned())]
        );
        // `?` on a foreign error type.
        match Adapter::<Counter>::route(&req("num")) {
            RouteDecision::Reject(r) => {
                assert!(r.message.contains("invalid digit"), "{}", r.message)
            }
            d => panic!("{d:?}"),
        }
        // A request the SDK cannot parse.
        match Adapter::<Counter>::route("{") {
            RouteDecision::Reject(r) => assert!(
                r.status == 500 && r.message.contains("route request"),
                "{r:?}"
            ),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn defaults_pass_through() {
        testing::reset();
        let req = json!({"messages": []}).to_string();
        assert_eq!(
            Adapter::<Counter>::render_prompt(&req, Some("t".into())),
            Ok(None)
        );
        assert!(Adapter::<Counter>::render_prompt("[", None).is_err());
        assert_eq!(
            Adapter::<Counter>::post_process(0, "x".into()),
            Ok("x".to_owned())
        );
    }

    #[test]
    fn metadata_and_config() {
        testing::reset();
        let m = Counter::metadata();
        assert_eq!(
            (m.name.as_str(), m.version.as_str()),
            ("pagoda-sdk", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(m.config_schema, "");
        #[derive(serde::Deserialize, Debug)]
        struct C {
            n: u32,
        }
        testing::set_config(json!({"n": 3}));
        assert_eq!(crate::host::config::<C>().unwrap().n, 3);
        testing::set_config(json!({"n": "x"}));
        let err = crate::host::config::<C>().unwrap_err();
        assert!(
            err.message().starts_with("invalid plugin config"),
            "{err:?}"
        );
        assert_eq!(crate::host::config::<Value>().unwrap(), json!({"n": "x"}));
    }
}
