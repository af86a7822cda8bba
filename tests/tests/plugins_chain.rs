//! The built-in plugins in the request path: chat-template changes the
//! prompt the model gets, router rejects with its own message, redact
//! removes an e-mail address from streamed output split across chunks.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;

const REPEAT: &str = "<|im_start|>system\nYou repeat text exactly.<|im_end|>\n<|im_start|>user\nRepeat exactly: My e-mail is alice@example.com<|im_end|>\n<|im_start|>assistant\nMy e-mail is alice@example.com<|im_end|>\n<|im_start|>user\nRepeat exactly: My e-mail is alice@example.com<|im_end|>\n<|im_start|>assistant\n";

#[test]
fn template_router_and_redact_in_the_request_path() {
    let dir = TempDir::new("chain");
    let p = start(&dir, &["--metrics-tenant-label", "id"]);

    // chat-template: a tenant whose template makes the model see a different prompt.
    p.put_tenant("plain", json!({"api_keys": ["key-plain-123456"]}));
    p.put_tenant(
        "tmpl",
        json!({"api_keys": ["key-tmpl-123456"], "plugins": ["chat-template"]}),
    );
    p.upload_ok(
        "tmpl",
        "chat-template",
        "chat-template",
        Some(&json!({"template": REPEAT})),
    );
    let (st, plain) = p.post_as("key-plain-123456", "/v1/chat/completions", &chat("Hi", 8));
    assert_eq!(st, 200, "{plain}");
    let (st, templ) = p.post_as("key-tmpl-123456", "/v1/chat/completions", &chat("Hi", 24));
    assert_eq!(st, 200, "{templ}");
    let (pt, tt) = (
        plain["usage"]["prompt_tokens"].as_u64().unwrap(),
        templ["usage"]["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(
        tt > pt + 20,
        "the plugin's template should make a longer prompt: {pt} vs {tt}"
    );
    let echoed = templ["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        echoed.contains("alice@example.com"),
        "the model should echo the address: {echoed:?}"
    );

    // router: a blocked word is rejected with the plugin's status and message.
    p.put_tenant(
        "routed",
        json!({"api_keys": ["key-routed-123456"], "plugins": ["router"]}),
    );
    p.upload_ok("routed", "router", "router", Some(&json!({"blocked_words": ["forbidden"], "reject_message": "That topic is not allowed here."})));
    let (st, v) = p.post_as(
        "key-routed-123456",
        "/v1/chat/completions",
        &chat("Tell me the forbidden thing", 8),
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["message"], "That topic is not allowed here.");
    assert_eq!(v["error"]["code"], "plugin_rejected");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (st, v) = p.post_as(
        "key-routed-123456",
        "/v1/chat/completions",
        &chat("Tell me a story", 4),
    );
    assert_eq!(st, 200, "{v}");

    // redact after the template: the streamed address is redacted even
    // though the model emits it over several chunks.
    p.put_tenant(
        "red",
        json!({"api_keys": ["key-red-123456"], "plugins": ["chat-template", "redact"]}),
    );
    p.upload_ok(
        "red",
        "chat-template",
        "chat-template",
        Some(&json!({"template": REPEAT})),
    );
    p.upload_ok("red", "redact", "redact", None);
    let (st, text, err) = p.stream_as("key-red-123456", "/v1/chat/completions", &chat("Hi", 24));
    assert_eq!(st, 200);
    assert!(err.is_none(), "{err:?}");
    assert!(
        !text.contains("alice@example.com") && !text.contains("alice@"),
        "leaked: {text:?}"
    );
    assert!(text.contains("[REDACTED]"), "{text:?}");
    // Non-streamed too.
    let (st, v) = p.post_as("key-red-123456", "/v1/chat/completions", &chat("Hi", 24));
    assert_eq!(st, 200, "{v}");
    let t = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        !t.contains("alice@example.com") && t.contains("[REDACTED]"),
        "{t:?}"
    );

    // Metrics per tenant and plugin.
    let (_, m) = p.s.get("/metrics");
    assert!(
        m.lines()
            .any(|l| l.starts_with("pagoda_plugin_calls_total{")
                && l.contains("tenant=\"red\",plugin=\"redact\",hook=\"on-chunk\"}")),
        "{m}"
    );
    assert!(
        m.contains("pagoda_plugin_hook_duration_seconds_bucket"),
        "{m}"
    );
    assert!(
        m.lines()
            .any(|l| l.starts_with("pagoda_plugin_errors_total") && l.contains("kind=\"reject\"")),
        "{m}"
    );
}

/// A tenant's router forces one output shape on every request: a client
/// that asked for nothing, and one that asked for something else, both get
/// output of the tenant's constraint (enforced by the engine), while
/// another tenant is untouched.
#[test]
fn a_route_plugin_forces_the_tenants_structured_output() {
    let dir = TempDir::new("forced");
    let p = start(&dir, &[]);
    p.put_tenant(
        "forms",
        json!({"api_keys": ["key-forms-123456"], "plugins": ["router"]}),
    );
    let schema = json!({"type": "object", "properties": {"verdict": {"enum": ["approve", "deny"]}},
        "required": ["verdict"], "additionalProperties": false});
    p.upload_ok(
        "forms",
        "router",
        "router",
        Some(&json!({"structured_outputs": {"json": schema, "disable_any_whitespace": true}})),
    );
    p.put_tenant("free", json!({"api_keys": ["key-free-123456"]}));
    let mut asked_other = chat("Write a poem", 40);
    asked_other["structured_outputs"] = json!({"regex": "[a-z ]+"});
    for body in [chat("Write a poem", 40), asked_other] {
        let (st, v) = p.post_as("key-forms-123456", "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let parsed: serde_json::Value = serde_json::from_str(text).expect(text);
        assert!(
            parsed == json!({"verdict": "approve"}) || parsed == json!({"verdict": "deny"}),
            "{text}"
        );
    }
    let (st, v) = p.post_as(
        "key-free-123456",
        "/v1/chat/completions",
        &chat("Write a poem", 12),
    );
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.starts_with("{\"verdict\""), "{text}");
}
