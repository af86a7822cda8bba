//! Pooling models (embeddings): which runner a model gets (`--runner`,
//! `--convert`), and how its hidden states become one vector per input
//! (`--pooler-config`, else the model's sentence-transformers files), as
//! vLLM reads them.
//!
//! A pooling request is a prefill-only row in the engine's ordinary
//! batches: it runs its prompt, the runner reads the final-normed hidden
//! state of the pooled token instead of sampling, and the request leaves
//! at once, keeping no KV (see `EngineCore::add_request`). The raw pooled
//! state comes back in the engine's output; [`PoolerConfig::finish`] then
//! truncates (`dimensions`) and normalizes it, in the front end.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// `--runner`: what the model is served for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RunnerKind {
    /// Pooling when the model's files say it is an embedding or scoring
    /// model (an architecture without a head, or sentence-transformers'
    /// `modules.json`), else generation.
    #[default]
    Auto,
    Generate,
    Pooling,
}

impl RunnerKind {
    /// Parses the flag's value.
    pub fn parse(s: &str) -> Result<RunnerKind> {
        Ok(match s {
            "auto" => RunnerKind::Auto,
            "generate" => RunnerKind::Generate,
            "pooling" => RunnerKind::Pooling,
            other => bail!("--runner {other}: expected auto, generate or pooling"),
        })
    }
}

/// `--convert`: how a generative checkpoint is turned into a pooling model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvertKind {
    #[default]
    Auto,
    /// Embeddings from the last hidden states.
    Embed,
    /// Class scores from a classification head (cross-encoders).
    Classify,
}

impl ConvertKind {
    /// Parses the flag's value.
    pub fn parse(s: &str) -> Result<ConvertKind> {
        Ok(match s {
            "auto" => ConvertKind::Auto,
            "embed" => ConvertKind::Embed,
            "classify" => ConvertKind::Classify,
            "none" => ConvertKind::Auto,
            other => bail!("--convert {other}: expected auto, embed or classify"),
        })
    }
}

/// Which hidden states make an input's vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingType {
    /// The last token's (decoder embedding models: Qwen3-Embedding).
    Last,
    /// The first token's (`[CLS]`).
    Cls,
    /// The mean over every token.
    Mean,
}

impl PoolingType {
    fn parse(s: &str) -> Result<PoolingType> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "LAST" => PoolingType::Last,
            "CLS" => PoolingType::Cls,
            "MEAN" => PoolingType::Mean,
            other => bail!("pooling_type {other:?}: expected LAST, CLS or MEAN"),
        })
    }

    /// How the model's forward pools its sequence's rows.
    pub fn seq_pooling(self) -> pagoda_accel::ops::SeqPooling {
        match self {
            PoolingType::Last => pagoda_accel::ops::SeqPooling::Last,
            PoolingType::Cls => pagoda_accel::ops::SeqPooling::First,
            PoolingType::Mean => pagoda_accel::ops::SeqPooling::Mean,
        }
    }

    /// vLLM's name for it.
    pub fn name(self) -> &'static str {
        match self {
            PoolingType::Last => "LAST",
            PoolingType::Cls => "CLS",
            PoolingType::Mean => "MEAN",
        }
    }
}

/// What a pooling model's vectors are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingTask {
    /// Embeddings (`/v1/embeddings`, `/pooling`).
    Embed,
    /// A cross-encoder's relevance score of a pair (`/score`, `/rerank`):
    /// one raw logit per input, which the score endpoints pass through a
    /// sigmoid as vLLM's default activation for one label does.
    Score,
    /// A sequence classifier with several labels (`/classify`): its
    /// `num_labels` raw logits per input, which `/classify` turns into
    /// probabilities with a softmax, as vLLM's default activation does.
    Classify,
}

/// How a pooling model makes its vectors.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolerConfig {
    pub pooling_type: PoolingType,
    /// L2-normalize each vector (sentence-transformers' `Normalize`).
    pub normalize: bool,
    /// What the vectors are for.
    pub task: PoolingTask,
    /// A classifier's label names, by index (its config's `id2label`);
    /// empty for an embedding model.
    pub labels: Vec<String>,
    /// A decoder served as a reranker from two of its vocabulary's tokens
    /// (vLLM's `classifier_from_token`, the Qwen3-Reranker form).
    pub token_head: Option<TokenHead>,
    /// A scored pair's token types travel in its ids (an encoder with a
    /// token type table: BERT, XLM-R); otherwise the pair goes untyped, as
    /// one text (decoder rerankers, ModernBERT).
    pub pair_types: bool,
}

/// The Qwen3-Reranker form of a causal model (vLLM's `--hf-overrides
/// '{"architectures": ["Qwen3ForSequenceClassification"],
/// "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker":
/// true}'`): the score of a pair is P(yes) of the softmax over the logits
/// of the two tokens at its last token, which is the sigmoid of
/// `h · (W[yes] - W[no])` for the final-normed hidden state `h` and the
/// LM head `W`; `weight` holds that difference.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenHead {
    /// The "false" and "true" tokens, in that order.
    pub tokens: [String; 2],
    /// `W[true] - W[false]` (filled once the weights are read).
    pub weight: Vec<f32>,
}

/// Reads vLLM's `--hf-overrides` JSON: only the Qwen3-Reranker form is
/// implemented (`architectures` naming a `*ForSequenceClassification`,
/// `classifier_from_token` with the false and true tokens, and
/// `is_original_qwen3_reranker` true); other keys are refused by name.
pub fn token_head_from_overrides(json: &str) -> Result<TokenHead> {
    let v: Value =
        serde_json::from_str(json).with_context(|| format!("--hf-overrides {json}: not JSON"))?;
    let obj = v
        .as_object()
        .with_context(|| format!("--hf-overrides {json}: expected a JSON object"))?;
    let mut tokens = None;
    let mut original = false;
    let mut classifier_arch = false;
    for (k, val) in obj {
        match k.as_str() {
            "architectures" => {
                classifier_arch = val
                    .as_array()
                    .and_then(|a| a.first())
                    .and_then(Value::as_str)
                    .is_some_and(|a| a.ends_with("ForSequenceClassification"));
                if !classifier_arch {
                    bail!("--hf-overrides: architectures {val} is not implemented (only a *ForSequenceClassification, the Qwen3-Reranker form)");
                }
            }
            "classifier_from_token" => {
                let t: Vec<String> = val
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
                match <[String; 2]>::try_from(t) {
                    Ok(pair) => tokens = Some(pair),
                    Err(_) => bail!("--hf-overrides: classifier_from_token must name two tokens, the false and the true one (such as [\"no\", \"yes\"]); got {val}"),
                }
            }
            "is_original_qwen3_reranker" => {
                original = val
                    .as_bool()
                    .context("--hf-overrides: is_original_qwen3_reranker must be true or false")?;
            }
            other => bail!("--hf-overrides: key {other:?} is not implemented (supported: architectures, classifier_from_token, is_original_qwen3_reranker, the Qwen3-Reranker form)"),
        }
    }
    match (classifier_arch, tokens, original) {
        (true, Some(tokens), true) => Ok(TokenHead {
            tokens,
            weight: Vec::new(),
        }),
        _ => bail!("--hf-overrides: only the Qwen3-Reranker form is implemented: give architectures [\"Qwen3ForSequenceClassification\"], classifier_from_token [\"no\", \"yes\"] and is_original_qwen3_reranker true"),
    }
}

impl PoolerConfig {
    /// What a decoder converted to an embedding model pools by default, as
    /// vLLM's `as_embedding_model`: the last token, normalized.
    pub const DECODER_DEFAULT: PoolerConfig = PoolerConfig {
        pooling_type: PoolingType::Last,
        normalize: true,
        task: PoolingTask::Embed,
        labels: Vec::new(),
        token_head: None,
        pair_types: false,
    };

    /// What a BERT encoder without sentence-transformers' files pools by
    /// default, as vLLM's `BertEmbeddingModel`: its `[CLS]` row,
    /// normalized.
    pub const ENCODER_DEFAULT: PoolerConfig = PoolerConfig {
        pooling_type: PoolingType::Cls,
        normalize: true,
        task: PoolingTask::Embed,
        labels: Vec::new(),
        token_head: None,
        pair_types: true,
    };

    /// A cross-encoder (`*ForSequenceClassification`, one label): its
    /// `[CLS]` row through the model's pooler and classifier, one raw
    /// logit, not normalized.
    pub const CROSS_ENCODER: PoolerConfig = PoolerConfig {
        pooling_type: PoolingType::Cls,
        normalize: false,
        task: PoolingTask::Score,
        labels: Vec::new(),
        token_head: None,
        pair_types: true,
    };

    /// A `*ForSequenceClassification` checkpoint whose config is
    /// `config_json`: a cross-encoder ([`PoolerConfig::CROSS_ENCODER`])
    /// with one label, a classifier ([`PoolingTask::Classify`]) with
    /// several; the labels named by `id2label`. Its rows pool as the
    /// config's `classifier_pooling` says (ModernBERT's `cls` or `mean`),
    /// else the `[CLS]` row.
    pub fn classifier(config_json: &Value) -> Result<PoolerConfig> {
        let labels = classifier_labels(config_json)?;
        let pooling_type = match config_json.get("classifier_pooling") {
            None | Some(Value::Null) => PoolingType::Cls,
            Some(Value::String(s)) if s == "cls" => PoolingType::Cls,
            Some(Value::String(s)) if s == "mean" => PoolingType::Mean,
            Some(other) => {
                bail!("classifier_pooling {other} is not implemented (only cls and mean are)")
            }
        };
        Ok(PoolerConfig {
            task: if labels.len() == 1 {
                PoolingTask::Score
            } else {
                PoolingTask::Classify
            },
            labels,
            pooling_type,
            ..PoolerConfig::CROSS_ENCODER
        })
    }

    /// The pooling sentence-transformers' `modules.json` in `dir`
    /// describes, if the folder has one: its Pooling module's
    /// `config.json` (one `pooling_mode_*` set) and whether a Normalize
    /// module follows.
    pub fn from_sentence_transformers(dir: &Path) -> Result<Option<PoolerConfig>> {
        let path = dir.join("modules.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let modules: Vec<Value> = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a JSON list of modules", path.display()))?;
        let kind = |m: &Value| {
            m.get("type")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        let normalize = modules.iter().any(|m| kind(m).ends_with(".Normalize"));
        let Some(pool) = modules.iter().find(|m| kind(m).ends_with(".Pooling")) else {
            return Ok(None);
        };
        let sub = pool.get("path").and_then(Value::as_str).unwrap_or("");
        let cfg_path = dir.join(sub).join("config.json");
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?,
        )
        .with_context(|| format!("{}: not JSON", cfg_path.display()))?;
        let on = |k: &str| cfg.get(k).and_then(Value::as_bool).unwrap_or(false);
        let mut modes = Vec::new();
        if on("pooling_mode_cls_token") {
            modes.push(PoolingType::Cls);
        }
        if on("pooling_mode_mean_tokens") {
            modes.push(PoolingType::Mean);
        }
        if on("pooling_mode_lasttoken") {
            modes.push(PoolingType::Last);
        }
        for unsupported in [
            "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens",
        ] {
            if on(unsupported) {
                bail!(
                    "{}: {unsupported} is not implemented; only CLS, mean and last-token pooling are (override with --pooler-config '{{\"pooling_type\": \"MEAN\"}}' if that is what you want)",
                    cfg_path.display()
                );
            }
        }
        if cfg.get("include_prompt").and_then(Value::as_bool) == Some(false) {
            bail!(
                "{}: include_prompt false (pooling that skips the instruction) is not implemented",
                cfg_path.display()
            );
        }
        match modes.as_slice() {
            [one] => Ok(Some(PoolerConfig {
                pooling_type: *one,
                normalize,
                task: PoolingTask::Embed,
                labels: Vec::new(),
                token_head: None,
                pair_types: true,
            })),
            [] => bail!("{}: sets no pooling_mode_*", cfg_path.display()),
            _ => bail!(
                "{}: sets several pooling modes at once (their concatenation is not implemented)",
                cfg_path.display()
            ),
        }
    }

    /// Applies `--pooler-config` (vLLM's JSON: `pooling_type`, `normalize`)
    /// over `base`. Keys that would change the vectors and are not
    /// implemented are refused by name.
    pub fn with_overrides(mut self, json: &str) -> Result<PoolerConfig> {
        let v: Value = serde_json::from_str(json)
            .with_context(|| format!("--pooler-config {json}: not JSON"))?;
        let Some(obj) = v.as_object() else {
            bail!("--pooler-config {json}: expected a JSON object such as {{\"pooling_type\": \"MEAN\", \"normalize\": true}}");
        };
        for (k, val) in obj {
            match k.as_str() {
                "pooling_type" => {
                    let s = val
                        .as_str()
                        .context("--pooler-config: pooling_type must be a string")?;
                    self.pooling_type = PoolingType::parse(s).context("--pooler-config")?;
                }
                "normalize" => {
                    self.normalize = val
                        .as_bool()
                        .context("--pooler-config: normalize must be true or false")?;
                }
                other => bail!(
                    "--pooler-config: key {other:?} is not implemented (supported: pooling_type, normalize)"
                ),
            }
        }
        Ok(self)
    }

    /// A scoring or classifying model's logits from its raw pooled output:
    /// the classifier's own, or a token head's one logit.
    pub fn head_logits(&self, raw: Vec<f32>) -> Result<Vec<f32>> {
        let Some(head) = &self.token_head else {
            return Ok(raw);
        };
        if raw.len() != head.weight.len() {
            bail!(
                "the reranker's hidden state has {} values, its head {}",
                raw.len(),
                head.weight.len()
            );
        }
        let dot: f64 = raw
            .iter()
            .zip(&head.weight)
            .map(|(x, w)| f64::from(*x) * f64::from(*w))
            .sum();
        Ok(vec![dot as f32])
    }

    /// Turns a raw pooled hidden state into the vector a client gets: the
    /// first `dimensions` components if asked (Matryoshka truncation, as
    /// vLLM does before normalizing), then L2-normalized if the model
    /// normalizes.
    pub fn finish(&self, mut v: Vec<f32>, dimensions: Option<usize>) -> Vec<f32> {
        if let Some(d) = dimensions {
            v.truncate(d);
        }
        if self.normalize {
            // As torch's F.normalize: divide by max(‖v‖, 1e-12).
            let norm = v
                .iter()
                .map(|x| f64::from(*x) * f64::from(*x))
                .sum::<f64>()
                .sqrt();
            let scale = 1.0 / norm.max(1e-12);
            for x in &mut v {
                *x = (f64::from(*x) * scale) as f32;
            }
        }
        v
    }
}

/// A cross-encoder's score from its raw pooled output (one logit): the
/// sigmoid, vLLM's default activation for a one-label classifier and what
/// sentence-transformers' `CrossEncoder.predict` returns.
pub fn score_of(raw: &[f32]) -> Result<f32> {
    match raw {
        [logit] => Ok((1.0 / (1.0 + (-f64::from(*logit)).exp())) as f32),
        other => bail!(
            "a cross-encoder gives one logit per pair; this model gave {}",
            other.len()
        ),
    }
}

/// A classifier's label names by index: `num_labels` of them (else as
/// many as `id2label` has, else transformers' default of 2), each its
/// `id2label` entry or transformers' `LABEL_<i>`.
pub fn classifier_labels(config_json: &Value) -> Result<Vec<String>> {
    let id2label = config_json.get("id2label").and_then(Value::as_object);
    let n = match config_json.get("num_labels") {
        Some(x) => usize::try_from(
            x.as_u64()
                .context("'num_labels' must be a positive integer")?,
        )
        .context("'num_labels' is too large")?,
        None => id2label.map_or(2, |m| m.len()),
    };
    if n == 0 {
        bail!("'num_labels' is 0: a classifier needs at least one label");
    }
    Ok((0..n)
        .map(|i| {
            id2label
                .and_then(|m| m.get(&i.to_string()))
                .and_then(Value::as_str)
                .map_or_else(|| format!("LABEL_{i}"), str::to_owned)
        })
        .collect())
}

/// A classifier's probabilities from its raw logits, as vLLM's
/// `/classify` gives them: the sigmoid of a lone logit, else the softmax
/// over the labels (computed in f64).
pub fn class_probs(logits: &[f32]) -> Vec<f32> {
    if let [one] = logits {
        return vec![(1.0 / (1.0 + (-f64::from(*one)).exp())) as f32];
    }
    let max = logits
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = logits.iter().map(|&x| (f64::from(x) - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

/// Whether `config.json`'s first architecture names a model without a
/// generation head (`Qwen3Model`, `BertModel`) or with a scoring head
/// (`...ForSequenceClassification`): such checkpoints are served for
/// pooling when `--runner auto`.
pub fn architecture_is_pooling(config_json: &Value) -> bool {
    let arch = config_json
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or("");
    arch.ends_with("Model") || arch.ends_with("ForSequenceClassification")
}

/// Whether `config.json`'s first architecture is a classifier
/// (`...ForSequenceClassification`): a cross-encoder, served for scoring.
pub fn architecture_is_classifier(config_json: &Value) -> bool {
    config_json
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .is_some_and(|a| a.ends_with("ForSequenceClassification"))
}

/// Whether `config.json` describes an encoder (BERT), whose rows attend
/// both ways and which is served for pooling only.
pub fn architecture_is_encoder(config_json: &Value) -> bool {
    let arch = config_json
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str);
    let model_type = config_json.get("model_type").and_then(Value::as_str);
    matches!(
        arch,
        Some(
            "BertModel"
                | "BertForSequenceClassification"
                | "XLMRobertaModel"
                | "XLMRobertaForSequenceClassification"
                | "ModernBertModel"
                | "ModernBertForSequenceClassification"
        )
    ) || (arch.is_none() && matches!(model_type, Some("bert" | "xlm-roberta" | "modernbert")))
}

/// Whether the encoder `config.json` describes reads a pair's token types
/// (BERT's and XLM-R's token type table). ModernBERT has none: transformers
/// never gives it `token_type_ids`, so its pairs are sent untyped whatever
/// types the tokenizer's template assigns.
pub fn architecture_reads_token_types(config_json: &Value) -> bool {
    architecture_is_encoder(config_json)
        && config_json.get("model_type").and_then(Value::as_str) != Some("modernbert")
        && !config_json
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .is_some_and(|a| a.starts_with("ModernBert"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_truncates_before_normalizing() {
        let c = PoolerConfig::DECODER_DEFAULT;
        let v = c.finish(vec![3.0, 4.0, 12.0], Some(2));
        assert_eq!(v.len(), 2);
        assert!(
            (v[0] - 0.6).abs() < 1e-7 && (v[1] - 0.8).abs() < 1e-7,
            "{v:?}"
        );
        let raw = PoolerConfig {
            normalize: false,
            ..c
        };
        assert_eq!(raw.finish(vec![3.0, 4.0], None), vec![3.0, 4.0]);
    }

    #[test]
    fn overrides_refuse_unknown_keys() {
        let c = PoolerConfig::DECODER_DEFAULT;
        let m = c
            .clone()
            .with_overrides(r#"{"pooling_type": "mean", "normalize": false}"#)
            .unwrap();
        assert_eq!(m.pooling_type, PoolingType::Mean);
        assert!(!m.normalize);
        let e = c.with_overrides(r#"{"softmax": true}"#).unwrap_err();
        assert!(format!("{e:#}").contains("softmax"), "{e:#}");
    }
}
