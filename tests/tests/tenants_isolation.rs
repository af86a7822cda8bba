//! Tenants are isolated: keys reach only their own tenant's models and
//! plugins, tenant keys cannot use the admin API, bad uploads are refused
//! with the old version kept, and limits answer 429.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;

#[test]
fn tenant_isolation_admin_auth_bad_uploads_and_limits() {
    let dir = TempDir::new("tenants");
    let p = start(&dir, &["--served-model-name", "smol-b"]);

    // Admin auth: no token 401, wrong token 401.
    let (st, _) = p.admin_as("wrong-token", "GET", "/admin/v1/tenants", None);
    assert_eq!(st, 401);

    p.put_tenant(
        "a",
        json!({"api_keys": ["key-a-123456"], "models": ["smol"], "plugins": ["tag"]}),
    );
    p.put_tenant(
        "b",
        json!({"api_keys": ["key-b-123456"], "models": ["smol-b"], "plugins": ["tag"]}),
    );
    // Tenant keys are refused on admin routes.
    let (st, v) = p.admin_as("key-a-123456", "GET", "/admin/v1/tenants/a", None);
    assert_eq!(st, 403, "{v}");
    let (st, _) = p.admin_as(
        "key-a-123456",
        "PUT",
        "/admin/v1/tenants/a",
        Some(&json!({"api_keys": ["x-123456789"]})),
    );
    assert_eq!(st, 403);
    // Stored keys are hashes only.
    let (st, v) = p.admin("GET", "/admin/v1/tenants/a", None);
    assert_eq!(st, 200);
    assert!(!v.to_string().contains("key-a-123456"), "{v}");
    let on_disk = std::fs::read_to_string(p.state.join("tenants/a/tenant.json")).unwrap();
    assert!(!on_disk.contains("key-a-123456"));

    // Each tenant has its own tag plugin.
    p.upload_ok("a", "tag", "tag-v1", Some(&json!({"tag": " [tenant-a]"})));
    p.upload_ok("b", "tag", "tag-v1", Some(&json!({"tag": " [tenant-b]"})));

    // Unknown keys and no key: 401 once tenants exist.
    let (st, _) = p.post_as("nope-123456", "/v1/chat/completions", &chat("Hi", 4));
    assert_eq!(st, 401);
    // A reaches its model and its plugin; not B's model.
    let (st, v) = p.post_as("key-a-123456", "/v1/chat/completions", &chat("Hi", 4));
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.ends_with(" [tenant-a]") && !text.contains("tenant-b"),
        "{text}"
    );
    let mut body = chat("Hi", 4);
    body["model"] = json!("smol-b");
    let (st, v) = p.post_as("key-a-123456", "/v1/chat/completions", &body);
    assert_eq!(st, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found");
    let (st, v) = p.post_as("key-b-123456", "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .ends_with(" [tenant-b]"),
        "{v}"
    );
    // /v1/models lists only the tenant's models.
    let mut r = pagoda_e2e::agent()
        .get(&p.s.url("/v1/models"))
        .header("Authorization", "Bearer key-a-123456")
        .call()
        .unwrap();
    let models: serde_json::Value =
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["smol"]);

    // Invalid wasm: 400, the old version stays active.
    let (st, v) = p.upload("a", "tag", b"\0asm not really a component", None);
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("valid"),
        "{v}"
    );
    // A config that violates the plugin's schema: 400, old version stays.
    let (st, v) = p.upload("a", "tag", &component("tag-v2"), Some(&json!({"tag": 5})));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("schema"),
        "{v}"
    );
    let (st, v) = p.admin("GET", "/admin/v1/tenants/a/plugins", None);
    assert_eq!(st, 200);
    assert_eq!(v["data"][0]["active_version"], 1, "{v}");
    assert_eq!(v["data"][0]["versions"].as_array().unwrap().len(), 1, "{v}");
    let (_, v) = p.post_as("key-a-123456", "/v1/chat/completions", &chat("Hi", 4));
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .ends_with(" [tenant-a]"),
        "{v}"
    );

    // Limits: tokens per minute → 429 with Retry-After once spent.
    p.put_tenant(
        "c",
        json!({"api_keys": ["key-c-123456"], "limits": {"tokens_per_minute": 30}}),
    );
    let (st, _) = p.post_as(
        "key-c-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "One two three", "max_tokens": 40, "ignore_eos": true}),
    );
    assert_eq!(st, 200);
    let r = pagoda_e2e::agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", "Bearer key-c-123456")
        .send_json(json!({"model": "smol", "prompt": "Hi", "max_tokens": 2}))
        .unwrap();
    assert_eq!(r.status().as_u16(), 429);
    let retry: u64 = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!(retry >= 1);
    // Other tenants are unaffected.
    let (st, _) = p.post_as("key-b-123456", "/v1/chat/completions", &body);
    assert_eq!(st, 200);

    // Deleting a tenant revokes its keys.
    let (st, _) = p.admin("DELETE", "/admin/v1/tenants/c", None);
    assert_eq!(st, 200);
    let (st, _) = p.post_as(
        "key-c-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(st, 401);
}
