//! Tenant-owned LoRA adapters through the real server (issue 42): uploaded
//! through the admin API as multipart/form-data, checked against the base
//! before they become visible, stored by content hash in `--state-dir`,
//! versioned and rolled back, private to their tenant (another tenant's
//! adapter answers exactly as a missing model, `/v1/models` included),
//! bounded by per-tenant quotas, chosen by a `route` plugin, named in the
//! access log and the per-tenant metrics, crash-safe under `kill -9`, and
//! shared between replicas through an S3 state store (moto).
//!
//! Outputs are checked against PEFT's own (`tests/fixtures/lora`): a
//! request that runs an adapter gives that adapter's prompt logprobs within
//! 1e-4, which no other adapter (nor the base) comes near.

mod plugins_common;
mod store_common;

use pagoda_e2e::{agent, Server, TempDir};
use plugins_common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use store_common::*;

const KEY_A: &str = "key-tenant-a-1234";
const KEY_B: &str = "key-tenant-b-1234";

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures"))
}

fn llama() -> PathBuf {
    fixtures().join("hf-families/llama")
}

/// The flags of a server with tenants and adapters on the llama fixture.
fn server_args(state: &Path) -> Vec<String> {
    [
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enable-lora",
        "--max-loras",
        "2",
        "--state-dir",
        &state.to_string_lossy(),
        "--admin-token",
        ADMIN,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn start_at(state: &Path, extra: &[&str], env: &[(&str, &str)]) -> PServer {
    let mut args = server_args(state);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    PServer {
        s: Server::start_with_env(&llama(), &args, env),
        state: state.to_path_buf(),
    }
}

/// A multipart/form-data body of an adapter folder's two files (or of
/// the parts given).
fn multipart(parts: &[(&str, Vec<u8>)]) -> (String, Vec<u8>) {
    let boundary = "pagoda-test-boundary-7f3a";
    let mut body = Vec::new();
    for (name, bytes) in parts {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn files_of(fixture: &str) -> Vec<(&'static str, Vec<u8>)> {
    let d = pagoda_e2e::lora_fixture(fixture);
    vec![
        (
            "adapter_config.json",
            std::fs::read(d.join("adapter_config.json")).expect("config"),
        ),
        (
            "adapter_model.safetensors",
            std::fs::read(d.join("adapter_model.safetensors")).expect("weights"),
        ),
    ]
}

fn upload_parts(p: &PServer, tenant: &str, name: &str, parts: &[(&str, Vec<u8>)]) -> (u16, Value) {
    let (ct, body) = multipart(parts);
    let url =
        p.s.url(&format!("/admin/v1/tenants/{tenant}/adapters/{name}"));
    let mut r = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {ADMIN}"))
        .header("Content-Type", &ct)
        .send(&body[..])
        .expect("upload");
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn upload(p: &PServer, tenant: &str, name: &str, fixture: &str) -> (u16, Value) {
    upload_parts(p, tenant, name, &files_of(fixture))
}

fn upload_ok(p: &PServer, tenant: &str, name: &str, fixture: &str) -> Value {
    let (st, v) = upload(p, tenant, name, fixture);
    assert_eq!(
        st,
        201,
        "upload {fixture} as {tenant}/{name}: {v}\n{}",
        p.s.log_text()
    );
    v
}

/// A completion for `model` as `key`, with prompt logprobs of `fixture`'s
/// prompt: (status, body).
fn score(p: &PServer, key: &str, model: &str, fixture: &str) -> (u16, Value) {
    let (ids, _) = pagoda_e2e::lora_first_case(fixture);
    p.post_as(
        key,
        "/v1/completions",
        &json!({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}),
    )
}

/// The largest gap between the server's prompt logprobs for `model` (as
/// `key`) and PEFT's for adapter `fixture`.
fn gap(p: &PServer, key: &str, model: &str, fixture: &str) -> f64 {
    let (ids, want) = pagoda_e2e::lora_first_case(fixture);
    let (st, v) = score(p, key, model, fixture);
    assert_eq!(st, 200, "{model} as {key}: {v}");
    let got = v["choices"][0]["prompt_logprobs"]
        .as_array()
        .or_else(|| v["prompt_logprobs"].as_array())
        .unwrap_or_else(|| panic!("no prompt_logprobs: {v}"));
    let mut worst = 0f64;
    for (i, w) in want.iter().enumerate() {
        let tok = ids[i + 1].to_string();
        let lp = got[i + 1][&tok]["logprob"]
            .as_f64()
            .unwrap_or_else(|| panic!("prompt token {}: {}", i + 1, got[i + 1]));
        worst = worst.max((lp - w).abs());
    }
    worst
}

/// Asserts that `model` as `key` runs exactly adapter `fixture`.
fn runs(p: &PServer, key: &str, model: &str, fixture: &str) {
    let g = gap(p, key, model, fixture);
    assert!(
        g < 1e-4,
        "{model} as {key}: prompt logprobs {g:.2e} from PEFT's {fixture}"
    );
}

/// The ids `/v1/models` lists for `key`.
fn model_ids(p: &PServer, key: &str) -> Vec<String> {
    let (st, v) = call_url(&p.s.url("/v1/models"), "GET", key, None);
    assert_eq!(st, 200, "{v}");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect()
}

fn tenants(p: &PServer) {
    p.put_tenant("a", json!({"api_keys": [KEY_A]}));
    p.put_tenant("b", json!({"api_keys": [KEY_B]}));
}

fn restart(p: PServer, extra: &[&str]) -> PServer {
    let state = p.state.clone();
    drop(p);
    start_at(&state, extra, &[])
}

#[test]
fn adapters_are_uploaded_checked_versioned_private_and_persisted() {
    let dir = TempDir::new("tenant-adapters");
    let p = start_at(&dir.0.join("state"), &[], &[]);
    tenants(&p);

    // A uploads an adapter and runs it: PEFT's outputs, not the base's.
    let v = upload_ok(&p, "a", "support", "llama/qv-r8");
    assert_eq!(
        (v["version"].as_u64(), v["rank"].as_u64()),
        (Some(1), Some(8)),
        "{v}"
    );
    assert_eq!(v["modules"], json!(["q_proj", "v_proj"]), "{v}");
    runs(&p, KEY_A, "support", "llama/qv-r8");
    assert!(
        gap(&p, KEY_A, "smol", "llama/qv-r8") > 1e-2,
        "the base is not the adapter"
    );
    assert!(model_ids(&p, KEY_A).contains(&"support".to_string()));

    // Stored by content hash.
    for (file, bytes) in files_of("llama/qv-r8") {
        let sha = sha256_hex(&bytes);
        let blob = p.state.join("tenants/a/adapters/.blobs").join(&sha);
        assert_eq!(
            std::fs::read(&blob).ok().as_deref(),
            Some(&bytes[..]),
            "{file} at {}",
            blob.display()
        );
    }

    // B cannot see or use it: exactly a missing model's answer.
    let (st_b, v_b) = score(&p, KEY_B, "support", "llama/qv-r8");
    let (st_m, v_m) = score(&p, KEY_B, "no-such-adapter", "llama/qv-r8");
    assert_eq!((st_b, st_m), (404, 404), "{v_b} {v_m}");
    assert_eq!(v_b["error"]["code"], "model_not_found", "{v_b}");
    assert_eq!(
        v_b["error"]["message"]
            .as_str()
            .map(|m| m.replace("support", "X")),
        v_m["error"]["message"]
            .as_str()
            .map(|m| m.replace("no-such-adapter", "X")),
        "B's answer for A's adapter differs from a missing model's"
    );
    assert_eq!(
        (&v_b["error"]["type"], &v_b["error"]["param"]),
        (&v_m["error"]["type"], &v_m["error"]["param"])
    );
    assert!(!model_ids(&p, KEY_B).contains(&"support".to_string()));
    let (st, _) = call_url(&p.s.url("/v1/models/support"), "GET", KEY_B, None);
    assert_eq!(st, 404);
    let (st, v) = call_url(&p.s.url("/v1/models/support"), "GET", KEY_A, None);
    assert_eq!((st, &v["parent"]), (200, &json!("smol")), "{v}");
    // Chat and the render route resolve the same way.
    let (st, v) = p.post_as(
        KEY_B,
        "/v1/chat/completions",
        &json!({"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    );
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("model_not_found")),
        "{v}"
    );

    // B has its own `support`: each gets its own.
    upload_ok(&p, "b", "support", "llama/all-r16");
    runs(&p, KEY_B, "support", "llama/all-r16");
    runs(&p, KEY_A, "support", "llama/qv-r8");

    // The prefix cache stays per tenant and per adapter: A's repeat hits
    // A's cache; B's copy of the very same adapter hits neither A's cache
    // nor B's own base model's.
    // (Without prompt_logprobs, which compute every prompt token anew.)
    let (ids, _) = pagoda_e2e::lora_first_case("llama/qv-r8");
    let cached = |key: &str, model: &str| {
        let (st, v) = p.post_as(
            key,
            "/v1/completions",
            &json!({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}),
        );
        assert_eq!(st, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens: {v}"))
    };
    upload_ok(&p, "b", "twin", "llama/qv-r8");
    cached(KEY_A, "support");
    assert!(cached(KEY_A, "support") > 0, "A's repeat missed its cache");
    assert_eq!(cached(KEY_B, "smol"), 0, "B hit A's cached base prompt");
    assert_eq!(
        cached(KEY_B, "twin"),
        0,
        "B's adapter hit A's cache or B's base model's"
    );
    assert!(cached(KEY_B, "twin") > 0, "B's repeat missed its cache");
    runs(&p, KEY_B, "twin", "llama/qv-r8");

    // A corrupt upload changes nothing: an adapter for another base, a
    // truncated weights file, a missing part, a rank above the limit.
    let mut truncated = files_of("llama/all-r16");
    let n = truncated[1].1.len();
    truncated[1].1.truncate(n / 2);
    let mut big_rank = files_of("llama/qv-r8");
    let mut cfg: Value = serde_json::from_slice(&big_rank[0].1).expect("config");
    cfg["r"] = json!(64);
    big_rank[0].1 = serde_json::to_vec(&cfg).expect("JSON");
    let only_config = vec![files_of("llama/qv-r8").remove(0)];
    for (what, parts, says) in [
        ("another base", files_of("qwen3/all-r8"), "shape"),
        ("truncated", truncated, "safetensors"),
        ("one part", only_config, "adapter_model.safetensors"),
        ("rank", big_rank, "--max-lora-rank"),
    ] {
        let (st, v) = upload_parts(&p, "a", "support", &parts);
        assert_eq!(st, 400, "{what}: {v}");
        let msg = openai_error(&v)["message"].as_str().unwrap_or("");
        assert!(msg.contains(says), "{what}: {msg}");
    }
    let (st, v) = p.admin("GET", "/admin/v1/tenants/a/adapters", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["data"][0]["name"], "support", "{v}");
    assert_eq!(v["data"][0]["active_version"], 1, "{v}");
    assert_eq!(
        v["data"][0]["versions"].as_array().map(Vec::len),
        Some(1),
        "{v}"
    );
    runs(&p, KEY_A, "support", "llama/qv-r8");
    // A name that is a served model's, or not a name, is refused.
    let (st, v) = upload(&p, "a", "smol", "llama/qv-r8");
    assert_eq!(st, 400, "{v}");
    let (st, _) = upload(&p, "a", ".hidden", "llama/qv-r8");
    assert_eq!(st, 400);

    // A new version replaces it; rollback restores the earlier outputs.
    let v = upload_ok(&p, "a", "support", "llama/rslora-r4");
    assert_eq!(v["version"], 2, "{v}");
    runs(&p, KEY_A, "support", "llama/rslora-r4");
    let (st, v) = p.admin(
        "POST",
        "/admin/v1/tenants/a/adapters/support/rollback",
        None,
    );
    assert_eq!((st, &v["version"]), (200, &json!(1)), "{v}");
    runs(&p, KEY_A, "support", "llama/qv-r8");
    // The version rolled back from can no longer be reached: it and its
    // files are gone, so stored bytes are what the tenant can use.
    let (_, v) = p.admin("GET", "/admin/v1/tenants/a/adapters", None);
    assert_eq!(v["data"][0]["active_version"], 1, "{v}");
    let versions: Vec<u64> = v["data"][0]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .filter_map(|r| r["version"].as_u64())
        .collect();
    assert_eq!(versions, [1], "{v}");
    assert_eq!(
        v["usage"]["stored_bytes"].as_u64(),
        Some(
            files_of("llama/qv-r8")
                .iter()
                .map(|(_, b)| b.len() as u64)
                .sum()
        ),
        "{v}"
    );
    let dropped = sha256_hex(&files_of("llama/rslora-r4")[1].1);
    assert!(!p
        .state
        .join("tenants/a/adapters/.blobs")
        .join(dropped)
        .exists());
    assert!(!p.state.join("tenants/a/adapters/support/2.json").exists());

    // Everything survives a restart, loaded on first use.
    let p = restart(p, &[]);
    runs(&p, KEY_A, "support", "llama/qv-r8");
    runs(&p, KEY_B, "support", "llama/all-r16");
    let (st, _) = score(&p, KEY_B, "support-x", "llama/qv-r8");
    assert_eq!(st, 404);

    // DELETE: a request in flight (its first token out) finishes with the
    // adapter; new ones get 404.
    let addr = p.s.base.clone();
    let (ids, _) = pagoda_e2e::lora_first_case("llama/qv-r8");
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let streaming = std::thread::spawn(move || {
        use std::io::BufRead;
        let r = agent()
            .post(&format!("{addr}/v1/completions"))
            .header("Authorization", &format!("Bearer {KEY_A}"))
            .send_json(&json!({"model": "support", "prompt": ids, "max_tokens": 80,
                "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true}}))
            .expect("stream");
        assert_eq!(r.status().as_u16(), 200);
        let mut events = Vec::new();
        for line in std::io::BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.expect("read");
            if let Some(e) = line.strip_prefix("data: ") {
                if events.is_empty() {
                    let _ = started_tx.send(());
                }
                events.push(e.to_string());
            }
        }
        events
    });
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the stream started");
    let (st, v) = p.admin("DELETE", "/admin/v1/tenants/a/adapters/support", None);
    assert_eq!(st, 200, "{v}");
    let events = streaming.join().expect("stream thread");
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "{events:?}"
    );
    let usage = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    assert_eq!(usage, Some(80), "the request in flight was cut: {events:?}");
    let (st, v) = score(&p, KEY_A, "support", "llama/qv-r8");
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("model_not_found")),
        "{v}"
    );
    assert!(!model_ids(&p, KEY_A).contains(&"support".to_string()));
    let (st, _) = p.admin("DELETE", "/admin/v1/tenants/a/adapters/support", None);
    assert_eq!(st, 404);
    // Its blobs are gone; B's adapter is untouched.
    let blobs =
        std::fs::read_dir(p.state.join("tenants/a/adapters/.blobs")).map_or(0, |d| d.count());
    assert_eq!(blobs, 0, "blobs of a deleted adapter remain");
    runs(&p, KEY_B, "support", "llama/all-r16");
}

/// sha256 of `b`, in hex (by the system's sha256sum).
fn sha256_hex(b: &[u8]) -> String {
    use std::io::Write;
    let mut c = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum");
    c.stdin.take().expect("stdin").write_all(b).expect("write");
    let out = c.wait_with_output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a hash")
        .to_string()
}

#[test]
fn quotas_name_their_limit_and_cold_loads_evict_idle_adapters() {
    let dir = TempDir::new("tenant-adapter-quotas");
    let p = start_at(&dir.0.join("state"), &[], &[("RUST_LOG", "info")]);
    p.put_tenant(
        "q",
        json!({"api_keys": [KEY_A], "adapter_limits": {"max_stored": 1}}),
    );
    upload_ok(&p, "q", "one", "llama/qv-r8");
    let (st, v) = upload(&p, "q", "two", "llama/rslora-r4");
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "adapter_quota_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("adapter_limits.max_stored ")),
        "{v}"
    );
    // A new version of a stored adapter is not a new adapter.
    upload_ok(&p, "q", "one", "llama/qv-r8");

    let size = |f: &str| files_of(f).iter().map(|(_, b)| b.len() as u64).sum::<u64>();
    p.put_tenant(
        "q",
        json!({"api_keys": [KEY_A], "adapter_limits": {"max_stored": 3, "max_stored_bytes": size("llama/qv-r8") + size("llama/all-r16") / 2}}),
    );
    let (st, v) = upload(&p, "q", "two", "llama/all-r16");
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("adapter_limits.max_stored_bytes")),
        "{v}"
    );

    // One resident at a time: each use of the other is a cold load that
    // evicts the idle one; both keep their own outputs.
    p.put_tenant(
        "q",
        json!({"api_keys": [KEY_A], "adapter_limits": {"max_stored": 3, "max_resident": 1}}),
    );
    upload_ok(&p, "q", "two", "llama/rslora-r4");
    let (_, v) = p.admin("GET", "/admin/v1/tenants/q/adapters", None);
    let resident: Vec<(&str, bool)> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|a| (a["name"].as_str().unwrap_or(""), a["resident"] == true))
        .collect();
    assert_eq!(resident, [("one", false), ("two", true)], "{v}");
    assert_eq!(v["usage"]["resident"], 1, "{v}");
    runs(&p, KEY_A, "one", "llama/qv-r8");
    runs(&p, KEY_A, "two", "llama/rslora-r4");
    runs(&p, KEY_A, "one", "llama/qv-r8");
    let (_, metrics) = p.s.get("/metrics");
    let (_, t) = p.admin("GET", "/admin/v1/tenants/q", None);
    let label = t["metrics_label"].as_str().expect("a label").to_string();
    let loads = metric_sum(
        &metrics,
        "pagoda_tenant_adapter_cold_loads_total",
        &[("tenant", &label)],
    );
    assert_eq!(loads, 3.0, "three cold loads:\n{metrics}");
    assert!(
        metrics.contains("# HELP pagoda_tenant_adapter_cold_loads_total"),
        "undescribed:\n{metrics}"
    );
    // Per-tenant metrics name the adapter; under the default hashed
    // tenant label, the adapter's name is hashed too.
    let used = metric_sum(
        &metrics,
        "pagoda_tenant_adapter_requests_total",
        &[("tenant", &label)],
    );
    assert_eq!(used, 3.0, "{metrics}");
    let series: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("pagoda_tenant_adapter_requests_total{"))
        .collect();
    assert_eq!(series.len(), 2, "one series per adapter: {series:?}");
    assert!(
        series.iter().all(|l| l.contains("adapter=\"a-")
            && !l.contains("\"one\"")
            && !l.contains("\"two\"")),
        "{series:?}"
    );
    assert!(p.s.log_text().contains("adapter evicted to make room"));

    // An adapter that could never be resident is refused at upload.
    p.put_tenant(
        "q",
        json!({"api_keys": [KEY_A], "adapter_limits": {"max_stored": 3, "max_resident_bytes": 1000}}),
    );
    let (st, v) = upload(&p, "q", "three", "llama/all-r16");
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("adapter_limits.max_resident_bytes")),
        "{v}"
    );
    let (_, v) = p.admin("GET", "/admin/v1/tenants/q/adapters", None);
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2), "{v}");
}

/// The server's JSON access lines for `path`, once there are `n`.
fn access_entries(p: &PServer, path: &str, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let entries: Vec<Value> =
            p.s.log_text()
                .lines()
                .filter(|l| l.contains("pagoda::access"))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|v| v["path"] == path)
                .collect();
        if entries.len() >= n || std::time::Instant::now() > deadline {
            return entries;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_route_plugin_chooses_the_adapter_and_accounting_names_it() {
    let dir = TempDir::new("tenant-adapter-route");
    let p = start_at(
        &dir.0.join("state"),
        &["--log-format", "json", "--metrics-tenant-label", "id"],
        &[],
    );
    p.put_tenant("a", json!({"api_keys": [KEY_A], "plugins": ["router"]}));
    p.put_tenant("b", json!({"api_keys": [KEY_B], "plugins": ["router"]}));
    upload_ok(&p, "a", "support", "llama/qv-r8");
    upload_ok(&p, "b", "other", "llama/all-r16");
    // Both tenants' routers send every request to their `support`.
    let route_to = json!({"adapter": "support"});
    let (st, v) = p.upload("a", "router", &component("router"), Some(&route_to));
    assert_eq!(st, 201, "{v}");
    let (st, v) = p.upload("b", "router", &component("router"), Some(&route_to));
    assert_eq!(st, 201, "{v}");

    // A's clients name the base model and get A's adapter.
    runs(&p, KEY_A, "smol", "llama/qv-r8");
    // B has no `support`: the plugin cannot reach A's.
    let (st, v) = score(&p, KEY_B, "smol", "llama/qv-r8");
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("model_not_found")),
        "{v}"
    );
    // Once B has one, B's routes to it.
    upload_ok(&p, "b", "support", "llama/rslora-r4");
    runs(&p, KEY_B, "smol", "llama/rslora-r4");

    // The access log names the adapter each request ran with.
    let entries = access_entries(&p, "/v1/completions", 3);
    let ran: Vec<(&str, &str, u64)> = entries
        .iter()
        .map(|e| {
            (
                e["tenant"].as_str().unwrap_or(""),
                e["adapter"].as_str().unwrap_or(""),
                e["status"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        ran,
        [
            ("a", "support", 200),
            ("b", "-", 404),
            ("b", "support", 200)
        ],
        "{entries:?}"
    );
    // Per-tenant metrics name it too (--metrics-tenant-label id: by name).
    let (_, metrics) = p.s.get("/metrics");
    for t in ["a", "b"] {
        let n = metric_sum(
            &metrics,
            "pagoda_tenant_adapter_requests_total",
            &[("tenant", t), ("adapter", "support")],
        );
        assert_eq!(n, 1.0, "tenant {t}:\n{metrics}");
    }

    // Adapter labels are capped: past 32 distinct values, `other`.
    p.put_tenant("many", json!({"api_keys": ["key-many-123456"]}));
    for i in 0..34 {
        upload_ok(&p, "many", &format!("ad{i}"), "llama/qv-r8");
        let (st, v) = score(&p, "key-many-123456", &format!("ad{i}"), "llama/qv-r8");
        assert_eq!(st, 200, "{v}");
    }
    let (_, metrics) = p.s.get("/metrics");
    let series: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("pagoda_tenant_adapter_requests_total{") && l.contains("tenant=\"many\"")
        })
        .collect();
    let other = metric_sum(
        &metrics,
        "pagoda_tenant_adapter_requests_total",
        &[("tenant", "many"), ("adapter", "other")],
    );
    // 32 labels in all: `support` took one, so 31 of many's adapters have
    // their own series and the other 3 share `other`.
    assert_eq!((series.len(), other), (32, 3.0), "{series:#?}");
}

#[test]
fn an_adapter_the_admin_shares_serves_every_tenant_its_allowlist_admits() {
    let dir = TempDir::new("tenant-adapter-shared");
    let p = start_at(&dir.0.join("state"), &[], &[]);
    tenants(&p);
    p.put_tenant(
        "strict",
        json!({"api_keys": ["key-strict-12345"], "models": ["smol"]}),
    );
    p.put_tenant("lib", json!({"api_keys": ["key-lib-1234567"]}));
    let (ct, body) = multipart(&files_of("llama/qv-r8"));
    let url = p.s.url("/admin/v1/tenants/lib/adapters/common?shared=true");
    let r = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {ADMIN}"))
        .header("Content-Type", &ct)
        .send(&body[..])
        .expect("upload");
    assert_eq!(r.status().as_u16(), 201);
    // Not shared: private as ever.
    upload_ok(&p, "lib", "private", "llama/all-r16");

    for key in [KEY_A, KEY_B] {
        runs(&p, key, "common", "llama/qv-r8");
        assert!(model_ids(&p, key).contains(&"common".to_string()));
        assert!(!model_ids(&p, key).contains(&"private".to_string()));
        assert_eq!(score(&p, key, "private", "llama/qv-r8").0, 404);
        let (st, _) = call_url(&p.s.url("/v1/models/common"), "GET", key, None);
        assert_eq!(st, 200);
    }
    // A tenant whose allowlist does not name it does not get it.
    let (st, v) = score(&p, "key-strict-12345", "common", "llama/qv-r8");
    assert_eq!(
        (st, &v["error"]["code"]),
        (404, &json!("model_not_found")),
        "{v}"
    );
    assert!(!model_ids(&p, "key-strict-12345").contains(&"common".to_string()));
    // Its own adapters need no place in its allowlist.
    upload_ok(&p, "strict", "mine", "llama/all-r16");
    runs(&p, "key-strict-12345", "mine", "llama/all-r16");
    assert!(model_ids(&p, "key-strict-12345").contains(&"mine".to_string()));
    // A tenant's own adapter of that name wins over the shared one.
    upload_ok(&p, "a", "common", "llama/rslora-r4");
    runs(&p, KEY_A, "common", "llama/rslora-r4");
    runs(&p, KEY_B, "common", "llama/qv-r8");
    // Shared names are unique across tenants.
    let (ct, body) = multipart(&files_of("llama/qv-r8"));
    let url = p.s.url("/admin/v1/tenants/b/adapters/common?shared=true");
    let mut r = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {ADMIN}"))
        .header("Content-Type", &ct)
        .send(&body[..])
        .expect("upload");
    assert_eq!(r.status().as_u16(), 400);
    let text = r.body_mut().read_to_string().unwrap_or_default();
    assert!(text.contains("already shares"), "{text}");
    runs(&p, KEY_B, "common", "llama/qv-r8");
}

/// Writes half of an adapter upload to the server and kills it with
/// SIGKILL before the rest arrives.
fn kill_mid_upload(p: PServer, tenant: &str, name: &str, fixture: &str) -> PathBuf {
    use std::io::Write;
    let (ct, body) = multipart(&files_of(fixture));
    let addr = p.s.base.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    write!(
        sock,
        "PUT /admin/v1/tenants/{tenant}/adapters/{name} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ADMIN}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .expect("head");
    sock.write_all(&body[..body.len() / 2])
        .expect("half the body");
    sock.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(200));
    p.s.signal(9);
    drop(sock);
    p.state.clone()
}

#[test]
fn kill_during_an_upload_leaves_the_previous_version_serving() {
    let dir = TempDir::new("tenant-adapter-crash");
    let p = start_at(&dir.0.join("state"), &[], &[]);
    tenants(&p);
    upload_ok(&p, "a", "support", "llama/qv-r8");
    runs(&p, KEY_A, "support", "llama/qv-r8");

    let state = kill_mid_upload(p, "a", "support", "llama/all-r16");
    let p = start_at(&state, &[], &[]);
    runs(&p, KEY_A, "support", "llama/qv-r8");
    let (_, v) = p.admin("GET", "/admin/v1/tenants/a/adapters", None);
    assert_eq!(v["data"][0]["active_version"], 1, "{v}");
    assert_eq!(
        v["data"][0]["versions"].as_array().map(Vec::len),
        Some(1),
        "{v}"
    );

    // A crash after the new version's files were written but before its
    // record: leftovers of the interrupted write are ignored.
    let blobs = state.join("tenants/a/adapters/.blobs");
    std::fs::write(blobs.join(".tmp-half-written"), b"partial").expect("leftover");
    std::fs::write(state.join("tenants/a/adapters/support/.tmp-2.json-0"), b"{").expect("leftover");

    // Kill right after a completed upload: the new version is durable,
    // and rollback history survives too.
    upload_ok(&p, "a", "support", "llama/all-r16");
    p.s.signal(9);
    let state = p.state.clone();
    drop(p);
    let p = start_at(&state, &[], &[]);
    runs(&p, KEY_A, "support", "llama/all-r16");
    let (st, v) = p.admin(
        "POST",
        "/admin/v1/tenants/a/adapters/support/rollback",
        None,
    );
    assert_eq!(st, 200, "{v}");
    runs(&p, KEY_A, "support", "llama/qv-r8");
    assert!(!state
        .join("tenants/a/adapters/support/.tmp-2.json-0")
        .exists());
    assert!(!blobs.join(".tmp-half-written").exists());
}

const POLL_SECONDS: u64 = 2;

fn replica(dir: &TempDir, name: &str, proxy_port: u16) -> PServer {
    let state = dir.0.join(name);
    let endpoint = format!("http://127.0.0.1:{proxy_port}");
    let poll = POLL_SECONDS.to_string();
    start_at(
        &state,
        &[
            "--state-store",
            &format!("s3://{BUCKET}/adapters"),
            "--state-poll-seconds",
            &poll,
        ],
        &[
            ("AWS_ENDPOINT", &endpoint),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_REGION", "us-east-1"),
            ("RUST_LOG", "info"),
        ],
    )
}

#[test]
fn replicas_share_adapters_through_s3_and_serve_cached_ones_through_an_outage() {
    let moto = Moto::start();
    let mut proxy = Proxy::start(moto.port);
    let dir = TempDir::new("tenant-adapter-s3");
    let a = replica(&dir, "a", proxy.port);
    let b = replica(&dir, "b", proxy.port);
    // Two poll intervals, plus room to fetch and check the files on a
    // machine busy with other tests.
    let within_two_polls = 2 * Duration::from_secs(POLL_SECONDS) + Duration::from_secs(4);

    tenants(&a);
    upload_ok(&a, "a", "support", "llama/qv-r8");
    let uploaded = std::time::Instant::now();
    wait_for(within_two_polls, "B serves A's adapter and knows B", || {
        score(&b, KEY_A, "support", "llama/qv-r8").0 == 200
            && b.admin("GET", "/admin/v1/tenants/b", None).0 == 200
    });
    eprintln!(
        "B serves the adapter uploaded through A {:.1} s later",
        uploaded.elapsed().as_secs_f64()
    );
    runs(&b, KEY_A, "support", "llama/qv-r8");
    // Private there too.
    assert_eq!(score(&b, KEY_B, "support", "llama/qv-r8").0, 404);
    assert!(!model_ids(&b, KEY_B).contains(&"support".to_string()));

    // A second adapter and a new version reach B (B has not used them:
    // their files are only in its cache).
    upload_ok(&a, "a", "fresh", "llama/rslora-r4");
    upload_ok(&a, "b", "support", "llama/all-r16");
    wait_for(within_two_polls, "B has the new adapters", || {
        let (_, v) = b.admin("GET", "/admin/v1/tenants/a/adapters", None);
        let (_, w) = b.admin("GET", "/admin/v1/tenants/b/adapters", None);
        v["data"].as_array().map(Vec::len) == Some(2)
            && w["data"].as_array().map(Vec::len) == Some(1)
    });

    // The store goes away: both replicas keep serving what they cached,
    // loading on first use from their own --state-dir.
    proxy.take_down();
    runs(&b, KEY_A, "fresh", "llama/rslora-r4");
    runs(&b, KEY_B, "support", "llama/all-r16");
    runs(&a, KEY_A, "support", "llama/qv-r8");
    // Admin changes wait for the store.
    let (st, v) = upload(&a, "a", "late", "llama/qv-r8");
    assert_eq!(st, 503, "{v}");
    assert_eq!(
        score(&a, KEY_A, "late", "llama/qv-r8").0,
        404,
        "a refused upload is not visible"
    );

    // Back: a rollback through B reaches A.
    proxy.bring_up();
    upload_ok(&b, "a", "support", "llama/all-r16");
    wait_for(within_two_polls, "A serves B's new version", || {
        gap(&a, KEY_A, "support", "llama/all-r16") < 1e-4
    });
    let (st, v) = b.admin(
        "POST",
        "/admin/v1/tenants/a/adapters/support/rollback",
        None,
    );
    assert_eq!(st, 200, "{v}");
    wait_for(within_two_polls, "A serves the rolled-back version", || {
        gap(&a, KEY_A, "support", "llama/qv-r8") < 1e-4
    });
    // A deletion through A leaves B too.
    let (st, v) = a.admin("DELETE", "/admin/v1/tenants/a/adapters/fresh", None);
    assert_eq!(st, 200, "{v}");
    wait_for(within_two_polls, "B drops the deleted adapter", || {
        score(&b, KEY_A, "fresh", "llama/rslora-r4").0 == 404
    });
}
