//! The admin API: tenants and their plugins. Guarded by its own token
//! (`--admin-token` / `PAGODA_ADMIN_TOKEN`); without one every admin route
//! answers 404. Tenant API keys get a 403 here.
//!
//! - `GET /admin/v1/tenants`
//! - `PUT|GET|DELETE /admin/v1/tenants/{id}`
//! - `GET /admin/v1/tenants/{id}/plugins`
//! - `PUT /admin/v1/tenants/{id}/plugins/{name}` (body: component bytes;
//!   config: `?config=<urlencoded JSON>` or header `x-pagoda-plugin-config`)
//! - `POST /admin/v1/tenants/{id}/plugins/{name}/rollback`
//! - `GET /admin/v1/tenants/{id}/adapters`
//! - `PUT /admin/v1/tenants/{id}/adapters/{name}[?shared=true]` (body:
//!   multipart/form-data with the parts `adapter_config.json` and
//!   `adapter_model.safetensors`)
//! - `DELETE /admin/v1/tenants/{id}/adapters/{name}`
//! - `POST /admin/v1/tenants/{id}/adapters/{name}/rollback`

use super::auth::{bearer_token, same};
use super::body::read_limited;
use super::errors::{json_response, ApiError};
use super::{AppState, Body};
use crate::tenants::TenantSpec;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use std::sync::Arc;

/// Largest component accepted.
pub const MAX_PLUGIN_BYTES: usize = 64 << 20;

/// Largest adapter upload accepted (both files): a rank-64 adapter on
/// every projection of an 8B model is about 336 MB in f16.
pub const MAX_ADAPTER_BYTES: usize = 1 << 30;

/// The answer to a refused adapter: a quota is a 400 with the code
/// `adapter_quota_exceeded` naming its limit, the state store's faults as
/// [`bad`] reports them, anything else (an adapter that does not fit the
/// base, a bad upload, a stored adapter that no longer loads) a 400 that
/// says why.
pub fn adapter_error(e: anyhow::Error) -> ApiError {
    use crate::tenants::adapters::AdapterError;
    match e.downcast_ref::<AdapterError>() {
        Some(q) => ApiError {
            code: "adapter_quota_exceeded",
            ..ApiError::invalid(None, q.to_string())
        },
        None => bad(e),
    }
}

fn percent_decode(s: &str) -> Result<String, ApiError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(x) => out.push(x),
                    None => {
                        return Err(ApiError::invalid(
                            Some("config".into()),
                            "bad percent-encoding in the query",
                        ))
                    }
                }
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out)
        .map_err(|_| ApiError::invalid(Some("config".into()), "the config is not UTF-8"))
}

fn query_param(req: &Request<Incoming>, name: &str) -> Result<Option<String>, ApiError> {
    let Some(q) = req.uri().query() else {
        return Ok(None);
    };
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == name {
            return percent_decode(v).map(Some);
        }
    }
    Ok(None)
}

/// An admin change that failed: a lost race with another replica (409) or
/// an unreachable state store (503) as such, anything else as bad input.
fn bad(e: anyhow::Error) -> ApiError {
    use crate::tenants::shared::StoreError;
    match e.downcast_ref::<StoreError>() {
        Some(StoreError::Conflict(_)) => ApiError::conflict(format!("{e:#}")),
        Some(StoreError::Unavailable { .. }) => {
            let mut a = ApiError::unavailable(format!("{e:#}"));
            a.retry_after = Some(5);
            a
        }
        // The store's fault, not the client's: a 5xx naming the object.
        Some(StoreError::Corrupt { .. }) => ApiError {
            status: StatusCode::BAD_GATEWAY,
            kind: "server_error",
            code: "state_store_corrupt",
            ..ApiError::internal(format!("{e:#}"))
        },
        None => ApiError::invalid(None, format!("{e:#}")),
    }
}

fn tenant_not_found(id: &str) -> ApiError {
    ApiError {
        code: "tenant_not_found",
        ..ApiError::not_found(&format!("tenant '{id}'"))
    }
}

fn tenant_view(state: &AppState, t: &crate::tenants::Tenant) -> serde_json::Value {
    let s = t.snapshot();
    let c = &s.config;
    json!({
        "id": c.id,
        "api_key_hashes": c.api_key_hashes,
        "models": c.models,
        "limits": c.limits,
        "scheduling": c.scheduling,
        // How the tenant appears in /metrics (--metrics-tenant-label).
        "metrics_label": crate::tenants::metric_label::of(&c.id),
        "plugins": c.plugins,
        "plugin_limits": c.plugin_limits,
        "chain": s.chain.iter().map(|e| json!({"name": e.plugin.name, "version": e.plugin.version, "sha256": e.plugin.sha256})).collect::<Vec<_>>(),
        "installed": state.tenants.list_plugins(t)["data"],
        "adapter_limits": c.adapter_limits,
        "kv_cache": c.kv_cache,
        // The per-minute budgets and what is left of each now.
        "rate_limits": t.rate_limits(),
        "cache_group": c.cache_group,
        "adapters": s.adapters,
        // With --state-store: the revision of the shared manifest this
        // replica serves (each landed change adds one).
        "state_revision": state.tenants.revision_of(&c.id),
        // Why the store's newer state is not applied here (it is held at
        // state_revision), if it is not: repair by PUT or DELETE.
        "state_error": state.tenants.state_fault(&c.id),
    })
}

/// Handles `/admin/...`.
pub async fn route(
    state: Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let Some(token) = state.admin_token.as_deref() else {
        return Err(ApiError::not_found(&path));
    };
    match bearer_token(req.headers()) {
        Some(k) if same(k, token) => {}
        Some(k)
            if state.tenants.by_key(k).is_some()
                || state.config.api_key.as_deref().is_some_and(|a| same(a, k)) =>
        {
            return Err(ApiError::forbidden(
                "This key may not use the admin API; pass the admin token.",
            ));
        }
        _ => {
            return Err(ApiError {
                message: "Incorrect admin token. Pass it as 'Authorization: Bearer TOKEN'.".into(),
                ..ApiError::invalid_api_key()
            })
        }
    }
    let parts: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(str::to_string)
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let method = req.method().clone();
    match (method, parts.as_slice()) {
        (Method::POST, ["admin", "v1", "reset_prefix_cache"]) => {
            state.engine()?;
            // Every model's cache (an --extra-model has its own engine).
            for engine in state.models().engines() {
                match engine.reset_prefix_cache().await {
                    Some(Ok(())) => {}
                    Some(Err(held)) => return Err(ApiError::conflict(format!(
                        "the prefix cache cannot be reset while requests run ({held} blocks are held); retry when the server is idle"
                    ))),
                    None => return Err(ApiError::unavailable("the engine has stopped")),
                }
            }
            Ok(json_response(&json!({"reset": true})))
        }
        (Method::GET, ["admin", "v1", "state-store"]) => {
            let t = &state.tenants;
            let store = t.state_store().ok_or_else(|| {
                ApiError::not_found("the state store (this server runs without --state-store)")
            })?;
            Ok(json_response(&json!({
                "url": store.url(),
                "reachable": store.is_up(),
                "serving": t.not_serving().is_none(),
                "not_serving_because": t.not_serving(),
                "held_drop": t.held_drop(),
            })))
        }
        (Method::POST, ["admin", "v1", "state-store", "confirm-drop"]) => {
            let dropped = state.tenants.confirm_drop().await.map_err(bad)?;
            Ok(json_response(&json!({"dropped": dropped})))
        }
        (Method::GET, ["admin", "v1", "tenants"]) => {
            let ids = state.tenants.ids();
            Ok(json_response(&json!({"object": "list", "data": ids})))
        }
        (Method::PUT, ["admin", "v1", "tenants", id]) => {
            let body = read_limited(req, 1 << 20).await?;
            let spec: TenantSpec = serde_json::from_slice(&body)
                .map_err(|e| ApiError::invalid(None, format!("bad tenant body: {e}")))?;
            let (created, _) = state.tenants.put(id, spec).await.map_err(bad)?;
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            let mut r = json_response(&tenant_view(&state, &t));
            if created {
                *r.status_mut() = StatusCode::CREATED;
            }
            Ok(r)
        }
        (Method::GET, ["admin", "v1", "tenants", id]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            Ok(json_response(&tenant_view(&state, &t)))
        }
        (Method::DELETE, ["admin", "v1", "tenants", id]) => {
            if state.tenants.delete(id).await.map_err(|e| {
                if e.downcast_ref::<crate::tenants::shared::StoreError>()
                    .is_some()
                {
                    bad(e)
                } else {
                    ApiError::internal(format!("{e:#}"))
                }
            })? {
                Ok(json_response(&json!({"id": id, "deleted": true})))
            } else {
                Err(tenant_not_found(id))
            }
        }
        (Method::GET, ["admin", "v1", "tenants", id, "plugins"]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            Ok(json_response(&state.tenants.list_plugins(&t)))
        }
        (Method::PUT, ["admin", "v1", "tenants", id, "plugins", name]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            let mut config = query_param(&req, "config")?;
            if config.is_none() {
                if let Some(h) = req.headers().get("x-pagoda-plugin-config") {
                    config = Some(
                        h.to_str()
                            .map_err(|_| {
                                ApiError::invalid(
                                    Some("config".into()),
                                    "x-pagoda-plugin-config is not text",
                                )
                            })?
                            .to_string(),
                    );
                }
            }
            let name = name.to_string();
            let body = read_limited(req, MAX_PLUGIN_BYTES).await?;
            if body.is_empty() {
                return Err(ApiError::invalid(
                    None,
                    "the body must be the plugin's component bytes (.wasm)",
                ));
            }
            let r = state
                .tenants
                .upload(&t, &name, body, config)
                .await
                .map_err(|e| {
                    tracing::warn!(tenant = %t.id, plugin = %name, "upload refused: {e:#}");
                    bad(e)
                })?;
            tracing::info!(tenant = %t.id, plugin = %name, version = r.version, sha256 = %r.sha256, "plugin version active");
            let mut resp = json_response(&json!({
                "tenant": t.id, "name": name, "version": r.version, "sha256": r.sha256, "size": r.size,
                "plugin_name": r.meta.name, "plugin_version": r.meta.version, "hooks": r.meta.hooks, "active": true,
            }));
            *resp.status_mut() = StatusCode::CREATED;
            Ok(resp)
        }
        (Method::POST, ["admin", "v1", "tenants", id, "plugins", name, "rollback"]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            let r = state.tenants.rollback(&t, name).await.map_err(bad)?;
            Ok(json_response(
                &json!({"tenant": t.id, "name": name, "version": r.version, "sha256": r.sha256, "active": true}),
            ))
        }
        (Method::GET, ["admin", "v1", "tenants", id, "adapters"]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            Ok(json_response(&state.tenants.list_adapters(&t)))
        }
        (Method::PUT, ["admin", "v1", "tenants", id, "adapters", name]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            let name = name.to_string();
            if state.served_model_names().iter().any(|n| *n == name) {
                return Err(ApiError::invalid(
                    Some("name".into()),
                    format!("the adapter name '{name}' is a served model's name; choose another"),
                ));
            }
            let engine = state.engine()?;
            let loras = engine.lora_registry().cloned().ok_or_else(|| {
                ApiError::invalid(
                    None,
                    "LoRA adapters are not enabled; start the server with --enable-lora",
                )
            })?;
            let content_type = req
                .headers()
                .get(hyper::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let shared = match query_param(&req, "shared")?.as_deref() {
                None | Some("false") | Some("0") => false,
                Some("true") | Some("1") => true,
                Some(other) => {
                    return Err(ApiError::invalid(
                        Some("shared".into()),
                        format!("shared={other}: give true or false"),
                    ))
                }
            };
            let body = read_limited(req, MAX_ADAPTER_BYTES).await?;
            let upload = crate::tenants::adapters::parse_multipart(&content_type, &body)
                .map_err(|e| ApiError::invalid(None, format!("{e:#}")))?;
            let r = state
                .tenants
                .upload_adapter(&t, &name, upload, shared, &loras)
                .await
                .map_err(|e| {
                    tracing::warn!(tenant = %t.id, adapter = %name, "adapter upload refused: {e:#}");
                    adapter_error(e)
                })?;
            tracing::info!(tenant = %t.id, adapter = %name, version = r.version, sha256 = %r.sha256, "adapter version active");
            let mut v = serde_json::to_value(&r).unwrap_or_default();
            v["tenant"] = json!(t.id);
            v["name"] = json!(name);
            v["active"] = json!(true);
            let mut resp = json_response(&v);
            *resp.status_mut() = StatusCode::CREATED;
            Ok(resp)
        }
        (Method::DELETE, ["admin", "v1", "tenants", id, "adapters", name]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            if state.tenants.delete_adapter(&t, name).await.map_err(bad)? {
                tracing::info!(tenant = %t.id, adapter = %name, "adapter deleted");
                Ok(json_response(
                    &json!({"tenant": t.id, "name": name, "deleted": true}),
                ))
            } else {
                Err(ApiError {
                    code: "adapter_not_found",
                    ..ApiError::not_found(&format!("adapter '{name}' of tenant '{id}'"))
                })
            }
        }
        (Method::POST, ["admin", "v1", "tenants", id, "adapters", name, "rollback"]) => {
            let t = state.tenants.get(id).ok_or_else(|| tenant_not_found(id))?;
            let r = state
                .tenants
                .rollback_adapter(&t, name)
                .await
                .map_err(bad)?;
            tracing::info!(tenant = %t.id, adapter = %name, version = r.version, "adapter rolled back");
            Ok(json_response(
                &json!({"tenant": t.id, "name": name, "version": r.version, "sha256": r.sha256, "active": true}),
            ))
        }
        (m, _) if parts.first() == Some(&"admin") => {
            Err(ApiError::not_found(&format!("{} {path}", m.as_str())))
        }
        _ => Err(ApiError::not_found(&path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("%7B%22tag%22%3A%22%20x%22%7D").unwrap(),
            r#"{"tag":" x"}"#
        );
        assert_eq!(percent_decode("a+b").unwrap(), "a b");
        assert!(percent_decode("%zz").is_err());
    }
}
