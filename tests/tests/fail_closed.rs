//! A server set up for tenants never serves a request without a key, and
//! what it shows on the open `/metrics` reveals no credential.
//!
//! - With an admin token (or a state dir) and no tenant yet, a request
//!   without a key, or with a key nobody was given, is a 401.
//! - A 401 on a request whose body was not read either leaves the
//!   connection usable or closes it with `Connection: close`.
//! - A tenant's hashed metrics label is not `sha256(admin token ‖ 0 ‖ id)`
//!   (which anyone could test guesses of the admin token against), and it
//!   is the same after a restart on the same state dir.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn status_with(p: &PServer, auth: Option<&str>) -> u16 {
    let body = json!({"model": "smol", "prompt": "Hi", "max_tokens": 1});
    let mut req = pagoda_e2e::agent().post(&p.s.url("/v1/completions"));
    if let Some(a) = auth {
        req = req.header("Authorization", a);
    }
    req.send_json(&body).expect("request").status().as_u16()
}

#[test]
fn a_server_for_tenants_refuses_requests_without_a_valid_key_even_before_any_tenant() {
    let dir = TempDir::new("fail-closed");
    let p = start(&dir, &[]);
    for auth in [None, Some("Bearer some-key-nobody-has"), Some("Basic abc")] {
        assert_eq!(status_with(&p, auth), 401, "{auth:?}");
    }
    p.put_tenant("t1", json!({"api_keys": ["key-of-tenant-one"]}));
    assert_eq!(status_with(&p, Some("Bearer key-of-tenant-one")), 200);
    assert_eq!(status_with(&p, None), 401);
    // Deleting the last tenant does not open the server either.
    let (st, v) = p.admin("DELETE", "/admin/v1/tenants/t1", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(status_with(&p, None), 401);
    assert_eq!(status_with(&p, Some("Bearer key-of-tenant-one")), 401);
}

/// Reads one HTTP/1.1 response with a Content-Length body: (head, body).
fn read_response(s: &mut TcpStream) -> (String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).expect("response head");
        assert!(n == 1, "connection closed inside a response head");
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("response body");
    (head, body)
}

#[test]
fn a_401_on_a_request_with_a_body_keeps_the_connection_usable_or_says_close() {
    let dir = TempDir::new("fail-closed-conn");
    let p = start(&dir, &[]);
    let addr = p.s.url("").trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let body = json!({"model": "smol", "prompt": "x".repeat(20_000), "max_tokens": 1}).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong-key-123\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let (head, _) = read_response(&mut s);
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    if head.to_ascii_lowercase().contains("connection: close") {
        // Said: the server closes it, and the client knows not to reuse it.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        return;
    }
    // Not said: then the connection must still serve the next request.
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("second request");
    let (head, _) = read_response(&mut s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

fn admin_token_label(id: &str) -> String {
    let mut c = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum");
    let mut input = ADMIN.as_bytes().to_vec();
    input.push(0);
    input.extend_from_slice(id.as_bytes());
    c.stdin
        .take()
        .expect("stdin")
        .write_all(&input)
        .expect("to sha256sum");
    let out = c.wait_with_output().expect("sha256sum output");
    format!("t-{}", &String::from_utf8_lossy(&out.stdout)[..16])
}

#[test]
fn the_metrics_label_is_no_oracle_for_the_admin_token() {
    let dir = TempDir::new("fail-closed-label");
    let label = {
        let p = start(&dir, &[]);
        p.put_tenant("acme", json!({"api_keys": ["key-of-acme-123"]}));
        let (_, v) = p.admin("GET", "/admin/v1/tenants/acme", None);
        let label = v["metrics_label"].as_str().expect("label").to_string();
        assert!(label.starts_with("t-") && label.len() == 18, "{label}");
        assert_ne!(label, admin_token_label("acme"));
        // It is the label /metrics shows.
        assert_eq!(status_with(&p, Some("Bearer key-of-acme-123")), 200);
        let m = p.s.get("/metrics").1;
        assert!(m.contains(&format!("tenant=\"{label}\"")), "{m}");
        assert!(!m.contains("acme"), "the tenant's name is not exposed");
        label
    };
    // The same on a restart (the key salt persists in the state dir).
    let p = start(&dir, &[]);
    let (_, v) = p.admin("GET", "/admin/v1/tenants/acme", None);
    assert_eq!(v["metrics_label"].as_str(), Some(label.as_str()));
}
