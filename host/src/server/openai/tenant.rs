//! A tenant's request through its plugin chain: admission (limits and one
//! snapshot), `route`, `render-prompt`, and the output hooks. Hook calls run
//! on blocking threads (wasmtime calls are synchronous and may take up to
//! their deadline), with the request's one `Store` moved there and back.

use crate::plugins::{ErrorKind, HookError, HookKind, RouteDecision, Session};
use crate::server::errors::ApiError;
use crate::server::AppState;
use crate::tenants::{Admission, Tenant, TenantError};
use serde_json::{json, Value};
use std::sync::Arc;

/// A tenant's request in flight.
pub struct TenantCtx {
    pub admission: Admission,
    session: Option<Box<Session>>,
    /// Chain indices with `on-chunk`, in order.
    on_chunk: Vec<usize>,
    /// Chain indices for non-streamed output: (index, has post-process).
    post: Vec<(usize, bool)>,
    failed: Vec<bool>,
}

/// The OpenAI error of a failed hook under a fail-closed policy.
pub fn hook_error(e: &HookError) -> ApiError {
    let status = match e.kind {
        ErrorKind::Instantiate => 503,
        _ => 500,
    };
    ApiError::plugin(status, "plugin_error", format!("{e}"))
}

/// A tenant's refusal of a request: a 429 for the tenant's own limits,
/// a 503 when plugin instances run short; both with the `Retry-After` the
/// refusal knows (1 s where it knows none).
impl From<TenantError> for ApiError {
    fn from(e: TenantError) -> ApiError {
        let message = e.to_string();
        match e {
            TenantError::TooManyInFlight { .. } => ApiError::overloaded(message),
            TenantError::PerMinute { retry_after, .. } => ApiError {
                retry_after: Some(retry_after),
                ..ApiError::overloaded(message)
            },
            TenantError::PluginShareInUse { .. } | TenantError::PluginPoolInUse { .. } => {
                ApiError {
                    retry_after: Some(1),
                    ..ApiError::unavailable(message)
                }
            }
        }
    }
}

impl TenantCtx {
    /// Admits a request: concurrency and token limits, one snapshot of the
    /// tenant's config and chain for the whole request.
    pub fn admit(
        state: &AppState,
        tenant: &Arc<Tenant>,
        request_id: &str,
    ) -> Result<TenantCtx, ApiError> {
        let admission = state.tenants.admit(tenant)?;
        let snap = Arc::clone(&admission.snapshot);
        let session = if snap.chain.is_empty() {
            None
        } else {
            let models: Vec<String> = state
                .served_model_names()
                .iter()
                .filter(|m| snap.allows_model(m))
                .cloned()
                .collect();
            Some(Box::new(Session::new(
                Arc::clone(&state.tenants.runtime),
                &tenant.id,
                request_id,
                models,
                snap.chain.clone(),
                snap.config.plugin_limits.clone(),
            )))
        };
        let (on_chunk, post) = match &session {
            Some(s) => {
                let on_chunk = s.with_hook(HookKind::OnChunk);
                let post = (0..s.chain().len())
                    .filter_map(|i| {
                        let p = &s.chain()[i].plugin;
                        if p.has(HookKind::PostProcess) {
                            Some((i, true))
                        } else if p.has(HookKind::OnChunk) {
                            Some((i, false))
                        } else {
                            None
                        }
                    })
                    .collect();
                (on_chunk, post)
            }
            None => (Vec::new(), Vec::new()),
        };
        let n = snap.chain.len();
        Ok(TenantCtx {
            admission,
            session,
            on_chunk,
            post,
            failed: vec![false; n],
        })
    }

    pub fn tenant_id(&self) -> &str {
        &self.admission.tenant.id
    }

    /// Whose prefix-cache blocks the tenant's requests may share: its
    /// cache group's, or its own. Group and tenant names live apart, so a
    /// tenant never shares with a group named like it.
    pub fn cache_scope(&self) -> String {
        match &self.admission.snapshot.config.cache_group {
            Some(g) => format!("group:{g}"),
            None => format!("tenant:{}", self.tenant_id()),
        }
    }

    /// The tenant's share of the engine, as its requests carry it.
    pub fn share(&self) -> crate::engine::fair_share::TenantShare {
        let s = &self.admission.snapshot.config.scheduling;
        crate::engine::fair_share::TenantShare {
            name: self.admission.tenant.id.as_str().into(),
            weight: s.weight,
            priority_class: s.priority_class,
            kv: self.admission.snapshot.config.kv_cache.share(),
        }
    }

    /// 404 unless the tenant may use `model`.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if self.admission.snapshot.allows_model(model) {
            Ok(())
        } else {
            Err(ApiError::model_not_found(model))
        }
    }

    fn fail_open(&self, i: usize, h: HookKind) -> bool {
        self.admission.snapshot.chain[i].fail_open(h)
    }

    /// Runs `f` on the session on a blocking thread.
    async fn run<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Session) -> R + Send + 'static,
    ) -> Result<R, ApiError> {
        let mut s = self
            .session
            .take()
            .ok_or_else(|| ApiError::internal("the plugin session was lost"))?;
        let (s, r) = tokio::task::spawn_blocking(move || {
            let r = f(&mut s);
            (s, r)
        })
        .await
        .map_err(|e| ApiError::internal(format!("a plugin task failed: {e}")))?;
        self.session = Some(s);
        Ok(r)
    }

    fn has_hook(&self, h: HookKind) -> Vec<usize> {
        self.session
            .as_ref()
            .map(|s| s.with_hook(h))
            .unwrap_or_default()
    }

    /// `route` of each plugin in order; `modify` feeds the next.
    pub async fn route(&mut self, endpoint: &str, mut body: Value) -> Result<Value, ApiError> {
        for i in self.has_hook(HookKind::Route) {
            let req = json!({"endpoint": endpoint, "body": body}).to_string();
            match self.run(move |s| s.route(i, &req)).await? {
                Ok(RouteDecision::Continue) => {}
                Ok(RouteDecision::Reject(r)) => {
                    return Err(ApiError::plugin(r.status, "plugin_rejected", r.message));
                }
                Ok(RouteDecision::Modify(s)) => match serde_json::from_str::<Value>(&s) {
                    Ok(v) if v.is_object() => body = v,
                    _ => {
                        let e = HookError {
                            plugin: self.admission.snapshot.chain[i].plugin.name.clone(),
                            hook: HookKind::Route,
                            kind: ErrorKind::BadOutput,
                            detail: "modify returned something that is not a JSON object".into(),
                        };
                        if !self.fail_open(i, HookKind::Route) {
                            return Err(hook_error(&e));
                        }
                    }
                },
                Err(e) => {
                    self.failed[i] = true;
                    if !self.fail_open(i, HookKind::Route) {
                        return Err(hook_error(&e));
                    }
                }
            }
        }
        Ok(body)
    }

    /// Whether a plugin of the chain has `render-prompt`.
    pub fn has_render_prompt(&self) -> bool {
        !self.has_hook(HookKind::RenderPrompt).is_empty()
    }

    /// `render-prompt`: the first plugin that returns a prompt wins.
    pub async fn render(
        &mut self,
        body: &Value,
        template: Option<String>,
    ) -> Result<Option<String>, ApiError> {
        let req = body.to_string();
        for i in self.has_hook(HookKind::RenderPrompt) {
            let (r, t) = (req.clone(), template.clone());
            match self
                .run(move |s| s.render_prompt(i, &r, t.as_deref()))
                .await?
            {
                Ok(Ok(Some(p))) => return Ok(Some(p)),
                Ok(Ok(None)) => {}
                Ok(Err(msg)) => return Err(ApiError::plugin(400, "plugin_rejected", msg)),
                Err(e) => {
                    self.failed[i] = true;
                    if !self.fail_open(i, HookKind::RenderPrompt) {
                        return Err(hook_error(&e));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Whether streamed text passes through plugins.
    pub fn has_on_chunk(&self) -> bool {
        !self.on_chunk.is_empty()
    }

    /// Streamed text of `choice` through the `on-chunk` chain.
    pub async fn on_chunk(
        &mut self,
        choice: usize,
        text: String,
        finish: bool,
        tokens: (u32, u32),
    ) -> Result<String, ApiError> {
        let order = self.on_chunk.clone();
        let fail_open: Vec<bool> = order
            .iter()
            .map(|&i| self.fail_open(i, HookKind::OnChunk))
            .collect();
        let failed = self.failed.clone();
        let (out, newly_failed) = self
            .run(move |s| {
                s.set_tokens(tokens.0, tokens.1);
                let mut text = text;
                let mut newly = Vec::new();
                for (k, &i) in order.iter().enumerate() {
                    if failed[i] {
                        continue; // fail-open plugin that failed earlier: pass through
                    }
                    match s.on_chunk(i, choice as u32, &text, finish) {
                        Ok(t) => text = t,
                        Err(e) => {
                            newly.push(i);
                            if !fail_open[k] {
                                return (Err(e), newly);
                            }
                        }
                    }
                }
                (Ok(text), newly)
            })
            .await?;
        for i in newly_failed {
            self.failed[i] = true;
        }
        out.map_err(|e| hook_error(&e))
    }

    /// The complete text of a non-streamed choice through `post-process`
    /// (or, for plugins without it, one final `on-chunk`).
    pub async fn post_process(
        &mut self,
        choice: usize,
        text: String,
        tokens: (u32, u32),
    ) -> Result<String, ApiError> {
        let mut text = text;
        for (i, has_post) in self.post.clone() {
            if self.failed[i] {
                continue;
            }
            let t = text.clone();
            let r = self
                .run(move |s| {
                    s.set_tokens(tokens.0, tokens.1);
                    if has_post {
                        s.post_process(i, choice as u32, &t)
                    } else {
                        s.on_chunk(i, choice as u32, &t, true).map(Ok)
                    }
                })
                .await?;
            match r {
                Ok(Ok(t)) => text = t,
                Ok(Err(msg)) => {
                    return Err(ApiError::plugin(
                        500,
                        "plugin_error",
                        format!(
                            "plugin '{}' failed the response: {msg}",
                            self.admission.snapshot.chain[i].plugin.name
                        ),
                    ))
                }
                Err(e) => {
                    self.failed[i] = true;
                    if !self.fail_open(
                        i,
                        if has_post {
                            HookKind::PostProcess
                        } else {
                            HookKind::OnChunk
                        },
                    ) {
                        return Err(hook_error(&e));
                    }
                }
            }
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::StatusCode;

    /// Each refusal keeps the status, type, code, message and Retry-After
    /// the server answered before tenants had an error type of their own.
    #[test]
    fn tenant_refusals_answer_as_before() {
        let t = || "acme".to_string();
        let cases = [
            (
                TenantError::TooManyInFlight { tenant: t(), max: 2 },
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                "Tenant 'acme' has 2 requests in flight, its limit. Retry later.",
                1,
            ),
            (
                TenantError::PerMinute {
                    tenant: t(),
                    what: "tokens",
                    per_minute: 600,
                    retry_after: 7,
                },
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                "Tenant 'acme' used its 600 tokens per minute. Retry after 7 s.",
                7,
            ),
            (
                TenantError::PluginShareInUse { tenant: t(), share: 4 },
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "service_unavailable",
                "Tenant 'acme' has its share of 4 plugin instances in use by requests in flight. Retry later.",
                1,
            ),
            (
                TenantError::PluginPoolInUse { total: 16 },
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "service_unavailable",
                "All 16 plugin instances are in use by requests in flight. Retry later.",
                1,
            ),
        ];
        for (e, status, kind, code, message, retry_after) in cases {
            let a = ApiError::from(e);
            assert_eq!(
                (
                    a.status,
                    a.kind,
                    a.code,
                    a.message.as_str(),
                    a.param,
                    a.retry_after
                ),
                (status, kind, code, message, None, Some(retry_after))
            );
        }
    }
}
