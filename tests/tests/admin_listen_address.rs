//! The admin API on its own address (`--admin-host`/`--admin-port`): admin
//! routes answer there, and 404 on the public address (where nothing
//! changes through them); the public API (inference, models, metrics)
//! answers 404 on the admin address, which keeps only the health probes.
//! Tenants created through the admin address serve on the public one.

mod plugins_common;

use pagoda_e2e::{agent, free_port, TempDir};
use plugins_common::*;
use serde_json::{json, Value};

/// One HTTP call to `base + path` with a bearer token; returns (status, body).
fn call(base: &str, method: &str, path: &str, token: &str, body: Option<&Value>) -> (u16, Value) {
    call_url(&format!("{base}{path}"), method, token, body)
}

/// Asserts a 404 `not_found` in OpenAI's error shape.
fn assert_not_found(what: &str, (st, v): (u16, Value)) {
    assert_eq!(st, 404, "{what}: {v}");
    assert_eq!(openai_error(&v)["code"], "not_found", "{what}: {v}");
}

#[test]
fn admin_api_answers_only_on_its_own_address() {
    let dir = TempDir::new("admin-addr");
    let admin_port = free_port();
    let port = admin_port.to_string();
    let p = start(
        &dir,
        &["--admin-host", "127.0.0.1", "--admin-port", port.as_str()],
    );
    let public = p.s.base.clone();
    let admin = format!("http://127.0.0.1:{admin_port}");
    assert_ne!(public, admin);

    // The admin address serves the admin API, with its token checks.
    let (st, v) = call(&admin, "GET", "/admin/v1/tenants", ADMIN, None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["data"], json!([]), "{v}");
    let (st, v) = call(&admin, "GET", "/admin/v1/tenants", "wrong-token", None);
    assert_eq!(st, 401, "{v}");
    let tenant = json!({"api_keys": ["key-t-123456"], "plugins": ["tag"]});
    let (st, v) = call(&admin, "PUT", "/admin/v1/tenants/t", ADMIN, Some(&tenant));
    assert_eq!(st, 201, "{v}");
    let url = format!("{admin}/admin/v1/tenants/t/plugins/tag");
    let mut r = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {ADMIN}"))
        .send(&component("tag-v1")[..])
        .expect("upload");
    assert_eq!(
        r.status().as_u16(),
        201,
        "{}",
        r.body_mut().read_to_string().unwrap_or_default()
    );
    // A tenant key is refused there, as on a shared address.
    let (st, _) = call(&admin, "GET", "/admin/v1/tenants/t", "key-t-123456", None);
    assert_eq!(st, 403);

    // The public address knows no admin routes, even with the admin token,
    // and a write through it changes nothing.
    for (method, path, body) in [
        ("GET", "/admin/v1/tenants", None),
        ("GET", "/admin/v1/tenants/t", None),
        ("GET", "/admin/v1/tenants/t/plugins", None),
        (
            "PUT",
            "/admin/v1/tenants/sneaky",
            Some(json!({"api_keys": ["key-s-123456"]})),
        ),
        ("DELETE", "/admin/v1/tenants/t", None),
        ("POST", "/admin/v1/tenants/t/plugins/tag/rollback", None),
        ("GET", "/admin", None),
    ] {
        assert_not_found(
            &format!("public {method} {path}"),
            call(&public, method, path, ADMIN, body.as_ref()),
        );
    }
    let (st, v) = call(&admin, "GET", "/admin/v1/tenants", ADMIN, None);
    assert_eq!(st, 200);
    assert_eq!(
        v["data"],
        json!(["t"]),
        "the public address changed tenants: {v}"
    );

    // The tenant made through the admin address is served on the public
    // one, with its plugin.
    let prompt = chat("Hi", 4);
    let (st, v) = call(
        &public,
        "POST",
        "/v1/chat/completions",
        "key-t-123456",
        Some(&prompt),
    );
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.ends_with(" [v1]"), "{text:?}");

    // The admin address serves no public API, whatever the key.
    for key in ["key-t-123456", ADMIN] {
        for (method, path, body) in [
            ("POST", "/v1/chat/completions", Some(prompt.clone())),
            (
                "POST",
                "/v1/completions",
                Some(json!({"model": "smol", "prompt": "Hi", "max_tokens": 2})),
            ),
            ("GET", "/v1/models", None),
            (
                "POST",
                "/tokenize",
                Some(json!({"model": "smol", "prompt": "Hi"})),
            ),
            ("GET", "/metrics", None),
            ("GET", "/version", None),
        ] {
            assert_not_found(
                &format!("admin-address {method} {path} as {key}"),
                call(&admin, method, path, key, body.as_ref()),
            );
        }
    }
    // Health probes answer on both addresses.
    for base in [&public, &admin] {
        for path in ["/health", "/health/ready"] {
            let (st, v) = call(base, "GET", path, "", None);
            assert_eq!(st, 200, "{base}{path}: {v}");
        }
    }
    // The public address still serves its own routes.
    let (st, _) = p.s.get("/metrics");
    assert_eq!(st, 200);
    let (st, v) = call(&public, "GET", "/v1/models", "key-t-123456", None);
    assert_eq!(st, 200, "{v}");
}
