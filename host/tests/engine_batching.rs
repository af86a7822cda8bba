//! The batched engine on the demo model: batching, chunked prefill,
//! preemption and prefix caching must not change any greedy output, and
//! every block must come back to the pool.

mod common;

use pagoda::engine::core::RequestOptions;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};

const MAX_TOKENS: usize = 12;

fn args() -> EngineArgs {
    let mut a = EngineArgs::new(common::demo_gguf());
    a.threads = 2;
    a.max_model_len = Some(512);
    a.kv_cache_memory = Some(64 << 20);
    a
}

/// 32 prompts of mixed lengths (4 to ~150 tokens), some sharing prefixes.
fn prompts() -> Vec<Prompt> {
    let topics = [
        "the ocean",
        "a compiler",
        "Paris",
        "prime numbers",
        "tea",
        "a violin",
        "rain",
        "Rust",
    ];
    (0..32)
        .map(|i| {
            let topic = topics[i % topics.len()];
            let mut p = format!("Write about {topic}.");
            for k in 0..(i * 7) % 23 {
                p.push_str(&format!(
                    " Sentence {k} about {topic} goes on a little longer."
                ));
            }
            Prompt::Text(p)
        })
        .collect()
}

fn solo_outputs(prompts: &[Prompt]) -> Vec<Vec<u32>> {
    let mut llm = LLM::new(args()).expect("engine");
    let params = SamplingParams::greedy(MAX_TOKENS);
    prompts
        .iter()
        .map(|p| {
            llm.generate(std::slice::from_ref(p), &params)
                .expect("generate")[0]
                .outputs[0]
                .token_ids
                .clone()
        })
        .collect()
}

/// Runs all prompts together, stepping the engine by hand so the KV
/// accounting can be checked after every step.
fn batched_outputs(a: EngineArgs, prompts: &[Prompt]) -> (Vec<Vec<u32>>, LLM) {
    let mut llm = LLM::new(a).expect("engine");
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| llm.encode(p).expect("encode"))
        .collect();
    let core = llm.engine_mut();
    let mut engine_ids = Vec::new();
    for (i, p) in ids.into_iter().enumerate() {
        engine_ids.push(
            core.add_request(
                format!("p{i}"),
                p,
                SamplingParams::greedy(MAX_TOKENS),
                RequestOptions::default(),
            )
            .expect("add"),
        );
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); engine_ids.len()];
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            let i = engine_ids
                .iter()
                .position(|&e| e == o.id)
                .expect("known request");
            out[i].extend_from_slice(&o.new_token_ids);
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    (out, llm)
}

fn assert_pool_clean(llm: &LLM) {
    let kv = llm.engine().kv_cache();
    assert_eq!(
        kv.pool().num_free(),
        kv.pool().num_blocks(),
        "blocks leaked"
    );
    assert_eq!(kv.num_seqs(), 0);
    kv.pool().check_invariants().expect("pool invariants");
}

#[test]
fn batching_chunking_preemption_and_prefix_caching_change_no_output() {
    let prompts = prompts();
    let solo = solo_outputs(&prompts);

    let conditions: Vec<(&str, EngineArgs)> = vec![
        ("prefix caching on", args()),
        ("prefix caching off", {
            let mut a = args();
            a.enable_prefix_caching = false;
            a
        }),
        ("chunked prefill (64-token steps)", {
            let mut a = args();
            a.max_num_batched_tokens = 64;
            a
        }),
        ("preemption (20-block pool)", {
            let mut a = args();
            // 20 blocks of 16 tokens (320 tokens): a few sequences fill the
            // pool, and their decodes then need blocks that are not there.
            let per_block = 2 * 30 * 16 * 192 * 2;
            a.max_model_len = Some(320);
            a.kv_cache_memory = Some(20 * per_block);
            a
        }),
    ];
    for (name, a) in conditions {
        let (got, llm) = batched_outputs(a, &prompts);
        for (i, (g, s)) in got.iter().zip(&solo).enumerate() {
            assert_eq!(g, s, "{name}: prompt {i} differs from its solo run");
        }
        if name.starts_with("preemption") {
            assert!(
                llm.engine().stats().num_preemptions > 0,
                "the small pool should force preemption"
            );
        }
        if name.starts_with("chunked") {
            assert!(
                llm.engine().stats().steps > 32,
                "64-token steps should chunk the prompts"
            );
        }
        assert_pool_clean(&llm);
    }
}

#[test]
fn aborted_requests_free_their_blocks_at_once() {
    let mut llm = LLM::new(args()).expect("engine");
    let tok = llm.tokenizer().clone();
    let core = llm.engine_mut();
    let mut ids = Vec::new();
    for i in 0..8 {
        let prompt = tok
            .encode(
                &format!("Count to {i} and then keep counting forever:"),
                true,
            )
            .expect("encode");
        ids.push(
            core.add_request(
                format!("r{i}"),
                prompt,
                SamplingParams::greedy(64),
                RequestOptions::default(),
            )
            .expect("add"),
        );
    }
    for _ in 0..3 {
        core.step().expect("a step");
    }
    assert!(core.kv_cache().pool().num_free() < core.kv_cache().pool().num_blocks());
    for &id in &ids {
        assert!(core.abort(id).is_some());
    }
    assert_eq!(
        core.kv_cache().pool().num_free(),
        core.kv_cache().pool().num_blocks()
    );
    core.kv_cache()
        .pool()
        .check_invariants()
        .expect("pool invariants");
    assert!(!core.has_unfinished());
}

#[test]
fn a_shared_long_prefix_is_computed_once_and_only_within_a_salt() {
    let mut a = args();
    a.max_model_len = Some(1200);
    let mut llm = LLM::new(a).expect("engine");
    let tok = llm.tokenizer().clone();
    let mut prefix = String::new();
    while tok.encode(&prefix, true).expect("encode").len() < 1000 {
        prefix.push_str("Pagoda serves many tenants from one fleet of accelerators. ");
    }
    let core = llm.engine_mut();
    let run = |core: &mut pagoda::engine::core::EngineCore, text: String, salt: u64| {
        let ids = tok.encode(&text, true).expect("encode");
        let n = ids.len();
        let id = core
            .add_request(
                text.clone(),
                ids,
                SamplingParams::greedy(2),
                RequestOptions {
                    cache_salt: salt,
                    ..Default::default()
                },
            )
            .expect("add");
        let mut cached = None;
        while core.has_unfinished() {
            for o in core.step().expect("a step") {
                if o.id == id && o.finish_reason.is_some() {
                    cached = Some(o.num_cached_tokens);
                }
            }
        }
        (n, cached.expect("finished"))
    };
    let (_, first) = run(core, format!("{prefix} First question?"), 1);
    assert_eq!(first, 0);
    let before = core.stats().prefix;
    let (n, second) = run(core, format!("{prefix} Second, different question?"), 1);
    let after = core.stats().prefix;
    assert!(
        second >= 992,
        "only {second} of {n} prompt tokens came from the cache"
    );
    assert_eq!(after.hits - before.hits, second as u64);
    assert_eq!(after.queries - before.queries, n as u64);
    // The same prefix under another salt (another tenant) shares nothing.
    let (_, other_salt) = run(core, format!("{prefix} Second, different question?"), 2);
    assert_eq!(other_salt, 0);
}

#[test]
fn samples_of_one_prompt_share_its_blocks() {
    let mut llm = LLM::new(args()).expect("engine");
    let prompt = Prompt::Text("Sharing is caring. ".repeat(20));
    let n_tokens = llm.encode(&prompt).expect("encode").len();
    let params = SamplingParams {
        n: 4,
        temperature: Some(0.8),
        seed: Some(3),
        max_tokens: Some(4),
        ..Default::default()
    };
    let out = llm.generate(&[prompt], &params).expect("generate");
    assert_eq!(out[0].outputs.len(), 4);
    // The first sample computes the prompt; the other three wait while its
    // blocks are in flight, then find them all in the prefix cache.
    let full_blocks = (n_tokens - 1) / 16 * 16;
    assert_eq!(llm.engine().stats().prefix.hits, 3 * full_blocks as u64);
    assert_pool_clean(&llm);
}

/// Constrained and unconstrained sequences in one batch, under a KV pool
/// small enough to preempt: the unconstrained ones give exactly what they
/// give alone (the mask thread beside the forward changes nothing), every
/// constrained one matches its regex and ends as soon as its grammar is
/// complete, and every block comes back.
#[test]
fn constrained_sequences_batch_with_free_ones_and_survive_preemption() {
    use pagoda::engine::structured_output::{GrammarCompiler, OutputConstraint, StructuredOutputs};
    let prompts = prompts();
    let free: Vec<Prompt> = prompts.iter().step_by(2).cloned().collect();
    let solo = solo_outputs(&free);
    let mut a = args();
    // The 20-block pool of the preemption case above.
    let per_block = 2 * 30 * 16 * 192 * 2;
    a.max_model_len = Some(320);
    a.kv_cache_memory = Some(20 * per_block);
    let mut llm = LLM::new(a).expect("engine");
    let tok = llm.tokenizer().clone();
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| llm.encode(p).expect("encode"))
        .collect();
    let core = llm.engine_mut();
    let compiler = GrammarCompiler::new(
        tok.clone(),
        core.eos_ids(),
        core.runner().config().vocab_size,
    )
    .expect("compiler");
    let regex = r" ?[A-Z][a-z]+ [0-9]{2}";
    let spec = StructuredOutputs::new(OutputConstraint::Regex(regex.into()));
    let mut engine_ids = Vec::new();
    for (i, ids) in encoded.into_iter().enumerate() {
        let constrained = i % 2 == 1;
        let opts = RequestOptions {
            grammar: constrained.then(|| compiler.compile(&spec).expect("compile")),
            ..Default::default()
        };
        engine_ids.push((
            core.add_request(
                format!("p{i}"),
                ids,
                SamplingParams::greedy(MAX_TOKENS),
                opts,
            )
            .expect("add"),
            constrained,
        ));
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); engine_ids.len()];
    let mut finish = vec![None; engine_ids.len()];
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            let i = engine_ids
                .iter()
                .position(|&(e, _)| e == o.id)
                .expect("known");
            out[i].extend_from_slice(&o.new_token_ids);
            if o.finish_reason.is_some() {
                finish[i] = o.finish_reason;
            }
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    assert!(
        core.stats().num_preemptions > 0,
        "the pool should be small enough to preempt"
    );
    let rx = regex_lite(regex);
    let mut free_outputs = Vec::new();
    for (i, &(_, constrained)) in engine_ids.iter().enumerate() {
        if constrained {
            let text = tok.decode(&out[i], true).expect("decode");
            assert!(rx(&text), "prompt {i}: {text:?} does not match {regex}");
            assert_eq!(
                finish[i],
                Some(pagoda::engine::FinishReason::Stop),
                "prompt {i}"
            );
        } else {
            free_outputs.push(out[i].clone());
        }
    }
    assert_eq!(free_outputs, solo);
    assert_pool_clean(&llm);
}

/// A matcher for the test's one regex, ` ?[A-Z][a-z]+ [0-9]{2}`, written
/// out by hand so the check does not share the engine's regex machinery.
fn regex_lite(_: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        let s = s.strip_prefix(' ').unwrap_or(s);
        let Some((word, num)) = s.split_once(' ') else {
            return false;
        };
        let mut chars = word.chars();
        chars.next().is_some_and(|c| c.is_ascii_uppercase())
            && word.len() >= 2
            && chars.all(|c| c.is_ascii_lowercase())
            && num.len() == 2
            && num.chars().all(|c| c.is_ascii_digit())
    }
}
