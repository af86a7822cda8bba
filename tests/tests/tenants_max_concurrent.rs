//! A tenant's `limits.max_concurrent`: with N of its requests in flight,
//! the next one gets 429 with an OpenAI error body (`rate_limit_error`,
//! `rate_limit_exceeded`), streamed or not, while another tenant is served
//! normally; once the N requests finish, the tenant is served again, and
//! refused requests never keep a slot.

mod plugins_common;

use pagoda_e2e::{agent, TempDir};
use plugins_common::*;
use serde_json::{json, Value};

const LIMIT: usize = 2;
/// Long enough that the held requests are still generating when the
/// request over the limit arrives (hundreds of ms at the very least).
const HOLD_TOKENS: u64 = 384;

/// A streamed completion as `key` whose response head has arrived: by
/// then the request has been admitted, and it holds its slot until its
/// last token.
fn hold(p: &PServer, key: &str) -> ureq::http::Response<ureq::Body> {
    let r = agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", &format!("Bearer {key}"))
        .send_json(json!({
            "model": "smol",
            "prompt": "Count from one to one thousand:",
            "max_tokens": HOLD_TOKENS,
            "ignore_eos": true,
            "temperature": 0,
            "stream": true,
        }))
        .expect("request");
    assert_eq!(r.status().as_u16(), 200, "a request within the limit");
    r
}

/// Reads a held stream to its end (EOF, past `[DONE]`); returns the
/// number of tokens' worth of text events and the last finish reason.
fn finish(r: ureq::http::Response<ureq::Body>) -> (usize, String) {
    let text = r.into_body().read_to_string().expect("stream body");
    let mut events = 0;
    let mut reason = String::new();
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("chunk JSON");
        assert!(v.get("error").is_none(), "error event: {v}");
        events += 1;
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            reason = f.to_string();
        }
    }
    assert!(text.contains("data: [DONE]"), "no [DONE] in {text}");
    (events, reason)
}

/// A short request as `key`; returns (status, body).
fn short(p: &PServer, key: &str, stream: bool) -> (u16, Value) {
    let body = json!({"model": "smol", "prompt": "Hi", "max_tokens": 2, "temperature": 0});
    if stream {
        let (st, _, err) = p.stream_as(key, "/v1/completions", &body);
        (st, err.unwrap_or(Value::Null))
    } else {
        p.post_as(key, "/v1/completions", &body)
    }
}

/// Asserts a 429 for the tenant's limit, with OpenAI's error shape.
fn assert_over_limit(st: u16, v: &Value) {
    assert_eq!(st, 429, "{v}");
    let e = openai_error(v);
    assert_eq!(e["type"], "rate_limit_error", "{v}");
    assert_eq!(e["code"], "rate_limit_exceeded", "{v}");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("capped") && msg.contains(&LIMIT.to_string()),
        "the message should name the tenant and its limit: {msg}"
    );
}

#[test]
fn max_concurrent_answers_429_beyond_the_limit_and_frees_slots() {
    let dir = TempDir::new("max-concurrent");
    let p = start(&dir, &[]);
    p.put_tenant(
        "capped",
        json!({"api_keys": ["key-capped-123456"], "limits": {"max_concurrent": LIMIT}}),
    );
    p.put_tenant("free", json!({"api_keys": ["key-free-123456"]}));

    // Under the limit, one request at a time is served.
    let (st, v) = short(&p, "key-capped-123456", false);
    assert_eq!(st, 200, "{v}");

    for round in 0..2 {
        // N requests in flight...
        let held: Vec<_> = (0..LIMIT).map(|_| hold(&p, "key-capped-123456")).collect();
        // ...so the next ones are refused, streamed or not, again and again.
        for stream in [false, true, false] {
            let (st, v) = short(&p, "key-capped-123456", stream);
            assert_over_limit(st, &v);
        }
        // Meanwhile another tenant is served normally.
        let (st, v) = short(&p, "key-free-123456", false);
        assert_eq!(st, 200, "round {round}: the other tenant: {v}");
        let (st, v) = short(&p, "key-free-123456", true);
        assert_eq!(st, 200, "round {round}: the other tenant (stream): {v}");

        // The held requests were not disturbed by the refusals.
        for r in held {
            let (events, reason) = finish(r);
            assert_eq!(reason, "length", "round {round}");
            assert!(events > 1, "round {round}: {events} events");
        }
        // Finished: the tenant is served again (and in round 1, after the
        // refusals of round 0, LIMIT requests at once are admitted again:
        // a refused request never kept a slot).
        let (st, v) = short(&p, "key-capped-123456", false);
        assert_eq!(
            st, 200,
            "round {round}: after the held requests finished: {v}"
        );
        let (st, v) = short(&p, "key-capped-123456", true);
        assert_eq!(st, 200, "round {round}: streamed, after: {v}");
    }

    // A tenant's concurrency is its own: the free tenant may have more
    // than LIMIT requests in flight.
    let held: Vec<_> = (0..LIMIT + 1)
        .map(|_| hold(&p, "key-free-123456"))
        .collect();
    for r in held {
        assert_eq!(finish(r).1, "length");
    }
}
