//! `--speculative-config`, read with vLLM's keys and defaulting rules, and
//! the seed's `--speculative-model` / `--num-speculative-tokens`, which
//! mean the same thing. Anything Pagoda would have to guess at is refused
//! at start-up with what to change.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::PathBuf;

use super::MAX_SPECULATIVE_TOKENS;

/// Where drafts come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: the tokens that followed the longest earlier match
    /// of the history's last `min..=max` tokens.
    Ngram { min: usize, max: usize },
    /// A smaller model sharing the target's tokenizer.
    DraftModel { model: PathBuf },
}

/// How a draft model picks its drafts (vLLM's `draft_sample_method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftSampleMethod {
    /// The draft model's argmax; verification treats the proposal as
    /// certain (a one-hot draft distribution).
    #[default]
    Greedy,
    /// Sampled from the draft model's distribution, which verification
    /// then divides by.
    Probabilistic,
}

/// Speculative decoding, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpecMethod,
    /// Drafts per sequence and step.
    pub num_speculative_tokens: usize,
    pub draft_sample_method: DraftSampleMethod,
    /// Speculation pauses while more sequences than this run (vLLM's
    /// `disable_by_batch_size`): a full batch is compute-bound, and
    /// verifying drafts there costs more than it saves. `None`: the
    /// engine's measured default for the device.
    pub disable_by_batch_size: Option<usize>,
}

/// The keys of vLLM's `--speculative-config` that Pagoda reads.
const KEYS: &[&str] = &[
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_sample_method",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
];

/// vLLM methods that need a trained head or a proposer Pagoda lacks.
const UNBUILT_METHODS: &[&str] = &[
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "deepseek_mtp",
    "suffix",
];

fn usize_key(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).with_context(|| {
            format!("--speculative-config: \"{key}\" must be a non-negative integer, got {v}")
        }),
    }
}

fn str_key<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => bail!("--speculative-config: \"{key}\" must be a string, got {v}"),
    }
}

impl SpeculativeConfig {
    /// Reads the serve flags: `--speculative-config JSON`, or the seed's
    /// `--speculative-model M` with `--num-speculative-tokens N` (the same
    /// as `{"model": M, "num_speculative_tokens": N}`). `None` when no
    /// flag asks for speculation.
    pub fn from_flags(
        speculative_config: Option<&str>,
        speculative_model: Option<&str>,
        num_speculative_tokens: Option<usize>,
    ) -> Result<Option<SpeculativeConfig>> {
        match (speculative_config, speculative_model, num_speculative_tokens) {
            (None, None, None) => Ok(None),
            (Some(json), None, None) => SpeculativeConfig::from_json(json).map(Some),
            (Some(_), _, _) => bail!(
                "--speculative-config cannot be combined with --speculative-model or --num-speculative-tokens: put \"model\" and \"num_speculative_tokens\" in the JSON instead"
            ),
            (None, Some(model), n) => {
                let mut obj = Map::new();
                obj.insert("model".into(), Value::String(model.into()));
                if let Some(n) = n {
                    obj.insert("num_speculative_tokens".into(), Value::from(n as u64));
                }
                SpeculativeConfig::from_object(&obj)
                    .map(Some)
                    .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace("--speculative-config: \"num_speculative_tokens\" is required", "--num-speculative-tokens is required with --speculative-model")))
            }
            (None, None, Some(_)) => bail!(
                "--num-speculative-tokens needs a proposer: add --speculative-model PATH (or \"[ngram]\"), or use --speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": N}}'"
            ),
        }
    }

    /// Parses vLLM's `--speculative-config` JSON.
    pub fn from_json(json: &str) -> Result<SpeculativeConfig> {
        let v: Value = serde_json::from_str(json)
            .with_context(|| format!("--speculative-config is not valid JSON: {json}"))?;
        let Value::Object(obj) = v else {
            bail!("--speculative-config must be a JSON object, such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}");
        };
        SpeculativeConfig::from_object(&obj)
    }

    fn from_object(obj: &Map<String, Value>) -> Result<SpeculativeConfig> {
        if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            bail!(
                "--speculative-config: key \"{k}\" is not supported; the keys read are {}",
                KEYS.join(", ")
            );
        }
        let model = str_key(obj, "model")?;
        let method = match (str_key(obj, "method")?, model) {
            (Some("ngram" | "[ngram]"), Some(m)) if m != "ngram" && m != "[ngram]" => bail!(
                "--speculative-config: method \"ngram\" drafts from the prompt and takes no \"model\" (got \"{m}\"); drop \"model\", or use method \"draft_model\""
            ),
            (Some("ngram" | "[ngram]"), _) | (None, Some("ngram" | "[ngram]")) => "ngram",
            (Some("draft_model"), Some(_)) | (None, Some(_)) => "draft_model",
            (Some("draft_model"), None) => bail!(
                "--speculative-config: method \"draft_model\" needs \"model\": the path of a smaller model with the same tokenizer"
            ),
            (Some(m), _) if UNBUILT_METHODS.contains(&m) => bail!(
                "--speculative-config: method \"{m}\" is not supported; use \"ngram\" or \"draft_model\""
            ),
            (Some(m), _) => bail!(
                "--speculative-config: unknown method \"{m}\"; use \"ngram\" or \"draft_model\""
            ),
            (None, None) => bail!(
                "--speculative-config needs \"method\" (\"ngram\" or \"draft_model\") or \"model\""
            ),
        };
        let n = usize_key(obj, "num_speculative_tokens")?
            .context("--speculative-config: \"num_speculative_tokens\" is required (how many tokens to draft per step, e.g. 4)")?;
        if n == 0 || n > MAX_SPECULATIVE_TOKENS {
            bail!(
                "--speculative-config: \"num_speculative_tokens\" must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {n}"
            );
        }
        let (lookup_min, lookup_max) = (
            usize_key(obj, "prompt_lookup_min")?,
            usize_key(obj, "prompt_lookup_max")?,
        );
        let method = if method == "ngram" {
            // vLLM's defaulting: both unset → 5 and 5; one set → the other
            // takes its value.
            let (min, max) = match (lookup_min, lookup_max) {
                (None, None) => (5, 5),
                (Some(a), None) => (a, a),
                (None, Some(b)) => (b, b),
                (Some(a), Some(b)) => (a, b),
            };
            if min == 0 || max == 0 {
                bail!("--speculative-config: \"prompt_lookup_min\" and \"prompt_lookup_max\" must be at least 1, got {min} and {max}");
            }
            if min > max {
                bail!("--speculative-config: \"prompt_lookup_min\" ({min}) is larger than \"prompt_lookup_max\" ({max})");
            }
            SpecMethod::Ngram { min, max }
        } else {
            if lookup_min.is_some() || lookup_max.is_some() {
                bail!("--speculative-config: \"prompt_lookup_min\" and \"prompt_lookup_max\" apply only to method \"ngram\"; drop them for a draft model");
            }
            SpecMethod::DraftModel {
                model: PathBuf::from(model.unwrap_or_default()),
            }
        };
        let draft_sample_method = match str_key(obj, "draft_sample_method")? {
            None | Some("greedy") => DraftSampleMethod::Greedy,
            Some("probabilistic") => DraftSampleMethod::Probabilistic,
            Some(other) => bail!(
                "--speculative-config: \"draft_sample_method\" must be \"greedy\" or \"probabilistic\", got \"{other}\""
            ),
        };
        if draft_sample_method == DraftSampleMethod::Probabilistic
            && matches!(method, SpecMethod::Ngram { .. })
        {
            bail!("--speculative-config: \"draft_sample_method\": \"probabilistic\" needs a draft model's distribution; n-gram drafts are always greedy");
        }
        match usize_key(obj, "draft_tensor_parallel_size")? {
            None | Some(1) => {}
            Some(n) => bail!(
                "--speculative-config: \"draft_tensor_parallel_size\" {n} is not supported: the draft model runs on one device context (use 1)"
            ),
        }
        let disable_by_batch_size = usize_key(obj, "disable_by_batch_size")?;
        if disable_by_batch_size == Some(0) {
            bail!("--speculative-config: \"disable_by_batch_size\" must be at least 1");
        }
        Ok(SpeculativeConfig {
            method,
            num_speculative_tokens: n,
            draft_sample_method,
            disable_by_batch_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<SpeculativeConfig> {
        SpeculativeConfig::from_json(json)
    }

    fn err(json: &str) -> String {
        format!("{:#}", parse(json).expect_err(json))
    }

    #[test]
    fn ngram_lookup_bounds_default_as_vllm_does() {
        let bounds = |json| match parse(json).map(|c| c.method) {
            Ok(SpecMethod::Ngram { min, max }) => (min, max),
            other => panic!("{json}: {other:?}"),
        };
        assert_eq!(
            bounds(r#"{"method": "ngram", "num_speculative_tokens": 3}"#),
            (5, 5)
        );
        assert_eq!(
            bounds(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#),
            (4, 4)
        );
        assert_eq!(
            bounds(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}"#),
            (2, 2)
        );
        assert_eq!(
            bounds(
                r#"{"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#
            ),
            (1, 3)
        );
    }

    #[test]
    fn a_model_implies_the_draft_model_method() {
        let c = parse(r#"{"model": "/models/small", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!(
            c.method,
            SpecMethod::DraftModel {
                model: "/models/small".into()
            }
        );
        assert_eq!(c.draft_sample_method, DraftSampleMethod::Greedy);
        let c = parse(r#"{"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}"#).unwrap();
        assert_eq!(c.draft_sample_method, DraftSampleMethod::Probabilistic);
    }

    #[test]
    fn the_seed_flags_mean_the_same_as_the_json() {
        let flags = SpeculativeConfig::from_flags(None, Some("/m"), Some(3)).unwrap();
        let json = SpeculativeConfig::from_flags(
            Some(r#"{"model": "/m", "num_speculative_tokens": 3}"#),
            None,
            None,
        )
        .unwrap();
        assert_eq!(flags, json);
        assert!(SpeculativeConfig::from_flags(None, None, None)
            .unwrap()
            .is_none());
        let ngram = SpeculativeConfig::from_flags(None, Some("[ngram]"), Some(2)).unwrap();
        assert!(matches!(
            ngram.map(|c| c.method),
            Some(SpecMethod::Ngram { .. })
        ));
    }

    #[test]
    fn bad_combinations_say_what_to_change() {
        for (json, says) in [
            (
                r#"{"method": "ngram"}"#,
                "\"num_speculative_tokens\" is required",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 0}"#,
                "between 1 and 16",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 99}"#,
                "between 1 and 16",
            ),
            (
                r#"{"method": "eagle", "model": "x", "num_speculative_tokens": 2}"#,
                "method \"eagle\" is not supported",
            ),
            (
                r#"{"method": "draft_model", "num_speculative_tokens": 2}"#,
                "needs \"model\"",
            ),
            (
                r#"{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}"#,
                "takes no \"model\"",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#,
                "larger than",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}"#,
                "at least 1",
            ),
            (
                r#"{"model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}"#,
                "apply only to method \"ngram\"",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}"#,
                "always greedy",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "top"}"#,
                "\"greedy\" or \"probabilistic\"",
            ),
            (
                r#"{"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}"#,
                "one device context",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": "4"}"#,
                "non-negative integer",
            ),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 4, "acceptance": 1}"#,
                "key \"acceptance\" is not supported",
            ),
            (r#"["ngram"]"#, "must be a JSON object"),
            (r#"{"method": "#, "not valid JSON"),
            (r#"{}"#, "needs \"method\""),
        ] {
            let e = err(json);
            assert!(e.contains(says), "{json}: {e}");
        }
        let e = format!(
            "{:#}",
            SpeculativeConfig::from_flags(None, None, Some(3)).unwrap_err()
        );
        assert!(e.contains("add --speculative-model"), "{e}");
        let e = format!(
            "{:#}",
            SpeculativeConfig::from_flags(None, Some("/m"), None).unwrap_err()
        );
        assert!(e.contains("--num-speculative-tokens is required"), "{e}");
        let e = format!(
            "{:#}",
            SpeculativeConfig::from_flags(Some("{}"), Some("/m"), Some(2)).unwrap_err()
        );
        assert!(e.contains("cannot be combined"), "{e}");
    }
}
