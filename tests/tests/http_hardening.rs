//! The HTTP front door under clients that are careless or hostile:
//! credentials are matched as RFC 9110 says (scheme case-insensitive) and
//! never collide with the admin token, a body announced beyond the limit
//! is refused before it is read, and every 429 says when to retry.

mod plugins_common;

use pagoda_e2e::{agent, TempDir};
use plugins_common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::time::Duration;

fn status_with(p: &PServer, auth: &str, path: &str) -> u16 {
    agent()
        .get(&p.s.url(path))
        .header("Authorization", auth)
        .call()
        .expect("request")
        .status()
        .as_u16()
}

#[test]
fn the_bearer_scheme_is_case_insensitive_for_tenant_and_admin_keys() {
    let dir = TempDir::new("bearer");
    let p = start(&dir, &[]);
    p.put_tenant("t", json!({"api_keys": ["key-t-123456"]}));
    for scheme in ["Bearer", "bearer", "BEARER"] {
        assert_eq!(
            status_with(&p, &format!("{scheme} key-t-123456"), "/v1/models"),
            200,
            "{scheme}"
        );
        assert_eq!(
            status_with(&p, &format!("{scheme} {ADMIN}"), "/admin/v1/tenants"),
            200,
            "{scheme}"
        );
    }
    assert_eq!(status_with(&p, "Basic key-t-123456", "/v1/models"), 401);
    assert_eq!(status_with(&p, "Bearer key-t-12345", "/v1/models"), 401);
}

#[test]
fn a_tenant_key_equal_to_the_admin_token_is_refused() {
    let dir = TempDir::new("admin-key");
    let p = start(&dir, &[]);
    let (st, v) = p.admin(
        "PUT",
        "/admin/v1/tenants/t",
        Some(&json!({"api_keys": ["key-t-123456", ADMIN]})),
    );
    assert_eq!(st, 400, "{v}");
    let msg = openai_error(&v)["message"]
        .as_str()
        .expect("message")
        .to_string();
    assert!(msg.contains("admin token"), "{msg}");
    // Nothing was created.
    let (st, _) = p.admin("GET", "/admin/v1/tenants/t", None);
    assert_eq!(st, 404);
}

/// Sends only the head of a `method` request announcing `length` body bytes and
/// returns the status line of the answer (or what went wrong).
fn announce_body(p: &PServer, method: &str, path: &str, length: u64, auth: &str) -> String {
    let addr = p.s.base.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        sock,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {auth}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    .expect("write");
    let mut buf = [0u8; 512];
    match sock.read(&mut buf) {
        Ok(n) => String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        Err(e) => format!("no answer: {e}"),
    }
}

#[test]
fn a_content_length_beyond_the_limit_is_refused_before_the_body_is_read() {
    let dir = TempDir::new("content-length");
    let p = start(&dir, &["--max-body-bytes", "65536"]);
    p.put_tenant("t", json!({"api_keys": ["key-t-123456"]}));
    // No body byte is ever sent: the answer comes from the head alone.
    let line = announce_body(&p, "POST", "/v1/completions", 1 << 30, "key-t-123456");
    assert!(line.contains(" 413 "), "{line}");
    let line = announce_body(&p, "PUT", "/admin/v1/tenants/t", 1 << 30, ADMIN);
    assert!(line.contains(" 413 "), "{line}");
    // Within the limit, the server waits for the body as it should.
    let line = announce_body(&p, "POST", "/v1/completions", 1000, "key-t-123456");
    assert!(line.starts_with("no answer"), "{line}");
}

#[test]
fn every_429_carries_retry_after() {
    let dir = TempDir::new("retry-after");
    let p = start(&dir, &[]);
    p.put_tenant(
        "t",
        json!({"api_keys": ["key-t-123456"], "limits": {"max_concurrent": 1}}),
    );
    // One long request holds the tenant's only slot (its head has arrived,
    // so it was admitted)...
    let held = agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", "Bearer key-t-123456")
        .send_json(
            json!({"model": "smol", "prompt": "Count:", "max_tokens": 256,
            "ignore_eos": true, "stream": true}),
        )
        .expect("held request");
    assert_eq!(held.status().as_u16(), 200);
    // ...so the next one is refused, and told when to come back.
    let r = agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", "Bearer key-t-123456")
        .send_json(json!({"model": "smol", "prompt": "Hi", "max_tokens": 2}))
        .expect("request");
    assert_eq!(r.status().as_u16(), 429);
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(retry.is_some_and(|s| s >= 1), "Retry-After: {retry:?}");
    drop(held);
}
