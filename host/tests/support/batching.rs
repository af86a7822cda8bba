//! Batching must not change a greedy output: 16 prompts of mixed lengths
//! (some sharing prefixes) run together, with prefix caching, and again in
//! small chunks over a pool small enough to preempt, must each give exactly
//! what they give alone.

use pagoda::engine::core::RequestOptions;
use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use std::path::Path;

const MAX_TOKENS: usize = 24;

fn params() -> SamplingParams {
    let mut p = SamplingParams::greedy(MAX_TOKENS);
    p.ignore_eos = true;
    p
}

fn args(model: &Path) -> EngineArgs {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(16 << 20);
    a
}

/// 16 prompts of 3 to 70 tokens below `vocab`; every other one opens with one of two
/// 20-token prefixes, so the prefix cache has something to share.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let ids = vocab - 3;
    let prefix = |k: u32| -> Vec<u32> { (0..20).map(|i| 3 + (k * 131 + i * 17) % ids).collect() };
    (0..16u32)
        .map(|i| {
            let mut p = if i % 2 == 0 {
                prefix(i % 4 / 2)
            } else {
                Vec::new()
            };
            let len = 3 + (i * 29) % 50;
            p.extend((0..len).map(|j| 3 + (i * 37 + j * 53 + 7) % ids));
            p
        })
        .collect()
}

fn solo(model: &Path, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut llm = LLM::new(args(model)).expect("engine");
    prompts
        .iter()
        .map(|p| {
            llm.generate(&[Prompt::Tokens(p.clone())], &params())
                .expect("generate")[0]
                .outputs[0]
                .token_ids
                .clone()
        })
        .collect()
}

fn batched(a: EngineArgs, prompts: &[Vec<u32>]) -> (Vec<Vec<u32>>, LLM) {
    batched_with(a, prompts, &vec![params(); prompts.len()])
}

/// Runs every prompt at once (prompt `i` with `params[i]`), stepping by
/// hand so the KV accounting is checked after every step, and checks that
/// every block came back to the pool. Returns each prompt's output ids.
pub fn batched_with(
    a: EngineArgs,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
) -> (Vec<Vec<u32>>, LLM) {
    let mut llm = LLM::new(a).expect("engine");
    let core = llm.engine_mut();
    let ids: Vec<u64> = prompts
        .iter()
        .zip(params)
        .enumerate()
        .map(|(i, (p, sp))| {
            core.add_request(
                format!("p{i}"),
                p.clone(),
                sp.clone(),
                RequestOptions::default(),
            )
            .expect("add")
        })
        .collect();
    let mut out = vec![Vec::new(); ids.len()];
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            let i = ids.iter().position(|&e| e == o.id).expect("known request");
            out[i].extend_from_slice(&o.new_token_ids);
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    let kv = llm.engine().kv_cache();
    assert_eq!(
        kv.pool().num_free(),
        kv.pool().num_blocks(),
        "blocks leaked"
    );
    kv.pool().check_invariants().expect("pool invariants");
    let (slots, free) = kv.state_slot_usage();
    assert_eq!(free, slots, "recurrent-state slots leaked");
    (out, llm)
}

pub fn batch_changes_nothing(model: &Path, what: &str) {
    batch_changes_nothing_with(model, what, |_| {});
}

/// [`batch_changes_nothing`] with the batched engines configured further
/// by `configure` (speculative decoding, say): their outputs must still
/// equal the plain engine's solo outputs. Returns the batched engines'
/// stats, in condition order.
pub fn batch_changes_nothing_with(
    model: &Path,
    what: &str,
    configure: impl Fn(&mut EngineArgs),
) -> Vec<pagoda::engine::core::EngineStats> {
    // The pool's bytes per block (a draft model's included), from the
    // blocks a known budget gave.
    let mut probe_args = args(model);
    configure(&mut probe_args);
    let probe = LLM::new(probe_args).expect("engine");
    let prompts = prompts(probe.engine().runner().config().vocab_size as u32);
    let alone = solo(model, &prompts);
    // A hybrid model's recurrent state (one slot per --max-num-seqs) comes
    // out of the same budget before the blocks do.
    // With prefix caching, as many checkpoints of it again.
    let a = args(model);
    let slots = a.max_num_seqs * if a.enable_prefix_caching { 2 } else { 1 };
    let state = probe.engine().runner().state_bytes_per_seq() * slots;
    let hybrid = state > 0;
    let per_block = ((16usize << 20) - state) / probe.engine().kv_cache().pool().num_blocks();
    drop(probe);
    let conditions: Vec<(&str, EngineArgs)> = vec![
        ("one batch, prefix caching", args(model)),
        ("chunked prefill (16-token steps) and a 12-block pool", {
            let mut a = args(model);
            a.max_num_batched_tokens = 16;
            a.kv_cache_memory = Some((12 * per_block + state) as u64);
            a.max_model_len = Some(12 * a.block_size);
            a
        }),
    ];
    let mut all = Vec::new();
    for (name, mut a) in conditions {
        configure(&mut a);
        let (got, llm) = batched(a, &prompts);
        for (i, (g, s)) in got.iter().zip(&alone).enumerate() {
            assert_eq!(g, s, "{what}, {name}: prompt {i} differs from its solo run");
        }
        let stats = llm.engine().stats();
        if name.starts_with("chunked") {
            assert!(
                stats.num_preemptions > 0,
                "{what}: the small pool should preempt"
            );
        } else if !hybrid {
            // A hybrid model's hits end where a step ended (its linear
            // layers' state is checkpointed there): these prompts share 20
            // tokens, less than any of their first chunks.
            assert!(
                stats.prefix.hits > 0,
                "{what}: the shared prefixes should hit the cache"
            );
        }
        all.push(stats);
    }
    all
}
