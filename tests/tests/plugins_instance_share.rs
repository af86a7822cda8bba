//! The plugin instance pool is shared between tenants: a tenant whose
//! requests hold plugin instances for long (slow or long-running requests)
//! is held to its share, and is refused at admission, before any token is
//! generated, while another tenant's requests are served in full,
//! post-processing included.

mod plugins_common;

use pagoda_e2e::{agent, TempDir};
use plugins_common::*;
use serde_json::json;

const GREEDY: &str = "key-greedy-123456";
const POLITE: &str = "key-polite-123456";

/// A long streamed completion as `key`; returns it once its head arrived
/// (admitted: its instance is reserved) or its error status and body.
fn long_stream(p: &PServer, key: &str) -> Result<ureq::http::Response<ureq::Body>, (u16, String)> {
    let mut r = agent()
        .post(&p.s.url("/v1/completions"))
        .header("Authorization", &format!("Bearer {key}"))
        .send_json(json!({"model": "smol", "prompt": "Count to a thousand:",
            "max_tokens": 400, "ignore_eos": true, "stream": true}))
        .expect("request");
    match r.status().as_u16() {
        200 => Ok(r),
        st => Err((st, r.body_mut().read_to_string().unwrap_or_default())),
    }
}

#[test]
fn a_tenant_holding_plugin_instances_is_kept_to_its_share() {
    let dir = TempDir::new("instance-share");
    let p = start(&dir, &["--plugin-max-instances", "8"]);
    p.put_tenant("greedy", json!({"api_keys": [GREEDY], "plugins": ["tag"]}));
    p.put_tenant("polite", json!({"api_keys": [POLITE], "plugins": ["tag"]}));
    p.upload_ok("greedy", "tag", "tag-v1", None);
    p.upload_ok("polite", "tag", "tag-v1", None);

    // Eight instances, two tenants: greedy may hold four.
    let mut held = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..6 {
        match long_stream(&p, GREEDY) {
            Ok(r) => held.push(r),
            Err(e) => refused.push(e),
        }
    }
    assert_eq!(held.len(), 4, "refused: {refused:?}");
    for (st, body) in &refused {
        assert_eq!(*st, 503, "{body}");
        assert!(body.contains("share of 4 plugin instances"), "{body}");
    }
    // Meanwhile the other tenant's requests run to the end, through their
    // plugin's post-processing.
    let polite: Vec<_> = (0..4)
        .map(|_| {
            let url = p.s.url("/v1/completions");
            std::thread::spawn(move || {
                let mut r = agent()
                    .post(&url)
                    .header("Authorization", &format!("Bearer {POLITE}"))
                    .send_json(json!({"model": "smol", "prompt": "Hello", "max_tokens": 3}))
                    .expect("request");
                let st = r.status().as_u16();
                (st, r.body_mut().read_to_string().unwrap_or_default())
            })
        })
        .collect();
    for t in polite {
        let (st, body) = t.join().expect("polite client");
        assert_eq!(st, 200, "{body}");
        assert!(body.contains("[v1]"), "{body}");
    }
    // Greedy's instances come back when its requests end.
    drop(held);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match long_stream(&p, GREEDY) {
            Ok(_) => break,
            Err(e) => assert!(
                std::time::Instant::now() < deadline,
                "never admitted again: {e:?}"
            ),
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
