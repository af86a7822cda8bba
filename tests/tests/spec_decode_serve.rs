//! `pagoda serve --speculative-config`: n-gram speculation and a draft
//! model through the OpenAI API give the plain server's greedy text,
//! streamed and not, seeded sampling stays reproducible, and vLLM's
//! `vllm:spec_decode_*` metrics are served; bad configurations stop
//! start-up with what to change.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server};
use serde_json::{json, Value};

const NGRAM: &str = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;

fn request(stream: bool) -> Value {
    json!({
        "model": "smol",
        "prompt": "Copy this text exactly.\nText: The river bends twice before it reaches the old mill, where the water slows and the children fish on summer evenings.\nCopy:",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
}

fn text(s: &Server) -> String {
    let (status, v) = s.post("/v1/completions", &request(false));
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

fn streamed_text(s: &Server) -> String {
    let (status, body) = s.post_text("/v1/completions", &request(true));
    assert_eq!(status, 200, "{body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            let v: Value = serde_json::from_str(d).expect("an SSE chunk");
            v["choices"][0]["text"].as_str().unwrap_or("").to_string()
        })
        .collect()
}

/// `/metrics` once the engine has stopped counting (the counters move
/// just after the last output is sent): two scrapes in a row agree.
fn settled_metrics(s: &Server) -> String {
    let mut last = s.get("/metrics").1;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let now = s.get("/metrics").1;
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// The value of the first sample of `name` whose labels contain `label`.
fn sample(metrics: &str, name: &str, label: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn ngram_speculation_serves_the_plain_text_and_counts_its_drafts() {
    let plain = {
        let s = Server::start(&[]);
        text(&s)
    };
    let s = Server::start(&["--speculative-config", NGRAM]);
    assert!(
        s.log_text().contains("speculative decoding: Ngram"),
        "{}",
        s.log_text()
    );
    assert_eq!(text(&s), plain);
    assert_eq!(streamed_text(&s), plain);
    let m = settled_metrics(&s);
    let value = |name| sample(&m, name, "model_name=").unwrap_or_else(|| panic!("{name}:\n{m}"));
    let drafts = value("vllm:spec_decode_num_drafts_total");
    let drafted = value("vllm:spec_decode_num_draft_tokens_total");
    let accepted = value("vllm:spec_decode_num_accepted_tokens_total");
    assert!(drafts > 0.0 && drafted >= drafts, "{drafts} {drafted}");
    assert!(
        accepted > 0.0 && accepted <= drafted,
        "{accepted} of {drafted}"
    );
    let per_pos = |p: usize| {
        sample(
            &m,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            &format!("position=\"{p}\""),
        )
    };
    let (first, last) = (
        per_pos(0).expect("position 0"),
        per_pos(3).expect("position 3"),
    );
    // A draft's later tokens are accepted only after its earlier ones.
    assert!(first >= last && first > 0.0, "{first} {last}");
    let summed: f64 = (0..4).filter_map(per_pos).sum();
    assert_eq!(summed, accepted);
    // Every metric docs/metrics.md lists for speculative decoding is served.
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
        .expect("docs/metrics.md");
    let section = doc
        .split("## Served with speculative decoding")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a section for speculative decoding");
    let names: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split(['`', '{']).next())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for name in names {
        assert!(
            m.lines().any(|l| l.starts_with(&format!("{name}{{"))),
            "{name} is documented but not served:\n{m}"
        );
    }
}

#[test]
fn the_seed_flags_serve_as_the_json_does() {
    let s = Server::start(&[
        "--speculative-model",
        "[ngram]",
        "--num-speculative-tokens",
        "3",
    ]);
    text(&s);
    assert!(s.metric("vllm:spec_decode_num_drafts_total") > 0.0);
}

#[test]
fn bad_speculative_configurations_stop_start_up() {
    for (flags, says) in [
        (
            vec![
                "--speculative-config",
                r#"{"method": "eagle", "model": "x", "num_speculative_tokens": 2}"#,
            ],
            "method \"eagle\" is not supported",
        ),
        (
            vec!["--num-speculative-tokens", "3"],
            "add --speculative-model",
        ),
        (
            vec![
                "--speculative-config",
                r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}"#,
            ],
            "larger than",
        ),
    ] {
        let out = std::process::Command::new(pagoda_bin())
            .arg("serve")
            .arg(demo_gguf())
            .args(&flags)
            .output()
            .expect("running pagoda serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn a_draft_model_serves_the_plain_text_and_seeds_stay_reproducible() {
    let plain = {
        let s = Server::start(&[]);
        text(&s)
    };
    // The demo model drafting for itself: every draft holds.
    let config = format!(
        r#"{{"model": {:?}, "num_speculative_tokens": 3}}"#,
        demo_gguf()
    );
    let s = Server::start(&["--speculative-config", &config]);
    assert!(s.log_text().contains("draft model:"), "{}", s.log_text());
    assert_eq!(text(&s), plain);
    let m = settled_metrics(&s);
    let value = |name| sample(&m, name, "model_name=").unwrap_or_else(|| panic!("{name}:\n{m}"));
    let drafted = value("vllm:spec_decode_num_draft_tokens_total");
    assert!(drafted > 0.0);
    assert_eq!(value("vllm:spec_decode_num_accepted_tokens_total"), drafted);
    // A seeded sampled request gives the same text every time, drafts and
    // all.
    let seeded = json!({
        "model": "smol",
        "prompt": "Once upon a time",
        "max_tokens": 32,
        "temperature": 0.9,
        "seed": 7,
        "ignore_eos": true,
    });
    let texts: Vec<String> = (0..2)
        .map(|_| {
            let (status, v) = s.post("/v1/completions", &seeded);
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["text"].as_str().expect("text").to_string()
        })
        .collect();
    assert_eq!(texts[0], texts[1]);
}
