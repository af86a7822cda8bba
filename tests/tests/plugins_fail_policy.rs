//! Per-hook failure policies of a tenant's plugin chain (`plugins` entries
//! `{"name", "policies": {"<hook>": "fail_open" | "fail_closed"}}`):
//!
//! - fail-closed (the default): a plugin that traps, loops past its
//!   deadline or runs out of memory fails the request with an OpenAI error,
//!   500 `plugin_error`, naming the plugin and the kind of failure;
//! - fail-open: the same failure skips the plugin for the rest of the
//!   request, which goes on without the plugin's effect while the rest of
//!   the chain still runs; the failure is still counted in the metrics;
//! - a policy applies to the hook it names only;
//! - other tenants are never affected.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::{json, Value};

const TAG: &str = " [tagged]";

/// The content of a non-streamed chat answer.
fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content in {v}"))
        .to_string()
}

/// Creates tenant `id` (key `key-<id>-123456`) whose chain is `first`,
/// then the `tag` plugin; uploads `first_file` as `first_name` and tag-v1
/// (configured to append [`TAG`]) as `tag`.
fn tenant_with(p: &PServer, id: &str, first: Value, first_name: &str, first_file: &str) {
    p.put_tenant(
        id,
        json!({
            "api_keys": [format!("key-{id}-123456")],
            "plugins": [first, "tag"],
            // A short route deadline keeps the `loop` fixture's spin short.
            "plugin_limits": {"timeout_ms": 200},
        }),
    );
    p.upload_ok(id, first_name, first_file, None);
    p.upload_ok(id, "tag", "tag-v1", Some(&json!({"tag": TAG})));
}

/// Whether `text` has 10 MB outputs of the `big-output` fixture in it.
fn has_big_output(text: &str) -> bool {
    text.contains(&"x".repeat(1000))
}

#[test]
fn fail_open_skips_the_failing_plugin_fail_closed_fails_the_request() {
    let dir = TempDir::new("fail-policy");
    let p = start(&dir, &["--metrics-tenant-label", "id"]);
    let prompt = chat("Name a colour.", 8);

    // The reference: a tenant whose chain is only the tag plugin.
    p.put_tenant(
        "plain",
        json!({"api_keys": ["key-plain-123456"], "plugins": ["tag"]}),
    );
    p.upload_ok("plain", "tag", "tag-v1", Some(&json!({"tag": TAG})));
    let (st, v) = p.post_as("key-plain-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 200, "{v}");
    let reference = content(&v);
    assert!(reference.ends_with(TAG), "{reference:?}");

    // Policies are checked when the tenant is stored.
    for bad in [
        json!({"name": "trap", "policies": {"route": "maybe"}}),
        json!({"name": "trap", "policies": {"routing": "fail_open"}}),
    ] {
        let (st, v) = p.admin(
            "PUT",
            "/admin/v1/tenants/bad",
            Some(&json!({"api_keys": ["key-bad-123456"], "plugins": [bad]})),
        );
        assert_eq!(st, 400, "{v}");
        openai_error(&v);
    }

    // Fail-closed is the default: each hostile `route` fails the request
    // with a 500 plugin_error that names the plugin and the kind.
    for (name, kind) in [("trap", "trap"), ("loop", "timeout"), ("oom", "oom")] {
        let id = format!("closed-{name}");
        tenant_with(&p, &id, json!(name), name, name);
        let (st, v) = p.post_as(&format!("key-{id}-123456"), "/v1/chat/completions", &prompt);
        assert_eq!(st, 500, "{id}: {v}");
        let e = openai_error(&v);
        assert_eq!(e["code"], "plugin_error", "{id}: {v}");
        assert_eq!(e["type"], "server_error", "{id}: {v}");
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!("'{name}'")) && msg.contains("route") && msg.contains(kind),
            "{id}: the message should name the plugin, the hook and '{kind}': {msg}"
        );
        // Streamed, the route failure is the HTTP status, before any event.
        let (st, _, err) =
            p.stream_as(&format!("key-{id}-123456"), "/v1/chat/completions", &prompt);
        assert_eq!(st, 500, "{id} (stream)");
        assert_eq!(err.expect("an error body")["error"]["code"], "plugin_error");
    }

    // Fail-open on `route`: the request goes on, the rest of the chain
    // (the tag) still runs, and the answer is the one without the plugin.
    for name in ["trap", "loop", "oom"] {
        let id = format!("open-{name}");
        tenant_with(
            &p,
            &id,
            json!({"name": name, "policies": {"route": "fail_open"}}),
            name,
            name,
        );
        let key = format!("key-{id}-123456");
        for round in 0..2 {
            let (st, v) = p.post_as(&key, "/v1/chat/completions", &prompt);
            assert_eq!(st, 200, "{id} round {round}: {v}\n{}", p.s.log_text());
            assert_eq!(content(&v), reference, "{id} round {round}");
            let (st, text, err) = p.stream_as(&key, "/v1/chat/completions", &prompt);
            assert_eq!(st, 200, "{id} (stream)");
            assert!(err.is_none(), "{id} (stream): {err:?}");
            assert_eq!(text, reference, "{id} (stream)");
        }
    }

    // A policy covers only the hook it names: fail_open for on-chunk does
    // not open a failing route.
    tenant_with(
        &p,
        "open-other-hook",
        json!({"name": "trap", "policies": {"on-chunk": "fail_open", "post-process": "fail_open"}}),
        "trap",
        "trap",
    );
    let (st, v) = p.post_as(
        "key-open-other-hook-123456",
        "/v1/chat/completions",
        &prompt,
    );
    assert_eq!(st, 500, "{v}");
    assert_eq!(openai_error(&v)["code"], "plugin_error");

    // Output hooks: `big-output` returns 10 MB from on-chunk and
    // post-process, over the 1 MiB limit. Fail-closed fails the request
    // (mid-stream: an error event); fail-open drops its output and the
    // client gets the text as if the plugin were not there.
    tenant_with(
        &p,
        "closed-big",
        json!("big-output"),
        "big-output",
        "big-output",
    );
    let (st, v) = p.post_as("key-closed-big-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 500, "{v}");
    let msg = openai_error(&v)["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("big-output") && msg.contains("output_too_large"),
        "{msg}"
    );
    let (st, text, err) = p.stream_as("key-closed-big-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 200);
    assert!(
        !has_big_output(&text),
        "the 10 MB output reached the client"
    );
    let err = err.expect("a final error event");
    assert_eq!(openai_error(&err)["code"], "plugin_error", "{err}");

    tenant_with(
        &p,
        "open-big",
        json!({"name": "big-output", "policies": {"on-chunk": "fail_open", "post-process": "fail_open"}}),
        "big-output",
        "big-output",
    );
    let (st, v) = p.post_as("key-open-big-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 200, "{v}");
    assert_eq!(content(&v), reference);
    let (st, text, err) = p.stream_as("key-open-big-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 200);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(text, reference);

    // The tenant without the failing plugins never noticed.
    let (st, v) = p.post_as("key-plain-123456", "/v1/chat/completions", &prompt);
    assert_eq!(st, 200, "{v}");
    assert_eq!(content(&v), reference);

    // Failures are counted per tenant and kind, fail-open ones included.
    let (_, metrics) = p.s.get("/metrics");
    for (tenant, plugin, kind) in [
        ("closed-trap", "trap", "trap"),
        ("open-trap", "trap", "trap"),
        ("open-loop", "loop", "timeout"),
        ("open-oom", "oom", "oom"),
        ("open-big", "big-output", "output_too_large"),
    ] {
        let n = metric_sum(
            &metrics,
            "pagoda_plugin_errors_total",
            &[("tenant", tenant), ("plugin", plugin), ("kind", kind)],
        );
        assert!(n >= 1.0, "no {kind} error counted for {tenant}/{plugin}");
    }
    assert_eq!(
        metric_sum(
            &metrics,
            "pagoda_plugin_errors_total",
            &[("tenant", "plain")]
        ),
        0.0,
        "the plain tenant's plugin never failed"
    );
    let (st, _) = p.s.get("/health");
    assert_eq!(st, 200);
}
