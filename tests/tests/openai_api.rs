//! The OpenAI-compatible API of the real binary, on the demo model.

use pagoda_e2e::{agent, read_sse, Server};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn chat_body(stream: bool) -> Value {
    let mut b = json!({
        "model": "smol",
        "messages": [{"role": "user", "content": "What is 2+2? Answer briefly."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
    });
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

#[test]
fn chat_and_completions_agree_streamed_and_not_with_consistent_usage() {
    let s = Server::start(&[]);
    // Non-streamed chat.
    let (status, full) = s.post("/v1/chat/completions", &chat_body(false));
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    assert!(!text.is_empty());
    let usage = &full["usage"];
    // The prompt count equals what /tokenize says for the same messages.
    let (_, tok) = s.post("/tokenize", &json!({"model": "smol", "messages": chat_body(false)["messages"], "add_special_tokens": false}));
    assert_eq!(usage["prompt_tokens"], tok["count"], "{tok}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );

    // Streamed chat: same greedy text, role first, usage last, then [DONE].
    let r = agent()
        .post(&s.url("/v1/chat/completions"))
        .send_json(chat_body(true))
        .expect("stream");
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let events = read_sse(r.into_body().into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|ch| ch["delta"]["content"].as_str())
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["choices"], json!([]));
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], usage[k], "{k}");
    }
    // The same prompt a second time: its full blocks come from the cache.
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).map(|ch| &ch["finish_reason"]))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        finish.len(),
        1,
        "exactly one chunk carries the finish reason"
    );
    assert_eq!(*finish[0], full["choices"][0]["finish_reason"]);

    // Completions, streamed and not, with n = 2 and logprobs.
    let body = json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 3});
    let (status, c) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["choices"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        c["choices"][0]["text"], c["choices"][1]["text"],
        "greedy samples agree"
    );
    assert!(
        c["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(" Paris"),
        "{c}"
    );
    assert_eq!(
        c["usage"]["prompt_tokens"], 5,
        "two samples of a 5-token prompt count it once, as OpenAI and vLLM do"
    );
    assert_eq!(c["usage"]["completion_tokens"], 16);
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(8));
    assert_eq!(lp["top_logprobs"][0].as_object().map(|o| o.len()), Some(3));
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = agent()
        .post(&s.url("/v1/completions"))
        .send_json(&sbody)
        .expect("stream");
    let events = read_sse(r.into_body().into_reader());
    let mut texts = [String::new(), String::new()];
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("chunk");
        for ch in v["choices"].as_array().expect("choices") {
            texts[ch["index"].as_u64().unwrap() as usize].push_str(ch["text"].as_str().unwrap());
        }
    }
    assert_eq!(texts[0], c["choices"][0]["text"].as_str().unwrap());
    assert_eq!(texts[1], c["choices"][1]["text"].as_str().unwrap());

    // Stop strings end the text before the stop string.
    let (_, st) = s.post("/v1/completions", &json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 20, "temperature": 0, "stop": ["."]}));
    assert_eq!(st["choices"][0]["text"], " Paris");
    assert_eq!(st["choices"][0]["finish_reason"], "stop");
    assert_eq!(st["choices"][0]["stop_reason"], ".");

    // Models, version, tokenize round trip.
    let (_, models) = s.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "smol");
    let (_, t) = s.post(
        "/tokenize",
        &json!({"prompt": "Hello, world!", "add_special_tokens": false}),
    );
    assert_eq!(t["tokens"], json!([19556, 28, 905, 17]));
    let (_, d) = s.post("/detokenize", &json!({"tokens": [19556, 28, 905, 17]}));
    assert_eq!(d["prompt"], "Hello, world!");
    assert_eq!(s.get("/version").0, 200);
}

/// The routes managed platforms and vLLM clients use beside the two
/// generation endpoints, and the cached-token count in usage.
#[test]
fn ping_invocations_model_fields_unserved_routes_and_cached_tokens() {
    let s = Server::start(&[]);
    assert_eq!(s.get("/ping").0, 200);
    assert_eq!(s.post("/ping", &json!({})).0, 200);
    // /invocations dispatches on the body's shape.
    let (st, c) = s.post("/invocations", &json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}));
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    let (st, c) = s.post("/invocations", &chat_body(false));
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["object"], "chat.completion");
    let (st, e) = s.post("/invocations", &json!({"model": "smol"}));
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    // Without a model, every generating route serves the first served
    // name, as vLLM does (the Responses API included).
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ),
        (
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 2}),
        ),
    ] {
        let (st, v) = s.post(path, &body);
        assert_eq!(st, 200, "{path}: {v}");
        assert_eq!(v["model"], "smol", "{path}: {v}");
        // vLLM always sends `prompt_logprobs` (null unless asked): on the
        // completion's choices, and once on a chat completion.
        let holder = match path {
            "/v1/completions" => &v["choices"][0],
            "/v1/chat/completions" => &v,
            _ => continue,
        };
        assert!(
            holder
                .as_object()
                .is_some_and(|o| o.get("prompt_logprobs") == Some(&Value::Null)),
            "{path}: {v}"
        );
    }

    let (_, models) = s.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    let m = &models["data"][0];
    assert!(
        m["root"].as_str().is_some_and(|r| r.ends_with(".gguf")),
        "{m}"
    );
    assert!(
        m["parent"].is_null() && m["max_model_len"].as_u64().is_some(),
        "{m}"
    );

    // Routes Pagoda does not serve answer with the OpenAI error body.
    for (path, status) in [
        ("/v1/moderations", 501),
        ("/v1/audio/speech", 501),
        ("/v1/nonsense", 404),
    ] {
        let (st, e) = s.post(path, &json!({"model": "smol", "input": "x"}));
        assert_eq!(st, status, "{path}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(path)),
            "{path}: {e}"
        );
    }

    // Embeddings from a generation model: a 400 (not a 5xx the openai
    // SDK would retry) that says which endpoints the model serves.
    let (st, e) = s.post("/v1/embeddings", &json!({"model": "smol", "input": "x"}));
    assert_eq!(st, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/v1/completions")),
        "{e}"
    );

    // The second request of a long shared prompt finds it cached.
    let prompt = "Pagoda serves many tenants from one fleet. ".repeat(20);
    let body = json!({"model": "smol", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let (_, first) = s.post("/v1/completions", &body);
    assert_eq!(
        first["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{first}"
    );
    let (_, second) = s.post("/v1/completions", &body);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let total = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached >= total - 16 && cached < total,
        "{cached} of {total} cached"
    );

    // Every metric docs/metrics.md lists as served is in /metrics, with
    // vLLM's labels.
    let (st, _) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "n": 2, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(st, 200);
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
        .expect("docs/metrics.md");
    let served = doc
        .split("## Served")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Served section");
    let names: Vec<&str> = served
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .collect();
    assert!(names.len() >= 25, "{names:?}");
    let (_, text) = s.get("/metrics");
    for name in names {
        let present = text.lines().any(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                (rest.starts_with('{')
                    || rest.starts_with("_bucket{")
                    || rest.starts_with("_count{"))
                    && l.contains("model_name=\"smol\"")
                    && l.contains("engine=\"0\"")
            })
        });
        assert!(
            present,
            "{name} is documented as served but missing from /metrics:\n{text}"
        );
    }
}

fn assert_error(s: &Server, path: &str, body: &str, status: u16, code: &str, param: Option<&str>) {
    let mut r = agent()
        .post(&s.url(path))
        .header("content-type", "application/json")
        .send(body)
        .expect("request");
    assert_eq!(r.status().as_u16(), status, "{body}");
    let v: Value =
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).expect("error JSON");
    let e = v["error"]
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {v}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["code", "message", "param", "type"], "{v}");
    assert_eq!(e["code"], code, "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert!(e["type"].is_string());
}

#[test]
fn every_error_class_has_the_exact_openai_shape() {
    let s = Server::start(&["--api-key", "sekret", "--max-body-bytes", "4096"]);
    let auth = |path: &str, body: &str| {
        let mut r = agent()
            .post(&s.url(path))
            .header("authorization", "Bearer sekret")
            .header("content-type", "application/json")
            .send(body)
            .expect("request");
        let status = r.status().as_u16();
        (
            status,
            serde_json::from_str::<Value>(&r.body_mut().read_to_string().unwrap()).unwrap(),
        )
    };
    // 401 without or with a wrong key.
    assert_error(
        &s,
        "/v1/completions",
        r#"{"model":"smol","prompt":"hi"}"#,
        401,
        "invalid_api_key",
        None,
    );
    // With the key, the rest.
    let cases: Vec<(&str, String, u16, &str, Option<&str>)> = vec![
        (
            "/v1/completions",
            "{not json".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            "/v1/completions",
            "[1,2]".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            "/v1/completions",
            // `model` may be omitted (the first served name answers, as in
            // vLLM), but a model that is not a string is refused by name.
            r#"{"model":7,"prompt":"hi"}"#.into(),
            400,
            "invalid_request_error",
            Some("model"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol"}"#.into(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"smol","messages":[{"role":"user","content":"hi"},{"role":"hacker","content":"x"}]}"#.into(),
            400,
            "invalid_request_error",
            Some("messages[1].role"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":"hi","stream_options":{"include_usage":true}}"#.into(),
            400,
            "invalid_request_error",
            Some("stream_options"),
        ),
        (
            "/v1/completions",
            r#"{"model":"gpt-9","prompt":"hi"}"#.into(),
            404,
            "model_not_found",
            Some("model"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":"hi","temperature":"warm"}"#.into(),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":"hi","max_tokens":-3}"#.into(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":"hi","top_p":7}"#.into(),
            400,
            "invalid_request_error",
            Some("top_p"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":{"a":1}}"#.into(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"model":"smol","prompt":"hi","max_tokens":4000}"#.into(),
            400,
            "context_length_exceeded",
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"smol","messages":[]}"#.into(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"smol","messages":[{"role":"user","content":"hi"}],"max_tokens":4000}"#
                .into(),
            400,
            "context_length_exceeded",
            Some("messages"),
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"smol","prompt":"{}"}}"#, "a".repeat(5000)),
            413,
            "request_too_large",
            None,
        ),
        ("/v1/nothing", "{}".into(), 404, "not_found", None),
    ];
    for (path, body, status, code, param) in cases {
        let (got, v) = auth(path, &body);
        assert_eq!(got, status, "{path} {body:.80}: {v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{v}");
    }
    // Unknown fields are ignored.
    let (got, v) = auth(
        "/v1/completions",
        r#"{"model":"smol","prompt":"hi","max_tokens":2,"frobnicate":true}"#,
    );
    assert_eq!(got, 200, "{v}");
}

#[test]
fn a_client_that_disconnects_frees_its_kv_blocks() {
    let s = Server::start(&[]);
    let body = json!({"model": "smol", "prompt": "Count forever:", "max_tokens": 1500, "ignore_eos": true, "stream": true});
    let r = agent()
        .post(&s.url("/v1/completions"))
        .send_json(&body)
        .expect("stream");
    let mut reader = std::io::BufReader::new(r.into_body().into_reader());
    let mut line = String::new();
    for _ in 0..6 {
        line.clear();
        std::io::BufRead::read_line(&mut reader, &mut line).expect("read");
    }
    assert!(s.metric("vllm:num_requests_running") >= 1.0);
    assert!(s.metric("vllm:kv_cache_usage_perc") > 0.0);
    drop(reader);
    let started = Instant::now();
    while s.metric("vllm:num_requests_running") != 0.0
        || s.metric("vllm:kv_cache_usage_perc") != 0.0
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the aborted request still holds KV"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, text) = s.get("/metrics");
    assert!(
        text.lines()
            .any(|l| l.starts_with("vllm:request_success_total{")
                && l.contains("finished_reason=\"abort\"")
                && l.ends_with("} 1")),
        "{text}"
    );
}

#[test]
fn overload_gets_answers_not_hangs_and_memory_stays_bounded() {
    let s = Server::start(&["--max-num-seqs", "4", "--max-pending-requests", "48"]);
    let rss_before = s.rss_kib();
    let url = s.url("/v1/chat/completions");
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body = json!({
                    "model": "smol", "max_tokens": 16, "stream": true, "temperature": 0,
                    "messages": [{"role": "user", "content": format!("Say something about the number {i}.")}],
                });
                let mut r = agent().post(&url).send_json(&body).expect("request");
                let status = r.status().as_u16();
                if status == 200 {
                    let events = read_sse(r.into_body().into_reader());
                    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                } else {
                    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).expect("JSON error body");
                    assert!(v["error"]["message"].is_string());
                }
                status
            })
        })
        .collect();
    let statuses: Vec<u16> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();
    assert!(
        statuses.iter().all(|s| [200, 429, 503].contains(s)),
        "{statuses:?}"
    );
    assert!(statuses.iter().filter(|&&s| s == 200).count() >= 4);
    let rss_after = s.rss_kib();
    assert!(
        rss_after < rss_before + 512 * 1024,
        "RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
}

#[test]
fn sigterm_finishes_requests_in_flight_and_exits_zero() {
    let mut s = Server::start(&[]);
    let url = s.url("/v1/completions");
    let client = std::thread::spawn(move || {
        let body = json!({"model": "smol", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": true, "temperature": 0});
        let mut r = agent().post(&url).send_json(&body).expect("request");
        let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        (r.status().as_u16(), v)
    });
    std::thread::sleep(Duration::from_millis(300));
    s.signal(libc::SIGTERM);
    let (status, v) = client.join().expect("client");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 48);
    let started = Instant::now();
    loop {
        if let Some(code) = s.child.try_wait().expect("wait") {
            assert!(code.success(), "exit status {code}:\n{}", s.log_text());
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `stream_options.continuous_usage_stats`, as vLLM sends it: with
/// `include_usage`, every chunk carries the usage so far.
#[test]
fn continuous_usage_stats_put_usage_on_every_chunk() {
    let s = Server::start(&[]);
    let (st, text) = s.post_text(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Count: one, two,", "max_tokens": 5, "temperature": 0,
                "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    );
    assert_eq!(st, 200, "{text}");
    let chunks: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    assert!(chunks.len() >= 5, "{text}");
    let mut last = 0;
    for c in &chunks {
        let done = c["usage"]["completion_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("a chunk without usage: {c}"));
        assert!(done >= last, "usage went back: {text}");
        last = done;
    }
    assert_eq!(last, 5, "{text}");
    // Without it, only the final chunk has usage.
    let (_, text) = s.post_text(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Count:", "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    let with_usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|c| !c["usage"].is_null())
        .count();
    assert_eq!(with_usage, 1, "{text}");
}

/// vLLM's `return_token_ids`: a choice carries its prompt's and its
/// output's ids (completions and chat, not streamed).
#[test]
fn return_token_ids_gives_each_choice_its_ids() {
    let s = Server::start(&[]);
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(st, 200, "{v}");
    let (_, t) = s.post(
        "/tokenize",
        &json!({"model": "smol", "prompt": "The capital of France is"}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["prompt_token_ids"], t["tokens"], "{v}");
    assert_eq!(c["token_ids"].as_array().map(Vec::len), Some(4), "{v}");
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(st, 200, "{v}");
    // A chat's prompt ids come once, beside the choices, as vLLM sends them.
    let chat_prompt = v["prompt_token_ids"].clone();
    assert!(chat_prompt.as_array().is_some_and(|a| a.len() > 3), "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["token_ids"].as_array().map(Vec::len), Some(3), "{v}");
    let chat_ids = c["token_ids"].clone();
    // Not asked: not sent.
    let (_, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hi", "max_tokens": 1}),
    );
    assert!(v["choices"][0].get("token_ids").is_none(), "{v}");

    // Streamed, as vLLM streams them: a completion's first chunk carries
    // its prompt's ids, every chunk the ids it adds; the same ids as the
    // unstreamed answer (greedy).
    let chunks = |body: serde_json::Value, path: &str| -> Vec<serde_json::Value> {
        let (st, text) = s.post_text(path, &body);
        assert_eq!(st, 200, "{text}");
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
            .collect()
    };
    let got = chunks(
        json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 4,
               "temperature": 0, "ignore_eos": true, "return_token_ids": true, "stream": true}),
        "/v1/completions",
    );
    let with_prompt: Vec<_> = got
        .iter()
        .filter(|c| c["choices"][0].get("prompt_token_ids").is_some())
        .collect();
    assert_eq!(with_prompt.len(), 1, "{got:?}");
    assert_eq!(
        with_prompt[0]["choices"][0]["prompt_token_ids"], t["tokens"],
        "{got:?}"
    );
    let ids: Vec<u64> = got
        .iter()
        .flat_map(|c| {
            c["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|x| x.as_u64())
        .collect();
    let want: Vec<u64> = v0_ids(&s);
    assert_eq!(ids, want, "{got:?}");
    let got = chunks(
        json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
               "temperature": 0, "ignore_eos": true, "return_token_ids": true, "stream": true}),
        "/v1/chat/completions",
    );
    assert_eq!(got[0]["prompt_token_ids"], chat_prompt, "{got:?}");
    assert!(
        got[1..].iter().all(|c| c.get("prompt_token_ids").is_none()),
        "{got:?}"
    );
    let ids: Vec<serde_json::Value> = got
        .iter()
        .flat_map(|c| {
            c["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(json!(ids), chat_ids, "{got:?}");
}

/// The unstreamed ids of the completion the streamed check compares with.
fn v0_ids(s: &Server) -> Vec<u64> {
    let (_, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
        .unwrap_or_default()
}

/// Logprob counts as vLLM reads them: `-1` is the whole vocabulary,
/// allowed only where `--max-logprobs` allows it.
#[test]
fn whole_vocabulary_logprobs_follow_max_logprobs() {
    let s = Server::start(&[]);
    for body in [
        json!({"model": "smol", "prompt": "Hi", "max_tokens": 1, "logprobs": -1}),
        json!({"model": "smol", "prompt": "Hi", "max_tokens": 1, "prompt_logprobs": -1}),
        json!({"model": "smol", "prompt": "Hi", "max_tokens": 1, "logprobs": -2}),
    ] {
        let (st, v) = s.post("/v1/completions", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1, "logprobs": true, "top_logprobs": -1}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max allowed: 20")),
        "{v}"
    );
    drop(s);

    let s = Server::start(&["--max-logprobs", "-1"]);
    let (_, info) = s.get("/tokenizer_info");
    let info: serde_json::Value = serde_json::from_str(&info).expect("json");
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1, "logprobs": true, "top_logprobs": -1}),
    );
    assert_eq!(st, 200, "{v}");
    let top = v["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0);
    assert_eq!(Some(top as u64), info["vocab_size"].as_u64(), "{info}");
    // The probabilities of the whole vocabulary sum to one.
    let mass: f64 = v["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["logprob"].as_f64())
                .map(f64::exp)
                .sum()
        })
        .unwrap_or(0.0);
    assert!((mass - 1.0).abs() < 1e-2, "mass {mass}");
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hi there", "max_tokens": 1, "prompt_logprobs": -1}),
    );
    assert_eq!(st, 200, "{v}");
    let row = v["choices"][0]["prompt_logprobs"][1]
        .as_object()
        .map(|m| m.len())
        .unwrap_or(0);
    assert_eq!(row, top, "{v}");
    drop(s);

    // Another limit is the one requests meet.
    let s = Server::start(&["--max-logprobs", "3"]);
    let ask = |k: i64| {
        s.post(
            "/v1/completions",
            &json!({"model": "smol", "prompt": "Hi", "max_tokens": 1, "logprobs": k}),
        )
    };
    let (st, v) = ask(3);
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .map(|m| m.len()),
        Some(3),
        "{v}"
    );
    let (st, v) = ask(4);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "logprobs", "{v}");
}

/// vLLM's `continue_final_message` and `echo` on chat: the prompt ends
/// inside the assistant's final message (no end of turn, no new turn), and
/// with `echo` the answer starts with that message, streamed or not.
#[test]
fn continue_final_message_and_echo_prefill_the_answer() {
    let s = Server::start(&[]);
    let prefill = "The three primary colors are red,";
    let messages = json!([
        {"role": "user", "content": "Name the three primary colors."},
        {"role": "assistant", "content": prefill},
    ]);
    let prompt_text = |body: serde_json::Value| -> (serde_json::Value, String) {
        let (st, v) = s.post("/tokenize", &body);
        assert_eq!(st, 200, "{v}");
        let (st, d) = s.post(
            "/detokenize",
            &json!({"model": "smol", "tokens": v["tokens"]}),
        );
        assert_eq!(st, 200, "{d}");
        (
            v["tokens"].clone(),
            d["prompt"].as_str().unwrap_or_default().to_string(),
        )
    };
    let (open_ids, open) = prompt_text(json!({"model": "smol", "messages": messages,
        "continue_final_message": true, "add_generation_prompt": false}));
    assert!(open.ends_with(prefill), "{open:?}");
    // Without it, the template closes the turn (and opens a new one).
    let (_, closed) = prompt_text(json!({"model": "smol", "messages": messages}));
    assert!(!closed.ends_with(prefill), "{closed:?}");
    assert!(closed.starts_with(&open), "{closed:?} vs {open:?}");
    // The generation continues the prefill: same ids as a completion of
    // the open prompt.
    let body = json!({"model": "smol", "messages": messages, "continue_final_message": true,
        "add_generation_prompt": false, "max_tokens": 5, "temperature": 0, "ignore_eos": true,
        "echo": true});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (_, c) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": open_ids, "max_tokens": 5, "temperature": 0,
                "ignore_eos": true}),
    );
    let continued = c["choices"][0]["text"].as_str().unwrap_or_default();
    assert_eq!(content, format!("{prefill}{continued}"), "{v} {c}");
    // Streamed: the echo comes first, then the same tokens.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (st, text) = s.post_text("/v1/chat/completions", &b);
    assert_eq!(st, 200, "{text}");
    let deltas: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(deltas.first().map(String::as_str), Some(prefill), "{text}");
    assert_eq!(deltas.concat(), content, "{text}");
    // `echo` after a user's message echoes nothing (roles differ).
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "temperature": 0, "echo": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .starts_with("Hi"),
        "{v}"
    );
    // What vLLM refuses.
    for (bad, why) in [
        (
            json!({"model": "smol", "messages": messages, "continue_final_message": true,
                "add_generation_prompt": true}),
            "Cannot set both",
        ),
        (
            json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                "continue_final_message": true}),
            "assistant",
        ),
    ] {
        let (st, v) = s.post("/v1/chat/completions", &bad);
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "continue_final_message", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(why)),
            "{v}"
        );
    }
}

/// vLLM's `/v1/chat/completions/batch`: choice `i` answers conversation
/// `i` exactly as a chat request of its own would, the usage is the sum,
/// and what the endpoint does not do (streams, tools, n > 1) is a 400.
#[test]
fn chat_batch_answers_each_conversation_as_its_own_chat() {
    let s = Server::start(&[]);
    let conversations = json!([
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "Count to three."},
         {"role": "assistant", "content": "One,"}],
    ]);
    let (st, v) = s.post(
        "/v1/chat/completions/batch",
        &json!({"model": "smol", "messages": conversations, "max_tokens": 6,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion", "{v}");
    let choices = v["choices"].as_array().cloned().unwrap_or_default();
    assert_eq!(choices.len(), 3, "{v}");
    let (mut prompt, mut completion) = (0, 0);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        let (st, one) = s.post(
            "/v1/chat/completions",
            &json!({"model": "smol", "messages": conversations[i], "max_tokens": 6,
                    "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
        );
        assert_eq!(st, 200, "{one}");
        assert_eq!(
            c["message"], one["choices"][0]["message"],
            "conversation {i}: {v}"
        );
        assert_eq!(c["token_ids"], one["choices"][0]["token_ids"], "{v}");
        prompt += one["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        completion += one["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], completion, "{v}");
    // `echo` echoes the assistant's final message, per conversation.
    let (st, v) = s.post(
        "/v1/chat/completions/batch",
        &json!({"model": "smol", "messages": conversations, "max_tokens": 2,
                "temperature": 0, "echo": true}),
    );
    assert_eq!(st, 200, "{v}");
    let content = |i: usize| {
        v["choices"][i]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(content(2).starts_with("One,"), "{v}");
    assert!(!content(0).starts_with("What"), "{v}");
    for (bad, param) in [
        (
            json!({"model": "smol", "messages": conversations, "stream": true}),
            "stream",
        ),
        (
            json!({"model": "smol", "messages": conversations, "n": 2}),
            "n",
        ),
        (
            json!({"model": "smol", "messages": conversations,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
            "tools",
        ),
        (
            json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}),
            "messages",
        ),
        (json!({"model": "smol", "messages": []}), "messages"),
        (
            json!({"model": "smol", "messages": [[{"role": "wizard", "content": "Hi"}]]}),
            "messages[0].role",
        ),
    ] {
        let (st, v) = s.post("/v1/chat/completions/batch", &bad);
        assert_eq!(st, 400, "{bad} -> {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

/// vLLM 0.32's `logprob_token_ids`: each step lists the scores of the ids
/// asked for, in their order, instead of the likeliest tokens (the same
/// scores the top alternatives carry), streamed or not; what it needs is
/// checked.
#[test]
fn logprob_token_ids_score_the_ids_asked_for() {
    let s = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Is the sky blue? Answer yes or no."}]);
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": messages, "max_tokens": 3, "temperature": 0,
                "logprobs": true, "top_logprobs": 5, "return_tokens_as_token_ids": true}),
    );
    assert_eq!(st, 200, "{v}");
    let top = &v["choices"][0]["logprobs"]["content"][0]["top_logprobs"];
    let id_of = |t: &Value| -> u32 {
        t["token"]
            .as_str()
            .and_then(|t| t.strip_prefix("token_id:"))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{t}"))
    };
    // The five likeliest first tokens, asked for in reverse order.
    let mut ids: Vec<u32> = top
        .as_array()
        .map(|a| a.iter().map(id_of).collect())
        .unwrap_or_default();
    assert_eq!(ids.len(), 5, "{v}");
    ids.reverse();
    let body = json!({"model": "smol", "messages": messages, "max_tokens": 3, "temperature": 0,
        "logprobs": true, "logprob_token_ids": ids, "return_tokens_as_token_ids": true});
    let (st, w) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{w}");
    assert_eq!(
        w["choices"][0]["message"], v["choices"][0]["message"],
        "{w}"
    );
    let content = w["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(content.len(), 3, "{w}");
    for step in &content {
        let listed: Vec<u32> = step["top_logprobs"]
            .as_array()
            .map(|a| a.iter().map(id_of).collect())
            .unwrap_or_default();
        assert_eq!(listed, ids, "{w}");
    }
    let first: Vec<&Value> = content[0]["top_logprobs"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let want: Vec<&Value> = top
        .as_array()
        .map(|a| a.iter().rev().collect())
        .unwrap_or_default();
    for (got, want) in first.iter().zip(&want) {
        let (a, b) = (
            got["logprob"].as_f64().unwrap_or(0.0),
            want["logprob"].as_f64().unwrap_or(1.0),
        );
        assert!((a - b).abs() < 1e-4, "{got} vs {want}");
    }
    assert_eq!(
        content[0]["logprob"], v["choices"][0]["logprobs"]["content"][0]["logprob"],
        "{w}"
    );
    // Streamed: the same lists.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (st, text) = s.post_text("/v1/chat/completions", &b);
    assert_eq!(st, 200, "{text}");
    let streamed: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, content, "{text}");
    // Completions: the ids' texts map to their scores.
    let (st, c) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "The sky is", "max_tokens": 2, "temperature": 0,
                "logprobs": 0, "logprob_token_ids": [ids[0], ids[1]],
                "return_tokens_as_token_ids": true}),
    );
    assert_eq!(st, 200, "{c}");
    let row = c["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .cloned()
        .unwrap_or_default();
    // A map: its order is not the request's.
    let mut keys: Vec<String> = row.keys().cloned().collect();
    keys.sort();
    let mut want = vec![
        format!("token_id:{}", ids[0]),
        format!("token_id:{}", ids[1]),
    ];
    want.sort();
    assert_eq!(keys, want, "{c}");
    // What it needs.
    for (path, bad) in [
        (
            "/v1/chat/completions",
            json!({"model": "smol", "messages": messages, "logprob_token_ids": [1]}),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "Hi", "logprob_token_ids": [1]}),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "Hi", "logprobs": 0,
            "logprob_token_ids": (0..129).collect::<Vec<u32>>()}),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "Hi", "logprobs": 0,
            "logprob_token_ids": [999_999]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smol", "messages": messages, "logprobs": true,
            "logprob_token_ids": [1], "response_format": {"type": "json_object"}}),
        ),
    ] {
        let (st, e) = s.post(path, &bad);
        assert_eq!(st, 400, "{bad}: {e}");
        assert_eq!(e["error"]["param"], "logprob_token_ids", "{bad}: {e}");
    }
}

/// Each generation endpoint reads its body into a typed request: a field
/// of the wrong type (nested ones too) is a 400 whose `param` names it by
/// its path and whose message says what was expected, on chat,
/// completions, Responses (whose chat request is built from its own
/// fields, so its names stay its own) and the tokenizer endpoints.
#[test]
fn a_field_of_the_wrong_type_is_named_with_what_was_expected() {
    let s = Server::start(&[]);
    let post = |path: &str, body: &Value| {
        let mut r = agent()
            .post(&s.url(path))
            .header("content-type", "application/json")
            .send(body.to_string())
            .expect("request");
        let status = r.status().as_u16();
        let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        (status, v)
    };
    let chat = |extra: Value| {
        let mut b = json!({"model": "smol", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "temperature": "hot"}),
            "temperature",
            "must be a number",
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "n": -1}),
            "n",
            "must be non-negative",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream": true, "stream_options": {"include_usage": "yes"}})),
            "stream_options.include_usage",
            "must be a boolean",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop": ["a", 1]})),
            "stop",
            "must be a string or a list of strings",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"continue_final_message": "yes"})),
            "continue_final_message",
            "must be a boolean",
        ),
        (
            "/v1/responses",
            json!({"model": "smol", "input": "hi", "max_output_tokens": "many"}),
            "max_output_tokens",
            "must be an integer",
        ),
        (
            "/v1/responses",
            json!({"model": "smol", "input": "hi", "top_p": [1]}),
            "top_p",
            "must be a number",
        ),
        (
            "/tokenize",
            json!({"model": "smol", "prompt": 5}),
            "prompt",
            "must be a string",
        ),
        (
            "/detokenize",
            json!({"model": "smol", "tokens": [1, -2]}),
            "tokens",
            "must be a list of token ids",
        ),
    ];
    for (path, body, param, expected) in cases {
        let (status, v) = post(path, &body);
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.contains(param) && message.contains(expected),
            "{path} {body}: {v}"
        );
    }
    // The same fields, well typed, are served.
    let (status, v) = post(
        "/v1/responses",
        &json!({"model": "smol", "input": "hi", "max_output_tokens": 2, "top_p": 1}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["max_output_tokens"], 2, "{v}");
}
