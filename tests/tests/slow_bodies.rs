//! Slow request bodies cannot starve normal requests at a low descriptor
//! limit. Under `ulimit -n 256` (64 normal connection slots and 64 in the
//! overflow pool), 100 clients send a complete request head announcing a
//! 100 kB body, then dribble the body a byte every 200 ms, and reconnect
//! whenever the server closes them: they hold every slot. A connection
//! whose body stalls is evicted under pressure like a slow head, so normal
//! requests and probes sent meanwhile are all served, and the evictions
//! are counted in `/metrics` and reported in the log.

use pagoda_e2e::Server;
use serde_json::json;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ATTACKERS: usize = 100;
const REQUESTS: usize = 30;
const PROBES: usize = 12;
/// More than the normal slots at `ulimit -n 256`.
const CHURNERS: usize = 100;

/// One slow-body client: a whole request head, then its body a byte every
/// 200 ms; a new connection once the server has closed this one (which
/// the client notices a write or two later).
fn slow_body(addr: String, stop: Arc<AtomicBool>, opened: Arc<AtomicUsize>) {
    let head = b"POST /v1/completions HTTP/1.1\r\nHost: pagoda\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{";
    let started = Instant::now();
    while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(120) {
        let Ok(mut s) = std::net::TcpStream::connect(&addr) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        opened.fetch_add(1, Ordering::Relaxed);
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        if s.write_all(head).is_err() {
            continue;
        }
        // At most the whole announced body, and never past the stop.
        for _ in 0..100_000 {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
            if s.write_all(b" ").is_err() {
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

/// The `reason` series of the refusal counter in a `/metrics` text.
fn refused(metrics: &str, reason: &str) -> f64 {
    let label = format!("reason=\"{reason}\"");
    metrics
        .lines()
        .find(|l| l.starts_with("pagoda_http_connections_refused_total{") && l.contains(&label))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no refusals counted for {reason} in:\n{metrics}"))
}

#[test]
fn slow_bodies_at_a_low_descriptor_limit_do_not_starve_requests_or_probes() {
    let s = Server::start_with_fd_limit(256, &[]);
    let addr = s.base.trim_start_matches("http://").to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let (_, before) = s.get("/metrics");
    assert_eq!(refused(&before, "evicted_slow_body"), 0.0);

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|_| {
            let (addr, stop, opened) = (addr.clone(), stop.clone(), opened.clone());
            std::thread::spawn(move || slow_body(addr, stop, opened))
        })
        .collect();
    // Let them take every slot, and their bodies stall.
    std::thread::sleep(Duration::from_secs(2));

    // Normal requests and probes, concurrently, each on a fresh connection
    // as a new client's would be.
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let url = s.url("/v1/completions");
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50) * i as u32);
                let body =
                    json!({"model": "smol", "prompt": format!("Request {i}:"), "max_tokens": 1});
                match agent().post(&url).send_json(body) {
                    Ok(r) if r.status().as_u16() == 200 => Ok(()),
                    Ok(r) => Err(format!("request {i}: {}", r.status())),
                    Err(e) => Err(format!("request {i}: {e}")),
                }
            })
        })
        .collect();
    let probes: Vec<_> = (0..PROBES)
        .map(|i| {
            let path = if i % 2 == 0 {
                "/health"
            } else {
                "/health/ready"
            };
            let url = s.url(path);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150) * i as u32);
                match agent().get(&url).call() {
                    Ok(r) if r.status().as_u16() == 200 => Ok(()),
                    Ok(r) => Err(format!("probe {i} {path}: {}", r.status())),
                    Err(e) => Err(format!("probe {i} {path}: {e}")),
                }
            })
        })
        .collect();
    let failures: Vec<String> = requests
        .into_iter()
        .chain(probes)
        .filter_map(|t| t.join().expect("client thread").err())
        .collect();
    // The counter, while the attack is still on: /metrics answers too.
    let during = agent()
        .get(&s.url("/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok());
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = a.join();
    }
    let log = s.log_text();
    let tail = log.lines().rev().take(20).collect::<Vec<_>>().join("\n");
    assert!(failures.is_empty(), "{failures:?}\n{tail}");
    let metrics = during.unwrap_or_else(|| s.get("/metrics").1);
    for l in metrics.lines().chain(log.lines()) {
        if l.starts_with("pagoda_http_connections_refused_total{") || l.contains("cut short") {
            eprintln!("{l}");
        }
    }
    assert!(
        refused(&metrics, "evicted_slow_body") > 0.0,
        "no slow body was evicted:\n{metrics}"
    );
    assert!(
        opened.load(Ordering::Relaxed) > ATTACKERS,
        "{} connections opened: no attacker was closed and came back",
        opened.load(Ordering::Relaxed)
    );
    assert!(
        log.contains("connections refused or cut short"),
        "the refusals were not reported in the log:\n{tail}"
    );
}

/// One churning client: a connection per request, closed after the answer,
/// as fast as it goes, for `dur`; how many were answered 200, and how many
/// not.
fn churn(addr: String, dur: Duration) -> (usize, usize) {
    use std::io::Read;
    let (mut ok, mut failed) = (0, 0);
    let started = Instant::now();
    while started.elapsed() < dur {
        let answered = std::net::TcpStream::connect(&addr).ok().and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: pagoda\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut head = [0u8; 12];
            s.read_exact(&mut head).ok()?;
            Some(head.ends_with(b"200"))
        });
        match answered {
            Some(true) => ok += 1,
            _ => failed += 1,
        }
    }
    (ok, failed)
}

#[test]
fn probes_answer_under_connection_churn_at_a_low_descriptor_limit() {
    let s = Server::start_with_fd_limit(256, &[]);
    let addr = s.base.trim_start_matches("http://").to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let churners: Vec<_> = (0..CHURNERS)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || churn(addr, Duration::from_secs(4)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut failures = Vec::new();
    for i in 0..30 {
        let path = ["/health", "/health/ready", "/ping", "/metrics"][i % 4];
        match agent().get(&s.url(path)).call() {
            Ok(r) if r.status().as_u16() == 200 => {}
            Ok(r) => failures.push(format!("probe {i} {path}: {}", r.status())),
            Err(e) => failures.push(format!("probe {i} {path}: {e}")),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, failed) = churners
        .into_iter()
        .map(|t| t.join().expect("churner"))
        .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
    eprintln!("churn: {ok} answered 200, {failed} not, in 4 s");
    let tail = s
        .log_text()
        .lines()
        .rev()
        .take(20)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(failures.is_empty(), "{failures:?}\n{tail}");
    assert!(
        ok > 0 && failed * 100 <= ok,
        "{ok} answered, {failed} not\n{tail}"
    );
}
