//! A generation run, shared by every generating endpoint (completions,
//! chat, Responses, Anthropic's Messages): the request validated against
//! the engine and its choices submitted ([`start_run`]), their outputs
//! collected ([`collect`]) into the completions or chat body, or streamed
//! as SSE chunks ([`stream_response`]), with usage metering and the
//! tenant's post-processing.

use crate::engine::async_engine::{AbortGuard, SubmitError};
use crate::engine::output_processor::{StepOutput, StopReason};
use crate::engine::request::{SamplingDefaults, TokenLogprob};
use crate::metering::{self, RecordStatus, UsageRecord};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::protocol::{self, CommonParams};
use crate::server::openai::tenant::TenantCtx;
use crate::server::openai::tools::{self, ToolMode};
use crate::server::openai::{fields, harmony, now_secs, reasoning, structured, tool_parsers};
use crate::server::{AppState, Body};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper::Response;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Which endpoint a generation serves; decides the response shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    Completions,
    Chat,
}

/// One prompt of a request, tokenized.
pub(crate) struct RunPrompt {
    pub ids: Vec<u32>,
    /// With `echo`: the text each of its choices starts with.
    pub echo: Option<String>,
}

/// Per choice: what has been produced so far.
#[derive(Default, Clone)]
pub(crate) struct Choice {
    pub(crate) text: String,
    pub(crate) tokens: usize,
    /// Its output's ids, with `return_token_ids`.
    pub(crate) token_ids: Vec<u32>,
    /// Of its tokens, accepted drafts (speculative decoding).
    pub(crate) spec_accepted: usize,
    pub(crate) logprobs: Vec<TokenLogprob>,
    pub(crate) finish_reason: Option<&'static str>,
    pub(crate) stop_reason: Option<Value>,
    /// Streaming with tools: bytes of `text` sent as content so far.
    pub(crate) sent: usize,
    /// The scores of its prompt's tokens 1.., when asked for.
    pub(crate) prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// Streaming with `echo`: the prompt has gone out.
    pub(crate) echoed: bool,
    /// Streaming completions with `return_token_ids`: the choice's prompt
    /// ids have gone out (with its first chunk, as vLLM sends them).
    pub(crate) prompt_ids_sent: bool,
    /// With a reasoning parser: the reasoning (`text` is then the answer),
    /// what of it the next chunk carries, and how far the split has got.
    pub(crate) reasoning: String,
    pub(crate) new_reasoning: String,
    pub(crate) reasoning_stream: reasoning::ReasoningStream,
}

pub(crate) struct Run {
    pub(crate) api: Api,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) rx: mpsc::UnboundedReceiver<StepOutput>,
    pub(crate) guard: AbortGuard,
    /// engine id → choice index
    pub(crate) choice_of: HashMap<u64, usize>,
    pub(crate) choices: Vec<Choice>,
    /// The prompts; choice `i` continues prompt `i / per_prompt`.
    pub(crate) prompts: Vec<RunPrompt>,
    pub(crate) per_prompt: usize,
    pub(crate) prompt_tokens: usize,
    /// Prompt tokens of all choices that came from the prefix cache.
    pub(crate) cached_tokens: usize,
    pub(crate) remaining: usize,
    pub(crate) want_logprobs: bool,
    /// Alternatives per token in the OpenAI logprobs (prompt rows, scored
    /// for several views, have more).
    pub(crate) logprobs_k: usize,
    /// vLLM's `prompt_logprobs`, as asked.
    pub(crate) prompt_logprobs_k: Option<usize>,
    /// Every chunk carries the usage so far (`continuous_usage_stats`).
    pub(crate) continuous_usage: bool,
    /// Choices carry their prompt's and output's ids (`return_token_ids`).
    pub(crate) return_token_ids: bool,
    /// Name tokens `token_id:{id}` in logprobs (`return_tokens_as_token_ids`).
    pub(crate) tokens_as_ids: bool,
    /// `--skip-tokenizer-init`: outputs carry ids and no text.
    pub(crate) no_text: bool,
    pub(crate) tokenizer: Arc<crate::tokenizer::Tokenizer>,
    /// How chat output becomes tool calls, when the request offers tools.
    pub(crate) tools: Option<ToolMode>,
    /// The tenant's admission and plugin session, if any.
    pub(crate) tenant: Option<TenantCtx>,
    /// The request's access-log record.
    pub(crate) log: Option<Arc<crate::server::access_log::Record>>,
    /// Splits chat output into reasoning and answer (`--reasoning-parser`).
    pub(crate) reasoning: Option<reasoning::ReasoningParser>,
    /// When it arrived, for its usage record (ms since the Unix epoch).
    pub(crate) created_ms: u64,
    /// Its usage record has been written (see [`Run::meter`]).
    pub(crate) metered: bool,
    pub(crate) _slot: InFlight,
}

impl Drop for Run {
    fn drop(&mut self) {
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        if let Some(t) = &self.tenant {
            t.admission
                .charge(self.prompt_tokens as u64, completion as u64);
        }
        if let Some(l) = &self.log {
            l.set_tokens(self.prompt_tokens, completion);
        }
        if !self.metered {
            // It ended before its response did (the client went away, or
            // it failed): its tokens were spent all the same. Nobody
            // waits on this record.
            let r = self.usage_record(RecordStatus::Aborted);
            metering::count(&r);
            if let Some(log) = self._slot.0.usage_log() {
                log.submit(&r);
            }
        }
    }
}

impl Run {
    /// The request's usage record as it stands.
    pub(crate) fn usage_record(&self, status: RecordStatus) -> UsageRecord {
        let (tenant, key_id, adapter) = self.log.as_ref().map(|l| l.who()).unwrap_or_default();
        let tenant = tenant.or_else(|| self.tenant.as_ref().map(|t| t.admission.tenant.id.clone()));
        let endpoint = self.log.as_ref().map_or_else(
            || match self.api {
                Api::Chat => "/v1/chat/completions".to_string(),
                Api::Completions => "/v1/completions".to_string(),
            },
            |l| l.path().to_string(),
        );
        UsageRecord {
            id: metering::record_id(),
            request_id: self.id.clone(),
            tenant,
            key_id,
            endpoint,
            model: self.model.clone(),
            adapter,
            prompt_tokens: self.prompt_tokens as u64,
            cached_tokens: self.cached_tokens as u64,
            completion_tokens: self.choices.iter().map(|c| c.tokens as u64).sum(),
            spec_accepted_tokens: self
                .choices
                .iter()
                .map(|c| c.spec_accepted.min(c.tokens) as u64)
                .sum(),
            finish_reasons: self
                .choices
                .iter()
                .map(|c| c.finish_reason.map(str::to_string))
                .collect(),
            status,
            created_ms: self.created_ms,
            finished_ms: metering::now_ms(),
        }
    }

    /// Records the finished request's usage: counted, and with
    /// `--usage-log` on disk before this returns. Called before the
    /// response's last bytes go out, so that no response is sent whose
    /// record could still be lost; a record that cannot be written fails
    /// the response instead (a 503).
    pub(crate) async fn meter(&mut self) -> Result<(), ApiError> {
        if self.metered {
            return Ok(());
        }
        self.metered = true;
        let r = self.usage_record(RecordStatus::Ok);
        meter(&self._slot.0, &r).await
    }
}

/// Records a finished request's usage: counted in the per-tenant metric
/// and, with `--usage-log`, on disk before this returns, so that callers
/// send the response only after. A record that cannot be written fails the
/// response instead (a 503).
pub(crate) async fn meter(state: &AppState, r: &UsageRecord) -> Result<(), ApiError> {
    metering::count(r);
    if let Some(log) = state.usage_log() {
        log.commit(r).await.map_err(|e| {
            ApiError::unavailable(format!(
                "the usage record of this request could not be written ({e}); the response is withheld"
            ))
        })?;
    }
    Ok(())
}

/// Counts a request as in flight until dropped.
pub(crate) struct InFlight(pub(crate) Arc<AppState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) async fn generate(
    state: Arc<AppState>,
    common: CommonParams,
    prompts: Vec<RunPrompt>,
    api: Api,
    id: String,
    tenant: Option<TenantCtx>,
    tools: Option<ToolMode>,
) -> Result<Response<Body>, ApiError> {
    let (stream, include_usage) = (
        common.stream,
        common.include_usage || state.config_force_include_usage(),
    );
    let run = start_run(state, common, prompts, api, id, tenant, tools).await?;
    if stream {
        Ok(stream_response(run, include_usage))
    } else {
        collect_response(run).await
    }
}

/// Validates the request against the engine, compiles its constraint,
/// submits every choice and returns the run that collects their outputs.
pub(crate) async fn start_run(
    state: Arc<AppState>,
    mut common: CommonParams,
    prompts: Vec<RunPrompt>,
    api: Api,
    id: String,
    tenant: Option<TenantCtx>,
    tools: Option<ToolMode>,
) -> Result<Run, ApiError> {
    let created_ms = metering::now_ms();
    if let Some(t) = &tenant {
        // Tenants share prefix-cache blocks only within a cache group.
        common.opts.cache_salt =
            protocol::salt_of(&format!("{}:{:x}", t.cache_scope(), common.opts.cache_salt));
        common.opts.tenant = t.share();
    }
    let engine = state.engine_as(&common.model, tenant.as_ref())?.clone();
    // A request that names an adapter runs with it on the base model.
    common.opts.lora = state
        .lora_as(&common.model, &engine, tenant.as_ref())
        .await?;
    common.tokens_as_ids |= state.config_tokens_as_ids();
    let max_len = engine.max_model_len();
    if api == Api::Completions {
        // OpenAI's default of 16 for completions, where neither the request
        // nor the model's generation config gives a max_tokens. Otherwise
        // the engine applies the model's defaults to what is unset (capped
        // to the context), and chat without one fills the context.
        common
            .params
            .apply_defaults(
                &engine.sampling_defaults().fallback_under(SamplingDefaults {
                    max_tokens: Some(16),
                    ..Default::default()
                }),
            );
    }
    let param = if api == Api::Chat {
        "messages"
    } else {
        "prompt"
    };
    for RunPrompt { ids, .. } in &prompts {
        if ids.is_empty() {
            return Err(ApiError::invalid(Some(param.into()), "the prompt is empty"));
        }
        let want = ids.len() + common.params.max_tokens.unwrap_or(1);
        if ids.len() >= max_len || want > max_len {
            return Err(ApiError::context_length(
                param,
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {want} tokens ({} in the {}, {} in the completion). Please reduce the length of the {} or completion.",
                    ids.len(),
                    if api == Api::Chat { "messages" } else { "prompt" },
                    common.params.max_tokens.unwrap_or(1),
                    if api == Api::Chat { "messages" } else { "prompt" },
                ),
            ));
        }
    }
    resolve_logprob_counts(
        &mut common,
        engine.vocab_size(),
        state.config_max_logprobs(),
    )?;
    let no_text = state.config_skip_tokenizer_init();
    if no_text {
        // Token ids in, token ids out: what needs text is refused, and
        // outputs carry their ids (logprobs name tokens by id).
        let refuse = |param: &str| {
            Err(ApiError::invalid(
                Some(param.into()),
                format!("'{param}' needs the tokenizer, and this server was started with --skip-tokenizer-init"),
            ))
        };
        if !common.params.stop.is_empty() {
            return refuse("stop");
        }
        if !common.bad_words.is_empty() {
            return refuse("bad_words");
        }
        if common.echo {
            return refuse("echo");
        }
        if let Some(r) = &common.structured {
            return refuse(&r.param.clone());
        }
        common.return_token_ids = true;
        common.tokens_as_ids = true;
    }
    if !common.bad_words.is_empty() {
        common.params.bad_words_token_ids = engine
            .tokenizer()
            .bad_words_ids(&common.bad_words)
            .map_err(|e| ApiError::invalid(Some("bad_words".into()), format!("{e:#}")))?;
    }
    common
        .params
        .validate(engine.vocab_size())
        .map_err(|e| ApiError::invalid(Some(e.param.to_string()), e.message))?;
    // A reasoning model's output is split into reasoning and answer,
    // unless the prompt already closed the reasoning (a template given
    // `enable_thinking: false`), as vLLM decides it.
    let reasoning = match (state.reasoning_parser(), api, prompts.first()) {
        (Some(parser), Api::Chat, Some(_)) if parser.is_harmony() => {
            // Harmony's markers are special tokens of gpt-oss's tokenizer:
            // they must stay in the text to be read (as vLLM does).
            common.params.skip_special_tokens = false;
            let calls = matches!(
                tools,
                Some(ToolMode::Auto(tool_parsers::ToolCallParser::OpenAi))
            );
            // A constraint waits for the final channel's header, which a
            // grammar over text could not write where its markers are
            // special tokens; where they are not (a tokenizer without
            // harmony's tokens), it is text the grammar may write, and the
            // constraint covers the whole output.
            let end = harmony::final_header_ids(engine.tokenizer());
            Some((parser.keeping_calls(calls), end))
        }
        (Some(parser), Api::Chat, Some(p)) => {
            let tok = engine.tokenizer();
            let end = tok.encode("</think>", false).unwrap_or_default();
            let start = tok.encode("<think>", false).unwrap_or_default();
            // What the template's generation prompt did, when the host's
            // template rendered it; else (a tenant's plugin rendered the
            // prompt) what the prompt's ids show.
            let prompt = match &common.generation_prompt {
                Some(g) => reasoning::PromptReasoning::of_text(g),
                None => reasoning::PromptReasoning::of_ids(&p.ids, &start, &end),
            };
            match prompt {
                reasoning::PromptReasoning::Closed => None,
                // The output starts inside the reasoning, whatever the
                // parser (Qwen3-Thinking templates open `<think>`, and the
                // model writes only `</think>`).
                reasoning::PromptReasoning::Opened => Some((parser.inside(), end)),
                reasoning::PromptReasoning::Untouched => Some((parser, end)),
            }
        }
        _ => None,
    };
    if let Some(r) = &common.structured {
        // The scores of chosen ids are computed on the host sampler, which
        // does not apply a grammar's mask.
        if !common.params.logprob_token_ids.is_empty() {
            return Err(ApiError::invalid(
                Some("logprob_token_ids".into()),
                format!(
                    "'logprob_token_ids' cannot be combined with structured output ('{}')",
                    r.param
                ),
            ));
        }
        common.opts.grammar = Some(compile_structure(&engine, r).await?);
        // The reasoning is free text; the constraint applies to the
        // answer, after `</think>` (as in vLLM).
        if let Some((_, end)) = &reasoning {
            common.opts.reasoning_end = Some(end.clone());
        }
    }
    let in_flight = state.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
    let slot = InFlight(Arc::clone(&state));
    if in_flight > state.max_pending {
        return Err(ApiError::overloaded(format!(
            "The server has {} requests in flight, its limit (--max-pending-requests). Retry later.",
            state.max_pending
        )));
    }
    // Under the engine's own model name.
    engine.with_metrics(|| {
        use crate::engine::async_engine::metric_names as m;
        metrics::histogram!(m::REQUEST_PARAMS_N).record(common.params.n as f64);
        if let Some(max) = common.params.max_tokens {
            metrics::histogram!(m::REQUEST_PARAMS_MAX_TOKENS).record(max as f64);
        }
    });
    let (tx, rx) = mpsc::unbounded_channel();
    let mut guard = engine.abort_guard();
    let mut choice_of = HashMap::new();
    let n = common.params.n;
    let mut prompt_tokens = 0;
    for (pi, RunPrompt { ids, .. }) in prompts.iter().enumerate() {
        prompt_tokens += ids.len();
        // Every sample scores the prompt it was asked to: a later one
        // could finish its prompt first (it is not held to the chunks
        // prompt scoring runs in), and a stream sends each choice's
        // prompt with its first tokens.
        for si in 0..n {
            let mut p = common.params.clone();
            p.n = 1;
            p.seed = common.params.seed.map(|s| s.wrapping_add(si as u64));
            let mut opts = common.opts.clone();
            opts.sample_index = si;
            let eid = engine
                .submit(format!("{id}-{pi}-{si}"), ids.clone(), p, opts, tx.clone())
                .await
                .map_err(|e| match e {
                    SubmitError::Invalid(e) => {
                        ApiError::invalid(Some(e.param.to_string()), e.message)
                    }
                    SubmitError::EngineDead => ApiError::unavailable("the engine has stopped"),
                })?;
            guard.push(eid);
            choice_of.insert(eid, pi * n + si);
        }
    }
    // Only the engine may hold senders from here on: when it dies, the
    // channel closes and the request gets its 503 instead of waiting.
    drop(tx);
    let total = choice_of.len();
    let log = crate::server::access_log::current();
    if let Some(l) = &log {
        l.set_request_id(&id);
        l.set_tokens(prompt_tokens, 0);
        if l.wants_prompt() {
            if let Some(p) = prompts.first() {
                l.set_prompt(&engine.tokenizer().decode(&p.ids, false).unwrap_or_default());
            }
        }
    }
    let run = Run {
        api,
        id,
        created: now_secs(),
        model: common.model.clone(),
        rx,
        guard,
        choice_of,
        choices: vec![Choice::default(); total],
        prompts,
        per_prompt: n,
        // Each prompt counts once however many samples continue it, as
        // OpenAI and vLLM count it (and tenants are charged).
        prompt_tokens,
        cached_tokens: 0,
        remaining: total,
        want_logprobs: common.params.logprobs.is_some(),
        // With `logprob_token_ids`, each of those ids is an alternative.
        logprobs_k: common
            .params
            .logprobs
            .unwrap_or(0)
            .max(common.params.logprob_token_ids.len()),
        prompt_logprobs_k: common.prompt_logprobs,
        continuous_usage: common.continuous_usage,
        return_token_ids: common.return_token_ids,
        tokens_as_ids: common.tokens_as_ids,
        no_text,
        tokenizer: engine.tokenizer().clone(),
        tools,
        tenant,
        log,
        reasoning: reasoning.map(|(parser, _)| parser),
        created_ms,
        metered: false,
        _slot: slot,
    };
    Ok(run)
}

/// Turns vLLM's `-1` (the whole vocabulary) into the vocabulary's size and
/// holds every logprob count to `--max-logprobs` (`max`, None: no limit),
/// as vLLM does: `-1` passes only where the limit is the vocabulary or
/// none.
fn resolve_logprob_counts(
    common: &mut CommonParams,
    vocab: usize,
    max: Option<usize>,
) -> Result<(), ApiError> {
    let all = |k: &mut Option<usize>| {
        if *k == Some(fields::ALL_LOGPROBS) {
            *k = Some(vocab);
        }
    };
    all(&mut common.params.logprobs);
    all(&mut common.params.prompt_logprobs);
    all(&mut common.prompt_logprobs);
    let Some(max) = max else {
        return Ok(());
    };
    for (k, what, param) in [
        (common.params.logprobs, "sample", "logprobs"),
        (common.prompt_logprobs, "prompt", "prompt_logprobs"),
    ] {
        if let Some(k) = k.filter(|&k| k > max) {
            return Err(ApiError::invalid(
                Some(param.into()),
                format!("Requested {what} logprobs of {k}, which is greater than max allowed: {max} (--max-logprobs)"),
            ));
        }
    }
    Ok(())
}

/// Compiles a request's constraint off the async threads (a large schema
/// takes milliseconds, and the first one builds the token trie).
async fn compile_structure(
    engine: &crate::engine::async_engine::AsyncEngine,
    r: &structured::RequestedStructure,
) -> Result<crate::engine::structured_output::GrammarMatcher, ApiError> {
    let engine = engine.clone();
    let spec = r.spec.clone();
    let compiled = tokio::task::spawn_blocking(move || {
        let compiler = engine.grammar_compiler().map_err(|e| (false, e))?;
        compiler.compile(&spec).map_err(|e| (true, e))
    })
    .await
    .map_err(|e| ApiError::internal(format!("compiling the constraint failed: {e}")))?;
    compiled.map_err(|(client, e)| {
        if client {
            ApiError::invalid(
                Some(r.param.clone()),
                format!("'{}' does not compile: {e}", r.param),
            )
        } else {
            ApiError::invalid(
                Some(r.param.clone()),
                format!("structured output is not available for this model: {e}"),
            )
        }
    })
}

fn stop_reason_json(r: &Option<StopReason>) -> Option<Value> {
    match r {
        Some(StopReason::Token(t)) => Some(json!(t)),
        Some(StopReason::Text(s)) => Some(json!(s)),
        None => None,
    }
}

impl Run {
    /// Passes a streamed output's text through the tenant's `on-chunk`
    /// plugins, if it has any, before the output is absorbed.
    pub(crate) async fn on_chunk(&mut self, o: &mut StepOutput) -> Result<(), ApiError> {
        let Some(mut t) = self.tenant.take() else {
            return Ok(());
        };
        let mut r = Ok(());
        if let (true, Some(&i)) = (t.has_on_chunk(), self.choice_of.get(&o.id)) {
            let done: usize =
                self.choices.iter().map(|c| c.tokens).sum::<usize>() + o.new_token_ids.len();
            let text = std::mem::take(&mut o.new_text);
            let tokens = (self.prompt_tokens as u32, done as u32);
            match t.on_chunk(i, text, o.finish_reason.is_some(), tokens).await {
                Ok(s) => o.new_text = s,
                Err(e) => r = Err(e),
            }
        }
        // Back before returning: dropping the run charges the tenant.
        self.tenant = Some(t);
        r
    }

    /// Folds one engine output into its choice; returns the choice index.
    pub(crate) fn absorb(&mut self, o: &mut StepOutput) -> Option<usize> {
        let &i = self.choice_of.get(&o.id)?;
        if self.no_text {
            // `--skip-tokenizer-init`: the ids are the output, as vLLM
            // sends them, with no text.
            o.new_text.clear();
        }
        if let Some(p) = self.reasoning {
            // From here on `o.new_text` is only the answer's part.
            let c = &mut self.choices[i];
            let (r, a) = c.reasoning_stream.push(
                p,
                &o.new_text,
                o.new_token_ids.len(),
                o.finish_reason.is_some(),
            );
            c.reasoning.push_str(&r);
            c.new_reasoning.push_str(&r);
            o.new_text = a;
        }
        if let (false, Some(l)) = (o.new_token_ids.is_empty(), &self.log) {
            l.first_token();
        }
        let c = &mut self.choices[i];
        c.text.push_str(&o.new_text);
        c.tokens += o.new_token_ids.len();
        c.spec_accepted = o.num_spec_accepted;
        if self.return_token_ids {
            c.token_ids.extend_from_slice(&o.new_token_ids);
        }
        if self.want_logprobs {
            c.logprobs.extend(o.logprobs.iter().cloned());
        }
        if let Some(p) = &o.prompt_logprobs {
            c.prompt_logprobs = Some(p.clone());
        }
        if let Some(f) = o.finish_reason {
            // The count is final once the request finishes (a preempted
            // request can find more of its prompt cached on re-admission).
            // Like the prompt, it counts once per prompt: the first sample's.
            if i % self.per_prompt.max(1) == 0 {
                self.cached_tokens += o.num_cached_tokens;
            }
            let c = &mut self.choices[i];
            c.finish_reason = Some(f.as_str());
            c.stop_reason = stop_reason_json(&o.stop_reason);
            self.remaining -= 1;
        }
        Some(i)
    }

    pub(crate) fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        });
        if self.api == Api::Chat {
            // 0 without a reasoning parser, as OpenAI sends for models
            // that do not reason.
            usage["completion_tokens_details"] =
                json!({"reasoning_tokens": self.reasoning_tokens()});
        }
        usage
    }

    /// The generated tokens that the reasoning parser put in the
    /// reasoning, over all choices (0 without a parser).
    pub(crate) fn reasoning_tokens(&self) -> usize {
        self.reasoning.map_or(0, |p| {
            self.choices
                .iter()
                .map(|c| c.reasoning_stream.reasoning_tokens(p))
                .sum()
        })
    }

    pub(crate) fn token_text(&self, id: u32) -> String {
        if self.tokens_as_ids {
            return format!("token_id:{id}");
        }
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The logprobs of generated tokens `lps`, the first at character
    /// `text_offset` of the choice's text; for completions with `echo`, after those of
    /// the choice's prompt (which start the text).
    pub(crate) fn logprobs_json(
        &self,
        echo_of: Option<usize>,
        lps: &[TokenLogprob],
        text_offset: usize,
    ) -> Value {
        if !self.want_logprobs {
            return Value::Null;
        }
        match self.api {
            Api::Chat => {
                let entry = |id: u32, lp: f32| {
                    let t = self.token_text(id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let mut e = entry(l.token_id, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Api::Completions => {
                // (token text, offset, its score): the prompt's first token
                // has none, as nothing predicts it. Offsets count
                // characters, as OpenAI's (and Python's) do.
                let mut rows: Vec<(String, usize, Option<&TokenLogprob>)> = Vec::new();
                if let Some(i) = echo_of {
                    let ids = &self.prompts[i / self.per_prompt].ids;
                    let scores = self.choices[i].prompt_logprobs.as_deref().unwrap_or(&[]);
                    let mut offset = 0;
                    for (k, &id) in ids.iter().enumerate() {
                        let t = self.token_text(id);
                        let next = offset + t.chars().count();
                        rows.push((t, offset, k.checked_sub(1).and_then(|k| scores.get(k))));
                        offset = next;
                    }
                }
                let mut offset = text_offset;
                for l in lps {
                    let t = self.token_text(l.token_id);
                    let next = offset + t.chars().count();
                    rows.push((t, offset, Some(l)));
                    offset = next;
                }
                let top = |l: &TokenLogprob| {
                    let m: serde_json::Map<String, Value> = l
                        .top
                        .iter()
                        .take(self.logprobs_k)
                        .map(|&(t, lp)| (self.token_text(t), json!(lp)))
                        .collect();
                    Value::Object(m)
                };
                json!({
                    "tokens": rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
                    "token_logprobs": rows.iter().map(|r| r.2.map(|l| l.logprob)).collect::<Vec<_>>(),
                    "top_logprobs": rows.iter().map(|r| r.2.map(top)).collect::<Vec<_>>(),
                    "text_offset": rows.iter().map(|r| r.1).collect::<Vec<_>>(),
                })
            }
        }
    }

    /// Choice `i`'s echo: its prompt's text, if the request asked for it.
    pub(crate) fn echo_text(&self, i: usize) -> Option<&str> {
        self.prompts[i / self.per_prompt].echo.as_deref()
    }

    /// vLLM's `prompt_logprobs` of choice `i`: `null` for the first
    /// token, then per token a map from token id to its logprob, rank and
    /// text, for the token itself and the top alternatives.
    pub(crate) fn prompt_logprobs_json(&self, i: usize) -> Value {
        let Some(k) = self.prompt_logprobs_k else {
            return Value::Null;
        };
        let Some(scores) = &self.choices[i].prompt_logprobs else {
            return Value::Null;
        };
        let entry = |t: u32, lp: f32, rank: u32| json!({"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)});
        let rows = scores.iter().map(|l| {
            let mut m = serde_json::Map::new();
            m.insert(l.token_id.to_string(), entry(l.token_id, l.logprob, l.rank));
            for (j, &(t, lp)) in l.top.iter().take(k).enumerate() {
                m.entry(t.to_string())
                    .or_insert_with(|| entry(t, lp, j as u32 + 1));
            }
            Value::Object(m)
        });
        std::iter::once(Value::Null).chain(rows).collect()
    }

    pub(crate) fn final_body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let echo = self.echo_text(i);
                let lp = self.logprobs_json(
                    echo.map(|_| i),
                    &c.logprobs,
                    echo.map_or(0, |e| e.chars().count()),
                );
                let mut v = match self.api {
                    Api::Completions => {
                        let mut v = json!({
                            "index": i, "text": format!("{}{}", echo.unwrap_or(""), c.text),
                            "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        });
                        // Always present (null unless asked), as vLLM sends it.
                        v["prompt_logprobs"] = self.prompt_logprobs_json(i);
                        v
                    }
                    Api::Chat => {
                        let (message, finish) = self.chat_message(i, c);
                        json!({
                            "index": i, "message": message,
                            "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason,
                        })
                    }
                };
                if self.return_token_ids {
                    // A chat has one prompt: vLLM gives its ids once, beside
                    // the choices (below); a completion's choice its own.
                    if self.api == Api::Completions {
                        v["prompt_token_ids"] = json!(self.prompts[i / self.per_prompt].ids);
                    }
                    v["token_ids"] = json!(c.token_ids);
                }
                v
            })
            .collect();
        let mut body = json!({
            "id": self.id,
            "object": if self.api == Api::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        });
        if self.api == Api::Chat && self.prompts.len() == 1 {
            // Chat has one prompt, so vLLM gives its scores once (null
            // unless asked, but always present). A batch of conversations
            // has none of these, as vLLM's batch endpoint sends none.
            body["prompt_logprobs"] = self.prompt_logprobs_json(0);
            if self.return_token_ids {
                body["prompt_token_ids"] = json!(self.prompts.first().map(|p| &p.ids));
            }
        }
        body
    }

    /// A finished chat choice's message, with the tool calls its output
    /// holds, and its finish reason ("tool_calls" when it called tools).
    pub(crate) fn chat_message(&self, i: usize, c: &Choice) -> (Value, Option<&'static str>) {
        let (mut message, finish) = self.answer_message(c);
        if let Some(e) = self.echo_text(i) {
            let answer = message["content"].as_str().unwrap_or("");
            message["content"] = json!(format!("{e}{answer}"));
        }
        if self.reasoning.is_some() {
            // vLLM 0.32's `reasoning`, and `reasoning_content` (its older
            // name) for older clients; the answer is null when the output
            // was all reasoning.
            let r = match c.reasoning.as_str() {
                "" => Value::Null,
                r => json!(r),
            };
            message["reasoning"] = r.clone();
            message["reasoning_content"] = r;
            if message["content"] == json!("")
                && !c.reasoning.is_empty()
                && self.echo_text(i).is_none()
            {
                message["content"] = Value::Null;
            }
        }
        (message, finish)
    }

    /// The answer part of a finished chat choice, with its tool calls.
    pub(crate) fn answer_message(&self, c: &Choice) -> (Value, Option<&'static str>) {
        let Some(mode) = &self.tools else {
            return (
                json!({"role": "assistant", "content": c.text}),
                c.finish_reason,
            );
        };
        let parsed = tools::extract(mode, &c.text);
        if parsed.calls.is_empty() {
            // A forced call cut by max_tokens is no call, and its fragment
            // (`{"a`) is no answer either: content null, as vLLM sends.
            let forced = matches!(mode, tools::ToolMode::Named(_) | tools::ToolMode::Required);
            let content = match mode {
                _ if forced => json!(parsed.content),
                tools::ToolMode::Auto(p) => json!(p.plain(&c.text)),
                _ => json!(c.text),
            };
            return (
                json!({"role": "assistant", "content": content}),
                c.finish_reason,
            );
        }
        let calls: Vec<Value> = parsed
            .calls
            .iter()
            .map(|call| tools::call_json(&tools::new_call_id(), call))
            .collect();
        let finish = match c.finish_reason {
            Some("stop") => Some("tool_calls"),
            other => other,
        };
        (
            json!({"role": "assistant", "content": parsed.content, "tool_calls": calls}),
            finish,
        )
    }

    /// The SSE chunk for one output of a chat that offers tools. A named
    /// call streams its arguments as they are generated; otherwise content
    /// flows until a tool call may have begun, and the calls go out whole
    /// once the output is complete.
    pub(crate) fn tool_delta_chunk(&mut self, i: usize, o: &StepOutput) -> Option<Bytes> {
        let mode = self.tools.clone()?;
        let engine_finish = o.finish_reason.map(|f| f.as_str());
        let mut delta = serde_json::Map::new();
        let reasoning = std::mem::take(&mut self.choices[i].new_reasoning);
        if !reasoning.is_empty() {
            insert_reasoning(&mut delta, reasoning);
        }
        let mut called = false;
        match &mode {
            ToolMode::Named(_) => {
                // The call goes out whole once the output is complete, as
                // `required` calls do: one cut by max_tokens (arguments
                // `{"a`) is then no call at all, streamed as unstreamed.
                if engine_finish.is_some() {
                    let c = &self.choices[i];
                    if let Some(call) = tools::extract(&mode, &c.text).calls.first() {
                        called = true;
                        let mut v = tools::call_json(&tools::new_call_id(), call);
                        v["index"] = json!(0);
                        delta.insert("tool_calls".into(), json!([v]));
                    }
                }
            }
            ToolMode::Required | ToolMode::Auto(_) => {
                let c = &mut self.choices[i];
                if engine_finish.is_none() {
                    let hold = match &mode {
                        ToolMode::Auto(p) => p.hold_from(&c.text),
                        _ => 0,
                    };
                    // Trailing whitespace waits too: before a call it is
                    // dropped, as the unstreamed content is trimmed.
                    let hold = c.text.get(..hold).map_or(0, |t| t.trim_end().len());
                    if hold > c.sent && c.text.is_char_boundary(hold) {
                        delta.insert("content".into(), json!(c.text[c.sent..hold]));
                        c.sent = hold;
                    }
                } else {
                    let parsed = tools::extract(&mode, &c.text);
                    if parsed.calls.is_empty() {
                        // A `required` output that holds no call was cut
                        // inside the call list: a fragment, not an answer.
                        let rest = c.text.get(c.sent..).unwrap_or("");
                        if let ToolMode::Auto(p) = &mode {
                            // Without the markers of formats that have
                            // some that are never content (harmony's).
                            let rest = p.plain(rest);
                            if !rest.is_empty() {
                                delta.insert("content".into(), json!(rest));
                            }
                        }
                        c.sent = c.text.len();
                    } else {
                        called = true;
                        let calls: Vec<Value> = parsed
                            .calls
                            .iter()
                            .enumerate()
                            .map(|(k, call)| {
                                let mut v = tools::call_json(&tools::new_call_id(), call);
                                v["index"] = json!(k);
                                v
                            })
                            .collect();
                        delta.insert("tool_calls".into(), Value::Array(calls));
                    }
                }
            }
        }
        let finish = match engine_finish {
            Some("stop") if called => Some("tool_calls"),
            other => other,
        };
        let has_ids = self.return_token_ids && !o.new_token_ids.is_empty();
        if delta.is_empty() && finish.is_none() && !has_ids {
            return None;
        }
        let mut choice = json!({
            "index": i, "delta": delta, "logprobs": null,
            "finish_reason": finish, "stop_reason": stop_reason_json(&o.stop_reason),
        });
        self.stream_token_ids(i, &mut choice, o);
        Some(self.chunk(vec![choice], None))
    }

    pub(crate) fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> Bytes {
        self.chunk_with(choices, usage, None)
    }

    /// A chunk, with the chat's `prompt_token_ids` when given.
    pub(crate) fn chunk_with(
        &self,
        choices: Vec<Value>,
        usage: Option<Value>,
        prompt_token_ids: Option<Value>,
    ) -> Bytes {
        let usage = usage.or_else(|| self.continuous_usage.then(|| self.usage()));
        let mut body = json!({
            "id": self.id,
            "object": if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        });
        if let Some(ids) = prompt_token_ids {
            body["prompt_token_ids"] = ids;
        }
        Bytes::from(format!("data: {body}\n\n"))
    }

    /// The SSE chunk for one engine output, if it carries anything. With
    /// `echo`, a choice's first chunk starts with its prompt.
    pub(crate) fn delta_chunk(&mut self, i: usize, o: &StepOutput) -> Option<Bytes> {
        let finish = o.finish_reason.map(|f| f.as_str());
        let has_logprobs = self.want_logprobs && !o.logprobs.is_empty();
        // A chat's echo went out with its opening chunks.
        let echo = match self.echo_text(i) {
            Some(t) if !self.choices[i].echoed && self.api == Api::Completions => {
                Some(t.to_string())
            }
            _ => None,
        };
        let reasoning = std::mem::take(&mut self.choices[i].new_reasoning);
        // With `return_token_ids`, every token goes out with some chunk,
        // even one whose text is still held back.
        let has_ids = self.return_token_ids && !o.new_token_ids.is_empty();
        if o.new_text.is_empty()
            && reasoning.is_empty()
            && finish.is_none()
            && !has_logprobs
            && echo.is_none()
            && !has_ids
        {
            return None;
        }
        let lp = if has_logprobs || echo.is_some() {
            let c = &self.choices[i];
            let before = c.text.get(..c.text.len() - o.new_text.len()).unwrap_or("");
            let echo_chars = self.echo_text(i).map_or(0, |e| e.chars().count());
            self.logprobs_json(
                echo.as_ref().map(|_| i),
                &o.logprobs,
                echo_chars + before.chars().count(),
            )
        } else {
            Value::Null
        };
        self.choices[i].echoed = true;
        let mut choice = match self.api {
            Api::Completions => json!({
                "index": i, "text": format!("{}{}", echo.unwrap_or_default(), o.new_text),
                "logprobs": lp,
                "finish_reason": finish, "stop_reason": stop_reason_json(&o.stop_reason),
            }),
            Api::Chat => {
                let mut delta = serde_json::Map::new();
                if !reasoning.is_empty() {
                    insert_reasoning(&mut delta, reasoning);
                }
                if !o.new_text.is_empty() {
                    delta.insert("content".into(), json!(o.new_text));
                }
                json!({
                    "index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": finish, "stop_reason": stop_reason_json(&o.stop_reason),
                })
            }
        };
        self.stream_token_ids(i, &mut choice, o);
        Some(self.chunk(vec![choice], None))
    }

    /// With `return_token_ids`, a streamed choice carries the ids its chunk
    /// adds, and a completion's first chunk its prompt's ids too (a chat
    /// stream sends those once, in its opening chunk), as vLLM streams them.
    pub(crate) fn stream_token_ids(&mut self, i: usize, choice: &mut Value, o: &StepOutput) {
        if !self.return_token_ids {
            return;
        }
        choice["token_ids"] = json!(o.new_token_ids);
        if self.api == Api::Completions && !self.choices[i].prompt_ids_sent {
            self.choices[i].prompt_ids_sent = true;
            choice["prompt_token_ids"] = json!(self.prompts[i / self.per_prompt].ids);
        }
    }
}

/// A delta's reasoning text: vLLM 0.32's `reasoning`, and
/// `reasoning_content` (its older name) for older clients.
fn insert_reasoning(delta: &mut serde_json::Map<String, Value>, reasoning: String) {
    delta.insert("reasoning_content".into(), json!(reasoning));
    delta.insert("reasoning".into(), json!(reasoning));
}

async fn collect_response(run: Run) -> Result<Response<Body>, ApiError> {
    let run = collect(run).await?;
    Ok(json_response(&run.final_body()))
}

/// Waits for every choice to finish and runs the tenant's post-processing
/// over their texts.
pub(crate) async fn collect(mut run: Run) -> Result<Run, ApiError> {
    while run.remaining > 0 {
        match run.rx.recv().await {
            Some(mut o) => {
                run.absorb(&mut o);
            }
            None => {
                return Err(ApiError::unavailable(
                    "the engine stopped before the request finished",
                ))
            }
        }
    }
    run.guard.disarm();
    if let Some(mut t) = run.tenant.take() {
        let completion: usize = run.choices.iter().map(|c| c.tokens).sum();
        let r = async {
            for i in 0..run.choices.len() {
                let text = std::mem::take(&mut run.choices[i].text);
                run.choices[i].text = t
                    .post_process(i, text, (run.prompt_tokens as u32, completion as u32))
                    .await?;
            }
            Ok::<_, ApiError>(())
        }
        .await;
        run.tenant = Some(t);
        r?;
    }
    run.meter().await?;
    Ok(run)
}

fn stream_response(run: Run, include_usage: bool) -> Response<Body> {
    enum Phase {
        Start,
        Tokens,
        Usage,
        Done,
        End,
    }
    let stream = futures_util::stream::unfold(
        (run, Phase::Start),
        move |(mut run, phase)| async move {
            match phase {
                Phase::Start => {
                    let frame = if run.api == Api::Chat {
                        // Chat streams open with the role, as OpenAI's do.
                        let choices = (0..run.choices.len())
                        .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                        .collect();
                        // vLLM sends a chat's prompt ids once, here.
                        let prompt_ids = run
                            .return_token_ids
                            .then(|| json!(run.prompts.first().map(|p| &p.ids)));
                        let mut frame = run.chunk_with(choices, None, prompt_ids).to_vec();
                        // With `echo`, the final message comes next, as its
                        // own chunk (vLLM's order).
                        if let Some(e) = run.echo_text(0) {
                            let choices = (0..run.choices.len())
                                .map(|i| json!({"index": i, "delta": {"content": e}, "logprobs": null, "finish_reason": null}))
                                .collect();
                            frame.extend_from_slice(&run.chunk(choices, None));
                        }
                        Bytes::from(frame)
                    } else {
                        Bytes::new()
                    };
                    Some((Ok(Frame::data(frame)), (run, Phase::Tokens)))
                }
                Phase::Tokens => loop {
                    if run.remaining == 0 {
                        let next = if include_usage {
                            Phase::Usage
                        } else {
                            Phase::Done
                        };
                        break Some((Ok(Frame::data(Bytes::new())), (run, next)));
                    }
                    match run.rx.recv().await {
                        Some(mut o) => {
                            if let Err(e) = run.on_chunk(&mut o).await {
                                // The guard stays armed: dropping the run aborts the engine requests.
                                let b =
                                    Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body()));
                                break Some((Ok(Frame::data(b)), (run, Phase::End)));
                            }
                            let Some(i) = run.absorb(&mut o) else {
                                continue;
                            };
                            let chunk = if run.tools.is_some() {
                                run.tool_delta_chunk(i, &o)
                            } else {
                                run.delta_chunk(i, &o)
                            };
                            if let Some(b) = chunk {
                                break Some((Ok(Frame::data(b)), (run, Phase::Tokens)));
                            }
                        }
                        None => {
                            let err = ApiError::unavailable(
                                "the engine stopped before the request finished",
                            );
                            let b = Bytes::from(format!("data: {}\n\n", err.body()));
                            break Some((Ok(Frame::data(b)), (run, Phase::Done)));
                        }
                    }
                },
                Phase::Usage => {
                    let b = run.chunk(Vec::new(), Some(run.usage()));
                    Some((Ok(Frame::data(b)), (run, Phase::Done)))
                }
                Phase::Done => {
                    run.guard.disarm();
                    if let Err(e) = run.meter().await {
                        let b = Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body()));
                        return Some((Ok(Frame::data(b)), (run, Phase::End)));
                    }
                    Some((
                        Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))),
                        (run, Phase::End),
                    ))
                }
                Phase::End => None,
            }
        },
    );
    sse_response(stream)
}

/// An SSE response over a stream of frames.
pub(crate) fn sse_response(
    frames: impl futures_util::Stream<Item = Result<Frame<Bytes>, std::convert::Infallible>>
        + Send
        + 'static,
) -> Response<Body> {
    let body = http_body_util::StreamBody::new(frames).boxed_unsync();
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    r
}
