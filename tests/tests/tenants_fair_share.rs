//! Fair share between tenants through the real server: a tenant's
//! `scheduling` (weight, priority class) is set and validated by the admin
//! API, weights 3:1 split the generated tokens 3:1 while both tenants have
//! more work than the engine holds, and the per-tenant metrics carry a
//! `tenant` label.

mod plugins_common;

use pagoda_e2e::{agent, TempDir};
use plugins_common::*;
use serde_json::json;
use std::time::{Duration, Instant};

const HEAVY: &str = "key-heavy-123456";
const LIGHT: &str = "key-light-123456";

/// Keeps `n` completions of `key` in flight until the server goes away.
fn keep_busy(url: String, key: &'static str, n: usize) {
    for _ in 0..n {
        let url = url.clone();
        std::thread::spawn(move || loop {
            let r = agent()
                .post(&url)
                .header("Authorization", &format!("Bearer {key}"))
                .send_json(json!({
                    "model": "smol",
                    "prompt": "Tell me a long story about a lighthouse.",
                    "max_tokens": 48,
                    "ignore_eos": true,
                    "temperature": 0,
                }));
            if r.is_err() {
                // The server stopped at the end of the test.
                return;
            }
        });
    }
}

fn scrape(p: &PServer) -> String {
    let (st, text) = p.s.get("/metrics");
    assert_eq!(st, 200);
    text
}

fn tenant_metric(metrics: &str, name: &str, tenant: &str) -> f64 {
    metric_sum(metrics, name, &[("tenant", tenant)])
}

/// Waits until both tenants have requests waiting (the engine is full).
fn wait_saturated(p: &PServer) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let m = scrape(p);
        let waiting = |t| tenant_metric(&m, "pagoda_tenant_num_requests_waiting", t);
        if waiting("heavy") > 0.0 && waiting("light") > 0.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the tenants never saturated the engine:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn weights_three_to_one_split_generated_tokens_three_to_one() {
    let dir = TempDir::new("fair-share");
    let p = start(
        &dir,
        &["--max-num-seqs", "4", "--metrics-tenant-label", "id"],
    );
    // The admin API validates and reports a tenant's scheduling.
    for bad in [
        json!({"weight": 0}),
        json!({"weight": 5000}),
        json!({"priority_class": 1000}),
    ] {
        let (st, v) = p.admin(
            "PUT",
            "/admin/v1/tenants/heavy",
            Some(&json!({"api_keys": [HEAVY], "scheduling": bad})),
        );
        assert_eq!(st, 400, "scheduling {bad}: {v}");
        assert!(
            openai_error(&v)["message"]
                .as_str()
                .unwrap()
                .contains("scheduling."),
            "{v}"
        );
    }
    p.put_tenant(
        "heavy",
        json!({"api_keys": [HEAVY], "scheduling": {"weight": 3}}),
    );
    p.put_tenant("light", json!({"api_keys": [LIGHT]}));
    let (st, v) = p.admin("GET", "/admin/v1/tenants/heavy", None);
    assert_eq!(st, 200);
    assert_eq!(
        v["scheduling"],
        json!({"weight": 3, "priority_class": 0}),
        "{v}"
    );

    let url = p.s.url("/v1/completions");
    keep_busy(url.clone(), HEAVY, 8);
    keep_busy(url, LIGHT, 8);
    wait_saturated(&p);
    let generated = |m: &str, t| tenant_metric(m, "pagoda_tenant_generation_tokens_total", t);
    let before = scrape(&p);
    std::thread::sleep(Duration::from_secs(6));
    let after = scrape(&p);
    let heavy = generated(&after, "heavy") - generated(&before, "heavy");
    let light = generated(&after, "light") - generated(&before, "light");
    let ratio = heavy / light;
    assert!(
        (ratio - 3.0).abs() <= 0.3,
        "heavy {heavy} and light {light} tokens: {ratio:.2}, not within 10% of 3:1"
    );
    // The engine holds four sequences, three of them heavy's: never more
    // of either, and exactly that except for a moment between a request
    // finishing and the next step admitting another.
    let mut exact = 0;
    for _ in 0..10 {
        let m = scrape(&p);
        let running = |t| tenant_metric(&m, "pagoda_tenant_num_requests_running", t);
        let (h, l) = (running("heavy"), running("light"));
        assert!(h <= 3.0 && l <= 1.0, "heavy {h}, light {l} running");
        exact += usize::from((h, l) == (3.0, 1.0));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(exact >= 5, "3 and 1 running in only {exact} of 10 scrapes");

    // The other per-tenant series, labelled by tenant.
    for name in [
        "pagoda_tenant_prompt_tokens_total",
        "pagoda_tenant_time_to_first_token_seconds_count",
        "pagoda_tenant_request_queue_time_seconds_count",
    ] {
        for t in ["heavy", "light"] {
            assert!(
                tenant_metric(&after, name, t) > 0.0,
                "{name}{{tenant={t}}} in\n{after}"
            );
        }
    }
}
