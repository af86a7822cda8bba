//! The hybrid Qwen models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from the GGUF
//! files llama.cpp's own converter writes (architectures `qwen35`,
//! `qwen35moe`, `qwen3next`; tests/fixtures/hf-families-2026/gguf, see its
//! README), served in float32: the loader undoes the converter's layout
//! (value heads reordered, `A_log` folded into `-exp(A_log)`, norms stored
//! as `1 + w`, Qwen3-Next's q/k/v/z split), so the logprobs agree with
//! transformers' float32 `reference.json` as closely as the Hugging Face
//! folders do (host/tests/hf_families.rs), and greedy ids agree up to the
//! first near-tie.

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

/// The same bound as the Hugging Face folders' (`hybrid_tol` in
/// hf_families.rs): 1e-4, and 3e-4 for qwen3_next, whose first case is
/// worse conditioned (transformers' own float32 is 1.0e-4 from float64).
fn tol(family: &str) -> f64 {
    match family {
        "qwen3_next" => 3e-4,
        _ => 1e-4,
    }
}

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
/// top-two gap is under `near_tie`. Returns the largest logprob difference.
fn check_against_reference(family: &str, what: &str, model: &Path, tol: f64, near_tie: f64) -> f64 {
    let reference = reference(family);
    let mut llm = engine(model).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    support::transformers_reference::check_cases(
        &reference,
        what,
        &mut llm,
        tol,
        near_tie,
        u32::MAX,
    )
}

fn gguf_agrees_with_transformers(family: &str) {
    let what = format!("{family} (llama.cpp's f32 GGUF)");
    check_against_reference(family, &what, &gguf(family, "f32"), tol(family), NEAR_TIE);
}

#[test]
fn qwen35_gguf_with_tiled_value_heads_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_5");
}

#[test]
fn qwen35moe_gguf_with_stacked_experts_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_5_moe");
}

#[test]
fn qwen3next_gguf_with_split_qkvz_agrees_with_transformers() {
    gguf_agrees_with_transformers("qwen3_next");
}

/// The same files quantized to Q8_0 by llama.cpp's `llama-quantize`
/// (`<family>.q8_0.gguf`; it leaves the conv1d kernel and the per-head
/// vectors f32). These tiny random models are too sensitive to 8-bit
/// rounding for their logprobs to check the layout (the Q8_0 weights alone,
/// dequantized and served in f32, move them by 2.3 to 7.7 nats from
/// transformers'; Pagoda and llama.cpp on the Q8_0 files part from each
/// other within a few greedy steps, see docs/benchmarks.md), so the
/// rebuilt Gated DeltaNet matrices are compared with those rebuilt from
/// the f32 file (which the tests above check against transformers)
/// instead, to check what is particular to quantized tensors (whole Q8_0
/// rows moved as bytes, columns reordered through dequantization): within Q8_0's rounding (a block's step, max|w|/127, bounds
/// it) everywhere, where a row or column taken from the wrong head
/// would be off by the weights' own size. The projections stay Q8_0 (their
/// rows move in whole blocks); `ssm_out`, whose columns are reordered
/// through its blocks, comes back dequantized.
#[test]
fn q8_0_gguf_files_rebuild_the_same_matrices_as_the_f32_ones() {
    use pagoda::engine::loader::gguf_weights::GgufWeights;
    use pagoda::engine::loader::WeightSource;
    for family in ["qwen3_5", "qwen3_5_moe", "qwen3_next"] {
        let f32_file = GgufFile::open(&gguf(family, "f32")).expect("f32 file");
        let q8_file = GgufFile::open(&gguf(family, "q8_0")).expect("q8_0 file");
        let config = ModelConfig::from_gguf(&f32_file).expect("f32 config");
        assert_eq!(
            ModelConfig::from_gguf(&q8_file).expect("q8_0 config"),
            config
        );
        let h = config.hybrid.clone().expect("hybrid");
        let exact = GgufWeights::new(&f32_file, DType::Auto).for_model(&config);
        let quant = GgufWeights::new(&q8_file, DType::Auto).for_model(&config);
        let (d, kd, vd, nv) = (
            config.hidden_size,
            h.n_k_heads * h.k_dim,
            h.n_v_heads * h.v_dim,
            h.n_v_heads,
        );
        let projections: Vec<(&str, usize, usize)> = match family {
            "qwen3_next" => vec![
                ("in_proj_qkvz", 2 * kd + 2 * vd, d),
                ("in_proj_ba", 2 * nv, d),
            ],
            _ => vec![
                ("in_proj_qkv", 2 * kd + vd, d),
                ("in_proj_z", vd, d),
                ("in_proj_b", nv, d),
                ("in_proj_a", nv, d),
            ],
        };
        let mut worst = 0f32;
        for (i, _) in h.linear_layers.iter().enumerate().filter(|(_, &l)| l) {
            let all = projections.iter().map(|&(n, r, c)| (n, r, c, true)).chain([
                ("out_proj", d, vd, false),
                ("conv1d", 2 * kd + vd, h.conv_kernel, false),
            ]);
            for (part, rows, cols, quantized) in all {
                let name = format!("model.layers.{i}.linear_attn.{part}.weight");
                let want = exact.matrix(&name, rows, cols).expect("f32 matrix");
                let got = quant
                    .matrix(&name, rows, cols)
                    .unwrap_or_else(|e| panic!("{family} {name}: {e:#}"));
                if quantized {
                    assert_eq!(got.ty().name(), "Q8_0", "{family} {name} kept quantized");
                }
                let (want, got) = (
                    want.dequantize().expect("f32"),
                    got.dequantize().expect("q8"),
                );
                // A block's step is its max / 127; the rounding is half
                // a step, plus the scale's own f16 rounding (< 0.1 step).
                let bound = want.iter().fold(0f32, |m, w| m.max(w.abs())) / 127.0;
                for (k, (w, g)) in want.iter().zip(&got).enumerate() {
                    let err = (w - g).abs();
                    worst = worst.max(err / bound);
                    assert!(
                        err <= bound,
                        "{family} {name}[{}, {}]: {g} from Q8_0, {w} from f32 (bound {bound})",
                        k / cols,
                        k % cols
                    );
                }
            }
        }
        eprintln!("{family}: largest Q8_0 error {worst:.2} of the bound");
    }
}

#[test]
fn q8_0_gguf_files_load_quantized_and_generate() {
    for family in ["qwen3_5", "qwen3_5_moe", "qwen3_next"] {
        let path = gguf(family, "q8_0");
        let mut a = EngineArgs::new(&path);
        a.threads = 1;
        let backend = pagoda::engine::args::cpu_backend(&a).expect("backend");
        let (model, _) = pagoda::engine::args::load_model(&backend, &a, |_| 128)
            .unwrap_or_else(|e| panic!("{family} Q8_0: {e:#}"));
        assert_eq!(model.weight_type(), "Q8_0", "{family}: kept quantized");
        let mut llm = engine(&path).unwrap_or_else(|e| panic!("{family} Q8_0: {e:#}"));
        let prompt = u32s(&reference(family)["cases"][0]["prompt_ids"]);
        let mut params = SamplingParams::greedy(4);
        params.prompt_logprobs = Some(1);
        let out = llm
            .generate(&[Prompt::Tokens(prompt.clone())], &params)
            .unwrap_or_else(|e| panic!("{family} Q8_0: {e:#}"));
        let lp = out[0].prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(lp.len(), prompt.len() - 1);
        assert!(lp.iter().all(|l| l.logprob.is_finite() && l.logprob <= 0.0));
        assert_eq!(out[0].outputs[0].token_ids.len(), 4);
    }
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

/// Every metadata key that changes the math is computed or refused by
/// name: an edited copy of a fixture is refused, naming the key.
#[test]
fn metadata_that_changes_the_math_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The untouched copy loads (so the refusals below are the edits').
    let same = edited("qwen3_5", dir.path(), |_| {});
    ModelConfig::from_gguf(&GgufFile::open(&same).expect("open")).expect("unchanged copy");
    let cases: Vec<(&str, Box<dyn Fn(&mut Vec<(String, GgufValue)>)>, &str)> = vec![
        (
            "qwen3_5",
            Box::new(set(
                "qwen35.rope.scaling.type",
                GgufValue::String("yarn".into()),
            )),
            "qwen35.rope.scaling.type",
        ),
        (
            "qwen3_5",
            Box::new(set(
                "qwen35.rope.dimension_sections",
                GgufValue::Array([3, 1, 1, 0].map(GgufValue::I32).to_vec()),
            )),
            "qwen35.rope.dimension_sections",
        ),
        (
            "qwen3_5",
            Box::new(set("qwen35.ssm.time_step_rank", GgufValue::U32(3))),
            "qwen35.ssm.time_step_rank",
        ),
        (
            "qwen3_5",
            Box::new(set("qwen35.attention.value_length", GgufValue::U32(16))),
            "qwen35.attention.value_length",
        ),
        (
            "qwen3_5",
            Box::new(|m: &mut Vec<(String, GgufValue)>| {
                m.retain(|(k, _)| k != "qwen35.rope.dimension_count")
            }),
            "qwen35.rope.dimension_count",
        ),
        (
            "qwen3_5",
            Box::new(set(
                "qwen35.attention.recurrent_layers",
                GgufValue::Array(vec![GgufValue::Bool(true); 3]),
            )),
            "qwen35.attention.recurrent_layers",
        ),
        (
            "qwen3_5_moe",
            Box::new(set("qwen35moe.expert_weights_norm", GgufValue::Bool(false))),
            "qwen35moe.expert_weights_norm",
        ),
        (
            "qwen3_5_moe",
            Box::new(set("qwen35moe.expert_gating_func", GgufValue::U32(2))),
            "qwen35moe.expert_gating_func",
        ),
        (
            "qwen3_next",
            Box::new(set(
                "qwen3next.rope.dimension_sections",
                GgufValue::Array([2, 1, 1, 0].map(GgufValue::I32).to_vec()),
            )),
            "qwen3next.rope.dimension_sections",
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

/// A file converted with its multi-token-prediction layer (the converter
/// without `--no-mtp`: `block_count` one more, `nextn_predict_layers` = 1,
/// one more `recurrent_layers` entry) reads as the same model; the extra
/// layer's tensors are left unread.
#[test]
fn nextn_prediction_layers_are_left_out_of_the_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plain = ModelConfig::from_gguf(&GgufFile::open(&gguf("qwen3_5", "f32")).expect("open"))
        .expect("config");
    let with_mtp = edited("qwen3_5", dir.path(), |m| {
        set("qwen35.block_count", GgufValue::U32(5))(m);
        set("qwen35.nextn_predict_layers", GgufValue::U32(1))(m);
        set(
            "qwen35.attention.recurrent_layers",
            GgufValue::Array(
                [true, true, true, false, false]
                    .map(GgufValue::Bool)
                    .to_vec(),
            ),
        )(m);
    });
    let c = ModelConfig::from_gguf(&GgufFile::open(&with_mtp).expect("open")).expect("config");
    assert_eq!(c, plain);
    let too_many = edited(
        "qwen3_5",
        dir.path(),
        set("qwen35.nextn_predict_layers", GgufValue::U32(5)),
    );
    let err =
        ModelConfig::from_gguf(&GgufFile::open(&too_many).expect("open")).expect_err("5 of 4");
    assert!(format!("{err:#}").contains("qwen35.nextn_predict_layers"));
}
