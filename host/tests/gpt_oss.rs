//! gpt-oss (`GptOssForCausalLM`) against transformers' own tiny checkpoint
//! (tests/fixtures/hf-families-2026/gpt_oss, copied from ../shared/fixtures,
//! written by transformers 5.19 with its float32 outputs in
//! `reference.json`): attention sinks, alternating 16-token sliding-window
//! and full layers, biased attention, YaRN (factor 4, `truncate` false),
//! 4 fused experts top-2 with biases and a clamped SwiGLU. Served in
//! float32 (so a float32 KV cache), each prompt's logprobs agree with
//! transformers' within 1e-4 and greedy ids up to the first near-tie, whole
//! or prefilled in 7-token chunks; batched, chunked and preempted runs give
//! each prompt its solo output; the keys and checkpoints not built are
//! refused by name.

mod support;

use support::transformers_reference::{f64s, u32s};

use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Largest |logprob − transformers'| accepted on a prompt token.
const TOL: f64 = 1e-4;
/// A greedy step whose top-two gap is below this is a near-tie.
const NEAR_TIE: f64 = 1e-3;

fn fixture() -> PathBuf {
    match std::env::var_os("PAGODA_HF_FAMILIES_2026") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families-2026"),
    }
    .join("gpt_oss")
}

/// A copy of the fixture in `dir` whose `config.json` went through `edit`.
fn edited(dir: &Path, edit: impl Fn(&mut Value)) -> PathBuf {
    let dst = dir.join("gpt_oss");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for e in std::fs::read_dir(fixture()).expect("fixture folder") {
        let e = e.expect("dir entry");
        std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy fixture file");
    }
    let path = dst.join("config.json");
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("JSON");
    edit(&mut v);
    std::fs::write(&path, v.to_string()).expect("write config");
    dst
}

fn args(model: &Path) -> EngineArgs {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(128);
    a.kv_cache_memory = Some(8 << 20);
    a
}

/// Serves `model` with `configure`d arguments and checks every reference
/// case: prompt logprobs within [`TOL`], greedy ids equal up to the first
/// near-tie. Returns the largest logprob difference.
fn check(what: &str, model: &Path, configure: impl Fn(&mut EngineArgs)) -> f64 {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json"),
    )
    .expect("reference JSON");
    assert_eq!(reference["architecture"], "GptOssForCausalLM");
    let mut a = args(model);
    configure(&mut a);
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    support::transformers_reference::check_cases(
        &reference,
        what,
        &mut llm,
        TOL,
        NEAR_TIE,
        u32::MAX,
    )
}

/// Both config forms: transformers 5's `rope_parameters` and 4's
/// top-level `rope_theta` with a `rope_scaling` object.
#[test]
fn gpt_oss_with_sinks_sliding_windows_yarn_and_clamped_experts_agrees_with_transformers() {
    check("gpt_oss (transformers 5)", &fixture(), |_| {});
    let dir = tempfile::tempdir().expect("tempdir");
    let v4 = edited(dir.path(), |v| {
        let mut p = v
            .as_object_mut()
            .expect("config object")
            .remove("rope_parameters")
            .expect("rope_parameters");
        let p = p.as_object_mut().expect("rope_parameters object");
        v["rope_theta"] = p.remove("rope_theta").expect("rope_theta");
        v["rope_scaling"] = Value::Object(p.clone());
    });
    check("gpt_oss (transformers 4)", &v4, |_| {});
}

/// Prompts prefilled 7 tokens a step: each chunk's queries see the
/// earlier chunks' K/V through the window and the sinks alike.
#[test]
fn gpt_oss_prompts_prefilled_in_chunks_of_7_agree_with_transformers() {
    check("gpt_oss (7-token chunks)", &fixture(), |a| {
        a.max_num_batched_tokens = 7
    });
}

/// 16 prompts of mixed lengths (some sharing prefixes) batched with
/// prefix caching, then in 16-token chunks with a pool small enough to
/// preempt: every greedy output equals the prompt's solo output.
#[test]
fn gpt_oss_batches_exactly() {
    support::batching::batch_changes_nothing(&fixture(), "gpt_oss");
}

/// A model with sinks that nothing computes would be served wrong: each
/// of these would change the math and is refused, naming the key.
#[test]
fn gpt_oss_keys_not_built_are_refused_by_name() {
    let cases: Vec<(Box<dyn Fn(&mut Value)>, &[&str])> = vec![
        (
            Box::new(|v| v["quantization_config"] = serde_json::json!({"quant_method": "fp8"})),
            &["quant_method", "fp8", "mxfp4"],
        ),
        (
            Box::new(|v| v["swiglu_limit"] = (-1.0).into()),
            &["swiglu_limit"],
        ),
        (
            Box::new(|v| v["experts_per_token"] = 3.into()),
            &["experts_per_token", "num_experts_per_tok"],
        ),
        (
            Box::new(|v| {
                v["layer_types"] = serde_json::json!(["sliding_attention", "chunked_attention"])
            }),
            &["layer_types", "chunked_attention"],
        ),
        (
            Box::new(|v| v["rope_parameters"]["rope_type"] = "longrope".into()),
            &["rope_type", "longrope"],
        ),
    ];
    for (i, (edit, want)) in cases.iter().enumerate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = edited(dir.path(), edit);
        let err = match LLM::new(args(&model)) {
            Ok(_) => panic!("case {i}: the edited config loaded"),
            Err(e) => format!("{e:#}"),
        };
        for w in *want {
            assert!(err.contains(w), "case {i}: '{w}' not in: {err}");
        }
    }
}

/// Every tensor of the checkpoint is read (the sinks, the router's bias
/// and the four fused expert tensors included), and transformers' own
/// config keys are all known.
#[test]
fn every_gpt_oss_tensor_and_key_is_used() {
    let a = args(&fixture());
    let backend = pagoda::engine::args::cpu_backend(&a).expect("backend");
    let (_, loaded) = pagoda::engine::args::load_model(&backend, &a, |_| 128)
        .unwrap_or_else(|e| panic!("gpt_oss: {e:#}"));
    assert_eq!(loaded.unused_tensors, Vec::<String>::new());
    let c: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("config.json")).expect("config"),
    )
    .expect("JSON");
    assert_eq!(
        pagoda::engine::config::unknown_hf_keys(&c),
        Vec::<String>::new()
    );
}

/// The fixture's chat template (ChatML, as its tokenizer_config carries
/// it) renders through the model's tokenizer.
#[test]
fn the_gpt_oss_chat_template_renders() {
    let t = pagoda::tokenizer::Tokenizer::from_hf_dir(&fixture()).expect("tokenizer");
    let chat = t.chat_template().expect("chat template");
    let text = chat
        .render(
            &[
                pagoda::tokenizer::ChatMessage::new("system", "be brief"),
                pagoda::tokenizer::ChatMessage::new("user", "hi"),
            ],
            true,
        )
        .expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// e2m1's magnitudes, by code (the sign is code bit 3).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Quantizes `w` (`[n, rows, cols]`, applied as `x @ W`) to MXFP4 as
/// OpenAI's checkpoints store it: each `W` transposed to `[cols, rows]`,
/// blocks of 32 along `rows`, one power-of-two scale per block. Returns the
/// blocks, the scales and the values they decode to, in `w`'s layout.
fn mxfp4(w: &[f32], n: usize, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    let mut decoded = vec![0f32; w.len()];
    for e in 0..n {
        for c in 0..cols {
            for g in 0..rows / 32 {
                let at = |r: usize| e * rows * cols + (g * 32 + r) * cols + c;
                let amax = (0..32).map(|r| w[at(r)].abs()).fold(0f32, f32::max);
                let exp = if amax > 0.0 {
                    (amax as f64 / 6.0).log2().ceil() as i32
                } else {
                    0
                };
                scales.push((exp + 127) as u8);
                let scale = 2f64.powi(exp);
                let mut codes = [0u8; 32];
                for (r, code) in codes.iter_mut().enumerate() {
                    let y = w[at(r)] as f64 / scale;
                    let (i, _) = E2M1
                        .iter()
                        .enumerate()
                        .map(|(i, &m)| (i, (m as f64 - y.abs()).abs()))
                        .fold((0, f64::MAX), |a, b| if b.1 < a.1 { b } else { a });
                    *code = i as u8 | if y < 0.0 { 8 } else { 0 };
                    let v = E2M1[i] as f64 * scale;
                    decoded[at(r)] = if y < 0.0 { -v } else { v } as f32;
                }
                for pair in codes.chunks_exact(2) {
                    blocks.push(pair[0] | (pair[1] << 4));
                }
            }
        }
    }
    (blocks, scales, decoded)
}

/// An MXFP4 checkpoint (`quant_method` `mxfp4`, the experts as `_blocks`
/// and `_scales`) serves as the float checkpoint holding the values its
/// blocks decode to: its experts stay MXFP4 in memory (17 bytes per 32
/// values, about 0.27× of bf16), and the MXFP4 kernel's products are the
/// decoded values' exactly, so the logprobs differ by summation order only
/// (within the f32 tolerance) and the greedy tokens are the same.
#[test]
fn an_mxfp4_checkpoint_serves_as_its_dequantized_experts() {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let dir = tempfile::tempdir().expect("tempdir");
    let quant = edited(&dir.path().join("q"), |v| {
        v["quantization_config"] = serde_json::json!({"quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
    });
    let float = edited(&dir.path().join("f"), |_| {});
    let bytes = std::fs::read(fixture().join("model.safetensors")).expect("weights");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let (mut q, mut f): (Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, Vec<_>) = (vec![], vec![]);
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut quantized = 0;
    let mut expert_values = 0;
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        if !(name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj")) {
            q.push((
                name.clone(),
                Dtype::F32,
                shape.clone(),
                view.data().to_vec(),
            ));
            f.push((name, Dtype::F32, shape, view.data().to_vec()));
            continue;
        }
        let w: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (n, rows, cols) = (shape[0], shape[1], shape[2]);
        let (blocks, scales, decoded) = mxfp4(&w, n, rows, cols);
        assert_ne!(decoded, w, "{name}: 4 bits change the weights");
        expert_values += w.len();
        q.push((
            format!("{name}_blocks"),
            Dtype::U8,
            vec![n, cols, rows / 32, 16],
            blocks,
        ));
        q.push((
            format!("{name}_scales"),
            Dtype::U8,
            vec![n, cols, rows / 32],
            scales,
        ));
        f.push((name, Dtype::F32, shape, le(&decoded)));
        quantized += 1;
    }
    assert_eq!(quantized, 4, "two stacks in each of two layers");
    for (folder, tensors) in [(&quant, &q), (&float, &f)] {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
            .collect();
        std::fs::write(
            folder.join("model.safetensors"),
            safetensors::serialize(views, None).expect("serialize"),
        )
        .expect("write weights");
    }
    let prompts: Vec<Vec<u32>> = vec![(1..40).collect(), (100..120).rev().collect()];
    let mut params = SamplingParams::greedy(12);
    params.ignore_eos = true;
    params.prompt_logprobs = Some(1);
    let run = |model: &Path| {
        let mut llm = LLM::new(args(model)).unwrap_or_else(|e| panic!("{e:#}"));
        prompts
            .iter()
            .map(|p| {
                let o = llm
                    .generate(&[Prompt::Tokens(p.clone())], &params)
                    .expect("generate");
                let lp: Vec<f32> = o[0]
                    .prompt_logprobs
                    .as_ref()
                    .expect("prompt logprobs")
                    .iter()
                    .map(|l| l.logprob)
                    .collect();
                (lp, o[0].outputs[0].token_ids.clone())
            })
            .collect::<Vec<_>>()
    };
    let (got, want) = (run(&quant), run(&float));
    let mut worst = 0f64;
    for ((lq, tq), (lf, tf)) in got.iter().zip(&want) {
        assert_eq!(tq, tf, "greedy tokens");
        assert_eq!(lq.len(), lf.len());
        for (a, b) in lq.iter().zip(lf) {
            worst = worst.max((*a as f64 - *b as f64).abs());
        }
    }
    eprintln!(
        "gpt_oss mxfp4: largest prompt logprob difference from the decoded f32 model {worst:.2e}"
    );
    assert!(
        worst <= TOL,
        "mxfp4 logprobs {worst} from the decoded model's"
    );
    // Every block and scale is read, and nothing else is left over; the
    // experts are resident as MXFP4: everything else is stored alike in
    // both models (f32), so the difference of the two models' weight bytes
    // is the experts' f32 bytes less their MXFP4 bytes.
    let load = |model: &Path| {
        let a = args(model);
        let backend = pagoda::engine::args::cpu_backend(&a).expect("backend");
        let (m, loaded) = pagoda::engine::args::load_model(&backend, &a, |_| 128)
            .unwrap_or_else(|e| panic!("{e:#}"));
        (m.weight_bytes(), loaded.unused_tensors)
    };
    let (quant_bytes, unused) = load(&quant);
    assert_eq!(unused, Vec::<String>::new());
    let (float_bytes, _) = load(&float);
    let expert_mxfp4 = quant_bytes - (float_bytes - 4 * expert_values);
    assert_eq!(
        expert_mxfp4 * 32,
        expert_values * 17,
        "17 bytes per 32 values"
    );
    let vs_bf16 = expert_mxfp4 as f64 / (2 * expert_values) as f64;
    eprintln!(
        "gpt_oss mxfp4: {expert_values} expert values resident in {expert_mxfp4} bytes, {vs_bf16:.4}x of bf16"
    );
    assert!((vs_bf16 - 17.0 / 64.0).abs() < 1e-12);
}

/// Served in bfloat16 (`--dtype bfloat16`: the fused experts, like every
/// other matrix, stored as bf16), the logprobs stay near transformers'
/// float32 ones: rounding the weights to 8 bits of mantissa moves them by
/// at most a few hundredths here, where a wrongly laid-out expert moves
/// them by whole nats.
#[test]
fn gpt_oss_in_bfloat16_stays_near_transformers_float32() {
    let mut a = args(&fixture());
    a.dtype = DType::BFloat16;
    let backend = pagoda::engine::args::cpu_backend(&a).expect("backend");
    let (m, _) =
        pagoda::engine::args::load_model(&backend, &a, |_| 128).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(m.weight_type(), "BF16");
    drop(m);
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json"),
    )
    .expect("reference JSON");
    let mut llm = LLM::new(a).unwrap_or_else(|e| panic!("{e:#}"));
    let mut worst = 0f64;
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = u32s(&case["prompt_ids"]);
        let want = f64s(&case["prompt_logprobs"]);
        let mut params = SamplingParams::greedy(1);
        params.prompt_logprobs = Some(1);
        let out = llm
            .generate(&[Prompt::Tokens(prompt)], &params)
            .expect("generate");
        for (l, w) in out[0]
            .prompt_logprobs
            .as_ref()
            .expect("prompt logprobs")
            .iter()
            .zip(&want[1..])
        {
            worst = worst.max((l.logprob as f64 - w.expect("logprob")).abs());
        }
    }
    eprintln!("gpt_oss (bfloat16): largest prompt logprob difference {worst:.2e}");
    assert!(worst < 0.1, "bf16 logprobs {worst} from transformers' f32");
}
