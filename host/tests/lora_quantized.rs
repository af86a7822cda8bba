//! An adapter on a quantized base, as QLoRA fine-tunes are served: the
//! demo model's Q4_1 GGUF stays quantized and the adapter runs beside it,
//! its factors stored in bf16 (`--lora-dtype auto`). Its prompt logprobs must stay as close to the same adapter on
//! the base dequantized to f32 as the base model's own logprobs do: the
//! adapter adds no error of its own to the quantization's.

mod common;

use pagoda::engine::lora::{LoraArgs, LoraDtype};
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The demo GGUF dequantized to f32 (made once, kept in the target dir).
fn dequantized(gguf: &Path) -> PathBuf {
    let out = root().join("target/demo-f32.gguf");
    if !out.exists() {
        let tmp = out.with_extension("partial");
        let ok = Command::new("python3")
            .arg(root().join("scripts/dequantize-gguf.py"))
            .arg(gguf)
            .arg(&tmp)
            .status()
            .expect("python3 scripts/dequantize-gguf.py (needs gguf and numpy)");
        assert!(ok.success(), "dequantize-gguf.py failed");
        std::fs::rename(&tmp, &out).expect("rename");
    }
    out
}

fn engine(model: &Path, adapter: Option<&Path>, dtype: LoraDtype) -> LLM {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.max_model_len = Some(256);
    a.kv_cache_memory = Some(32 << 20);
    a.kv_cache_dtype = pagoda::engine::kv_cache::KvCacheDtype::F32;
    if let Some(p) = adapter {
        a.lora = Some(LoraArgs {
            max_loras: 1,
            max_lora_rank: 8,
            modules: vec![("a".into(), p.to_path_buf())],
            dtype,
            ..Default::default()
        });
    }
    LLM::new(a).expect("engine")
}

fn prompt_logprobs(llm: &mut LLM, lora: Option<&str>) -> Vec<f64> {
    let mut p = SamplingParams::greedy(1);
    p.prompt_logprobs = Some(0);
    let prompt = Prompt::Text(
        "The river bends twice before it reaches the old mill, where the water slows and the children fish.".into(),
    );
    let out = llm
        .generate_with_lora(&[prompt], &p, lora)
        .expect("generate");
    out[0]
        .prompt_logprobs
        .as_ref()
        .expect("prompt logprobs")
        .iter()
        .map(|l| l.logprob as f64)
        .collect()
}

fn mean_gap(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / a.len() as f64
}

#[test]
fn an_adapter_on_the_quantized_base_adds_no_error_of_its_own() {
    let q4 = common::demo_gguf();
    let f32 = dequantized(&q4);
    let dir = tempfile::tempdir().expect("tempdir");
    let ok = Command::new("python3")
        .arg(root().join("scripts/make-lora.py"))
        .arg(dir.path())
        .args(["1", "--rank", "8", "--alpha", "16"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("python3 scripts/make-lora.py");
    assert!(ok.success());
    let adapter = dir.path().join("lora0");

    let auto = LoraDtype::Auto;
    let base_q = prompt_logprobs(&mut engine(&q4, None, auto), None);
    let base_f = prompt_logprobs(&mut engine(&f32, None, auto), None);
    // bf16 factors beside Q4_1, f32 factors beside the f32 base.
    let lora_q = prompt_logprobs(&mut engine(&q4, Some(&adapter), auto), Some("a"));
    let lora_f = prompt_logprobs(&mut engine(&f32, Some(&adapter), auto), Some("a"));
    // bf16 factors beside the f32 base: the rounding of the factors alone.
    let lora_f_bf16 = prompt_logprobs(
        &mut engine(&f32, Some(&adapter), LoraDtype::Bf16),
        Some("a"),
    );

    let moved = mean_gap(&lora_f, &base_f);
    let base_err = mean_gap(&base_q, &base_f);
    let lora_err = mean_gap(&lora_q, &lora_f);
    eprintln!(
        "adapter moves the f32 logprobs by {moved:.4} on average; Q4_1 vs f32: base {base_err:.4}, with the adapter {lora_err:.4}"
    );
    assert!(
        moved > 0.05,
        "the adapter should change the outputs ({moved})"
    );
    let rounding = mean_gap(&lora_f_bf16, &lora_f);
    eprintln!("bf16 factors vs f32 factors on the f32 base: {rounding:.5}");
    assert!(
        rounding > 0.0 && rounding < 0.02 * moved,
        "bf16 factors should round the adapter's effect only slightly: {rounding} of {moved}"
    );
    assert!(
        lora_err <= 1.25 * base_err + 1e-3,
        "the adapter on Q4_1 is {lora_err:.4} from it on f32, the base only {base_err:.4}"
    );
}
