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

/// Whether the server has closed `sock` (EOF or reset), waiting at most
/// `limit`.
fn closed_by_server(sock: &mut std::net::TcpStream, limit: Duration) -> bool {
    sock.set_read_timeout(Some(limit)).expect("timeout");
    let mut buf = [0u8; 256];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return true,
            // A response (a 408 for the slow body) then the close.
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn idle_and_slow_clients_neither_block_others_nor_keep_their_connections() {
    let dir = TempDir::new("slow-clients");
    let p = start(&dir, &["--header-timeout-seconds", "2"]);
    p.put_tenant("t", json!({"api_keys": ["key-t-123456"]}));
    let addr = p.s.base.trim_start_matches("http://").to_string();
    // 300 connections: a third idle, a third dripping a request head one
    // byte at a time, a third sending a head and then nothing of the body.
    let mut socks: Vec<std::net::TcpStream> = (0..300)
        .map(|i| {
            let mut s = std::net::TcpStream::connect(&addr).expect("connect");
            match i % 3 {
                0 => {}
                1 => s.write_all(b"P").expect("write"),
                _ => write!(
                    s,
                    "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 100\r\n\r\n{{"
                )
                .expect("write"),
            }
            s
        })
        .collect();
    for s in socks.iter_mut().skip(1).step_by(3) {
        s.write_all(b"O").expect("drip");
    }
    // Meanwhile a normal client is served.
    let (st, v) = p.post_as(
        "key-t-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 4}),
    );
    assert_eq!(st, 200, "{v}");
    // The idle and dripping ones are closed once their head is overdue;
    // the stalled bodies get their 408 and a close after the body timeout
    // (30 s), so only the first two kinds are waited for here.
    for (i, s) in socks.iter_mut().enumerate().filter(|(i, _)| i % 3 != 2) {
        assert!(
            closed_by_server(s, Duration::from_secs(10)),
            "connection {i} is still open past the header timeout"
        );
    }
}

#[test]
fn descriptor_exhaustion_keeps_probes_answering_and_the_log_quiet() {
    // 256 descriptors: about 64 normal connection slots and 64 overflow.
    let s = pagoda_e2e::Server::start_with_fd_limit(256, &["--header-timeout-seconds", "3"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    // Far more idle connections than the process can hold.
    let held: Vec<std::net::TcpStream> = (0..600)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    assert!(held.len() > 300, "only {} connections opened", held.len());
    // Probes still answer: from the overflow pool, or once the idle
    // connections' head timeout frees their slots.
    let mut answered = false;
    for _ in 0..60 {
        let r = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .new_agent()
            .get(&s.url("/health"))
            .call();
        if r.is_ok_and(|r| r.status().as_u16() == 200) {
            answered = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(answered, "/health never answered:\n{}", s.log_text());
    drop(held);
    // The server recovers fully, and it said so without flooding its log.
    std::thread::sleep(Duration::from_secs(4));
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 4}),
    );
    assert_eq!(st, 200, "{v}");
    let log = s.log_text();
    let reports = log.matches("accept failed").count();
    assert!(
        reports <= 10 && log.len() < 1 << 20,
        "{reports} accept reports, {} bytes of log",
        log.len()
    );
}

#[test]
fn prompts_far_beyond_the_context_are_refused_by_size_while_probes_answer() {
    let dir = TempDir::new("huge-prompts");
    let p = start(&dir, &[]);
    p.put_tenant("t", json!({"api_keys": ["key-t-123456"]}));
    let url = p.s.url("/v1/completions");
    let chat_url = p.s.url("/v1/chat/completions");
    // Three clients with 7.9 MB prompts, as in the finding that pushed
    // /health from 3 ms to 2.3 s while they were tokenized whole.
    let big = "lorem ipsum dolor sit amet ".repeat(7_900_000 / 27);
    let clients: Vec<_> = (0..3)
        .map(|i| {
            let (url, chat_url, big) = (url.clone(), chat_url.clone(), big.clone());
            std::thread::spawn(move || {
                let mut r = if i == 2 {
                    agent()
                        .post(&chat_url)
                        .header("Authorization", "Bearer key-t-123456")
                        .send_json(json!({
                            "model": "smol",
                            "messages": [{"role": "user", "content": big}],
                        }))
                } else {
                    agent()
                        .post(&url)
                        .header("Authorization", "Bearer key-t-123456")
                        .send_json(json!({"model": "smol", "prompt": big}))
                }
                .expect("request");
                let status = r.status().as_u16();
                let v: serde_json::Value =
                    serde_json::from_str(&r.body_mut().read_to_string().expect("body"))
                        .expect("JSON");
                (status, v)
            })
        })
        .collect();
    for _ in 0..10 {
        let (st, _) = p.s.get("/health");
        assert_eq!(st, 200);
    }
    for c in clients {
        let (st, v) = c.join().expect("client");
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
}
