//! KV-cache events for prefix-aware routing (`--kv-events-config`), read by
//! a pyzmq subscriber as llm-d's endpoint picker reads vLLM's: BlockStored
//! for a prompt's full blocks with the token ids `/v1/completions/render`
//! returns, different `extra_keys` for two tenants' identical prompts,
//! BlockRemoved under a small pool, rising sequence numbers, and a late
//! subscriber's replay. scripts/test.sh installs pyzmq and msgpack.

mod plugins_common;

use pagoda_e2e::{free_port, TempDir};
use plugins_common::*;
use serde_json::json;

const A: &str = "key-events-tenant-a";
const B: &str = "key-events-tenant-b";

#[test]
fn a_zmq_subscriber_sees_stores_evictions_tenants_and_replays() {
    let (pub_port, replay_port) = (free_port(), free_port());
    let config = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{pub_port}"),
        "replay_endpoint": format!("tcp://*:{replay_port}"),
        "topic": "kv@test@smol",
    })
    .to_string();
    let dir = TempDir::new("kv-events");
    // 24 blocks of 16 tokens: a dozen distinct prompts evict.
    let p = start(
        &dir,
        &[
            "--kv-events-config",
            &config,
            "--kv-cache-memory",
            "8640KiB",
            "--max-model-len",
            "384",
        ],
    );
    p.put_tenant("a", json!({"api_keys": [A]}));
    p.put_tenant("b", json!({"api_keys": [B]}));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/kv_events.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args([
            p.s.base.as_str(),
            "smol",
            &format!("tcp://127.0.0.1:{pub_port}"),
            &format!("tcp://127.0.0.1:{replay_port}"),
            A,
            B,
            ADMIN,
        ])
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.ends_with(" 0 failed")),
        "kv_events.py:\n{stdout}\n{stderr}\nserver log:\n{}",
        p.s.log_text()
    );
    // The publisher kept up: nothing dropped, and the counter is shown.
    let (_, metrics) = p.s.get("/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("pagoda_kv_events_dropped_batches_total{") && l.ends_with(" 0")),
        "{metrics}"
    );
    assert!(
        p.s.log_text().contains("KV-cache events: publishing on"),
        "{}",
        p.s.log_text()
    );
}

#[test]
fn bad_kv_events_configurations_stop_start_up() {
    for (config, says) in [
        (
            r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
            "\"zmq\" or \"null\"",
        ),
        (
            r#"{"enable_kv_cache_events": true, "endpoint": "localhost"}"#,
            "not a ZeroMQ endpoint",
        ),
    ] {
        let out = std::process::Command::new(pagoda_e2e::pagoda_bin())
            .arg("serve")
            .arg(pagoda_e2e::demo_gguf())
            .args(["--kv-events-config", config])
            .output()
            .expect("running pagoda serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{config}: {stderr}");
        assert!(stderr.contains(says), "{config}: {stderr}");
    }
}
