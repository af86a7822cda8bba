//! Slow and idle clients cannot starve normal requests at a low descriptor
//! limit. Under `ulimit -n 256` (64 normal connection slots and 64 for
//! probes), 100 slowloris connections that dribble their request heads and
//! reconnect as soon as they are closed hold every slot; a new connection
//! then evicts the one that has gone longest without a request in
//! progress, so normal requests are all served and every probe answers.

use pagoda_e2e::Server;
use serde_json::json;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const ATTACKERS: usize = 100;

/// One slowloris client: a request head that never ends, a header line a
/// second, a new connection whenever the server closes this one.
fn slowloris(addr: String, stop: Arc<AtomicBool>, opened: Arc<AtomicUsize>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = std::net::TcpStream::connect(&addr) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        opened.fetch_add(1, Ordering::Relaxed);
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\n")
            .is_err()
        {
            continue;
        }
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(700));
            if s.write_all(b"X-Slow: yes\r\n").is_err() {
                break;
            }
        }
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .new_agent()
}

#[test]
fn slowloris_connections_at_a_low_descriptor_limit_do_not_starve_requests() {
    let s = Server::start_with_fd_limit(256, &[]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|_| {
            let (addr, stop, opened) = (addr.clone(), stop.clone(), opened.clone());
            std::thread::spawn(move || slowloris(addr, stop, opened))
        })
        .collect();
    // Let them take every slot.
    std::thread::sleep(Duration::from_secs(2));

    let (mut served, mut probes) = (0, 0);
    let mut failures = Vec::new();
    for i in 0..20 {
        // A fresh connection each, as a new client's would be.
        let r = agent().post(&s.url("/v1/completions")).send_json(
            json!({"model": "smol", "prompt": format!("Request {i}:"), "max_tokens": 4}),
        );
        match r {
            Ok(r) if r.status().as_u16() == 200 => served += 1,
            Ok(r) => failures.push(format!("request {i}: {}", r.status())),
            Err(e) => failures.push(format!("request {i}: {e}")),
        }
        match agent().get(&s.url("/health")).call() {
            Ok(r) if r.status().as_u16() == 200 => probes += 1,
            Ok(r) => failures.push(format!("probe {i}: {}", r.status())),
            Err(e) => failures.push(format!("probe {i}: {e}")),
        }
    }
    // The attack was real: the connections closed to make room come back
    // (an attacker notices its socket closed a write or two later).
    let reconnected = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        opened.load(Ordering::Relaxed) > ATTACKERS
    });
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = a.join();
    }
    assert_eq!(
        (served, probes),
        (20, 20),
        "{failures:?}\n{}",
        s.log_text()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        reconnected,
        "{} connections opened: no attacker was closed and came back",
        opened.load(Ordering::Relaxed)
    );
}
