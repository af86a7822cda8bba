//! LoRA adapters through the real server, as vLLM serves them:
//! `--enable-lora --lora-modules name=path`, a request names an adapter as
//! its `model`, `/v1/models` lists adapters with the base as `parent`, and
//! with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` adapters are loaded and
//! unloaded through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
//! Bad adapters are refused with a 400 and change nothing.

use pagoda_e2e::Server;
use serde_json::{json, Value};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures"))
}

fn lora(name: &str) -> String {
    pagoda_e2e::lora_fixture(&format!("llama/{name}"))
        .display()
        .to_string()
}

/// The largest gap between the server's prompt logprobs for `model` and
/// PEFT's for `adapter`.
fn prompt_logprob_error(s: &Server, model: &str, adapter: &str) -> f64 {
    let (ids, want) = pagoda_e2e::lora_first_case(&format!("llama/{adapter}"));
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}),
    );
    assert_eq!(st, 200, "{model}: {v}");
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

#[test]
fn adapters_serve_list_load_and_unload_as_vllms_do() {
    let model = fixtures().join("hf-families/llama");
    let qv = format!("qv={}", lora("qv-r8"));
    let s = Server::start_with_env(
        &model,
        &[
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--enable-lora",
            "--lora-modules",
            &qv,
            "--max-loras",
            "2",
        ],
        &[("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")],
    );

    // Listed, with the base model as parent.
    let (st, body) = s.get("/v1/models");
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&body).expect("JSON");
    let card = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .find(|m| m["id"] == "qv")
        .unwrap_or_else(|| panic!("qv is not listed: {body}"));
    assert_eq!(card["parent"], "smol", "{card}");
    assert_eq!(card["root"], lora("qv-r8"), "{card}");

    // Naming the adapter runs it: PEFT's numbers, not the base model's.
    let err = prompt_logprob_error(&s, "qv", "qv-r8");
    assert!(err < 1e-4, "qv: prompt logprobs {err:.2e} from PEFT's");
    assert!(
        prompt_logprob_error(&s, "smol", "qv-r8") > 1e-2,
        "the base is not the adapter"
    );

    // Loaded at run time, then served.
    let path = lora("all-r16");
    let (st, text) = s.post_text(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "all", "lora_path": path}),
    );
    assert_eq!(
        (st, text.as_str()),
        (200, "Success: LoRA adapter 'all' added successfully.")
    );
    let err = prompt_logprob_error(&s, "all", "all-r16");
    assert!(err < 1e-4, "all: prompt logprobs {err:.2e} from PEFT's");
    let (st, v) = s.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "all", "lora_path": path}),
    );
    assert_eq!(st, 400, "loaded twice: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("already been loaded")),
        "{v}"
    );

    // A bad adapter is a 400 that changes nothing.
    for body in [
        json!({"lora_name": "missing", "lora_path": "/nonexistent/adapter"}),
        json!({"lora_name": "qwen", "lora_path": fixtures().join("lora/qwen3/all-r8")}),
        json!({"lora_path": path}),
    ] {
        let (st, v) = s.post("/v1/load_lora_adapter", &body);
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "qwen", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(st, 404, "a refused adapter is unknown: {v}");
    assert!(
        prompt_logprob_error(&s, "qv", "qv-r8") < 1e-4,
        "qv still serves"
    );

    // vLLM's gauge of the adapters in use.
    let (_, metrics) = s.get("/metrics");
    assert!(
        metrics.contains("vllm:lora_requests_info") && metrics.contains("max_lora=\"2\""),
        "no vllm:lora_requests_info in /metrics"
    );

    // Unloaded: new requests get 404 model_not_found.
    let (st, text) = s.post_text("/v1/unload_lora_adapter", &json!({"lora_name": "all"}));
    assert_eq!(
        (st, text.as_str()),
        (200, "Success: LoRA adapter 'all' removed successfully.")
    );
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "all", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(st, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    let (st, _) = s.post("/v1/unload_lora_adapter", &json!({"lora_name": "all"}));
    assert_eq!(st, 404, "unloading twice");
}

#[test]
fn without_the_switch_there_is_no_runtime_loading_and_lora_needs_enabling() {
    let model = fixtures().join("hf-families/llama");
    let s = Server::start_with_model(
        &model,
        &[
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--enable-lora",
        ],
    );
    let (st, _) = s.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "x", "lora_path": lora("qv-r8")}),
    );
    assert_eq!(
        st, 404,
        "vLLM has no such route without VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    );
    drop(s);
    // --lora-modules without --enable-lora stops start-up, naming the flag.
    let out = std::process::Command::new(pagoda_e2e::pagoda_bin())
        .args(["serve", "--model"])
        .arg(&model)
        .args(["--lora-modules", &format!("qv={}", lora("qv-r8"))])
        .output()
        .expect("pagoda");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--enable-lora"), "{err}");
}
