//! The HTTP server: the OpenAI API, health probes and Prometheus metrics,
//! on hyper 1 and tokio. The engine runs on its own thread behind an
//! [`AsyncEngine`] handle.

pub mod access_log;
pub mod admin;
pub mod auth;
pub mod body;
pub mod connections;
pub mod errors;
pub mod models;
pub mod openai;

use crate::engine::async_engine::{metric_names as m, AsyncEngine};
use crate::engine::EngineArgs;
use anyhow::{Context, Result};
use bytes::Bytes;
use errors::{json_response, ApiError};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The response body type of every route.
pub type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::convert::Infallible>;

/// A body of fixed bytes.
pub fn full(b: Bytes) -> Body {
    Full::new(b).boxed_unsync()
}

/// Server settings beyond the engine's.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Names the model answers to; the first is listed by `/v1/models`.
    pub served_model_names: Vec<String>,
    /// `--extra-model`: more models served behind the same port, each on
    /// an engine of its own.
    pub extra_models: Vec<models::ExtraModel>,
    /// Requests must carry `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// How connections are taken (caps and timeouts).
    pub connections: connections::ConnectionLimits,
    /// Requests in flight beyond this get a 429.
    pub max_pending_requests: usize,
    /// How long SIGTERM waits for requests in flight.
    pub shutdown_grace: Duration,
    /// How long the start-up warm-up forward may take.
    pub ready_timeout: Duration,
    /// The admin API's token; admin routes answer 404 without one.
    pub admin_token: Option<String>,
    /// Serve the admin API on its own address instead of the main one.
    pub admin_addr: Option<(String, u16)>,
    /// Where tenants and plugin versions persist (in memory only if None).
    pub state_dir: Option<std::path::PathBuf>,
    /// `--state-store`: the object store replicas share tenants through.
    pub state_store: Option<String>,
    /// `--state-poll-seconds`.
    pub state_poll: std::time::Duration,
    /// `--state-store-max-drop-fraction`.
    pub state_store_max_drop_fraction: f64,
    /// Plugin runtime settings.
    pub plugins: crate::plugins::RuntimeConfig,
    /// The parser of `tool_choice: "auto"` (`--enable-auto-tool-choice`
    /// with `--tool-call-parser`); without it, "auto" is refused.
    pub auto_tool_parser: Option<crate::server::openai::tool_parsers::ToolCallParser>,
    /// Splits chat output into reasoning and answer (`--reasoning-parser`).
    pub reasoning_parser: Option<crate::server::openai::reasoning::ReasoningParser>,
    /// Serve `/metrics` and the probes on their own port
    /// (`--metrics-port`); the API port then has no `/metrics`.
    pub metrics_port: Option<u16>,
    /// `--enable-force-include-usage`: streams end with their usage chunk
    /// whether or not the request asked for it.
    pub force_include_usage: bool,
    /// `--return-tokens-as-token-ids`: logprobs name tokens by id.
    pub return_tokens_as_token_ids: bool,
    /// `--max-logprobs`: the most logprobs per token a request may ask
    /// for (None: no limit, vLLM's `-1`).
    pub max_logprobs: Option<usize>,
    /// `--skip-tokenizer-init`: token ids in, token ids out.
    pub skip_tokenizer_init: bool,
    /// One line per request (`--disable-uvicorn-access-log`,
    /// `--enable-log-requests`).
    pub access_log: access_log::AccessLogConfig,
    /// `--usage-log`: where each finished request's usage record goes.
    pub usage_log: Option<crate::metering::UsageLogConfig>,
}

/// What every request handler shares.
pub struct AppState {
    /// The main model and any `--extra-model`s, each with its engine.
    models: models::ServedModels,
    /// Responses that `previous_response_id` can continue.
    pub(crate) responses: openai::responses::ResponseStore,
    config: ServerConfig,
    ready: AtomicBool,
    shutting_down: AtomicBool,
    load_error: OnceLock<String>,
    pub(crate) in_flight: AtomicUsize,
    pub(crate) max_pending: usize,
    metrics: PrometheusHandle,
    pub(crate) tenants: Arc<crate::tenants::Tenants>,
    pub(crate) admin_token: Option<String>,
    /// Whether this server is set up for tenants (an admin token, a state
    /// directory or a state store): it then never serves a request
    /// without a key, even while it knows no tenant.
    tenancy: bool,
    /// `--usage-log`, opened.
    usage_log: Option<Arc<crate::metering::UsageLog>>,
}

impl AppState {
    /// Where usage records go, with `--usage-log`.
    pub(crate) fn usage_log(&self) -> Option<&crate::metering::UsageLog> {
        self.usage_log.as_deref()
    }

    /// The names this server answers to, every model's (the main
    /// model's first).
    pub fn served_model_names(&self) -> &[String] {
        self.models.all_names()
    }

    /// The models this server serves, the main one first.
    pub fn models(&self) -> &models::ServedModels {
        &self.models
    }

    /// The model a request that names none is served by: the first name.
    pub fn default_model(&self) -> Option<&str> {
        self.config.served_model_names.first().map(String::as_str)
    }

    /// The parser for `tool_choice: "auto"`, if the server enables it.
    pub fn auto_tool_parser(&self) -> Option<crate::server::openai::tool_parsers::ToolCallParser> {
        self.config.auto_tool_parser
    }

    /// `--enable-force-include-usage`.
    pub fn config_force_include_usage(&self) -> bool {
        self.config.force_include_usage
    }

    /// `--return-tokens-as-token-ids`.
    pub fn config_tokens_as_ids(&self) -> bool {
        self.config.return_tokens_as_token_ids
    }

    /// `--max-logprobs` (None: no limit).
    pub fn config_max_logprobs(&self) -> Option<usize> {
        self.config.max_logprobs
    }

    /// `--skip-tokenizer-init`: a 400 for what needs the tokenizer (`what`).
    pub fn needs_tokenizer(&self, what: &str) -> Result<(), ApiError> {
        if self.config.skip_tokenizer_init {
            return Err(ApiError::invalid(
                None,
                format!("{what} needs the tokenizer, and this server was started with --skip-tokenizer-init: send completions with prompts of token ids"),
            ));
        }
        Ok(())
    }

    /// `--skip-tokenizer-init`.
    pub fn config_skip_tokenizer_init(&self) -> bool {
        self.config.skip_tokenizer_init
    }

    /// `--reasoning-parser`, if given.
    pub fn reasoning_parser(&self) -> Option<crate::server::openai::reasoning::ReasoningParser> {
        self.config.reasoning_parser
    }

    /// The engine that serves `model` (a served name of the main model or
    /// an extra one, or a LoRA adapter loaded on the main model), if it is
    /// up; a 404 for a model no engine serves.
    pub fn engine_for(&self, model: &str) -> Result<&AsyncEngine, ApiError> {
        let engine = self.engine()?;
        if let Some(m) = self.models.find(model) {
            return match m.engine() {
                Some(e) => Self::alive(e),
                None => Err(ApiError::unavailable(
                    "The model is still loading; retry when /health answers 200.",
                )),
            };
        }
        if engine.lora_info(model).is_none() {
            return Err(ApiError::model_not_found(model));
        }
        Ok(engine)
    }

    /// [`AppState::engine_for`] for a request of `tenant`: its own
    /// adapters count as served models (another tenant's do not, and
    /// answer as a missing model does).
    pub fn engine_as(
        &self,
        model: &str,
        tenant: Option<&crate::server::openai::tenant::TenantCtx>,
    ) -> Result<&AsyncEngine, ApiError> {
        if tenant.is_some_and(|t| t.admission.snapshot.owns_adapter(model)) {
            return self.engine();
        }
        let me = tenant.map_or("", |t| t.tenant_id());
        if !self.models.serves(model) && self.tenants.shared_adapter_owner(model, me).is_some() {
            return self.engine();
        }
        self.engine_for(model)
    }

    /// The LoRA adapter a request for `model` runs with: the tenant's own
    /// adapter of that name (made resident on this request if it is not),
    /// else a server-wide one, else none (the base model). Names the
    /// adapter in the access log.
    pub fn lora_as<'a>(
        &'a self,
        model: &'a str,
        engine: &'a AsyncEngine,
        tenant: Option<&crate::server::openai::tenant::TenantCtx>,
    ) -> impl std::future::Future<
        Output = Result<Option<std::sync::Arc<crate::engine::lora::LoadedLora>>, ApiError>,
    > + Send
           + 'a {
        // Only the tenant itself crosses the await (its request's plugin
        // session is not shared between threads).
        let me = tenant.map_or("", |t| t.tenant_id());
        // The tenant's own adapter, else one another tenant shares.
        let own = tenant
            .filter(|t| t.admission.snapshot.owns_adapter(model))
            .map(|t| Arc::clone(&t.admission.tenant))
            .or_else(|| {
                (!self.models.serves(model))
                    .then(|| self.tenants.shared_adapter_owner(model, me))
                    .flatten()
            });
        async move {
            let lora = match own {
                Some(t) => self
                    .tenants
                    .resolve_adapter(&t, model, engine.lora_registry())
                    .await
                    .map_err(|e| {
                        use crate::tenants::{adapters::AdapterError, shared::StoreError};
                        if e.downcast_ref::<AdapterError>().is_some()
                            || e.downcast_ref::<StoreError>().is_some()
                        {
                            admin::adapter_error(e)
                        } else {
                            // A stored adapter that no longer loads is
                            // the server's fault, not the request's.
                            tracing::error!("adapter '{model}': {e:#}");
                            ApiError::internal(format!(
                                "The adapter '{model}' could not be loaded ({e:#}); its owner can upload it again."
                            ))
                        }
                    })?
                    // Deleted since the request was admitted.
                    .ok_or_else(|| ApiError::model_not_found(model))
                    .map(Some)?,
                None => engine.lora(model),
            };
            if let (Some(_), Some(r)) = (&lora, access_log::current()) {
                r.set_adapter(model);
            }
            Ok(lora)
        }
    }

    /// The engine, if the server is ready to serve: every model's engine
    /// is up and, with a state store, the store has been read once and
    /// agrees on the key salt (what the readiness probes answer).
    pub fn serving(&self) -> Result<&AsyncEngine, ApiError> {
        let engine = self.engine()?;
        for e in self.models.engines() {
            Self::alive(e)?;
        }
        match self.tenants.not_serving() {
            Some(why) => Err(ApiError::unavailable(why)),
            None => Ok(engine),
        }
    }

    /// The main model's engine, or a 503 while the models load or after
    /// shutdown began.
    pub fn engine(&self) -> Result<&AsyncEngine, ApiError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ApiError::unavailable("The server is shutting down."));
        }
        match (
            self.models.main().engine(),
            self.ready.load(Ordering::Acquire),
        ) {
            (Some(e), true) => Self::alive(e),
            _ => Err(ApiError::unavailable(match self.load_error.get() {
                Some(e) => format!("The model failed to load: {e}"),
                None => "The model is still loading; retry when /health answers 200.".into(),
            })),
        }
    }

    /// `e`, or a 503 once its engine thread died.
    fn alive(e: &AsyncEngine) -> Result<&AsyncEngine, ApiError> {
        match e.death() {
            None => Ok(e),
            Some(why) => Err(ApiError::unavailable(format!(
                "The engine stopped ({why}); the server is exiting to be restarted."
            ))),
        }
    }
}

/// Installs the Prometheus recorder. Every series carries vLLM's
/// `model_name` (the first served name) and `engine` labels, so dashboards
/// built for vLLM select Pagoda's series unchanged; an `--extra-model`'s
/// engine records its series under its own first name instead.
fn install_metrics(model_name: &str) -> Result<PrometheusHandle> {
    // Latency histograms get explicit buckets so they render as Prometheus
    // histograms (vLLM's bucket edges), not summaries.
    let latency = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ];
    // vLLM's token-count buckets (1, 2, 5 up to its largest context).
    let tokens: Vec<f64> = (0..7)
        .flat_map(|e| [1.0, 2.0, 5.0].map(|b| b * 10f64.powi(e)))
        .collect();
    let mut builder = PrometheusBuilder::new()
        .add_global_label("model_name", model_name)
        .add_global_label("engine", "0");
    for name in [
        m::TTFT,
        m::ITL,
        m::E2E,
        m::QUEUE_TIME,
        m::TPOT,
        m::REQUEST_TPOT,
        m::PREFILL_TIME,
        m::DECODE_TIME,
        m::INFERENCE_TIME,
        m::TENANT_TTFT,
        m::TENANT_QUEUE_TIME,
    ] {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.into()), &latency)?;
    }
    for name in [
        m::REQUEST_PROMPT_TOKENS,
        m::REQUEST_GENERATION_TOKENS,
        m::REQUEST_MAX_GENERATION_TOKENS,
        m::REQUEST_PARAMS_N,
        m::REQUEST_PARAMS_MAX_TOKENS,
        m::ITERATION_TOKENS,
    ] {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.into()), &tokens)?;
    }
    let builder = builder.set_buckets_for_metric(
        Matcher::Full(crate::plugins::metrics::LATENCY.into()),
        crate::plugins::metrics::BUCKETS,
    )?;
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    models::install_recorder(recorder)?;
    crate::plugins::metrics::describe();
    metrics::describe_gauge!(m::NUM_REQUESTS_RUNNING, "Requests running on the engine.");
    metrics::describe_gauge!(m::NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.");
    metrics::describe_gauge!(
        m::KV_CACHE_USAGE,
        "Fraction of KV-cache blocks in use (0 to 1)."
    );
    metrics::describe_counter!(m::PROMPT_TOKENS, "Prompt tokens processed.");
    metrics::describe_gauge!(
        crate::tenants::shared::metrics::UP,
        "1 while the shared state store (--state-store) answers, else 0."
    );
    metrics::describe_counter!(
        crate::tenants::shared::metrics::ERRORS,
        "Operations on the shared state store that failed to reach it."
    );
    {
        use crate::tenants::shared::metrics as sm;
        metrics::describe_counter!(
            sm::TENANT_ERRORS,
            "Changes to a tenant's shared state that this replica could not apply (a corrupt manifest, a component whose content does not match its hash); the tenant is held at its last good state."
        );
        metrics::describe_gauge!(
            sm::TENANT_FAULTY,
            "1 while a tenant's shared state cannot be applied on this replica."
        );
        metrics::describe_counter!(
            sm::REFUSED_DROPS,
            "Polls of the state store that would have dropped more tenants than --state-store-max-drop-fraction allows, refused as a suspected store fault."
        );
        metrics::describe_gauge!(
            sm::DROP_HELD,
            "1 while tenants missing from the state store are held instead of dropped (until they return or an admin confirms)."
        );
        metrics::describe_gauge!(
            sm::SALT_CONFLICT,
            "1 while this replica's API-key salt differs from the state store's key-salt (it refuses requests then)."
        );
    }
    metrics::describe_counter!(m::GENERATION_TOKENS, "Tokens generated.");
    metrics::describe_counter!(m::NUM_PREEMPTIONS, "Preemptions by recompute.");
    metrics::describe_counter!(
        m::KV_EVENTS_DROPPED,
        "KV-cache event batches dropped because the publisher thread fell behind."
    );
    metrics::describe_counter!(
        m::SPEC_NUM_DRAFTS,
        "Speculative decoding: verifications (one per sequence and step with drafts)."
    );
    metrics::describe_counter!(
        m::SPEC_NUM_DRAFT_TOKENS,
        "Speculative decoding: drafted tokens verified."
    );
    metrics::describe_counter!(
        m::SPEC_NUM_ACCEPTED_TOKENS,
        "Speculative decoding: drafted tokens accepted."
    );
    metrics::describe_counter!(
        m::SPEC_ACCEPTED_PER_POS,
        "Speculative decoding: accepted drafts by position in the draft."
    );
    metrics::describe_counter!(
        m::PREFIX_QUERIES,
        "Prompt tokens looked up in the prefix cache."
    );
    metrics::describe_counter!(m::PREFIX_HITS, "Prompt tokens found in the prefix cache.");
    metrics::describe_counter!(m::REQUEST_SUCCESS, "Finished requests by finish reason.");
    metrics::describe_histogram!(m::TTFT, "Time to first token, seconds.");
    metrics::describe_histogram!(m::ITL, "Time between tokens, seconds.");
    metrics::describe_histogram!(m::E2E, "Request latency, seconds.");
    metrics::describe_histogram!(
        m::QUEUE_TIME,
        "Time waiting before first scheduled, seconds."
    );
    for (name, what) in [
        (
            m::TPOT,
            "Time between tokens, seconds (vLLM's older name for the inter-token latency).",
        ),
        (
            m::REQUEST_TPOT,
            "Per request: decode time over its output tokens after the first, seconds.",
        ),
        (m::PREFILL_TIME, "First scheduled to first token, seconds."),
        (m::DECODE_TIME, "First token to last token, seconds."),
        (m::INFERENCE_TIME, "First scheduled to finished, seconds."),
        (
            m::REQUEST_PROMPT_TOKENS,
            "Prompt tokens per finished request.",
        ),
        (
            m::REQUEST_GENERATION_TOKENS,
            "Generated tokens per finished request.",
        ),
        (
            m::REQUEST_MAX_GENERATION_TOKENS,
            "The most tokens each request could generate.",
        ),
        (m::REQUEST_PARAMS_N, "The n of each request."),
        (
            m::REQUEST_PARAMS_MAX_TOKENS,
            "The max_tokens of each request that set one.",
        ),
        (
            m::ITERATION_TOKENS,
            "Tokens run per engine step (prefill chunks and decodes).",
        ),
    ] {
        metrics::describe_histogram!(name, what);
    }
    metrics::describe_gauge!(m::TENANT_RUNNING, "Requests running, per tenant.");
    metrics::describe_gauge!(m::TENANT_WAITING, "Requests waiting, per tenant.");
    metrics::describe_gauge!(
        m::TENANT_KV_BLOCKS,
        "KV-cache blocks held or kept cached, per tenant with a kv_cache share."
    );
    metrics::describe_gauge!(
        m::TENANT_KV_CACHED_BLOCKS,
        "KV-cache blocks kept cached and held by no request, per tenant with a kv_cache share."
    );
    metrics::describe_counter!(
        m::TENANT_KV_EVICTED_BY_OTHERS,
        "Cached KV-cache blocks of the tenant evicted by other tenants' allocations."
    );
    metrics::describe_counter!(
        m::TENANT_PROMPT_TOKENS,
        "Prompt tokens of admitted requests, per tenant."
    );
    metrics::describe_counter!(m::TENANT_GENERATION_TOKENS, "Tokens generated, per tenant.");
    metrics::describe_counter!(
        crate::metering::metrics::TENANT_TOKENS,
        "Tokens of finished requests per tenant and kind (prompt, cached, completion, spec_accepted), as their usage records count them."
    );
    {
        use crate::metering::ship::metrics as um;
        metrics::describe_counter!(
            um::BATCHES,
            "Batches of usage records put to the --usage-log store."
        );
        metrics::describe_counter!(
            um::ERRORS,
            "Puts of usage records to the --usage-log store that failed (the records stay spooled and are retried)."
        );
        metrics::describe_gauge!(
            um::SPOOLED,
            "Bytes of usage records spooled and not yet acknowledged by the --usage-log store."
        );
    }
    metrics::describe_histogram!(m::TENANT_TTFT, "Time to first token per tenant, seconds.");
    metrics::describe_histogram!(
        m::TENANT_QUEUE_TIME,
        "Time waiting before first scheduled per tenant, seconds."
    );
    metrics::describe_gauge!(
        m::CACHE_CONFIG_INFO,
        "The KV cache's configuration, as labels."
    );
    metrics::describe_gauge!(
        m::GPU_CACHE_USAGE,
        "vLLM's older name for kv_cache_usage_perc."
    );
    metrics::describe_gauge!(
        m::NUM_REQUESTS_SWAPPED,
        "Always 0: Pagoda preempts by recompute and never swaps to host memory."
    );
    metrics::describe_counter!(
        m::PREFIX_CACHE_QUERIES_GPU,
        "vLLM's older name for prefix_cache_queries_total."
    );
    metrics::describe_counter!(
        m::PREFIX_CACHE_HITS_GPU,
        "vLLM's older name for prefix_cache_hits_total."
    );
    connections::describe_metrics();
    crate::tenants::adapters::describe_metrics();
    // Counters start at zero so that they are present before any request.
    for name in [
        m::PROMPT_TOKENS,
        m::GENERATION_TOKENS,
        m::NUM_PREEMPTIONS,
        m::PREFIX_QUERIES,
        m::PREFIX_HITS,
        m::PREFIX_CACHE_QUERIES_GPU,
        m::PREFIX_CACHE_HITS_GPU,
    ] {
        metrics::counter!(name).absolute(0);
    }
    for g in [
        m::NUM_REQUESTS_RUNNING,
        m::NUM_REQUESTS_WAITING,
        m::KV_CACHE_USAGE,
    ] {
        metrics::gauge!(g).set(0.0);
    }
    Ok(handle)
}

/// Who a request is: a tenant (by its key), the server-wide `--api-key`,
/// or anyone when neither keys nor tenants exist.
fn authenticate(
    state: &AppState,
    req: &Request<Incoming>,
) -> Result<Option<Arc<crate::tenants::Tenant>>, ApiError> {
    // Keys would not match those made on other replicas: serve nobody.
    if let Some(why) = state.tenants.salt_conflict() {
        return Err(ApiError::unavailable(why));
    }
    let key = auth::bearer_token(req.headers());
    if let Some(t) = key.and_then(|k| state.tenants.by_key(k)) {
        if let (Some(r), Some(k)) = (access_log::current(), key) {
            r.set_tenant(&t.id);
            r.set_key_id(state.tenants.key_id(k));
        }
        return Ok(Some(t));
    }
    match &state.config.api_key {
        Some(a) if key.is_some_and(|k| auth::same(k, a)) => Ok(None),
        Some(_) => Err(ApiError::invalid_api_key()),
        None if state.tenants.is_empty() && !state.tenancy => Ok(None),
        None if key.is_none() => Err(ApiError {
            message: "This server serves tenants: pass a tenant's API key as 'Authorization: Bearer KEY'.".into(),
            ..ApiError::invalid_api_key()
        }),
        None => Err(ApiError::invalid_api_key()),
    }
}

async fn read_json(state: &AppState, req: Request<Incoming>) -> Result<Value, ApiError> {
    let body = body::read_limited(req, state.config.max_body_bytes).await?;
    let small = body.len() <= 64 << 10;
    let parse = move || {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::invalid(None, format!("The request body is not valid JSON: {e}"))
        })
    };
    // Parsing megabytes of JSON takes milliseconds of CPU: off the HTTP
    // threads, unless the body is small.
    if small {
        parse()
    } else {
        openai::off_runtime(parse).await
    }
}

/// Which listener a request came in on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The main address, also serving the admin API.
    Both,
    /// The main address; the admin API has its own.
    Main,
    /// The admin address.
    Admin,
    /// The metrics address (`--metrics-port`): `/metrics` and the probes.
    Metrics,
}

async fn route(state: Arc<AppState>, req: Request<Incoming>, listener: Listener) -> Response<Body> {
    let log = access_log::Pending::start(
        state.config.access_log,
        req.method().as_str(),
        req.uri().path(),
    );
    let unread_body = has_body(&req);
    let result = log.scope(dispatch(state, req, listener)).await;
    match result {
        Ok(r) => log.finish(r, None),
        Err(e) => {
            let mut r = e.response();
            // A request refused before its body was read (a bad key, a
            // missing route) leaves that body on the connection, which
            // hyper then cannot reuse: say so, rather than let the client
            // send its next request into a connection about to close.
            if unread_body && matches!(e.status.as_u16(), 401 | 403 | 404 | 405) {
                r.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
            }
            log.finish(r, Some(e.kind))
        }
    }
}

/// Whether `req` says it has a body (a non-zero length, or chunked).
fn has_body(req: &Request<Incoming>) -> bool {
    let h = req.headers();
    h.contains_key(hyper::header::TRANSFER_ENCODING)
        || h.get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim() != "0")
}

/// Answers one request: health, metrics, the admin API, or the OpenAI API.
async fn dispatch(
    state: Arc<AppState>,
    req: Request<Incoming>,
    listener: Listener,
) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let is_admin = path == "/admin" || path.starts_with("/admin/");
    if listener == Listener::Admin && !is_admin && !path.starts_with("/health") {
        return Err(ApiError::not_found(&path));
    }
    let probe_or_metrics = path == "/metrics" || path == "/ping" || path.starts_with("/health");
    if listener == Listener::Metrics && !probe_or_metrics {
        return Err(ApiError::not_found(&path));
    }
    if path == "/metrics" && listener != Listener::Metrics && state.config.metrics_port.is_some() {
        return Err(ApiError::not_found(&path));
    }
    let result = match (method.clone(), path.as_str()) {
        (_, _) if is_admin => {
            if listener == Listener::Main {
                Err(ApiError::not_found(&path))
            } else {
                admin::route(Arc::clone(&state), req).await
            }
        }
        // As vLLM's: 200 only once requests can be served (the model is
        // loaded and warm, and a state store has been read), so probes and
        // scripts written for vLLM never send traffic into 503s.
        (Method::GET, "/health") => Ok(match state.serving() {
            Ok(_) => json_response(&json!({})),
            Err(e) => e.response(),
        }),
        // Liveness, for Kubernetes: 200 while the process is sound, model
        // loading included; 503 once the engine died or the model failed
        // to load, so the kubelet restarts it.
        (Method::GET, "/health/live") => Ok(
            match (
                state.models.engines().find_map(AsyncEngine::death),
                state.load_error.get(),
            ) {
                (Some(why), _) => {
                    ApiError::unavailable(format!("the engine stopped: {why}")).response()
                }
                (None, None) => json_response(&json!({})),
                (None, Some(_)) => ApiError::unavailable("the model failed to load").response(),
            },
        ),
        (Method::GET, "/health/ready" | "/health/startup") => Ok(match state.serving() {
            Ok(_) => json_response(&json!({"status": "ready"})),
            Err(e) => e.response(),
        }),
        // SageMaker-style managed platforms probe /ping and send every
        // request to /invocations, as vLLM serves them.
        (Method::GET | Method::POST, "/ping") => Ok(match state.serving() {
            Ok(_) => json_response(&json!({})),
            Err(e) => e.response(),
        }),
        (Method::POST, "/invocations") => match authenticate(&state, &req) {
            Err(e) => Err(e),
            Ok(tenant) => invocations(Arc::clone(&state), req, tenant).await,
        },
        (Method::GET, "/metrics") => {
            let mut r = Response::new(full(Bytes::from(state.metrics.render())));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            Ok(r)
        }
        (Method::GET, "/version") => Ok(json_response(
            &json!({"version": env!("CARGO_PKG_VERSION")}),
        )),
        // Anthropic's Messages API: its own key header and error shape.
        (_, p) if p == "/v1/messages" || p.starts_with("/v1/messages/") => {
            Ok(openai::anthropic::route(Arc::clone(&state), req).await)
        }
        (_, p)
            if p.starts_with("/v1/")
                || matches!(
                    p,
                    "/tokenize"
                        | "/detokenize"
                        | "/tokenizer_info"
                        | "/pooling"
                        | "/score"
                        | "/rerank"
                        | "/v2/rerank"
                        | "/v2/embed"
                        | "/classify"
                ) =>
        {
            match authenticate(&state, &req) {
                Err(e) => Err(e),
                Ok(tenant) => api_route(Arc::clone(&state), method, &path, req, tenant).await,
            }
        }
        (_, p) => Err(ApiError::not_found(p)),
    };
    result
}

async fn api_route(
    state: Arc<AppState>,
    method: Method,
    path: &str,
    req: Request<Incoming>,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let snapshot = tenant.as_ref().map(|t| t.snapshot());
    let allowed = |m: &str| snapshot.as_ref().is_none_or(|s| s.allows_model(m));
    match (method, path) {
        (Method::GET, "/v1/models") => {
            let engine = state.engine()?;
            let mut data: Vec<Value> = state
                .models
                .iter()
                .flat_map(|m| m.names.iter().map(move |n| (m, n)))
                .filter(|(_, n)| allowed(n))
                .map(|(m, n)| model_card(m, n))
                .collect();
            // Adapters, as vLLM lists them: their folder as root, the base
            // model as parent.
            data.extend(
                engine
                    .loras()
                    .iter()
                    .filter(|l| allowed(&l.name))
                    .map(|l| lora_card(&state, l)),
            );
            // Adapters tenants share (as the allowlist admits them), then
            // the tenant's own (and no other tenant's).
            let me = tenant.as_ref().map_or("", |t| t.id.as_str());
            for (name, version) in state.tenants.shared_adapters(me) {
                if allowed(&name) && !data.iter().any(|c| c["id"] == name.as_str()) {
                    data.push(tenant_lora_card(&state, &name, version));
                }
            }
            if let Some(t) = &tenant {
                for (name, version) in state.tenants.active_adapters(t) {
                    data.retain(|c| c["id"] != name.as_str());
                    data.push(tenant_lora_card(&state, &name, version));
                }
            }
            Ok(json_response(&json!({"object": "list", "data": data})))
        }
        // `client.models.retrieve(id)`: the id is the rest of the path (a
        // served name may hold a '/', as in "Qwen/Qwen3-8B").
        (Method::GET, p) if p.starts_with("/v1/models/") => {
            state.engine()?;
            let id = percent_decode(&p["/v1/models/".len()..]);
            let lora = state.engine()?.lora_info(&id);
            let own = tenant.as_ref().and_then(|t| {
                state
                    .tenants
                    .active_adapters(t)
                    .into_iter()
                    .find(|(n, _)| *n == id)
            });
            if let Some((name, version)) = own {
                return Ok(json_response(&tenant_lora_card(&state, &name, version)));
            }
            let me = tenant.as_ref().map_or("", |t| t.id.as_str());
            let is_served = state.models.serves(&id);
            if !is_served && allowed(&id) {
                let shared = state.tenants.shared_adapters(me);
                if let Some((name, version)) = shared.into_iter().find(|(n, _)| *n == id) {
                    return Ok(json_response(&tenant_lora_card(&state, &name, version)));
                }
            }
            match state.models.find(&id) {
                Some(m) if allowed(&id) => Ok(json_response(&model_card(m, &id))),
                None if lora.is_some() && allowed(&id) => {
                    let l = lora.as_ref().map(|l| lora_card(&state, l));
                    Ok(json_response(&l.unwrap_or_default()))
                }
                // Another tenant's model is as unknown as a missing one.
                _ => Err(ApiError::model_not_found(&id)),
            }
        }
        (Method::POST, "/v1/completions") => {
            let body = read_json(&state, req).await?;
            openai::completion::completions(state, body, tenant).await
        }
        // vLLM serves these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set;
        // they read a folder on the server, so a tenant's key never may
        // (tenants upload adapters through the admin API instead).
        (Method::POST, p @ ("/v1/load_lora_adapter" | "/v1/unload_lora_adapter"))
            if runtime_lora_updating() =>
        {
            if tenant.is_some() {
                return Err(ApiError::not_found(p));
            }
            let body = read_json(&state, req).await?;
            update_lora(&state, p == "/v1/load_lora_adapter", &body).await
        }
        (Method::POST, "/v1/embeddings") => {
            let body = read_json(&state, req).await?;
            openai::embeddings::embeddings(
                state,
                body,
                tenant,
                openai::embeddings::PoolingRoute::Embeddings,
            )
            .await
        }
        (Method::POST, p @ ("/score" | "/v1/score")) => {
            let body = read_json(&state, req).await?;
            openai::score::score(state, p, body, tenant, openai::score::ScoreRoute::Score).await
        }
        (Method::POST, p @ ("/rerank" | "/v1/rerank" | "/v2/rerank")) => {
            let body = read_json(&state, req).await?;
            openai::score::score(state, p, body, tenant, openai::score::ScoreRoute::Rerank).await
        }
        (Method::POST, p @ "/classify") => {
            let body = read_json(&state, req).await?;
            openai::classify::classify(state, p, body, tenant).await
        }
        (Method::POST, "/v2/embed") => {
            let body = read_json(&state, req).await?;
            openai::embeddings::embeddings(
                state,
                body,
                tenant,
                openai::embeddings::PoolingRoute::CohereEmbed,
            )
            .await
        }
        (Method::POST, "/pooling") => {
            let body = read_json(&state, req).await?;
            openai::embeddings::embeddings(
                state,
                body,
                tenant,
                openai::embeddings::PoolingRoute::Pooling,
            )
            .await
        }
        (Method::POST, "/v1/completions/render") => {
            let body = read_json(&state, req).await?;
            openai::tokenize::render(state, body, tenant, false).await
        }
        (Method::POST, "/v1/chat/completions/render") => {
            let body = read_json(&state, req).await?;
            openai::tokenize::render(state, body, tenant, true).await
        }
        (Method::POST, "/v1/chat/completions") => {
            let body = read_json(&state, req).await?;
            openai::chat_completion::chat(state, body, tenant).await
        }
        (Method::POST, "/v1/chat/completions/batch") => {
            let body = read_json(&state, req).await?;
            openai::chat_completion::chat_batch(state, body, tenant).await
        }
        (Method::POST, "/v1/responses") => {
            let body = read_json(&state, req).await?;
            openai::responses::responses(state, body, tenant).await
        }
        (Method::POST, "/v1/responses/render") => {
            let body = read_json(&state, req).await?;
            openai::responses::render(state, body, tenant).await
        }
        (Method::POST, p) if p.starts_with("/v1/responses/") && p.ends_with("/cancel") => {
            let id = percent_decode(&p["/v1/responses/".len()..p.len() - "/cancel".len()]);
            openai::responses::cancel(&state, &id, tenant.as_deref())
        }
        (Method::GET, p) if p.starts_with("/v1/responses/") && p.ends_with("/input_items") => {
            let id = percent_decode(&p["/v1/responses/".len()..p.len() - "/input_items".len()]);
            openai::responses::input_items(&state, &id, req.uri().query(), tenant.as_deref())
        }
        (Method::GET, p) if p.starts_with("/v1/responses/") => {
            let id = percent_decode(&p["/v1/responses/".len()..]);
            openai::responses::retrieve(&state, &id, tenant.as_deref())
        }
        (Method::DELETE, p) if p.starts_with("/v1/responses/") => {
            let id = percent_decode(&p["/v1/responses/".len()..]);
            openai::responses::delete(&state, &id, tenant.as_deref())
        }
        (Method::POST, "/tokenize") => {
            let body = read_json(&state, req).await?;
            check_model_field(&body, &allowed)?;
            openai::tokenize::tokenize(state, body, tenant).await
        }
        (Method::POST, "/detokenize") => {
            let body = read_json(&state, req).await?;
            check_model_field(&body, &allowed)?;
            openai::tokenize::detokenize(state, body, tenant).await
        }
        (Method::GET, "/tokenizer_info") => tokenizer_info(&state),
        (
            m,
            p @ ("/v1/models"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/v1/responses"
            | "/v1/embeddings"),
        ) => Err(ApiError::method_not_allowed(m.as_str(), p)),
        (_, p) => Err(match unserved_route(p) {
            Some(what) => ApiError::not_implemented(p, what),
            None => ApiError::not_found(p),
        }),
    }
}

/// Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` allows loading and
/// unloading adapters through the API, as vLLM reads it.
fn runtime_lora_updating() -> bool {
    std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true"))
}

/// `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and
/// `/v1/unload_lora_adapter` (`{"lora_name"}`), with vLLM's answers: a
/// plain-text success line, or a 400 (a bad body, a name already loaded,
/// an adapter that does not fit) or 404 (unloading an unknown adapter).
/// A failed load changes nothing; an unloaded adapter's running requests
/// finish, and new ones get 404 `model_not_found`.
async fn update_lora(
    state: &AppState,
    load: bool,
    body: &Value,
) -> Result<Response<Body>, ApiError> {
    let engine = state.engine()?.clone();
    if !engine.lora_enabled() {
        return Err(ApiError::invalid(
            None,
            "LoRA adapters are not enabled; start the server with --enable-lora",
        ));
    }
    let field = |k: &str| {
        body.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    let Some(name) = field("lora_name").map(str::to_string) else {
        return Err(ApiError::invalid(
            Some("lora_name".into()),
            if load {
                "Both 'lora_name' and 'lora_path' must be provided."
            } else {
                "'lora_name' needs to be provided to unload a LoRA adapter."
            },
        ));
    };
    let text = if load {
        let Some(path) = field("lora_path").map(std::path::PathBuf::from) else {
            return Err(ApiError::invalid(
                Some("lora_path".into()),
                "Both 'lora_name' and 'lora_path' must be provided.",
            ));
        };
        if state.served_model_names().iter().any(|n| *n == name) {
            return Err(ApiError::invalid(
                Some("lora_name".into()),
                format!("The lora adapter '{name}' would shadow a served model's name."),
            ));
        }
        if engine.lora_info(&name).is_some() {
            return Err(ApiError::invalid(
                Some("lora_name".into()),
                format!("The lora adapter '{name}' has already been loaded."),
            ));
        }
        let e = engine.clone();
        let n = name.clone();
        tokio::task::spawn_blocking(move || e.load_lora(&n, &path))
            .await
            .map_err(|e| ApiError::internal(format!("loading the adapter failed: {e}")))?
            .map_err(|e| ApiError::invalid(Some("lora_path".into()), format!("{e:#}")))?;
        tracing::info!("LoRA adapter {name:?} loaded");
        format!("Success: LoRA adapter '{name}' added successfully.")
    } else {
        if !engine.unload_lora(&name) {
            return Err(ApiError {
                status: hyper::StatusCode::NOT_FOUND,
                code: "not_found",
                ..ApiError::invalid(
                    Some("lora_name".into()),
                    format!("The lora adapter '{name}' cannot be found."),
                )
            });
        }
        tracing::info!("LoRA adapter {name:?} unloaded");
        format!("Success: LoRA adapter '{name}' removed successfully.")
    };
    let mut r = Response::new(full(Bytes::from(text)));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(r)
}

/// A LoRA adapter's `/v1/models` entry.
fn lora_card(state: &AppState, l: &crate::engine::lora::LoraInfo) -> Value {
    json!({
        "id": l.name, "object": "model", "created": 0, "owned_by": "pagoda",
        "root": l.path.display().to_string(), "parent": state.default_model(),
        "max_model_len": state.models.main().engine().map(|e| e.max_model_len()),
        "permission": [],
    })
}

/// A tenant's own adapter's `/v1/models` entry: its name and version
/// as `root` (not where the server keeps it), the base as parent.
fn tenant_lora_card(state: &AppState, name: &str, version: u64) -> Value {
    json!({
        "id": name, "object": "model", "created": 0, "owned_by": "pagoda",
        "root": format!("{name}@v{version}"), "parent": state.default_model(),
        "max_model_len": state.models.main().engine().map(|e| e.max_model_len()),
        "permission": [],
    })
}

/// One model's card under one of its names, as `/v1/models` lists it.
fn model_card(model: &models::ServedModel, name: &str) -> Value {
    json!({
        "id": name, "object": "model", "created": 0, "owned_by": "pagoda",
        "root": model.root, "parent": null,
        "max_model_len": model.engine().map(|e| e.max_model_len()),
        "permission": [],
    })
}

/// A path segment with its `%XX` escapes decoded (a `+` stays a `+` in a
/// path); an escape that is not one is kept as written.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'%', Some(x)) => {
                out.push(x);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What an OpenAI or vLLM route that Pagoda does not serve is for, so the
/// client learns it is missing here rather than misspelled.
fn unserved_route(path: &str) -> Option<&'static str> {
    let known: &[(&str, &str)] = &[
        ("/v1/audio/", "audio"),
        ("/v1/images/", "images"),
        ("/v1/moderations", "moderations"),
        ("/v1/files", "files"),
        ("/v1/batches", "batches"),
        ("/v1/fine_tuning/", "fine-tuning"),
    ];
    known
        .iter()
        .find(|(p, _)| path == *p || (p.ends_with('/') && path.starts_with(p)))
        .map(|&(_, what)| what)
}

/// `POST /invocations`: a chat request (it has `messages`) or a
/// completions request (it has `prompt`), decided by the body.
async fn invocations(
    state: Arc<AppState>,
    req: Request<Incoming>,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let body = read_json(&state, req).await?;
    if body.get("messages").is_some() {
        openai::chat_completion::chat(state, body, tenant).await
    } else if body.get("prompt").is_some() {
        openai::completion::completions(state, body, tenant).await
    } else {
        Err(ApiError::invalid(
            None,
            "/invocations takes a chat request (with 'messages') or a completions request (with 'prompt')",
        ))
    }
}

fn check_model_field(body: &Value, allowed: &dyn Fn(&str) -> bool) -> Result<(), ApiError> {
    match body.get("model").and_then(Value::as_str) {
        Some(m) if !allowed(m) => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// `GET /tokenizer_info`, as vLLM serves it: the default model's special
/// tokens, chat template and context length, for clients that tokenize
/// through the server (lm-eval's `tokenizer_backend=remote`).
fn tokenizer_info(state: &AppState) -> Result<Response<Body>, ApiError> {
    let engine = state.engine()?;
    let tok = engine.tokenizer();
    Ok(json_response(&json!({
        "bos_token": tok.bos_token(),
        "eos_token": tok.eos_token(),
        "pad_token": Value::Null,
        "add_bos_token": tok.add_bos(),
        "chat_template": tok.chat_template().map(|t| t.source()),
        "model_max_length": engine.max_model_len(),
        "vocab_size": engine.vocab_size(),
    })))
}

/// Loads the main model, then each `--extra-model` in turn, each followed
/// by a one-token forward; marks the server ready only once every model
/// has loaded and warmed up within the timeout.
fn load_and_warm_up(state: &AppState, args: &EngineArgs) -> Result<()> {
    let main = load_one(state, args, None)?;
    warn_reasoning_without_think_tokens(&state.config, main.tokenizer());
    let _ = state.models.main().engine.set(main);
    for (model, extra) in state.models.iter().skip(1).zip(&state.config.extra_models) {
        let name = &model.names[0];
        tracing::info!("loading --extra-model {name} ({})", model.root);
        let engine = load_one(state, &extra.args, models::labeled_recorder(name))
            .with_context(|| format!("--extra-model {name}"))?;
        let _ = model.engine.set(engine);
    }
    state.ready.store(true, Ordering::Release);
    Ok(())
}

/// Loads one model and runs a one-token forward through its engine, whose
/// metrics go through `recorder` when given.
fn load_one(
    state: &AppState,
    args: &EngineArgs,
    recorder: Option<Arc<dyn metrics::Recorder + Send + Sync>>,
) -> Result<AsyncEngine> {
    let core = crate::engine::build_engine(args)?;
    let engine = AsyncEngine::start_with_metrics(core, recorder)
        .context("cannot start the engine thread")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let bos = engine.tokenizer().bos_id().unwrap_or(0);
        let params = crate::engine::SamplingParams::greedy(1);
        // A pooling-only model warms up on a pooling request (it refuses
        // to generate).
        let opts = crate::engine::core::RequestOptions {
            pooling: !engine.generates(),
            ..Default::default()
        };
        let warm = async {
            engine
                .submit("warmup".into(), vec![bos], params, opts, tx)
                .await
                .map_err(|e| anyhow::anyhow!("warm-up request refused: {e}"))?;
            while let Some(o) = rx.recv().await {
                if o.finish_reason.is_some() {
                    return Ok(());
                }
            }
            anyhow::bail!("the engine stopped during warm-up")
        };
        tokio::time::timeout(state.config.ready_timeout, warm)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "the warm-up forward took longer than {:?}",
                    state.config.ready_timeout
                )
            })?
    })?;
    Ok(engine)
}

/// One start-up warning when `--reasoning-parser` is given for a tokenizer
/// that has no `<think>` / `</think>` tokens (harmony's `<|channel|>` /
/// `<|message|>` for openai_gptoss): such a model most likely
/// writes no reasoning tags, so the parser would find none (or take text
/// that merely spells them).
fn warn_reasoning_without_think_tokens(config: &ServerConfig, tok: &crate::tokenizer::Tokenizer) {
    let Some(parser) = config.reasoning_parser else {
        return;
    };
    let tags: &[&str] = if parser.is_harmony() {
        &[
            crate::server::openai::harmony::CHANNEL,
            crate::server::openai::harmony::MESSAGE,
        ]
    } else {
        &["<think>", "</think>"]
    };
    let missing: Vec<&str> = tags
        .iter()
        .copied()
        .filter(|t| tok.token_to_id(t).is_none())
        .collect();
    if !missing.is_empty() {
        tracing::warn!(
            "--reasoning-parser {}: the tokenizer has no {} token; this model likely writes no reasoning tags, so its output may never be split",
            parser.name(),
            missing.join(" or ")
        );
    }
}

/// Runs `pagoda serve` until SIGTERM or Ctrl-C.
pub fn serve(args: EngineArgs, config: ServerConfig) -> Result<()> {
    let metrics = install_metrics(config.served_model_names.first().map_or("", String::as_str))?;
    let runtime = crate::plugins::PluginRuntime::new(config.plugins.clone())?;
    let admin_token = config.admin_token.clone().filter(|t| !t.is_empty());
    if let Some(dir) = &config.state_dir {
        crate::tenants::store::create_private_dir(dir)
            .with_context(|| format!("cannot create --state-dir {}", dir.display()))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pagoda-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut tenants =
        crate::tenants::Tenants::new(runtime, config.state_dir.clone(), admin_token.clone())?;
    if let Some(url) = &config.state_store {
        use crate::tenants::shared::metrics as sm;
        for g in [sm::DROP_HELD, sm::SALT_CONFLICT] {
            metrics::gauge!(g).set(0.0);
        }
        metrics::counter!(sm::REFUSED_DROPS).increment(0);
        let store = Arc::new(crate::tenants::shared::StateStore::open(url)?);
        // The store's key salt, so every replica hashes keys alike; while
        // it is unreachable the cache's serves, and the first poll that
        // reaches it confirms or replaces that.
        let salt = match rt.block_on(store.salt(tenants.salt())) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!("{e}");
                None
            }
        };
        tenants = tenants.with_store(store, salt, config.state_store_max_drop_fraction)?;
    }
    let tenants = Arc::new(tenants);
    if let Some(dir) = &config.state_dir {
        let n = tenants
            .load_all()
            .context("cannot load the tenants from --state-dir")?;
        tracing::info!("loaded {n} tenants from {}", dir.display());
    }
    if let Some(store) = tenants.state_store() {
        match rt.block_on(tenants.sync_from_store()) {
            Ok(()) => tracing::info!(
                "state store {}: {} tenants",
                store.url(),
                tenants.ids().len()
            ),
            Err(e) => tracing::error!("{e:#}"),
        }
        let (t, every) = (Arc::clone(&tenants), config.state_poll);
        rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = t.sync_from_store().await {
                    // An outage is logged once, when it starts; anything
                    // else is worth a line every time.
                    if crate::tenants::shared::is_unavailable(&e) {
                        tracing::debug!("state store poll: {e:#}");
                    } else {
                        tracing::warn!("state store poll: {e:#}");
                    }
                }
            }
        });
    }
    let main_model = models::ServedModel::new(
        config.served_model_names.clone(),
        args.model.display().to_string(),
    );
    let extra_models = config
        .extra_models
        .iter()
        .map(|m| models::ServedModel::new(m.names.clone(), m.args.model.display().to_string()))
        .collect();
    let served = models::ServedModels::new(main_model, extra_models)?;
    let tenancy =
        admin_token.is_some() || config.state_dir.is_some() || config.state_store.is_some();
    let usage_log = match &config.usage_log {
        Some(c) => {
            let _in_runtime = rt.enter();
            let log = crate::metering::UsageLog::open(c)?;
            tracing::info!("usage records go to {}", c.target);
            Some(log)
        }
        None => None,
    };
    let state = Arc::new(AppState {
        usage_log,
        tenancy,
        models: served,
        responses: Default::default(),
        tenants,
        admin_token,
        max_pending: config.max_pending_requests,
        config,
        ready: AtomicBool::new(false),
        shutting_down: AtomicBool::new(false),
        load_error: OnceLock::new(),
        in_flight: AtomicUsize::new(0),
        metrics,
    });
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", state.config.host, state.config.port)
            .parse()
            .with_context(|| {
                format!(
                    "--host {} --port {} is not a socket address",
                    state.config.host, state.config.port
                )
            })?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let main_kind = if state.config.admin_addr.is_some() {
            Listener::Main
        } else {
            Listener::Both
        };
        let admin_listener = match &state.config.admin_addr {
            Some((h, p)) => {
                let a: SocketAddr = format!("{h}:{p}").parse().with_context(|| {
                    format!("--admin-host {h} --admin-port {p} is not a socket address")
                })?;
                let l = tokio::net::TcpListener::bind(a)
                    .await
                    .with_context(|| format!("cannot listen on {a}"))?;
                tracing::info!("admin API on http://{a}");
                Some(l)
            }
            None => None,
        };
        if let Some(port) = state.config.metrics_port {
            let a: SocketAddr = format!("{}:{port}", state.config.host)
                .parse()
                .with_context(|| format!("--metrics-port {port} is not a port on --host"))?;
            let l = tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("cannot listen on {a} (--metrics-port)"))?;
            tracing::info!("metrics and probes on http://{a}");
            let state = Arc::clone(&state);
            // Its own small pool, like the admin API's: scrapers and probes
            // get through whatever the API port is going through.
            let mut acceptor = connections::Acceptor::new(l, 64, "metrics");
            tokio::spawn(async move {
                loop {
                    let c = acceptor.accept().await;
                    let conn = serve_one(Arc::clone(&state), c, Listener::Metrics);
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!("metrics connection error: {e}");
                        }
                    });
                }
            });
        }
        let fd_limit = connections::raise_fd_limit();
        let max_connections = state
            .config
            .connections
            .max_connections
            .unwrap_or_else(|| connections::default_max_connections(fd_limit));
        tracing::info!(
            "serving up to {max_connections} connections at once (open-files limit {fd_limit})"
        );
        if let Some(l) = admin_listener {
            let state = Arc::clone(&state);
            // The admin API gets its own, small pool: a flood of the main
            // port never locks the operator out.
            let mut acceptor = connections::Acceptor::new(l, 256, "admin");
            tokio::spawn(async move {
                loop {
                    let c = acceptor.accept().await;
                    let state = Arc::clone(&state);
                    let conn = serve_one(state, c, Listener::Admin);
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!("admin connection error: {e}");
                        }
                    });
                }
            });
        }
        let mut acceptor = connections::Acceptor::new(listener, max_connections, "main");
        tracing::info!(
            "listening on http://{addr} (model loading; /health turns 200 when ready, /health/live is liveness)"
        );
        // Probes answer while the model loads, so load it off the runtime.
        let loader = {
            let state = Arc::clone(&state);
            tokio::task::spawn_blocking(move || {
                if let Err(e) = load_and_warm_up(&state, &args) {
                    tracing::error!("{e:#}");
                    let _ = state.load_error.set(format!("{e:#}"));
                    return Err(e);
                }
                tracing::info!("ready: serving {:?}", state.served_model_names());
                Ok(())
            })
        };
        tokio::spawn(log_stats(Arc::clone(&state)));
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let mut shutdown = Box::pin(shutdown_signal());
        let mut loader = Box::pin(loader);
        let mut load_failed = None;
        // Resolves once a loaded engine dies (see `AsyncEngine::died`).
        let mut died: std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>> =
            Box::pin(std::future::pending());
        let mut engine_death = None;
        loop {
            tokio::select! {
                c = acceptor.accept() => {
                    let conn = graceful.watch(serve_one(Arc::clone(&state), c, main_kind));
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!("connection error: {e}");
                        }
                    });
                }
                r = &mut loader, if load_failed.is_none() => {
                    match r {
                        Ok(Ok(())) => {
                            load_failed = Some(false);
                            // Any engine's death ends the server.
                            let engines: Vec<AsyncEngine> =
                                state.models.engines().cloned().collect();
                            if !engines.is_empty() {
                                died = Box::pin(async move {
                                    let deaths = engines.iter().map(|e| Box::pin(e.died()));
                                    futures_util::future::select_all(deaths).await.0
                                });
                            }
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(e) => return Err(anyhow::anyhow!("the model loader panicked: {e}")),
                    }
                }
                why = &mut died => {
                    if engine_death.is_some() {
                        break; // the drain below is over
                    }
                    // Requests in flight have their 503s already (their
                    // channels closed with the engine) and the probes answer
                    // 503 now; keep accepting for a moment so both are
                    // written and seen, then exit non-zero so that the
                    // supervisor restarts us.
                    tracing::error!("the engine died ({why}); exiting");
                    engine_death = Some(why);
                    let drain = ENGINE_DEATH_DRAIN.min(state.config.shutdown_grace);
                    died = Box::pin(async move {
                        tokio::time::sleep(drain).await;
                        String::new()
                    });
                }
                _ = &mut shutdown => break,
            }
        }
        tracing::info!(
            "shutting down: finishing requests in flight (grace {:?})",
            state.config.shutdown_grace
        );
        drop(acceptor);
        match tokio::time::timeout(state.config.shutdown_grace, graceful.shutdown()).await {
            Ok(()) => tracing::info!("all connections closed"),
            Err(_) => tracing::warn!("grace period over; closing remaining connections"),
        }
        state.shutting_down.store(true, Ordering::Release);
        for e in state.models.engines() {
            e.shutdown();
        }
        if let Some(log) = &state.usage_log {
            log.close().await;
        }
        match engine_death {
            Some(why) => Err(anyhow::anyhow!("the engine died: {why}")),
            None => Ok(()),
        }
    })
}

/// Serves one accepted connection: every request through [`route`], except
/// that a connection from the overflow pool gets the probes at once and
/// other requests once a normal slot is free (if none comes soon, a 503
/// telling the client to retry).
fn serve_one(
    state: Arc<AppState>,
    c: connections::Accepted,
    listener: Listener,
) -> impl hyper_util::server::graceful::GracefulConnection<Error = hyper::Error> + Send + 'static {
    let overflow = c.overflow;
    // It holds the connection's slot: the service (and so `conn`) lives as
    // long as the connection.
    let conn = c.conn;
    let builder = connections::http1_builder(&state.config.connections, &conn);
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let state = Arc::clone(&state);
        // In progress (never evicted, unless its body stalls) until the
        // response has been sent.
        let busy = conn.request_started();
        req.extensions_mut().insert(busy.body_watch());
        async move {
            if overflow
                && !connections::served_when_full(req.uri().path())
                && !busy.wait_for_slot().await
            {
                let mut e = ApiError::unavailable(
                    "The server has too many open connections. Retry shortly.",
                );
                e.retry_after = Some(1);
                return Ok::<_, std::convert::Infallible>(e.response());
            }
            let resp = route(state, req, listener).await;
            let (parts, body) = resp.into_parts();
            let body = body
                .map_frame(move |f| {
                    let _ = &busy;
                    f
                })
                .boxed_unsync();
            Ok(Response::from_parts(parts, body))
        }
    });
    builder.serve_connection(TokioIo::new(c.stream), svc)
}

/// How long a server whose engine died keeps answering (503s, unhealthy
/// probes) before it exits: long enough for the responses in flight to be
/// written and for a probe to see the failure, short enough that the
/// supervisor restarts it promptly. Capped by `--shutdown-grace-seconds`.
const ENGINE_DEATH_DRAIN: Duration = Duration::from_secs(2);

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// Logs a line like vLLM's every 10 s while there is activity, one per
/// model (an extra model's named at its start).
async fn log_stats(state: Arc<AppState>) {
    let n = state.models.iter().count();
    let mut last = vec![None; n];
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    loop {
        tick.tick().await;
        for (i, m) in state.models.iter().enumerate() {
            let Some(engine) = m.engine() else {
                continue;
            };
            let who = if i == 0 {
                String::new()
            } else {
                format!("{}: ", m.names[0])
            };
            log_engine_stats(&who, engine, &mut last[i]);
        }
    }
}

/// One engine's lines of [`log_stats`], against its stats of last time.
fn log_engine_stats(
    who: &str,
    engine: &AsyncEngine,
    last: &mut Option<(std::time::Instant, crate::engine::core::EngineStats)>,
) {
    let s = engine.stats();
    let now = std::time::Instant::now();
    if let Some((t, prev)) = last.take() {
        let dt = (now - t).as_secs_f64();
        let prompt = (s.prompt_tokens - prev.prompt_tokens) as f64 / dt;
        let gen = (s.generation_tokens - prev.generation_tokens) as f64 / dt;
        if prompt > 0.0 || gen > 0.0 || s.num_running > 0 || s.num_waiting > 0 {
            let hit = if s.prefix.queries > 0 {
                100.0 * s.prefix.hits as f64 / s.prefix.queries as f64
            } else {
                0.0
            };
            tracing::info!(
                "{who}Avg prompt throughput: {prompt:.1} tokens/s, Avg generation throughput: {gen:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%, Prefix cache hit rate: {hit:.1}%",
                s.num_running,
                s.num_waiting,
                100.0 * s.kv_usage
            );
        }
        let (spec, was) = (&s.spec, &prev.spec);
        let drafted = spec.num_draft_tokens - was.num_draft_tokens;
        if drafted > 0 {
            let drafts = (spec.num_drafts - was.num_drafts).max(1);
            let accepted = spec.num_accepted_tokens - was.num_accepted_tokens;
            let per_pos: Vec<String> = (0..spec.num_positions)
                .map(|p| {
                    format!(
                        "{:.3}",
                        (spec.accepted_per_pos[p] - was.accepted_per_pos[p]) as f64 / drafts as f64
                    )
                })
                .collect();
            tracing::info!(
                "{who}SpecDecoding metrics: Mean acceptance length: {:.2}, Accepted throughput: {:.2} tokens/s, Drafted throughput: {:.2} tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {}, Avg Draft acceptance rate: {:.1}%",
                1.0 + accepted as f64 / drafts as f64,
                accepted as f64 / dt,
                drafted as f64 / dt,
                per_pos.join(", "),
                100.0 * accepted as f64 / drafted as f64
            );
        }
    }
    *last = Some((now, s));
}
