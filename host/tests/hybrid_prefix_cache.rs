//! Prefix caching of the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next):
//! a hit restores the linear-attention layers' recurrent state from the
//! checkpoint at the hit's end as well as the attention layers' K/V, and
//! gives what the cold run gave.
//!
//! Served in float32 from transformers' own tiny checkpoints
//! (tests/fixtures/hf-families-2026), on the prompts of their
//! `reference.json` (38, 48 and 20 tokens; 16-token blocks).

use pagoda::engine::loader::DType;
use pagoda::engine::request::TokenLogprob;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

const HYBRID: [&str; 3] = ["qwen3_5", "qwen3_5_moe", "qwen3_next"];
const BLOCK: usize = 16;

fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf-families-2026")
        .join(family)
}

fn prompts(family: &str) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixture(family).join("reference.json")).expect("reference");
    let v: Value = serde_json::from_str(&text).expect("reference JSON");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            c["prompt_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect()
        })
        .collect()
}

fn engine(family: &str, prefix_caching: bool) -> LLM {
    let mut a = EngineArgs::new(fixture(family));
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    a.enable_prefix_caching = prefix_caching;
    LLM::new(a).expect("engine")
}

fn greedy(n: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p.logprobs = Some(1);
    p
}

/// Output ids, the sampled tokens' logprobs, and the cached prompt tokens.
fn run(llm: &mut LLM, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>, usize) {
    let out = llm
        .generate(&[Prompt::Tokens(prompt.to_vec())], &greedy(n))
        .expect("generate");
    let o = &out[0].outputs[0];
    let lps: Vec<f32> = o
        .logprobs
        .as_ref()
        .expect("logprobs")
        .iter()
        .map(|l: &TokenLogprob| l.logprob)
        .collect();
    (o.token_ids.clone(), lps, out[0].num_cached_tokens)
}

/// The same prompt again hits every full block before its last token
/// (the cold run split its prefill there and checkpointed the state), and
/// its tokens and logprobs are the cold run's, bit for bit.
#[test]
fn a_repeated_prompt_restores_the_linear_layers_state_and_repeats_the_cold_run_exactly() {
    for family in HYBRID {
        let mut llm = engine(family, true);
        for (c, p) in prompts(family).iter().enumerate() {
            let cold = run(&mut llm, p, 8);
            assert_eq!(
                cold.2, 0,
                "{family} case {c}: the first run found a cache hit"
            );
            let hit = run(&mut llm, p, 8);
            assert_eq!(
                hit.2,
                (p.len() - 1) / BLOCK * BLOCK,
                "{family} case {c}: a {}-token prompt should hit up to its last full block",
                p.len()
            );
            assert_eq!(
                hit.0, cold.0,
                "{family} case {c}: tokens differ after the hit"
            );
            assert_eq!(
                hit.1, cold.1,
                "{family} case {c}: logprobs differ after the hit"
            );
        }
    }
}

/// Runs `prompt` on `llm`'s engine under cache salt `salt`: output ids
/// and logprobs, and the cached prompt tokens.
fn run_salted(llm: &mut LLM, prompt: &[u32], n: usize, salt: u64) -> (Vec<u32>, Vec<f32>, usize) {
    use pagoda::engine::core::RequestOptions;
    let core = llm.engine_mut();
    let opts = RequestOptions {
        cache_salt: salt,
        ..Default::default()
    };
    let id = core
        .add_request(format!("salt{salt}"), prompt.to_vec(), greedy(n), opts)
        .expect("add");
    let (mut ids, mut lps, mut cached) = (Vec::new(), Vec::new(), 0);
    while core.has_unfinished() {
        for o in core.step().expect("step") {
            if o.id == id {
                ids.extend_from_slice(&o.new_token_ids);
                lps.extend(o.logprobs.iter().map(|l| l.logprob));
                cached = o.num_cached_tokens;
            }
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    (ids, lps, cached)
}

/// A later turn of a conversation (the earlier prompt, its answer and a
/// new message) continues from the earlier prompt's checkpoint, and gives
/// the cold run's tokens, with logprobs equal to float32 rounding: the
/// cached K/V and state came from the earlier turn's chunks (its prompt
/// split at its last full block), and the delta rule's chunked form rounds
/// differently over other chunks (transformers' own whole and chunked
/// prefills differ by up to 8.4e-5 on these checkpoints, the bound the
/// fixtures' README sets at 1e-4). Cold under
/// another salt on the same engine, and on an engine without prefix
/// caching.
#[test]
fn a_later_turn_continues_from_the_earlier_prompts_checkpoint() {
    for family in HYBRID {
        let mut cached = engine(family, true);
        let mut cold = engine(family, false);
        let first = &prompts(family)[1];
        let (answer, _, _) = run(&mut cached, first, 6);
        let mut second = first.clone();
        second.extend_from_slice(&answer);
        second.extend_from_slice(&first[..9]);
        let (ids, lps, hit) = run(&mut cached, &second, 8);
        // The first prompt's steps ended at its last full block (and at
        // its end, when that is a block boundary too): checkpoints there.
        assert_eq!(
            hit,
            first.len() / BLOCK * BLOCK,
            "{family}: the second turn should hit up to the first prompt's checkpoint"
        );
        let salted = run_salted(&mut cached, &second, 8, 7);
        assert_eq!(salted.2, 0, "{family}: another salt hit the cache");
        let uncached = run(&mut cold, &second, 8);
        assert_eq!(uncached.2, 0);
        for (what, (want_ids, want_lps, _)) in [("another salt", salted), ("no caching", uncached)]
        {
            assert_eq!(
                ids, want_ids,
                "{family}: tokens differ from the cold run ({what})"
            );
            for (i, (g, w)) in lps.iter().zip(&want_lps).enumerate() {
                assert!(
                    (g - w).abs() < 1e-4,
                    "{family}: token {i}'s logprob {g} vs {w} cold ({what})"
                );
            }
        }
    }
}
