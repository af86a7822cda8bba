//! The engine on its own thread, driven through channels: the async front
//! end submits requests and receives each request's outputs on a channel;
//! dropping a request's stream (a client that went away) aborts it, which
//! frees its KV blocks at once. The engine thread returns token ids; an
//! output thread beside it detokenizes them, applies stop strings (a
//! request a stop string ends is aborted in the engine) and sends each
//! request its outputs, so text never costs the engine's steps time.
//!
//! If a step fails (a device error) or panics, the thread records why and
//! ends: every request's output channel closes, so front ends answer 503,
//! and [`AsyncEngine::died`] resolves, so the server can stop reporting
//! healthy and exit for its supervisor to restart it. An engine whose step
//! failed halfway holds K/V in an unknown state; it is never reused.

use crate::engine::core::{EngineCore, EngineCoreOutput, EngineStats, RequestOptions};
use crate::engine::output_processor::{OutputProcessor, StepOutput, StopStrings};
use crate::engine::request::{FinishReason, ParamError, SamplingDefaults, SamplingParams};
use crate::engine::structured_output::GrammarCompiler;
use crate::tokenizer::detokenizer::IncrementalDetokenizer;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};

/// The environment variable that makes the engine thread panic at the start
/// of its N-th step: fault injection for the tests that check what the
/// server does when its engine dies. Read once, when the engine starts.
pub const INJECT_PANIC_AT_STEP: &str = "PAGODA_INJECT_ENGINE_PANIC_AT_STEP";

/// Prometheus metric names, as vLLM names them.
pub mod metric_names {
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
    pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
    pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
    pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
    pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
    pub const TTFT: &str = "vllm:time_to_first_token_seconds";
    pub const ITL: &str = "vllm:inter_token_latency_seconds";
    pub const E2E: &str = "vllm:e2e_request_latency_seconds";
    pub const QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
    pub const TPOT: &str = "vllm:time_per_output_token_seconds";
    pub const REQUEST_TPOT: &str = "vllm:request_time_per_output_token_seconds";
    pub const PREFILL_TIME: &str = "vllm:request_prefill_time_seconds";
    pub const DECODE_TIME: &str = "vllm:request_decode_time_seconds";
    pub const INFERENCE_TIME: &str = "vllm:request_inference_time_seconds";
    pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
    pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
    pub const REQUEST_MAX_GENERATION_TOKENS: &str = "vllm:request_max_num_generation_tokens";
    pub const REQUEST_PARAMS_N: &str = "vllm:request_params_n";
    pub const REQUEST_PARAMS_MAX_TOKENS: &str = "vllm:request_params_max_tokens";
    pub const ITERATION_TOKENS: &str = "vllm:iteration_tokens_total";
    pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
    pub const PREFIX_CACHE_QUERIES_GPU: &str = "vllm:gpu_prefix_cache_queries_total";
    pub const PREFIX_CACHE_HITS_GPU: &str = "vllm:gpu_prefix_cache_hits_total";
    pub const GPU_CACHE_USAGE: &str = "vllm:gpu_cache_usage_perc";
    pub const NUM_REQUESTS_SWAPPED: &str = "vllm:num_requests_swapped";
    pub const SPEC_NUM_DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
    pub const SPEC_NUM_DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
    pub const SPEC_NUM_ACCEPTED_TOKENS: &str = "vllm:spec_decode_num_accepted_tokens_total";
    pub const SPEC_ACCEPTED_PER_POS: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    /// With `--enable-lora`: the running and waiting adapters, as labels
    /// (vLLM's gauge; its value is when the labels were set).
    pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
    /// Pagoda's own: KV-event batches dropped because the publisher thread
    /// fell behind (`--kv-events-config`).
    pub const KV_EVENTS_DROPPED: &str = "pagoda_kv_events_dropped_batches_total";

    // Pagoda's own, per tenant (label `tenant`: the tenant id, or
    // `default` for requests made without a tenant's key). The label's
    // values are bounded by the tenants an operator configures.
    pub const TENANT_RUNNING: &str = "pagoda_tenant_num_requests_running";
    pub const TENANT_WAITING: &str = "pagoda_tenant_num_requests_waiting";
    pub const TENANT_PROMPT_TOKENS: &str = "pagoda_tenant_prompt_tokens_total";
    pub const TENANT_GENERATION_TOKENS: &str = "pagoda_tenant_generation_tokens_total";
    pub const TENANT_TTFT: &str = "pagoda_tenant_time_to_first_token_seconds";
    pub const TENANT_QUEUE_TIME: &str = "pagoda_tenant_request_queue_time_seconds";
    /// Tenants with a KV-cache share (`kv_cache` in their config): blocks
    /// they hold or keep cached, of those the cached ones nobody holds,
    /// and their cached blocks other tenants' allocations evicted.
    pub const TENANT_KV_BLOCKS: &str = "pagoda_tenant_kv_cache_blocks";
    pub const TENANT_KV_CACHED_BLOCKS: &str = "pagoda_tenant_kv_cache_cached_blocks";
    pub const TENANT_KV_EVICTED_BY_OTHERS: &str =
        "pagoda_tenant_kv_cache_blocks_evicted_by_others_total";
}

use metric_names as m;

/// The `position` label's values, without formatting one each step.
const POSITIONS: [&str; crate::engine::spec_decode::MAX_SPECULATIVE_TOKENS] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
];

enum Command {
    Add {
        external_id: String,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        opts: RequestOptions,
        outputs: mpsc::UnboundedSender<StepOutput>,
        reply: oneshot::Sender<Result<u64, ParamError>>,
        /// When it was submitted: its time to first token and queue time
        /// count from here (as vLLM's from the request's arrival), the
        /// step in flight when it came included.
        arrived: Instant,
    },
    Abort(u64),
    /// Empty the prefix cache; the reply is how many blocks are held if
    /// requests are running.
    ResetPrefixCache(oneshot::Sender<Result<(), usize>>),
    Shutdown,
}

/// A handle to the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct AsyncEngine {
    tx: std_mpsc::Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    tokenizer: Arc<Tokenizer>,
    max_model_len: usize,
    vocab_size: usize,
    hidden_size: usize,
    /// The ids that end an output, for structured output's token trie.
    eos_ids: Arc<[u32]>,
    /// The structured-output compiler, once first asked for.
    grammar: Arc<OnceLock<Result<Arc<GrammarCompiler>, String>>>,
    sampling_defaults: Arc<SamplingDefaults>,
    /// The LoRA adapters requests may name (`--enable-lora`).
    loras: Option<crate::engine::lora::SharedLoras>,
    /// How the model pools, when it is served for pooling.
    pooler: Option<Arc<crate::engine::pooling::PoolerConfig>>,
    /// Whether the engine takes generation requests.
    generates: bool,
    /// `Some(why)` once the engine thread has died.
    dead: watch::Receiver<Option<String>>,
    /// Where this engine's metrics go, if not to the global recorder.
    recorder: Option<Arc<dyn metrics::Recorder + Send + Sync>>,
}

/// Aborts the engine requests it guards when dropped before they finish,
/// so a client disconnect frees KV blocks at once.
pub struct AbortGuard {
    tx: std_mpsc::Sender<Command>,
    ids: Vec<u64>,
    done: bool,
}

impl AbortGuard {
    /// Marks the requests finished: nothing to abort on drop.
    pub fn disarm(&mut self) {
        self.done = true;
    }

    /// Adds an engine request to guard.
    pub fn push(&mut self, id: u64) {
        self.ids.push(id);
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            for &id in &self.ids {
                let _ = self.tx.send(Command::Abort(id));
            }
        }
    }
}

/// What the engine thread tells the output thread, in step order.
enum ToOutput {
    /// Follow request `id`: sent before any of its outputs.
    Add {
        id: u64,
        detok: IncrementalDetokenizer,
        stop: StopStrings,
        outputs: mpsc::UnboundedSender<StepOutput>,
    },
    /// A step's outputs (or an abort's).
    Outputs(Vec<EngineCoreOutput>),
}

/// A request's timings, for the latency metrics, on the engine thread.
struct Track {
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// The most tokens the request may generate.
    max_tokens: usize,
    /// Its `tenant` label.
    tenant: String,
}

impl AsyncEngine {
    /// Moves `core` onto a new thread and returns the handle.
    pub fn start(core: EngineCore) -> std::io::Result<AsyncEngine> {
        Self::start_with_metrics(core, None)
    }

    /// [`AsyncEngine::start`], its metrics recorded through `recorder`
    /// (where one server runs several engines, each labels its series
    /// with its own model's name) instead of the global recorder.
    pub fn start_with_metrics(
        core: EngineCore,
        recorder: Option<Arc<dyn metrics::Recorder + Send + Sync>>,
    ) -> std::io::Result<AsyncEngine> {
        let (tx, rx) = std_mpsc::channel();
        let stats = Arc::new(Mutex::new(core.stats()));
        let tokenizer = core.tokenizer().clone();
        let max_model_len = core.max_model_len();
        let vocab_size = core.runner().config().vocab_size;
        let pooler = core.pooler().cloned().map(Arc::new);
        let generates = core.generates();
        let hidden_size = core.runner().config().hidden_size;
        // What the KV cache is, once, as vLLM publishes it.
        let kv = core.kv_cache();
        let cache_info = || {
            metrics::gauge!(
                m::CACHE_CONFIG_INFO,
                "block_size" => kv.block_size().to_string(),
                "num_gpu_blocks" => kv.pool().num_blocks().to_string(),
                "num_cpu_blocks" => "0",
                "enable_prefix_caching" => if kv.prefix_caching() { "True" } else { "False" },
            )
            .set(1.0)
        };
        match recorder.as_deref() {
            Some(r) => metrics::with_local_recorder(r, cache_info),
            None => cache_info(),
        }
        let eos_ids: Arc<[u32]> = core.eos_ids().into();
        let sampling_defaults = Arc::new(core.sampling_defaults().clone());
        let loras = core.lora_registry().cloned();
        let s = Arc::clone(&stats);
        let (dead_tx, dead) = watch::channel(None);
        let panic_at = match std::env::var(INJECT_PANIC_AT_STEP) {
            Ok(v) => {
                let n = v.parse::<u64>().map_err(|_| {
                    std::io::Error::other(format!(
                        "{INJECT_PANIC_AT_STEP}={v} is not a step number"
                    ))
                })?;
                tracing::warn!("{INJECT_PANIC_AT_STEP}={n}: the engine will panic at step {n}");
                Some(n)
            }
            Err(_) => None,
        };
        // The output thread: detokenizes, applies stop strings, and sends
        // each request its outputs. It asks the engine to abort what a stop
        // string ended over a channel of its own, so that it never keeps
        // the command channel (whose closing ends an idle engine) open.
        let (to_output, from_engine) = std_mpsc::channel::<ToOutput>();
        let (stop_tx, stop_rx) = std_mpsc::channel::<u64>();
        std::thread::Builder::new()
            .name("pagoda-output".into())
            .spawn(move || output_loop(from_engine, stop_tx))?;
        let thread_recorder = recorder.clone();
        std::thread::Builder::new()
            .name("pagoda-engine".into())
            .spawn(move || {
                // Every metric of this engine goes through its recorder.
                let _local = thread_recorder
                    .as_deref()
                    .map(|r| metrics::set_default_local_recorder(r));
                // The request metrics, the output thread's channel (and
                // through it the requests' output channels) and the command
                // queue live out here, so that they close only after `dead`
                // is set: a front end that sees its channel close can rely
                // on the probes already reporting the death.
                let mut tracks: HashMap<u64, Track> = HashMap::new();
                let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    engine_loop(core, &rx, &stop_rx, &to_output, s, panic_at, &mut tracks)
                }));
                let why = match ended {
                    Ok(Ok(())) => return,
                    Ok(Err(e)) => format!("a step failed: {e:#}"),
                    Err(p) => format!(
                        "the engine thread panicked: {}",
                        p.downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "(no message)".into())
                    ),
                };
                tracing::error!("engine died: {why}");
                let _ = dead_tx.send(Some(why));
                drop(tracks);
                drop(to_output);
                drop(rx);
            })?;
        Ok(AsyncEngine {
            tx,
            stats,
            tokenizer,
            max_model_len,
            vocab_size,
            hidden_size,
            pooler,
            generates,
            eos_ids,
            grammar: Arc::new(OnceLock::new()),
            sampling_defaults,
            loras,
            dead,
            recorder,
        })
    }

    /// Runs `f` with this engine's metrics recorder, so that what it
    /// records on a front-end thread carries the engine's model name.
    pub fn with_metrics<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.recorder {
            Some(r) => metrics::with_local_recorder(&**r, f),
            None => f(),
        }
    }

    /// Why the engine thread died, if it has.
    pub fn death(&self) -> Option<String> {
        self.dead.borrow().clone()
    }

    /// Resolves with the reason once the engine thread dies of a failed or
    /// panicking step; never resolves for an engine that is shut down.
    pub async fn died(&self) -> String {
        let mut rx = self.dead.clone();
        loop {
            if let Some(why) = rx.borrow_and_update().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                // The thread ended without dying: a shutdown.
                return std::future::pending().await;
            }
        }
    }

    /// The model's defaults for sampling fields a request leaves unset
    /// (the engine applies them; front ends read them to place their own
    /// fallbacks under them).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }

    /// Whether LoRA adapters are served (`--enable-lora`).
    pub fn lora_enabled(&self) -> bool {
        self.loras.is_some()
    }

    /// The registry of adapters, shared with the engine thread
    /// (`--enable-lora`): tenants' adapters take their ids from it.
    pub fn lora_registry(&self) -> Option<&crate::engine::lora::SharedLoras> {
        self.loras.as_ref()
    }

    /// The adapter named `name`, if loaded (its factors read again if
    /// `--max-cpu-loras` dropped them; a folder that no longer loads is
    /// logged and answers `None`).
    pub fn lora(&self, name: &str) -> Option<Arc<crate::engine::lora::LoadedLora>> {
        crate::engine::lora::lock(self.loras.as_ref()?)
            .get(name)
            .unwrap_or_else(|e| {
                tracing::error!("{e:#}");
                None
            })
    }

    /// The adapter named `name`, without reading its factors.
    pub fn lora_info(&self, name: &str) -> Option<crate::engine::lora::LoraInfo> {
        crate::engine::lora::lock(self.loras.as_ref()?).info(name)
    }

    /// Every loaded adapter, by name.
    pub fn loras(&self) -> Vec<crate::engine::lora::LoraInfo> {
        match &self.loras {
            Some(r) => crate::engine::lora::lock(r).list(),
            None => Vec::new(),
        }
    }

    /// Loads the PEFT adapter in `path` under `name` (reading and checking
    /// it takes a moment: call it off the async threads). Requests may
    /// name it as their model once this returns.
    pub fn load_lora(
        &self,
        name: &str,
        path: &std::path::Path,
    ) -> anyhow::Result<Arc<crate::engine::lora::LoadedLora>> {
        match &self.loras {
            Some(r) => crate::engine::lora::lock(r).load(name, path),
            None => {
                anyhow::bail!("LoRA adapters are not enabled; start the server with --enable-lora")
            }
        }
    }

    /// Forgets adapter `name`: new requests for it are refused, running
    /// ones finish. Whether it was loaded.
    pub fn unload_lora(&self, name: &str) -> bool {
        self.loras
            .as_ref()
            .is_some_and(|r| crate::engine::lora::lock(r).unload(name))
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The longest sequence the engine accepts.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// How the model pools, when it takes pooling requests (`--runner
    /// pooling`, or `--runner generate` with `--pooler-config`); `None` for
    /// a generation-only model.
    pub fn pooler(&self) -> Option<&Arc<crate::engine::pooling::PoolerConfig>> {
        self.pooler.as_ref()
    }

    /// Whether the model takes generation requests (false when it is
    /// served for pooling only).
    pub fn generates(&self) -> bool {
        self.generates
    }

    /// The model's hidden size: the length of its pooled vectors.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The model's structured-output compiler, built on first use (its
    /// token trie takes a moment for a large vocabulary, which servers that
    /// never constrain output should not pay). Blocks while it is built:
    /// call it off the async threads.
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, String> {
        self.grammar
            .get_or_init(|| {
                let started = Instant::now();
                let c =
                    GrammarCompiler::new(self.tokenizer.clone(), &self.eos_ids, self.vocab_size)
                        .map(Arc::new)
                        .map_err(|e| format!("{e:#}"));
                tracing::info!(
                    "structured output: token trie of {} tokens built in {:.0} ms",
                    self.vocab_size,
                    started.elapsed().as_secs_f64() * 1e3
                );
                c
            })
            .clone()
    }

    /// The counters as of the last step.
    pub fn stats(&self) -> EngineStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A guard that aborts the requests pushed into it unless disarmed.
    pub fn abort_guard(&self) -> AbortGuard {
        AbortGuard {
            tx: self.tx.clone(),
            ids: Vec::new(),
            done: false,
        }
    }

    /// Submits one sequence; its outputs arrive on `outputs`. Returns the
    /// engine id, or why the request was refused.
    ///
    /// The request is abortable from the moment the engine admits it: if
    /// this future is dropped before it returns (the client went away),
    /// the engine aborts the request, whether or not the id had arrived.
    pub async fn submit(
        &self,
        external_id: String,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        opts: RequestOptions,
        outputs: mpsc::UnboundedSender<StepOutput>,
    ) -> Result<u64, SubmitError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Add {
                external_id,
                prompt_ids,
                params,
                opts,
                outputs,
                reply,
                arrived: Instant::now(),
            })
            .map_err(|_| SubmitError::EngineDead)?;
        let mut pending = PendingAdd {
            rx: Some(rx),
            tx: self.tx.clone(),
        };
        let reply = match pending.rx.as_mut() {
            Some(rx) => rx.await,
            None => return Err(SubmitError::EngineDead),
        };
        pending.rx = None;
        match reply {
            Ok(r) => r.map_err(SubmitError::Invalid),
            Err(_) => Err(SubmitError::EngineDead),
        }
    }

    /// Aborts an engine request.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Empties the prefix cache between steps (vLLM's
    /// `reset_prefix_cache`). `Err(n)`: `n` blocks are held by running
    /// requests, and nothing changed; `None` if the engine is gone.
    pub async fn reset_prefix_cache(&self) -> Option<Result<(), usize>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::ResetPrefixCache(reply)).ok()?;
        rx.await.ok()
    }

    /// Stops the engine thread after its current step.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// A submission waiting for its engine id. Dropped before the id was
/// taken, it aborts the request if the engine already admitted it (the
/// engine aborts it itself if the id comes after the drop).
struct PendingAdd {
    rx: Option<oneshot::Receiver<Result<u64, ParamError>>>,
    tx: std_mpsc::Sender<Command>,
}

impl Drop for PendingAdd {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            if let Ok(Ok(id)) = rx.try_recv() {
                let _ = self.tx.send(Command::Abort(id));
            }
        }
    }
}

/// Why a submission failed.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Invalid(ParamError),
    #[error("the engine has stopped")]
    EngineDead,
}

/// Detokenizes the engine's outputs and sends each request its own, until
/// the engine thread ends. `stop` tells the engine which requests a stop
/// string ended.
fn output_loop(from_engine: std_mpsc::Receiver<ToOutput>, stop: std_mpsc::Sender<u64>) {
    let mut processor = OutputProcessor::default();
    let mut channels: HashMap<u64, mpsc::UnboundedSender<StepOutput>> = HashMap::new();
    while let Ok(msg) = from_engine.recv() {
        match msg {
            ToOutput::Add {
                id,
                detok,
                stop,
                outputs,
            } => {
                processor.add(id, detok, stop);
                channels.insert(id, outputs);
            }
            ToOutput::Outputs(list) => {
                for out in list {
                    let id = out.id;
                    let Some(p) = processor.process(out) else {
                        continue;
                    };
                    if p.abort_in_core {
                        let _ = stop.send(id);
                    }
                    let finished = p.output.finish_reason.is_some();
                    // A closed channel's client went away: its guard aborts
                    // the request in the engine.
                    if let Some(ch) = channels.get(&id) {
                        let _ = ch.send(p.output);
                    }
                    if finished {
                        channels.remove(&id);
                    }
                }
            }
        }
    }
}

fn engine_loop(
    mut core: EngineCore,
    rx: &std_mpsc::Receiver<Command>,
    stops: &std_mpsc::Receiver<u64>,
    to_output: &std_mpsc::Sender<ToOutput>,
    stats: Arc<Mutex<EngineStats>>,
    panic_at: Option<u64>,
    tracks: &mut HashMap<u64, Track>,
) -> anyhow::Result<()> {
    let mut last = core.stats();
    // Shown from the start under this engine's recorder, so that an extra
    // model's series exist before its first request (the main model's the
    // server sets up with the recorder; adding zero changes nothing).
    for name in [
        m::PROMPT_TOKENS,
        m::GENERATION_TOKENS,
        m::NUM_PREEMPTIONS,
        m::PREFIX_QUERIES,
        m::PREFIX_HITS,
        m::PREFIX_CACHE_QUERIES_GPU,
        m::PREFIX_CACHE_HITS_GPU,
    ] {
        metrics::counter!(name).increment(0);
    }
    if core.publishes_kv_events() {
        // Shown from the start, so a dashboard can tell 0 from absent.
        metrics::counter!(m::KV_EVENTS_DROPPED).increment(0);
    }
    // Tenants whose gauges are set: a tenant that leaves the engine gets
    // zeros once, then no more updates.
    let mut tenant_gauges: Vec<String> = Vec::new();
    // The adapters last reported, so the gauge changes only when they do.
    let max_loras = core
        .lora_registry()
        .map(|r| crate::engine::lora::lock(r).limits().max_loras);
    let mut lora_shown: Option<(Vec<String>, Vec<String>)> = None;
    loop {
        // Block only when there is nothing to run.
        let first = if core.has_unfinished() {
            rx.try_recv().ok()
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return Ok(()),
            }
        };
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Add {
                    external_id,
                    prompt_ids,
                    params,
                    opts,
                    outputs,
                    reply,
                    arrived,
                } => {
                    // A prompt counts once, whatever its number of samples.
                    let n = if opts.sample_index == 0 {
                        prompt_ids.len()
                    } else {
                        0
                    };
                    let tenant = crate::tenants::metric_label::of(&opts.tenant.name);
                    let detok = OutputProcessor::detokenizer(
                        core.tokenizer().clone(),
                        &prompt_ids,
                        &params,
                    );
                    let stop = StopStrings::of(&params);
                    tracing::debug!(
                        target: "pagoda::engine::step",
                        tenant = %tenant,
                        prompt = prompt_ids.len(),
                        waited_ms = arrived.elapsed().as_secs_f64() * 1e3,
                        "request in",
                    );
                    let r = core.add_request(external_id, prompt_ids, params, opts);
                    if let Ok(id) = r {
                        // Before any output of the request: the output
                        // thread takes messages in order.
                        let _ = to_output.send(ToOutput::Add {
                            id,
                            detok,
                            stop,
                            outputs,
                        });
                        let max_tokens = core.max_output_tokens(id).unwrap_or(0);
                        metrics::counter!(m::PROMPT_TOKENS).increment(n as u64);
                        metrics::counter!(m::TENANT_PROMPT_TOKENS, "tenant" => tenant.clone())
                            .increment(n as u64);
                        tracks.insert(
                            id,
                            Track {
                                arrived,
                                first_token: None,
                                last_token: None,
                                max_tokens,
                                tenant,
                            },
                        );
                    }
                    if let Err(Ok(id)) = reply.send(r) {
                        // The submitter went away while its request waited
                        // for this thread (its client disconnected): nobody
                        // holds the id to abort it, so it ends here rather
                        // than run to max_tokens for no one, outside every
                        // limit that counted it.
                        if let Some(out) = core.abort(id) {
                            finish(tracks, &out, None);
                            let _ = to_output.send(ToOutput::Outputs(vec![out]));
                        }
                    }
                }
                Command::Abort(id) => {
                    if let Some(out) = core.abort(id) {
                        finish(tracks, &out, None);
                        let _ = to_output.send(ToOutput::Outputs(vec![out]));
                    }
                }
                Command::ResetPrefixCache(reply) => {
                    let _ = reply.send(core.reset_prefix_cache());
                }
                Command::Shutdown => return Ok(()),
            }
            next = rx.try_recv().ok();
        }
        // Requests a stop string ended: the client has its last output.
        while let Ok(id) = stops.try_recv() {
            if let Some(out) = core.abort(id) {
                finish(tracks, &out, Some(FinishReason::Stop));
            }
        }
        if panic_at.is_some_and(|n| core.stats().steps + 1 >= n) && core.has_unfinished() {
            panic!("injected fault ({INJECT_PANIC_AT_STEP})");
        }
        let outputs = core.step()?;
        let now = Instant::now();
        for out in &outputs {
            if let Some(t) = tracks.get_mut(&out.id) {
                let n = out.new_token_ids.len() as u64;
                metrics::counter!(m::GENERATION_TOKENS).increment(n);
                metrics::counter!(m::TENANT_GENERATION_TOKENS, "tenant" => t.tenant.clone())
                    .increment(n);
                match t.last_token {
                    None => {
                        let ttft = (now - t.arrived).as_secs_f64();
                        tracing::debug!(
                            target: "pagoda::engine::step",
                            tenant = %t.tenant,
                            ttft_ms = ttft * 1e3,
                            "first token",
                        );
                        metrics::histogram!(m::TTFT).record(ttft);
                        metrics::histogram!(m::TENANT_TTFT, "tenant" => t.tenant.clone())
                            .record(ttft);
                        // Queue time ends when the scheduler first admits
                        // the request, not at its first token.
                        let scheduled = out.scheduled_at.unwrap_or(now);
                        let queued = secs_between(t.arrived, scheduled);
                        metrics::histogram!(m::QUEUE_TIME).record(queued);
                        metrics::histogram!(m::TENANT_QUEUE_TIME, "tenant" => t.tenant.clone())
                            .record(queued);
                        metrics::histogram!(m::PREFILL_TIME).record(secs_between(scheduled, now));
                        t.first_token = Some(now);
                    }
                    Some(prev) => {
                        let gap = (now - prev).as_secs_f64();
                        metrics::histogram!(m::ITL).record(gap);
                        metrics::histogram!(m::TPOT).record(gap);
                    }
                }
                t.last_token = Some(now);
            }
            if out.finish_reason.is_some() {
                finish(tracks, &out, None);
            }
        }
        if !outputs.is_empty() {
            let _ = to_output.send(ToOutput::Outputs(outputs));
        }
        let s = core.stats();
        metrics::gauge!(m::NUM_REQUESTS_RUNNING).set(s.num_running as f64);
        metrics::gauge!(m::NUM_REQUESTS_WAITING).set(s.num_waiting as f64);
        metrics::gauge!(m::KV_CACHE_USAGE).set(s.kv_usage);
        metrics::gauge!(m::GPU_CACHE_USAGE).set(s.kv_usage);
        metrics::gauge!(m::NUM_REQUESTS_SWAPPED).set(0.0);
        set_tenant_gauges(&core, &mut tenant_gauges);
        if let Some(max) = max_loras {
            set_lora_info(&core, max, &mut lora_shown);
        }
        if s.steps > last.steps {
            metrics::histogram!(m::ITERATION_TOKENS).record(s.last_step_tokens as f64);
        }
        metrics::counter!(m::NUM_PREEMPTIONS).increment(s.num_preemptions - last.num_preemptions);
        metrics::counter!(m::PREFIX_QUERIES).increment(s.prefix.queries - last.prefix.queries);
        metrics::counter!(m::PREFIX_HITS).increment(s.prefix.hits - last.prefix.hits);
        metrics::counter!(m::PREFIX_CACHE_QUERIES_GPU)
            .increment(s.prefix.queries - last.prefix.queries);
        metrics::counter!(m::PREFIX_CACHE_HITS_GPU).increment(s.prefix.hits - last.prefix.hits);
        if s.kv_events_dropped > last.kv_events_dropped {
            metrics::counter!(m::KV_EVENTS_DROPPED)
                .increment(s.kv_events_dropped - last.kv_events_dropped);
        }
        if s.spec.num_drafts > last.spec.num_drafts {
            let (now, was) = (&s.spec, &last.spec);
            metrics::counter!(m::SPEC_NUM_DRAFTS).increment(now.num_drafts - was.num_drafts);
            metrics::counter!(m::SPEC_NUM_DRAFT_TOKENS)
                .increment(now.num_draft_tokens - was.num_draft_tokens);
            metrics::counter!(m::SPEC_NUM_ACCEPTED_TOKENS)
                .increment(now.num_accepted_tokens - was.num_accepted_tokens);
            for pos in 0..now.num_positions {
                metrics::counter!(m::SPEC_ACCEPTED_PER_POS, "position" => POSITIONS[pos])
                    .increment(now.accepted_per_pos[pos] - was.accepted_per_pos[pos]);
            }
        }
        last = s;
        *stats.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }
}

/// Sets the per-tenant running and waiting gauges from the scheduler.
fn set_tenant_gauges(core: &EngineCore, shown: &mut Vec<String>) {
    let loads = core.tenant_loads();
    let mut now = Vec::with_capacity(loads.len());
    for l in loads {
        let label = crate::tenants::metric_label::of(&l.name);
        metrics::gauge!(m::TENANT_RUNNING, "tenant" => label.clone()).set(l.running as f64);
        metrics::gauge!(m::TENANT_WAITING, "tenant" => label.clone()).set(l.waiting as f64);
        now.push(label);
    }
    for gone in shown.iter().filter(|g| !now.contains(g)) {
        metrics::gauge!(m::TENANT_RUNNING, "tenant" => gone.clone()).set(0.0);
        metrics::gauge!(m::TENANT_WAITING, "tenant" => gone.clone()).set(0.0);
    }
    *shown = now;
    // Owners stay registered once seen, so these series never vanish.
    for (name, u) in core.kv_cache().owner_usage() {
        let label = crate::tenants::metric_label::of(&name);
        metrics::gauge!(m::TENANT_KV_BLOCKS, "tenant" => label.clone()).set(u.blocks as f64);
        metrics::gauge!(m::TENANT_KV_CACHED_BLOCKS, "tenant" => label.clone()).set(u.cached as f64);
        metrics::counter!(m::TENANT_KV_EVICTED_BY_OTHERS, "tenant" => label)
            .absolute(u.evicted_by_others);
    }
}

/// Sets `vllm:lora_requests_info` as vLLM does: one series whose labels
/// name the running and the waiting adapters (comma-separated) and
/// `max_lora`, whose value is when they were set; the previous series is
/// zeroed when they change.
fn set_lora_info(core: &EngineCore, max: usize, shown: &mut Option<(Vec<String>, Vec<String>)>) {
    let now = core.lora_load();
    if shown.as_ref() == Some(&now) {
        return;
    }
    let labels = |(running, waiting): &(Vec<String>, Vec<String>)| {
        [
            ("running_lora_adapters", running.join(",")),
            ("waiting_lora_adapters", waiting.join(",")),
            ("max_lora", max.to_string()),
        ]
    };
    if let Some(old) = shown.as_ref() {
        metrics::gauge!(m::LORA_REQUESTS_INFO, &labels(old)).set(0.0);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    metrics::gauge!(m::LORA_REQUESTS_INFO, &labels(&now)).set(t);
    *shown = Some(now);
}

/// Seconds from `a` to `b`, 0 if `b` is earlier.
fn secs_between(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64()
}

/// Records the metrics of a request that left the engine, finished for
/// `reason` (its output's own reason unless given).
fn finish(tracks: &mut HashMap<u64, Track>, out: &EngineCoreOutput, reason: Option<FinishReason>) {
    if let Some(t) = tracks.remove(&out.id) {
        let reason = reason
            .or(out.finish_reason)
            .unwrap_or(FinishReason::Abort)
            .as_str();
        metrics::counter!(m::REQUEST_SUCCESS, "finished_reason" => reason).increment(1);
        let now = Instant::now();
        metrics::histogram!(m::E2E).record((now - t.arrived).as_secs_f64());
        metrics::histogram!(m::REQUEST_PROMPT_TOKENS).record(out.num_prompt_tokens as f64);
        metrics::histogram!(m::REQUEST_GENERATION_TOKENS).record(out.num_output_tokens as f64);
        metrics::histogram!(m::REQUEST_MAX_GENERATION_TOKENS).record(t.max_tokens as f64);
        if let Some(scheduled) = out.scheduled_at {
            metrics::histogram!(m::INFERENCE_TIME).record(secs_between(scheduled, now));
        }
        if let (Some(first), Some(last)) = (t.first_token, t.last_token) {
            metrics::histogram!(m::DECODE_TIME).record(secs_between(first, last));
            if out.num_output_tokens > 1 {
                metrics::histogram!(m::REQUEST_TPOT)
                    .record(secs_between(first, last) / (out.num_output_tokens - 1) as f64);
            }
        }
    }
}
