//! The access log: one line per request once it has been answered, with
//! the method, path, status, tenant id (never its key), request id, token
//! counts, time to first token and latency, and the OpenAI error type of
//! a failure; `--log-format json` makes it one JSON object per line, and
//! `--disable-uvicorn-access-log` turns it off.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const KEY: &str = "key-access-log-1234";

fn completion() -> Value {
    json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
}

/// The server's access lines, once there are at least `n` of them.
fn access_lines(p: &PServer, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<String> =
            p.s.log_text()
                .lines()
                .filter(|l| l.contains("pagoda::access"))
                .map(str::to_string)
                .collect();
        if lines.len() >= n || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A tenant whose token budget one completion uses up, so its next
/// request gets a 429.
fn tenant_with_a_small_budget(p: &PServer) {
    p.put_tenant(
        "acme",
        json!({"api_keys": [KEY], "limits": {"tokens_per_minute": 6}}),
    );
}

#[test]
fn every_request_gets_one_line_with_its_outcome() {
    let dir = TempDir::new("access-log");
    let p = start(&dir, &[]);
    tenant_with_a_small_budget(&p);
    let url = p.s.url("/v1/completions");
    // 400: not JSON.
    let r = pagoda_e2e::agent()
        .post(&url)
        .header("Authorization", &format!("Bearer {KEY}"))
        .header("Content-Type", "application/json")
        .send("{not json");
    assert_eq!(r.map(|r| r.status().as_u16()).unwrap_or(0), 400);
    // 200, which spends the tenant's budget; then 429.
    let (st, ok) = p.post_as(KEY, "/v1/completions", &completion());
    assert_eq!(st, 200, "{ok}");
    let (st, v) = p.post_as(KEY, "/v1/completions", &completion());
    assert_eq!(st, 429, "{v}");
    // 404.
    let (st, _) = call_url(&p.s.url("/v1/no-such-route"), "GET", KEY, None);
    assert_eq!(st, 404);

    let lines = access_lines(&p, 4);
    let line = |status: &str, path: &str| -> String {
        lines
            .iter()
            .find(|l| {
                l.contains(&format!("status={status}")) && l.contains(&format!("path={path}"))
            })
            .unwrap_or_else(|| panic!("no {status} line for {path} in:\n{}", lines.join("\n")))
            .clone()
    };
    let ok_line = line("200", "/v1/completions");
    let id = ok["id"].as_str().expect("id");
    let usage = &ok["usage"];
    for want in [
        "method=POST".to_string(),
        "tenant=acme".to_string(),
        format!("request_id={id}"),
        format!("prompt_tokens={}", usage["prompt_tokens"]),
        format!("completion_tokens={}", usage["completion_tokens"]),
        "ttft_ms=".to_string(),
        "latency_ms=".to_string(),
    ] {
        assert!(ok_line.contains(&want), "{want:?} not in {ok_line}");
    }
    assert!(!ok_line.contains("error="), "{ok_line}");
    assert!(line("400", "/v1/completions").contains("error=invalid_request_error"));
    assert!(line("429", "/v1/completions").contains("error=rate_limit_error"));
    assert!(line("404", "/v1/no-such-route").contains("error=invalid_request_error"));
    let log = p.s.log_text();
    assert!(!log.contains(KEY), "the tenant key is in the log:\n{log}");
    assert!(
        !log.contains("capital of France"),
        "prompt text without --enable-log-requests:\n{log}"
    );
}

#[test]
fn json_lines_with_prompts_when_asked_and_none_when_disabled() {
    let dir = TempDir::new("access-log-json");
    let p = start(&dir, &["--log-format", "json", "--enable-log-requests"]);
    p.put_tenant("acme", json!({"api_keys": [KEY]}));
    let (st, ok) = p.post_as(KEY, "/v1/completions", &completion());
    assert_eq!(st, 200, "{ok}");
    let lines = access_lines(&p, 1);
    let entry: Value = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["path"] == "/v1/completions")
        .unwrap_or_else(|| panic!("no JSON access line in:\n{}", p.s.log_text()));
    assert_eq!(entry["target"], "pagoda::access", "{entry}");
    assert_eq!(entry["status"], 200, "{entry}");
    assert_eq!(entry["request_id"], ok["id"], "{entry}");
    assert_eq!(
        entry["completion_tokens"], ok["usage"]["completion_tokens"],
        "{entry}"
    );
    assert_eq!(entry["prompt"], "The capital of France is", "{entry}");

    let dir = TempDir::new("access-log-off");
    let p = start(&dir, &["--disable-uvicorn-access-log"]);
    p.put_tenant("acme", json!({"api_keys": [KEY]}));
    let (st, _) = p.post_as(KEY, "/v1/completions", &completion());
    assert_eq!(st, 200);
    std::thread::sleep(Duration::from_millis(300));
    assert!(access_lines(&p, 0).is_empty(), "{}", p.s.log_text());
}
