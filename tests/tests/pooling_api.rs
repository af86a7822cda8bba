//! `/v1/embeddings` through the real binary, serving the Qwen3-Embedding
//! form fixture (tests/fixtures/pooling/qwen3-embed, written by
//! scripts/make-pooling-fixtures.py): every input shape gives
//! sentence-transformers' vectors (cosine ≥ 0.99999), base64 decodes to the
//! same floats, and errors are vLLM's 400s.

mod plugins_common;

use pagoda_e2e::{Server, TempDir};
use plugins_common::{PServer, ADMIN};
use serde_json::{json, Value};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/pooling/qwen3-embed"
    ))
}

fn reference() -> Value {
    let p = fixture().join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("JSON")
}

fn start() -> Server {
    // A `Qwen3Model` with sentence-transformers' modules.json: served for
    // pooling without --runner.
    Server::start_with_model(&fixture(), &["--dtype", "float32", "--max-model-len", "64"])
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

/// Checks a response's vectors against `want`, in order.
fn check_vectors(r: &Value, want: &[Vec<f64>], what: &str) {
    let data = r["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: {r}"));
    assert_eq!(data.len(), want.len(), "{what}: {r}");
    for (i, (d, w)) in data.iter().zip(want).enumerate() {
        assert_eq!(d["index"], i, "{what}");
        assert_eq!(d["object"], "embedding", "{what}");
        let c = cosine(&floats(&d["embedding"]), w);
        assert!(
            c >= 0.99999,
            "{what}, input {i}: cosine {c} with sentence-transformers"
        );
    }
}

#[test]
fn embeddings_match_sentence_transformers_in_every_input_shape() {
    let s = start();
    let r = reference();
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let want: Vec<Vec<f64>> = inputs.iter().map(|i| floats(&i["embedding"])).collect();
    let ids: Vec<Value> = inputs.iter().map(|i| i["token_ids"].clone()).collect();
    let n_tokens: u64 = ids
        .iter()
        .map(|i| i.as_array().map_or(0, Vec::len) as u64)
        .sum();

    let (st, list) = s.post("/v1/embeddings", &json!({"model": "smol", "input": texts}));
    assert_eq!(st, 200, "{list}");
    assert_eq!(list["object"], "list");
    assert_eq!(list["model"], "smol");
    assert_eq!(list["usage"]["prompt_tokens"], n_tokens, "{list}");
    assert_eq!(list["usage"]["total_tokens"], n_tokens, "{list}");
    check_vectors(&list, &want, "list of strings");

    let (st, one) = s.post("/v1/embeddings", &json!({"input": texts[1]}));
    assert_eq!(st, 200, "{one}");
    check_vectors(&one, &want[1..2], "one string, default model");

    let (st, by_ids) = s.post("/v1/embeddings", &json!({"model": "smol", "input": ids}));
    assert_eq!(st, 200, "{by_ids}");
    check_vectors(&by_ids, &want, "token-id lists");

    let (st, one_ids) = s.post("/v1/embeddings", &json!({"model": "smol", "input": ids[2]}));
    assert_eq!(st, 200, "{one_ids}");
    check_vectors(&one_ids, &want[2..3], "one token-id list");

    // base64: little-endian float32, decoded here by Python's base64 and
    // struct modules, must be the float response's numbers exactly.
    let (st, b64) = s.post(
        "/v1/embeddings",
        &json!({"model": "smol", "input": texts, "encoding_format": "base64"}),
    );
    assert_eq!(st, 200, "{b64}");
    let strings: Vec<&str> = b64["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| d["embedding"].as_str().expect("a base64 string"))
        .collect();
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import base64, json, struct, sys\n\
             for s in json.load(sys.stdin):\n\
             \x20   raw = base64.b64decode(s, validate=True)\n\
             \x20   print(json.dumps(list(struct.unpack('<%df' % (len(raw) // 4), raw))))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .expect("stdin")
                .write_all(json!(strings).to_string().as_bytes())?;
            c.wait_with_output()
        })
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Compared as f32: each JSON side carries an f32 in decimal, which
    // names it exactly once rounded back to f32.
    let decoded: Vec<Vec<f32>> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Vec<f64> = serde_json::from_str(l).expect("floats");
            v.into_iter().map(|x| x as f32).collect()
        })
        .collect();
    assert_eq!(decoded.len(), texts.len());
    for (i, d) in decoded.iter().enumerate() {
        let float: Vec<f32> = floats(&list["data"][i]["embedding"])
            .into_iter()
            .map(|x| x as f32)
            .collect();
        assert_eq!(d, &float, "input {i}: base64 and float differ");
    }

    // vLLM's /pooling: the same request, each vector as `data` of an
    // object "pooling", the same numbers.
    let (st, pooled) = s.post("/pooling", &json!({"model": "smol", "input": texts}));
    assert_eq!(st, 200, "{pooled}");
    for (i, d) in pooled["data"].as_array().expect("data").iter().enumerate() {
        assert_eq!(d["object"], "pooling", "{pooled}");
        assert_eq!(d["index"], i, "{pooled}");
        assert_eq!(d["data"], list["data"][i]["embedding"], "input {i}");
    }
    assert_eq!(pooled["usage"]["prompt_tokens"], n_tokens, "{pooled}");

    // Matryoshka: the first 16 components, renormalized.
    let (st, short) = s.post(
        "/v1/embeddings",
        &json!({"model": "smol", "input": texts, "dimensions": 16}),
    );
    assert_eq!(st, 200, "{short}");
    let want16: Vec<Vec<f64>> = r["dimensions"]["16"]
        .as_array()
        .expect("dimensions 16")
        .iter()
        .map(floats)
        .collect();
    check_vectors(&short, &want16, "dimensions 16");
}

#[test]
fn embedding_errors_are_vllms_400s() {
    let s = start();
    // Over the context: vLLM's message, unless truncation is asked for.
    let long = json!({"model": "smol", "input": vec![5; 65]});
    let (st, e) = s.post("/v1/embeddings", &long);
    assert_eq!(st, 400, "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("maximum context length is 64 tokens")
            && msg.contains("65 tokens in the input for embedding generation"),
        "{e}"
    );
    let mut cut = long.clone();
    cut["truncate_prompt_tokens"] = json!(64);
    let (st, ok) = s.post("/v1/embeddings", &cut);
    assert_eq!(st, 200, "{ok}");
    // Truncation keeps the last 64 tokens: the same as sending them.
    let (_, same) = s.post(
        "/v1/embeddings",
        &json!({"model": "smol", "input": vec![5; 64]}),
    );
    assert_eq!(ok["data"][0]["embedding"], same["data"][0]["embedding"]);
    for k in [65, 0, -2] {
        cut["truncate_prompt_tokens"] = json!(k);
        let (st, e) = s.post("/v1/embeddings", &cut);
        assert_eq!(st, 400, "truncate_prompt_tokens {k}: {e}");
        assert_eq!(e["error"]["param"], "truncate_prompt_tokens", "{e}");
    }
    // -1 is the context's length.
    cut["truncate_prompt_tokens"] = json!(-1);
    let (st, all) = s.post("/v1/embeddings", &cut);
    assert_eq!(st, 200, "{all}");
    assert_eq!(all["data"][0]["embedding"], same["data"][0]["embedding"]);

    for (body, param) in [
        (json!({"model": "smol", "input": []}), "input"),
        (json!({"model": "smol", "input": [[1], "a"]}), "input"),
        (
            json!({"model": "smol", "input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (
            json!({"model": "smol", "input": "a", "dimensions": 0}),
            "dimensions",
        ),
        (
            json!({"model": "smol", "input": "a", "dimensions": 65}),
            "dimensions",
        ),
        (json!({"model": "smol", "input": [100000]}), "input"),
    ] {
        let (st, e) = s.post("/v1/embeddings", &body);
        assert_eq!(st, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
    let (st, e) = s.post("/v1/embeddings", &json!({"model": "other", "input": "a"}));
    assert_eq!(st, 404, "{e}");

    // Generation on the embedding model: a 400 that names the endpoint.
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
    ] {
        let (st, e) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("/v1/embeddings")),
            "{path}: {e}"
        );
    }
}

/// The official `openai` package's `embeddings.create` (float, base64, and
/// its default) and LangChain's `OpenAIEmbeddings`, as
/// tests/python/openai_embeddings.py drives them.
#[test]
fn the_official_openai_client_embeds() {
    let s = start();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/openai_embeddings.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(&s.base)
        .arg("smol")
        .arg(fixture().join("reference.json"))
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.contains(" passed, 0 failed")),
        "openai_embeddings.py failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_text()
    );
}

/// Tenants apply to embeddings as to generation: keys are required once
/// tenants exist, the model allowlist holds, and the inputs' tokens are
/// charged to the tenant's prompt-token budget.
#[test]
fn tenants_keys_and_token_limits_apply_to_embeddings() {
    let dir = TempDir::new("pooling-tenants");
    let state = dir.0.join("state");
    let d = state.to_string_lossy().to_string();
    let p = PServer {
        s: Server::start_with_model(
            &fixture(),
            &[
                "--dtype",
                "float32",
                "--max-model-len",
                "64",
                "--state-dir",
                &d,
                "--admin-token",
                ADMIN,
            ],
        ),
        state,
    };
    p.put_tenant(
        "t",
        json!({"api_keys": ["key-t-123456"], "models": ["smol"], "limits": {"prompt_tokens_per_minute": 60}}),
    );
    p.put_tenant(
        "other",
        json!({"api_keys": ["key-o-123456"], "models": ["not-smol"]}),
    );
    let body = json!({"model": "smol", "input": [vec![5; 40], vec![6; 40]]});
    let (st, v) = p.post_as("nope-123456", "/v1/embeddings", &body);
    assert_eq!(st, 401, "{v}");
    let (st, v) = p.post_as("key-o-123456", "/v1/embeddings", &body);
    assert_eq!(st, 404, "a model outside the allowlist: {v}");
    // 80 tokens overdraw the 60 a minute; the next request waits.
    let (st, v) = p.post_as("key-t-123456", "/v1/embeddings", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 80, "{v}");
    let (_, view) = p.admin("GET", "/admin/v1/tenants/t", None);
    let b = &view["rate_limits"]["prompt_tokens_per_minute"];
    assert!(
        b["remaining"].as_f64().unwrap_or(1.0) < 0.0,
        "charged 80 of 60: {view}"
    );
    let (st, v) = p.post_as("key-t-123456", "/v1/embeddings", &body);
    assert_eq!(st, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("prompt tokens per minute"),
        "{v}"
    );
}
