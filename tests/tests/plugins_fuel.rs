//! Fuel metering (`pagoda serve --plugin-fuel`, budget per hook call in the
//! tenant's `plugin_limits.fuel`): a plugin that loops forever is stopped
//! when its call has burnt exactly its budget, long before its wall-clock
//! deadline, and fails only its own request with a `plugin_error` of kind
//! `out_of_fuel`; `/metrics` counts the error and the fuel consumed.
//! Well-behaved plugins run under metering as before, and the epoch
//! deadline still stops a loop whose fuel budget is too large to matter.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Fuel per call of the looping tenant: milliseconds of spinning.
const BUDGET: u64 = 20_000_000;
/// Its wall-clock deadline, far beyond what the budget lasts.
const DEADLINE_MS: u64 = 30_000;

fn fuel_of(p: &PServer, tenant: &str, plugin: &str) -> f64 {
    let (_, metrics) = p.s.get("/metrics");
    metric_sum(
        &metrics,
        "pagoda_plugin_fuel_consumed_total",
        &[("tenant", tenant), ("plugin", plugin)],
    )
}

#[test]
fn a_looping_plugin_runs_out_of_fuel_and_fails_only_its_request() {
    let dir = TempDir::new("fuel");
    let p = Arc::new(start(
        &dir,
        &["--plugin-fuel", "--metrics-tenant-label", "id"],
    ));

    // A loop with a small fuel budget and a long deadline.
    p.put_tenant(
        "spender",
        json!({
            "api_keys": ["key-spender-123456"],
            "plugins": ["loop"],
            "plugin_limits": {"fuel": BUDGET, "timeout_ms": DEADLINE_MS},
        }),
    );
    p.upload_ok("spender", "loop", "loop", None);
    // A loop with fuel to spare: the deadline stops it.
    p.put_tenant(
        "rich",
        json!({
            "api_keys": ["key-rich-123456"],
            "plugins": ["loop"],
            "plugin_limits": {"fuel": 1u64 << 50, "timeout_ms": 300},
        }),
    );
    p.upload_ok("rich", "loop", "loop", None);
    // A well-behaved plugin under the same metering.
    p.put_tenant(
        "good",
        json!({
            "api_keys": ["key-good-123456"],
            "plugins": ["tag"],
            "plugin_limits": {"fuel": BUDGET},
        }),
    );
    p.upload_ok("good", "tag", "tag-v1", Some(&json!({"tag": " [good]"})));

    // The good tenant is served all along.
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let good = {
        let (p, stop, served) = (Arc::clone(&p), Arc::clone(&stop), Arc::clone(&served));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (st, v) = p.post_as("key-good-123456", "/v1/chat/completions", &chat("Hi", 4));
                assert_eq!(st, 200, "the good tenant failed: {v}");
                let text = v["choices"][0]["message"]["content"].as_str().unwrap();
                assert!(text.ends_with(" [good]"), "{text:?}");
                served.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let before = fuel_of(&p, "spender", "loop");
    assert_eq!(before, 0.0);
    for round in 1..=3u32 {
        let started = Instant::now();
        let (st, v) = p.post_as("key-spender-123456", "/v1/chat/completions", &chat("Hi", 4));
        let took = started.elapsed();
        assert_eq!(st, 500, "{v}");
        let e = openai_error(&v);
        assert_eq!(e["code"], "plugin_error", "{v}");
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains("'loop'") && msg.contains("out_of_fuel"),
            "the message should name the plugin and say out_of_fuel: {msg}"
        );
        assert!(
            took < Duration::from_millis(DEADLINE_MS / 3),
            "fuel should stop the loop long before its {DEADLINE_MS} ms deadline; took {took:?}"
        );
        // Each failed call burnt exactly its budget, no more.
        assert_eq!(
            fuel_of(&p, "spender", "loop"),
            (BUDGET * u64::from(round)) as f64,
            "round {round}"
        );
    }

    // With fuel to spare, the epoch deadline is what stops the loop.
    let started = Instant::now();
    let (st, v) = p.post_as("key-rich-123456", "/v1/chat/completions", &chat("Hi", 4));
    assert_eq!(st, 500, "{v}");
    let msg = openai_error(&v)["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("'loop'") && msg.contains("timeout") && msg.contains("300 ms"),
        "{msg}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );

    stop.store(true, Ordering::Relaxed);
    good.join().expect("good tenant thread");
    assert!(served.load(Ordering::Relaxed) > 0);

    // The metrics say why, per tenant.
    let (_, metrics) = p.s.get("/metrics");
    let errors = |tenant: &str, kind: &str| {
        metric_sum(
            &metrics,
            "pagoda_plugin_errors_total",
            &[("tenant", tenant), ("plugin", "loop"), ("kind", kind)],
        )
    };
    assert_eq!(errors("spender", "out_of_fuel"), 3.0);
    assert_eq!(errors("spender", "timeout"), 0.0);
    assert_eq!(errors("rich", "timeout"), 1.0);
    assert_eq!(errors("rich", "out_of_fuel"), 0.0);
    let good_fuel = fuel_of(&p, "good", "tag");
    assert!(
        good_fuel > 0.0,
        "the good plugin's calls are metered too:\n{metrics}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "pagoda_plugin_errors_total",
            &[("tenant", "good")]
        ),
        0.0
    );
}
