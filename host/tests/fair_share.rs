//! Fair share between tenants, through the engine's library API on a tiny
//! random model: a flooding tenant does not hold back another tenant's
//! first token, weights split throughput, preemption takes from the
//! tenant over its share, and one tenant is scheduled exactly as FCFS.

mod support;

use pagoda::engine::core::{EngineCore, RequestOptions};
use pagoda::engine::fair_share::TenantShare;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::scheduler::SchedulingPolicy;
use pagoda::engine::{EngineArgs, SamplingParams, LLM};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use support::tiny_model::{Storage, TinyModel, TinySpec};

const MAX_MODEL_LEN: usize = 128;

fn model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    TinyModel::random(TinySpec::llama()).write_hf(&m, Storage::F32, 1);
    m
}

fn engine(model: &Path, policy: SchedulingPolicy, max_num_seqs: usize, kv_bytes: u64) -> LLM {
    let mut a = EngineArgs::new(model);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_memory = Some(kv_bytes);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.max_num_seqs = max_num_seqs;
    a.scheduling_policy = policy;
    LLM::new(a).unwrap_or_else(|e| panic!("LLM::new: {e:#}"))
}

fn tenant(name: &str, weight: u32) -> RequestOptions {
    RequestOptions {
        tenant: TenantShare {
            name: name.into(),
            weight,
            priority_class: 0,
            kv: None,
        },
        ..Default::default()
    }
}

/// Greedy, ignoring EOS: every request runs to `max_tokens`.
fn params(max_tokens: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(max_tokens);
    p.ignore_eos = true;
    p
}

fn add(
    core: &mut EngineCore,
    id: &str,
    prompt_len: usize,
    max_tokens: usize,
    opts: RequestOptions,
) -> u64 {
    // Distinct prompts, so that no two requests share prefix-cache blocks.
    let salt = id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 3 + (i.wrapping_mul(7).wrapping_add(salt)) % 40)
        .collect();
    core.add_request(id.into(), prompt, params(max_tokens), opts)
        .unwrap_or_else(|e| panic!("add {id}: {}", e.message))
}

/// Steps until request `id` gets its first token; returns how many steps
/// that took (checking the KV accounting after each).
fn steps_to_first_token(core: &mut EngineCore, id: u64, limit: usize) -> usize {
    for step in 1..=limit {
        let outs = core.step().expect("step");
        core.check_kv_accounting().expect("kv accounting");
        if outs
            .iter()
            .any(|o| o.id == id && !o.new_token_ids.is_empty())
        {
            return step;
        }
    }
    panic!("request {id} had no token after {limit} steps");
}

/// Tenant A fills the engine (4 sequences) with 16 long requests; tenant B
/// then sends one. Under fair share B's request takes one of A's slots at
/// once; under FCFS it waits for A's queue to drain.
fn flood_then_one(policy: SchedulingPolicy) -> (usize, u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut llm = engine(&m, policy, 4, 4 << 20);
    let core = llm.engine_mut();
    for i in 0..16 {
        add(core, &format!("a{i}"), 8, 40, tenant("a", 1));
    }
    for _ in 0..3 {
        core.step().expect("step");
    }
    let b = add(core, "b", 8, 4, tenant("b", 1));
    let steps = steps_to_first_token(core, b, 1000);
    (steps, core.stats().num_preemptions)
}

#[test]
fn a_flooding_tenant_does_not_hold_back_another_tenants_first_token() {
    let (fair_steps, fair_preemptions) = flood_then_one(SchedulingPolicy::Fair);
    assert_eq!(fair_steps, 1, "under fair share B runs in the next step");
    assert_eq!(
        fair_preemptions, 1,
        "it takes exactly one of A's four slots"
    );
    // The same load under FCFS shows the problem fair share solves: B
    // waits for A's 16 requests of 40 tokens to go through 4 slots.
    let (fcfs_steps, _) = flood_then_one(SchedulingPolicy::Fcfs);
    assert!(
        fcfs_steps > 100,
        "FCFS: B's first token after {fcfs_steps} steps"
    );
}

/// Tokens generated per tenant while both tenants have more work than the
/// engine's 8 sequences hold.
fn generated_under_saturation(weights: (u32, u32)) -> (usize, usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut llm = engine(&m, SchedulingPolicy::Fair, 8, 4 << 20);
    let core = llm.engine_mut();
    let mut owner = HashMap::new();
    for i in 0..40 {
        owner.insert(
            add(core, &format!("a{i}"), 6, 24, tenant("a", weights.0)),
            'a',
        );
        owner.insert(
            add(core, &format!("b{i}"), 6, 24, tenant("b", weights.1)),
            'b',
        );
    }
    let (mut a, mut b) = (0, 0);
    for _ in 0..120 {
        for o in core.step().expect("step") {
            match owner.get(&o.id) {
                Some('a') => a += o.new_token_ids.len(),
                Some(_) => b += o.new_token_ids.len(),
                None => panic!("output of an unknown request {}", o.id),
            }
        }
        core.check_kv_accounting().expect("kv accounting");
    }
    assert!(
        core.stats().num_waiting > 0,
        "both tenants stayed saturated"
    );
    (a, b)
}

#[test]
fn weights_three_to_one_split_throughput_three_to_one_under_saturation() {
    let (a, b) = generated_under_saturation((3, 1));
    let ratio = a as f64 / b as f64;
    assert!(
        (ratio - 3.0).abs() <= 0.3,
        "tokens a {a}, b {b}: ratio {ratio:.2}, not within 10% of 3"
    );
    let (a, b) = generated_under_saturation((1, 1));
    let ratio = a as f64 / b as f64;
    assert!((ratio - 1.0).abs() <= 0.1, "equal weights: a {a}, b {b}");
}

#[test]
fn when_blocks_run_out_the_tenant_over_its_share_is_preempted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    // 512 bytes a token (2 layers, 2 KV heads of 16, K and V in f32): 24
    // blocks of 16 tokens. A's six requests grow to 6 x 64 tokens = all 24.
    let mut llm = engine(&m, SchedulingPolicy::Fair, 64, 24 * 16 * 512);
    let core = llm.engine_mut();
    let mut a_ids = Vec::new();
    for i in 0..6 {
        a_ids.push(add(core, &format!("a{i}"), 8, 56, tenant("a", 1)));
    }
    for _ in 0..50 {
        core.step().expect("step");
        core.check_kv_accounting().expect("kv accounting");
    }
    assert!(
        core.kv_cache().pool().usage() > 0.9,
        "A holds nearly every block"
    );
    let before = core.stats().num_preemptions;
    let b = add(core, "b", 20, 30, tenant("b", 1));
    let steps = steps_to_first_token(core, b, 5);
    assert!(steps <= 2, "B's first token after {steps} steps");
    assert!(
        core.stats().num_preemptions > before,
        "B got its blocks from A"
    );
    // B runs to the end: it is never the victim while A is over its share.
    let mut done = false;
    for _ in 0..200 {
        for o in core.step().expect("step") {
            if o.id == b && o.finish_reason.is_some() {
                assert_eq!(o.num_output_tokens, 30);
                done = true;
            }
        }
        core.check_kv_accounting().expect("kv accounting");
        if done {
            break;
        }
    }
    assert!(done, "B finished");
}

/// The order in which requests finish, step by step, and the preemption
/// count, for one tenant's mixed load on a pool that forces preemption.
fn one_tenant_trace(policy: SchedulingPolicy) -> (Vec<(usize, u64)>, u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut llm = engine(&m, policy, 6, 10 * 16 * 512);
    let core = llm.engine_mut();
    for i in 0..12 {
        add(
            core,
            &format!("r{i}"),
            4 + (i * 5) % 30,
            10 + (i * 3) % 40,
            RequestOptions::default(),
        );
    }
    let mut trace = Vec::new();
    let mut step = 0;
    while core.has_unfinished() {
        step += 1;
        assert!(step < 10_000, "the load finishes");
        for o in core.step().expect("step") {
            if o.finish_reason.is_some() {
                trace.push((step, o.id));
            }
        }
        core.check_kv_accounting().expect("kv accounting");
    }
    (trace, core.stats().num_preemptions)
}

#[test]
fn with_one_tenant_fair_share_schedules_exactly_as_fcfs() {
    let fair = one_tenant_trace(SchedulingPolicy::Fair);
    let fcfs = one_tenant_trace(SchedulingPolicy::Fcfs);
    assert!(fcfs.1 > 0, "the pool is small enough to preempt");
    assert_eq!(fair, fcfs);
}

/// Tenant A's long prompts fill each step's 64-token budget while A is
/// alone. Once tenant B has work too, A's prefills add at most a quarter of
/// the budget (16 tokens) to a step, so the step in flight when B's request
/// comes stays short; B's prompt runs in the next step alone, as on an idle
/// engine, and A's prompts still finish.
#[test]
fn while_tenants_contend_one_tenants_prefills_fill_a_quarter_of_a_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut a = EngineArgs::new(&m);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_memory = Some(4 << 20);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.max_num_seqs = 8;
    a.max_num_batched_tokens = 64;
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("LLM::new: {e:#}"));
    let core = llm.engine_mut();
    let flood: Vec<u64> = (0..3)
        .map(|i| add(core, &format!("a{i}"), 100, 8, tenant("a", 1)))
        .collect();
    core.step().expect("step");
    assert_eq!(
        core.stats().last_step_tokens,
        64,
        "alone, A fills the budget"
    );
    // B decodes for longer than A's prompts take, so both contend
    // throughout (no reliance on how long contention is remembered).
    let b = add(core, "b", 12, 100, tenant("b", 1));
    let outs = core.step().expect("step");
    assert!(
        outs.iter()
            .any(|o| o.id == b && !o.new_token_ids.is_empty()),
        "B's first token comes in the next step"
    );
    assert_eq!(
        core.stats().last_step_tokens,
        12,
        "B's first prefill runs alone"
    );
    let mut done = 0;
    for _ in 0..200 {
        let outs = core.step().expect("step");
        core.check_kv_accounting().expect("kv accounting");
        // No step carries more than 16 prompt tokens of A beside the
        // decodes (one token per running sequence, B's included).
        assert!(
            core.stats().last_step_tokens <= 16 + 4,
            "step of {} tokens",
            core.stats().last_step_tokens
        );
        assert!(
            !outs.iter().any(|o| o.id == b && o.finish_reason.is_some()),
            "B outlasts A's prompts"
        );
        done += outs
            .iter()
            .filter(|o| flood.contains(&o.id) && o.finish_reason.is_some())
            .count();
        if done == flood.len() {
            return;
        }
    }
    panic!("A's requests did not finish under the cap");
}

/// With `--tenant-step-tokens 4`, while tenants contend a tenant adds at
/// most 4 tokens of any kind to a step: A's 8 decoding streams take turns
/// (each advances at least every other step, none starves), B's stream
/// decodes every step, and every request finishes.
#[test]
fn while_tenants_contend_one_tenants_streams_decode_in_turns_within_the_step_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut a = EngineArgs::new(&m);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_memory = Some(4 << 20);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.max_num_seqs = 16;
    a.max_num_batched_tokens = 64;
    a.tenant_step_tokens = 4;
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("LLM::new: {e:#}"));
    let core = llm.engine_mut();
    let flood: Vec<u64> = (0..8)
        .map(|i| add(core, &format!("a{i}"), 5, 12, tenant("a", 1)))
        .collect();
    // Alone, A is not bounded: its 8 prompts run in one step.
    core.step().expect("step");
    assert_eq!(core.stats().last_step_tokens, 40, "alone, A is unbounded");
    let b = add(core, "b", 3, 30, tenant("b", 1));
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut last_seen: HashMap<u64, usize> = HashMap::new();
    for step in 0..200 {
        let outs = core.step().expect("step");
        core.check_kv_accounting().expect("kv accounting");
        let a_tokens = outs
            .iter()
            .filter(|o| flood.contains(&o.id))
            .map(|o| o.new_token_ids.len())
            .sum::<usize>();
        assert!(
            a_tokens <= 4,
            "step {step}: A got {a_tokens} tokens, over its bound of 4"
        );
        for o in &outs {
            outputs
                .entry(o.id)
                .or_default()
                .extend_from_slice(&o.new_token_ids);
            if !o.new_token_ids.is_empty() {
                last_seen.insert(o.id, step);
            }
        }
        // Turns: no stream of A waits more than two bounds' worth of
        // steps (8 streams, 4 a step) while it runs.
        for &id in &flood {
            let done = outputs.get(&id).is_some_and(|v| v.len() == 11);
            let seen = last_seen.get(&id).copied().unwrap_or(0);
            assert!(done || step < seen + 3, "step {step}: stream {id} starves");
        }
        if !core.has_unfinished() {
            break;
        }
    }
    assert!(!core.has_unfinished(), "requests did not finish");
    assert_eq!(outputs[&b].len(), 30);
    for &id in &flood {
        // One token came from the first step, before `outputs` counted.
        assert_eq!(outputs[&id].len(), 11, "stream {id}");
    }
}

/// The step bound is per unit of weight: with `--tenant-step-tokens 2`,
/// A of weight 2 adds at most 4 tokens to a contended step and B of weight
/// 1 at most 2, so while both keep more streams open than their bounds
/// A's streams decode twice as many tokens as B's, as fair share says.
#[test]
fn the_step_bound_scales_with_weight_and_keeps_the_weighted_split() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut a = EngineArgs::new(&m);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_memory = Some(4 << 20);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.max_num_seqs = 16;
    a.max_num_batched_tokens = 64;
    a.tenant_step_tokens = 2;
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("LLM::new: {e:#}"));
    let core = llm.engine_mut();
    let heavy: Vec<u64> = (0..6)
        .map(|i| add(core, &format!("a{i}"), 3, 40, tenant("a", 2)))
        .collect();
    let light: Vec<u64> = (0..6)
        .map(|i| add(core, &format!("b{i}"), 3, 40, tenant("b", 1)))
        .collect();
    let (mut a_total, mut b_total) = (0usize, 0usize);
    for step in 0..60 {
        let outs = core.step().expect("step");
        core.check_kv_accounting().expect("kv accounting");
        let count = |ids: &[u64]| {
            outs.iter()
                .filter(|o| ids.contains(&o.id))
                .map(|o| o.new_token_ids.len())
                .sum::<usize>()
        };
        let (a_step, b_step) = (count(&heavy), count(&light));
        // The first steps prefill the 3-token prompts (a tenant's first
        // prefill may run in a step of its own, outside the step bound);
        // from then on every step is a contended decode step.
        if step >= 6 {
            assert!(
                a_step <= 4,
                "step {step}: A (weight 2) got {a_step} tokens, over 2 x 2"
            );
            assert!(
                b_step <= 2,
                "step {step}: B (weight 1) got {b_step} tokens, over 2"
            );
            a_total += a_step;
            b_total += b_step;
        }
    }
    assert!(b_total > 0, "B decoded nothing");
    let ratio = a_total as f64 / b_total as f64;
    assert!(
        (1.8..=2.2).contains(&ratio),
        "A decoded {a_total} tokens and B {b_total}: ratio {ratio:.2}, weights say 2"
    );
}
