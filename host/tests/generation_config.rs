//! A model's Hugging Face `generation_config.json` sets the defaults of the
//! sampling parameters a request leaves unset, as vLLM's default
//! `--generation-config auto` does.
//!
//! Specification checked here, on tiny random Llama models written as HF
//! folders, through the offline `LLM` API and the real `pagoda generate`
//! binary (the OpenAI server is checked over HTTP in
//! `tests/tests/generation_config.rs`):
//! - `eos_token_id` (an integer or a list) ends generation where the greedy
//!   chain produces one of its ids, with finish reason "stop"; `ignore_eos`
//!   generates past it. This holds for the model folder's own file and for
//!   one in another folder given as `--generation-config FOLDER`.
//! - `max_new_tokens` is the default `max_tokens`: a request without one
//!   stops there ("length"); a request's own `max_tokens` wins; a default
//!   larger than the room the prompt leaves is capped, not an error.
//! - `temperature`, `top_k` (and the other sampling fields) fill what the
//!   request leaves unset, and a request's own value wins. Values equal to
//!   transformers' defaults (`top_k: 50`, `temperature: 1.0`) are not
//!   applied, as vLLM does not apply them.
//! - `--generation-config vllm` ignores the file's sampling fields: a run
//!   then equals one that sets every field to vLLM's built-in default.
//! - A malformed file, a value of the wrong type or out of range, an eos id
//!   beyond the vocabulary, and a `--generation-config` folder that does
//!   not exist or lacks the file, are one-line errors naming the file (or
//!   the flag) and the problem, never a panic.
//! - Start-up logs the defaults applied, in vLLM's words.

mod support;

use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::{
    EngineArgs, FinishReason, GenerationConfigSource, Prompt, SamplingDefaults, SamplingParams, LLM,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use support::tiny_model::{write_json, Storage, TinyModel, TinySpec, BOS, EOS};

const PROMPT: &str = "hello world the cat sat on the mat in the dog";
/// Tokens of [`PROMPT`] with BOS.
const PROMPT_LEN: usize = 12;
/// The context of every engine here.
const MAX_MODEL_LEN: usize = 64;
/// Tokens of the greedy chain the tests look at.
const N: usize = 10;

/// A tiny Llama HF folder at `dir/model` whose `generation_config.json` is
/// `gen` (the tiny model's own is `{"bos_token_id": 0, "eos_token_id": 1}`).
fn model_with(dir: &Path, gen: Option<Value>) -> PathBuf {
    let model = dir.join("model");
    TinyModel::random(TinySpec::llama()).write_hf(&model, Storage::F32, 1);
    if let Some(gen) = gen {
        write_json(&model.join("generation_config.json"), &gen);
    }
    model
}

/// A folder holding only a `generation_config.json` of `gen`.
fn gen_folder(dir: &Path, name: &str, gen: &Value) -> PathBuf {
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).expect("create folder");
    write_json(&folder.join("generation_config.json"), gen);
    folder
}

fn engine(model: &Path, source: GenerationConfigSource) -> LLM {
    let mut args = EngineArgs::new(model);
    args.threads = 2;
    args.max_model_len = Some(MAX_MODEL_LEN);
    args.kv_cache_memory = Some(4 << 20);
    args.kv_cache_dtype = KvCacheDtype::F32;
    args.generation_config = source;
    LLM::new(args).unwrap_or_else(|e| panic!("LLM::new({}): {e:#}", model.display()))
}

/// Runs `params` on [`PROMPT`]: the generated ids and the finish reason.
fn run(llm: &mut LLM, params: &SamplingParams) -> (Vec<u32>, Option<FinishReason>) {
    let out = llm
        .generate(&[Prompt::from(PROMPT)], params)
        .expect("generate");
    assert_eq!(out[0].prompt_token_ids.len(), PROMPT_LEN);
    let c = &out[0].outputs[0];
    (c.token_ids.clone(), c.finish_reason)
}

/// Greedy, past EOS, `n` tokens: the argmax chain.
fn greedy_chain(llm: &mut LLM, n: usize) -> Vec<u32> {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    let (ids, finish) = run(llm, &p);
    assert_eq!((ids.len(), finish), (n, Some(FinishReason::Length)));
    ids
}

/// Runs the real `pagoda generate --json` on `model` with `extra` flags:
/// exit code, stdout and stderr.
fn pagoda_generate(model: &Path, extra: &[&str], log: &str) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(["generate", "--json", "--model"])
        .arg(model)
        .args([
            "--prompt",
            PROMPT,
            "--threads",
            "1",
            "--kv-cache-memory",
            "4MiB",
            "--kv-cache-dtype",
            "f32",
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
        ])
        .args(extra)
        .env("RUST_LOG", log)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running the pagoda binary");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `pagoda generate --json` that must succeed: its one output object.
fn generate_json(model: &Path, extra: &[&str]) -> Value {
    let (code, stdout, stderr) = pagoda_generate(model, extra, "warn");
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// `pagoda generate` that must fail cleanly: exit status 1, no panic, and
/// a last stderr line that starts with `error:` and holds every needle.
fn expect_error(model: &Path, extra: &[&str], needles: &[&str]) {
    let (code, stdout, stderr) = pagoda_generate(model, extra, "warn");
    assert!(
        !stderr.contains("panicked"),
        "the binary panicked:\n{stderr}"
    );
    assert_eq!(
        code,
        Some(1),
        "expected exit status 1; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(last.starts_with("error: "), "not an error line: {last:?}");
    eprintln!("{last}");
    for needle in needles {
        assert!(last.contains(needle), "expected {needle:?} in:\n{last}");
    }
}

/// The first step `k >= 2` of `chain` whose token is new to the chain and
/// comes before any EOS: stopping on it must stop exactly there.
fn first_fresh_step(chain: &[u32]) -> usize {
    (2..chain.len())
        .find(|&k| !chain[..=k].contains(&EOS) && !chain[..k].contains(&chain[k]))
        .unwrap_or_else(|| panic!("no usable step in the greedy chain {chain:?}"))
}

#[test]
fn eos_token_id_of_the_generation_config_stops_at_that_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model_with(dir.path(), None);
    let chain = greedy_chain(&mut engine(&model, GenerationConfigSource::Auto), N);
    let k = first_fresh_step(&chain);
    let stop_at = chain[k];

    // A generation config in another folder, given as --generation-config.
    // The tokenizer knows nothing of this id: only the generation config
    // can end the sequence there.
    let other = gen_folder(dir.path(), "gen", &json!({"eos_token_id": [EOS, stop_at]}));
    let mut llm = engine(&model, GenerationConfigSource::Folder(other.clone()));
    assert_eq!(llm.sampling_defaults().eos_token_ids, [stop_at]);
    assert!(llm.engine().eos_ids().contains(&stop_at));
    let (ids, finish) = run(&mut llm, &SamplingParams::greedy(N));
    assert_eq!(ids, chain[..=k], "stops on the generation config's eos id");
    assert_eq!(finish, Some(FinishReason::Stop));
    // ignore_eos generates past it.
    let mut p = SamplingParams::greedy(N);
    p.ignore_eos = true;
    assert_eq!(
        run(&mut llm, &p),
        (chain.clone(), Some(FinishReason::Length))
    );

    // The same through the real binary.
    let out = generate_json(
        &model,
        &[
            "--max-tokens",
            &N.to_string(),
            "--generation-config",
            other.to_str().expect("utf-8 path"),
        ],
    );
    assert_eq!(ids_of(&out), chain[..=k]);
    assert_eq!(out["finish_reason"], "stop");

    // And from the model folder's own file, an integer or a list (auto).
    for eos in [json!(stop_at), json!([EOS, stop_at])] {
        let model = model_with(
            &dir.path().join(format!("own-{}", eos.is_array())),
            Some(json!({"bos_token_id": BOS, "eos_token_id": eos})),
        );
        let mut llm = engine(&model, GenerationConfigSource::Auto);
        assert_eq!(
            run(&mut llm, &SamplingParams::greedy(N)),
            (chain[..=k].to_vec(), Some(FinishReason::Stop))
        );
        let out = generate_json(&model, &["--max-tokens", &N.to_string()]);
        assert_eq!(ids_of(&out), chain[..=k]);
        assert_eq!(out["finish_reason"], "stop");
    }
}

#[test]
fn max_new_tokens_is_the_default_max_tokens_and_a_request_value_wins() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model_with(
        dir.path(),
        Some(json!({"bos_token_id": BOS, "eos_token_id": EOS, "max_new_tokens": 3})),
    );
    let mut llm = engine(&model, GenerationConfigSource::Auto);
    assert_eq!(llm.sampling_defaults().max_tokens, Some(3));
    let unset = SamplingParams {
        temperature: Some(0.0),
        ignore_eos: true,
        ..Default::default()
    };
    let (ids, finish) = run(&mut llm, &unset);
    assert_eq!((ids.len(), finish), (3, Some(FinishReason::Length)));
    let (ids, finish) = run(
        &mut llm,
        &SamplingParams {
            max_tokens: Some(5),
            ..unset.clone()
        },
    );
    assert_eq!((ids.len(), finish), (5, Some(FinishReason::Length)));

    // pagoda generate: no --max-tokens takes the model's 3; --max-tokens wins.
    let chain = greedy_chain(&mut llm, 5);
    let out = generate_json(&model, &[]);
    assert_eq!(ids_of(&out), chain[..3], "{out}");
    if !chain[..5].contains(&EOS) {
        assert_eq!(
            ids_of(&generate_json(&model, &["--max-tokens", "5"])),
            chain
        );
    }

    // A default larger than the room the prompt leaves is capped; the same
    // value set by the request is an error.
    let big = gen_folder(dir.path(), "big", &json!({"max_new_tokens": 1000}));
    let mut llm = engine(&model, GenerationConfigSource::Folder(big));
    let (ids, finish) = run(&mut llm, &unset);
    assert_eq!(
        (ids.len(), finish),
        (MAX_MODEL_LEN - PROMPT_LEN, Some(FinishReason::Length))
    );
    let err = llm
        .generate(
            &[Prompt::from(PROMPT)],
            &SamplingParams {
                max_tokens: Some(1000),
                ..unset
            },
        )
        .expect_err("1000 tokens do not fit");
    assert!(
        format!("{err:#}").contains("maximum context length"),
        "{err:#}"
    );
}

#[test]
fn sampling_defaults_fill_what_the_request_leaves_unset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model_with(
        dir.path(),
        Some(json!({
            "bos_token_id": BOS, "eos_token_id": EOS, "do_sample": true,
            "temperature": 0.7, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0,
            "transformers_version": "4.45.0", "some_future_key": {"x": 1}
        })),
    );
    let mut llm = engine(&model, GenerationConfigSource::Auto);
    // transformers' defaults (top_p 1.0, repetition_penalty 1.0) are not
    // applied, unknown keys are ignored.
    assert_eq!(
        *llm.sampling_defaults(),
        SamplingDefaults {
            temperature: Some(0.7),
            top_k: Some(1),
            ..Default::default()
        }
    );
    let chain = greedy_chain(&mut llm, N);
    // Nothing set: top_k 1 from the model makes any seed greedy.
    for seed in [1, 2, 3] {
        let p = SamplingParams {
            max_tokens: Some(N),
            ignore_eos: true,
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(run(&mut llm, &p).0, chain, "seed {seed}");
    }
    // The request's own top_k wins; temperature still comes from the model.
    let own_top_k = SamplingParams {
        max_tokens: Some(N),
        ignore_eos: true,
        seed: Some(7),
        top_k: Some(0),
        ..Default::default()
    };
    let sampled_07 = run(&mut llm, &own_top_k).0;
    assert_ne!(sampled_07, chain, "top_k 0 samples");
    let explicit_07 = SamplingParams {
        temperature: Some(0.7),
        ..own_top_k.clone()
    };
    assert_eq!(run(&mut llm, &explicit_07).0, sampled_07);

    // --generation-config vllm: the file's sampling fields are ignored, so
    // leaving everything unset equals setting vLLM's built-in defaults.
    let mut vllm = engine(&model, GenerationConfigSource::Vllm);
    assert!(vllm.sampling_defaults().is_empty());
    let unset = SamplingParams {
        max_tokens: Some(N),
        ignore_eos: true,
        seed: Some(7),
        ..Default::default()
    };
    let builtin = SamplingParams {
        temperature: Some(1.0),
        top_p: Some(1.0),
        top_k: Some(0),
        min_p: Some(0.0),
        repetition_penalty: Some(1.0),
        ..unset.clone()
    };
    let under_vllm = run(&mut vllm, &unset).0;
    assert_eq!(under_vllm, run(&mut llm, &builtin).0);
    assert_ne!(under_vllm, chain, "vLLM's defaults sample");
}

#[test]
fn generation_config_vllm_ignores_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Values that would fail validation, and a cap of 3: none of it counts.
    let model = model_with(
        dir.path(),
        Some(
            json!({"bos_token_id": BOS, "eos_token_id": EOS, "max_new_tokens": 3,
            "temperature": "hot"}),
        ),
    );
    let mut llm = engine(&model, GenerationConfigSource::Vllm);
    assert!(llm.sampling_defaults().is_empty());
    let p = SamplingParams {
        temperature: Some(0.0),
        ignore_eos: true,
        ..Default::default()
    };
    let (ids, finish) = run(&mut llm, &p);
    assert_eq!(
        (ids.len(), finish),
        (MAX_MODEL_LEN - PROMPT_LEN, Some(FinishReason::Length)),
        "without max_tokens the request fills the context"
    );
    let (code, stdout, stderr) = pagoda_generate(
        &model,
        &["--generation-config", "vllm", "--max-tokens", "4"],
        "info",
    );
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        !stderr.contains("generation config"),
        "nothing applied, nothing logged:\n{stderr}"
    );
}

#[test]
fn start_up_logs_the_defaults_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model_with(
        dir.path(),
        Some(json!({"bos_token_id": BOS, "eos_token_id": EOS,
            "temperature": 0.0, "top_p": 0.9, "max_new_tokens": 4})),
    );
    let (code, stdout, stderr) = pagoda_generate(&model, &[], "info");
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("Default sampling parameters have been overridden by the model's Hugging Face generation config"))
        .unwrap_or_else(|| panic!("no log line of the defaults:\n{stderr}"));
    for needle in [
        "generation_config.json",
        "temperature=0",
        "top_p=0.9",
        "max_tokens=4",
        "--generation-config vllm",
    ] {
        assert!(line.contains(needle), "expected {needle:?} in:\n{line}");
    }
    let out: Value = serde_json::from_str(stdout.trim()).expect("JSON");
    let n = ids_of(&out).len();
    assert!(n == 4 || out["finish_reason"] == "stop", "{out}");
}

#[test]
fn bad_generation_configs_are_one_line_errors_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model_with(dir.path(), None);
    let file = model.join("generation_config.json");
    let shown = file.display().to_string();
    let cases: &[(&str, &[&str])] = &[
        ("{\"temperature\": 0.5,", &["not valid JSON"]),
        ("[1, 2]", &["must be a JSON object"]),
        (
            r#"{"temperature": "hot"}"#,
            &["'temperature' must be a number"],
        ),
        (r#"{"top_k": 2.5}"#, &["'top_k' must be an integer"]),
        (
            r#"{"max_new_tokens": 0}"#,
            &["'max_new_tokens' must be at least 1"],
        ),
        (r#"{"top_p": 2.5}"#, &["top_p must be in (0, 1]"]),
        (
            r#"{"eos_token_id": "</s>"}"#,
            &["'eos_token_id' must be a token id or a list of token ids"],
        ),
        (
            r#"{"eos_token_id": [1, 100000]}"#,
            &["eos_token_id 100000 is beyond the vocabulary"],
        ),
    ];
    for (text, needles) in cases {
        std::fs::write(&file, text).expect("write");
        let mut all = vec![shown.as_str()];
        all.extend_from_slice(needles);
        expect_error(&model, &["--max-tokens", "2"], &all);
    }

    // A --generation-config folder that does not exist, or has no file.
    std::fs::write(&file, r#"{"eos_token_id": 1}"#).expect("write");
    let missing = dir.path().join("no-such-folder");
    let missing_s = missing.display().to_string();
    expect_error(
        &model,
        &["--generation-config", &missing_s, "--max-tokens", "2"],
        &["--generation-config", &missing_s, "not a folder"],
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let empty_s = empty.display().to_string();
    expect_error(
        &model,
        &["--generation-config", &empty_s, "--max-tokens", "2"],
        &[&empty_s, "has no generation_config.json"],
    );
    // The offline API reports the same error.
    let mut args = EngineArgs::new(&model);
    args.generation_config = GenerationConfigSource::Folder(empty);
    let err = LLM::new(args).err().expect("no generation_config.json");
    assert!(format!("{err:#}").contains("has no generation_config.json"));
}
