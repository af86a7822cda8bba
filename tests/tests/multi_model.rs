//! One server, one port, two models: the demo GGUF as the chat model and
//! the BERT embedding fixture (tests/fixtures/pooling/bert-embed) as an
//! `--extra-model`, each on its own engine. Each answers exactly as a
//! server of its own does (greedy chat text and tokens; embedding floats
//! bitwise, and within cosine 0.99999 of sentence-transformers'), requests
//! are routed by `model`, `/v1/models` lists both, generation on the
//! embedding model is vLLM's 400 naming /v1/embeddings, tenants' model
//! allowlists hold per name, and each engine's metrics carry its own
//! `model_name`.

mod plugins_common;

use pagoda_e2e::{Server, TempDir};
use plugins_common::{metric_sum, PServer, ADMIN};
use serde_json::{json, Value};
use std::path::PathBuf;

fn embed_fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/pooling/bert-embed"
    ))
}

fn reference() -> Value {
    let p = embed_fixture().join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("JSON")
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn chat_body(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": true,
    })
}

/// The generated text and token logprob strings of a chat answer.
fn chat_output(v: &Value) -> (String, Vec<Value>) {
    let c = &v["choices"][0];
    let text = c["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let tokens = c["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|t| json!([t["token"], t["logprob"]]))
        .collect();
    (text, tokens)
}

const CHAT_KEY: &str = "key-chat-only-123456";
const ALL_KEY: &str = "key-both-models-123456";

#[test]
fn one_server_serves_a_chat_model_and_an_embedding_model_each_as_alone() {
    let r = reference();
    let texts: Vec<&str> = r["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let embed_body = |model: &str| json!({"model": model, "input": texts});

    // Each model served alone.
    let (solo_chat, solo_embed) = {
        let chat = Server::start(&[]);
        let (st, c) = chat.post("/v1/chat/completions", &chat_body("smol"));
        assert_eq!(st, 200, "{c}");
        drop(chat);
        let embed = Server::start_with_model(
            &embed_fixture(),
            &["--dtype", "float32", "--max-model-len", "64"],
        );
        let (st, e) = embed.post("/v1/embeddings", &embed_body("smol"));
        assert_eq!(st, 200, "{e}");
        (c, e)
    };

    // Both behind one port, with tenants.
    let dir = TempDir::new("multi-model");
    let state = dir.0.join("state");
    let d = state.to_string_lossy().to_string();
    let spec = json!({
        "model": embed_fixture(),
        "served_model_name": ["embed", "embed-alias"],
        "dtype": "float32",
        "max_model_len": 64,
    })
    .to_string();
    let p = PServer {
        s: Server::start(&[
            "--extra-model",
            &spec,
            "--state-dir",
            &d,
            "--admin-token",
            ADMIN,
        ]),
        state,
    };
    p.put_tenant("both", json!({"api_keys": [ALL_KEY], "models": []}));
    p.put_tenant("chat", json!({"api_keys": [CHAT_KEY], "models": ["smol"]}));

    // Chat on the chat model: the solo server's greedy tokens.
    let (st, c) = p.post_as(ALL_KEY, "/v1/chat/completions", &chat_body("smol"));
    assert_eq!(st, 200, "{c}");
    assert_eq!(chat_output(&c), chat_output(&solo_chat), "{c}\n{solo_chat}");
    assert_eq!(c["usage"], solo_chat["usage"]);

    // Embeddings on the embedding model, under either of its names: the
    // solo server's floats, bit for bit, and sentence-transformers'.
    let mut embed_tokens = 0;
    for name in ["embed", "embed-alias"] {
        let (st, e) = p.post_as(ALL_KEY, "/v1/embeddings", &embed_body(name));
        assert_eq!(st, 200, "{e}");
        assert_eq!(e["model"], name, "{e}");
        assert_eq!(e["usage"], solo_embed["usage"]);
        embed_tokens += e["usage"]["prompt_tokens"].as_u64().expect("usage");
        let (got, alone) = (
            e["data"].as_array().expect("data"),
            solo_embed["data"].as_array().expect("data"),
        );
        assert_eq!(got.len(), texts.len());
        for (k, (g, a)) in got.iter().zip(alone).enumerate() {
            assert_eq!(
                g["embedding"], a["embedding"],
                "input {k}: not bitwise the solo vector"
            );
            let want = floats(&r["inputs"][k]["embedding"]);
            let c = cosine(&floats(&g["embedding"]), &want);
            assert!(
                c >= 0.99999,
                "input {k}: cosine {c} to sentence-transformers"
            );
        }
    }

    // Routed by name: generation on the embedding model, and embeddings on
    // the chat model, are 400s naming the endpoint to use; an unknown
    // model is a 404.
    let (st, e) = p.post_as(ALL_KEY, "/v1/chat/completions", &chat_body("embed"));
    assert_eq!(st, 400, "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("/v1/embeddings"), "{e}");
    let (st, e) = p.post_as(ALL_KEY, "/v1/embeddings", &embed_body("smol"));
    assert_eq!(st, 400, "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("/v1/chat/completions"), "{e}");
    for (path, body) in [
        ("/v1/embeddings", embed_body("no-such-model")),
        ("/v1/chat/completions", chat_body("no-such-model")),
    ] {
        let (st, e) = p.post_as(ALL_KEY, path, &body);
        assert_eq!(st, 404, "{path}: {e}");
        assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    }

    // /v1/models: every name, each with its model's path and context.
    let (st, models) = p.admin_as(ALL_KEY, "GET", "/v1/models", None);
    assert_eq!(st, 200, "{models}");
    let cards = models["data"].as_array().expect("data");
    let card = |id: &str| {
        cards
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("{id} not in {models}"))
    };
    let embed_root = embed_fixture().display().to_string();
    assert_eq!(card("smol")["max_model_len"], 2048, "{models}");
    assert_ne!(card("smol")["root"], embed_root.as_str(), "{models}");
    for id in ["embed", "embed-alias"] {
        assert_eq!(card(id)["max_model_len"], 64, "{models}");
        assert_eq!(card(id)["root"], embed_root.as_str(), "{models}");
    }
    assert_eq!(cards.len(), 3, "{models}");
    let (st, one) = p.admin_as(ALL_KEY, "GET", "/v1/models/embed-alias", None);
    assert_eq!(st, 200, "{one}");
    assert_eq!(one["root"], embed_root.as_str(), "{one}");

    // A tenant allowed only the chat model sees and reaches only it.
    let (st, e) = p.post_as(CHAT_KEY, "/v1/embeddings", &embed_body("embed"));
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    let (st, c) = p.post_as(CHAT_KEY, "/v1/chat/completions", &chat_body("smol"));
    assert_eq!(st, 200, "{c}");
    let (st, models) = p.admin_as(CHAT_KEY, "GET", "/v1/models", None);
    assert_eq!(st, 200, "{models}");
    let ids: Vec<&Value> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|c| &c["id"])
        .collect();
    assert_eq!(ids, [&json!("smol")], "{models}");

    // Each engine counts its own prompt tokens under its own name: the
    // embedding engine its warm-up's one token and the embedding inputs,
    // the chat engine its warm-up and the two chat prompts.
    let (_, metrics) = p.s.get("/metrics");
    let prompt = |name: &str| {
        metric_sum(
            &metrics,
            "vllm:prompt_tokens_total",
            &[("model_name", name)],
        )
    };
    let chat_tokens = solo_chat["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(prompt("embed"), (1 + embed_tokens) as f64, "{metrics}");
    assert_eq!(prompt("smol"), (1 + 2 * chat_tokens) as f64, "{metrics}");
    let requests = |name: &str| {
        metric_sum(
            &metrics,
            "vllm:request_success_total",
            &[("model_name", name)],
        )
    };
    // Warm-up, then each input of the two embedding requests (an engine
    // request apiece) / the two chats.
    assert_eq!(requests("embed"), (1 + 2 * texts.len()) as f64, "{metrics}");
    assert_eq!(requests("smol"), 3.0, "{metrics}");
}

#[test]
fn a_malformed_extra_model_stops_the_server_with_what_was_expected() {
    for (spec, says) in [
        ("no-equals-sign", "expected NAME=PATH or a JSON object"),
        (r#"{"model": "x", "max_len": 5}"#, "unknown field `max_len`"),
        (
            // A name the main model already answers to.
            "smol=/nowhere",
            "\"smol\" is given to two models",
        ),
    ] {
        let out = std::process::Command::new(pagoda_e2e::pagoda_bin())
            .args(["serve", "--model"])
            .arg(pagoda_e2e::demo_gguf())
            .args([
                "--served-model-name",
                "smol",
                "--port",
                &pagoda_e2e::free_port().to_string(),
                "--extra-model",
                spec,
            ])
            .output()
            .expect("running pagoda serve");
        assert!(!out.status.success(), "{spec}: started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{spec}: {err}");
    }
}
