//! `pagoda serve --generation-config FOLDER`: the OpenAI endpoints take the
//! defaults of that folder's `generation_config.json` for what a request
//! leaves unset (greedy `temperature`, `max_new_tokens` as `max_tokens`,
//! `eos_token_id` as extra EOS ids), and a request's own values win.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server, TempDir};
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

/// The greedy chain of [`PROMPT`] on the demo model, as `pagoda generate`
/// (greedy by default) gives it.
fn greedy_chain(n: usize) -> Vec<u64> {
    let out = std::process::Command::new(pagoda_bin())
        .args(["generate", "--json", "--threads", "2", "--model"])
        .arg(demo_gguf())
        .args(["--prompt", PROMPT, "--max-tokens", &n.to_string()])
        .args(["--kv-cache-memory", "64MiB", "--max-model-len", "256"])
        .output()
        .expect("pagoda generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

fn completion_tokens(v: &Value) -> u64 {
    v["usage"]["completion_tokens"].as_u64().expect("usage")
}

#[test]
fn generation_config_defaults_apply_over_http_and_requests_win() {
    let chain = greedy_chain(6);
    // The first token from step 2 on that the chain has not produced yet:
    // an EOS id there must end the output right there, before the
    // max_new_tokens of 5 does.
    let k = (2..chain.len().min(5))
        .find(|&k| !chain[..k].contains(&chain[k]))
        .unwrap_or_else(|| panic!("no fresh token in {chain:?}"));
    let dir = TempDir::new("gencfg");
    std::fs::write(
        dir.0.join("generation_config.json"),
        json!({"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": [chain[k]],
               "do_sample": false, "transformers_version": "4.45.0"})
        .to_string(),
    )
    .expect("write generation_config.json");
    let s = Server::start_with_model(
        &demo_gguf(),
        &["--generation-config", dir.0.to_str().expect("utf-8 path")],
    );
    let log = s.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("Default sampling parameters have been overridden"))
        .unwrap_or_else(|| panic!("no start-up line of the defaults:\n{log}"));
    assert!(
        line.contains("temperature=0") && line.contains("max_tokens=5"),
        "{line}"
    );

    // Nothing set: greedy (the config's temperature 0), and the config's
    // eos id ends the output at step k.
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": PROMPT}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(completion_tokens(&v), k as u64 + 1, "{v}");

    // Past EOS: max_new_tokens is the default max_tokens ...
    let (_, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": PROMPT, "ignore_eos": true}),
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(completion_tokens(&v), 5, "{v}");
    let five = v["choices"][0]["text"].clone();
    // ... and the request's own max_tokens wins, continuing the same
    // greedy text.
    let (_, v) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": PROMPT, "ignore_eos": true, "max_tokens": 6}),
    );
    assert_eq!(completion_tokens(&v), 6, "{v}");
    let six = v["choices"][0]["text"].as_str().expect("text");
    assert!(
        six.starts_with(five.as_str().expect("text")),
        "{five} / {six}"
    );

    // Chat takes the same defaults.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "ignore_eos": true,
                "messages": [{"role": "user", "content": "Name a colour."}]}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(completion_tokens(&v), 5, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}
