//! Hot swap under load: 8 clients stream continuously while tag-v1 and
//! tag-v2 are uploaded alternately 10 times. No request fails, each carries
//! exactly one tag, and the tag is that of the version active when the
//! request was admitted.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[test]
fn hot_swap_under_load_keeps_each_request_on_its_admission_version() {
    let dir = TempDir::new("hotswap");
    let p = Arc::new(start(&dir, &[]));
    p.put_tenant(
        "t",
        json!({"api_keys": ["key-t-123456"], "plugins": ["tag"]}),
    );
    p.upload_ok("t", "tag", "tag-v1", None);
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    // (send, headers, tag)
    let results = Arc::new(Mutex::new(Vec::<(f64, f64, String)>::new()));
    let mut clients = Vec::new();
    for c in 0..8 {
        let (p, stop, results) = (Arc::clone(&p), Arc::clone(&stop), Arc::clone(&results));
        clients.push(std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let body = json!({"model": "smol", "prompt": format!("Count {c} {n}:"), "max_tokens": 6, "temperature": 0, "stream": true});
                let sent = t0.elapsed().as_secs_f64();
                let r = pagoda_e2e::agent()
                    .post(&p.s.url("/v1/completions"))
                    .header("Authorization", "Bearer key-t-123456")
                    .send_json(&body)
                    .expect("request");
                let headers = t0.elapsed().as_secs_f64();
                assert_eq!(r.status().as_u16(), 200, "client {c} request {n} failed");
                let events = pagoda_e2e::read_sse(r.into_body().into_reader());
                let mut text = String::new();
                for e in events.iter().filter(|e| *e != "[DONE]") {
                    let v: serde_json::Value = serde_json::from_str(e).unwrap();
                    assert!(v.get("error").is_none(), "client {c} request {n}: {v}");
                    for ch in v["choices"].as_array().into_iter().flatten() {
                        text.push_str(ch["text"].as_str().unwrap_or(""));
                    }
                }
                let tags = text.matches(" [v1]").count() + text.matches(" [v2]").count();
                assert_eq!(tags, 1, "exactly one tag in {text:?}");
                let tag = if text.ends_with(" [v1]") { "v1" } else if text.ends_with(" [v2]") { "v2" } else { panic!("tag not at the end: {text:?}") };
                results.lock().unwrap().push((sent, headers, tag.to_string()));
                n += 1;
            }
        }));
    }
    // (start, end, tag now active)
    let mut swaps = vec![(0.0, 0.0, "v1".to_string())];
    std::thread::sleep(std::time::Duration::from_millis(500));
    for i in 0..10 {
        let (file, tag) = if i % 2 == 0 {
            ("tag-v2", "v2")
        } else {
            ("tag-v1", "v1")
        };
        let start = t0.elapsed().as_secs_f64();
        p.upload_ok("t", "tag", file, None);
        swaps.push((start, t0.elapsed().as_secs_f64(), tag.to_string()));
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("a client failed");
    }
    let results = results.lock().unwrap();
    assert!(results.len() >= 16, "only {} requests ran", results.len());
    let mut checked = 0;
    for (sent, headers, tag) in results.iter() {
        // Admission happens between sending and the response headers; skip
        // requests whose window overlaps a swap.
        if swaps
            .iter()
            .skip(1)
            .any(|(s, e, _)| s <= headers && e >= sent)
        {
            continue;
        }
        let expect = &swaps.iter().rev().find(|(_, e, _)| e <= sent).unwrap().2;
        assert_eq!(
            tag, expect,
            "request sent at {sent:.3}s got {tag}, active was {expect}; swaps {swaps:?}"
        );
        checked += 1;
    }
    assert!(checked > 0, "no request fell between swaps");
    let (_, v) = p.admin("GET", "/admin/v1/tenants/t/plugins", None);
    assert_eq!(v["data"][0]["active_version"], 11, "{v}");
}

/// The memory images of the compiled plugin versions this server holds
/// (wasmtime keeps each in a memfd).
fn wasm_images(p: &PServer) -> usize {
    let fds = std::path::PathBuf::from(format!("/proc/{}/fd", p.s.child.id()));
    std::fs::read_dir(fds)
        .expect("fd dir")
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().contains("wasm-memory-image"))
        })
        .count()
}

#[test]
fn many_uploads_keep_only_a_few_versions_compiled_and_rollback_still_works() {
    let dir = TempDir::new("uploads-bounded");
    let p = start(&dir, &[]);
    p.put_tenant("t", json!({"api_keys": ["key-t-123456"]}));
    let before = wasm_images(&p);
    p.upload_ok("t", "tag", "tag-v1", None);
    // A component holds one memory image per core module with data.
    let per_version = wasm_images(&p) - before;
    assert!(per_version >= 1, "no memory image to count");
    for i in 1..12 {
        p.upload_ok(
            "t",
            "tag",
            if i % 2 == 0 { "tag-v1" } else { "tag-v2" },
            None,
        );
    }
    // The active version and the two before it stay compiled; the other
    // nine were unloaded (their memory images closed), not leaked.
    let bound = before + 3 * per_version;
    let images = wasm_images(&p);
    assert!(
        images <= bound,
        "{images} plugin memory images are open after 12 uploads (at most {bound})"
    );
    // Rolling back past the loaded ones reloads from the state dir.
    for _ in 0..4 {
        let (st, v) = p.admin("POST", "/admin/v1/tenants/t/plugins/tag/rollback", None);
        assert_eq!(st, 200, "{v}");
    }
    let (st, v) = p.post_as(
        "key-t-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    // 12 uploads, 4 rollbacks: version 8 (tag-v2) is active.
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or("")
            .ends_with(" [v2]"),
        "{v}"
    );
    assert!(wasm_images(&p) <= bound);
}
