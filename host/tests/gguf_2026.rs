//! Gemma 3 and gpt-oss from the GGUF files llama.cpp's own converter writes
//! (architectures `gemma3` and `gpt-oss`; tests/fixtures/hf-families-2026/
//! gguf, see its README), served in float32: the loader reads the metadata
//! as llama.cpp's loader does and undoes the converter's tensor transforms
//! (Gemma's norms stored as `1 + w`, its embedding cut to the tokenizer's
//! rows), so the logprobs agree with transformers' float32 `reference.json`
//! within 1e-4 and greedy ids agree up to the first near-tie.

mod support;

use support::transformers_reference::u32s;

use pagoda::engine::config::ModelConfig;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::loader::gguf::{GgufFile, GgufValue};
use pagoda::engine::loader::gguf_writer::{write_gguf, GgufTensorToWrite};
use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A greedy step whose top-two gap is below this is a near-tie, where
/// float32 rounding may pick either token.
const NEAR_TIE: f64 = 1e-3;

/// The bound of the acceptance: 1e-4 from transformers' float32.
const TOL: f64 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families-2026")
}

fn gguf(family: &str, ty: &str) -> PathBuf {
    fixtures().join("gguf").join(format!("{family}.{ty}.gguf"))
}

fn engine(model: &Path) -> anyhow::Result<LLM> {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    assert_eq!(a.kv_cache_dtype, KvCacheDtype::Auto);
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    LLM::new(a)
}

fn reference(family: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(family).join("reference.json"))
            .expect("reference.json"),
    )
    .expect("reference JSON")
}

/// Serves `model` and checks every case of `family`'s reference: prompt
/// logprobs within `tol`, greedy ids equal up to the first step whose
/// top-two gap is under `near_tie`, and up to the first generated token
/// at or past `embedded_rows` (a token whose embedding row the converter
/// dropped: the file no longer holds what transformers feeds back next).
/// Returns the largest logprob difference.
fn check_against_reference(
    family: &str,
    what: &str,
    model: &Path,
    tol: f64,
    near_tie: f64,
    embedded_rows: u32,
) -> f64 {
    let reference = reference(family);
    let mut llm = engine(model).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    support::transformers_reference::check_cases(
        &reference,
        what,
        &mut llm,
        tol,
        near_tie,
        embedded_rows,
    )
}

/// A copy of `family`'s f32 file with its metadata changed by `edit`.
fn edited(family: &str, dir: &Path, edit: impl Fn(&mut Vec<(String, GgufValue)>)) -> PathBuf {
    let g = GgufFile::open(&gguf(family, "f32")).expect("f32 file");
    let mut meta: Vec<(String, GgufValue)> = g
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    edit(&mut meta);
    let tensors: Vec<GgufTensorToWrite> = g
        .tensors()
        .iter()
        .map(|t| {
            let data = g.tensor(&t.name).expect("tensor");
            GgufTensorToWrite {
                name: t.name.clone(),
                ty: data.ty,
                shape: data.shape.to_vec(),
                data: data.data.to_vec(),
            }
        })
        .collect();
    let out = dir.join(format!("{family}-edited.gguf"));
    let meta: Vec<(&str, GgufValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    write_gguf(&out, &meta, &tensors).expect("write");
    out
}

fn set(key: &str, v: GgufValue) -> impl Fn(&mut Vec<(String, GgufValue)>) + '_ {
    move |m| {
        m.retain(|(k, _)| k != key);
        m.push((key.to_string(), v.clone()));
    }
}

#[test]
fn gemma3_gguf_agrees_with_transformers() {
    let worst = check_against_reference(
        "gemma3",
        "gemma3 (llama.cpp's f32 GGUF)",
        &gguf("gemma3", "f32"),
        TOL,
        NEAR_TIE,
        // The converter keeps the embedding rows of the tokenizer's 510
        // tokens (the LM head keeps all 512).
        510,
    );
    assert!(worst < TOL);
}

/// The GGUF file reads as the same model as the Hugging Face folder it was
/// converted from: the layer mix, both RoPEs, the score scale, the
/// vocabulary (the LM head's 512 rows, though the embedding keeps 510).
#[test]
fn gemma3_gguf_config_is_the_hf_config() {
    let g = ModelConfig::from_gguf(&GgufFile::open(&gguf("gemma3", "f32")).expect("open"))
        .expect("gguf config");
    let hf = ModelConfig::from_hf_config(&fixtures().join("gemma3/config.json")).expect("hf");
    assert_eq!(g, hf);
}

/// Without `attention.sliding_window_pattern` (what the converter writes on
/// its own) the file means what llama.cpp makes of it: every layer but each
/// 6th is local, so all three layers of the fixture are; a period read as
/// a number works the same way.
#[test]
fn gemma3_layer_pattern_defaults_to_llama_cpps_period_of_six() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = "gemma3.attention.sliding_window_pattern";
    let read =
        |p: &Path| ModelConfig::from_gguf(&GgufFile::open(p).expect("open")).expect("config");
    let none = read(&edited("gemma3", dir.path(), |m| {
        m.retain(|(k, _)| k != key)
    }));
    assert_eq!(none.sliding_windows, vec![Some(16); 3]);
    let two = read(&edited("gemma3", dir.path(), set(key, GgufValue::U32(2))));
    assert_eq!(two.sliding_windows, vec![Some(16), None, Some(16)]);
    let no_window = read(&edited(
        "gemma3",
        dir.path(),
        set("gemma3.attention.sliding_window", GgufValue::U32(0)),
    ));
    assert!(no_window.sliding_windows.iter().all(Option::is_none));
}

/// Every metadata key that changes the math is computed or refused by
/// name: an edited copy of a fixture is refused, naming the key.
#[test]
fn gemma3_metadata_that_changes_the_math_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let same = edited("gemma3", dir.path(), |_| {});
    ModelConfig::from_gguf(&GgufFile::open(&same).expect("open")).expect("unchanged copy");
    type Edit = Box<dyn Fn(&mut Vec<(String, GgufValue)>)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "gemma3",
            Box::new(set(
                "gemma3.rope.scaling.type",
                GgufValue::String("yarn".into()),
            )),
            "gemma3.rope.scaling.type",
        ),
        (
            "gemma3",
            Box::new(set("gemma3.attn_logit_softcapping", GgufValue::F32(50.0))),
            "gemma3.attn_logit_softcapping",
        ),
        (
            "gemma3",
            Box::new(set("gemma3.attention.value_length", GgufValue::U32(8))),
            "gemma3.attention.value_length",
        ),
        (
            "gemma3",
            Box::new(set("gemma3.rope.dimension_count", GgufValue::U32(8))),
            "gemma3.rope.dimension_count",
        ),
        (
            "gemma3",
            Box::new(set(
                "gemma3.attention.sliding_window_pattern",
                GgufValue::Array(vec![GgufValue::Bool(true); 2]),
            )),
            "gemma3.attention.sliding_window_pattern",
        ),
        (
            "gemma3",
            Box::new(set("gemma3.expert_count", GgufValue::U32(4))),
            "gemma3.expert_count",
        ),
    ];
    for (family, edit, key) in cases {
        let path = edited(family, dir.path(), edit);
        let err = ModelConfig::from_gguf(&GgufFile::open(&path).expect("open"))
            .expect_err(&format!("{family} with {key} edited"));
        let msg = format!("{err:#}");
        assert!(msg.contains(key), "{family}: '{msg}' does not name {key}");
    }
}

#[test]
fn gpt_oss_gguf_agrees_with_transformers() {
    let worst = check_against_reference(
        "gpt_oss",
        "gpt_oss (llama.cpp's f32 GGUF)",
        &gguf("gpt_oss", "f32"),
        TOL,
        NEAR_TIE,
        512,
    );
    assert!(worst < TOL);
}

/// The gpt-oss file reads as the same model as its Hugging Face folder:
/// the alternating layers, YaRN (gpt-oss's unrounded ramp), the experts,
/// the SwiGLU limits.
#[test]
fn gpt_oss_gguf_config_is_the_hf_config() {
    let g = ModelConfig::from_gguf(&GgufFile::open(&gguf("gpt_oss", "f32")).expect("open"))
        .expect("gguf config");
    let hf = ModelConfig::from_hf_config(&fixtures().join("gpt_oss/config.json")).expect("hf");
    assert_eq!(g, hf);
}

#[test]
fn gpt_oss_metadata_that_changes_the_math_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let same = edited("gpt_oss", dir.path(), |_| {});
    ModelConfig::from_gguf(&GgufFile::open(&same).expect("open")).expect("unchanged copy");
    type Edit = Box<dyn Fn(&mut Vec<(String, GgufValue)>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(set(
                "gpt-oss.rope.scaling.type",
                GgufValue::String("linear".into()),
            )),
            "gpt-oss.rope.scaling.type",
        ),
        (
            Box::new(set("gpt-oss.rope.freq_base_swa", GgufValue::F32(10_000.0))),
            "gpt-oss.rope.freq_base_swa",
        ),
        (
            Box::new(set("gpt-oss.rope.scaling.attn_factor", GgufValue::F32(2.0))),
            "gpt-oss.rope.scaling.attn_factor",
        ),
        (
            Box::new(set("gpt-oss.attention.value_length", GgufValue::U32(8))),
            "gpt-oss.attention.value_length",
        ),
        (
            Box::new(set("gpt-oss.expert_used_count", GgufValue::U32(5))),
            "gpt-oss.expert_used_count",
        ),
        (
            Box::new(set(
                "gpt-oss.attention.sliding_window_pattern",
                GgufValue::Array(vec![GgufValue::Bool(true); 3]),
            )),
            "gpt-oss.attention.sliding_window_pattern",
        ),
    ];
    for (edit, key) in cases {
        let path = edited("gpt_oss", dir.path(), edit);
        let err = ModelConfig::from_gguf(&GgufFile::open(&path).expect("open"))
            .expect_err(&format!("gpt_oss with {key} edited"));
        let msg = format!("{err:#}");
        assert!(msg.contains(key), "gpt_oss: '{msg}' does not name {key}");
    }
}

/// gpt-oss as published in GGUF: experts in MXFP4 (ggml type 39), here the
/// f32 file quantized by llama.cpp's `llama-quantize ... MXFP4_MOE` (which
/// also makes the other matrices Q8_0). The experts, dequantized at load
/// and rebuilt into transformers' fused layout, are the f32 file's within
/// MXFP4's rounding: a root-mean-square error of a small fraction of the
/// weights' own, where a value taken from the wrong place (nibble order,
/// gate/up interleave, transpose) would be of their size.
#[test]
fn gpt_oss_mxfp4_experts_read_back_within_mxfp4_rounding() {
    use pagoda::engine::loader::gguf_weights::GgufWeights;
    use pagoda::engine::loader::WeightSource;
    let f32_file = GgufFile::open(&gguf("gpt_oss", "f32")).expect("f32 file");
    let mx_file = GgufFile::open(&gguf("gpt_oss", "mxfp4_moe")).expect("mxfp4 file");
    let config = ModelConfig::from_gguf(&f32_file).expect("config");
    assert_eq!(
        ModelConfig::from_gguf(&mx_file).expect("mxfp4 config"),
        config
    );
    let exact = GgufWeights::new(&f32_file, DType::Auto).for_model(&config);
    let mx = GgufWeights::new(&mx_file, DType::Auto).for_model(&config);
    let (d, f, e) = (config.hidden_size, config.intermediate_size, 4);
    for i in 0..config.num_layers {
        for (part, shape) in [
            ("gate_up_proj", vec![e, d, 2 * f]),
            ("down_proj", vec![e, f, d]),
            ("gate_up_proj_bias", vec![e, 2 * f]),
        ] {
            let name = format!("model.layers.{i}.mlp.experts.{part}");
            let (want, _) = exact.stacked(&name, &shape).expect("f32");
            let (got, _) = mx
                .stacked(&name, &shape)
                .unwrap_or_else(|err| panic!("{name}: {err:#}"));
            let rms = |v: &mut dyn Iterator<Item = f32>| {
                let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + (x as f64).powi(2), n + 1));
                (s / n as f64).sqrt()
            };
            let w = rms(&mut want.iter().copied());
            let err = rms(&mut want.iter().zip(&got).map(|(a, b)| a - b));
            eprintln!("{name}: rms error {:.3} of the weights'", err / w);
            assert!(err < 0.2 * w, "{name}: rms error {err} vs weights' {w}");
        }
    }
    let mut llm = engine(&gguf("gpt_oss", "mxfp4_moe")).expect("mxfp4 engine");
    let prompt = u32s(&reference("gpt_oss")["cases"][0]["prompt_ids"]);
    let mut params = SamplingParams::greedy(4);
    params.prompt_logprobs = Some(1);
    let out = llm
        .generate(&[Prompt::Tokens(prompt.clone())], &params)
        .expect("generate");
    let lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
    assert!(lp.iter().all(|l| l.logprob.is_finite() && l.logprob <= 0.0));
    assert_eq!(out[0].outputs[0].token_ids.len(), 4);
}

/// The MXFP4 file's experts stay MXFP4 in memory (ggml's blocks are what
/// `GgmlType::MXFP4` stores: 17 bytes per 32 values) and serve as the
/// values those blocks decode to, times activations quantized to 8 bits
/// per 32 as llama.cpp does for this file (ggml's Q8_0; the kernel is
/// checked bitwise against a naive reference in `pagoda_accel`'s tests).
/// Against a copy of the file with each MXFP4 expert tensor replaced by an
/// f32 tensor of its decoded values (decoded by the loader's table decoder,
/// not the kernel; f32 weights multiply f32 activations), the prompt
/// logprobs then differ by that activation rounding alone. Its size is
/// measured on the same model by the file's Q8_0 matrices, whose
/// activations are 8-bit in both copies: decoding them to f32 as well
/// moves the logprobs by the rounding of the attention's activations. The
/// experts' rounding must be of that order (within 3× of it, both printed)
/// and well under a logprob unit; the copy weighs the experts' f32 bytes
/// less their MXFP4 bytes more.
#[test]
fn gpt_oss_mxfp4_experts_stay_mxfp4_and_serve_as_their_decoded_values() {
    use pagoda::engine::loader::gguf_weights::dequantize_mxfp4;
    use pagoda_accel::GgmlType;
    let dir = tempfile::tempdir().expect("tempdir");
    let mx_path = gguf("gpt_oss", "mxfp4_moe");
    let g = GgufFile::open(&mx_path).expect("mxfp4 file");
    let config = ModelConfig::from_gguf(&g).expect("config");
    let meta: Vec<(&str, GgufValue)> = g
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let mut tensors: Vec<GgufTensorToWrite> = g
        .tensors()
        .iter()
        .map(|t| {
            let data = g.tensor(&t.name).expect("tensor");
            GgufTensorToWrite {
                name: t.name.clone(),
                ty: data.ty,
                shape: data.shape.to_vec(),
                data: data.data.to_vec(),
            }
        })
        .collect();
    let mut expert_values = 0usize;
    for t in tensors
        .iter_mut()
        .filter(|t| t.name.contains("_exps.weight"))
    {
        assert_eq!(t.ty, GgmlType::MXFP4, "{}", t.name);
        let v = dequantize_mxfp4(&t.data).expect("decode");
        assert_eq!(v.len(), t.shape.iter().product::<usize>());
        expert_values += v.len();
        t.ty = GgmlType::F32;
        t.data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    }
    assert_eq!(expert_values, config.num_layers * 3 * 4 * 64 * 64);
    let float_path = dir.path().join("gpt_oss-decoded.gguf");
    write_gguf(&float_path, &meta, &tensors).expect("write");
    // The Q8_0 matrices decoded too (exactly: f16 scale times int8 code).
    let mut decoded_q8 = 0;
    for t in tensors.iter_mut().filter(|t| t.ty == GgmlType::Q8_0) {
        let cols = t.shape[0];
        let rows = t.shape[1..].iter().product::<usize>();
        let w = pagoda_accel::Weight::from_raw(GgmlType::Q8_0, rows, cols, &t.data).expect("q8_0");
        let mut v = vec![0f32; rows * cols];
        for (r, row) in v.chunks_exact_mut(cols).enumerate() {
            w.dequantize_row(r, row);
        }
        t.ty = GgmlType::F32;
        t.data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        decoded_q8 += 1;
    }
    assert!(
        decoded_q8 >= 4 * config.num_layers,
        "{decoded_q8} Q8_0 tensors"
    );
    let all_f32_path = dir.path().join("gpt_oss-all-f32.gguf");
    write_gguf(&all_f32_path, &meta, &tensors).expect("write");

    let logprobs = |model: &Path| -> Vec<Vec<f64>> {
        let mut llm = engine(model).unwrap_or_else(|e| panic!("{e:#}"));
        let mut params = SamplingParams::greedy(1);
        params.prompt_logprobs = Some(1);
        reference("gpt_oss")["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .map(|c| {
                let out = llm
                    .generate(&[Prompt::Tokens(u32s(&c["prompt_ids"]))], &params)
                    .expect("generate");
                let lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
                lp.iter().map(|l| l.logprob as f64).collect()
            })
            .collect()
    };
    let (mx, float, all_f32) = (
        logprobs(&mx_path),
        logprobs(&float_path),
        logprobs(&all_f32_path),
    );
    // Largest and mean absolute difference.
    let diff = |p: &[Vec<f64>], q: &[Vec<f64>]| {
        let (mut worst, mut sum, mut n) = (0f64, 0f64, 0usize);
        for (a, b) in p.iter().zip(q) {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert!(x.is_finite() && y.is_finite());
                worst = worst.max((x - y).abs());
                sum += (x - y).abs();
                n += 1;
            }
        }
        (worst, sum / n as f64)
    };
    let (experts, experts_mean) = diff(&mx, &float);
    let (attention, attention_mean) = diff(&float, &all_f32);
    eprintln!(
        "gpt_oss mxfp4 gguf: prompt logprob difference from the decoded f32 file (the experts' 8-bit activations) {experts:.2e} largest, {experts_mean:.2e} mean; the Q8_0 matrices' 8-bit activations {attention:.2e} largest, {attention_mean:.2e} mean"
    );
    assert!(attention > TOL, "the Q8_0 matrices' activations are 8-bit");
    assert!(experts > TOL, "the experts' activations are 8-bit");
    assert!(
        experts <= 3.0 * attention && experts_mean <= 3.0 * attention_mean && experts < 1.0,
        "experts {experts} (mean {experts_mean}), attention {attention} (mean {attention_mean})"
    );

    let bytes = |model: &Path| {
        let mut a = EngineArgs::new(model);
        a.threads = 2;
        a.dtype = DType::Float32;
        a.max_model_len = Some(128);
        let backend = pagoda::engine::args::cpu_backend(&a).expect("backend");
        let (m, _) = pagoda::engine::args::load_model(&backend, &a, |_| 128)
            .unwrap_or_else(|e| panic!("{e:#}"));
        m.weight_bytes()
    };
    let (mx_bytes, float_bytes) = (bytes(&mx_path), bytes(&float_path));
    assert_eq!(
        (float_bytes - mx_bytes) * 32,
        expert_values * (4 * 32 - 17),
        "the experts are resident in 17 bytes per 32 values"
    );
}
