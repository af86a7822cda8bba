//! Quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors,
//! Ascend ModelSlim) load with their weights kept quantized, and compute
//! what their files say.
//!
//! The fixtures are generated: `scripts/quantize-hf.py` (numpy) quantizes
//! the tiny random Llama and Qwen2 models of the test support into each
//! format, packed as the reference packers pack it (round-to-nearest), with
//! `model.layers.0.mlp.down_proj` left dense as each format marks an
//! ignored layer, and writes its own numpy dequantization of the files.
//!
//! Specification checked here, for every format and both models:
//! - Every quantized layer loads as a quantized block type (Q4_0 for
//!   symmetric int4, Q4_1 for asymmetric int4, Q8_0 for int8) at under a
//!   third of its f32 size, and dequantizes to the numpy dequantization bit
//!   for bit: GPTQ's input packing, `zero − 1` and `desc_act` permutation,
//!   AWQ's nibble order, compressed-tensors' offset codes and ModelSlim's
//!   scales are read as their packers wrote them. The ignored layer loads
//!   dense with the source's exact values.
//! - The logits match an f64 forward pass over the numpy-dequantized
//!   weights, in prefill, chunked prefill and batched decode, within the
//!   error the int8 activations allow (see [`tolerance`]); static W8A8
//!   layers round their inputs onto the checkpoint's grid in both.
//! - Greedy continuations through the public `LLM` API follow the
//!   reference's argmax chain.
//! - Bad checkpoints are refused at load with a message naming the tensor
//!   (or the config entry), never a panic: wrong shapes, missing scales,
//!   3-bit GPTQ, a packed tensor of the wrong length, a config whose method
//!   the tensors do not match, a config that quantizes a layer the file
//!   keeps in float.
//! - `--quantization` is checked against the folder (a mismatch names
//!   both), `w8a8` accepts either W8A8 format, and `int8` quantizes a float
//!   checkpoint's layers at load.

mod support;

use pagoda::engine::args::{load_model, LoadedModel};
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::loader::hf_quant::QuantizationArg;
use pagoda::engine::loader::safetensors::SafetensorsSource;
use pagoda::engine::loader::{DType, WeightSource};
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use pagoda_accel::GgmlType;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use support::reference::*;
use support::tiny_model::{Storage, TinyModel, TinySpec};

/// The layer every fixture leaves dense.
const IGNORED: &str = "model.layers.0.mlp.down_proj";

/// One format the script writes: a name, its arguments, and what its
/// quantized layers are held as.
struct Format {
    name: &'static str,
    args: &'static [&'static str],
    held: GgmlType,
    /// Whether the inputs of its layers are rounded onto a static grid.
    static_input: bool,
}

const FORMATS: &[Format] = &[
    Format {
        name: "gptq int4 group 32",
        args: &["--method", "gptq", "--bits", "4", "--group-size", "32"],
        held: GgmlType::Q4_0,
        static_input: false,
    },
    Format {
        name: "gptq int4 group 32 desc_act asymmetric",
        args: &[
            "--method",
            "gptq",
            "--bits",
            "4",
            "--group-size",
            "32",
            "--desc-act",
            "--asym",
        ],
        held: GgmlType::Q4_1,
        static_input: false,
    },
    Format {
        name: "gptq int8 one group per row",
        args: &["--method", "gptq", "--bits", "8", "--group-size", "-1"],
        held: GgmlType::Q8_0,
        static_input: false,
    },
    Format {
        name: "gptq int8 group 32 desc_act",
        args: &[
            "--method",
            "gptq",
            "--bits",
            "8",
            "--group-size",
            "32",
            "--desc-act",
        ],
        held: GgmlType::Q8_0,
        static_input: false,
    },
    Format {
        name: "awq int4 group 32",
        args: &["--method", "awq", "--group-size", "32"],
        held: GgmlType::Q4_1,
        static_input: false,
    },
    Format {
        name: "compressed-tensors W8A8 dynamic",
        args: &["--method", "ct-w8a8"],
        held: GgmlType::Q8_0,
        static_input: false,
    },
    Format {
        name: "compressed-tensors W8A8 static",
        args: &["--method", "ct-w8a8", "--static-input"],
        held: GgmlType::Q8_0,
        static_input: true,
    },
    Format {
        name: "compressed-tensors W4A16 group 32",
        args: &["--method", "ct-w4a16", "--group-size", "32"],
        held: GgmlType::Q4_0,
        static_input: false,
    },
    Format {
        name: "compressed-tensors W4A16 group 32 asymmetric",
        args: &["--method", "ct-w4a16", "--group-size", "32", "--asym"],
        held: GgmlType::Q4_1,
        static_input: false,
    },
    Format {
        name: "ModelSlim W8A8",
        args: &["--method", "modelslim-w8a8"],
        held: GgmlType::Q8_0,
        static_input: true,
    },
    Format {
        name: "ModelSlim W8A8_DYNAMIC",
        args: &["--method", "modelslim-w8a8-dynamic"],
        held: GgmlType::Q8_0,
        static_input: false,
    },
];

/// Relative tolerance (of the logit scale) of the engine against the f64
/// forward over the same dequantized weights. The weights are identical, so
/// the difference is the activations: the int8 kernels quantize each
/// 32-element block of every input to int8 (relative error up to 1/254 per
/// element), and static W8A8 layers then re-quantize inputs that are
/// already on the checkpoint's grid. The tiny models amplify relative
/// perturbations about 20-fold (their attention is deliberately peaked:
/// per-channel int8 weights alone move the logits by 5e-2), so the
/// activations' rounding shows as 3e-2 to 7e-2 with dynamic activations
/// and up to 1.7e-1 with static ones, whose fixed grids also clamp (measured
/// on every format here).
/// Simulating the kernels' activation rounding in the reference brings the
/// formats without a column order or static grid to 3e-7 until a rounding
/// tie falls differently in f32 and f64, which is why the reference stays
/// unrounded. Misreading a format costs far more (see
/// `the_comparison_would_notice_a_misread_format`).
fn tolerance(f: &Format) -> f64 {
    if f.static_input {
        2.5e-1
    } else {
        1e-1
    }
}

/// A quantized folder and what the script says about it.
struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    /// The float model it was quantized from.
    source: TinyModel,
    /// The numpy dequantization and static grids (see the script).
    reference: HashMap<String, Vec<f32>>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/quantize-hf.py")
}

/// Writes `spec`'s model in f32 and quantizes it with `args`.
fn quantize(spec: TinySpec, args: &[&str]) -> Fixture {
    let source = TinyModel::random(spec);
    let dir = tempfile::tempdir().expect("tempdir");
    let (src, dst, refp) = (
        dir.path().join("float"),
        dir.path().join("quantized"),
        dir.path().join("reference.safetensors"),
    );
    source.write_hf(&src, Storage::F32, 1);
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .args(["--ignore", IGNORED, "--seed", "7", "--reference"])
        .args([&refp, &src, &dst])
        .output()
        .expect("run python3 scripts/quantize-hf.py (needs numpy)");
    assert!(
        out.status.success(),
        "quantize-hf.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&refp).expect("read the reference");
    let st = SafeTensors::deserialize(&bytes).expect("a valid reference file");
    let reference = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), Dtype::F32, "{name}");
            let v = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, v)
        })
        .collect();
    Fixture {
        _dir: dir,
        path: dst,
        source,
        reference,
    }
}

impl Fixture {
    /// The source model with every quantized layer's weights replaced by
    /// the numpy dequantization (and folded biases by the files' biases).
    fn dequantized_model(&self) -> TinyModel {
        let mut m = self.source.clone();
        for (name, v) in &self.reference {
            if name.ends_with(".weight") || name.ends_with(".bias") {
                m.get_mut(name).data = v.clone();
            }
        }
        m
    }

    /// The static grid of `layer`'s input, if it has one.
    fn grid(&self, layer: &str) -> Option<(f64, f64)> {
        let s = self.reference.get(&format!("{layer}.input_scale"))?;
        let o = &self.reference[&format!("{layer}.input_offset")];
        Some((s[0] as f64, o[0] as f64))
    }

    /// Rounds inputs onto each layer's static grid, as the checkpoint's
    /// runtime quantizes them: `clamp(round(x / s + o), −128, 127)`, seen
    /// as `(q − o) · s`.
    fn round_inputs(&self, layer: &str, x: &mut [f64]) {
        if let Some((s, o)) = self.grid(layer) {
            for v in x {
                let q = (*v / s + o).round_ties_even().clamp(-128.0, 127.0);
                *v = (q - o) * s;
            }
        }
    }
}

/// The quantized layers of a model: (weight name, rows, cols).
fn linears(spec: &TinySpec) -> Vec<(String, usize, usize)> {
    let (d, q, kv, f) = (
        spec.hidden_size,
        spec.q_dim(),
        spec.kv_dim(),
        spec.intermediate_size,
    );
    let mut out = Vec::new();
    for l in 0..spec.num_layers {
        for (name, rows, cols) in [
            ("self_attn.q_proj", q, d),
            ("self_attn.k_proj", kv, d),
            ("self_attn.v_proj", kv, d),
            ("self_attn.o_proj", d, q),
            ("mlp.gate_proj", f, d),
            ("mlp.up_proj", f, d),
            ("mlp.down_proj", d, f),
        ] {
            out.push((format!("model.layers.{l}.{name}.weight"), rows, cols));
        }
    }
    out
}

fn specs() -> [TinySpec; 2] {
    [TinySpec::llama(), TinySpec::qwen2()]
}

#[test]
fn every_format_dequantizes_to_the_numpy_reference_bit_for_bit() {
    for spec in specs() {
        for f in FORMATS {
            let what = format!("{:?} {}", spec.family, f.name);
            let fx = quantize(spec.clone(), f.args);
            let src = SafetensorsSource::open(&fx.path, DType::Auto, None)
                .unwrap_or_else(|e| panic!("{what}: open: {e:#}"));
            for (name, rows, cols) in linears(&spec) {
                let m = src
                    .matrix(&name, rows, cols)
                    .unwrap_or_else(|e| panic!("{what}: {name}: {e:#}"));
                let got = m.dequantize().expect("dequantize");
                if name.starts_with(IGNORED) {
                    assert_eq!(m.ty(), GgmlType::F32, "{what}: {name} stays dense");
                    assert_eq!(got, fx.source.get(&name).data, "{what}: {name}");
                    continue;
                }
                assert_eq!(m.ty(), f.held, "{what}: {name}: held as");
                let f32_bytes = rows * cols * 4;
                assert!(
                    m.bytes().len() * 3 < f32_bytes,
                    "{what}: {name}: {} bytes is not quantized ({f32_bytes} as f32)",
                    m.bytes().len()
                );
                let want = &fx.reference[&name];
                let mismatch = got
                    .iter()
                    .zip(want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                if let Some(i) = mismatch {
                    panic!(
                        "{what}: {name}: element ({}, {}) is {} but numpy dequantizes it to {}",
                        i / cols,
                        i % cols,
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

#[test]
fn every_format_matches_the_f64_forward_over_its_dequantized_weights() {
    for spec in specs() {
        for f in FORMATS {
            let what = format!("{:?} {}", spec.family, f.name);
            let fx = quantize(spec.clone(), f.args);
            let (model, _) = load(&fx.path, DType::Auto);
            let weights = fx.dequantized_model();
            check_against_reference_with(&what, &model, &weights, tolerance(f), &|l, x| {
                fx.round_inputs(l, x)
            });
        }
    }
}

#[test]
fn the_comparison_would_notice_a_misread_format() {
    // The GPTQ desc_act fixture read as if its columns were in order misses
    // by far more than the tolerance: the check above can tell a right
    // reading from a wrong one.
    let spec = TinySpec::llama();
    let gptq = quantize(spec.clone(), FORMATS[1].args);
    let (model, _) = load(&gptq.path, DType::Auto);
    let mut wrong = gptq.dequantized_model();
    let (name, rows, cols) = linears(&spec).swap_remove(0);
    let src = SafetensorsSource::open(&gptq.path, DType::Auto, None).expect("open");
    let held = src.matrix(&name, rows, cols).expect("matrix");
    // The stored column order: the values without the un-permutation.
    let stored = pagoda_accel::HostMatrix::new(held.ty(), rows, cols, held.bytes().to_vec())
        .expect("matrix")
        .dequantize()
        .expect("dequantize");
    wrong.get_mut(&name).data = stored;
    let vocab = spec.vocab_size();
    let (seqs, schedule) = two_sequences(vocab);
    let got = run_schedule(&model, &seqs, &schedule);
    let want = reference_logits(&wrong, &seqs[0], Mistakes::default());
    let (e, _, _) = relative_error(&got[0], &want);
    assert!(
        e > 3.0 * tolerance(&FORMATS[1]),
        "ignoring desc_act's order changes the logits by only {e:.2e}"
    );
}

/// The engine's greedy continuation of a fixed prompt, and its prompt ids.
fn llm_greedy(
    path: &Path,
    n: usize,
    quantization: Option<QuantizationArg>,
) -> (Vec<u32>, Vec<u32>) {
    let mut args = EngineArgs::new(path);
    args.threads = 2;
    args.max_model_len = Some(MAX_POSITIONS);
    args.kv_cache_memory = Some(4 << 20);
    args.kv_cache_dtype = KvCacheDtype::F32;
    args.quantization = quantization;
    let mut llm = LLM::new(args).unwrap_or_else(|e| panic!("LLM::new({}): {e:#}", path.display()));
    let mut params = SamplingParams::greedy(n);
    params.ignore_eos = true;
    let out = llm
        .generate(
            &[Prompt::from(
                "hello world the cat sat on the mat in the dog",
            )],
            &params,
        )
        .expect("generate");
    (
        out[0].prompt_token_ids.clone(),
        out[0].outputs[0].token_ids.clone(),
    )
}

#[test]
fn greedy_continuations_follow_the_reference_argmax_chain() {
    const N: usize = 8;
    for spec in specs() {
        for f in FORMATS {
            let what = format!("{:?} {}", spec.family, f.name);
            let fx = quantize(spec.clone(), f.args);
            let (prompt, got) = llm_greedy(&fx.path, N, None);
            let weights = fx.dequantized_model();
            let mut seq = prompt.clone();
            for (step, &tok) in got.iter().enumerate() {
                let logits = reference_logits_with(&weights, &seq, Mistakes::default(), &|l, x| {
                    fx.round_inputs(l, x)
                });
                let last = logits.last().expect("logits");
                let scale = last.iter().fold(0f64, |a, v| a.max(v.abs()));
                let (want, margin) = argmax(last);
                if tok != want {
                    // Only a near-tie may go either way within the tolerance.
                    let gap = last[want as usize] - last[tok as usize];
                    assert!(
                        gap <= 2.0 * tolerance(f) * scale,
                        "{what}: step {step}: engine chose {tok}, the reference {want} by {gap:.3} (margin {margin:.3}, scale {scale:.1})"
                    );
                    break;
                }
                seq.push(tok);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Bad checkpoints.
// ---------------------------------------------------------------------------

/// Rewrites the fixture's `model.safetensors` through `edit`, which gets
/// every tensor as (dtype, shape, bytes) by name.
fn edit_tensors(
    fx: &Fixture,
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = fx.path.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("valid");
    let mut all: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut all);
    let views: BTreeMap<String, TensorView<'_>> = all
        .iter()
        .map(|(n, (dt, shape, data))| {
            (
                n.clone(),
                TensorView::new(*dt, shape.clone(), data).expect("a consistent view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).expect("write");
}

/// Rewrites `config.json`'s `quantization_config` through `edit`.
fn edit_config(fx: &Fixture, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = fx.path.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut c["quantization_config"]);
    std::fs::write(&path, c.to_string()).expect("write");
}

/// Loading `fx` with `quantization` fails; returns the message.
fn load_error(path: &Path, quantization: Option<QuantizationArg>) -> String {
    let mut args = EngineArgs::new(path);
    args.quantization = quantization;
    match load_model(&backend(&args), &args, |_| MAX_POSITIONS) {
        Ok(_) => panic!("{} loaded, but it should be refused", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "the message should mention '{p}': {msg}");
    }
}

const Q: &str = "model.layers.1.self_attn.q_proj";

#[test]
fn bad_gptq_checkpoints_are_refused_naming_the_tensor() {
    let gptq = || quantize(TinySpec::llama(), FORMATS[0].args);

    // Scales of the wrong shape.
    let fx = gptq();
    edit_tensors(&fx, |t| {
        let s = t.get_mut(&format!("{Q}.scales")).expect("scales");
        s.1 = vec![s.1[0] * 2, s.1[1] / 2];
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.scales"), "shape"],
    );

    // Missing scales.
    let fx = gptq();
    edit_tensors(&fx, |t| {
        t.remove(&format!("{Q}.scales"));
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.scales"), "missing"],
    );

    // A packed tensor of the wrong length (one word row short).
    let fx = gptq();
    edit_tensors(&fx, |t| {
        let w = t.get_mut(&format!("{Q}.qweight")).expect("qweight");
        let row = w.1[1] * 4;
        w.1[0] -= 1;
        w.2.truncate(w.2.len() - row);
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.qweight"), "shape"],
    );

    // bits = 3.
    let fx = gptq();
    edit_config(&fx, |q| q["bits"] = 3.into());
    assert_mentions(&load_error(&fx.path, None), &["bits = 3", "config.json"]);

    // g_idx naming a group that does not exist.
    let fx = gptq();
    edit_tensors(&fx, |t| {
        let g = t.get_mut(&format!("{Q}.g_idx")).expect("g_idx");
        g.2[0..4].copy_from_slice(&99i32.to_le_bytes());
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.g_idx"), "group 99"],
    );

    // A layer the config quantizes, stored in float.
    let fx = gptq();
    edit_tensors(&fx, |t| {
        for part in ["qweight", "qzeros", "scales", "g_idx"] {
            t.remove(&format!("{Q}.{part}"));
        }
        let n = 64 * 64;
        t.insert(
            format!("{Q}.weight"),
            (Dtype::F32, vec![64, 64], vec![0u8; n * 4]),
        );
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.qweight"), "missing"],
    );
}

#[test]
fn a_config_whose_method_the_tensors_do_not_match_is_refused() {
    // GPTQ tensors under an AWQ config: AWQ packs along the output.
    let fx = quantize(TinySpec::llama(), FORMATS[0].args);
    edit_config(
        &fx,
        |q| *q = serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm"}),
    );
    assert_mentions(
        &load_error(&fx.path, None),
        &["model.layers.0.self_attn.q_proj.qweight", "shape"],
    );

    // GPTQ tensors under a compressed-tensors config.
    let fx = quantize(TinySpec::llama(), FORMATS[0].args);
    edit_config(&fx, |q| {
        *q = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"}}},
            "ignore": ["lm_head"]
        })
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &["model.layers.0.self_attn.q_proj.weight_scale", "missing"],
    );

    // A ModelSlim layer the description calls W8A8 but stored in float.
    let fx = quantize(TinySpec::llama(), FORMATS[9].args);
    edit_tensors(&fx, |t| {
        let w = t.get_mut(&format!("{Q}.weight")).expect("weight");
        *w = (Dtype::F32, w.1.clone(), vec![0u8; w.2.len() * 4]);
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.weight"), "int8"],
    );

    // compressed-tensors W4A16 with a packed tensor of the wrong length.
    let fx = quantize(TinySpec::llama(), FORMATS[7].args);
    edit_tensors(&fx, |t| {
        let w = t
            .get_mut(&format!("{Q}.weight_packed"))
            .expect("weight_packed");
        w.1[1] -= 1;
        let (rows, cols) = (w.1[0], w.1[1]);
        w.2.truncate(rows * cols * 4);
    });
    assert_mentions(
        &load_error(&fx.path, None),
        &[&format!("{Q}.weight_packed"), "shape"],
    );
}

#[test]
fn the_quantization_flag_is_checked_against_the_folder() {
    let gptq = quantize(TinySpec::llama(), FORMATS[0].args);
    let msg = load_error(&gptq.path, Some(QuantizationArg::Awq));
    assert_mentions(&msg, &["--quantization awq", "gptq", "--quantization gptq"]);
    let msg = load_error(&gptq.path, Some(QuantizationArg::W8A8));
    assert_mentions(&msg, &["--quantization w8a8", "gptq int4"]);

    // vLLM's names for the same methods load.
    for q in ["gptq", "gptq_marlin"] {
        let arg: QuantizationArg = q.parse().expect("a method");
        let (_, got) = llm_greedy(&gptq.path, 2, Some(arg));
        assert_eq!(got.len(), 2, "--quantization {q}");
    }
    // The seed's w8a8 takes either W8A8 format; ascend only ModelSlim's.
    let ct = quantize(TinySpec::llama(), FORMATS[5].args);
    let slim = quantize(TinySpec::llama(), FORMATS[9].args);
    for path in [&ct.path, &slim.path] {
        llm_greedy(path, 2, Some(QuantizationArg::W8A8));
    }
    llm_greedy(&slim.path, 2, Some(QuantizationArg::Ascend));
    let msg = load_error(&ct.path, Some(QuantizationArg::Ascend));
    assert_mentions(&msg, &["--quantization ascend", "compressed-tensors"]);
    // W4A16 is not W8A8.
    let w4 = quantize(TinySpec::llama(), FORMATS[7].args);
    assert_mentions(
        &load_error(&w4.path, Some(QuantizationArg::W8A8)),
        &["W4A16"],
    );
    // int8 is for float checkpoints.
    assert_mentions(
        &load_error(&gptq.path, Some(QuantizationArg::Int8)),
        &["quantized already"],
    );
    let err = "fp8".parse::<QuantizationArg>().expect_err("unsupported");
    assert_mentions(&format!("{err}"), &["fp8", "gptq", "int8"]);
}

#[test]
fn online_int8_quantizes_a_float_checkpoint_at_load() {
    for spec in specs() {
        let m = TinyModel::random(spec.clone());
        let dir = tempfile::tempdir().expect("tempdir");
        m.write_hf(dir.path(), Storage::BF16, 1);
        let src = SafetensorsSource::open(dir.path(), DType::Auto, Some(QuantizationArg::Int8))
            .expect("open");
        let bf16 = m.map(false, |x| Storage::BF16.round(x));
        for (name, rows, cols) in linears(&spec) {
            let held = src.matrix(&name, rows, cols).expect("matrix");
            assert_eq!(held.ty(), GgmlType::Q8_0, "{name}");
            // Round-to-nearest int8 per 32 values: within half a step, plus
            // the step's own rounding to f16 (2^-11 of it, times |q| ≤ 127).
            let got = held.dequantize().expect("dequantize");
            let want = &bf16.get(&name).data;
            for (lane, (g, w)) in got.chunks(32).zip(want.chunks(32)).enumerate() {
                let step = w.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                for (a, b) in g.iter().zip(w) {
                    assert!(
                        (a - b).abs() <= (0.5 + 127.0 / 2048.0) * step + 1e-7,
                        "{name}: lane {lane}: {a} vs {b} (step {step})"
                    );
                }
            }
        }
        // Embeddings and the LM head stay as stored.
        let e = src
            .matrix(
                "model.embed_tokens.weight",
                spec.vocab_size(),
                spec.hidden_size,
            )
            .expect("embeddings");
        assert_eq!(e.ty(), GgmlType::BF16);

        let mut args = EngineArgs::new(dir.path());
        args.quantization = Some(QuantizationArg::Int8);
        let (model, loaded): (_, LoadedModel) =
            load_model(&backend(&args), &args, |_| MAX_POSITIONS).expect("load");
        let _ = loaded;
        // The f64 forward over the bf16 weights: int8 weights add their
        // rounding (half a step of 1/127 per value) to the activations'
        // (see `tolerance`); measured 4e-2.
        check_against_reference("online int8", &model, &bf16, 1e-1);
    }
}
