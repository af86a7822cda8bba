//! PEFT LoRA adapters as `save_pretrained` writes them: an
//! `adapter_config.json` and an `adapter_model.safetensors` whose tensors
//! are named `base_model.model.model.layers.N.<block>.<module>.lora_A.weight`
//! (`[r, in]`) and `…lora_B.weight` (`[out, r]`). Each adapted module adds
//! `scaling · B (A x)` to its projection's output, with `scaling` =
//! `lora_alpha / r` (or `lora_alpha / √r` under `use_rslora`).
//!
//! What would change the math and is not computed is refused here, by
//! name: DoRA, `modules_to_save`, trained biases, per-module rank or alpha
//! patterns, adapters on embeddings, the LM head or the experts of a
//! mixture, and adapters on the latent attention of DeepSeek.

use crate::engine::config::ModelConfig;
use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// A projection an adapter may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraModule {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraModule {
    pub const ALL: [LoraModule; 7] = [
        LoraModule::Q,
        LoraModule::K,
        LoraModule::V,
        LoraModule::O,
        LoraModule::Gate,
        LoraModule::Up,
        LoraModule::Down,
    ];

    /// Its Hugging Face name.
    pub fn hf_name(self) -> &'static str {
        match self {
            LoraModule::Q => "q_proj",
            LoraModule::K => "k_proj",
            LoraModule::V => "v_proj",
            LoraModule::O => "o_proj",
            LoraModule::Gate => "gate_proj",
            LoraModule::Up => "up_proj",
            LoraModule::Down => "down_proj",
        }
    }

    /// The block it sits in (`self_attn` or `mlp`).
    fn block(self) -> &'static str {
        match self {
            LoraModule::Q | LoraModule::K | LoraModule::V | LoraModule::O => "self_attn",
            _ => "mlp",
        }
    }

    /// `(in, out)` of its projection in a model shaped by `c`.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (d, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        match self {
            LoraModule::Q => (d, q),
            LoraModule::K | LoraModule::V => (d, kv),
            LoraModule::O => (q, d),
            LoraModule::Gate | LoraModule::Up => (d, f),
            LoraModule::Down => (f, d),
        }
    }
}

/// One adapted projection: `out += scaling · B (A x)`.
#[derive(Clone, Debug)]
pub struct LoraWeights {
    /// `[rank, in]`, row-major, f32.
    pub a: Vec<f32>,
    /// `[out, rank]`, row-major, f32.
    pub b: Vec<f32>,
    pub rank: usize,
    pub in_dim: usize,
    pub out_dim: usize,
}

/// A loaded adapter: its scaling and its adapted projections, by layer.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub rank: usize,
    /// `lora_alpha / r`, or `lora_alpha / √r` with `use_rslora`.
    pub scaling: f32,
    /// `(layer, module)` → its factors.
    pub modules: BTreeMap<(usize, LoraModule), LoraWeights>,
}

impl LoraAdapter {
    /// Loads the PEFT adapter in folder `dir` for a base model shaped by
    /// `base`, refusing ranks above `max_rank` (`--max-lora-rank`).
    pub fn load(dir: &Path, base: &ModelConfig, max_rank: usize) -> Result<LoraAdapter> {
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read(&config_path).with_context(|| {
            format!(
                "{}: cannot read the adapter's config (a PEFT adapter folder has adapter_config.json and adapter_model.safetensors)",
                config_path.display()
            )
        })?;
        let weights_path = dir.join("adapter_model.safetensors");
        if !weights_path.exists() {
            if dir.join("adapter_model.bin").exists() {
                bail!(
                    "{}: adapter_model.bin is a pickled PyTorch file, which Pagoda does not load; convert it with PEFT (`model.save_pretrained(dir, safe_serialization=True)`) to adapter_model.safetensors",
                    dir.display()
                );
            }
            bail!("{}: no adapter_model.safetensors", dir.display());
        }
        let bytes = std::fs::read(&weights_path)
            .with_context(|| format!("{}: cannot read", weights_path.display()))?;
        Self::from_bytes(
            &text,
            &bytes,
            base,
            max_rank,
            &config_path.display().to_string(),
            &weights_path.display().to_string(),
        )
    }

    /// Parses an adapter from the bytes of its two PEFT files (an upload),
    /// with the same refusals as [`LoraAdapter::load`]; errors name the
    /// files as `config_name` and `weights_name`.
    pub fn from_bytes(
        config: &[u8],
        weights: &[u8],
        base: &ModelConfig,
        max_rank: usize,
        config_name: &str,
        weights_name: &str,
    ) -> Result<LoraAdapter> {
        let config: Value = serde_json::from_slice(config)
            .with_context(|| format!("{config_name}: not valid JSON"))?;
        let (rank, scaling) =
            read_config(&config, max_rank).with_context(|| config_name.to_string())?;
        let modules =
            read_tensors(weights, base, rank).with_context(|| weights_name.to_string())?;
        if modules.is_empty() {
            bail!("{weights_name}: the adapter has no LoRA tensors");
        }
        Ok(LoraAdapter {
            rank,
            scaling,
            modules,
        })
    }

    /// Bytes its factors take in f32.
    pub fn size_bytes(&self) -> usize {
        self.modules
            .values()
            .map(|w| (w.a.len() + w.b.len()) * 4)
            .sum()
    }
}

/// The rank and scaling of a PEFT config, after refusing what is not
/// computed.
fn read_config(c: &Value, max_rank: usize) -> Result<(usize, f32)> {
    let peft_type = c.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        bail!("peft_type {peft_type:?} is not LoRA");
    }
    let truthy = |key: &str| c.get(key).is_some_and(|v| v.as_bool() == Some(true));
    let non_empty = |key: &str| match c.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    };
    if truthy("use_dora") {
        bail!("use_dora: DoRA adapters are not computed; serve a merged model instead");
    }
    if non_empty("modules_to_save") {
        bail!("modules_to_save: adapters that replace whole modules are not computed");
    }
    match c.get("bias").and_then(Value::as_str).unwrap_or("none") {
        "none" => {}
        other => bail!("bias {other:?}: adapters with trained biases are not computed"),
    }
    if truthy("lora_bias") {
        bail!("lora_bias: adapters with trained biases are not computed");
    }
    if truthy("fan_in_fan_out") {
        bail!("fan_in_fan_out: transposed (Conv1D) adapters are not computed");
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if non_empty(key) {
            bail!("{key}: per-module ranks or alphas are not computed");
        }
    }
    for key in [
        "use_qalora",
        "use_bdlora",
        "trainable_token_indices",
        "target_parameters",
    ] {
        if non_empty(key) && c.get(key) != Some(&Value::Bool(false)) {
            bail!("{key}: this PEFT variant is not computed");
        }
    }
    let rank = c
        .get("r")
        .and_then(Value::as_u64)
        .context("no integer 'r' (the LoRA rank)")? as usize;
    if rank == 0 {
        bail!("r is 0");
    }
    if rank > max_rank {
        bail!("r = {rank} is above --max-lora-rank {max_rank}; restart with --max-lora-rank {rank} or more");
    }
    let alpha = c
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .context("no number 'lora_alpha'")?;
    let scaling = if truthy("use_rslora") {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    };
    Ok((rank, scaling as f32))
}

/// Where a LoRA tensor's name points: `(layer, module, is_b)`.
fn parse_name(name: &str) -> Result<(usize, LoraModule, bool)> {
    let rest = name
        .strip_prefix("base_model.model.")
        .with_context(|| format!("tensor '{name}': not a PEFT LoRA tensor name"))?;
    let (rest, is_b) = if let Some(r) = rest.strip_suffix(".lora_A.weight") {
        (r, false)
    } else if let Some(r) = rest.strip_suffix(".lora_B.weight") {
        (r, true)
    } else {
        bail!("tensor '{name}': neither lora_A nor lora_B (only LoRA factors are computed)");
    };
    let Some(layer_rest) = rest.strip_prefix("model.layers.") else {
        bail!(
            "tensor '{name}': LoRA on {rest} is not computed (only the layers' attention and MLP projections)"
        );
    };
    let (layer, module_path) = layer_rest
        .split_once('.')
        .with_context(|| format!("tensor '{name}': no module after the layer"))?;
    let layer: usize = layer
        .parse()
        .with_context(|| format!("tensor '{name}': layer {layer:?} is not a number"))?;
    let module = LoraModule::ALL
        .into_iter()
        .find(|m| module_path == format!("{}.{}", m.block(), m.hf_name()))
        .with_context(|| {
            format!(
                "tensor '{name}': LoRA on {module_path} is not computed (only q/k/v/o_proj of self_attn and gate/up/down_proj of a dense mlp)"
            )
        })?;
    Ok((layer, module, is_b))
}

/// The adapted projections of an adapter file, checked against the base.
fn read_tensors(
    bytes: &[u8],
    base: &ModelConfig,
    rank: usize,
) -> Result<BTreeMap<(usize, LoraModule), LoraWeights>> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow::anyhow!("not a valid safetensors file: {e}"))?;
    if base.mla.is_some() {
        bail!("LoRA on latent attention (DeepSeek) is not computed yet");
    }
    let mut a_of = BTreeMap::new();
    let mut b_of = BTreeMap::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for name in &names {
        let (layer, module, is_b) = parse_name(name)?;
        if layer >= base.num_layers {
            bail!(
                "tensor '{name}': layer {layer}, but the base model has {} layers",
                base.num_layers
            );
        }
        if let (Some(moe), LoraModule::Gate | LoraModule::Up | LoraModule::Down) =
            (&base.moe, module)
        {
            if moe.sparse_layers.get(layer).copied().unwrap_or(true) {
                bail!("tensor '{name}': LoRA on the experts of a mixture is not computed");
            }
        }
        let t = st
            .tensor(name)
            .map_err(|e| anyhow::anyhow!("tensor '{name}': {e}"))?;
        let (in_dim, out_dim) = module.dims(base);
        let want = if is_b {
            [out_dim, rank]
        } else {
            [rank, in_dim]
        };
        if t.shape() != want {
            bail!(
                "tensor '{name}': shape {:?}, but r = {rank} on this base needs {want:?}",
                t.shape()
            );
        }
        let values = to_f32(name, t.dtype(), t.data())?;
        if values.iter().any(|v| !v.is_finite()) {
            bail!("tensor '{name}': holds a NaN or an infinity");
        }
        if is_b {
            b_of.insert((layer, module), values);
        } else {
            a_of.insert((layer, module), values);
        }
    }
    let mut modules = BTreeMap::new();
    for (key, a) in a_of {
        let b = b_of.remove(&key).with_context(|| {
            format!("layer {} {}: lora_A without lora_B", key.0, key.1.hf_name())
        })?;
        let (in_dim, out_dim) = key.1.dims(base);
        modules.insert(
            key,
            LoraWeights {
                a,
                b,
                rank,
                in_dim,
                out_dim,
            },
        );
    }
    if let Some((layer, module)) = b_of.keys().next() {
        bail!("layer {layer} {}: lora_B without lora_A", module.hf_name());
    }
    Ok(modules)
}

fn to_f32(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let halves = || {
        bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => halves().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        Dtype::BF16 => halves()
            .map(|b| half::bf16::from_bits(b).to_f32())
            .collect(),
        other => bail!("tensor '{name}': dtype {other:?}; LoRA factors must be F32, F16 or BF16"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_map_to_layers_and_modules() {
        assert_eq!(
            parse_name("base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight").ok(),
            Some((3, LoraModule::V, true))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").ok(),
            Some((0, LoraModule::Down, false))
        );
        for refused in [
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        ] {
            assert!(parse_name(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn configs_that_change_the_math_are_refused_by_name() {
        let base = serde_json::json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16});
        assert_eq!(read_config(&base, 64).ok(), Some((8, 2.0)));
        let mut rs = base.clone();
        rs["use_rslora"] = true.into();
        assert_eq!(read_config(&rs, 64).ok(), Some((8, 16.0 / 8f32.sqrt())));
        for (key, value, named) in [
            ("use_dora", serde_json::json!(true), "use_dora"),
            (
                "modules_to_save",
                serde_json::json!(["lm_head"]),
                "modules_to_save",
            ),
            ("bias", serde_json::json!("all"), "bias"),
            (
                "rank_pattern",
                serde_json::json!({"q_proj": 4}),
                "rank_pattern",
            ),
        ] {
            let mut c = base.clone();
            c[key] = value;
            let e = format!("{:#}", read_config(&c, 64).expect_err(key));
            assert!(e.contains(named), "{key}: {e}");
        }
        let e = format!("{:#}", read_config(&base, 4).expect_err("rank"));
        assert!(e.contains("--max-lora-rank"), "{e}");
    }
}
