//! The prefix cache never serves K/V that was not computed: under seeded
//! random schedules that mix tenants, shared prefixes, chunked prefill,
//! fair-share and KV-pressure preemption and aborts, every finished greedy
//! output equals what the same prompt gives when it runs alone.
//!
//! There is no timing here: each schedule is a function of its seed, and
//! the engine is stepped by hand.

mod support;

use pagoda::engine::core::{EngineCore, RequestOptions};
use pagoda::engine::fair_share::TenantShare;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::request::FinishReason;
use pagoda::engine::scheduler::SchedulingPolicy;
use pagoda::engine::{EngineArgs, SamplingParams, LLM};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use support::tiny_model::{Storage, TinyModel, TinySpec};

const MAX_MODEL_LEN: usize = 128;
/// K and V of 2 layers, 2 KV heads of 16, in f32.
const BYTES_PER_TOKEN: u64 = 2 * 2 * 2 * 16 * 4;
const BLOCK: usize = 16;
/// The longest output any request asks for; references are this long.
const MAX_TOKENS: usize = 20;
const SCHEDULES: u64 = 1000;

/// splitmix64: a small, seedable generator, so each schedule is fixed by
/// its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| 3 + (self.next() % 40) as u32).collect()
    }
}

fn model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    TinyModel::random(TinySpec::llama()).write_hf(&m, Storage::F32, 1);
    m
}

fn greedy(max_tokens: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(max_tokens);
    p.ignore_eos = true;
    p
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

/// Each prompt's greedy output when it runs alone on an engine with no
/// prefix cache, computed once per prompt.
struct Alone {
    llm: LLM,
    outputs: HashMap<Vec<u32>, Vec<u32>>,
}

impl Alone {
    fn new(model: &Path) -> Alone {
        let mut a = EngineArgs::new(model);
        a.threads = 1;
        a.max_model_len = Some(MAX_MODEL_LEN);
        a.kv_cache_memory = Some(64 * BLOCK as u64 * BYTES_PER_TOKEN);
        a.kv_cache_dtype = KvCacheDtype::F32;
        a.enable_prefix_caching = false;
        a.scheduling_policy = SchedulingPolicy::Fcfs;
        Alone {
            llm: LLM::new(a).unwrap_or_else(|e| panic!("reference engine: {e:#}")),
            outputs: HashMap::new(),
        }
    }

    fn output(&mut self, prompt: &[u32]) -> &[u32] {
        let core = self.llm.engine_mut();
        self.outputs.entry(prompt.to_vec()).or_insert_with(|| {
            let id = core
                .add_request(
                    "alone".into(),
                    prompt.to_vec(),
                    greedy(MAX_TOKENS),
                    RequestOptions::default(),
                )
                .unwrap_or_else(|e| panic!("alone: {}", e.message));
            let mut out = Vec::new();
            while core.has_unfinished() {
                for o in core.step().expect("step") {
                    assert_eq!(o.id, id);
                    out.extend(o.new_token_ids);
                }
            }
            out
        })
    }
}

/// One request of a schedule.
struct Planned {
    name: String,
    prompt: Vec<u32>,
    max_tokens: usize,
    opts: RequestOptions,
    arrives_at: usize,
    /// Aborted this many steps after it arrives, if at all.
    abort_after: Option<usize>,
}

/// What one schedule did, for the test's coverage figures.
#[derive(Default)]
struct Ran {
    finished: usize,
    aborted: usize,
    preemptions: u64,
    prefix_hits: u64,
}

/// Runs schedule `seed` on a fresh engine and checks every finished
/// output against the prompt's output alone. Returns an error naming the
/// first request that differs.
fn run_schedule(seed: u64, model: &Path, alone: &mut Alone) -> Result<Ran, String> {
    let mut rng = Rng(seed);
    let mut a = EngineArgs::new(model);
    a.threads = 1;
    a.max_model_len = Some(MAX_MODEL_LEN);
    a.kv_cache_dtype = KvCacheDtype::F32;
    a.block_size = BLOCK;
    // From one longest sequence's worth of blocks (KV pressure on every
    // step) to room for several.
    let blocks = rng.range(MAX_MODEL_LEN / BLOCK, 3 * MAX_MODEL_LEN / BLOCK);
    a.kv_cache_memory = Some(blocks as u64 * BLOCK as u64 * BYTES_PER_TOKEN);
    a.max_num_seqs = rng.range(2, 4);
    // Small budgets split prompts into several chunks.
    a.max_num_batched_tokens = [8, 16, 24, 40, 128][rng.range(0, 4)];
    a.scheduling_policy = SchedulingPolicy::Fair;
    a.enable_prefix_caching = true;
    let mut llm = LLM::new(a).map_err(|e| format!("engine: {e:#}"))?;

    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let n = rng.range(BLOCK, 3 * BLOCK);
            rng.tokens(n)
        })
        .collect();
    let weights = [rng.range(1, 3) as u32, rng.range(1, 3) as u32, 1];
    let tenants = ["a", "b", "c"];
    let mut plan: Vec<Planned> = (0..rng.range(5, 12))
        .map(|i| {
            let t = rng.range(0, 2);
            let mut prompt = if rng.chance(70) {
                prefixes[rng.range(0, 2)].clone()
            } else {
                Vec::new()
            };
            let tail = rng.range(1, 40);
            prompt.extend(rng.tokens(tail));
            let max_tokens = rng.range(1, MAX_TOKENS);
            Planned {
                name: format!("r{i}"),
                prompt,
                max_tokens,
                opts: tenant(tenants[t], weights[t]),
                arrives_at: rng.range(0, 30),
                abort_after: rng.chance(15).then(|| rng.range(0, 12)),
            }
        })
        .collect();
    plan.sort_by_key(|p| p.arrives_at);

    let core: &mut EngineCore = llm.engine_mut();
    let mut ran = Ran::default();
    // engine id -> (index into plan, tokens so far, step it arrived)
    let mut live: HashMap<u64, (usize, Vec<u32>, usize)> = HashMap::new();
    let mut next = 0;
    let mut step = 0;
    while next < plan.len() || core.has_unfinished() {
        while next < plan.len() && plan[next].arrives_at <= step {
            let p = &plan[next];
            let id = core
                .add_request(
                    p.name.clone(),
                    p.prompt.clone(),
                    greedy(p.max_tokens),
                    p.opts.clone(),
                )
                .map_err(|e| format!("add {}: {}", p.name, e.message))?;
            live.insert(id, (next, Vec::new(), step));
            next += 1;
        }
        let due: Vec<u64> = live
            .iter()
            .filter(|(_, (i, _, at))| plan[*i].abort_after.is_some_and(|d| at + d == step))
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            core.abort(id);
            live.remove(&id);
            ran.aborted += 1;
        }
        for o in core.step().map_err(|e| format!("step: {e:#}"))? {
            let Some((i, tokens, _)) = live.get_mut(&o.id) else {
                return Err(format!("output for unknown request {}", o.id));
            };
            tokens.extend(&o.new_token_ids);
            if let Some(reason) = o.finish_reason {
                let p = &plan[*i];
                if reason != FinishReason::Length {
                    return Err(format!("{} finished with {reason:?}", p.name));
                }
                let want = &alone.output(&p.prompt)[..p.max_tokens];
                if tokens[..] != *want {
                    return Err(format!(
                        "schedule {seed}: {} (tenant {}, {} prompt tokens) gave {tokens:?}, alone {want:?}",
                        p.name,
                        p.opts.tenant.name,
                        p.prompt.len()
                    ));
                }
                ran.finished += 1;
                live.remove(&o.id);
            }
        }
        core.check_kv_accounting()
            .map_err(|e| format!("schedule {seed}, step {step}: {e}"))?;
        step += 1;
        if step > 20_000 {
            return Err(format!("schedule {seed} did not finish"));
        }
    }
    if !live.is_empty() {
        return Err(format!(
            "schedule {seed}: {} requests never finished",
            live.len()
        ));
    }
    let stats = core.stats();
    ran.preemptions = stats.num_preemptions;
    ran.prefix_hits = stats.prefix.hits;
    Ok(ran)
}

#[test]
fn every_greedy_output_under_random_schedules_equals_the_prompt_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = model(dir.path());
    let mut alone = Alone::new(&m);
    let mut total = Ran::default();
    let mut failures = Vec::new();
    for seed in 0..SCHEDULES {
        match run_schedule(0xca11_0000 + seed, &m, &mut alone) {
            Ok(r) => {
                total.finished += r.finished;
                total.aborted += r.aborted;
                total.preemptions += r.preemptions;
                total.prefix_hits += r.prefix_hits;
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {SCHEDULES} schedules served wrong output; the first: {}",
        failures.len(),
        failures[0]
    );
    // The schedules exercise what they claim to, and the model's output
    // depends on its context (so wrong K/V would show).
    eprintln!(
        "{} finished, {} aborted, {} preemptions, {} prefix-hit tokens",
        total.finished, total.aborted, total.preemptions, total.prefix_hits
    );
    assert!(total.finished > 1000, "finished {}", total.finished);
    assert!(total.aborted > 50, "aborted {}", total.aborted);
    assert!(total.preemptions > 200, "preemptions {}", total.preemptions);
    assert!(
        total.prefix_hits > 10_000,
        "prefix hits {}",
        total.prefix_hits
    );
    let distinct: std::collections::HashSet<&Vec<u32>> = alone.outputs.values().collect();
    assert!(
        distinct.len() * 2 > alone.outputs.len(),
        "{} distinct outputs of {} prompts: the model ignores its context",
        distinct.len(),
        alone.outputs.len()
    );
}
