//! The architectures Pagoda loads, in one table (vLLM's
//! `models/registry.py`): each row names an architecture as Hugging Face
//! (`architectures`, `model_type`) and GGUF (`general.architecture`) spell
//! it, the family it is ([`Arch`]), how its config is read from either
//! form, and which family file builds it. Config reading
//! ([`ModelConfig::from_hf_json`], [`ModelConfig::from_gguf`]), the model
//! loader ([`super::load`]), `pagoda models` and the errors that list what
//! is supported all go through this table and nothing else.
//!
//! A family file owns its own reading where only it reads it (BERT's
//! `config.json`, the GGUF metadata of Gemma 3, gpt-oss, DeepSeek and the
//! hybrid Qwen models); the readers the Llama-like decoders share stay in
//! `engine/config.rs` ([`ModelConfig::from_hf_decoder`],
//! [`ModelConfig::from_gguf_decoder`]).

use super::{
    bert, deepseek, gemma3, gpt_oss, llama, mixtral, modernbert, qwen3, qwen3_next, qwen_moe, Model,
};
use crate::engine::config::{unknown_hf_keys, Arch, HfFamily, ModelConfig};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::Backend;
use serde_json::Value;
use std::marker::PhantomData;
use std::path::Path;

/// Builds a model of the row's family on `B`'s device: (backend, weights,
/// config, `--max-model-len`).
pub type LoadFn<B> = fn(&B, &dyn WeightSource, ModelConfig, usize) -> Result<Model<B>>;
/// Reads a `config.json` of the row's architecture; the `&str` is the
/// row's first HF name.
pub type HfConfigFn = fn(&Value, &str) -> Result<ModelConfig>;
/// Reads the metadata of a GGUF file of the row's architecture: the file,
/// its `general.architecture`, the row's [`Arch`].
pub type GgufConfigFn = fn(&GgufFile, &str, Arch) -> Result<ModelConfig>;

/// One architecture.
pub struct ArchEntry<B: Backend> {
    /// Its names in `config.json`'s `architectures`; the first is the one
    /// listed.
    pub hf: &'static [&'static str],
    /// Its `model_type`s, for a `config.json` without `architectures`.
    pub model_types: &'static [&'static str],
    /// Its `general.architecture` names in GGUF files; empty where GGUF
    /// files are not read.
    pub gguf: &'static [&'static str],
    /// The models it serves, for `pagoda models`.
    pub models: &'static str,
    /// The family it is: the config's [`ModelConfig::arch`], which picks
    /// the row's loader.
    pub arch: Arch,
    pub hf_config: HfConfigFn,
    /// `None` where `gguf` is empty.
    pub gguf_config: Option<GgufConfigFn>,
    pub load: LoadFn<B>,
}

/// The table, for models on `B`'s device (the backend types only the
/// loaders: every other column is the same for all of them).
pub struct Architectures<B>(PhantomData<B>);

impl<B: Backend> Architectures<B> {
    /// Rows sharing a GGUF name (`llama`) share its reader, which tells
    /// them apart by the file's metadata; the first row with a name wins.
    pub const TABLE: &'static [ArchEntry<B>] = &[
        ArchEntry {
            hf: &["LlamaForCausalLM"],
            model_types: &["llama"],
            gguf: &["llama"],
            models: "Llama 2, Llama 3.x, SmolLM2, TinyLlama, Vicuna",
            arch: Arch::Llama,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Llama),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(llama::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["MistralForCausalLM"],
            model_types: &["mistral"],
            gguf: &["llama", "mistral"],
            models: "Mistral 7B (v0.1 to v0.3)",
            arch: Arch::Llama,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Mistral),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(llama::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen2ForCausalLM"],
            model_types: &["qwen2"],
            gguf: &["qwen2"],
            models: "Qwen2, Qwen2.5 (attention q/k/v bias)",
            arch: Arch::Qwen2,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen2),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(llama::load(b, s, c, m)?)),
        },
        ArchEntry {
            // `Qwen3Model`: the headless decoder Qwen3-Embedding is saved
            // as; served for pooling (see `engine::pooling`).
            hf: &["Qwen3ForCausalLM", "Qwen3Model"],
            model_types: &["qwen3"],
            gguf: &["qwen3"],
            models: "Qwen3 dense (q/k RMSNorm per head, explicit head_dim)",
            arch: Arch::Qwen3,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen3),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(qwen3::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["MixtralForCausalLM"],
            model_types: &["mixtral"],
            gguf: &["llama"],
            models: "Mixtral 8x7B, 8x22B (mixture of experts, top-2)",
            arch: Arch::Mixtral,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Mixtral),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(mixtral::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen2MoeForCausalLM"],
            model_types: &["qwen2_moe"],
            gguf: &["qwen2moe"],
            models: "Qwen1.5-MoE, Qwen2-MoE (routed experts and a gated shared expert)",
            arch: Arch::Qwen2Moe,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen2Moe),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(qwen_moe::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen3MoeForCausalLM"],
            model_types: &["qwen3_moe"],
            gguf: &["qwen3moe"],
            models: "Qwen3-MoE (30B-A3B, 235B-A22B)",
            arch: Arch::Qwen3Moe,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen3Moe),
            gguf_config: Some(ModelConfig::from_gguf_decoder),
            load: |b, s, c, m| Ok(Box::new(qwen_moe::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["DeepseekV2ForCausalLM"],
            model_types: &["deepseek_v2"],
            gguf: &["deepseek2"],
            models: "DeepSeek-V2, V2-Lite (MLA, shared and routed experts)",
            arch: Arch::Deepseek,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::DeepseekV2),
            gguf_config: Some(|g, _, _| deepseek::gguf_config(g)),
            load: |b, s, c, m| Ok(Box::new(deepseek::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["DeepseekV3ForCausalLM"],
            model_types: &["deepseek_v3"],
            gguf: &["deepseek2"],
            models: "DeepSeek-V3, R1 (MLA, sigmoid group-limited routing)",
            arch: Arch::Deepseek,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::DeepseekV3),
            gguf_config: Some(|g, _, _| deepseek::gguf_config(g)),
            load: |b, s, c, m| Ok(Box::new(deepseek::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Gemma3ForCausalLM"],
            model_types: &["gemma3_text"],
            gguf: &["gemma3"],
            models: "Gemma 3 text (1B; the text stack of 4B-27B): local/global layers, per-layer-type RoPE, GeGLU, sandwich norms",
            arch: Arch::Gemma3,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Gemma3),
            gguf_config: Some(|g, _, _| gemma3::gguf_config(g)),
            load: |b, s, c, m| Ok(Box::new(gemma3::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen3NextForCausalLM"],
            model_types: &["qwen3_next"],
            gguf: &["qwen3next"],
            models: "Qwen3-Next (hybrid Gated DeltaNet and gated attention, experts with a gated shared expert)",
            arch: Arch::Qwen3Next,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen3Next),
            gguf_config: Some(qwen3_next::gguf_config),
            load: |b, s, c, m| Ok(Box::new(qwen3_next::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen3_5ForCausalLM"],
            model_types: &["qwen3_5_text"],
            gguf: &["qwen35"],
            models: "Qwen3.5 dense, text only (hybrid Gated DeltaNet and gated attention)",
            arch: Arch::Qwen35,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen35),
            gguf_config: Some(qwen3_next::gguf_config),
            load: |b, s, c, m| Ok(Box::new(qwen3_next::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["Qwen3_5MoeForCausalLM"],
            model_types: &["qwen3_5_moe_text"],
            gguf: &["qwen35moe"],
            models: "Qwen3.5-MoE, text only (hybrid, experts with a gated shared expert)",
            arch: Arch::Qwen35Moe,
            hf_config: |v, _| ModelConfig::from_hf_decoder(v, HfFamily::Qwen35Moe),
            gguf_config: Some(qwen3_next::gguf_config),
            load: |b, s, c, m| Ok(Box::new(qwen3_next::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["GptOssForCausalLM"],
            model_types: &["gpt_oss"],
            gguf: &["gpt-oss"],
            models: "gpt-oss (attention sinks, alternating sliding-window layers, experts with clamped SwiGLU; bf16/f32, MXFP4 experts kept 4-bit in memory, from HF folders and GGUF)",
            arch: Arch::GptOss,
            hf_config: gpt_oss::hf_config,
            gguf_config: Some(|g, _, _| gpt_oss::gguf_config(g)),
            load: |b, s, c, m| Ok(Box::new(gpt_oss::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["BertModel"],
            model_types: &["bert"],
            gguf: &[],
            models: "BERT encoders for embeddings (sentence-transformers: all-MiniLM, BGE, E5), served for pooling",
            arch: Arch::Bert,
            hf_config: bert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(bert::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["BertForSequenceClassification"],
            model_types: &[],
            gguf: &[],
            models: "BERT cross-encoders and classifiers (ms-marco rerankers), served for scoring and /classify",
            arch: Arch::Bert,
            hf_config: bert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(bert::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["XLMRobertaModel"],
            model_types: &["xlm-roberta"],
            gguf: &[],
            models: "XLM-RoBERTa encoders for embeddings (BGE-M3, multilingual E5), served for pooling",
            arch: Arch::Bert,
            hf_config: bert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(bert::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["XLMRobertaForSequenceClassification"],
            model_types: &[],
            gguf: &[],
            models: "XLM-RoBERTa cross-encoders (bge-reranker), served for scoring and /classify",
            arch: Arch::Bert,
            hf_config: bert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(bert::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["ModernBertModel"],
            model_types: &["modernbert"],
            gguf: &[],
            models: "ModernBERT encoders for embeddings (sentence-transformers: gte-modernbert, modernbert-embed), served for pooling",
            arch: modernbert::MODERNBERT,
            hf_config: modernbert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(modernbert::load(b, s, c, m)?)),
        },
        ArchEntry {
            hf: &["ModernBertForSequenceClassification"],
            model_types: &[],
            gguf: &[],
            models: "ModernBERT cross-encoders and classifiers (gte-reranker-modernbert), served for scoring and /classify",
            arch: modernbert::MODERNBERT,
            hf_config: modernbert::hf_config,
            gguf_config: None,
            load: |b, s, c, m| Ok(Box::new(modernbert::load(b, s, c, m)?)),
        },
    ];
}

/// The rows as read where no device is involved (config reading, listing):
/// through the CPU's instance of the table, whose columns other than the
/// loaders are every backend's.
pub fn architectures() -> &'static [ArchEntry<pagoda_accel::CpuBackend>] {
    Architectures::<pagoda_accel::CpuBackend>::TABLE
}

/// The row that loads models of family `arch` on `B`'s device.
pub fn entry<B: Backend>(arch: Arch) -> Result<&'static ArchEntry<B>> {
    Architectures::<B>::TABLE
        .iter()
        .find(|e| e.arch == arch)
        .with_context(|| format!("no row of the architecture table loads {arch:?}"))
}

/// The supported architectures' HF names, for errors.
pub fn supported_list() -> String {
    architectures()
        .iter()
        .map(|e| e.hf[0])
        .collect::<Vec<_>>()
        .join(", ")
}

impl ModelConfig {
    /// Reads an HF `config.json`.
    pub fn from_hf_config(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the model config", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        let config = Self::from_hf_json(&v)
            .with_context(|| format!("{}: unsupported config", path.display()))?;
        let unknown = unknown_hf_keys(&v);
        if !unknown.is_empty() {
            tracing::warn!(
                "{}: keys not read (check that none changes the model's math): {}",
                path.display(),
                unknown.join(", ")
            );
        }
        Ok(config)
    }

    /// Interprets a parsed HF `config.json`: the row its first
    /// `architectures` name (else its `model_type`) names reads it.
    pub fn from_hf_json(v: &Value) -> Result<ModelConfig> {
        let arch = v
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find_map(Value::as_str));
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let row = architectures().iter().find(|e| match arch {
            Some(a) => e.hf.contains(&a),
            None => e.model_types.contains(&model_type),
        });
        match row {
            Some(e) => (e.hf_config)(v, e.hf[0]),
            None => bail!(
                "architecture {} (model_type '{model_type}') is not supported; supported: {}",
                arch.unwrap_or("<none>"),
                supported_list()
            ),
        }
    }

    /// Reads the model's shape from GGUF metadata (`{arch}.*` keys): the
    /// first row naming the file's `general.architecture` reads it.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let name = g.architecture()?;
        let row = architectures()
            .iter()
            .find_map(|e| Some((e.arch, e.gguf_config?)).filter(|_| e.gguf.contains(&name)));
        let Some((arch, read)) = row else {
            bail!(
                "{}: GGUF architecture '{name}' is not supported; supported: {}",
                g.path().display(),
                supported_list()
            );
        };
        read(g, name, arch)
            .with_context(|| format!("{}: unsupported model shape", g.path().display()))
    }
}
