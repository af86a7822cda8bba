//! Built-in plugin `router` (hook: `route`).
//!
//! Config (every field optional):
//!
//! ```json
//! {"aliases": {"fast": "smol"}, "allowed_models": ["smol"],
//!  "max_tokens_limit": 256, "temperature_max": 1.0,
//!  "reject_message": "...", "blocked_words": ["..."],
//!  "structured_outputs": {"json": {"type": "object", "...": "..."}},
//!  "adapter": "support"}
//! ```
//!
//! In this order, for both endpoints:
//!
//! 1. `blocked_words`: a prompt containing one of them (case-insensitive,
//!    as a whole word or phrase) is rejected with 400 and `reject_message`.
//! 2. `aliases`: a model name that is an alias is rewritten to its target.
//! 3. `allowed_models`: a model (after aliasing) not in the list is
//!    rejected: 403 if the server serves it to this tenant (it exists, the
//!    tenant may just not use it through this router), 404 otherwise. An
//!    absent list allows every model.
//! 4. `max_tokens_limit`: `max_tokens` and `max_completion_tokens` above it
//!    are lowered to it; when the client gave neither, `max_tokens` is set
//!    to it, since a limit the client can avoid by omitting the field would
//!    not be one.
//! 5. `temperature_max`: a higher `temperature` is lowered to it; when the
//!    client gave none and the maximum is below OpenAI's default of 1.0,
//!    `temperature` is set to the maximum.
//! 6. `structured_outputs`: every request gets this constraint (vLLM's
//!    `structured_outputs` object), replacing any `response_format`,
//!    `structured_outputs` or `guided_*` field the client sent, so the
//!    tenant's outputs always have that shape; the engine enforces it.
//! 7. `adapter`: every request runs with this LoRA adapter of the tenant
//!    (`RouteRequest::set_adapter`), e.g. its latest fine-tune.
//!
//! Any rewrite makes the decision `Modify`; otherwise `Continue`.

mod logic;

use pagoda_sdk::{host, metadata, Hook, Metadata, Plugin, Result, RouteDecision, RouteRequest};

/// The plugin.
#[derive(Default)]
pub struct Router;

impl Plugin for Router {
    fn metadata() -> Metadata {
        metadata!()
            .hooks([Hook::Route])
            .config_schema(logic::schema())
    }

    fn route(&mut self, request: RouteRequest) -> Result<RouteDecision> {
        let config: logic::Config = host::config()?;
        Ok(logic::decide(&config, request, &host::facts().models))
    }
}

pagoda_sdk::export_plugin!(Router);
