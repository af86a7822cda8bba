//! `pagoda serve`: the OpenAI-compatible server, with `vllm serve`'s flags.

use super::EngineFlags;
use crate::server::openai::tool_parsers::ToolCallParser;
use crate::server::{serve, ServerConfig};
use anyhow::{bail, Result};
use clap::Args;
use std::time::Duration;

/// Flags of `pagoda serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model, as `vllm serve MODEL` takes it: a GGUF file or a Hugging
    /// Face folder (the same as --model; give one or the other).
    #[arg(value_name = "MODEL")]
    pub model_arg: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub engine: EngineFlags,
    /// `vllm serve` flags that change nothing here, accepted with a log line.
    #[command(flatten)]
    pub vllm: super::vllm_compat::VllmNoopFlags,
    /// Names the model is served under (default: the model path's file name);
    /// given again (or in --config too), the names add up.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// One more model served behind the same port on an engine of its own
    /// (an embedding model or a reranker beside a chat model): NAME=PATH,
    /// or a JSON object {"model": PATH, "served_model_name": NAME or
    /// [NAMES], "runner", "convert", "pooler_config", "hf_overrides",
    /// "tokenizer", "quantization", "dtype", "max_model_len",
    /// "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
    /// "gpu_memory_utilization"}. Unset fields take the main model's
    /// machine settings (device, threads, dtype, KV-cache size: each model
    /// gets a KV cache of that size) and the model's own defaults.
    /// Several after one flag, or the flag repeated, add up; a request's
    /// "model" picks one.
    #[arg(long, num_args = 1.., value_name = "SPEC")]
    pub extra_model: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API.
    #[arg(long, env = "PAGODA_API_KEY")]
    pub api_key: Option<String>,
    /// Seed for requests that do not give their own.
    #[arg(long)]
    pub seed: Option<u64>,
    /// No access-log line per request (vLLM's flag for uvicorn's log).
    #[arg(long)]
    pub disable_uvicorn_access_log: bool,
    /// Accepted as vLLM does; request details (prompt text) are off
    /// unless --enable-log-requests.
    #[arg(long)]
    pub disable_log_requests: bool,
    /// Add each request's prompt text (its first 500 characters) to its
    /// access-log line.
    #[arg(long)]
    pub enable_log_requests: bool,
    /// Split reasoning models' `<think>…</think>` into `reasoning_content`:
    /// deepseek_r1 or qwen3; openai_gptoss reads gpt-oss's harmony channels
    /// (implied by --tool-call-parser openai).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Accepted as older vLLM takes it; --reasoning-parser turns reasoning on.
    #[arg(long)]
    pub enable_reasoning: bool,
    /// Send usage with every response, as vLLM's flag does: a streamed
    /// completion or chat ends with its usage chunk even when the request
    /// did not ask for `stream_options.include_usage`.
    #[arg(long)]
    pub enable_force_include_usage: bool,
    /// Name every token of a response's logprobs `token_id:{id}`, as
    /// vLLM's flag does (a request's `return_tokens_as_token_ids` also
    /// asks for it).
    #[arg(long)]
    pub return_tokens_as_token_ids: bool,
    /// Token ids in, token ids out, as vLLM's flag does: prompts must be
    /// token ids (completions only; chat, Responses and the tokenizer
    /// endpoints need the tokenizer and are refused), and outputs carry
    /// `token_ids` with empty text. Stop strings, bad words, echo and
    /// structured output, which need text, are refused.
    #[arg(long)]
    pub skip_tokenizer_init: bool,
    /// A chat template (a file, or the template itself) used instead of
    /// the model's own.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// How tenants appear in the per-tenant metrics' `tenant` label: hash
    /// (a salted hash; the admin API gives each tenant's), id, or none
    /// (one series for all).
    #[arg(long, default_value = "hash")]
    pub metrics_tenant_label: String,
    /// Serve /metrics (and the health probes) on this port instead of the
    /// API port, for clusters that keep metrics off the public address.
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// How log lines are written: text, or json (one object per line, for
    /// log pipelines).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Tensor-parallel degree (only 1 is built so far).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline-parallel degree (only 1 is built so far).
    #[arg(long, default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// Requests in flight beyond this get a 429.
    #[arg(long, default_value_t = 1024)]
    pub max_pending_requests: usize,
    /// Largest request body, in bytes; larger ones get a 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Client connections served at once (beyond them, health probes are
    /// answered at once and other requests wait briefly for a slot, which
    /// idle and stalled connections give up); default: from the
    /// open-files limit, at most 16384.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds a client may take to send a request's head (idle
    /// keep-alive connections are closed after it too).
    #[arg(long, default_value_t = 10)]
    pub header_timeout_seconds: u64,
    /// Seconds SIGTERM waits for requests in flight.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_seconds: u64,
    /// Seconds the start-up warm-up forward may take before readiness fails.
    #[arg(long, default_value_t = 600)]
    pub ready_timeout_seconds: u64,
    /// Token of the admin API (tenants, plugins); admin routes answer 404 without one.
    #[arg(long, env = "PAGODA_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// Serve the admin API on its own address (with --admin-port).
    #[arg(long)]
    pub admin_host: Option<String>,
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// Where tenants and plugin versions persist across restarts; with
    /// --state-store, the local cache of the shared state.
    #[arg(long)]
    pub state_dir: Option<std::path::PathBuf>,
    /// Tenant and plugin state shared by replicas: s3://bucket/prefix,
    /// gs://bucket/prefix, az://container/prefix or file:///path
    /// (credentials from the environment, as each cloud's SDK names them).
    #[arg(long, env = "PAGODA_STATE_STORE", requires = "state_dir")]
    pub state_store: Option<String>,
    /// How often a replica reads the shared state store for changes made
    /// through other replicas.
    #[arg(long, default_value_t = 5.0)]
    pub state_poll_seconds: f64,
    /// The largest fraction of the tenants one poll of the state store may
    /// find gone and drop; a poll that would drop more (or every tenant)
    /// is held as a suspected store fault until the tenants come back or
    /// an admin confirms (POST /admin/v1/state-store/confirm-drop).
    #[arg(long, default_value_t = 0.5)]
    pub state_store_max_drop_fraction: f64,
    /// Meter plugin calls with fuel (tenants set the fuel per call in plugin_limits.fuel).
    #[arg(long)]
    pub plugin_fuel: bool,
    /// Plugin instances alive at once, across all requests.
    #[arg(long, default_value_t = 256)]
    pub plugin_max_instances: u32,
    /// One usage record (JSON line) per finished request, for billing: a
    /// local file, or s3://bucket/prefix, gs://…, az://… or file:///dir
    /// (records then wait in --usage-log-spool and are put in batches).
    /// A record is on disk before its response's last bytes are sent.
    #[arg(long, env = "PAGODA_USAGE_LOG")]
    pub usage_log: Option<String>,
    /// Where records for an object-store --usage-log wait until the store
    /// has them (default: usage-spool under --state-dir).
    #[arg(long)]
    pub usage_log_spool: Option<std::path::PathBuf>,
    /// How often spooled usage records are put to the store.
    #[arg(long, default_value_t = 2.0)]
    pub usage_log_flush_seconds: f64,
    /// Let the model decide when to call tools (`tool_choice: "auto"`),
    /// parsing its output with --tool-call-parser.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// How the model writes tool calls: hermes (Qwen2.5, Hermes),
    /// llama3_json, mistral or pythonic.
    #[arg(long)]
    pub tool_call_parser: Option<String>,
}

/// The reasoning parser the flags ask for. gpt-oss's tool calls are read
/// from its harmony output, whose reasoning channel the `openai_gptoss`
/// parser takes apart: `--tool-call-parser openai` implies it (vLLM reads
/// any gpt-oss output as harmony), and refuses another.
fn reasoning_parser(
    a: &ServeArgs,
    tools: Option<ToolCallParser>,
) -> Result<Option<crate::server::openai::reasoning::ReasoningParser>> {
    use crate::server::openai::reasoning::ReasoningParser;
    let parser: Option<ReasoningParser> =
        a.reasoning_parser.as_deref().map(str::parse).transpose()?;
    if tools != Some(ToolCallParser::OpenAi) {
        return Ok(parser);
    }
    match parser {
        None => Ok(Some(ReasoningParser::GptOss { calls: false })),
        Some(p) if p.is_harmony() => Ok(Some(p)),
        Some(p) => bail!(
            "--tool-call-parser openai reads gpt-oss's harmony output, which --reasoning-parser {} cannot split; use --reasoning-parser openai_gptoss or leave it out",
            p.name()
        ),
    }
}

/// The `tool_choice: "auto"` parser the flags ask for.
fn auto_tool_parser(a: &ServeArgs) -> Result<Option<ToolCallParser>> {
    let parser = a
        .tool_call_parser
        .as_deref()
        .map(ToolCallParser::from_name)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--tool-call-parser: {e}"))?;
    match (a.enable_auto_tool_choice, parser) {
        (true, None) => bail!(
            "--enable-auto-tool-choice needs --tool-call-parser ({}) to read the model's tool calls",
            ToolCallParser::NAMES.join(", ")
        ),
        (true, p) => Ok(p),
        (false, Some(_)) => bail!(
            "--tool-call-parser is only used with --enable-auto-tool-choice; add that flag or drop the parser"
        ),
        (false, None) => Ok(None),
    }
}

/// Rejects flags whose feature is not built yet, instead of ignoring them.
fn check_unbuilt(a: &ServeArgs) -> Result<()> {
    if a.tensor_parallel_size != 1 {
        bail!("--tensor-parallel-size {} is not supported yet: this build runs one device context (use 1)", a.tensor_parallel_size);
    }
    if a.pipeline_parallel_size != 1 {
        bail!("--pipeline-parallel-size {} is not supported yet: this build runs one device context (use 1)", a.pipeline_parallel_size);
    }
    Ok(())
}

/// Runs `pagoda serve`.
pub fn run(mut a: ServeArgs) -> Result<()> {
    match (a.model_arg.take(), &a.engine.model) {
        (Some(m), None) => a.engine.model = Some(m),
        (Some(m), Some(flag)) => bail!(
            "the model is given twice, as MODEL ({}) and as --model ({}); give it once",
            m.display(),
            flag.display()
        ),
        (None, Some(_)) => {}
        (None, None) => {
            bail!("no model given: `pagoda serve MODEL` or `pagoda serve --model MODEL`")
        }
    }
    check_unbuilt(&a)?;
    a.vllm.check_and_log()?;
    if a.disable_log_requests {
        if a.enable_log_requests {
            tracing::info!("--disable-log-requests: request prompts are not logged, whatever --enable-log-requests says");
        } else {
            tracing::info!("--disable-log-requests: accepted; request prompts are logged only with --enable-log-requests");
        }
    }
    let label: crate::tenants::metric_label::TenantLabel = a.metrics_tenant_label.parse()?;
    crate::tenants::metric_label::configure(label);
    let auto_tool_parser = auto_tool_parser(&a)?;
    let reasoning_parser = reasoning_parser(&a, auto_tool_parser)?;
    let mut engine = a.engine.to_engine_args()?;
    engine.seed = a.seed;
    let extra_models = a
        .extra_model
        .iter()
        .map(|spec| super::extra_model::parse(spec, &a.engine, a.seed))
        .collect::<Result<Vec<_>>>()?;
    engine.chat_template = a.chat_template.clone();
    let names = if a.served_model_name.is_empty() {
        let model = engine.model.clone();
        vec![model
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| model.display().to_string())]
    } else {
        a.served_model_name.clone()
    };
    let usage_log = match a.usage_log.clone() {
        None => None,
        Some(target) => {
            if !(a.usage_log_flush_seconds.is_finite() && a.usage_log_flush_seconds > 0.0) {
                anyhow::bail!(
                    "--usage-log-flush-seconds {} must be a positive number of seconds",
                    a.usage_log_flush_seconds
                );
            }
            Some(crate::metering::UsageLogConfig {
                target,
                spool: a
                    .usage_log_spool
                    .clone()
                    .or_else(|| a.state_dir.as_ref().map(|d| d.join("usage-spool"))),
                flush: Duration::from_secs_f64(a.usage_log_flush_seconds),
            })
        }
    };
    serve(
        engine,
        ServerConfig {
            host: a.host,
            port: a.port,
            served_model_names: names,
            extra_models,
            api_key: a.api_key,
            max_body_bytes: a.max_body_bytes,
            connections: crate::server::connections::ConnectionLimits {
                max_connections: a.max_connections,
                header_timeout: Duration::from_secs(a.header_timeout_seconds.max(1)),
            },
            max_pending_requests: a.max_pending_requests,
            shutdown_grace: Duration::from_secs(a.shutdown_grace_seconds),
            ready_timeout: Duration::from_secs(a.ready_timeout_seconds),
            admin_token: a.admin_token,
            admin_addr: match (a.admin_host, a.admin_port) {
                (None, None) => None,
                (h, p) => Some((h.unwrap_or_else(|| "127.0.0.1".into()), p.unwrap_or(8001))),
            },
            state_dir: a.state_dir,
            state_store: a.state_store,
            state_store_max_drop_fraction: a.state_store_max_drop_fraction,
            state_poll: {
                if !(a.state_poll_seconds.is_finite() && a.state_poll_seconds > 0.0) {
                    anyhow::bail!(
                        "--state-poll-seconds {} must be a positive number of seconds",
                        a.state_poll_seconds
                    );
                }
                std::time::Duration::from_secs_f64(a.state_poll_seconds)
            },
            plugins: crate::plugins::RuntimeConfig {
                fuel: a.plugin_fuel,
                max_instances: a.plugin_max_instances,
                ..Default::default()
            },
            auto_tool_parser,
            metrics_port: a.metrics_port,
            force_include_usage: a.enable_force_include_usage,
            return_tokens_as_token_ids: a.return_tokens_as_token_ids,
            max_logprobs: a.vllm.max_logprobs_limit(),
            skip_tokenizer_init: a.skip_tokenizer_init,
            reasoning_parser,
            usage_log,
            access_log: crate::server::access_log::AccessLogConfig {
                enabled: !a.disable_uvicorn_access_log,
                log_prompts: a.enable_log_requests && !a.disable_log_requests,
            },
        },
    )
}
