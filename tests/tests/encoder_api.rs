//! BERT and ModernBERT encoders through the real binary over HTTP, serving the fixtures
//! of tests/fixtures/pooling (written by scripts/make-pooling-fixtures.py):
//! bert-embed (sentence-transformers `BertModel`, mean pooling, Normalize)
//! on `/v1/embeddings` and `/pooling`, against sentence-transformers'
//! vectors (cosine ≥ 0.99999, and Matryoshka's 16 dimensions); bert-rerank
//! (`BertForSequenceClassification`, one label) on `/score`, `/v1/score`,
//! `/rerank`, `/v1/rerank` and `/v2/rerank`, against CrossEncoder's scores
//! (within 1e-4); and vLLM's 400s. The `cohere` SDK and LiteLLM, unmodified,
//! rerank and embed through them (tests/python/rerank_clients.py).

use pagoda_e2e::Server;
use serde_json::{json, Value};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/pooling")).join(name)
}

fn reference(name: &str) -> Value {
    let p = fixture(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("JSON")
}

fn start(name: &str) -> Server {
    // BERT checkpoints are served for pooling without --runner.
    Server::start_with_model(
        &fixture(name),
        &["--dtype", "float32", "--max-model-len", "64"],
    )
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

fn message(e: &Value) -> &str {
    e["error"]["message"].as_str().unwrap_or("")
}

#[test]
fn bert_embeddings_match_sentence_transformers_over_http() {
    let s = start("bert-embed");
    let r = reference("bert-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let n_tokens: usize = inputs
        .iter()
        .map(|i| i["token_ids"].as_array().map_or(0, Vec::len))
        .sum();
    let mut worst = 1.0f64;
    for (path, object, field) in [
        ("/v1/embeddings", "embedding", "embedding"),
        ("/pooling", "pooling", "data"),
    ] {
        let (st, out) = s.post(path, &json!({"model": "smol", "input": texts}));
        assert_eq!(st, 200, "{path}: {out}");
        assert_eq!(out["usage"]["prompt_tokens"], n_tokens, "{path}: {out}");
        let data = out["data"].as_array().expect("data");
        assert_eq!(data.len(), inputs.len(), "{out}");
        for (k, (d, i)) in data.iter().zip(inputs).enumerate() {
            assert_eq!(d["index"], k);
            assert_eq!(d["object"], object);
            let c = cosine(&floats(&d[field]), &floats(&i["embedding"]));
            worst = worst.min(c);
            assert!(c >= 0.99999, "{path}, input {k}: cosine {c}");
        }
    }
    eprintln!("bert-embed over HTTP: lowest cosine {worst:.9}");
    // Matryoshka: the first 16 components, renormalized.
    let (st, short) = s.post(
        "/v1/embeddings",
        &json!({"model": "smol", "input": texts, "dimensions": 16}),
    );
    assert_eq!(st, 200, "{short}");
    let dims = r["dimensions"]["16"].as_array().expect("dimensions 16");
    for (k, (d, want)) in short["data"]
        .as_array()
        .expect("data")
        .iter()
        .zip(dims)
        .enumerate()
    {
        let got = floats(&d["embedding"]);
        assert_eq!(got.len(), 16);
        let c = cosine(&got, &floats(want));
        assert!(c >= 0.99999, "input {k}, 16 dimensions: cosine {c}");
    }

    // Over the context: vLLM's message, unless truncation is asked for.
    let long = json!({"model": "smol", "input": vec![5; 65]});
    let (st, e) = s.post("/v1/embeddings", &long);
    assert_eq!(st, 400, "{e}");
    assert!(
        message(&e).contains("maximum context length is 64 tokens")
            && message(&e).contains("65 tokens in the input for embedding generation"),
        "{e}"
    );
    let mut cut = long.clone();
    cut["truncate_prompt_tokens"] = json!(64);
    let (st, ok) = s.post("/v1/embeddings", &cut);
    assert_eq!(st, 200, "{ok}");

    // A client's ids are ids: one past the vocabulary is refused even
    // where its high bits would read as a token type.
    let (st, e) = s.post(
        "/v1/embeddings",
        &json!({"model": "smol", "input": [2, 5 | (1 << 30), 3]}),
    );
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "input", "{e}");

    // Generation, and scoring, on the embedding model: 400s that name the
    // endpoint to use.
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
        (
            "/v1/rerank",
            json!({"model": "smol", "query": "a", "documents": ["b"]}),
        ),
        (
            "/score",
            json!({"model": "smol", "text_1": "a", "text_2": "b"}),
        ),
    ] {
        let (st, e) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {e}");
        assert!(message(&e).contains("/v1/embeddings"), "{path}: {e}");
    }
}

#[test]
fn bert_rerank_scores_match_cross_encoder_over_http() {
    let s = start("bert-rerank");
    let r = reference("bert-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let want = floats(&r["scores"]);
    let n_tokens: usize = r["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_array().map_or(0, Vec::len))
        .sum();
    let mut worst = 0.0f64;
    let mut by_relevance: Vec<usize> = (0..want.len()).collect();
    by_relevance.sort_by(|&a, &b| want[b].total_cmp(&want[a]));

    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let (st, out) = s.post(
            path,
            &json!({"model": "smol", "query": query, "documents": docs}),
        );
        assert_eq!(st, 200, "{path}: {out}");
        assert_eq!(out["model"], "smol");
        assert!(
            out["id"].as_str().is_some_and(|i| i.starts_with("rerank-")),
            "{out}"
        );
        assert_eq!(out["usage"]["prompt_tokens"], n_tokens, "{path}: {out}");
        assert_eq!(out["usage"]["total_tokens"], n_tokens, "{path}: {out}");
        let results = out["results"].as_array().expect("results");
        assert_eq!(results.len(), docs.len(), "{out}");
        for (res, &i) in results.iter().zip(&by_relevance) {
            assert_eq!(res["index"], i, "{path}: by relevance: {out}");
            assert_eq!(res["document"]["text"], docs[i], "{out}");
            let got = res["relevance_score"].as_f64().expect("relevance_score");
            worst = worst.max((got - want[i]).abs());
            assert!(
                (got - want[i]).abs() < 1e-4,
                "{path}, document {i}: {got} vs CrossEncoder's {}",
                want[i]
            );
        }
    }
    // top_n and return_documents.
    let (st, top) = s.post(
        "/v1/rerank",
        &json!({"model": "smol", "query": query, "documents": docs, "top_n": 1, "return_documents": false}),
    );
    assert_eq!(st, 200, "{top}");
    let results = top["results"].as_array().expect("results");
    assert_eq!(results.len(), 1, "{top}");
    assert_eq!(results[0]["index"], by_relevance[0]);
    assert!(results[0].get("document").is_none(), "{top}");

    // /score: 1:N, N:N, and a raw logit with use_activation false.
    for path in ["/score", "/v1/score"] {
        let (st, out) = s.post(
            path,
            &json!({"model": "smol", "text_1": query, "text_2": docs}),
        );
        assert_eq!(st, 200, "{path}: {out}");
        assert_eq!(out["object"], "list");
        assert_eq!(out["usage"]["prompt_tokens"], n_tokens, "{out}");
        let data = out["data"].as_array().expect("data");
        assert_eq!(data.len(), docs.len());
        for (k, d) in data.iter().enumerate() {
            assert_eq!(d["index"], k);
            assert_eq!(d["object"], "score");
            let got = d["score"].as_f64().expect("score");
            worst = worst.max((got - want[k]).abs());
            assert!((got - want[k]).abs() < 1e-4, "{path}, pair {k}: {got}");
        }
    }
    eprintln!("bert-rerank over HTTP: largest |score - CrossEncoder| {worst:.3e}");
    let (st, nn) = s.post(
        "/score",
        &json!({"model": "smol", "text_1": [query, query], "text_2": [docs[2], docs[0]]}),
    );
    assert_eq!(st, 200, "{nn}");
    assert!(
        (nn["data"][0]["score"].as_f64().unwrap_or(0.0) - want[2]).abs() < 1e-4,
        "{nn}"
    );
    assert!(
        (nn["data"][1]["score"].as_f64().unwrap_or(0.0) - want[0]).abs() < 1e-4,
        "{nn}"
    );
    let (st, raw) = s.post(
        "/score",
        &json!({"model": "smol", "text_1": query, "text_2": docs[0], "use_activation": false}),
    );
    assert_eq!(st, 200, "{raw}");
    let logit = raw["data"][0]["score"].as_f64().expect("score");
    let want_logit = floats(&r["logits"])[0];
    assert!((logit - want_logit).abs() < 1e-4, "{logit} vs {want_logit}");

    // Errors: mismatched lengths, an over-long pair (vLLM's message, or
    // truncation), and the endpoints this model does not serve.
    let (st, e) = s.post(
        "/score",
        &json!({"model": "smol", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
    );
    assert_eq!(st, 400, "{e}");
    assert!(message(&e).contains("1:1, 1:N or N:N"), "{e}");
    let long_doc = "paris ".repeat(70);
    let (st, e) = s.post(
        "/v1/rerank",
        &json!({"model": "smol", "query": query, "documents": [long_doc]}),
    );
    assert_eq!(st, 400, "{e}");
    assert!(
        message(&e).contains("maximum context length is 64 tokens")
            && message(&e).contains("tokens in the input for score"),
        "{e}"
    );
    let (st, ok) = s.post(
        "/v1/rerank",
        &json!({"model": "smol", "query": query, "documents": [long_doc], "truncate_prompt_tokens": 64}),
    );
    assert_eq!(st, 200, "{ok}");
    for (path, body) in [
        ("/v1/embeddings", json!({"model": "smol", "input": "hi"})),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "max_tokens": 2}),
        ),
    ] {
        let (st, e) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {e}");
        assert!(
            message(&e).contains("/score") && message(&e).contains("/rerank"),
            "{path}: {e}"
        );
    }
}

/// xlmr-embed (`XLMRobertaModel`: positions after padding_idx, CLS
/// pooling): its 66 position rows less the offset of 2 hold a context of
/// 64 tokens, which the server takes (the harness passes a context
/// length, so the default itself is checked in host/tests/pooling.rs).
#[test]
fn xlm_roberta_embeddings_match_sentence_transformers_over_http() {
    let s = start("xlmr-embed");
    let r = reference("xlmr-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let (st, out) = s.post("/v1/embeddings", &json!({"model": "smol", "input": texts}));
    assert_eq!(st, 200, "{out}");
    for (k, (d, i)) in out["data"]
        .as_array()
        .expect("data")
        .iter()
        .zip(inputs)
        .enumerate()
    {
        let c = cosine(&floats(&d["embedding"]), &floats(&i["embedding"]));
        assert!(c >= 0.99999, "input {k}: cosine {c}");
    }
    let (st, text) = s.get("/v1/models");
    assert_eq!(st, 200, "{text}");
    let models: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(models["data"][0]["max_model_len"], 64, "{models}");
}

/// xlmr-rerank (`XLMRobertaForSequenceClassification`, one label, the
/// bge-reranker form) through the same scoring endpoints: CrossEncoder's
/// scores within 1e-4.
#[test]
fn xlm_roberta_rerank_scores_match_cross_encoder_over_http() {
    let s = start("xlmr-rerank");
    let r = reference("xlmr-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let want = floats(&r["scores"]);
    let mut by_relevance: Vec<usize> = (0..want.len()).collect();
    by_relevance.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let mut worst = 0.0f64;
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let (st, out) = s.post(
            path,
            &json!({"model": "smol", "query": query, "documents": docs}),
        );
        assert_eq!(st, 200, "{path}: {out}");
        let results = out["results"].as_array().expect("results");
        assert_eq!(results.len(), docs.len(), "{out}");
        for (res, &i) in results.iter().zip(&by_relevance) {
            assert_eq!(res["index"], i, "{path}: by relevance: {out}");
            let got = res["relevance_score"].as_f64().expect("relevance_score");
            worst = worst.max((got - want[i]).abs());
            assert!((got - want[i]).abs() < 1e-4, "{path}, document {i}: {got}");
        }
    }
    for path in ["/score", "/v1/score"] {
        let (st, out) = s.post(
            path,
            &json!({"model": "smol", "text_1": query, "text_2": docs}),
        );
        assert_eq!(st, 200, "{path}: {out}");
        for (k, d) in out["data"].as_array().expect("data").iter().enumerate() {
            let got = d["score"].as_f64().expect("score");
            worst = worst.max((got - want[k]).abs());
            assert!((got - want[k]).abs() < 1e-4, "{path}, pair {k}: {got}");
        }
    }
    eprintln!("xlmr-rerank over HTTP: largest |score - CrossEncoder| {worst:.3e}");
}

/// bert-classify (`BertForSequenceClassification`, three labels) on vLLM's
/// `/classify`: transformers' softmax within 1e-4, id2label's names,
/// `use_activation: false` for the logits; the scoring and embeddings
/// endpoints refuse it naming /classify.
#[test]
fn bert_classify_matches_transformers_over_http() {
    let s = start("bert-classify");
    let r = reference("bert-classify");
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let n_tokens: usize = inputs
        .iter()
        .map(|i| i["token_ids"].as_array().map_or(0, Vec::len))
        .sum();
    let (st, out) = s.post("/classify", &json!({"model": "smol", "input": texts}));
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["object"], "list");
    assert_eq!(out["model"], "smol");
    assert!(
        out["id"]
            .as_str()
            .is_some_and(|i| i.starts_with("classify-")),
        "{out}"
    );
    assert_eq!(out["usage"]["prompt_tokens"], n_tokens, "{out}");
    assert_eq!(out["usage"]["total_tokens"], n_tokens, "{out}");
    let data = out["data"].as_array().expect("data");
    assert_eq!(data.len(), texts.len());
    let mut worst = 0.0f64;
    for (k, (d, i)) in data.iter().zip(inputs).enumerate() {
        assert_eq!(d["index"], k);
        assert_eq!(d["num_classes"], 3, "{d}");
        assert_eq!(d["label"], i["label"], "input {k}: {d}");
        let want = floats(&i["probs"]);
        for (g, w) in floats(&d["probs"]).iter().zip(&want) {
            worst = worst.max((g - w).abs());
            assert!((g - w).abs() < 1e-4, "input {k}: {d} vs {want:?}");
        }
    }
    eprintln!("bert-classify over HTTP: largest |prob - transformers| {worst:.3e}");
    // One string, and the raw logits.
    let (st, one) = s.post(
        "/classify",
        &json!({"model": "smol", "input": texts[1], "use_activation": false}),
    );
    assert_eq!(st, 200, "{one}");
    let got = floats(&one["data"][0]["probs"]);
    for (g, w) in got.iter().zip(floats(&inputs[1]["logits"])) {
        assert!((g - w).abs() < 1e-4, "{one}");
    }
    let (st, e) = s.post("/classify", &json!({"model": "smol", "input": [1, 2]}));
    assert_eq!(st, 400, "{e}");
    assert!(message(&e).contains("'input'"), "{e}");
    for (path, body) in [
        ("/v1/embeddings", json!({"model": "smol", "input": "hi"})),
        ("/v2/embed", json!({"model": "smol", "texts": ["hi"]})),
        (
            "/score",
            json!({"model": "smol", "text_1": "a", "text_2": "b"}),
        ),
        (
            "/v1/rerank",
            json!({"model": "smol", "query": "a", "documents": ["b"]}),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "hi", "max_tokens": 2}),
        ),
    ] {
        let (st, e) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{path}: {e}");
        assert!(message(&e).contains("/classify"), "{path}: {e}");
    }
}

/// Cohere's `/v2/embed` as vLLM serves it, on bert-embed: the float
/// vectors (sentence-transformers' within cosine 0.99999), the texts back,
/// billed input tokens, Matryoshka's `output_dimension`, and the packed
/// binary types; an embedding model at /classify is told to use
/// /v1/embeddings.
#[test]
fn cohere_v2_embed_matches_sentence_transformers_over_http() {
    let s = start("bert-embed");
    let r = reference("bert-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let n_tokens: usize = inputs
        .iter()
        .map(|i| i["token_ids"].as_array().map_or(0, Vec::len))
        .sum();
    let (st, out) = s.post(
        "/v2/embed",
        &json!({"model": "smol", "texts": texts, "input_type": "search_document", "embedding_types": ["float", "binary", "ubinary", "base64"]}),
    );
    assert_eq!(st, 200, "{out}");
    assert!(
        out["id"].as_str().is_some_and(|i| i.starts_with("embd-")),
        "{out}"
    );
    assert_eq!(out["response_type"], "embeddings_by_type");
    assert_eq!(out["texts"], json!(texts));
    assert_eq!(out["meta"]["api_version"]["version"], "2", "{out}");
    assert_eq!(
        out["meta"]["billed_units"]["input_tokens"], n_tokens,
        "{out}"
    );
    let vectors = out["embeddings"]["float"].as_array().expect("float");
    assert_eq!(vectors.len(), texts.len());
    for (k, (v, i)) in vectors.iter().zip(inputs).enumerate() {
        let want = floats(&i["embedding"]);
        let got = floats(v);
        let c = cosine(&got, &want);
        assert!(c >= 0.99999, "input {k}: cosine {c}");
        // The packed types, bit by bit from the float vector's signs.
        let bits: Vec<i64> = got
            .chunks(8)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .map(|(j, x)| i64::from(*x >= 0.0) << (7 - j))
                    .sum()
            })
            .collect();
        let ub: Vec<i64> = out["embeddings"]["ubinary"][k]
            .as_array()
            .expect("ubinary")
            .iter()
            .map(|x| x.as_i64().expect("int"))
            .collect();
        assert_eq!(ub, bits, "input {k}: ubinary");
        let b: Vec<i64> = out["embeddings"]["binary"][k]
            .as_array()
            .expect("binary")
            .iter()
            .map(|x| x.as_i64().expect("int"))
            .collect();
        assert_eq!(
            b,
            bits.iter().map(|x| x - 128).collect::<Vec<_>>(),
            "input {k}: binary"
        );
        let b64 = out["embeddings"]["base64"][k].as_str().expect("base64");
        // Little-endian float32s: 4 bytes a component, padded base64.
        assert_eq!(b64.len(), (want.len() * 4).div_ceil(3) * 4, "input {k}");
    }
    // The default type is float alone; output_dimension truncates and
    // renormalizes as /v1/embeddings' dimensions does.
    let (st, short) = s.post(
        "/v2/embed",
        &json!({"model": "smol", "texts": [texts[0]], "input_type": "search_query", "output_dimension": 16}),
    );
    assert_eq!(st, 200, "{short}");
    assert!(short["embeddings"]["binary"].is_null(), "{short}");
    let got = floats(&short["embeddings"]["float"][0]);
    let c = cosine(&got, &floats(&r["dimensions"]["16"][0]));
    assert!(c >= 0.99999, "16 dimensions: cosine {c}");
    for (body, word) in [
        (json!({"model": "smol"}), "texts"),
        (
            json!({"model": "smol", "texts": ["a"], "embedding_types": ["int8"]}),
            "embedding_types",
        ),
        (
            json!({"model": "smol", "texts": ["a"], "images": ["data:image/png;base64,AA=="]}),
            "images",
        ),
    ] {
        let (st, e) = s.post("/v2/embed", &body);
        assert_eq!(st, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], word, "{body}: {e}");
    }
    let (st, e) = s.post("/classify", &json!({"model": "smol", "input": "hi"}));
    assert_eq!(st, 400, "{e}");
    assert!(message(&e).contains("/v1/embeddings"), "{e}");
}

/// A generation model refuses /classify and /v2/embed, naming the
/// endpoints it serves.
#[test]
fn generation_model_refuses_classify_and_cohere_embed() {
    let s = Server::start(&[]);
    for (path, body) in [
        ("/classify", json!({"model": "smol", "input": "hi"})),
        ("/v2/embed", json!({"model": "smol", "texts": ["hi"]})),
    ] {
        let (st, e) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {e}");
        assert!(message(&e).contains("/v1/completions"), "{path}: {e}");
    }
}

/// qwen3-rerank: a causal Qwen3 served as Qwen3-Reranker with vLLM's
/// `--hf-overrides`: `/rerank` and `/score` give P(yes) of the softmax over
/// the "no" and "yes" logits at the pair's last token, transformers'
/// within 1e-4.
#[test]
fn qwen3_reranker_over_http_matches_transformers() {
    let s = Server::start_with_model(
        &fixture("qwen3-rerank"),
        &[
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--hf-overrides",
            r#"{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}"#,
        ],
    );
    let r = reference("qwen3-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let want = floats(&r["scores"]);
    let mut worst = 0.0f64;
    let (st, out) = s.post(
        "/v1/rerank",
        &json!({"model": "smol", "query": query, "documents": docs}),
    );
    assert_eq!(st, 200, "{out}");
    for res in out["results"].as_array().expect("results") {
        let i = res["index"].as_u64().expect("index") as usize;
        let got = res["relevance_score"].as_f64().expect("relevance_score");
        worst = worst.max((got - want[i]).abs());
        assert!((got - want[i]).abs() < 1e-4, "document {i}: {got}");
    }
    let (st, out) = s.post(
        "/score",
        &json!({"model": "smol", "text_1": query, "text_2": docs}),
    );
    assert_eq!(st, 200, "{out}");
    for (k, d) in out["data"].as_array().expect("data").iter().enumerate() {
        let got = d["score"].as_f64().expect("score");
        worst = worst.max((got - want[k]).abs());
        assert!((got - want[k]).abs() < 1e-4, "pair {k}: {got}");
    }
    eprintln!("qwen3-rerank over HTTP: largest |P(yes) - transformers| {worst:.3e}");
    let (st, e) = s.post("/v1/embeddings", &json!({"model": "smol", "input": "hi"}));
    assert_eq!(st, 400, "{e}");
    assert!(message(&e).contains("/rerank"), "{e}");
}

/// Runs tests/python/rerank_clients.py in `mode` against `fixture`'s server.
fn run_clients(mode: &str, name: &str) {
    let s = start(name);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/rerank_clients.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(mode)
        .arg(&s.base)
        .arg("smol")
        .arg(fixture(name).join("reference.json"))
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.contains(" passed, 0 failed")),
        "rerank_clients.py {mode} failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_text()
    );
}

/// The `cohere` SDK (`ClientV2.rerank` on /v2/rerank) and LiteLLM's
/// `rerank` (its cohere provider), unmodified, on the XLM-R cross-encoder:
/// CrossEncoder's scores within 1e-4, in its order.
#[test]
fn cohere_and_litellm_rerank_clients_work_unmodified() {
    run_clients("rerank", "xlmr-rerank");
}

/// LiteLLM's `embedding` (its openai provider) on the BERT embedder:
/// sentence-transformers' vectors, cosine ≥ 0.99999.
#[test]
fn litellm_embedding_works_unmodified() {
    run_clients("embed", "bert-embed");
}

/// modernbert-embed (`ModernBertModel` saved by sentence-transformers:
/// rotary positions, local layers with a window of 8, mean pooling and
/// Normalize) on `/v1/embeddings`, the 73-token input included:
/// sentence-transformers' vectors at cosine 0.99999.
#[test]
fn modernbert_embeddings_match_sentence_transformers_over_http() {
    let s = Server::start_with_model(
        &fixture("modernbert-embed"),
        &["--dtype", "float32", "--max-model-len", "128"],
    );
    let r = reference("modernbert-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    let (st, out) = s.post("/v1/embeddings", &json!({"model": "smol", "input": texts}));
    assert_eq!(st, 200, "{out}");
    let n_tokens: usize = inputs
        .iter()
        .map(|i| i["token_ids"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(out["usage"]["prompt_tokens"], n_tokens, "{out}");
    let data = out["data"].as_array().expect("data");
    assert_eq!(data.len(), inputs.len(), "{out}");
    for (k, (d, i)) in data.iter().zip(inputs).enumerate() {
        let c = cosine(&floats(&d["embedding"]), &floats(&i["embedding"]));
        eprintln!("modernbert-embed over HTTP, input {k}: cosine {c:.9}");
        assert!(c >= 0.99999, "input {k}: cosine {c}");
    }
}

/// modernbert-rerank (`ModernBertForSequenceClassification`, one label,
/// mean classifier pooling) on `/rerank` and `/score`: CrossEncoder's
/// scores within 1e-4, though its tokenizer types the second text 1 (the
/// model reads no types).
#[test]
fn modernbert_rerank_scores_match_cross_encoder_over_http() {
    let s = Server::start_with_model(
        &fixture("modernbert-rerank"),
        &["--dtype", "float32", "--max-model-len", "128"],
    );
    let r = reference("modernbert-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let want = floats(&r["scores"]);
    let mut by_relevance: Vec<usize> = (0..want.len()).collect();
    by_relevance.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let mut worst = 0.0f64;
    let (st, out) = s.post(
        "/rerank",
        &json!({"model": "smol", "query": query, "documents": docs}),
    );
    assert_eq!(st, 200, "{out}");
    let results = out["results"].as_array().expect("results");
    assert_eq!(results.len(), docs.len(), "{out}");
    for (res, &i) in results.iter().zip(&by_relevance) {
        assert_eq!(res["index"], i, "by relevance: {out}");
        let got = res["relevance_score"].as_f64().expect("relevance_score");
        worst = worst.max((got - want[i]).abs());
        assert!((got - want[i]).abs() < 1e-4, "document {i}: {got}");
    }
    let (st, out) = s.post(
        "/score",
        &json!({"model": "smol", "text_1": query, "text_2": docs}),
    );
    assert_eq!(st, 200, "{out}");
    for (k, d) in out["data"].as_array().expect("data").iter().enumerate() {
        let got = d["score"].as_f64().expect("score");
        worst = worst.max((got - want[k]).abs());
        assert!((got - want[k]).abs() < 1e-4, "pair {k}: {got}");
    }
    eprintln!("modernbert-rerank over HTTP: largest |score - CrossEncoder| {worst:.3e}");
}
