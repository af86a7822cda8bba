//! A `vllm serve` command line starts Pagoda as it is: flags that change
//! nothing here are accepted with one log line each, vLLM's underscore
//! spellings (`--max_model_len`) work, `--gpu-memory-utilization` on the
//! CPU is a warning, and only values that would change results are refused.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server};
use serde_json::json;

#[test]
fn a_vllm_command_line_starts_and_serves() {
    let model = demo_gguf().to_string_lossy().to_string();
    let s = Server::start(&[
        "--enforce-eager",
        "--trust-remote-code",
        "--disable-log-stats",
        "--disable-log-requests",
        "--enable-chunked-prefill",
        "--no-async-scheduling",
        "--swap-space",
        "4",
        "--uvicorn-log-level",
        "warning",
        "--structured-outputs-config.backend",
        "xgrammar",
        "--enable-prompt-tokens-details",
        "--root-path",
        "/llm",
        "--max-logprobs",
        "20",
        // Underscore spellings, one with `=`.
        "--max_num_seqs",
        "3",
        "--block_size=16",
        "--device",
        "cpu",
        "--gpu_memory_utilization",
        "0.9",
        // Meaningful flags, given as the model is.
        "--load-format",
        "gguf",
        "--tokenizer",
        &model,
        "--enable-force-include-usage",
    ]);
    let (st, body) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body["choices"][0]["text"].is_string(), "{body}");
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].is_number(),
        "{body}"
    );
    // --max-logprobs 20 is the limit requests meet.
    let (st, body) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 1, "logprobs": 21}),
    );
    assert_eq!(st, 400, "{body}");
    let log = s.log_text();
    for flag in [
        "--enforce-eager",
        "--trust-remote-code",
        "--disable-log-stats",
        "--disable-log-requests",
        "--enable-chunked-prefill",
        "--no-async-scheduling",
        "--swap-space 4",
        "--uvicorn-log-level warning",
        "--structured-outputs-config.backend xgrammar",
        "--enable-prompt-tokens-details",
        "--root-path /llm",
        "--max-logprobs 20",
        "--gpu-memory-utilization 0.9 applies to GPUs only and is ignored",
        "--load-format gguf",
        "--tokenizer",
    ] {
        assert_eq!(
            log.lines().filter(|l| l.contains(flag)).count(),
            1,
            "one log line naming {flag}:\n{log}"
        );
    }
    // --enable-force-include-usage: a stream that did not ask for usage
    // still ends with it.
    let (st, text) = s.post_text(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "stream": true}),
    );
    assert_eq!(st, 200, "{text}");
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .last()
        .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .unwrap_or_default();
    assert_eq!(last["usage"]["completion_tokens"], 3, "{text}");
    // The underscore spelling took effect.
    assert!(log.contains("(max-num-seqs 3)"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn values_that_would_change_results_are_refused() {
    for (args, want) in [
        (
            &["--structured-outputs-config.backend", "magic"][..],
            "lm-format-enforcer",
        ),
        (
            &["--max_logprobs", "-2"][..],
            "--max-logprobs -2: give a non-negative count, or -1 for no limit",
        ),
        (
            &["--load-format", "dummy"][..],
            "--load-format dummy is not supported",
        ),
        (
            &["--load_format=safetensors"][..],
            "does not match the model",
        ),
        (
            &["--tokenizer", "/no/such/tokenizer"][..],
            "--tokenizer /no/such/tokenizer: no such file",
        ),
    ] {
        let out = std::process::Command::new(pagoda_bin())
            .arg("serve")
            .arg(demo_gguf())
            .args(args)
            .output()
            .expect("running pagoda serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
