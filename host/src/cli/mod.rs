//! The `pagoda` command line: `generate`, `models` (and later `serve`,
//! `bench`). Flags mirror `vllm serve` where vLLM has them.

pub mod bench;
pub mod config_file;
pub mod extra_model;
pub mod generate;
pub mod models;
pub mod serve;
pub mod vllm_compat;

use crate::engine::args::{parse_bytes, EngineArgs};
use crate::engine::generation_config::GenerationConfigSource;
use crate::engine::kv_cache::KvCacheDtype;
use crate::engine::loader::hf_quant::QuantizationArg;
use crate::engine::loader::DType;
use crate::engine::scheduler::SchedulingPolicy;
use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Pagoda: a multi-tenant LLM inference server.
#[derive(Parser, Debug)]
#[command(name = "pagoda", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Whether log lines are JSON objects (`serve --log-format json`).
    pub fn log_json(&self) -> bool {
        matches!(&self.command, Command::Serve(s) if s.log_format == "json")
    }

    /// Parses the command line, a flag given again overriding its earlier
    /// value: `--config FILE` puts the file's flags first, so flags on the
    /// command line win, and wrappers like scripts/demo.sh pass defaults
    /// that a user's `--port 9000` replaces. Exits on bad flags (with
    /// clap's message), as `Parser::parse_from` does.
    /// vLLM's underscore spellings (`--max_model_len`) are taken too.
    pub fn parse_overridable(args: Vec<std::ffi::OsString>) -> Cli {
        Self::try_parse_overridable(args).unwrap_or_else(|e| e.exit())
    }

    /// [`Cli::parse_overridable`] without exiting: clap's error instead.
    pub fn try_parse_overridable(args: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        fn overridable(c: clap::Command) -> clap::Command {
            c.args_override_self(true).mut_subcommands(overridable)
        }
        let args = vllm_compat::dash_flag_names(args);
        let matches = overridable(Cli::command()).try_get_matches_from(args)?;
        Cli::from_arg_matches(&matches)
    }
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text for one or more prompts, batched, and print it.
    Generate(generate::GenerateArgs),
    /// Serve the OpenAI-compatible API.
    Serve(serve::ServeArgs),
    /// List the supported model architectures.
    Models,
    /// Measure throughput and latency.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// The flags that shape the engine, shared by `generate`, `serve` and `bench`.
#[derive(Args, Debug, Clone)]
pub struct EngineFlags {
    /// A GGUF file or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json).
    /// `serve` also takes it as its first argument, as `vllm serve` does.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A GGUF file or Hugging Face folder whose tokenizer is used instead
    /// of the model's own (its ids must fit the model's vocabulary).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// How the weights are read, as vLLM names it: auto (the model's
    /// form), gguf (a GGUF file) or safetensors (a Hugging Face folder);
    /// others are refused.
    #[arg(long, default_value = "auto")]
    pub load_format: String,
    /// auto (a CUDA GPU if the driver finds one, else the CPU), cpu, cuda,
    /// rocm or npu.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Fraction of accelerator memory for weights, activations and the KV
    /// cache (accelerators only; default 0.9).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f32>,
    /// Weight dtype for float weights: auto, float32, bfloat16, float16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Longest sequence (prompt + output); defaults to the model's context length.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// CPU threads (default: every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tokens per KV block: a power of two up to 256.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size, such as 4GiB (default: a quarter of free memory, at most 4 GiB).
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// KV cache element type: auto (the model's dtype, as in vLLM: f32,
    /// bf16 or f16 for float weights, f16 for quantized ones), bf16, f16,
    /// f32.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Most sequences running at once (default: 64 on the CPU, where
    /// batched throughput has saturated; 256 on accelerators).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Most tokens in one step (prefill chunks plus decodes).
    #[arg(long, default_value_t = crate::engine::args::DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    /// Reuse the KV of shared prompt prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// fair (weighted fair share between tenants, by each tenant's
    /// `scheduling` config; first come first served within a tenant),
    /// fcfs (first come first served, whoever the tenant), or priority (a
    /// request's `priority` field orders the queue).
    #[arg(long, default_value = "fair")]
    pub scheduling_policy: String,
    /// Under fair share, while tenants contend: the most prompt tokens
    /// one tenant's prefills add to a step, so that a step another tenant
    /// waits on stays short (0: a quarter of --max-num-batched-tokens).
    #[arg(long, default_value_t = 0)]
    pub tenant_prefill_chunk: usize,
    /// Under fair share, while tenants contend: the most tokens of any
    /// kind (decodes and prefill chunks) one tenant adds to a step per unit
    /// of its weight; its streams beyond it decode in turns, so the step a
    /// calm tenant's first token waits for stays short (0: no such bound;
    /// default 8 on the CPU, none on accelerators).
    #[arg(long)]
    pub tenant_step_tokens: Option<usize>,
    /// Defaults for sampling parameters a request leaves unset: auto (the
    /// model folder's generation_config.json), vllm (vLLM's own defaults),
    /// or a folder holding a generation_config.json.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// The weights' quantization, as vLLM names it: gguf, gptq, awq,
    /// compressed-tensors, ascend (ModelSlim), w8a8 (the folder's int8
    /// format), or int8 (quantize a float checkpoint at load). Omitted, the
    /// model's own is used; given, it must match the model.
    #[arg(long)]
    pub quantization: Option<String>,
    /// Speculative decoding, as vLLM configures it: a JSON object such as
    /// {"method": "ngram", "num_speculative_tokens": 4} (keys: method,
    /// model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max,
    /// draft_sample_method, disable_by_batch_size).
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// The seed's form of a draft model ("[ngram]" for prompt lookup);
    /// needs --num-speculative-tokens.
    #[arg(long)]
    pub speculative_model: Option<String>,
    /// Drafts per sequence and step, with --speculative-model.
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
    /// KV-cache events for prefix-aware routers, as vLLM configures them:
    /// a JSON object such as {"enable_kv_cache_events": true, "publisher":
    /// "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
    /// "tcp://*:5558", "topic": "kv@pod@model"} (also buffer_steps, hwm).
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Serve LoRA adapters on the base model (vLLM's multi-LoRA): requests
    /// name an adapter as their "model".
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters to load at start-up, as vLLM takes them: name=path, or a
    /// JSON object {"name": ..., "path": ..., "base_model_name": ...};
    /// several after one flag, or the flag repeated.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// Distinct adapters in one step (their device slots).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// The largest adapter rank accepted; larger adapters are refused.
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Adapters whose factors stay in host memory (at least --max-loras):
    /// the least recently used idle ones beyond are dropped and read again
    /// from their folder when a request names them. Unset: all stay.
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// The adapters' factors in memory: auto (the base's own float type, or
    /// bfloat16 beside a quantized base), bfloat16, float16 or float32.
    /// Arithmetic is f32 either way; half types halve what a decode step
    /// streams per adapter.
    #[arg(long, default_value = "auto", value_parser = parse_lora_dtype)]
    pub lora_dtype: crate::engine::lora::LoraDtype,
    /// What the model is served for, as vLLM's --runner: generate,
    /// pooling (embeddings on /v1/embeddings), or auto (pooling when the
    /// checkpoint is a headless `*Model` or has sentence-transformers'
    /// modules.json).
    #[arg(long, default_value = "auto")]
    pub runner: String,
    /// How a generative checkpoint becomes a pooling model, as vLLM's
    /// --convert: auto, embed (its last hidden states) or classify.
    #[arg(long, default_value = "auto")]
    pub convert: String,
    /// The pooler over the model's own (1_Pooling, 2_Normalize), as vLLM's
    /// JSON: {"pooling_type": "LAST", "normalize": true}.
    #[arg(long)]
    pub pooler_config: Option<String>,
    /// vLLM's JSON over the model's config.json; only the Qwen3-Reranker
    /// form is implemented: {"architectures":
    /// ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
    /// "yes"], "is_original_qwen3_reranker": true}.
    #[arg(long)]
    pub hf_overrides: Option<String>,
}

fn parse_lora_dtype(s: &str) -> Result<crate::engine::lora::LoraDtype> {
    crate::engine::lora::LoraDtype::parse(s)
}

/// One `--lora-modules` entry: `name=path`, or vLLM's JSON form.
fn parse_lora_module(s: &str) -> Result<(String, std::path::PathBuf)> {
    if s.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(s)
            .map_err(|e| anyhow::anyhow!("--lora-modules {s}: not valid JSON: {e}"))?;
        let field = |k: &str| v.get(k).and_then(serde_json::Value::as_str);
        let (Some(name), Some(path)) = (field("name"), field("path")) else {
            bail!("--lora-modules {s}: the JSON form needs \"name\" and \"path\"");
        };
        return Ok((name.to_string(), path.into()));
    }
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.into()))
        }
        _ => bail!("--lora-modules {s}: expected name=path or a JSON object"),
    }
}

impl EngineFlags {
    /// Turns the flags into engine arguments, rejecting bad values.
    pub fn to_engine_args(&self) -> Result<EngineArgs> {
        let Some(model) = &self.model else {
            bail!("no model given: pass --model PATH (a GGUF file or a Hugging Face folder)");
        };
        check_load_format(&self.load_format, model)?;
        let mut a = EngineArgs::new(model);
        a.tokenizer = self.tokenizer.clone();
        a.device = self.device.parse()?;
        if let Some(u) = self.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                bail!("--gpu-memory-utilization must be in (0, 1], got {u}");
            }
            if a.device == pagoda_accel::Device::Cpu {
                // vLLM command lines carry it whatever the device: warn, as
                // it changes nothing on the CPU.
                tracing::warn!("--gpu-memory-utilization {u} applies to GPUs only and is ignored: --device {} runs on the CPU, where --kv-cache-memory (e.g. 4GiB) sizes the KV cache", self.device);
            }
            a.gpu_memory_utilization = u;
        }
        a.dtype = self.dtype.parse::<DType>()?;
        a.quantization = self
            .quantization
            .as_deref()
            .map(str::parse::<QuantizationArg>)
            .transpose()?;
        a.max_model_len = self.max_model_len;
        a.threads = self.threads;
        a.block_size = self.block_size;
        a.kv_cache_memory = self
            .kv_cache_memory
            .as_deref()
            .map(parse_bytes)
            .transpose()?;
        a.kv_cache_dtype = self.kv_cache_dtype.parse::<KvCacheDtype>()?;
        a.max_num_seqs = self.max_num_seqs.unwrap_or(match a.device {
            pagoda_accel::Device::Cpu => crate::engine::args::DEFAULT_MAX_NUM_SEQS_CPU,
            _ => crate::engine::args::DEFAULT_MAX_NUM_SEQS_ACCELERATOR,
        });
        a.max_num_batched_tokens = self.max_num_batched_tokens;
        a.enable_prefix_caching = !self.no_enable_prefix_caching;
        a.scheduling_policy = self.scheduling_policy.parse::<SchedulingPolicy>()?;
        a.tenant_prefill_chunk = self.tenant_prefill_chunk;
        a.tenant_step_tokens = self.tenant_step_tokens.unwrap_or(match a.device {
            pagoda_accel::Device::Cpu => crate::engine::args::DEFAULT_TENANT_STEP_TOKENS_CPU,
            _ => 0,
        });
        a.generation_config = self.generation_config.parse::<GenerationConfigSource>()?;
        a.kv_events = self
            .kv_events_config
            .as_deref()
            .map(crate::engine::kv_events::KvEventsConfig::from_json)
            .transpose()?
            .flatten();
        a.speculative = crate::engine::spec_decode::SpeculativeConfig::from_flags(
            self.speculative_config.as_deref(),
            self.speculative_model.as_deref(),
            self.num_speculative_tokens,
        )?;
        a.runner = crate::engine::pooling::RunnerKind::parse(&self.runner)?;
        a.convert = crate::engine::pooling::ConvertKind::parse(&self.convert)?;
        a.pooler_config = self.pooler_config.clone();
        a.hf_overrides = self.hf_overrides.clone();
        if !self.enable_lora && !self.lora_modules.is_empty() {
            bail!("--lora-modules needs --enable-lora");
        }
        if self.enable_lora {
            if self.max_loras == 0 {
                bail!("--max-loras must be at least 1");
            }
            if let Some(c) = self.max_cpu_loras {
                if c < self.max_loras {
                    bail!(
                        "--max-cpu-loras ({c}) must be at least --max-loras ({})",
                        self.max_loras
                    );
                }
            }
            a.lora = Some(crate::engine::lora::LoraArgs {
                max_loras: self.max_loras,
                max_lora_rank: self.max_lora_rank,
                dtype: self.lora_dtype,
                max_cpu_loras: self.max_cpu_loras,
                modules: self
                    .lora_modules
                    .iter()
                    .map(|m| parse_lora_module(m))
                    .collect::<Result<_>>()?,
            });
        }
        Ok(a)
    }
}

/// `--load-format`: vLLM's names for the forms Pagoda reads are accepted
/// when they match the model; others (`dummy` weights, `pt` files, …)
/// would change results or cannot be read, and are refused.
fn check_load_format(format: &str, model: &std::path::Path) -> Result<()> {
    let is_dir = model.is_dir();
    match format {
        "auto" => {}
        "gguf" if !is_dir => {
            tracing::info!("--load-format gguf: the model is a GGUF file, as Pagoda reads it");
        }
        "safetensors" if is_dir => {
            tracing::info!("--load-format safetensors: the model folder's *.safetensors are read, as Pagoda reads them");
        }
        "gguf" | "safetensors" => bail!(
            "--load-format {format} does not match the model {}: it is {}; use --load-format auto",
            model.display(),
            if is_dir { "a folder (safetensors)" } else { "a file (gguf)" }
        ),
        other => bail!(
            "--load-format {other} is not supported: Pagoda reads GGUF files (gguf) and Hugging Face folders of *.safetensors (safetensors); use auto"
        ),
    }
    Ok(())
}

/// Runs the command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(b) => bench::run(b),
        Command::Serve(a) => serve::run(a),
        Command::Models => {
            models::run();
            Ok(())
        }
    }
}
