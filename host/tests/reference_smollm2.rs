//! The demo model against llama.cpp's and float32 transformers' outputs
//! (tests/fixtures/reference, copied from ../shared/reference): greedy continuations must pass the reference
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

/// The reference checker's rule (../shared/reference/check_greedy.py's
/// docstring), per case: our tokens must equal the reference's until the
/// first step where they differ; there ours must be among the reference's
/// top 5 within `NEAR_TIE` nats of its best (a near-tie, which quantized
/// and exact arithmetic legitimately break differently). After that the
/// contexts differ and nothing more is compared. Stopping early while
/// agreeing fails. Returns why it passed, or why not.
fn check_greedy(reference: &serde_json::Value, ours: &[u32]) -> Result<String, String> {
    const NEAR_TIE: f64 = 0.4;
    let want = reference["output_ids"].as_array().ok_or("no output_ids")?;
    let top5 = reference["top5_logprobs"]
        .as_array()
        .ok_or("no top5_logprobs")?;
    for (i, (r, &o)) in want.iter().zip(ours).enumerate() {
        let r = r.as_u64().ok_or("a reference id is not a number")?;
        if r == o as u64 {
            continue;
        }
        let top: Vec<(u64, f64)> = top5[i]
            .as_array()
            .ok_or("top5 is not a list")?
            .iter()
            .filter_map(|e| Some((e[0].as_u64()?, e[1].as_f64()?)))
            .collect();
        let best = top.first().map(|t| t.1).ok_or("an empty top 5")?;
        return match top.iter().find(|t| t.0 == o as u64) {
            Some(&(_, lp)) if best - lp <= NEAR_TIE => Ok(format!(
                "near-tie at step {i} (ref {r} {best:.3}, ours {o} {lp:.3})"
            )),
            Some(&(_, lp)) => Err(format!(
                "diverged at step {i}: ref {r}, ours {o} (ref logprob {lp:.3} vs best {best:.3})"
            )),
            None => Err(format!(
                "diverged at step {i}: ref {r}, ours {o} (not in the reference's top 5)"
            )),
        };
    }
    if ours.len() < want.len() {
        return Err(format!(
            "stopped after {} tokens, the reference has {}",
            ours.len(),
            want.len()
        ));
    }
    Ok("identical".into())
}

#[test]
fn greedy_continuations_pass_the_reference_checker() {
    let mut llm = engine(2);
    let ours = run_cases(&mut llm);
    let mut passed: HashMap<String, Vec<String>> = HashMap::new();
    let mut report = String::new();
    for reference in ["smollm2_llamacpp.json", "smollm2_hf_f32.json"] {
        let cases = common::reference_json(reference);
        report.push_str(&format!("--- {reference}\n"));
        for case in cases["greedy"].as_array().expect("greedy cases") {
            let name = case["name"].as_str().expect("a case name");
            let Some((_, ids)) = ours.iter().find(|(n, _)| n == name) else {
                report.push_str(&format!("{name}: MISSING\n"));
                continue;
            };
            match check_greedy(case, ids) {
                Ok(why) => {
                    report.push_str(&format!("{name}: ok {why}\n"));
                    passed
                        .entry(name.to_string())
                        .or_default()
                        .push(reference.to_string());
                }
                Err(why) => report.push_str(&format!("{name}: FAIL {why}\n")),
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
