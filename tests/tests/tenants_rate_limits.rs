//! Per-tenant rate limits as token buckets, through the real binary:
//! requests, prompt tokens and completion tokens per minute, each refused
//! with a 429 in OpenAI's error shape and a `Retry-After` from that
//! tenant's own refill; honouring it succeeds; other tenants are not
//! slowed; the admin view shows every budget's level.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::{json, Value};

/// Posts a completion; returns the status, the body and `Retry-After`.
fn complete(p: &PServer, key: &str, body: &Value) -> (u16, Value, Option<u64>) {
    let mut r = pagoda_e2e::agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", &format!("Bearer {key}"))
        .send_json(body)
        .expect("request");
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
        retry,
    )
}

fn small() -> Value {
    json!({"model": "smol", "prompt": "Hello there", "max_tokens": 2})
}

#[test]
fn each_per_minute_budget_refuses_with_its_own_retry_after() {
    let dir = TempDir::new("tenants-rate");
    let p = start(&dir, &["--max-model-len", "2048"]);
    p.put_tenant(
        "r",
        json!({"api_keys": ["key-r-123456"], "limits": {"requests_per_minute": 2}}),
    );
    p.put_tenant(
        "pt",
        json!({"api_keys": ["key-pt-123456"], "limits": {"prompt_tokens_per_minute": 1200}}),
    );
    p.put_tenant(
        "ct",
        json!({"api_keys": ["key-ct-123456"], "limits": {"completion_tokens_per_minute": 30}}),
    );
    p.put_tenant("free", json!({"api_keys": ["key-free-123456"]}));

    // Requests: two a minute; the third waits for a thirtieth of a minute.
    for _ in 0..2 {
        let (st, v, _) = complete(&p, "key-r-123456", &small());
        assert_eq!(st, 200, "{v}");
    }
    let (st, v, retry) = complete(&p, "key-r-123456", &small());
    assert_eq!(st, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("2 requests per minute"),
        "{v}"
    );
    let retry = retry.expect("Retry-After");
    assert!(
        (25..=31).contains(&retry),
        "requests refill one per 30 s: {retry}"
    );
    // Another tenant is not held back by it.
    let (st, v, _) = complete(&p, "key-free-123456", &small());
    assert_eq!(st, 200, "{v}");

    // Prompt tokens: 1200 a minute (20 a second); a prompt of about 1300
    // tokens overdraws the bucket, and the next request waits for the
    // refill, then succeeds.
    let long = "one two three four five six seven eight nine ten ".repeat(130);
    let body = json!({"model": "smol", "prompt": long, "max_tokens": 1});
    // The bucket refills from the debit on: time the two requests take
    // shortens the wait (on a loaded machine, by seconds).
    let sent = std::time::Instant::now();
    let (st, v, _) = complete(&p, "key-pt-123456", &body);
    assert_eq!(st, 200, "{v}");
    let used = v["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(used > 1200, "the prompt should overdraw: {used}");
    let (st, v, retry) = complete(&p, "key-pt-123456", &small());
    assert_eq!(st, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("prompt tokens per minute"),
        "{v}"
    );
    let retry = retry.expect("Retry-After");
    let overdraft = used - 1200;
    let elapsed = sent.elapsed().as_secs();
    assert!(
        retry + elapsed + 1 >= overdraft / 20 && retry <= overdraft / 20 + 3,
        "{overdraft} tokens over at 20 a second, {elapsed} s after the debit: Retry-After {retry}"
    );
    let (_, view) = p.admin("GET", "/admin/v1/tenants/pt", None);
    let b = &view["rate_limits"]["prompt_tokens_per_minute"];
    assert_eq!(b["limit"], 1200, "{view}");
    assert!(b["remaining"].as_f64().unwrap_or(1.0) < 0.0, "{view}");
    std::thread::sleep(std::time::Duration::from_secs(retry));
    let (st, v, _) = complete(&p, "key-pt-123456", &small());
    assert_eq!(st, 200, "after Retry-After: {v}");

    // Completion tokens: 30 a minute; 40 generated overdraw it.
    let body = json!({"model": "smol", "prompt": "Count:", "max_tokens": 40, "ignore_eos": true});
    let (st, v, _) = complete(&p, "key-ct-123456", &body);
    assert_eq!(st, 200, "{v}");
    let (st, v, retry) = complete(&p, "key-ct-123456", &small());
    assert_eq!(st, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("30 completion tokens per minute"),
        "{v}"
    );
    assert!(retry.expect("Retry-After") >= 20);
    let (_, view) = p.admin("GET", "/admin/v1/tenants/ct", None);
    assert_eq!(
        view["rate_limits"]["completion_tokens_per_minute"]["limit"], 30,
        "{view}"
    );
    assert!(
        view["rate_limits"].get("requests_per_minute").is_none(),
        "{view}"
    );
}
