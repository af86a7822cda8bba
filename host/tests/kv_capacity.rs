//! KV-cache capacity per tenant: a tenant's reservation keeps its cached
//! prefix through another tenant's flood of unique prompts, and a cap
//! bounds what one tenant may hold, while tenants without either share
//! the pool least-recently-used first as before.
//!
//! The engine is stepped by hand; what is checked is the prefix cache's
//! answer (`num_cached_tokens`) and the pool's per-tenant counts, never
//! timing.

mod support;

use pagoda::engine::core::{EngineCore, RequestOptions};
use pagoda::engine::fair_share::{KvShare, TenantShare};
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::scheduler::SchedulingPolicy;
use pagoda::engine::{EngineArgs, SamplingParams, LLM};
use std::path::Path;
use support::tiny_model::{Storage, TinyModel, TinySpec};

const MAX_MODEL_LEN: usize = 128;
/// K and V of 2 layers, 2 KV heads of 16, in f32.
const BYTES_PER_TOKEN: u64 = 2 * 2 * 2 * 16 * 4;
const BLOCK: usize = 16;
/// The pool: 40 blocks of 16 tokens.
const BLOCKS: usize = 40;

fn engine(dir: &Path) -> LLM {
    let m = dir.join("model");
    if !m.exists() {
        TinyModel::random(TinySpec::llama()).write_hf(&m, Storage::F32, 1);
    }
    let mut a = EngineArgs::new(&m);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_memory = Some((BLOCKS * BLOCK) as u64 * BYTES_PER_TOKEN);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.enable_prefix_caching = true;
    a.scheduling_policy = SchedulingPolicy::Fair;
    LLM::new(a).unwrap_or_else(|e| panic!("LLM::new: {e:#}"))
}

fn tenant(name: &str, kv: Option<KvShare>) -> RequestOptions {
    RequestOptions {
        tenant: TenantShare {
            name: name.into(),
            weight: 1,
            priority_class: 0,
            kv,
        },
        ..Default::default()
    }
}

/// Runs `prompts` to the end, `concurrent` at a time; returns each one's
/// cached prompt tokens.
fn run(
    core: &mut EngineCore,
    prompts: &[Vec<u32>],
    opts: &RequestOptions,
    concurrent: usize,
) -> Vec<usize> {
    let mut p = SamplingParams::greedy(4);
    p.ignore_eos = true;
    let mut cached = vec![0; prompts.len()];
    let mut ids = Vec::new();
    let mut next = 0;
    let mut done = 0;
    while done < prompts.len() {
        while next < prompts.len() && ids.len() - done < concurrent {
            let id = core
                .add_request(
                    format!("r{next}"),
                    prompts[next].clone(),
                    p.clone(),
                    opts.clone(),
                )
                .unwrap_or_else(|e| panic!("add_request: {}", e.message));
            ids.push(id);
            next += 1;
        }
        for o in core.step().expect("step") {
            let i = ids.iter().position(|&id| id == o.id).expect("our request");
            if o.finish_reason.is_some() {
                cached[i] = o.num_cached_tokens;
                done += 1;
            }
        }
        core.kv_cache()
            .pool()
            .check_invariants()
            .expect("pool invariants");
    }
    cached
}

/// A calm tenant's 96-token prompt (6 blocks), then a flood of 30 unique
/// 64-token prompts (4 blocks each, 120 blocks in all: three times the
/// pool), then the calm prompt again: the tokens it finds cached.
fn calm_after_flood(core: &mut EngineCore, calm: &RequestOptions) -> usize {
    let prompt: Vec<u32> = (0..96).map(|i| 3 + (i * 7 % 40) as u32).collect();
    let first = run(core, std::slice::from_ref(&prompt), calm, 1);
    assert_eq!(first, vec![0], "a cold cache has nothing");
    let flood: Vec<Vec<u32>> = (0..30u32)
        .map(|r| {
            (0..64)
                .map(|i| 3 + (r * 31 + i * 7 + i * i * r) % 70)
                .collect()
        })
        .collect();
    run(core, &flood, &tenant("flood", None), 4);
    run(core, std::slice::from_ref(&prompt), calm, 1)[0]
}

#[test]
fn a_reservation_keeps_a_calm_tenants_prefix_through_a_flood() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Without a reservation the flood evicts the calm prefix.
    let mut llm = engine(dir.path());
    let lost = calm_after_flood(llm.engine_mut(), &tenant("calm", None));
    assert_eq!(
        lost, 0,
        "without a reservation the flood should evict the prefix"
    );
    // With a quarter of the pool reserved (10 blocks) the six blocks stay:
    // the whole prompt but its last, partial-or-final block is a hit.
    let mut llm = engine(dir.path());
    let share = KvShare {
        reserved_permille: 250,
        max_permille: 1000,
    };
    let kept = calm_after_flood(llm.engine_mut(), &tenant("calm", Some(share)));
    assert!(
        kept >= 80,
        "with a reservation {kept} of 96 tokens were cached"
    );
    let usage = llm.engine().kv_cache().owner_usage();
    let calm = usage
        .iter()
        .find(|(n, _)| &**n == "calm")
        .expect("calm counted");
    assert_eq!(calm.1.evicted_by_others, 0, "{usage:?}");
}

#[test]
fn a_cap_bounds_what_one_tenant_holds_and_the_rest_stays_for_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut llm = engine(dir.path());
    let core = llm.engine_mut();
    // The flood may hold a quarter of the pool at most (10 blocks, above
    // the 8 of one longest request).
    let capped = tenant(
        "flood",
        Some(KvShare {
            reserved_permille: 0,
            max_permille: 250,
        }),
    );
    let flood: Vec<Vec<u32>> = (0..12u32)
        .map(|r| (0..64).map(|i| 3 + (r * 11 + i * 3) % 40).collect())
        .collect();
    let mut p = SamplingParams::greedy(8);
    p.ignore_eos = true;
    for (i, prompt) in flood.iter().enumerate() {
        core.add_request(format!("f{i}"), prompt.clone(), p.clone(), capped.clone())
            .unwrap_or_else(|e| panic!("add_request: {}", e.message));
    }
    let mut most = 0;
    while core.has_unfinished() {
        core.step().expect("step");
        let usage = core.kv_cache().owner_usage();
        let held = usage
            .iter()
            .find(|(n, _)| &**n == "flood")
            .map_or(0, |u| u.1.blocks);
        most = most.max(held);
        assert!(held <= 10, "the capped tenant holds {held} blocks");
        core.kv_cache()
            .pool()
            .check_invariants()
            .expect("pool invariants");
    }
    assert!(most >= 8, "the cap should be reached ({most})");
    // Another tenant's prompt runs beside a capped flood without waiting
    // for it: submitted together, the calm request finishes first.
    for (i, prompt) in flood.iter().enumerate() {
        core.add_request(format!("g{i}"), prompt.clone(), p.clone(), capped.clone())
            .unwrap_or_else(|e| panic!("add_request: {}", e.message));
    }
    let calm_prompt: Vec<u32> = (0..64).map(|i| 5 + (i * 3 % 30) as u32).collect();
    let calm = core
        .add_request("calm".into(), calm_prompt, p.clone(), tenant("calm", None))
        .unwrap_or_else(|e| panic!("add_request: {}", e.message));
    let mut finished = Vec::new();
    while core.has_unfinished() {
        for o in core.step().expect("step") {
            if o.finish_reason.is_some() {
                finished.push(o.id);
            }
        }
    }
    let at = finished
        .iter()
        .position(|&id| id == calm)
        .expect("calm finished");
    assert!(
        at < 6,
        "the calm request finished {at}th of {}",
        finished.len()
    );
}
