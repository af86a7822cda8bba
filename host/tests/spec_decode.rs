//! Speculative decoding on the demo model: under greedy sampling every
//! prompt gives token for token what plain decoding gives, alone and in a
//! batch of 32 with prefix caching, chunked prefill and preemption; under
//! temperature 1 the tokens follow the same distribution as plain
//! sampling; and the drafts really were verified (and mostly accepted where
//! the output quotes the prompt).

mod common;
mod support;

use pagoda::engine::spec_decode::{SpecStats, SpeculativeConfig};
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use support::batching::batched_with as batched;
use support::chi2::assert_same_distributions;

const MAX_TOKENS: usize = 40;

fn args(spec: Option<&str>) -> EngineArgs {
    let mut a = EngineArgs::new(common::demo_gguf());
    a.threads = 2;
    a.max_model_len = Some(512);
    a.kv_cache_memory = Some(64 << 20);
    a.speculative = spec.map(|s| SpeculativeConfig::from_json(s).expect("config"));
    a
}

/// Drafts for every sequence of a 32-sequence batch.
const NGRAM: &str = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 64}"#;

/// 32 prompts: most ask to repeat a passage (the n-gram proposer's best
/// case, so many drafts hold), others are free text (most drafts fail);
/// several share a prefix.
fn prompts() -> Vec<Prompt> {
    let passages = [
        "The river bends twice before it reaches the old mill, where the water slows and the children fish on summer evenings.",
        "fn add(a: u32, b: u32) -> u32 { a + b }\nfn mul(a: u32, b: u32) -> u32 { a * b }",
        "Tea is grown on hillsides, picked by hand, withered, rolled, oxidized and dried before it is sorted into grades.",
        "Prime numbers have exactly two divisors: one and themselves. Two, three, five, seven and eleven are the first five.",
    ];
    (0..32)
        .map(|i| {
            let p = passages[i % passages.len()];
            let text = match i % 4 {
                3 => format!("Write a short story about number {i}."),
                _ => format!(
                    "Copy this text exactly.\nText: {p}\nCopy: {}",
                    &p[..(i % 3) * 7]
                ),
            };
            Prompt::Text(text)
        })
        .collect()
}

fn greedy() -> SamplingParams {
    let mut p = SamplingParams::greedy(MAX_TOKENS);
    p.ignore_eos = true;
    p
}

fn solo(spec: Option<&str>, prompts: &[Prompt]) -> (Vec<Vec<u32>>, LLM) {
    let mut llm = LLM::new(args(spec)).expect("engine");
    let out = prompts
        .iter()
        .map(|p| {
            llm.generate(std::slice::from_ref(p), &greedy())
                .expect("generate")[0]
                .outputs[0]
                .token_ids
                .clone()
        })
        .collect();
    (out, llm)
}

#[test]
fn greedy_output_is_unchanged_by_ngram_speculation() {
    let stats = greedy_output_is_unchanged_by(NGRAM);
    // Quoting a passage is what prompt lookup is for: most drafts hold.
    let rate = stats.acceptance_rate().unwrap_or(0.0);
    assert!(rate > 0.4, "acceptance rate {rate} ({stats:?})");
}

#[test]
fn a_draft_model_equal_to_the_target_accepts_every_draft() {
    let config = format!(
        r#"{{"model": {:?}, "num_speculative_tokens": 4, "disable_by_batch_size": 64}}"#,
        common::demo_gguf()
    );
    let stats = greedy_output_is_unchanged_by(&config);
    assert_eq!(
        stats.num_accepted_tokens, stats.num_draft_tokens,
        "{stats:?}"
    );
}

/// Every prompt of [`prompts`] gives token for token its plain greedy
/// output under speculative decoding `config`: alone, in one batch of 32
/// with prefix caching, and chunked over a pool small enough to preempt.
/// Returns the solo run's speculation counters.
fn greedy_output_is_unchanged_by(config: &str) -> SpecStats {
    let prompts = prompts();
    let (plain, llm) = solo(None, &prompts);
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| llm.encode(p).expect("encode"))
        .collect();
    drop(llm);
    let (spec, llm) = solo(Some(config), &prompts);
    for (i, (s, p)) in spec.iter().zip(&plain).enumerate() {
        assert_eq!(s, p, "alone: prompt {i} differs with speculation");
    }
    let solo_stats = llm.engine().stats().spec;
    assert!(
        solo_stats.num_drafts > 0 && solo_stats.num_accepted_tokens > 0,
        "{solo_stats:?}"
    );
    // A draft model's pool takes its share of the budget: the small pool
    // below is sized in this engine's blocks.
    let bytes_per_block = (64usize << 20) / llm.engine().kv_cache().pool().num_blocks();
    drop(llm);

    let conditions: Vec<(&str, EngineArgs)> = vec![
        ("one batch of 32, prefix caching", args(Some(config))),
        ("chunked prefill (48-token steps), a 24-block pool", {
            let mut a = args(Some(config));
            a.max_num_batched_tokens = 48;
            // 24 blocks of 16 tokens: a few sequences fill the pool,
            // and their decodes (and drafts) then need blocks that are not
            // there.
            a.max_model_len = Some(320);
            a.kv_cache_memory = Some(24 * bytes_per_block as u64);
            a
        }),
    ];
    let params = vec![greedy(); prompts.len()];
    for (name, a) in conditions {
        let (got, llm) = batched(a, &ids, &params);
        for (i, (g, p)) in got.iter().zip(&plain).enumerate() {
            assert_eq!(g, p, "{name}: prompt {i} differs from plain decoding");
        }
        let stats = llm.engine().stats();
        assert!(
            stats.spec.num_accepted_tokens > 0,
            "{name}: {:?}",
            stats.spec
        );
        if name.starts_with("chunked") {
            assert!(
                stats.num_preemptions > 0,
                "{name}: the small pool should preempt ({stats:?})"
            );
        } else {
            assert!(
                stats.prefix.hits > 0,
                "{name}: shared prefixes should hit the cache"
            );
        }
    }
    solo_stats
}

#[test]
fn sampled_tokens_follow_the_target_distribution() {
    // One prompt whose pattern the proposer follows but the model only
    // half believes, drawn 3000 times with temperature 1, each draw seeded:
    // the 2nd to 5th tokens (verified drafts, or corrections drawn from
    // the residual) must be distributed as plain sampling's.
    let llm = LLM::new(args(None)).expect("engine");
    let prompt = llm
        .encode(&Prompt::Text(
            "Colors: red, blue, red, green, red, yellow, red, green, red, blue, red,".into(),
        ))
        .expect("encode");
    drop(llm);
    let draws = 3000;
    let prompts = vec![prompt; draws];
    let params: Vec<SamplingParams> = (0..draws as u64)
        .map(|seed| {
            let mut p = SamplingParams::greedy(6);
            p.temperature = Some(1.0);
            p.seed = Some(seed);
            p.ignore_eos = true;
            p
        })
        .collect();
    let counts = |spec: Option<&str>| {
        let mut a = args(spec);
        a.max_num_seqs = 64;
        let (out, llm) = batched(a, &prompts, &params);
        let mut by_pos = vec![std::collections::HashMap::<u32, f64>::new(); 4];
        for o in &out {
            for (pos, m) in by_pos.iter_mut().enumerate() {
                *m.entry(o[pos + 1]).or_insert(0.0) += 1.0;
            }
        }
        (by_pos, llm.engine().stats().spec)
    };
    let (plain, _) = counts(None);
    let (spec, stats) = counts(Some(
        r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2, "disable_by_batch_size": 64}"#,
    ));
    // Both outcomes of verification happened many times.
    assert!(stats.num_draft_tokens > 1000, "{stats:?}");
    assert!(stats.num_accepted_tokens > 300, "{stats:?}");
    assert!(
        stats.num_draft_tokens - stats.num_accepted_tokens > 100,
        "{stats:?}"
    );
    assert_same_distributions(&plain, &spec, 2);
}
