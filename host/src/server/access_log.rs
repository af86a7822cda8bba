//! The access log: one line per request, written when the response has
//! been sent (for a stream, after its last event, or when the client went
//! away), through `tracing` under the target `pagoda::access`.
//!
//! A line holds the method, path, status, tenant id (never the key), the
//! LoRA adapter it ran with (`-` for the base model), the request id, prompt and completion tokens, time to first token and total
//! latency, and for a 4xx or 5xx the OpenAI error type. Prompt text is
//! logged only with `--enable-log-requests`. `--disable-uvicorn-access-log`
//! turns the lines off, as it turns off vLLM's; `--log-format json` makes
//! every log line (these included) one JSON object.
//!
//! Handlers deep in the request (the generation run, which may outlive the
//! route on a spawned task) fill in what only they know through the
//! request's [`Record`], found with [`current`] while the route runs.

use crate::server::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::Response;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// What the operator asked the access log to do.
#[derive(Clone, Copy, Debug)]
pub struct AccessLogConfig {
    /// One line per request (off with `--disable-uvicorn-access-log`).
    pub enabled: bool,
    /// Add the prompt text, cut to [`PROMPT_CHARS`] characters
    /// (`--enable-log-requests`).
    pub log_prompts: bool,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        AccessLogConfig {
            enabled: true,
            log_prompts: false,
        }
    }
}

/// The most prompt characters a line carries with `--enable-log-requests`.
pub const PROMPT_CHARS: usize = 500;

const UNSET: usize = usize::MAX;

/// What one request's handlers learn about it, for its log line.
#[derive(Debug)]
pub struct Record {
    /// The route the request came in on.
    path: String,
    tenant: Mutex<Option<String>>,
    /// A short hash of the API key it came with (never the key).
    key_id: Mutex<Option<String>>,
    /// The LoRA adapter the request ran with (a tenant's own, or shared).
    adapter: Mutex<Option<String>>,
    request_id: Mutex<Option<String>>,
    prompt_tokens: AtomicUsize,
    completion_tokens: AtomicUsize,
    first_token: OnceLock<Instant>,
    prompt: Mutex<Option<String>>,
    log_prompts: bool,
}

impl Record {
    fn new(path: &str, log_prompts: bool) -> Record {
        Record {
            path: path.to_string(),
            tenant: Mutex::new(None),
            key_id: Mutex::new(None),
            adapter: Mutex::new(None),
            request_id: Mutex::new(None),
            prompt_tokens: AtomicUsize::new(UNSET),
            completion_tokens: AtomicUsize::new(UNSET),
            first_token: OnceLock::new(),
            prompt: Mutex::new(None),
            log_prompts,
        }
    }

    /// The LoRA adapter the request runs with.
    pub fn set_adapter(&self, name: &str) {
        *self.adapter.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.to_string());
    }

    /// The tenant the request was authenticated as.
    pub fn set_tenant(&self, id: &str) {
        *self.tenant.lock().unwrap_or_else(|e| e.into_inner()) = Some(id.to_string());
    }

    /// The short hash of the API key the request came with.
    pub fn set_key_id(&self, id: String) {
        *self.key_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
    }

    /// The route the request came in on.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The tenant, the key's short hash and the adapter, as set so far
    /// (for the request's usage record).
    pub fn who(&self) -> (Option<String>, Option<String>, Option<String>) {
        let get = |m: &Mutex<Option<String>>| m.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (get(&self.tenant), get(&self.key_id), get(&self.adapter))
    }

    /// The id the response carries (`cmpl-…`, `chatcmpl-…`, `resp_…`).
    pub fn set_request_id(&self, id: &str) {
        *self.request_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(id.to_string());
    }

    /// Token counts as the response's usage reports them.
    pub fn set_tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens.store(prompt, Ordering::Relaxed);
        self.completion_tokens.store(completion, Ordering::Relaxed);
    }

    /// Notes the first generated token (the first call wins).
    pub fn first_token(&self) {
        let _ = self.first_token.set(Instant::now());
    }

    /// Whether the prompt text is wanted; callers skip decoding it if not.
    pub fn wants_prompt(&self) -> bool {
        self.log_prompts
    }

    /// The prompt text, kept only with `--enable-log-requests`.
    pub fn set_prompt(&self, text: &str) {
        if self.log_prompts {
            let cut: String = text.chars().take(PROMPT_CHARS).collect();
            *self.prompt.lock().unwrap_or_else(|e| e.into_inner()) = Some(cut);
        }
    }
}

tokio::task_local! {
    static CURRENT: Arc<Record>;
}

/// The record of the request being routed on this task, if any.
pub fn current() -> Option<Arc<Record>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// One request on its way through the route: created when it arrives,
/// written out when its response body is dropped.
pub struct Pending {
    config: AccessLogConfig,
    record: Arc<Record>,
    method: String,
    path: String,
    started: Instant,
    status: u16,
    error_type: Option<&'static str>,
}

impl Pending {
    /// A request that just arrived.
    pub fn start(config: AccessLogConfig, method: &str, path: &str) -> Pending {
        Pending {
            config,
            record: Arc::new(Record::new(path, config.log_prompts)),
            method: method.to_string(),
            path: path.to_string(),
            started: Instant::now(),
            status: 0,
            error_type: None,
        }
    }

    /// Runs the route with this request's record reachable by [`current`].
    pub async fn scope<F: std::future::Future>(&self, f: F) -> F::Output {
        CURRENT.scope(Arc::clone(&self.record), f).await
    }

    /// The request's record.
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// Ties the line to `resp`: it is written when the body has been sent
    /// or dropped. `error_type` is the OpenAI error type of a failure.
    pub fn finish(
        mut self,
        resp: Response<Body>,
        error_type: Option<&'static str>,
    ) -> Response<Body> {
        if !self.config.enabled {
            return resp;
        }
        self.status = resp.status().as_u16();
        self.error_type = error_type;
        let (parts, body) = resp.into_parts();
        // The closure owns `self`; the mapped body owns the closure, so the
        // line is written when hyper drops the body.
        let body = body
            .map_frame(move |f: hyper::body::Frame<Bytes>| {
                let _ = &self;
                f
            })
            .boxed_unsync();
        Response::from_parts(parts, body)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.config.enabled || self.status == 0 {
            return;
        }
        let r = &self.record;
        let tenant = r.tenant.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let adapter = r.adapter.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let request_id = r
            .request_id
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let prompt = r.prompt.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let count = |a: &AtomicUsize| {
            let v = a.load(Ordering::Relaxed);
            (v != UNSET).then_some(v as u64)
        };
        let ms = |d: std::time::Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        let ttft = r
            .first_token
            .get()
            .map(|t| ms(t.duration_since(self.started)));
        tracing::info!(
            target: "pagoda::access",
            method = %self.method,
            path = %self.path,
            status = self.status,
            tenant = %tenant.as_deref().unwrap_or("-"),
            adapter = %adapter.as_deref().unwrap_or("-"),
            request_id = %request_id.as_deref().unwrap_or("-"),
            prompt_tokens = count(&r.prompt_tokens),
            completion_tokens = count(&r.completion_tokens),
            ttft_ms = ttft,
            latency_ms = ms(self.started.elapsed()),
            error = self.error_type.map(tracing::field::display),
            prompt = prompt.as_deref(),
            "request"
        );
    }
}
