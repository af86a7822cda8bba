//! The engine core: one step is schedule (the scheduler's plan, a
//! [`SchedulerOutput`]) → execute (the model runner runs the model, samples
//! and drafts, returning a [`ModelRunnerOutput`](crate::engine::runner_output::ModelRunnerOutput))
//! → update (the scheduler takes the sampled ids, applies the token-level
//! stops and frees what finished). Plain data passes between the stages,
//! and each is visited once a step. The core returns token ids
//! ([`EngineCoreOutput`]); text and stop strings are the front end's
//! ([`crate::engine::output_processor`]). It is synchronous and owned by
//! one thread; the async front end talks to it through channels.

pub use crate::engine::core_output::{EngineCoreOutput, StopReason};
use crate::engine::fair_share::{TenantLoad, TenantShare};
use crate::engine::kv_cache::{KvCacheManager, PrefixStats};
use crate::engine::kv_events::KvEventPublisher;
use crate::engine::request::{
    FinishReason, ParamError, Request, RequestStatus, SamplingDefaults, SamplingParams,
};
use crate::engine::runner::ModelExecutor;
use crate::engine::scheduler::Scheduler;
use crate::engine::scheduler_output::SchedulerOutput;
use crate::engine::spec_decode::{Proposer, SpecStats, Speculator};
use crate::engine::structured_output::{GrammarMatcher, GuidedRow};
use crate::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Instant;

/// Per-request options beyond sampling.
#[derive(Clone, Debug, Default)]
pub struct RequestOptions {
    /// Separates prefix-cache entries: blocks are shared only between
    /// requests with the same salt (the tenant plus any `cache_salt`).
    pub cache_salt: u64,
    /// Lower runs first under `--scheduling-policy priority`.
    pub priority: i64,
    /// The tenant, its weight and priority class: the unit of fair share
    /// under `--scheduling-policy fair`, and the `tenant` label of the
    /// per-tenant metrics.
    pub tenant: TenantShare,
    /// The grammar the output must follow (structured output), compiled
    /// by the model's [`GrammarCompiler`](crate::engine::structured_output::GrammarCompiler).
    pub grammar: Option<GrammarMatcher>,
    /// Which of a request's `n` samples this is. Only sample 0 counts its
    /// prompt in the prompt-token metrics, as the API's usage counts it.
    pub sample_index: usize,
    /// For a reasoning model: the tokens that end its reasoning
    /// (`</think>`). The `grammar` then applies only after the output has
    /// produced them, as in vLLM: the reasoning itself is free text.
    pub reasoning_end: Option<Vec<u32>>,
    /// The LoRA adapter to run with ([`EngineCore::lora`]), if any.
    pub lora: Option<std::sync::Arc<crate::engine::lora::LoadedLora>>,
    /// A pooling request (embeddings): the prompt runs, its pooled hidden
    /// state comes back in the final output, nothing is generated. Only an
    /// engine with a pooler ([`EngineCore::pooler`]) takes one; it may share
    /// a batch with generation rows when the engine also generates
    /// ([`EngineCore::generates`]).
    pub pooling: bool,
}

/// Counters the engine keeps for metrics and logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_usage: f64,
    pub num_preemptions: u64,
    pub prefix: PrefixStats,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    /// Tokens the last step ran (prefill chunks, decodes and drafts).
    pub last_step_tokens: usize,
    /// Speculative decoding's counters.
    pub spec: SpecStats,
    /// KV-event batches dropped because their publisher fell behind.
    pub kv_events_dropped: u64,
}

/// The engine core.
pub struct EngineCore {
    scheduler: Scheduler,
    kv: KvCacheManager,
    runner: Box<dyn ModelExecutor>,
    tokenizer: Arc<Tokenizer>,
    max_model_len: usize,
    next_id: u64,
    stats: EngineStats,
    default_seed: Option<u64>,
    /// The model's defaults for what requests leave unset.
    sampling_defaults: SamplingDefaults,
    /// The ids that end a sequence unless `ignore_eos`: the tokenizer's
    /// EOS ids and the generation config's `eos_token_id`.
    eos_ids: Vec<u32>,
    /// The step's plan and constrained rows, kept to reuse their
    /// allocations.
    plan: SchedulerOutput,
    guided: Vec<GuidedRow>,
    /// Where the prefix cache's events go, when they are published.
    kv_events: Option<KvEventPublisher>,
    /// The LoRA adapters requests may name (`--enable-lora`).
    /// Shared with the front end, which loads and unloads adapters off
    /// the engine thread ([`EngineCore::lora_registry`]).
    loras: Option<crate::engine::lora::SharedLoras>,
    /// How the model pools, when it takes pooling requests (`--runner
    /// pooling`, or `--runner generate` with `--pooler-config`); `None`
    /// for a generation-only engine.
    pooler: Option<crate::engine::pooling::PoolerConfig>,
    /// Whether the engine takes generation requests: false for a model
    /// served for pooling only.
    generates: bool,
}

impl EngineCore {
    /// Assembles a core from its parts.
    pub fn new(
        scheduler: Scheduler,
        kv: KvCacheManager,
        runner: Box<dyn ModelExecutor>,
        tokenizer: Arc<Tokenizer>,
        max_model_len: usize,
    ) -> EngineCore {
        let eos_ids = tokenizer.eos_ids().to_vec();
        EngineCore {
            scheduler,
            kv,
            runner,
            tokenizer,
            max_model_len,
            next_id: 0,
            stats: EngineStats::default(),
            default_seed: None,
            sampling_defaults: SamplingDefaults::default(),
            eos_ids,
            plan: SchedulerOutput::default(),
            guided: Vec::new(),
            kv_events: None,
            loras: None,
            pooler: None,
            generates: true,
        }
    }

    /// Serves the model for pooling (embeddings) with `pooler`: requests
    /// must then be pooling requests, and generation ones are refused.
    /// `None` serves it for generation only.
    pub fn set_pooler(&mut self, pooler: Option<crate::engine::pooling::PoolerConfig>) {
        self.generates = pooler.is_none();
        self.pooler = pooler;
    }

    /// Serves the model for generation and, with `pooler`, for pooling
    /// too: both kinds of request then share the engine's batches, each a
    /// row of its own (a pooling row runs its prompt, gives its vector and
    /// leaves, keeping no KV).
    pub fn set_generation_and_pooler(
        &mut self,
        pooler: Option<crate::engine::pooling::PoolerConfig>,
    ) {
        self.generates = true;
        self.pooler = pooler;
    }

    /// Whether the engine takes generation requests (false for a model
    /// served for pooling only).
    pub fn generates(&self) -> bool {
        self.generates
    }

    /// How the model pools, if it is served for pooling.
    pub fn pooler(&self) -> Option<&crate::engine::pooling::PoolerConfig> {
        self.pooler.as_ref()
    }

    /// Serves LoRA adapters from `registry` (`--enable-lora`): the model
    /// runner makes room for the registry's `max_loras` at once, their
    /// factors stored as `dtype` says.
    pub fn enable_lora(
        &mut self,
        registry: crate::engine::lora::LoraRegistry,
        dtype: crate::engine::lora::LoraDtype,
    ) -> anyhow::Result<()> {
        let max = registry.limits().max_loras;
        self.runner.enable_lora(max, dtype)?;
        self.scheduler.set_max_loras(max);
        self.loras = Some(std::sync::Arc::new(std::sync::Mutex::new(registry)));
        Ok(())
    }

    /// Loads the PEFT adapter in folder `path` under `name`.
    ///
    /// # Errors
    /// Without `--enable-lora`, for a name already taken, or an adapter
    /// that does not fit the base model (nothing then changes).
    pub fn load_lora(
        &mut self,
        name: &str,
        path: &std::path::Path,
    ) -> anyhow::Result<std::sync::Arc<crate::engine::lora::LoadedLora>> {
        match &self.loras {
            Some(r) => crate::engine::lora::lock(r).load(name, path),
            None => {
                anyhow::bail!("LoRA adapters are not enabled; start the server with --enable-lora")
            }
        }
    }

    /// Forgets adapter `name`: requests running with it finish.
    pub fn unload_lora(&mut self, name: &str) -> bool {
        self.loras
            .as_ref()
            .is_some_and(|r| crate::engine::lora::lock(r).unload(name))
    }

    /// The adapter named `name`, if loaded (its factors read again if
    /// `--max-cpu-loras` dropped them; a folder that no longer loads is
    /// logged and answers `None`).
    pub fn lora(&self, name: &str) -> Option<std::sync::Arc<crate::engine::lora::LoadedLora>> {
        crate::engine::lora::lock(self.loras.as_ref()?)
            .get(name)
            .unwrap_or_else(|e| {
                tracing::error!("{e:#}");
                None
            })
    }

    /// The LoRA adapters requests may name, if enabled.
    pub fn lora_registry(&self) -> Option<&crate::engine::lora::SharedLoras> {
        self.loras.as_ref()
    }

    /// The adapters of the running and the waiting requests (by name,
    /// each once), for vLLM's `vllm:lora_requests_info`.
    pub fn lora_load(&self) -> (Vec<String>, Vec<String>) {
        self.scheduler.lora_load()
    }

    /// Publishes the prefix cache's events after every step (the KV-cache
    /// manager must record them: [`KvCacheManager::with_events`]).
    pub fn set_kv_events(&mut self, publisher: Option<KvEventPublisher>) {
        self.kv_events = publisher;
    }

    /// Empties the prefix cache, and tells KV-event subscribers at once.
    /// Refused, with how many blocks are held, while requests run.
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        self.kv.reset_prefix_cache()?;
        self.publish_kv_events();
        Ok(())
    }

    /// Hands the events since the last call to the publisher, if any.
    fn publish_kv_events(&mut self) {
        if let Some(publisher) = &self.kv_events {
            let mut events = Vec::new();
            self.kv.take_events(&mut events);
            if !events.is_empty() {
                publisher.publish(events);
            }
        }
    }

    /// Whether the prefix cache's events are published.
    pub fn publishes_kv_events(&self) -> bool {
        self.kv_events.is_some()
    }

    /// Batches of KV-cache events dropped because their publisher fell
    /// behind.
    pub fn kv_events_dropped(&self) -> u64 {
        self.kv_events.as_ref().map_or(0, KvEventPublisher::dropped)
    }

    /// Turns speculative decoding on: after each step, `speculator` drafts
    /// the next tokens of every sequence it can (in the model runner), and
    /// the next step verifies them. A draft model's drafts have their K/V
    /// slots reserved by the scheduler.
    pub fn set_speculator(&mut self, speculator: Option<Speculator>) {
        let lookahead = match speculator.as_ref().map(|s| (s.proposer(), s)) {
            Some((Proposer::DraftModel, s)) => Some(s),
            _ => None,
        };
        self.scheduler.set_draft_lookahead(lookahead);
        self.runner.set_speculator(speculator);
    }

    /// Seeds requests that give no seed of their own (`--seed`).
    pub fn set_default_seed(&mut self, seed: Option<u64>) {
        self.default_seed = seed;
    }

    /// Sets the model's sampling defaults (its `generation_config.json`):
    /// every request that leaves a field unset takes the default, and the
    /// `eos_token_ids` end sequences as EOS does.
    pub fn set_sampling_defaults(&mut self, mut defaults: SamplingDefaults) {
        let tokenizer_eos = self.tokenizer.eos_ids();
        defaults
            .eos_token_ids
            .retain(|t| !tokenizer_eos.contains(t));
        self.eos_ids = tokenizer_eos.to_vec();
        self.eos_ids.extend_from_slice(&defaults.eos_token_ids);
        self.sampling_defaults = defaults;
    }

    /// The model's sampling defaults in effect (`eos_token_ids` lists only
    /// the ids beyond the tokenizer's own EOS ids).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }

    /// Every id that ends a sequence unless the request ignores EOS.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The tokenizer requests are decoded with.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The model runner.
    pub fn runner(&self) -> &dyn ModelExecutor {
        &*self.runner
    }

    /// The KV-cache manager, for usage figures and invariant checks.
    pub fn kv_cache(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The most tokens request `id` may generate, as admission settled it
    /// (its `max_tokens`, else the model's default, capped to the context).
    pub fn max_output_tokens(&self, id: u64) -> Option<usize> {
        let req = self.scheduler.get(id)?;
        Some(req.max_len - req.prompt_len)
    }

    /// The longest sequence (prompt + output) the engine accepts.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Validates and queues one sequence. Returns its engine id.
    ///
    /// Sampling fields the request leaves unset take the model's defaults
    /// here, whichever front end submitted it. A `max_tokens` the request
    /// set must fit in the context; one that came from the defaults (or
    /// none at all) is capped to the room the prompt leaves.
    pub fn add_request(
        &mut self,
        external_id: String,
        prompt_ids: Vec<u32>,
        mut params: SamplingParams,
        opts: RequestOptions,
    ) -> Result<u64, ParamError> {
        if opts.lora.is_some() && self.loras.is_none() {
            return Err(ParamError {
                param: "model",
                message: "LoRA adapters are not enabled; start the server with --enable-lora"
                    .into(),
            });
        }
        match (opts.pooling, self.pooler.is_some(), self.generates) {
            (true, false, _) => {
                return Err(ParamError {
                    param: "model",
                    message: "The model does not support the Embeddings API; it is served for generation: use /v1/completions or /v1/chat/completions, or restart with --runner pooling (or with --runner generate and a --pooler-config to serve both)".into(),
                })
            }
            (false, _, false) => {
                let task = self.pooler.as_ref().map(|p| p.task);
                let score = task == Some(crate::engine::pooling::PoolingTask::Score);
                return Err(ParamError {
                    param: "model",
                    message: if score {
                        "The model does not support generation; it is a cross-encoder served for scoring: use /score, /v1/score, /rerank, /v1/rerank or /v2/rerank".into()
                    } else if task == Some(crate::engine::pooling::PoolingTask::Classify) {
                        "The model does not support generation; it is a classifier served for pooling: use /classify".into()
                    } else {
                        "The model does not support generation; it is served for pooling (--runner pooling): use /v1/embeddings".into()
                    },
                });
            }
            _ => {}
        }
        if opts.pooling {
            // A pooling row runs its prompt and generates nothing: the
            // runner reads the pooled hidden state where it would sample.
            params.max_tokens = Some(0);
            params.prompt_logprobs = None;
            params.logprobs = None;
            params.n = 1;
        }
        let max_tokens_set = params.max_tokens.is_some();
        params.apply_defaults(&self.sampling_defaults);
        let vocab = self.runner.config().vocab_size;
        params.validate(vocab)?;
        if prompt_ids.is_empty() {
            return Err(ParamError {
                param: "prompt",
                message: "the prompt must contain at least one token".into(),
            });
        }
        // An encoder's tokens may carry their token type in their high
        // bits (see `pagoda_accel::ops::TOKEN_TYPE_SHIFT`).
        let types = self
            .runner
            .config()
            .encoder
            .as_ref()
            .map_or(1, |e| e.type_vocab_size.max(1));
        for &t in &prompt_ids {
            let (id, ty) = if types > 1 {
                pagoda_accel::ops::encoder::unpack_token(t)
            } else {
                (t, 0)
            };
            if id as usize >= vocab {
                return Err(ParamError {
                    param: "prompt",
                    message: format!("token id {t} is beyond the vocabulary of {vocab}"),
                });
            }
            if ty as usize >= types {
                return Err(ParamError {
                    param: "prompt",
                    message: format!("token type {ty} is beyond the model's {types} token types"),
                });
            }
        }
        let prompt_len = prompt_ids.len();
        if opts.pooling && prompt_len > self.max_model_len {
            // vLLM's message for an embedding input over the context.
            return Err(ParamError {
                param: "input",
                message: format!(
                    "This model's maximum context length is {} tokens. However, you requested {prompt_len} tokens in the input for embedding generation. Please reduce the length of the input.",
                    self.max_model_len
                ),
            });
        }
        if prompt_len >= self.max_model_len && !opts.pooling {
            return Err(ParamError {
                param: "prompt",
                message: format!(
                    "This model's maximum context length is {} tokens. However, your prompt has {prompt_len} tokens, leaving no room for output.",
                    self.max_model_len
                ),
            });
        }
        let max_len = match params.max_tokens {
            Some(m) if prompt_len + m > self.max_model_len && max_tokens_set => {
                return Err(ParamError {
                    param: "max_tokens",
                    message: format!(
                        "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt_len} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                        self.max_model_len,
                        prompt_len + m
                    ),
                });
            }
            Some(m) => (prompt_len + m).min(self.max_model_len),
            None => self.max_model_len,
        };
        let id = self.next_id;
        self.next_id += 1;
        let eos_ids = if params.ignore_eos {
            Vec::new()
        } else {
            self.eos_ids.clone()
        };
        let req = Request {
            id,
            external_id,
            prompt_len,
            num_computed: 0,
            num_cached_prompt: 0,
            num_spec_accepted: 0,
            max_len,
            salt: opts.cache_salt,
            // Prompt logprobs come from the exact kernels, so a prompt
            // scores as generation would compute it.
            // Pooled vectors too: they are the exact model's.
            prompt_kernel: prompt_len >= crate::engine::request::PROMPT_KERNEL_MIN_LEN
                && self.runner.has_prompt_kernel()
                && params.prompt_logprobs.is_none()
                && !opts.pooling,
            priority: opts.priority,
            tenant: opts.tenant,
            arrival: id,
            arrived_at: Instant::now(),
            first_scheduled_at: None,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            eos_ids,
            seed: params.seed.or(self
                .default_seed
                .map(|s| s ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15))),
            token_ids: prompt_ids,
            prompt_logprobs: params.prompt_logprobs.map(|_| Vec::new()),
            prompt_logprobs_done: prompt_len <= 1,
            params,
            grammar: opts.grammar,
            reasoning_end: opts.reasoning_end.filter(|e| !e.is_empty()),
            num_drafts: 0,
            announced: false,
            blocks_sent: 0,
            blocks_shrunk: false,
            lora: opts.lora,
            pooling: opts.pooling,
        };
        self.stats.prompt_tokens += prompt_len as u64;
        self.scheduler.add(req);
        Ok(id)
    }

    /// Aborts a request and frees its blocks at once. Returns its final
    /// output, or `None` if it had already finished.
    pub fn abort(&mut self, id: u64) -> Option<EngineCoreOutput> {
        let req = self
            .scheduler
            .remove(id, FinishReason::Abort, &mut self.kv)?;
        Some(EngineCoreOutput::aborted(req))
    }

    /// Checks the KV accounting: the pool's own invariants, and that every
    /// running sequence holds exactly the blocks its computed tokens need,
    /// so no sequence wastes more than its one partly filled block. Tests
    /// call this after every step.
    pub fn check_kv_accounting(&self) -> Result<(), String> {
        self.kv.pool().check_invariants()?;
        self.kv.check_state_slots()?;
        let bs = self.kv.block_size();
        for &id in self.scheduler.running_ids() {
            let Some(req) = self.scheduler.get(id) else {
                continue;
            };
            let held = self.kv.block_table(id).len();
            let need = req.num_computed.div_ceil(bs);
            // A draft model's drafts have their slots already.
            let reserved = (req.num_computed + req.num_drafts).div_ceil(bs);
            if held < need || held > reserved {
                return Err(format!(
                    "request {id} holds {held} blocks for {} computed tokens and {} drafts (needs {need} to {reserved})",
                    req.num_computed, req.num_drafts
                ));
            }
        }
        Ok(())
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// A snapshot of the engine's counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            num_running: self.scheduler.num_running(),
            num_waiting: self.scheduler.num_waiting(),
            kv_usage: self.kv.pool().usage(),
            num_preemptions: self.scheduler.num_preemptions(),
            prefix: self.kv.prefix_stats(),
            kv_events_dropped: self.kv_events_dropped(),
            ..self.stats
        }
    }

    /// Every tenant with requests in the engine: how many run and wait.
    pub fn tenant_loads(&self) -> Vec<TenantLoad> {
        self.scheduler.tenant_loads()
    }

    /// Runs one step. Returns an output for every request that sampled a
    /// token or finished.
    ///
    /// # Errors
    /// If the device failed. The engine's state is then unknown (the step's
    /// K/V may be half written), so the caller must stop using it.
    pub fn step(&mut self) -> anyhow::Result<Vec<EngineCoreOutput>> {
        let mut plan = std::mem::take(&mut self.plan);
        let mut guided = std::mem::take(&mut self.guided);
        self.scheduler
            .schedule(&mut self.kv, &mut plan, &mut guided);
        let mut outputs = Vec::new();
        if !plan.is_empty() {
            if !plan.seqs.is_empty() {
                self.stats.steps += 1;
                self.stats.last_step_tokens = plan.num_tokens;
            }
            let started = std::time::Instant::now();
            let sampled = self.runner.execute(&plan, &mut guided)?;
            // What each step carried and took (RUST_LOG=pagoda::engine::step=debug):
            // where a request's latency goes under load.
            tracing::debug!(
                target: "pagoda::engine::step",
                seqs = plan.seqs.len(),
                tokens = plan.num_tokens,
                ms = started.elapsed().as_secs_f64() * 1e3,
            );
            self.stats.generation_tokens += self.scheduler.update_from_output(
                &plan,
                sampled,
                &mut guided,
                &mut self.kv,
                &mut outputs,
                &mut self.stats.spec,
            );
        }
        self.plan = plan;
        self.guided = guided;
        self.publish_kv_events();
        Ok(outputs)
    }
}
