//! LoRA adapters written by PEFT (tests/fixtures/lora, copied from
//! ../shared/fixtures/lora, with PEFT's float32 outputs), served on their
//! base (tests/fixtures/hf-families) in float32 with a float32 KV cache:
//! - each adapter's prompt logprobs agree with PEFT's within 1e-4, and its
//!   greedy ids up to the first near-tie;
//! - a batch mixing every adapter of a base with the base itself, under
//!   prefix caching, chunked prefill and preemption (a small pool), gives
//!   each request exactly what it gives alone;
//! - what the kernels cannot compute is refused at load, by name.

mod common;

use pagoda::engine::core::RequestOptions;
use pagoda::engine::loader::DType;
use pagoda::engine::lora::LoraArgs;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;
const NEAR_TIE: f64 = 1e-3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The adapters of each base, by folder name.
const ADAPTERS: [(&str, &[&str]); 2] = [
    ("llama", &["qv-r8", "all-r16", "rslora-r4"]),
    ("qwen3", &["all-r8"]),
];

fn args(base: &str, adapters: &[&str], max_loras: usize) -> EngineArgs {
    let mut a = EngineArgs::new(fixtures().join("hf-families").join(base));
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    a.lora = Some(LoraArgs {
        max_loras,
        max_lora_rank: 16,
        modules: adapters
            .iter()
            .map(|n| (n.to_string(), fixtures().join("lora").join(base).join(n)))
            .collect(),
        ..Default::default()
    });
    a
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn f64s(v: &Value) -> Vec<Option<f64>> {
    v.as_array()
        .expect("array")
        .iter()
        .map(Value::as_f64)
        .collect()
}

fn reference(base: &str, adapter: &str) -> Value {
    let p = fixtures()
        .join("lora")
        .join(base)
        .join(adapter)
        .join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("JSON")
}

#[test]
fn each_adapter_matches_peft() {
    for (base, adapters) in ADAPTERS {
        let mut llm = LLM::new(args(base, adapters, 2)).expect("engine");
        for &adapter in adapters {
            let what = format!("{base} + {adapter}");
            let reference = reference(base, adapter);
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
                params.min_tokens = want_greedy.len();
                params.prompt_logprobs = Some(1);
                let out = llm
                    .generate_with_lora(&[Prompt::Tokens(prompt.clone())], &params, Some(adapter))
                    .unwrap_or_else(|e| panic!("{what} case {c}: {e:#}"));
                let got_lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
                for (i, l) in got_lp.iter().enumerate() {
                    let want = want_lp[i + 1].expect("reference logprob");
                    let err = (l.logprob as f64 - want).abs();
                    worst = worst.max(err);
                    assert!(
                        err < TOL,
                        "{what} case {c}, prompt token {}: logprob {} vs PEFT {want}",
                        i + 1,
                        l.logprob
                    );
                }
                let got = &out[0].outputs[0].token_ids;
                for (i, (&g, &w)) in got.iter().zip(&want_greedy).enumerate() {
                    if gaps[i].is_some_and(|gap| gap < NEAR_TIE) {
                        break;
                    }
                    assert_eq!(
                        g, w,
                        "{what} case {c}: greedy token {i} (got {got:?}, want {want_greedy:?})"
                    );
                }
            }
            eprintln!("{what}: largest prompt logprob difference {worst:.2e}");
        }
    }
}

/// `--max-cpu-loras 1` with three adapters: each request's adapter is
/// read again from its folder when another was used since, and gives
/// PEFT's outputs all the same; idle adapters' factors leave host memory.
#[test]
fn adapters_dropped_from_host_memory_are_read_again_and_give_the_same_outputs() {
    let (base, adapters) = ADAPTERS[0];
    let mut a = args(base, adapters, 1);
    if let Some(l) = &mut a.lora {
        l.max_cpu_loras = Some(1);
    }
    let mut llm = LLM::new(a).expect("engine");
    let in_memory = |llm: &LLM| {
        let r = llm.engine().lora_registry().expect("LoRA enabled");
        pagoda::engine::lora::lock(r).num_in_memory()
    };
    // Loading three at start-up already keeps one.
    assert_eq!(in_memory(&llm), 1);
    for round in 0..2 {
        for &adapter in adapters {
            let reference = reference(base, adapter);
            let case = &reference["cases"][0];
            let prompt = u32s(&case["prompt_ids"]);
            let want_lp = f64s(&case["prompt_logprobs"]);
            let mut params = SamplingParams::greedy(1);
            params.prompt_logprobs = Some(1);
            let out = llm
                .generate_with_lora(&[Prompt::Tokens(prompt)], &params, Some(adapter))
                .unwrap_or_else(|e| panic!("{adapter}: {e:#}"));
            let got = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
            for (i, l) in got.iter().enumerate() {
                let want = want_lp[i + 1].expect("reference logprob");
                assert!(
                    (l.logprob as f64 - want).abs() < TOL,
                    "round {round}, {adapter}, prompt token {}: {} vs PEFT {want}",
                    i + 1,
                    l.logprob
                );
            }
            // The runner's slot still holds this adapter; the registry
            // keeps at most one more.
            assert!(
                in_memory(&llm) <= 2,
                "round {round}, {adapter}: {}",
                in_memory(&llm)
            );
        }
    }
}

#[test]
fn a_mixed_batch_gives_each_request_its_solo_output() {
    let (base, adapters) = ADAPTERS[0];
    // Prompts that share prefixes across adapters: a hit under one adapter
    // must never serve another, or the base.
    let reference = reference(base, adapters[0]);
    let cases: Vec<Vec<u32>> = reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| u32s(&c["prompt_ids"]))
        .collect();
    let choices: Vec<Option<&str>> = std::iter::once(None)
        .chain(adapters.iter().map(|a| Some(*a)))
        .collect();
    let requests: Vec<(Vec<u32>, Option<&str>)> = (0..32)
        .map(|i| {
            let mut p = cases[i % cases.len()].clone();
            // A distinct tail after the shared prefix.
            p.push(20 + (i as u32 % 7));
            (p, choices[i % choices.len()])
        })
        .collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    // Alone: one request at a time, every adapter resident, and no prefix
    // cache, so that each output is computed from its own tokens only.
    let mut solo_args = args(base, adapters, adapters.len());
    solo_args.enable_prefix_caching = false;
    let mut llm = LLM::new(solo_args).expect("engine");
    let solo: Vec<Vec<u32>> = requests
        .iter()
        .map(|(p, a)| {
            llm.generate_with_lora(&[Prompt::Tokens(p.clone())], &params, *a)
                .expect("generate")[0]
                .outputs[0]
                .token_ids
                .clone()
        })
        .collect();
    // Together, in a pool small enough to preempt, with chunked prefill and
    // fewer adapter slots than adapters, stepping by hand to check the KV
    // accounting after every step.
    let mut a = args(base, adapters, 2);
    a.kv_cache_memory = Some(128 << 10);
    a.max_num_batched_tokens = 48;
    a.max_num_seqs = 32;
    let mut llm = LLM::new(a).expect("engine");
    let core = llm.engine_mut();
    let mut ids = Vec::new();
    for (i, (p, adapter)) in requests.iter().enumerate() {
        let lora = adapter.map(|n| core.lora(n).expect("a loaded adapter"));
        let opts = RequestOptions {
            lora,
            ..Default::default()
        };
        ids.push(
            core.add_request(format!("r{i}"), p.clone(), params.clone(), opts)
                .expect("add"),
        );
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut steps = 0;
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            let i = ids.iter().position(|&id| id == o.id).expect("ours");
            out[i].extend_from_slice(&o.new_token_ids);
        }
        core.check_kv_accounting().expect("kv accounting");
        steps += 1;
        assert!(steps < 10_000, "the batch never finished");
    }
    assert!(
        core.stats().num_preemptions > 0,
        "the pool should have forced preemption"
    );
    for (i, (got, want)) in out.iter().zip(&solo).enumerate() {
        assert_eq!(
            got, want,
            "request {i} ({:?}) differs from its solo run",
            requests[i].1
        );
    }
}

#[test]
fn what_is_not_computed_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = fixtures().join("lora/llama/qv-r8");
    let cases = [
        (r#""use_dora": false"#, r#""use_dora": true"#, "use_dora"),
        (
            r#""modules_to_save": null"#,
            r#""modules_to_save": ["lm_head"]"#,
            "modules_to_save",
        ),
        (r#""bias": "none""#, r#""bias": "all""#, "bias"),
        (r#""r": 8"#, r#""r": 32"#, "--max-lora-rank"),
    ];
    for (from, to, named) in cases {
        let folder = dir.path().join(named.trim_start_matches('-'));
        std::fs::create_dir_all(&folder).expect("mkdir");
        std::fs::copy(
            src.join("adapter_model.safetensors"),
            folder.join("adapter_model.safetensors"),
        )
        .expect("copy");
        let config = std::fs::read_to_string(src.join("adapter_config.json")).expect("config");
        assert!(config.contains(from), "the fixture's config has {from}");
        std::fs::write(folder.join("adapter_config.json"), config.replace(from, to))
            .expect("write");
        let mut a = args("llama", &[], 1);
        if let Some(l) = a.lora.as_mut() {
            l.modules = vec![("bad".into(), folder.clone())];
        }
        let e = match LLM::new(a) {
            Ok(_) => panic!("{named}: the adapter was accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains(named), "{named}: {e}");
    }
    // An adapter made for another base: its shapes do not fit.
    let mut a = args("llama", &[], 1);
    a.model = fixtures().join("hf-families/qwen3");
    if let Some(l) = a.lora.as_mut() {
        l.modules = vec![("other".into(), src.clone())];
    }
    let e = LLM::new(a)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(e.contains("shape"), "{e}");
}
