//! Converts an HF folder of float32 weights (transformers' own tiny
//! checkpoints) into a GGUF file the way llama.cpp's `convert_hf_to_gguf.py`
//! lays it out, written from llama.cpp's documented conventions and not
//! from Pagoda's loader:
//!
//! - tensor names `blk.N.attn_q`, …, `ffn_gate_inp` (router), experts
//!   stacked per layer into `ffn_{gate,up,down}_exps` (`[experts, rows,
//!   cols]`), the shared expert as `ffn_*_shexp`, its gate as the vector
//!   `ffn_gate_inp_shexp`;
//! - for the `llama` architecture (Llama, Mistral, Mixtral), q and k rows
//!   permuted so that RoPE rotates adjacent pairs;
//! - metadata under `{arch}.*`, expert counts included;
//! - quantized types for the 2-D weights except the router, which
//!   llama-quantize keeps in F32, as it keeps every 1-D tensor.

use super::tiny_model::{permute_rows_for_gguf, write_gguf_parts};
use pagoda::engine::loader::gguf::GgufValue;
use pagoda::engine::loader::gguf_writer::GgufTensorToWrite;
use pagoda_accel::{GgmlType, HostMatrix};
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The GGUF architecture of an HF `architectures[0]`.
fn gguf_arch(hf: &str) -> &'static str {
    match hf {
        "LlamaForCausalLM" | "MistralForCausalLM" | "MixtralForCausalLM" => "llama",
        "Qwen2ForCausalLM" => "qwen2",
        "Qwen3ForCausalLM" => "qwen3",
        "Qwen2MoeForCausalLM" => "qwen2moe",
        "Qwen3MoeForCausalLM" => "qwen3moe",
        other => panic!("no GGUF architecture for {other}"),
    }
}

/// llama.cpp's name for an HF tensor (without the expert index), and the
/// expert index for per-expert tensors.
fn gguf_tensor(hf: &str) -> (String, Option<usize>) {
    match hf {
        "model.embed_tokens.weight" => return ("token_embd.weight".into(), None),
        "model.norm.weight" => return ("output_norm.weight".into(), None),
        "lm_head.weight" => return ("output.weight".into(), None),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, tail) = rest.split_once('.').expect("layer index");
    let (tail, suffix) = tail.rsplit_once('.').expect("suffix");
    let expert_part = |t: &str| -> Option<(usize, &'static str)> {
        let t = t
            .strip_prefix("mlp.experts.")
            .or_else(|| t.strip_prefix("block_sparse_moe.experts."))?;
        let (e, p) = t.split_once('.')?;
        let g = match p {
            "gate_proj" | "w1" => "ffn_gate_exps",
            "up_proj" | "w3" => "ffn_up_exps",
            "down_proj" | "w2" => "ffn_down_exps",
            other => panic!("expert part {other}"),
        };
        Some((e.parse().ok()?, g))
    };
    if let Some((e, g)) = expert_part(tail) {
        return (format!("blk.{layer}.{g}.{suffix}"), Some(e));
    }
    let g = match tail {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        other => panic!("no GGUF name for {other}"),
    };
    (format!("blk.{layer}.{g}.{suffix}"), None)
}

fn rope_theta(c: &Value) -> f64 {
    c["rope_parameters"]["rope_theta"]
        .as_f64()
        .or_else(|| c["rope_theta"].as_f64())
        .unwrap_or(10_000.0)
}

/// Writes `folder` (config.json, model.safetensors in F32, tokenizer.json)
/// as a GGUF file at `out`, its 2-D weights other than the router in `ty`.
pub fn convert(folder: &Path, out: &Path, ty: GgmlType) {
    let c: Value = serde_json::from_str(
        &std::fs::read_to_string(folder.join("config.json")).expect("config.json"),
    )
    .expect("config JSON");
    let hf_arch = c["architectures"][0].as_str().expect("architectures");
    let arch = gguf_arch(hf_arch);
    let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config {k}")) as u32;
    let heads = u("num_attention_heads");
    let hidden = u("hidden_size");
    let head_dim = c["head_dim"].as_u64().map_or(hidden / heads, |h| h as u32);
    let vocab = u("vocab_size");
    let k = |key: &str| format!("{arch}.{key}");
    let mut meta: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::String(arch.into()),
        ),
        (
            k("context_length"),
            GgufValue::U32(u("max_position_embeddings")),
        ),
        (k("embedding_length"), GgufValue::U32(hidden)),
        (k("block_count"), GgufValue::U32(u("num_hidden_layers"))),
        (
            k("feed_forward_length"),
            GgufValue::U32(u("intermediate_size")),
        ),
        (k("attention.head_count"), GgufValue::U32(heads)),
        (
            k("attention.head_count_kv"),
            GgufValue::U32(u("num_key_value_heads")),
        ),
        (k("attention.key_length"), GgufValue::U32(head_dim)),
        (k("attention.value_length"), GgufValue::U32(head_dim)),
        (k("rope.dimension_count"), GgufValue::U32(head_dim)),
        (k("rope.freq_base"), GgufValue::F32(rope_theta(&c) as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(c["rms_norm_eps"].as_f64().expect("eps") as f32),
        ),
        (k("vocab_size"), GgufValue::U32(vocab)),
    ];
    let experts = c["num_local_experts"]
        .as_u64()
        .or_else(|| c["num_experts"].as_u64());
    if let Some(n) = experts {
        meta.push((k("expert_count"), GgufValue::U32(n as u32)));
        meta.push((
            k("expert_used_count"),
            GgufValue::U32(u("num_experts_per_tok")),
        ));
        if let Some(f) = c["moe_intermediate_size"].as_u64() {
            meta.push((k("expert_feed_forward_length"), GgufValue::U32(f as u32)));
        }
        if let Some(f) = c["shared_expert_intermediate_size"].as_u64() {
            meta.push((
                k("expert_shared_feed_forward_length"),
                GgufValue::U32(f as u32),
            ));
        }
    }
    meta.extend(tokenizer_metadata(folder, vocab as usize));

    let bytes = std::fs::read(folder.join("model.safetensors")).expect("weights");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    // name → (shape of one, per-expert data) so experts can be stacked.
    let mut stacks: BTreeMap<String, (Vec<usize>, BTreeMap<usize, Vec<f32>>)> = BTreeMap::new();
    let mut tensors = Vec::new();
    let permute = arch == "llama";
    for (name, view) in st.tensors() {
        let mut values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let shape = view.shape().to_vec();
        if permute && (name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight")) {
            values = permute_rows_for_gguf(&values, shape[0], shape[1], head_dim as usize);
        }
        let (gname, expert) = gguf_tensor(&name);
        match expert {
            Some(e) => {
                let entry = stacks
                    .entry(gname)
                    .or_insert((shape.clone(), BTreeMap::new()));
                assert_eq!(entry.0, shape, "{name}: experts of one shape");
                entry.1.insert(e, values);
            }
            None if gname.ends_with("ffn_gate_inp_shexp.weight") => {
                tensors.push(tensor(gname, GgmlType::F32, vec![shape[1]], &values));
            }
            None => {
                let t = if shape.len() == 2 && !gname.contains("ffn_gate_inp") {
                    ty
                } else {
                    GgmlType::F32
                };
                tensors.push(tensor(gname, t, shape, &values));
            }
        }
    }
    for (gname, (shape, per_expert)) in stacks {
        let n = per_expert.len();
        assert_eq!(
            per_expert.keys().copied().collect::<Vec<_>>(),
            (0..n).collect::<Vec<_>>()
        );
        let all: Vec<f32> = per_expert.into_values().flatten().collect();
        let mut t = tensor(gname, ty, vec![n * shape[0], shape[1]], &all);
        t.shape = vec![n, shape[0], shape[1]];
        tensors.push(t);
    }
    write_gguf_parts(out, &meta, &tensors);
}

/// A tensor of `shape` (rows of its last dimension) stored as `ty`.
fn tensor(name: String, ty: GgmlType, shape: Vec<usize>, values: &[f32]) -> GgufTensorToWrite {
    let cols = *shape.last().expect("a shape");
    let rows = values.len() / cols;
    let m = HostMatrix::from_f32_as(ty, rows, cols, values)
        .unwrap_or_else(|e| panic!("{name} as {}: {e}", ty.name()));
    GgufTensorToWrite {
        name,
        ty,
        shape,
        data: m.bytes().to_vec(),
    }
}

/// The byte-level BPE of `tokenizer.json` as GGUF `gpt2` tokenizer keys,
/// padded with unused control tokens to `vocab` entries.
fn tokenizer_metadata(folder: &Path, vocab: usize) -> Vec<(String, GgufValue)> {
    let t: Value = serde_json::from_str(
        &std::fs::read_to_string(folder.join("tokenizer.json")).expect("tokenizer.json"),
    )
    .expect("tokenizer JSON");
    let mut tokens = vec![String::new(); vocab];
    let mut types = vec![1i32; vocab];
    for (tok, id) in t["model"]["vocab"].as_object().expect("vocab") {
        tokens[id.as_u64().expect("id") as usize] = tok.clone();
    }
    for a in t["added_tokens"].as_array().expect("added tokens") {
        let id = a["id"].as_u64().expect("id") as usize;
        tokens[id] = a["content"].as_str().expect("content").to_string();
        types[id] = 3;
    }
    for (i, tok) in tokens.iter_mut().enumerate() {
        if tok.is_empty() {
            *tok = format!("<|unused_{i}|>");
            types[i] = 3;
        }
    }
    let merges: Vec<GgufValue> = t["model"]["merges"]
        .as_array()
        .expect("merges")
        .iter()
        .map(|m| match m {
            Value::String(s) => GgufValue::String(s.clone()),
            Value::Array(p) => GgufValue::String(format!(
                "{} {}",
                p[0].as_str().expect("merge"),
                p[1].as_str().expect("merge")
            )),
            other => panic!("merge {other}"),
        })
        .collect();
    vec![
        (
            "tokenizer.ggml.model".into(),
            GgufValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            GgufValue::String("default".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(tokens.into_iter().map(GgufValue::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), GgufValue::Array(merges)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(0)),
    ]
}
