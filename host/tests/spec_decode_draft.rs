//! Speculative decoding with a draft model, on scripts/make-fixtures.py's
//! tiny checkpoints (which share one tokenizer): whether the draft agrees
//! with the target almost always (its own Q8_0 copy) or hardly ever (an
//! unrelated model), 16 prompts batched with prefix caching, and chunked
//! over a pool small enough to preempt, give exactly the plain engine's
//! solo greedy outputs. A draft with another vocabulary is refused.

mod common;
mod support;

use pagoda::engine::spec_decode::SpeculativeConfig;
use pagoda::engine::{EngineArgs, LLM};
use std::path::Path;
use support::batching::batch_changes_nothing_with;
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
