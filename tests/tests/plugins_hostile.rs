//! Hostile plugins (an endless loop, a memory hog, a trap, a 10 MB output)
//! fail only their own requests, with a clear OpenAI error within the
//! deadline, while another tenant's requests succeed and the server stays up.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn hostile_plugins_fail_only_their_own_requests() {
    let dir = TempDir::new("hostile");
    let p = Arc::new(start(&dir, &[]));
    p.put_tenant("good", json!({"api_keys": ["key-good-123456"]}));
    let hostile = [
        ("loop", "timeout"),
        ("oom", "oom"),
        ("trap", "trap"),
        ("big-output", "output_too_large"),
    ];
    for (name, _) in hostile {
        p.put_tenant(
            &format!("h-{name}"),
            json!({"api_keys": [format!("key-{name}-123456")], "plugins": [name]}),
        );
        p.upload_ok(&format!("h-{name}"), name, name, None);
    }
    // The good tenant keeps working meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let good = {
        let (p, stop, ok) = (Arc::clone(&p), Arc::clone(&stop), Arc::clone(&ok));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (st, v) = p.post_as(
                    "key-good-123456",
                    "/v1/chat/completions",
                    &chat("Say hi", 4),
                );
                assert_eq!(st, 200, "the good tenant failed: {v}");
                ok.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    for round in 0..2 {
        for (name, kind) in hostile {
            for stream in [false, true] {
                let started = Instant::now();
                let key = format!("key-{name}-123456");
                let err = if stream {
                    let (st, _text, err) =
                        p.stream_as(&key, "/v1/chat/completions", &chat("Say hi", 8));
                    assert!(st == 200 || st >= 500, "{name}: status {st}");
                    err.unwrap_or_else(|| panic!("{name} (stream, round {round}): no error event"))
                } else {
                    let (st, v) = p.post_as(&key, "/v1/chat/completions", &chat("Say hi", 8));
                    assert!(st == 500 || st == 503, "{name}: status {st}: {v}");
                    v
                };
                let msg = err["error"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                assert_eq!(err["error"]["code"], "plugin_error", "{name}: {err}");
                assert!(
                    msg.contains(name) && msg.contains(kind),
                    "{name}: message should name the plugin and '{kind}': {msg}"
                );
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "{name} took {:?}",
                    started.elapsed()
                );
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    good.join().expect("good tenant thread");
    assert!(ok.load(Ordering::Relaxed) > 0);
    // Still up, and the errors were counted per kind.
    let (st, _) = p.s.get("/health");
    assert_eq!(st, 200);
    let (_, metrics) = p.s.get("/metrics");
    for (name, kind) in hostile {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("pagoda_plugin_errors_total")
                    && l.contains(&format!("plugin=\"{name}\""))
                    && l.contains(&format!("kind=\"{kind}\""))),
            "no error metric for {name}/{kind}"
        );
    }
}
