//! `--usage-log`: exact metering through the real binary. Every finished
//! request leaves one usage record whose counts are its response's usage
//! block (streamed or not, n > 1, with speculative decoding and prefix-cache
//! hits), `pagoda_tenant_tokens_total` counts the same, and a record is on
//! disk before its response is sent: after a `kill -9` mid-run, every
//! request whose response was complete is in the object store once the
//! server has restarted and shipped its spool (some perhaps twice, under
//! one record id).

mod plugins_common;

use pagoda_e2e::{agent, read_sse, Server, TempDir};
use plugins_common::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NGRAM: &str = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;
const KEY: &str = "key-meter-123456";

/// A prompt the model copies, so n-gram drafts get accepted.
const COPY: &str = "Copy this text exactly.\nText: The river bends twice before it reaches the old mill, where the water slows and the children fish on summer evenings.\nCopy:";

/// The usage counts of one response: (prompt, completion, cached).
#[derive(Default, Debug, Clone, Copy, PartialEq)]
struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
}

impl Usage {
    fn of(u: &Value) -> Usage {
        let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a count in {u}"));
        // Chat and completions name them prompt/completion; Responses
        // input/output.
        let prompt = u.get("prompt_tokens").or(u.get("input_tokens"));
        let completion = u.get("completion_tokens").or(u.get("output_tokens"));
        let details = u
            .get("prompt_tokens_details")
            .or(u.get("input_tokens_details"));
        Usage {
            prompt: n(prompt.expect("prompt tokens")),
            completion: n(completion.expect("completion tokens")),
            cached: details.map_or(0, |d| d["cached_tokens"].as_u64().unwrap_or(0)),
        }
    }

    fn add(&mut self, o: Usage) {
        self.prompt += o.prompt;
        self.completion += o.completion;
        self.cached += o.cached;
    }
}

/// A streamed request with `include_usage`: its id and usage.
fn stream(p: &PServer, path: &str, body: &Value) -> (String, Usage) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = agent()
        .post(&p.s.url(path))
        .header("Authorization", &format!("Bearer {KEY}"))
        .send_json(&body)
        .expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let events = read_sse(r.into_body().into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut id = String::new();
    let mut usage = None;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).expect("chunk");
        id = v["id"].as_str().expect("id").to_string();
        if !v["usage"].is_null() {
            usage = Some(Usage::of(&v["usage"]));
        }
    }
    (id, usage.expect("a usage chunk"))
}

fn post(p: &PServer, path: &str, body: &Value) -> (String, Usage) {
    let (status, v) = p.post_as(KEY, path, body);
    assert_eq!(status, 200, "{v}");
    (
        v["id"].as_str().expect("id").to_string(),
        Usage::of(&v["usage"]),
    )
}

fn records(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn the_logs_totals_are_the_responses_usage_over_a_mixed_run() {
    let dir = TempDir::new("usage-log");
    let log = dir.0.join("billing/usage.jsonl");
    let log_arg = log.to_string_lossy().to_string();
    let p = start(
        &dir,
        &[
            "--usage-log",
            &log_arg,
            "--speculative-config",
            NGRAM,
            "--enable-prefix-caching",
            "--metrics-tenant-label",
            "id",
        ],
    );
    p.put_tenant("acme", json!({"api_keys": [KEY]}));

    let completion = |stream: bool| {
        json!({"model": "smol", "prompt": COPY, "max_tokens": 24, "temperature": 0,
            "ignore_eos": true, "stream": stream})
    };
    let sampled = json!({"model": "smol", "prompt": "Once upon a time", "max_tokens": 12, "n": 3,
        "temperature": 0.8, "seed": 7});
    let chat = json!({"model": "smol", "max_tokens": 10, "temperature": 0,
        "messages": [{"role": "user", "content": "Name three colours."}]});
    let responses = json!({"model": "smol", "input": "Say hello.", "max_output_tokens": 8,
        "temperature": 0});

    let mut sent: BTreeMap<String, Usage> = BTreeMap::new();
    let mut put = |(id, u): (String, Usage)| {
        assert!(
            sent.insert(id.clone(), u).is_none(),
            "response ids repeat: {id}"
        );
    };
    // The same copy prompt twice: the second finds it cached.
    put(post(&p, "/v1/completions", &completion(false)));
    put(post(&p, "/v1/completions", &completion(false)));
    put(stream(&p, "/v1/completions", &completion(true)));
    put(post(&p, "/v1/completions", &sampled));
    put(stream(&p, "/v1/completions", &sampled));
    put(post(&p, "/v1/chat/completions", &chat));
    put(stream(&p, "/v1/chat/completions", &chat));
    put(post(&p, "/v1/responses", &responses));

    let mut total = Usage::default();
    for u in sent.values() {
        total.add(*u);
    }
    assert!(
        total.cached > 0,
        "the repeated prompt was cached: {total:?}"
    );

    // Every record is on disk before its response went out: no waiting.
    let recs = records(&std::fs::read_to_string(&log).expect("the usage log"));
    assert_eq!(recs.len(), sent.len(), "{recs:#?}");
    let mut logged = Usage::default();
    let mut spec = 0;
    let mut ids = BTreeSet::new();
    for r in &recs {
        let rid = r["request_id"].as_str().expect("request_id");
        let want = sent
            .get(rid)
            .unwrap_or_else(|| panic!("a record of a request never answered: {r}"));
        let got = Usage {
            prompt: r["prompt_tokens"].as_u64().expect("prompt"),
            completion: r["completion_tokens"].as_u64().expect("completion"),
            cached: r["cached_tokens"].as_u64().expect("cached"),
        };
        assert_eq!(got, *want, "{r}");
        logged.add(got);
        spec += r["spec_accepted_tokens"].as_u64().expect("spec");
        assert!(ids.insert(r["id"].as_str().expect("id").to_string()));
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["tenant"], "acme", "{r}");
        assert_eq!(r["model"], "smol", "{r}");
        let key_id = r["key_id"].as_str().expect("key_id");
        assert_eq!(key_id.len(), 16, "{r}");
        assert!(
            !r.to_string().contains(KEY),
            "the key itself is never logged: {r}"
        );
        assert!(r["finished_ms"].as_u64() >= r["created_ms"].as_u64(), "{r}");
        assert!(
            r["endpoint"]
                .as_str()
                .is_some_and(|e| e.starts_with("/v1/")),
            "{r}"
        );
    }
    assert_eq!(logged, total);
    assert!(spec > 0, "the copy prompt's drafts were accepted");
    let n3 = recs
        .iter()
        .find(|r| r["finish_reasons"].as_array().is_some_and(|a| a.len() == 3))
        .expect("an n = 3 record");
    assert!(n3["finish_reasons"]
        .as_array()
        .is_some_and(|a| a.iter().all(|f| f == "length")));

    // The counters agree with the log.
    let m = p.s.get("/metrics").1;
    for (kind, want) in [
        ("prompt", total.prompt),
        ("completion", total.completion),
        ("cached", total.cached),
        ("spec_accepted", spec),
    ] {
        let got = metric_sum(
            &m,
            "pagoda_tenant_tokens_total",
            &[("tenant", "acme"), ("kind", kind)],
        );
        assert_eq!(got, want as f64, "{kind}");
    }
}

/// Record lines under `dir` (recursively), by record id.
fn lines_under(dir: &std::path::Path, out: &mut Vec<Value>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            lines_under(&p, out);
        } else if p.extension().is_some_and(|x| x == "jsonl") {
            out.extend(records(&std::fs::read_to_string(&p).unwrap_or_default()));
        }
    }
}

#[test]
fn no_record_of_a_sent_response_is_lost_to_kill_9() {
    let dir = TempDir::new("usage-kill");
    let store = dir.0.join("store");
    let spool = dir.0.join("spool");
    let store_url = format!("file://{}", store.display());
    let spool_arg = spool.to_string_lossy().to_string();
    let args = [
        "--usage-log",
        store_url.as_str(),
        "--usage-log-spool",
        spool_arg.as_str(),
        "--usage-log-flush-seconds",
        "0.2",
        "--max-num-seqs",
        "8",
    ];
    let s = Server::start(&args);
    let done: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..6 {
        let (url, done, stop) = (s.url("/v1/completions"), done.clone(), stop.clone());
        clients.push(std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let body = json!({"model": "smol", "prompt": format!("Client {c} asks question {i}:"),
                    "max_tokens": 16 + (i % 5) * 8, "temperature": 0, "ignore_eos": true,
                    "stream": c % 2 == 0});
                let Ok(r) = agent().post(&url).send_json(&body) else {
                    return;
                };
                if r.status().as_u16() != 200 {
                    return;
                }
                // Complete means: the whole body arrived ([DONE] for a
                // stream, the JSON for the rest).
                let mut body = String::new();
                let mut reader = r.into_body().into_reader();
                if std::io::Read::read_to_string(&mut reader, &mut body).is_err() {
                    return;
                }
                let id = if c % 2 == 0 {
                    if !body.trim_end().ends_with("data: [DONE]") {
                        return;
                    }
                    body.lines()
                        .filter_map(|l| l.strip_prefix("data: "))
                        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                        .find_map(|v| v["id"].as_str().map(str::to_string))
                } else {
                    serde_json::from_str::<Value>(&body)
                        .ok()
                        .and_then(|v| v["id"].as_str().map(str::to_string))
                };
                match id {
                    Some(id) => done.lock().expect("lock").push(id),
                    None => return,
                }
            }
        }));
    }
    // Let some finish, then kill the server mid-run.
    let start = Instant::now();
    while done.lock().expect("lock").len() < 12 && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(20));
    }
    s.signal(libc::SIGKILL);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    drop(s);
    let sent: BTreeSet<String> = done.lock().expect("lock").iter().cloned().collect();
    assert!(
        sent.len() >= 12,
        "only {} responses before the kill",
        sent.len()
    );

    // Restarted on the same spool, the server ships what the kill left.
    let s = Server::start(&args);
    let mut shipped = Vec::new();
    let start = Instant::now();
    loop {
        shipped.clear();
        lines_under(&store, &mut shipped);
        let have: BTreeSet<&str> = shipped
            .iter()
            .filter_map(|r| r["request_id"].as_str())
            .collect();
        if sent.iter().all(|id| have.contains(id.as_str())) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "records of sent responses are missing from the store: {:?}",
            sent.iter()
                .filter(|id| !have.contains(id.as_str()))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A record shipped twice is the same record, under the same id.
    let mut by_id: BTreeMap<String, &Value> = BTreeMap::new();
    for r in &shipped {
        let id = r["id"].as_str().expect("id").to_string();
        if let Some(prev) = by_id.insert(id, r) {
            assert_eq!(prev, r);
        }
    }
    for r in by_id.values() {
        if sent.contains(r["request_id"].as_str().unwrap_or("")) {
            assert_eq!(r["status"], "ok", "{r}");
        }
    }
    drop(s);
}

#[test]
fn an_object_store_log_needs_a_spool() {
    let dir = TempDir::new("usage-nospool");
    let url = format!("file://{}", dir.0.join("store").display());
    let out = std::process::Command::new(pagoda_e2e::pagoda_bin())
        .args(["serve", "--model"])
        .arg(pagoda_e2e::demo_gguf())
        .args(["--port", "0", "--usage-log", &url])
        .output()
        .expect("run pagoda");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--usage-log-spool"), "{err}");
}
