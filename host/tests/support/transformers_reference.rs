//! transformers' float32 outputs in a fixture's `reference.json` (the
//! hf-families folders: `cases` with `prompt_ids`, `prompt_logprobs`,
//! `greedy_ids`, `greedy_top2_gap`), and the one check every family's
//! test makes against them.

use pagoda::engine::{Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::Path;

/// `reference.json` of the fixture folder `dir`.
pub fn read(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference JSON")
}

pub fn f64s(v: &Value) -> Vec<Option<f64>> {
    v.as_array()
        .expect("array")
        .iter()
        .map(Value::as_f64)
        .collect()
}

pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Runs every case of `reference` on `llm`: prompt logprobs within `tol`,
/// greedy ids equal up to the first step whose top-two gap is under
/// `near_tie`, and up to the first generated id at or past
/// `embedded_rows` (a token whose embedding row a converted file dropped).
/// Returns the largest logprob difference.
pub fn check_cases(
    reference: &Value,
    what: &str,
    llm: &mut LLM,
    tol: f64,
    near_tie: f64,
    embedded_rows: u32,
) -> f64 {
    let mut worst = 0f64;
    for (c, case) in reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let prompt = u32s(&case["prompt_ids"]);
        let want_lp = f64s(&case["prompt_logprobs"]);
        let want_greedy = u32s(&case["greedy_ids"]);
        let gaps = f64s(&case["greedy_top2_gap"]);
        let mut params = SamplingParams::greedy(want_greedy.len());
        // transformers generated with min_new_tokens = max_new_tokens,
        // which masks EOS at every step.
        params.min_tokens = want_greedy.len();
        params.prompt_logprobs = Some(1);
        let out = llm
            .generate(&[Prompt::Tokens(prompt.clone())], &params)
            .unwrap_or_else(|e| panic!("{what} case {c}: {e:#}"));
        let got_lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(got_lp.len(), prompt.len() - 1);
        for (i, l) in got_lp.iter().enumerate() {
            let want = want_lp[i + 1].expect("reference logprob");
            assert_eq!(l.token_id, prompt[i + 1]);
            let err = (l.logprob as f64 - want).abs();
            worst = worst.max(err);
            assert!(
                err < tol,
                "{what} case {c}, prompt token {}: logprob {} vs transformers {want}",
                i + 1,
                l.logprob
            );
        }
        let got = &out[0].outputs[0].token_ids;
        for (i, (&g, &w)) in got.iter().zip(&want_greedy).enumerate() {
            if gaps[i].is_some_and(|gap| gap < near_tie) {
                break;
            }
            assert_eq!(
                g, w,
                "{what} case {c}: greedy token {i} is {g}, transformers {w} (got {got:?}, want {want_greedy:?})"
            );
            if w >= embedded_rows {
                eprintln!("{what} case {c}: greedy compared up to token {i} ({w}, past the file's {embedded_rows} embedding rows)");
                break;
            }
        }
    }
    eprintln!("{what}: largest prompt logprob difference {worst:.2e}");
    worst
}
