//! Speculative decoding with a draft model, on scripts/make-fixtures.py's
//! tiny checkpoints (which share one tokenizer): whether the draft agrees
//! with the target almost always (its own Q8_0 copy) or hardly ever (an
//! unrelated model), 16 prompts batched with prefix caching, and chunked
//! over a pool small enough to preempt, give exactly the plain engine's
//! solo greedy outputs; and drafts sampled from the draft model's own
//! distribution leave sampled output distributed as plain sampling's. A
//! draft with another vocabulary is refused.

mod common;
mod support;

use pagoda::engine::core::RequestOptions;
use pagoda::engine::spec_decode::SpeculativeConfig;
use pagoda::engine::{EngineArgs, SamplingParams, LLM};
use std::collections::HashMap;
use std::path::Path;
use support::batching::batch_changes_nothing_with;
use support::chi2::assert_same_distributions;
use support::fixtures::fixtures;

fn with_draft(draft: &Path) -> impl Fn(&mut EngineArgs) {
    let json = format!(
        r#"{{"model": {:?}, "num_speculative_tokens": 3, "disable_by_batch_size": 64}}"#,
        draft
    );
    move |a: &mut EngineArgs| {
        a.speculative = Some(SpeculativeConfig::from_json(&json).expect("config"));
    }
}

#[test]
fn draft_models_that_agree_or_not_change_no_greedy_output() {
    let dir = fixtures();
    let target = dir.join("llama3/model-F32.gguf");
    let own_copy = dir.join("llama3/model-Q8_0.gguf");
    let unrelated = dir.join("qwen3/model-F32.gguf");
    for stats in batch_changes_nothing_with(
        &target,
        "llama3 drafted by its Q8_0 copy",
        with_draft(&own_copy),
    ) {
        let rate = stats.spec.acceptance_rate().unwrap_or(0.0);
        assert!(
            rate > 0.5,
            "its own Q8_0 copy should mostly agree: {:?}",
            stats.spec
        );
    }
    for stats in
        batch_changes_nothing_with(&target, "llama3 drafted by qwen3", with_draft(&unrelated))
    {
        let s = stats.spec;
        assert!(
            s.num_drafts > 0 && s.num_accepted_tokens < s.num_draft_tokens,
            "an unrelated draft should be rejected often: {s:?}"
        );
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    // The demo model's 49152 tokens against the fixtures' 320.
    let target = fixtures().join("llama3/model-F32.gguf");
    let mut a = EngineArgs::new(&target);
    a.threads = 2;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(16 << 20);
    with_draft(&common::demo_gguf())(&mut a);
    let e = format!("{:#}", LLM::new(a).err().expect("refused"));
    assert!(e.contains("must share the model's tokenizer"), "{e}");
}

/// Token frequencies at output positions 1..=3 of `draws` seeded samples
/// (at `temperature`, top-k 40) of one prompt on `a`'s engine, with the
/// engine's speculation counters.
fn sampled_frequencies(
    a: EngineArgs,
    draws: u64,
    temperature: f32,
) -> (
    Vec<HashMap<u32, f64>>,
    pagoda::engine::spec_decode::SpecStats,
) {
    let mut llm = LLM::new(a).expect("engine");
    let core = llm.engine_mut();
    let prompt: Vec<u32> = (0..12u32).map(|i| 3 + (i * 37 + 11) % 300).collect();
    let mut ids = Vec::new();
    for seed in 0..draws {
        let mut p = SamplingParams::greedy(4);
        p.temperature = Some(temperature);
        p.top_k = Some(40);
        p.seed = Some(seed);
        p.ignore_eos = true;
        ids.push(
            core.add_request(
                format!("d{seed}"),
                prompt.clone(),
                p,
                RequestOptions::default(),
            )
            .expect("add"),
        );
    }
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            out.entry(o.id)
                .or_default()
                .extend_from_slice(&o.new_token_ids);
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    let mut by_pos = vec![HashMap::new(); 3];
    for id in ids {
        let o = &out[&id];
        for (pos, m) in by_pos.iter_mut().enumerate() {
            *m.entry(o[pos + 1]).or_insert(0.0) += 1.0;
        }
    }
    (by_pos, llm.engine().stats().spec)
}

#[test]
fn sampled_drafts_keep_the_target_distribution() {
    // llama3 drafted by the unrelated qwen3, drafts drawn from qwen3's own
    // distribution (`draft_sample_method` probabilistic): verification
    // divides by it, so the tokens must still follow llama3's (with its
    // top-k), as plain sampling draws them.
    let dir = fixtures();
    let args = |spec: Option<String>| {
        let mut a = EngineArgs::new(dir.join("llama3/model-F32.gguf"));
        a.threads = 2;
        a.max_model_len = Some(128);
        a.kv_cache_memory = Some(64 << 20);
        a.max_num_seqs = 64;
        a.speculative = spec.map(|s| SpeculativeConfig::from_json(&s).expect("config"));
        a
    };
    let draws = 3000;
    // A high temperature makes the two tiny random models' distributions
    // overlap enough for both outcomes of verification to be common.
    let t = 4.0;
    let (plain, _) = sampled_frequencies(args(None), draws, t);
    let (spec, stats) = sampled_frequencies(
        args(Some(format!(
            r#"{{"model": {:?}, "num_speculative_tokens": 2, "draft_sample_method": "probabilistic", "disable_by_batch_size": 64}}"#,
            dir.join("qwen3/model-F32.gguf")
        ))),
        draws,
        t,
    );
    // Both outcomes of verification happened many times.
    assert!(stats.num_accepted_tokens > 300, "{stats:?}");
    assert!(
        stats.num_draft_tokens - stats.num_accepted_tokens > 300,
        "{stats:?}"
    );
    assert_same_distributions(&plain, &spec, 2);
}
