//! Tiny random Llama-family models, written to disk the way real ones ship.
//!
//! A [`TinyModel`] is a set of named f32 tensors (Hugging Face names) drawn
//! from a seeded generator for a [`TinySpec`] shape: Llama (tied LM head, no
//! bias, explicit `head_dim`) or Qwen2 (untied LM head, q/k/v biases). It can
//! be written as
//!
//! - a Hugging Face folder ([`TinyModel::write_hf`]): `config.json`,
//!   `model.safetensors` in F32, BF16 or F16 (or two shards plus
//!   `model.safetensors.index.json`), a byte-level BPE `tokenizer.json`,
//!   `tokenizer_config.json` (BOS/EOS, chat template) and
//!   `generation_config.json`;
//! - a GGUF F32 file ([`TinyModel::write_gguf`]) with llama.cpp's tensor
//!   names and metadata keys, the same tokenizer as GGUF metadata, and — for
//!   the llama architecture — q/k rows permuted as llama.cpp's HF→GGUF
//!   converter permutes them.
//!
//! Everything here is written independently of the engine's loaders (its own
//! name table, its own permutation), so that tests comparing the two check
//! the loaders rather than repeat them.

use pagoda::engine::loader::gguf::GgufValue;
use pagoda::engine::loader::gguf_writer::{write_gguf, GgufTensorToWrite};
use pagoda_accel::GgmlType;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Which member of the Llama family the model is shaped as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM`: no attention bias.
    Llama,
    /// `Qwen2ForCausalLM`: q/k/v projections carry biases.
    Qwen2,
}

impl Family {
    /// The `architectures[0]` of `config.json`.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }

    /// GGUF's `general.architecture`.
    pub fn gguf_architecture(self) -> &'static str {
        self.model_type()
    }

    /// Whether q/k/v projections have biases.
    pub fn has_qkv_bias(self) -> bool {
        self == Family::Qwen2
    }
}

/// The shape and hyper-parameters of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub family: Family,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Seed of the weight generator.
    pub seed: u64,
}

impl TinySpec {
    /// Llama shape: hidden 64, 2 layers, 4 query heads over 2 KV heads of
    /// 16, FFN 96, tied embeddings.
    pub fn llama() -> TinySpec {
        TinySpec {
            family: Family::Llama,
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            intermediate_size: 96,
            // Not transformers' default (10000), so a config reader that drops
            // the key fails the reference tests.
            rope_theta: 40_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            max_position_embeddings: 128,
            seed: 0x5eed_0001,
        }
    }

    /// Qwen2 shape: as [`TinySpec::llama`] but 3 layers, q/k/v biases and
    /// an untied LM head.
    pub fn qwen2() -> TinySpec {
        TinySpec {
            family: Family::Qwen2,
            num_layers: 3,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            seed: 0x5eed_0002,
            ..TinySpec::llama()
        }
    }

    /// Tokens in the vocabulary (the tokenizer's, which is also the model's).
    pub fn vocab_size(&self) -> usize {
        vocab().len()
    }

    /// Width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

// ---------------------------------------------------------------------------
// Tokenizer: a byte-level BPE over a few dozen tokens.
// ---------------------------------------------------------------------------

/// BOS token id (`<s>`).
pub const BOS: u32 = 0;
/// EOS token id (`</s>`).
pub const EOS: u32 = 1;

/// A chat template: `role: content` lines, then `assistant:`.
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// BPE merges, highest priority first, in byte-level spelling (`Ġ` is a
/// space).
pub const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("o", "n"),
    ("a", "t"),
    ("e", "n"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("Ġ", "a"),
    ("Ġ", "s"),
    ("Ġs", "at"),
    ("Ġ", "c"),
    ("Ġc", "at"),
    ("Ġ", "on"),
    ("Ġ", "m"),
    ("Ġm", "at"),
    ("h", "i"),
    ("Ġ", "in"),
    ("Ġ", "d"),
    ("o", "g"),
    ("Ġd", "og"),
];

/// The vocabulary in id order: `<s>`, `</s>`, a–z, `Ġ` (space), `Ċ`
/// (newline), digits, punctuation, then one token per merge.
pub fn vocab() -> Vec<String> {
    let mut v: Vec<String> = vec!["<s>".into(), "</s>".into()];
    v.extend(('a'..='z').map(String::from));
    v.push("Ġ".into());
    v.push("Ċ".into());
    v.extend(('0'..='9').map(String::from));
    v.extend([".", ",", "!", "?", ":", "'"].map(String::from));
    for (a, b) in MERGES {
        v.push(format!("{a}{b}"));
    }
    v
}

/// The id of the token spelled `text` (byte-level spelling).
pub fn token_id(text: &str) -> u32 {
    vocab()
        .iter()
        .position(|t| t == text)
        .unwrap_or_else(|| panic!("no token {text:?}")) as u32
}

/// `tokenizer.json`: byte-level BPE with `<s>` and `</s>` as special tokens.
pub fn tokenizer_json() -> Value {
    let vocab: serde_json::Map<String, Value> = vocab()
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, json!(i)))
        .collect();
    let merges: Vec<String> = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(BOS, "<s>"), special(EOS, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    })
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and
/// `generation_config.json` into `dir`.
pub fn write_tokenizer_files(dir: &Path) {
    write_json(&dir.join("tokenizer.json"), &tokenizer_json());
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "lstrip": false, "rstrip": false},
            "add_bos_token": true,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 128
        }),
    );
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": BOS, "eos_token_id": EOS}),
    );
}

/// Writes `v` as pretty JSON at `path`.
pub fn write_json(path: &Path, v: &Value) {
    let text = serde_json::to_string_pretty(v).expect("serialize JSON");
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

// ---------------------------------------------------------------------------
// Weights.
// ---------------------------------------------------------------------------

/// One named tensor, row-major, in PyTorch shape order (`[out, in]`).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// How the safetensors files store the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    BF16,
    F16,
}

impl Storage {
    /// `x` as it reads back after being stored this way.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Storage::F32 => x,
            Storage::BF16 => half::bf16::from_f32(x).to_f32(),
            Storage::F16 => half::f16::from_f32(x).to_f32(),
        }
    }

    fn encode(self, data: &[f32]) -> (Dtype, Vec<u8>) {
        match self {
            Storage::F32 => (
                Dtype::F32,
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Storage::BF16 => (
                Dtype::BF16,
                data.iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            ),
            Storage::F16 => (
                Dtype::F16,
                data.iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            ),
        }
    }

    /// `torch_dtype` of `config.json`.
    fn torch_dtype(self) -> &'static str {
        match self {
            Storage::F32 => "float32",
            Storage::BF16 => "bfloat16",
            Storage::F16 => "float16",
        }
    }
}

/// SplitMix64: a tiny, seedable, portable generator.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-a, a)`.
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

/// A tiny model: its shape and its weights under Hugging Face names.
#[derive(Clone, Debug)]
pub struct TinyModel {
    pub spec: TinySpec,
    pub tensors: Vec<Tensor>,
}

impl TinyModel {
    /// Draws every weight from a generator seeded with `spec.seed`.
    ///
    /// Scales are chosen so that the model is far from degenerate: q/k
    /// projections are large enough that attention is peaked (so RoPE and
    /// the GQA head mapping matter), biases are large enough to matter,
    /// norms are not all ones, and the attention and MLP outputs outweigh
    /// the token embedding in the residual stream (otherwise a tied LM head
    /// just predicts the input token again, and greedy chains repeat it).
    pub fn random(spec: TinySpec) -> TinyModel {
        let mut rng = Rng(spec.seed);
        let (d, q, kv, f, v) = (
            spec.hidden_size,
            spec.q_dim(),
            spec.kv_dim(),
            spec.intermediate_size,
            spec.vocab_size(),
        );
        let mut tensors = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            let n = shape.iter().product();
            let data = (0..n).map(|_| offset + rng.uniform(scale)).collect();
            tensors.push(Tensor { name, shape, data });
        };
        let fan = |n: usize| (3.0 / n as f32).sqrt();
        add("model.embed_tokens.weight".into(), vec![v, d], 1.0, 0.0);
        for i in 0..spec.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            add(p("input_layernorm.weight"), vec![d], 0.3, 1.0);
            add(p("self_attn.q_proj.weight"), vec![q, d], 0.4, 0.0);
            add(p("self_attn.k_proj.weight"), vec![kv, d], 0.4, 0.0);
            add(p("self_attn.v_proj.weight"), vec![kv, d], fan(d), 0.0);
            if spec.family.has_qkv_bias() {
                add(p("self_attn.q_proj.bias"), vec![q], 0.5, 0.0);
                add(p("self_attn.k_proj.bias"), vec![kv], 0.5, 0.0);
                add(p("self_attn.v_proj.bias"), vec![kv], 0.5, 0.0);
            }
            add(p("self_attn.o_proj.weight"), vec![d, q], 3.0 * fan(q), 0.0);
            add(p("post_attention_layernorm.weight"), vec![d], 0.3, 1.0);
            add(p("mlp.gate_proj.weight"), vec![f, d], 2.0 * fan(d), 0.0);
            add(p("mlp.up_proj.weight"), vec![f, d], fan(d), 0.0);
            add(p("mlp.down_proj.weight"), vec![d, f], 3.0 * fan(f), 0.0);
        }
        add("model.norm.weight".into(), vec![d], 0.3, 1.0);
        if !spec.tie_word_embeddings {
            add("lm_head.weight".into(), vec![v, d], 0.5, 0.0);
        }
        TinyModel { spec, tensors }
    }

    /// The tensor called `name` (HF name); panics if there is none.
    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// The tensor called `name`, if any.
    pub fn find(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor called `name`, mutably; panics if there is none.
    pub fn get_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// A copy with every element of the matrices (and, unless
    /// `matrices_only`, of the vectors too) passed through `f`: the weights
    /// as they read back from a lower-precision file or dtype.
    pub fn map(&self, matrices_only: bool, f: impl Fn(f32) -> f32) -> TinyModel {
        let mut m = self.clone();
        for t in &mut m.tensors {
            if t.shape.len() == 2 || !matrices_only {
                t.data.iter_mut().for_each(|x| *x = f(*x));
            }
        }
        m
    }

    /// `config.json`. The Llama variant states `head_dim`; the Qwen2 one
    /// leaves it implied by `hidden_size / num_attention_heads`.
    pub fn config_json(&self, storage: Storage) -> Value {
        let s = &self.spec;
        let mut c = json!({
            "architectures": [s.family.hf_architecture()],
            "model_type": s.family.model_type(),
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads,
            "max_position_embeddings": s.max_position_embeddings,
            "rms_norm_eps": s.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "rope_scaling": null,
            "hidden_act": "silu",
            "tie_word_embeddings": s.tie_word_embeddings,
            "vocab_size": s.vocab_size(),
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "torch_dtype": storage.torch_dtype(),
        });
        if s.family == Family::Llama {
            c["head_dim"] = json!(s.head_dim);
            c["attention_bias"] = json!(false);
        }
        c
    }

    /// Writes the model as a Hugging Face folder into `dir` (created if
    /// needed): config, tokenizer files, and the weights stored as
    /// `storage` in one `model.safetensors` (`shards == 1`) or in `shards`
    /// files named by `model.safetensors.index.json`.
    pub fn write_hf(&self, dir: &Path, storage: Storage, shards: usize) {
        assert!(shards >= 1);
        std::fs::create_dir_all(dir).expect("create the model folder");
        write_json(&dir.join("config.json"), &self.config_json(storage));
        write_tokenizer_files(dir);
        let encoded: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|t| {
                let (dt, bytes) = storage.encode(&t.data);
                (t.name.clone(), t.shape.clone(), dt, bytes)
            })
            .collect();
        if shards == 1 {
            write_safetensors(&dir.join("model.safetensors"), &encoded);
            return;
        }
        let per = encoded.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        let mut total = 0usize;
        for (k, chunk) in encoded.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", k + 1);
            write_safetensors(&dir.join(&file), chunk);
            for (name, _, _, bytes) in chunk {
                weight_map.insert(name.clone(), json!(file));
                total += bytes.len();
            }
        }
        write_json(
            &dir.join("model.safetensors.index.json"),
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        );
    }

    /// GGUF metadata (model shape and tokenizer) under llama.cpp's keys.
    pub fn gguf_metadata(&self) -> Vec<(String, GgufValue)> {
        let s = &self.spec;
        let arch = s.family.gguf_architecture();
        let k = |key: &str| format!("{arch}.{key}");
        let tokens = vocab();
        let types: Vec<GgufValue> = (0..tokens.len())
            .map(|i| {
                GgufValue::I32(if i as u32 == BOS || i as u32 == EOS {
                    3
                } else {
                    1
                })
            })
            .collect();
        vec![
            (
                "general.architecture".into(),
                GgufValue::String(arch.into()),
            ),
            (
                "general.name".into(),
                GgufValue::String(format!("tiny-{arch}")),
            ),
            (
                k("context_length"),
                GgufValue::U32(s.max_position_embeddings as u32),
            ),
            (k("embedding_length"), GgufValue::U32(s.hidden_size as u32)),
            (k("block_count"), GgufValue::U32(s.num_layers as u32)),
            (
                k("feed_forward_length"),
                GgufValue::U32(s.intermediate_size as u32),
            ),
            (
                k("attention.head_count"),
                GgufValue::U32(s.num_heads as u32),
            ),
            (
                k("attention.head_count_kv"),
                GgufValue::U32(s.num_kv_heads as u32),
            ),
            (k("rope.freq_base"), GgufValue::F32(s.rope_theta as f32)),
            (
                k("attention.layer_norm_rms_epsilon"),
                GgufValue::F32(s.rms_norm_eps as f32),
            ),
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
            ("tokenizer.ggml.token_type".into(), GgufValue::Array(types)),
            (
                "tokenizer.ggml.merges".into(),
                GgufValue::Array(
                    MERGES
                        .iter()
                        .map(|(a, b)| GgufValue::String(format!("{a} {b}")))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(BOS)),
            ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(EOS)),
            ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true)),
            (
                "tokenizer.chat_template".into(),
                GgufValue::String(CHAT_TEMPLATE.into()),
            ),
        ]
    }

    /// The weights as F32 GGUF tensors under llama.cpp's names. With
    /// `permute_qk`, the rows of every q and k projection are reordered as
    /// llama.cpp's converter does for the llama architecture (see
    /// [`permute_rows_for_gguf`]).
    pub fn gguf_tensors(&self, permute_qk: bool) -> Vec<GgufTensorToWrite> {
        let hd = self.spec.head_dim;
        self.tensors
            .iter()
            .map(|t| {
                let name = gguf_tensor_name(&t.name);
                let is_qk = t.name.ends_with("q_proj.weight") || t.name.ends_with("k_proj.weight");
                let data = if permute_qk && is_qk {
                    permute_rows_for_gguf(&t.data, t.shape[0], t.shape[1], hd)
                } else {
                    t.data.clone()
                };
                GgufTensorToWrite {
                    name,
                    ty: GgmlType::F32,
                    shape: t.shape.clone(),
                    data: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                }
            })
            .collect()
    }

    /// Writes the model as a GGUF F32 file at `path`, with q/k permuted for
    /// the llama architecture (as llama.cpp's converter does) and not for
    /// qwen2.
    pub fn write_gguf(&self, path: &Path) {
        let permute = self.spec.family == Family::Llama;
        write_gguf_parts(path, &self.gguf_metadata(), &self.gguf_tensors(permute));
    }
}

/// Writes a GGUF file from owned metadata keys.
pub fn write_gguf_parts(
    path: &Path,
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite],
) {
    let meta: Vec<(&str, GgufValue)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    write_gguf(path, &meta, tensors).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
}

fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Dtype, Vec<u8>)]) {
    let views: BTreeMap<String, TensorView<'_>> = tensors
        .iter()
        .map(|(name, shape, dt, bytes)| {
            (
                name.clone(),
                TensorView::new(*dt, shape.clone(), bytes).expect("a consistent tensor view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// llama.cpp's name for an HF tensor name.
pub fn gguf_tensor_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf
        .strip_prefix("model.layers.")
        .unwrap_or_else(|| panic!("unexpected tensor {hf}"));
    let (layer, tail) = rest.split_once('.').expect("layer index");
    let table = [
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ];
    let (_, g) = table
        .iter()
        .find(|(h, _)| *h == tail)
        .unwrap_or_else(|| panic!("unexpected tensor {hf}"));
    format!("blk.{layer}.{g}")
}

/// Reorders the rows of a q or k projection (`[rows, cols]`, heads of
/// `head_dim` rows stacked) the way llama.cpp's HF→GGUF converter does:
/// within each head, new row `2i` is old row `i` and new row `2i + 1` is old
/// row `i + head_dim / 2`. Rotating adjacent pairs of the permuted output
/// then equals rotating HF's half-split pairs of the original output.
pub fn permute_rows_for_gguf(data: &[f32], rows: usize, cols: usize, head_dim: usize) -> Vec<f32> {
    assert_eq!(data.len(), rows * cols);
    assert_eq!(rows % head_dim, 0, "rows must be whole heads");
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..rows / head_dim {
        for i in 0..half {
            for (new, old) in [(2 * i, i), (2 * i + 1, i + half)] {
                let (dst, src) = ((h * head_dim + new) * cols, (h * head_dim + old) * cols);
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}
