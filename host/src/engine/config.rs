//! The model's shape and hyper-parameters, read from `config.json` or from
//! GGUF metadata into one form the model definition uses.

use crate::engine::loader::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{RopeScaling, RopeStyle};
use serde_json::Value;
use std::path::Path;

/// The architectures one Llama-family definition serves, with the names
/// they carry in HF `config.json` (`architectures`) and in GGUF
/// (`general.architecture`).
pub const SUPPORTED_ARCHITECTURES: &[(&str, &str, &str)] = &[
    (
        "LlamaForCausalLM",
        "llama",
        "Llama 2, Llama 3.x, SmolLM2, TinyLlama, Vicuna",
    ),
    ("MistralForCausalLM", "llama", "Mistral 7B (v0.1 to v0.3)"),
    (
        "Qwen2ForCausalLM",
        "qwen2",
        "Qwen2, Qwen2.5 (attention q/k/v bias)",
    ),
];

/// The longest context the engine accepts (16M tokens).
pub const MAX_CONTEXT: usize = 1 << 24;

/// Which member of the family; decides the small differences between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, Mistral and SmolLM2: no attention bias.
    Llama,
    /// Qwen2: biases on the q, k and v projections.
    Qwen2,
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    /// The context length the model was trained for.
    pub max_position_embeddings: usize,
    /// The LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// The q, k and v projections carry a bias (Qwen2).
    pub attention_bias: bool,
}

impl ModelConfig {
    /// Reads an HF `config.json`.
    pub fn from_hf_config(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the model config", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        Self::from_hf_json(&v).with_context(|| format!("{}: unsupported config", path.display()))
    }

    /// Interprets a parsed HF `config.json`.
    pub fn from_hf_json(v: &Value) -> Result<ModelConfig> {
        let archs: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = match (archs.first().copied(), model_type) {
            (Some("LlamaForCausalLM" | "MistralForCausalLM"), _) | (None, "llama" | "mistral") => {
                Arch::Llama
            }
            (Some("Qwen2ForCausalLM"), _) | (None, "qwen2") => Arch::Qwen2,
            (other, mt) => bail!(
                "architecture {} (model_type '{mt}') is not supported; supported: {}",
                other.unwrap_or("<none>"),
                supported_list()
            ),
        };
        let usize_of = |key: &str| -> Result<usize> {
            let x = v
                .get(key)
                .with_context(|| format!("missing '{key}'"))?
                .as_u64()
                .with_context(|| format!("'{key}' must be a positive integer"))?;
            usize::try_from(x).with_context(|| format!("'{key}' is too large"))
        };
        let f32_of = |key: &str, default: f32| -> Result<f32> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .map(|x| x as f32)
                    .with_context(|| format!("'{key}' must be a number")),
            }
        };
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let num_kv_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => usize_of("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => {
                if num_heads == 0 {
                    bail!("'num_attention_heads' must be positive");
                }
                hidden_size / num_heads
            }
            Some(_) => usize_of("head_dim")?,
        };
        let rope_scaling = parse_hf_rope_scaling(v.get("rope_scaling"))?;
        let cfg = ModelConfig {
            arch,
            hidden_size,
            num_layers: usize_of("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: usize_of("intermediate_size")?,
            vocab_size: usize_of("vocab_size")?,
            rms_norm_eps: f32_of("rms_norm_eps", 1e-6)?,
            rope_theta: f32_of("rope_theta", 10_000.0)?,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            max_position_embeddings: match v.get("max_position_embeddings") {
                None | Some(Value::Null) => 2048,
                Some(_) => usize_of("max_position_embeddings")?,
            },
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            attention_bias: arch == Arch::Qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the model's shape from GGUF metadata (`{arch}.*` keys).
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let name = g.architecture()?;
        let arch = match name {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => bail!(
                "{}: GGUF architecture '{other}' is not supported; supported: {}",
                g.path().display(),
                supported_list()
            ),
        };
        let key = |k: &str| format!("{name}.{k}");
        let req = |k: &str| -> Result<usize> {
            let x = g.get_u64(&key(k))?.with_context(|| {
                format!("{}: missing metadata '{}'", g.path().display(), key(k))
            })?;
            usize::try_from(x).with_context(|| format!("'{}' is too large", key(k)))
        };
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = match g.get_u64(&key("attention.head_count_kv"))? {
            Some(x) => x as usize,
            None => num_heads,
        };
        let head_dim = match g.get_u64(&key("attention.key_length"))? {
            Some(x) => x as usize,
            None if num_heads > 0 => hidden_size / num_heads,
            None => bail!("{}: attention.head_count is 0", g.path().display()),
        };
        // The rotary embedding covers whole heads in every architecture
        // served here; a file that says otherwise (0 included) would be
        // computed wrongly, so it is refused rather than ignored.
        if let Some(n) = g.get_u64(&key("rope.dimension_count"))? {
            if n != head_dim as u64 {
                bail!(
                    "{}: {} is {n}, but the attention heads are {head_dim} wide; only a rotary embedding over whole heads is supported",
                    g.path().display(),
                    key("rope.dimension_count")
                );
            }
        }
        let vocab_size = match g.get_u64(&key("vocab_size"))? {
            Some(x) => x as usize,
            None => g
                .get_str_array("tokenizer.ggml.tokens")?
                .map(|t| t.len())
                .with_context(|| {
                    format!("{}: no vocab_size and no tokenizer", g.path().display())
                })?,
        };
        let rope_scaling = match g.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: g.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
            },
            Some(other) => bail!(
                "{}: rope scaling '{other}' is not supported (supported: none, linear, llama3)",
                g.path().display()
            ),
        };
        let tie_word_embeddings = !g.tensors().iter().any(|t| t.name == "output.weight");
        let cfg = ModelConfig {
            arch,
            hidden_size,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: req("feed_forward_length")?,
            vocab_size,
            rms_norm_eps: g
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: g.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling,
            // llama.cpp's converter permutes the q/k rows of llama-arch
            // models so that rotation pairs are adjacent; qwen2 keeps HF's
            // half-split layout.
            rope_style: if arch == Arch::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            max_position_embeddings: g.get_u64(&key("context_length"))?.unwrap_or(2048) as usize,
            tie_word_embeddings,
            attention_bias: arch == Arch::Qwen2,
        };
        cfg.validate()
            .with_context(|| format!("{}: unsupported model shape", g.path().display()))?;
        Ok(cfg)
    }

    /// Rejects shapes the kernels cannot run, with the reason.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, x) in positive {
            if x == 0 {
                bail!("'{name}' must be positive");
            }
        }
        // Bounds far above any real model, so a corrupt or hostile config
        // fails here instead of in a giant allocation.
        let limits = [
            ("num_hidden_layers", self.num_layers, 1 << 10),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 19),
            ("num_attention_heads", self.num_heads, 1 << 10),
            ("vocab_size", self.vocab_size, 1 << 22),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_CONTEXT,
            ),
        ];
        for (name, x, max) in limits {
            if x > max {
                bail!("'{name}' = {x} is beyond the supported maximum of {max}");
            }
        }
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    bail!("rope_scaling factor {factor} must be a positive number");
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                if !(factor.is_finite() && factor > 0.0) {
                    bail!("rope_scaling factor {factor} must be a positive number");
                }
                if !(low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && high_freq_factor.is_finite())
                {
                    bail!("llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {low_freq_factor} and {high_freq_factor}");
                }
                if original_max_position == 0 {
                    bail!("llama3 rope_scaling needs a positive original_max_position_embeddings");
                }
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.num_heads / self.num_kv_heads > 16 {
            bail!(
                "a GQA group of {} query heads per KV head is more than the 16 supported",
                self.num_heads / self.num_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > 256 {
            bail!(
                "head_dim {} is not supported (must be even and at most 256)",
                self.head_dim
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("rope_theta {} must be a positive number", self.rope_theta);
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!(
                "rms_norm_eps {} must be a non-negative number",
                self.rms_norm_eps
            );
        }
        Ok(())
    }

    /// Width of the query projection output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key (and value) projection output.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn parse_hf_rope_scaling(v: Option<&Value>) -> Result<RopeScaling> {
    let Some(obj) = v.and_then(Value::as_object) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str, d: f64| obj.get(k).and_then(Value::as_f64).unwrap_or(d) as f32;
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor", 1.0),
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor", 8.0),
            low_freq_factor: num("low_freq_factor", 1.0),
            high_freq_factor: num("high_freq_factor", 4.0),
            original_max_position: num("original_max_position_embeddings", 8192.0) as usize,
        }),
        other => bail!(
            "rope_scaling type '{other}' is not supported (supported: default, linear, llama3)"
        ),
    }
}

fn supported_list() -> String {
    SUPPORTED_ARCHITECTURES
        .iter()
        .map(|(a, _, _)| *a)
        .collect::<Vec<_>>()
        .join(", ")
}
