//! Bad input to `pagoda generate` is a clean, one-line error, never a panic.
//!
//! Each case runs the real binary as a user would
//! (`pagoda generate --model PATH --prompt hi --max-tokens 2`) on a tiny
//! model that is valid except for one defect, and requires:
//! - a non-zero exit status of 1 (not a panic's 101, not a signal),
//! - no "panicked" anywhere on stderr,
//! - a last stderr line that starts with `error:`, names the offending file
//!   (where there is one) and says what is wrong with it.
//!
//! Defects covered: a missing path; a GGUF file truncated in its header, in
//! its metadata, in its tensor infos and in its tensor data; a safetensors
//! file truncated in its header length, its JSON header and its data (one
//! file and one shard of two); a q projection of the wrong shape in an HF
//! folder and in a GGUF file; `config.json` with an unsupported
//! architecture (the error lists the supported ones), heads that do not
//! divide, an unsupported `rope_scaling`, negative and zero sizes, an absurd
//! context length, and text that is not JSON; `--device cuda` on a machine
//! without the CUDA driver; `--gpu-memory-utilization` on the CPU;
//! `--dtype float8`.

mod support;

use pagoda::engine::loader::gguf::GgufFile;
use pagoda_accel::GgmlType;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use support::tiny_model::{write_gguf_parts, write_json, Storage, TinyModel, TinySpec};

/// Runs `pagoda generate` on `model` with `extra` flags; returns the exit
/// code (`None` if killed by a signal), stdout and stderr.
fn generate(model: &Path, extra: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(["generate", "--model"])
        .arg(model)
        .args([
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--threads",
            "1",
            "--kv-cache-memory",
            "4MiB",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running the pagoda binary");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that `pagoda generate` on `model` fails cleanly with a last
/// stderr line that starts with `error:` and contains every needle
/// (case-insensitively); returns that line.
fn expect_error(model: &Path, extra: &[&str], needles: &[&str]) -> String {
    let (code, stdout, stderr) = generate(model, extra);
    assert!(
        !stderr.contains("panicked"),
        "{}: the binary panicked:\n{stderr}",
        model.display()
    );
    assert_eq!(
        code,
        Some(1),
        "{}: expected exit status 1, got {code:?}; stdout:\n{stdout}\nstderr:\n{stderr}",
        model.display()
    );
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .to_string();
    assert!(
        last.starts_with("error: "),
        "{}: last stderr line is not an error: {last:?}",
        model.display()
    );
    // Shown with `--nocapture`, to review the wording of every message.
    eprintln!("{last}");
    let lower = last.to_lowercase();
    for needle in needles {
        assert!(
            lower.contains(&needle.to_lowercase()),
            "expected {needle:?} in the error line:\n{last}"
        );
    }
    last
}

/// Writes a valid tiny model's HF folder into `dir`.
fn hf_folder(dir: &Path, m: &TinyModel) -> PathBuf {
    m.write_hf(dir, Storage::F32, 1);
    dir.to_path_buf()
}

/// Writes a valid tiny HF folder, then rewrites its `config.json` with `edit`.
fn hf_folder_with_config(dir: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let m = TinyModel::random(TinySpec::llama());
    hf_folder(dir, &m);
    let path = dir.join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read config")).expect("JSON");
    edit(&mut config);
    write_json(&path, &config);
    path
}

fn shown(p: &Path) -> String {
    p.display().to_string()
}

// ---------------------------------------------------------------------------
// Sanity: the undamaged tiny models do work, so every failure below is the
// defect's doing.
// ---------------------------------------------------------------------------

#[test]
fn the_undamaged_tiny_models_generate_successfully() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::qwen2());
    let hf = hf_folder(&dir.path().join("hf"), &m);
    let gguf = dir.path().join("tiny.gguf");
    m.write_gguf(&gguf);
    for model in [&hf, &gguf] {
        let (code, stdout, stderr) = generate(model, &[]);
        assert_eq!(code, Some(0), "{}: {stderr}", model.display());
        assert!(
            !stdout.trim().is_empty(),
            "{}: no text generated",
            model.display()
        );
    }
}

// ---------------------------------------------------------------------------
// Paths and files.
// ---------------------------------------------------------------------------

#[test]
fn a_missing_model_path_is_named_in_the_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-model.gguf");
    expect_error(&missing, &[], &[&shown(&missing), "no such file"]);
}

#[test]
fn a_gguf_truncated_anywhere_names_the_file_and_says_truncated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.gguf");
    TinyModel::random(TinySpec::llama()).write_gguf(&good);
    let bytes = std::fs::read(&good).expect("read GGUF");
    let data_offset = GgufFile::open(&good).expect("open GGUF").data_offset() as usize;
    let cuts = [
        ("in the magic", 2),
        ("in the header counts", 13),
        ("in the first metadata key", 24 + 12),
        ("in the tokenizer metadata", data_offset / 2),
        ("in the tensor infos", data_offset - 40),
        ("in the tensor data", data_offset + 1000),
        ("one byte short", bytes.len() - 1),
    ];
    for (where_, cut) in cuts {
        let path = dir.path().join(format!("cut-at-{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).expect("write");
        let line = expect_error(&path, &[], &[&shown(&path), "truncated"]);
        assert!(!line.is_empty(), "{where_}");
    }
}

#[test]
fn a_truncated_safetensors_file_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::llama());
    let src = hf_folder(&dir.path().join("good"), &m);
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let cuts = [
        ("in the header length", 4),
        ("in the JSON header", 8 + header_len / 2),
        ("in the tensor data", 8 + header_len + 1000),
        ("one byte short", bytes.len() - 1),
    ];
    for (where_, cut) in cuts {
        let folder = dir.path().join(format!("cut-at-{cut}"));
        hf_folder(&folder, &m);
        let file = folder.join("model.safetensors");
        std::fs::write(&file, &bytes[..cut]).expect("write");
        let line = expect_error(
            &folder,
            &[],
            &[&shown(&file), "not a valid safetensors file"],
        );
        assert!(!line.is_empty(), "{where_}");
    }
}

#[test]
fn a_truncated_shard_of_a_sharded_model_names_that_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::qwen2());
    m.write_hf(dir.path(), Storage::F32, 2);
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).expect("read");
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).expect("write");
    expect_error(
        dir.path(),
        &[],
        &[&shown(&shard), "not a valid safetensors file"],
    );
}

#[test]
fn a_q_projection_of_the_wrong_shape_in_an_hf_folder_is_named_with_both_shapes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = TinyModel::random(TinySpec::llama());
    let t = m.get_mut("model.layers.1.self_attn.q_proj.weight");
    t.shape = vec![48, 64];
    t.data.truncate(48 * 64);
    hf_folder(dir.path(), &m);
    let file = dir.path().join("model.safetensors");
    expect_error(
        dir.path(),
        &[],
        &[
            &shown(&file),
            "model.layers.1.self_attn.q_proj.weight",
            "shape",
            "[48, 64]",
            "[64, 64]",
        ],
    );
}

#[test]
fn a_q_projection_of_the_wrong_shape_in_a_gguf_is_named_with_both_shapes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::llama());
    let mut tensors = m.gguf_tensors(true);
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_q.weight")
        .expect("attn_q");
    assert_eq!(t.ty, GgmlType::F32);
    t.shape = vec![48, 64];
    t.data.truncate(48 * 64 * 4);
    let path = dir.path().join("wrong-shape.gguf");
    write_gguf_parts(&path, &m.gguf_metadata(), &tensors);
    expect_error(
        &path,
        &[],
        &[
            &shown(&path),
            "blk.0.attn_q.weight",
            "shape",
            "[48, 64]",
            "[64, 64]",
        ],
    );
}

// ---------------------------------------------------------------------------
// config.json.
// ---------------------------------------------------------------------------

#[test]
fn an_unknown_architecture_is_rejected_with_the_supported_list() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |c| {
        c["architectures"] = json!(["GPT2LMHeadModel"]);
        c["model_type"] = json!("gpt2");
    });
    expect_error(
        dir.path(),
        &[],
        &[
            &shown(&config),
            "GPT2LMHeadModel",
            "not supported",
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
        ],
    );
}

#[test]
fn an_unknown_gguf_architecture_is_rejected_with_the_supported_list() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::llama());
    let mut meta = m.gguf_metadata();
    meta[0].1 = pagoda::engine::loader::gguf::GgufValue::String("gpt2".into());
    let path = dir.path().join("gpt2.gguf");
    write_gguf_parts(&path, &meta, &m.gguf_tensors(true));
    expect_error(
        &path,
        &[],
        &[
            &shown(&path),
            "'gpt2'",
            "not supported",
            "LlamaForCausalLM",
            "Qwen2ForCausalLM",
        ],
    );
}

#[test]
fn query_heads_that_are_not_a_multiple_of_kv_heads_are_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |c| c["num_key_value_heads"] = json!(3));
    expect_error(
        dir.path(),
        &[],
        &[
            &shown(&config),
            "num_attention_heads (4)",
            "num_key_value_heads (3)",
            "multiple",
        ],
    );
}

#[test]
fn an_unsupported_rope_scaling_type_is_rejected_with_the_supported_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |c| {
        c["rope_scaling"] =
            json!({"type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [1.0]});
    });
    expect_error(
        dir.path(),
        &[],
        &[
            &shown(&config),
            "rope_scaling",
            "'longrope'",
            "not supported",
            "linear",
            "llama3",
            "yarn",
        ],
    );
}

#[test]
fn negative_and_zero_sizes_are_rejected_naming_the_key() {
    let cases: [(&str, Value, &[&str]); 4] = [
        ("hidden_size", json!(-64), &["'hidden_size'", "positive"]),
        (
            "intermediate_size",
            json!(0),
            &["'intermediate_size'", "positive"],
        ),
        (
            "num_hidden_layers",
            json!(0),
            &["'num_hidden_layers'", "positive"],
        ),
        ("vocab_size", json!(12.5), &["'vocab_size'", "integer"]),
    ];
    for (key, value, needles) in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = hf_folder_with_config(dir.path(), |c| c[key] = value);
        let mut all = vec![shown(&config)];
        all.extend(needles.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        expect_error(dir.path(), &[], &refs);
    }
}

#[test]
fn an_absurd_context_length_is_an_error_not_an_allocation_failure() {
    // Without --max-model-len the engine sizes itself for the model's
    // context length. 2^40 positions (from config.json, or from the flag)
    // cannot be served and must be refused with a message, not by aborting
    // on a failed allocation.
    let dir = tempfile::tempdir().expect("tempdir");
    hf_folder_with_config(dir.path(), |c| {
        c["max_position_embeddings"] = json!(1u64 << 40)
    });
    let line = expect_error(dir.path(), &[], &[]);
    assert!(
        line.contains("max-model-len") || line.contains("max_position_embeddings"),
        "{line}"
    );

    let ok = tempfile::tempdir().expect("tempdir");
    hf_folder(ok.path(), &TinyModel::random(TinySpec::llama()));
    expect_error(
        ok.path(),
        &["--max-model-len", "1099511627776"],
        &["max-model-len"],
    );
}

#[test]
fn an_absurd_layer_count_is_an_error_not_an_allocation_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    hf_folder_with_config(dir.path(), |c| c["num_hidden_layers"] = json!(1u64 << 40));
    // Refused from the config alone, before any weight is read.
    expect_error(
        dir.path(),
        &[],
        &[&shown(dir.path()), "num_hidden_layers", "maximum"],
    );
}

#[test]
fn a_rope_scaling_factor_that_is_not_positive_is_rejected() {
    // A zero factor divides every rotary frequency by zero: the model would
    // run on NaN positions and print garbage instead of failing.
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |c| {
        c["rope_scaling"] = json!({"type": "linear", "factor": 0.0})
    });
    expect_error(dir.path(), &[], &[&shown(&config), "factor"]);
}

#[test]
fn a_config_json_that_is_not_json_is_rejected_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |_| {});
    std::fs::write(&config, "architectures = [\"LlamaForCausalLM\"]\n").expect("write");
    expect_error(dir.path(), &[], &[&shown(&config), "not valid JSON"]);
}

#[test]
fn a_folder_without_config_json_names_the_missing_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = hf_folder_with_config(dir.path(), |_| {});
    std::fs::remove_file(&config).expect("remove config.json");
    expect_error(dir.path(), &[], &[&shown(&config)]);
}

// ---------------------------------------------------------------------------
// Flags.
// ---------------------------------------------------------------------------

#[test]
fn device_cuda_without_a_driver_says_so_in_one_line() {
    // The default build has the CUDA backend; what is missing here is the
    // driver, and the binary must say so instead of panicking.
    if pagoda_accel::backend::cuda::driver_available() {
        eprintln!("libcuda is present on this machine: nothing to check");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = hf_folder(dir.path(), &TinyModel::random(TinySpec::llama()));
    expect_error(
        &hf,
        &["--device", "cuda"],
        &["--device cuda", "libcuda", "NVIDIA driver", "--device cpu"],
    );
}

#[test]
fn gpu_memory_utilization_on_the_cpu_points_to_kv_cache_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = hf_folder(dir.path(), &TinyModel::random(TinySpec::llama()));
    // A vLLM command line carries it: on the CPU it is a warning naming
    // the flag that sizes the cache there, not an exit.
    let (code, stdout, stderr) =
        generate(&hf, &["--device", "cpu", "--gpu-memory-utilization", "0.5"]);
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("WARN")
            && l.contains("--gpu-memory-utilization")
            && l.contains("--kv-cache-memory")),
        "{stderr}"
    );
    // Out of range is still a mistake, on any device.
    expect_error(
        &hf,
        &["--device", "cpu", "--gpu-memory-utilization", "1.5"],
        &["--gpu-memory-utilization", "(0, 1]"],
    );
}

#[test]
fn dtype_float8_is_rejected_with_the_accepted_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = hf_folder(dir.path(), &TinyModel::random(TinySpec::llama()));
    expect_error(
        &hf,
        &["--dtype", "float8"],
        &[
            "--dtype", "'float8'", "auto", "float32", "bfloat16", "float16",
        ],
    );
}

#[test]
fn a_shard_path_that_leaves_the_model_folder_is_refused_before_it_is_opened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::llama());
    let model = dir.path().join("model");
    m.write_hf(&model, Storage::F32, 2);
    // A file outside the folder that the index points at: it must never be
    // opened, whatever it holds.
    let outside = dir.path().join("secret.safetensors");
    std::fs::copy(model.join("model-00001-of-00002.safetensors"), &outside).expect("copy");
    let index_path = model.join("model.safetensors.index.json");
    for target in ["../secret.safetensors", "/etc/passwd", "sub/x.safetensors"] {
        let mut index: Value =
            serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read index"))
                .expect("JSON");
        let map = index["weight_map"].as_object_mut().expect("weight_map");
        let first = map.keys().next().expect("a tensor").clone();
        map.insert(first, Value::String(target.into()));
        write_json(&index_path, &index);
        expect_error(
            &model,
            &[],
            &[&shown(&index_path), target, "file name in the model folder"],
        );
    }
}

#[test]
fn a_gguf_rope_dimension_count_other_than_the_head_width_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = TinyModel::random(TinySpec::llama());
    for n in [0u32, 8] {
        let mut meta = m.gguf_metadata();
        meta.push((
            "llama.rope.dimension_count".into(),
            pagoda::engine::loader::gguf::GgufValue::U32(n),
        ));
        let path = dir.path().join(format!("rope-{n}.gguf"));
        write_gguf_parts(&path, &meta, &m.gguf_tensors(true));
        expect_error(
            &path,
            &[],
            &[
                &shown(&path),
                "llama.rope.dimension_count",
                &format!("is {n}"),
                "16 wide",
            ],
        );
    }
    // The head width itself is accepted.
    let mut meta = m.gguf_metadata();
    meta.push((
        "llama.rope.dimension_count".into(),
        pagoda::engine::loader::gguf::GgufValue::U32(16),
    ));
    let path = dir.path().join("rope-16.gguf");
    write_gguf_parts(&path, &meta, &m.gguf_tensors(true));
    let (code, _, stderr) = generate(&path, &[]);
    assert_eq!(code, Some(0), "{stderr}");
}
