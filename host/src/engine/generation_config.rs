//! Sampling defaults from a Hugging Face `generation_config.json`, applied
//! as vLLM applies them under its default `--generation-config auto`.
//!
//! vLLM reads the file through transformers' `GenerationConfig` and keeps
//! the fields that differ from transformers' own defaults
//! (`to_diff_dict`); of those it uses `temperature`, `top_p`, `top_k`,
//! `min_p`, `repetition_penalty` and `max_new_tokens` (as the default
//! `max_tokens`) as defaults for what a request leaves unset, and every id
//! of `eos_token_id` (an integer or a list) ends generation as EOS does.
//! The same rules are followed here. Other keys (`do_sample`,
//! `bos_token_id`, `transformers_version`, ...) are ignored.

use crate::engine::request::{SamplingDefaults, SamplingParams};
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The file a model folder keeps its generation defaults in.
pub const FILE_NAME: &str = "generation_config.json";

/// Where sampling defaults come from: `--generation-config`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum GenerationConfigSource {
    /// `auto`: the model folder's `generation_config.json`, if it has one
    /// (a GGUF file has none).
    #[default]
    Auto,
    /// `vllm`: vLLM's own defaults; the file's sampling fields are not
    /// read. (EOS ids the tokenizer takes from the model folder's
    /// `generation_config.json` still end generation, as in vLLM.)
    Vllm,
    /// A folder holding the `generation_config.json` to use.
    Folder(PathBuf),
}

impl std::str::FromStr for GenerationConfigSource {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => GenerationConfigSource::Auto,
            "vllm" => GenerationConfigSource::Vllm,
            "" => bail!("--generation-config must be auto, vllm, or a folder holding {FILE_NAME}"),
            folder => GenerationConfigSource::Folder(PathBuf::from(folder)),
        })
    }
}

/// The defaults read from one `generation_config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// The file they came from.
    pub path: PathBuf,
    pub defaults: SamplingDefaults,
}

/// Reads the generation config `source` names for `model` (a GGUF file or
/// an HF folder). `None` when there is none to apply: `vllm`, a GGUF model,
/// or a model folder without the file under `auto`. A folder given
/// explicitly must hold the file.
pub fn load(source: &GenerationConfigSource, model: &Path) -> Result<Option<GenerationConfig>> {
    let path = match source {
        GenerationConfigSource::Vllm => return Ok(None),
        GenerationConfigSource::Auto => {
            if !model.is_dir() {
                return Ok(None);
            }
            let path = model.join(FILE_NAME);
            if !path.exists() {
                return Ok(None);
            }
            path
        }
        GenerationConfigSource::Folder(dir) => {
            if !dir.is_dir() {
                bail!(
                    "--generation-config {}: not a folder (give auto, vllm, or a folder holding {FILE_NAME})",
                    dir.display()
                );
            }
            let path = dir.join(FILE_NAME);
            if !path.is_file() {
                bail!(
                    "--generation-config {}: the folder has no {FILE_NAME}",
                    dir.display()
                );
            }
            path
        }
    };
    Ok(Some(read(&path)?))
}

/// Reads and interprets one `generation_config.json`. Errors name the file
/// and what is wrong with it.
pub fn read(path: &Path) -> Result<GenerationConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let defaults = from_json(&v).with_context(|| format!("{}: invalid", path.display()))?;
    Ok(GenerationConfig {
        path: path.to_path_buf(),
        defaults,
    })
}

/// Interprets a parsed `generation_config.json`.
pub fn from_json(v: &Value) -> Result<SamplingDefaults> {
    let Some(obj) = v.as_object() else {
        bail!("must be a JSON object");
    };
    // transformers' GenerationConfig defaults; vLLM sees only the fields
    // that differ from them (`to_diff_dict`), so a file that spells out
    // `top_k: 50` leaves top-k off, as in vLLM.
    let unless = |x: Option<f32>, hf_default: f32| x.filter(|&x| x != hf_default);
    let d = SamplingDefaults {
        temperature: unless(number(obj, "temperature")?, 1.0),
        top_p: unless(number(obj, "top_p")?, 1.0),
        top_k: integer(obj, "top_k")?
            .map(|k| i32::try_from(k).with_context(|| format!("'top_k' {k} is out of range")))
            .transpose()?
            .filter(|&k| k != 50),
        min_p: number(obj, "min_p")?,
        repetition_penalty: unless(number(obj, "repetition_penalty")?, 1.0),
        max_tokens: match integer(obj, "max_new_tokens")? {
            None => None,
            Some(n) if n >= 1 => Some(
                usize::try_from(n).with_context(|| format!("'max_new_tokens' {n} is too large"))?,
            ),
            Some(n) => bail!("'max_new_tokens' must be at least 1, got {n}"),
        },
        eos_token_ids: token_ids(obj, "eos_token_id")?,
    };
    Ok(d)
}

/// Checks the defaults the way a request's values are checked, so that a
/// bad file fails at start-up instead of failing every request.
pub fn validate(d: &SamplingDefaults, vocab_size: usize) -> Result<()> {
    if let Some(&t) = d.eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        bail!("eos_token_id {t} is beyond the vocabulary of {vocab_size}");
    }
    let mut probe = SamplingParams::default();
    probe.apply_defaults(d);
    Ok(probe.validate(vocab_size)?)
}

fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn number(obj: &Map<String, Value>, key: &str) -> Result<Option<f32>> {
    field(obj, key)
        .map(|v| {
            v.as_f64()
                .map(|x| x as f32)
                .with_context(|| format!("'{key}' must be a number, got {v}"))
        })
        .transpose()
}

fn integer(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>> {
    field(obj, key)
        .map(|v| {
            v.as_i64()
                .with_context(|| format!("'{key}' must be an integer, got {v}"))
        })
        .transpose()
}

/// A token id or a list of them; duplicates dropped, order kept.
fn token_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .with_context(|| format!("'{key}' must be a token id or a list of token ids, got {v}"))
    };
    let ids = match field(obj, key) {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(one).collect::<Result<Vec<_>>>()?,
        Some(v) => vec![one(v)?],
    };
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_fields_vllm_uses_and_ignores_the_rest() {
        let d = from_json(&json!({
            "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_new_tokens": 256,
            "eos_token_id": [128001, 128009, 128001], "bos_token_id": 128000,
            "do_sample": true, "transformers_version": "4.45.0", "frobnicate": [1]
        }))
        .expect("valid");
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(20),
                min_p: Some(0.05),
                repetition_penalty: Some(1.1),
                max_tokens: Some(256),
                eos_token_ids: vec![128001, 128009],
            }
        );
        let d = from_json(&json!({"eos_token_id": 2, "temperature": null})).expect("valid");
        assert_eq!(d.eos_token_ids, [2]);
        assert_eq!(d.temperature, None);
    }

    #[test]
    fn transformers_defaults_are_not_applied_as_vllm_does_not() {
        let d = from_json(&json!({"temperature": 1.0, "top_p": 1.0, "top_k": 50,
            "repetition_penalty": 1.0}))
        .expect("valid");
        assert!(d.is_empty(), "{d:?}");
    }

    #[test]
    fn wrong_types_name_the_key() {
        for (v, key) in [
            (json!({"temperature": "hot"}), "'temperature'"),
            (json!({"top_k": 1.5}), "'top_k'"),
            (json!({"max_new_tokens": -1}), "'max_new_tokens'"),
            (json!({"max_new_tokens": 0}), "'max_new_tokens'"),
            (json!({"eos_token_id": "</s>"}), "'eos_token_id'"),
            (json!({"eos_token_id": [2, -1]}), "'eos_token_id'"),
        ] {
            let e = format!("{:#}", from_json(&v).expect_err("invalid"));
            assert!(e.contains(key), "{v}: {e}");
        }
        assert!(from_json(&json!([1])).is_err());
    }

    #[test]
    fn out_of_range_values_fail_validation() {
        let d = from_json(&json!({"top_p": 1.5})).expect("parses");
        let e = validate(&d, 100).expect_err("invalid").to_string();
        assert!(e.contains("top_p"), "{e}");
        let d = from_json(&json!({"eos_token_id": [5, 100]})).expect("parses");
        let e = validate(&d, 100).expect_err("invalid").to_string();
        assert!(e.contains("eos_token_id 100"), "{e}");
        assert!(validate(&from_json(&json!({"top_k": 5})).expect("parses"), 100).is_ok());
    }

    #[test]
    fn the_source_flag_parses() {
        assert_eq!(
            "auto".parse::<GenerationConfigSource>().ok(),
            Some(GenerationConfigSource::Auto)
        );
        assert_eq!(
            "vllm".parse::<GenerationConfigSource>().ok(),
            Some(GenerationConfigSource::Vllm)
        );
        assert_eq!(
            "/m/gen".parse::<GenerationConfigSource>().ok(),
            Some(GenerationConfigSource::Folder("/m/gen".into()))
        );
        assert!("".parse::<GenerationConfigSource>().is_err());
    }

    #[test]
    fn request_values_win_over_the_model_and_the_model_over_fallbacks() {
        let model = SamplingDefaults {
            temperature: Some(0.6),
            max_tokens: Some(7),
            ..Default::default()
        };
        let mut p = SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        };
        // A front end's fallbacks apply only where the model sets nothing.
        p.apply_defaults(&model.fallback_under(SamplingDefaults {
            temperature: Some(0.3),
            top_p: Some(0.5),
            max_tokens: Some(128),
            ..Default::default()
        }));
        p.apply_defaults(&model);
        assert_eq!(p.temperature, Some(0.0));
        assert_eq!(p.top_p, Some(0.5));
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.top_k(), 0);
        assert_eq!(p.repetition_penalty(), 1.0);
    }
}
