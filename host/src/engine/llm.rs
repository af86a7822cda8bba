//! The offline API, shaped like vLLM's `LLM`: build once, then
//! `generate(prompts, params)` runs every prompt through the batched engine
//! together and returns when all are done.

use crate::engine::args::{build_engine, EngineArgs};
use crate::engine::core::{EngineCore, RequestOptions, StopReason};
use crate::engine::output_processor::{OutputProcessor, StopStrings};
use crate::engine::request::{FinishReason, SamplingDefaults, SamplingParams, TokenLogprob};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// A prompt: text (tokenized with special tokens parsed) or token ids.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

/// One completion of a prompt.
#[derive(Clone, Debug, Default)]
pub struct CompletionOutput {
    /// Which of the `n` samples this is.
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Per generated token, when `logprobs` was asked for.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
}

/// The result for one prompt.
#[derive(Clone, Debug)]
pub struct RequestOutput {
    pub request_id: String,
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<u32>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: usize,
    /// With `prompt_logprobs`: the score of every prompt token after the
    /// first, given those before it (entry `i` scores token `i + 1`).
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub outputs: Vec<CompletionOutput>,
    pub finished: bool,
}

/// An engine for offline batched generation.
pub struct LLM {
    core: EngineCore,
    /// Detokenizes the core's outputs and applies stop strings.
    outputs: OutputProcessor,
    next_request: u64,
}

impl LLM {
    /// Loads the model and builds the engine.
    pub fn new(args: EngineArgs) -> Result<LLM> {
        Ok(LLM {
            core: build_engine(&args)?,
            outputs: OutputProcessor::default(),
            next_request: 0,
        })
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        self.core.tokenizer()
    }

    /// The model's defaults for sampling fields a request leaves unset
    /// (from its `generation_config.json`, per `--generation-config`);
    /// `generate` applies them.
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        self.core.sampling_defaults()
    }

    /// The engine core, for statistics and tests.
    pub fn engine(&self) -> &EngineCore {
        &self.core
    }

    /// The engine core, mutably: lets callers drive steps themselves.
    pub fn engine_mut(&mut self) -> &mut EngineCore {
        &mut self.core
    }

    /// Tokenizes a prompt as the completions API does: special-token text is
    /// parsed, and BOS is added only if the tokenizer config asks for it.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(t) => self.core.tokenizer().encode(t, true),
            Prompt::Tokens(t) => Ok(t.clone()),
        }
    }

    /// Embeds every prompt with a model served for pooling (`--runner
    /// pooling`), all in the same batches, and returns their vectors in
    /// prompt order, as vLLM's `LLM.embed`: pooled, truncated to
    /// `dimensions` if given, and normalized as the model's pooler says.
    pub fn embed(
        &mut self,
        prompts: &[Prompt],
        dimensions: Option<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        let pooler = self.core.pooler().cloned().context(
            "the model is served for generation; build the engine with --runner pooling to embed",
        )?;
        let ids = prompts
            .iter()
            .map(|prompt| match prompt {
                Prompt::Text(t) => self.core.tokenizer().encode_for_pooling(t),
                Prompt::Tokens(t) => Ok(t.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self
            .pool(ids)?
            .into_iter()
            .map(|v| pooler.finish(v, dimensions))
            .collect())
    }

    /// Scores each `(query, document)` pair with a cross-encoder
    /// (`*ForSequenceClassification`, one label), all in the same batches,
    /// as vLLM's `LLM.score`: the pair encoded as `[CLS] q [SEP] d [SEP]`
    /// with token types 0 then 1, its logit through a sigmoid.
    pub fn score(&mut self, pairs: &[(&str, &str)]) -> Result<Vec<f32>> {
        let pooler = self
            .core
            .pooler()
            .cloned()
            .context("the model is served for generation; serve a cross-encoder to score")?;
        match pooler.task {
            crate::engine::pooling::PoolingTask::Score => {}
            crate::engine::pooling::PoolingTask::Classify => anyhow::bail!(
                "the model is a classifier with {} labels, not a cross-encoder: use classify",
                pooler.labels.len()
            ),
            crate::engine::pooling::PoolingTask::Embed => anyhow::bail!(
                "the model is an embedding model, not a cross-encoder: it does not score pairs"
            ),
        }
        let untyped = !pooler.pair_types;
        let ids = pairs
            .iter()
            .map(|(q, d)| {
                let ids = self.core.tokenizer().encode_pair_for_scoring(q, d)?;
                // A decoder reranker, or an encoder without a token type
                // table (ModernBERT), reads the pair as one text, untyped.
                Ok(if untyped {
                    ids.into_iter()
                        .map(|t| pagoda_accel::ops::encoder::unpack_token(t).0)
                        .collect()
                } else {
                    ids
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.pool(ids)?
            .into_iter()
            .map(|v| crate::engine::pooling::score_of(&pooler.head_logits(v)?))
            .collect()
    }

    /// Classifies each text with a sequence classifier
    /// (`*ForSequenceClassification`), all in the same batches, as vLLM's
    /// `LLM.classify`: each text's probabilities over the labels (softmax;
    /// a lone label's sigmoid).
    pub fn classify(&mut self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let pooler = self
            .core
            .pooler()
            .cloned()
            .context("the model is served for generation; serve a classifier to classify")?;
        if pooler.labels.is_empty() {
            anyhow::bail!("the model is an embedding model, not a classifier: use embed");
        }
        let ids = texts
            .iter()
            .map(|t| self.core.tokenizer().encode_for_pooling(t))
            .collect::<Result<Vec<_>>>()?;
        self.pool(ids)?
            .into_iter()
            .map(|v| Ok(crate::engine::pooling::class_probs(&pooler.head_logits(v)?)))
            .collect()
    }

    /// Runs every prompt as a pooling row and returns the raw pooled
    /// vectors in prompt order.
    fn pool(&mut self, prompts: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>> {
        let mut owner: HashMap<u64, usize> = HashMap::new();
        let n = prompts.len();
        for (pi, ids) in prompts.into_iter().enumerate() {
            let request_id = format!("{}", self.next_request);
            self.next_request += 1;
            let id = self
                .core
                .add_request(
                    request_id,
                    ids,
                    SamplingParams::default(),
                    RequestOptions {
                        pooling: true,
                        ..Default::default()
                    },
                )
                .with_context(|| format!("prompt {pi}"))?;
            owner.insert(id, pi);
        }
        let mut results: Vec<Option<Vec<f32>>> = vec![None; n];
        let mut remaining = owner.len();
        while remaining > 0 {
            for o in self.core.step()? {
                let Some(&pi) = owner.get(&o.id) else {
                    continue;
                };
                if o.finish_reason.is_some() {
                    let v = o.pooled.with_context(|| {
                        format!("prompt {pi}: the engine returned no pooled vector")
                    })?;
                    results[pi] = Some(v);
                    remaining -= 1;
                }
            }
            if remaining > 0 && !self.core.has_unfinished() {
                anyhow::bail!("the engine stopped with {remaining} pooling requests unfinished");
            }
        }
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.with_context(|| format!("prompt {i}: no output")))
            .collect()
    }

    /// Generates completions for every prompt, batched, and returns them in
    /// prompt order. Fields of `params` left unset take the model's
    /// defaults ([`LLM::sampling_defaults`]).
    pub fn generate(
        &mut self,
        prompts: &[Prompt],
        params: &SamplingParams,
    ) -> Result<Vec<RequestOutput>> {
        self.generate_with_lora(prompts, params, None)
    }

    /// [`LLM::generate`] with the LoRA adapter named `lora` (loaded with
    /// the engine's `lora` arguments, or [`EngineCore::load_lora`]), as
    /// vLLM's `generate(..., lora_request=...)`.
    pub fn generate_with_lora(
        &mut self,
        prompts: &[Prompt],
        params: &SamplingParams,
        lora: Option<&str>,
    ) -> Result<Vec<RequestOutput>> {
        let lora = match lora {
            None => None,
            Some(name) => Some(
                self.core
                    .lora(name)
                    .with_context(|| format!("no LoRA adapter named {name:?} is loaded"))?,
            ),
        };
        let mut results = Vec::with_capacity(prompts.len());
        // engine id → (prompt index, sample index)
        let mut owner: HashMap<u64, (usize, usize)> = HashMap::new();
        for (pi, prompt) in prompts.iter().enumerate() {
            let ids = self.encode(prompt)?;
            let request_id = format!("{}", self.next_request);
            self.next_request += 1;
            for si in 0..params.n {
                let mut p = params.clone();
                p.n = 1;
                p.seed = params.seed.map(|s| s.wrapping_add(si as u64));
                if si > 0 {
                    // The samples share one prompt: the first scores it.
                    p.prompt_logprobs = None;
                }
                let detok = OutputProcessor::detokenizer(self.core.tokenizer().clone(), &ids, &p);
                let stop = StopStrings::of(&p);
                let id = self
                    .core
                    .add_request(
                        format!("{request_id}-{si}"),
                        ids.clone(),
                        p,
                        RequestOptions {
                            sample_index: si,
                            lora: lora.clone(),
                            ..Default::default()
                        },
                    )
                    .with_context(|| format!("prompt {pi}"))?;
                self.outputs.add(id, detok, stop);
                owner.insert(id, (pi, si));
            }
            results.push(RequestOutput {
                request_id,
                prompt: match prompt {
                    Prompt::Text(t) => Some(t.clone()),
                    Prompt::Tokens(_) => None,
                },
                prompt_token_ids: ids,
                num_cached_tokens: 0,
                prompt_logprobs: None,
                outputs: (0..params.n)
                    .map(|index| CompletionOutput {
                        index,
                        ..Default::default()
                    })
                    .collect(),
                finished: false,
            });
        }
        let mut remaining = owner.len();
        while remaining > 0 {
            for o in self.core.step()? {
                let Some(&(pi, si)) = owner.get(&o.id) else {
                    continue;
                };
                let Some(processed) = self.outputs.process(o) else {
                    continue;
                };
                if processed.abort_in_core {
                    // A stop string ended it; the output says so already.
                    self.core.abort(processed.output.id);
                }
                let o = processed.output;
                let r = &mut results[pi];
                r.num_cached_tokens = r.num_cached_tokens.max(o.num_cached_tokens);
                if o.prompt_logprobs.is_some() {
                    r.prompt_logprobs = o.prompt_logprobs;
                }
                let c = &mut r.outputs[si];
                c.text.push_str(&o.new_text);
                c.token_ids.extend_from_slice(&o.new_token_ids);
                if params.logprobs.is_some() {
                    c.logprobs.get_or_insert_with(Vec::new).extend(o.logprobs);
                }
                if o.finish_reason.is_some() {
                    c.finish_reason = o.finish_reason;
                    c.stop_reason = o.stop_reason;
                    remaining -= 1;
                }
            }
            if remaining > 0 && !self.core.has_unfinished() {
                anyhow::bail!("the engine stopped with {remaining} sequences unfinished");
            }
        }
        for r in &mut results {
            r.finished = true;
        }
        Ok(results)
    }
}
