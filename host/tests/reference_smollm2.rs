//! The demo model against llama.cpp's and float32 transformers' outputs
//! (../shared/reference): greedy continuations must pass the reference
//! checker, case by case, against at least one of the two.

mod common;

use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use std::collections::HashMap;

fn engine(threads: usize) -> LLM {
    let mut args = EngineArgs::new(common::demo_gguf());
    args.threads = threads;
    args.max_model_len = Some(2048);
    args.kv_cache_memory = Some(256 << 20);
    LLM::new(args).expect("loading the demo model")
}

/// Runs every greedy case of cases.json, all batched together, and returns
/// `name → output ids`.
fn run_cases(llm: &mut LLM) -> Vec<(String, Vec<u32>)> {
    let cases = common::reference_json("cases.json");
    let mut out = Vec::new();
    let greedy = cases["greedy"].as_array().expect("greedy cases");
    // Different cases want different lengths and stop ids, so each gets its
    // own params; they still share the engine's batches as they run.
    for case in greedy {
        let name = case["name"].as_str().expect("name").to_string();
        let mut p =
            SamplingParams::greedy(case["max_tokens"].as_u64().expect("max_tokens") as usize);
        p.stop_token_ids = case["stop_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default();
        p.ignore_eos = true; // stop only where the reference stops: at its stop_ids
        let prompt = case["prompt"].as_str().expect("prompt");
        let r = llm.generate(&[Prompt::from(prompt)], &p).expect("generate");
        out.push((name, r[0].outputs[0].token_ids.clone()));
    }
    out
}

#[test]
fn prompt_token_ids_match_the_reference() {
    let mut llm = engine(2);
    let reference = common::reference_json("smollm2_llamacpp.json");
    for case in reference["greedy"].as_array().expect("greedy") {
        let want: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).expect("ids");
        let got = llm
            .encode(&Prompt::from(case["prompt"].as_str().expect("prompt")))
            .expect("encode");
        assert_eq!(got, want, "{}", case["name"]);
    }
    // Keep the engine used so the test also proves a model loads.
    let _ = llm
        .generate(&[Prompt::from("Hi")], &SamplingParams::greedy(1))
        .expect("generate");
}

#[test]
fn greedy_continuations_pass_the_reference_checker() {
    let mut llm = engine(2);
    let ours = run_cases(&mut llm);
    let dir = tempfile::tempdir().expect("tempdir");
    let ours_path = dir.path().join("ours.json");
    let rows: Vec<_> = ours
        .iter()
        .map(|(n, ids)| serde_json::json!({"name": n, "output_ids": ids}))
        .collect();
    std::fs::write(
        &ours_path,
        serde_json::json!({ "greedy": rows }).to_string(),
    )
    .expect("write");
    let checker = common::reference_dir().join("check_greedy.py");
    let mut passed: HashMap<String, Vec<String>> = HashMap::new();
    let mut report = String::new();
    for reference in ["smollm2_llamacpp.json", "smollm2_hf_f32.json"] {
        let out = std::process::Command::new("python3")
            .arg(&checker)
            .arg(common::reference_dir().join(reference))
            .arg(&ours_path)
            .output()
            .expect("running check_greedy.py");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        report.push_str(&format!("--- {reference}\n{text}"));
        for line in text.lines() {
            if let Some((name, rest)) = line.split_once(": ") {
                if rest.starts_with("ok") {
                    passed
                        .entry(name.to_string())
                        .or_default()
                        .push(reference.to_string());
                }
            }
        }
    }
    eprintln!("{report}");
    for (name, _) in &ours {
        assert!(
            passed.contains_key(name),
            "case {name} passes against neither reference:\n{report}"
        );
    }
}
