//! `pagoda bench` through its real CLI: `serve` against our own server, and
//! `throughput` offline; their result JSON carries vLLM's keys.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server, TempDir};
use serde_json::Value;

#[test]
fn bench_serve_against_our_server_writes_every_key() {
    let s = Server::start(&["--max-num-seqs", "4"]);
    let dir = TempDir::new("bench");
    let out = dir.0.join("result.json");
    let status = std::process::Command::new(pagoda_bin())
        .args([
            "bench",
            "serve",
            "--base-url",
            &s.base,
            "--model",
            "smol",
            "--no-progress",
        ])
        .arg("--tokenizer")
        .arg(demo_gguf())
        .args([
            "--num-prompts",
            "6",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--max-concurrency",
            "3",
            "--seed",
            "5",
            "--ignore-eos",
        ])
        .arg("--result-json")
        .arg(&out)
        .status()
        .expect("pagoda bench serve");
    assert!(status.success());
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("result")).expect("JSON");
    for key in [
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_concurrency",
        "request_rate",
        "burstiness",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "errors",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    for m in ["ttft", "tpot", "itl", "e2el"] {
        for s in ["mean", "median", "std", "p99"] {
            let k = format!("{s}_{m}_ms");
            assert!(v[&k].as_f64().is_some_and(|x| x > 0.0), "{k} = {}", v[&k]);
        }
    }
    assert_eq!(v["completed"], 6);
    assert_eq!(v["failed"], 0);
    assert_eq!(
        v["total_output_tokens"], 48,
        "ignore_eos gives exactly output_len tokens each"
    );
    for l in v["input_lens"].as_array().unwrap() {
        assert_eq!(l.as_u64(), Some(32));
    }
    assert!(v["itls"][0].as_array().is_some_and(|a| a.len() >= 4));
}

#[test]
fn bench_throughput_runs_each_dataset() {
    let dir = TempDir::new("bench-tp");
    for dataset in ["random", "seed", "prefix-repetition"] {
        let out = dir.0.join(format!("{dataset}.json"));
        let o = std::process::Command::new(pagoda_bin())
            .args([
                "bench",
                "throughput",
                "--dataset",
                dataset,
                "--num-prompts",
                "4",
                "--input-len",
                "24",
                "--output-len",
                "6",
            ])
            .args([
                "--threads",
                "2",
                "--max-model-len",
                "2048",
                "--kv-cache-memory",
                "256MiB",
            ])
            .arg("--model")
            .arg(demo_gguf())
            .arg("--result-json")
            .arg(&out)
            .output()
            .expect("pagoda bench throughput");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(&out).expect("result")).expect("JSON");
        assert_eq!(v["num_requests"], 4);
        assert_eq!(v["total_output_tokens"], 24, "{dataset}");
        assert!(v["tokens_per_second"].as_f64().is_some_and(|x| x > 0.0));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(stdout.contains("requests/s"), "{stdout}");
        if dataset == "prefix-repetition" {
            assert!(stdout.contains("prefix cache hits"), "{stdout}");
        }
    }
}

/// A `vllm bench serve` command line works with the program name changed:
/// vLLM's flag names, chat through `--backend openai-chat`, `--ignore-eos`
/// off unless given, chat prompt lengths as the server counts them, and a
/// fixed `--seed` giving the same prompts.
#[test]
fn bench_serve_takes_vllm_bench_serve_flags() {
    let s = Server::start(&["--max-num-seqs", "4"]);
    let dir = TempDir::new("bench-vllm");
    let run = |seed: &str, ignore_eos: bool, name: &str| -> Value {
        let out = dir.0.join(name);
        let mut cmd = std::process::Command::new(pagoda_bin());
        cmd.args([
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            &s.base,
        ])
        .args([
            "--model",
            "smol",
            "--dataset-name",
            "random",
            "--random-input-len",
            "24",
        ])
        .args([
            "--random-output-len",
            "6",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
        ])
        .args(["--seed", seed, "--no-progress"])
        .arg("--tokenizer")
        .arg(demo_gguf())
        .arg("--result-json")
        .arg(&out);
        if ignore_eos {
            cmd.arg("--ignore-eos");
        }
        assert!(cmd.status().expect("pagoda bench serve").success());
        serde_json::from_str(&std::fs::read_to_string(&out).expect("result")).expect("JSON")
    };
    let a = run("3", true, "a.json");
    let b = run("3", true, "b.json");
    let c = run("4", true, "c.json");
    assert_eq!(a["completed"], 4);
    assert_eq!(a["endpoint"], "/v1/chat/completions");
    assert_eq!(a["total_output_tokens"], 24, "--ignore-eos: 6 tokens each");
    // The chat template wraps the 24 random tokens, and the server's count says so.
    for l in a["input_lens"].as_array().unwrap() {
        assert!(l.as_u64().is_some_and(|n| n > 24), "{l}");
    }
    assert_eq!(a["input_lens"], b["input_lens"]);
    assert_eq!(
        a["generated_texts"], b["generated_texts"],
        "the same seed, the same prompts"
    );
    assert_ne!(
        a["generated_texts"], c["generated_texts"],
        "another seed, other prompts"
    );
    // Without --ignore-eos the server may stop early, as with vLLM.
    let d = run("3", false, "d.json");
    assert!(d["total_output_tokens"].as_u64().is_some_and(|n| n <= 24));
}
