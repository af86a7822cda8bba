//! Engine arguments (the `vllm serve` flags that shape the engine) and the
//! start-up sequence that turns them into a running [`EngineCore`]: load
//! the model and tokenizer, size the KV pool, wire the parts together.

use crate::engine::config::ModelConfig;
use crate::engine::core::EngineCore;
use crate::engine::generation_config::{self, GenerationConfig, GenerationConfigSource};
use crate::engine::kv_cache::{KvCacheDtype, KvCacheManager};
use crate::engine::kv_events::{KvEventPublisher, KvEventsConfig};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::gguf_weights::GgufWeights;
use crate::engine::loader::hf_quant::QuantizationArg;
use crate::engine::loader::safetensors::SafetensorsSource;
use crate::engine::loader::DType;
use crate::engine::models::{self, CausalLm, Model, Workspace};
use crate::engine::runner::{ModelExecutor, ModelRunner};
use crate::engine::scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
use crate::engine::spec_decode::draft_model::DraftModel;
use crate::engine::spec_decode::{SpecMethod, SpeculativeConfig, Speculator};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use pagoda_accel::{Backend, CpuBackend, Device, KvSpec, StepBatch};
use std::path::PathBuf;
use std::sync::Arc;

/// The default token budget of one step. On a CPU a step's time grows with
/// its tokens, so the budget bounds how long running decodes wait behind a
/// prefill chunk, and it lets prompts that arrive together finish their
/// prefill one after another instead of all at the end of one long step.
/// Measured on the 2-core Xeon VM, SmolLM2 Q4_1, `pagoda bench serve` at 16
/// concurrent (64 requests of 128 in / 128 out), budgets 2048 / 512 / 256:
/// TTFT p50 1437 / 522 / 352 ms, output 423 / 459 / 480 tok/s; offline
/// (`pagoda bench throughput`, 16 × 128/128) 529 / 516 / 530 tok/s, and a
/// 1024-token prompt alone 1664 / 1567 / 1594 tok/s. 512 keeps long prompts
/// in few chunks while getting most of the TTFT gain.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 512;

/// Everything that decides how the engine is built.
#[derive(Clone, Debug)]
pub struct EngineArgs {
    /// A GGUF file or an HF model folder.
    pub model: PathBuf,
    pub device: Device,
    /// Fraction of an accelerator's memory the engine may use for weights,
    /// activations and the KV pool (`--gpu-memory-utilization`); the KV pool
    /// gets what the weights and a profile forward leave. Unused on the CPU.
    pub gpu_memory_utilization: f32,
    pub dtype: DType,
    /// `--quantization`: checked against the model, or `int8` to quantize
    /// a float checkpoint at load.
    pub quantization: Option<QuantizationArg>,
    /// `--chat-template`: a file holding a chat template, or the template
    /// itself, used instead of the model's.
    pub chat_template: Option<String>,
    /// `--tokenizer`: a GGUF file or HF folder whose tokenizer is used
    /// instead of the model's own.
    pub tokenizer: Option<PathBuf>,
    /// Defaults to the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// CPU threads; 0 means every core.
    pub threads: usize,
    pub block_size: usize,
    /// KV pool size in bytes; defaults to a share of free memory.
    pub kv_cache_memory: Option<u64>,
    pub kv_cache_dtype: KvCacheDtype,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
    pub scheduling_policy: SchedulingPolicy,
    /// Under fair share, while tenants contend: the most prompt tokens one
    /// tenant's prefills add to a step (0: a quarter of the step budget).
    pub tenant_prefill_chunk: usize,
    /// Under fair share, while tenants contend: the most tokens of any kind
    /// one tenant adds to a step per unit of weight, its streams decoding in
    /// turns beyond it (0: no such bound; by default
    /// [`DEFAULT_TENANT_STEP_TOKENS_CPU`] on the CPU).
    pub tenant_step_tokens: usize,
    /// Seed for requests that give none (each request's RNG is derived
    /// from it and the request id); `None` seeds from the OS.
    pub seed: Option<u64>,
    /// Where the defaults for unset sampling parameters come from
    /// (`--generation-config`: the model folder's `generation_config.json`
    /// by default).
    pub generation_config: GenerationConfigSource,
    /// Speculative decoding (`--speculative-config`), if on.
    pub speculative: Option<SpeculativeConfig>,
    /// KV-cache events for prefix-aware routers (`--kv-events-config`),
    /// if on.
    pub kv_events: Option<KvEventsConfig>,
    /// LoRA adapters (`--enable-lora` and its flags), if on.
    pub lora: Option<crate::engine::lora::LoraArgs>,
    /// `--runner`: generation, pooling, or what the model's files say.
    pub runner: crate::engine::pooling::RunnerKind,
    /// `--convert`: how a generative checkpoint becomes a pooling model.
    pub convert: crate::engine::pooling::ConvertKind,
    /// `--pooler-config`: vLLM's JSON over the model's own pooling.
    pub pooler_config: Option<String>,
    /// `--hf-overrides`: vLLM's JSON over config.json (the Qwen3-Reranker
    /// form only, see [`crate::engine::pooling::token_head_from_overrides`]).
    pub hf_overrides: Option<String>,
}

/// `--max-num-seqs` on the CPU when the flag is not given: where batched
/// throughput stops rising, measured rather than copied from GPUs. On the
/// 2-core Sapphire Rapids Xeon (demo model, `bench/cpu-max-num-seqs.sh`,
/// docs/benchmarks.md), output tok/s at 2 / 4 / 8 / 16 / 32 / 64 / 128
/// sequences was 223 / 396 / 571 / 762 / 835 / 894 / 905: 64 reaches 98% of
/// the peak, and every sequence beyond only lengthens each step, and with it
/// every tenant's time to first token.
pub const DEFAULT_MAX_NUM_SEQS_CPU: usize = 64;

/// `--tenant-step-tokens` on the CPU when the flag is not given: while
/// tenants contend, each adds at most this many tokens per unit of weight
/// to a step. A CPU step's time grows with every row (on the EPYC, demo
/// model, 2 threads: 3.8 ms for one decode row, 15.5 ms for nine, ~1.3 ms a
/// row), so a flood's 32 decode rows make the step a calm tenant's first
/// token waits for several times its own prefill. With 8 (`bench/isolation.sh`,
/// docs/benchmarks.md) that tenant's TTFT beside 32 flooding streams was
/// 1.31x its TTFT alone for 128-token prompts (1.9-2.1x without a bound), and
/// the flood itself decoded faster (420 against 310-340 tok/s: on the CPU
/// nine-row steps cost no more per row than 32-row ones). GPUs run a step's
/// rows in parallel, so there it stays off.
pub const DEFAULT_TENANT_STEP_TOKENS_CPU: usize = 8;

/// Speculative decoding pauses while more sequences than this run, unless
/// `disable_by_batch_size` says otherwise. A larger batch is compute-bound,
/// so every verified draft costs nearly what a decoded token does.
pub const DEFAULT_SPEC_MAX_BATCH: usize = 8;

/// `--max-num-seqs` on accelerators when the flag is not given (vLLM's).
pub const DEFAULT_MAX_NUM_SEQS_ACCELERATOR: usize = 256;

impl EngineArgs {
    /// Defaults for `model`, as `vllm serve` would pick them (on the CPU:
    /// [`DEFAULT_MAX_NUM_SEQS_CPU`] sequences).
    pub fn new(model: impl Into<PathBuf>) -> EngineArgs {
        EngineArgs {
            model: model.into(),
            device: Device::Cpu,
            gpu_memory_utilization: 0.9,
            dtype: DType::Auto,
            quantization: None,
            chat_template: None,
            tokenizer: None,
            max_model_len: None,
            threads: 0,
            block_size: 16,
            kv_cache_memory: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS_CPU,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            enable_prefix_caching: true,
            scheduling_policy: SchedulingPolicy::Fair,
            tenant_prefill_chunk: 0,
            tenant_step_tokens: DEFAULT_TENANT_STEP_TOKENS_CPU,
            seed: None,
            generation_config: GenerationConfigSource::Auto,
            speculative: None,
            kv_events: None,
            lora: None,
            runner: Default::default(),
            convert: Default::default(),
            pooler_config: None,
            hf_overrides: None,
        }
    }
}

/// The model and its tokenizer, loaded from a GGUF file or an HF folder.
pub struct LoadedModel {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub source: LoadedFrom,
    /// The `generation_config.json` that `--generation-config` selects, if
    /// any: the defaults for what requests leave unset.
    pub generation_config: Option<GenerationConfig>,
    /// Tensors of the checkpoint that the model did not use (Hugging Face
    /// folders), reported in one start-up warning.
    pub unused_tensors: Vec<String>,
}

/// Which format the model came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadedFrom {
    Gguf,
    HuggingFace,
}

/// Loads the model weights (onto `backend`'s device), config and tokenizer
/// named by `args`.
pub fn load_model<B: Backend>(
    backend: &B,
    args: &EngineArgs,
    max_positions: impl Fn(&ModelConfig) -> usize,
) -> Result<(Model<B>, LoadedModel)> {
    let path = &args.model;
    if !path.exists() {
        bail!(
            "{}: no such file or directory (give a GGUF file or a Hugging Face model folder)",
            path.display()
        );
    }
    // Read before the weights, so that a bad file fails fast.
    let generation_config = generation_config::load(&args.generation_config, path)?;
    let check_generation_config = |c: &ModelConfig| -> Result<()> {
        match &generation_config {
            Some(g) => generation_config::validate(&g.defaults, c.vocab_size)
                .with_context(|| format!("{}: invalid", g.path.display())),
            None => Ok(()),
        }
    };
    if path.is_dir() {
        let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
        check_generation_config(&config)?;
        let mut tokenizer = match &args.tokenizer {
            Some(t) => load_tokenizer_override(t, config.vocab_size)?,
            None => Tokenizer::from_hf_dir(path)?,
        };
        override_chat_template(&mut tokenizer, args)?;
        let source = SafetensorsSource::open(path, args.dtype, args.quantization)?;
        if let Some(s) = source.scheme() {
            tracing::info!(
                "{}: {} checkpoint, kept quantized",
                path.display(),
                s.describe()
            );
        }
        let model = models::load(backend, &source, config.clone(), max_positions(&config))?;
        let unused_tensors = source.unused();
        if !unused_tensors.is_empty() {
            const SHOWN: usize = 8;
            tracing::warn!(
                "{}: {} tensors of the checkpoint are not used by the model (check that none changes its math): {}{}",
                path.display(),
                unused_tensors.len(),
                unused_tensors[..unused_tensors.len().min(SHOWN)].join(", "),
                if unused_tensors.len() > SHOWN { ", ..." } else { "" }
            );
        }
        Ok((
            model,
            LoadedModel {
                config,
                tokenizer,
                source: LoadedFrom::HuggingFace,
                generation_config,
                unused_tensors,
            },
        ))
    } else {
        if let Some(q) = args.quantization.filter(|&q| q != QuantizationArg::Gguf) {
            bail!(
                "--quantization {}, but {} is a GGUF file, whose block types are its quantization: use --quantization gguf or omit the flag",
                q.name(),
                path.display()
            );
        }
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        check_generation_config(&config)?;
        let mut tokenizer = match &args.tokenizer {
            Some(t) => load_tokenizer_override(t, config.vocab_size)?,
            None => Tokenizer::from_gguf(&file)?,
        };
        override_chat_template(&mut tokenizer, args)?;
        let model = models::load(
            backend,
            &GgufWeights::new(&file, args.dtype).for_model(&config),
            config.clone(),
            max_positions(&config),
        )?;
        Ok((
            model,
            LoadedModel {
                config,
                tokenizer,
                source: LoadedFrom::Gguf,
                generation_config,
                unused_tensors: Vec::new(),
            },
        ))
    }
}

/// Loads `--tokenizer`: an HF folder (tokenizer.json) or a GGUF file. Its
/// ids must fit the model's vocabulary of `vocab_size`.
fn load_tokenizer_override(path: &std::path::Path, vocab_size: usize) -> Result<Tokenizer> {
    if !path.exists() {
        bail!(
            "--tokenizer {}: no such file or directory (give a Hugging Face folder with tokenizer.json, or a GGUF file)",
            path.display()
        );
    }
    let tokenizer = if path.is_dir() {
        Tokenizer::from_hf_dir(path)
    } else {
        GgufFile::open(path).and_then(|g| Tokenizer::from_gguf(&g))
    }
    .with_context(|| format!("--tokenizer {}", path.display()))?;
    if tokenizer.vocab_size() > vocab_size {
        bail!(
            "--tokenizer {}: its vocabulary of {} tokens does not fit the model's {}; use the model's own tokenizer",
            path.display(),
            tokenizer.vocab_size(),
            vocab_size
        );
    }
    tracing::info!(
        "--tokenizer {}: used instead of the model's own",
        path.display()
    );
    Ok(tokenizer)
}

/// Applies `--chat-template`: a path to a file, or the template itself.
fn override_chat_template(tokenizer: &mut Tokenizer, args: &EngineArgs) -> Result<()> {
    let Some(t) = &args.chat_template else {
        return Ok(());
    };
    let path = std::path::Path::new(t);
    let source = if !t.contains("{%") && !t.contains("{{") && path.exists() {
        std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template {}: cannot read", path.display()))?
    } else {
        t.clone()
    };
    tokenizer
        .set_chat_template(&source)
        .context("--chat-template")
}

/// Free memory as the kernel reports it (`MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Parses sizes such as `4GiB`, `512MiB`, `2G` or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .with_context(|| format!("'{s}' is not a size (try 4GiB or 512MiB)"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => bail!("'{s}': unknown unit '{other}' (use B, KiB, MiB, GiB or TiB)"),
    };
    Ok((x * mul as f64) as u64)
}

/// Builds the engine: model, tokenizer, KV pool, scheduler. Logs the pool.
pub fn build_engine(args: &EngineArgs) -> Result<EngineCore> {
    if !args.block_size.is_power_of_two() || args.block_size > 256 {
        bail!(
            "--block-size {} must be a power of two no larger than 256",
            args.block_size
        );
    }
    if args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--max-num-seqs and --max-num-batched-tokens must be positive");
    }
    if let Some(l) = args.max_model_len {
        if l == 0 || l > crate::engine::config::MAX_CONTEXT {
            bail!(
                "--max-model-len {l} must be between 1 and {}",
                crate::engine::config::MAX_CONTEXT
            );
        }
    }
    let (mut pooler, generates) = resolve_pooler(args)?;
    if let Some(head) = pooler.as_mut().and_then(|p| p.token_head.as_mut()) {
        head.weight = token_head_weight(args, &head.tokens)?;
    }
    let mut core = match args.device {
        Device::Cpu => assemble(cpu_backend(args)?, args, pooler.as_ref()),
        #[cfg(feature = "cuda")]
        Device::Cuda => assemble(
            pagoda_accel::CudaBackend::new(0).context("--device cuda")?,
            args,
            pooler.as_ref(),
        ),
        other => Err(other.open(args.threads).err().map_or_else(
            || {
                anyhow::anyhow!(
                    "--device {other} has no engine backend in this build; use --device cpu"
                )
            },
            anyhow::Error::from,
        )),
    }?;
    if let Some(p) = &pooler {
        if args.speculative.is_some() || args.lora.is_some() {
            if generates {
                bail!("--pooler-config with --runner generate adds pooling rows to the generation batches, which is not implemented beside speculative decoding or LoRA adapters; drop --pooler-config, --speculative-config or --enable-lora");
            }
            bail!("--runner pooling serves embeddings, which neither speculative decoding nor LoRA adapters apply to; drop --speculative-config and --enable-lora");
        }
        tracing::info!(
            "serving for {}pooling ({}): {} pooling{}",
            if generates { "generation and " } else { "" },
            match p.task {
                crate::engine::pooling::PoolingTask::Embed => "embeddings",
                crate::engine::pooling::PoolingTask::Score => "scores of a cross-encoder",
                crate::engine::pooling::PoolingTask::Classify => "a classifier's probabilities",
            },
            p.pooling_type.name(),
            if p.normalize { ", L2-normalized" } else { "" }
        );
    }
    if generates {
        core.set_generation_and_pooler(pooler);
    } else {
        core.set_pooler(pooler);
    }
    Ok(core)
}

/// Decides whether the model is served for pooling (`--runner`,
/// `--convert`) and how it pools: `--pooler-config` over the model's
/// sentence-transformers files, else vLLM's default for a decoder turned
/// into an embedding model (last token, normalized). Also returns whether
/// the engine generates: a causal model served with `--runner generate`
/// and a `--pooler-config` does both, its pooling rows beside the
/// generation rows in the same batches (an extension: vLLM refuses the
/// pair); every other pooling model generates nothing, as in vLLM.
fn resolve_pooler(
    args: &EngineArgs,
) -> Result<(Option<crate::engine::pooling::PoolerConfig>, bool)> {
    use crate::engine::pooling::{
        architecture_is_classifier, architecture_is_encoder, architecture_is_pooling,
        architecture_reads_token_types, ConvertKind, PoolerConfig, PoolingType, RunnerKind,
    };
    let dir = args.model.is_dir().then_some(args.model.as_path());
    let config_json = match dir {
        Some(d) => std::fs::read_to_string(d.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()),
        None => None,
    };
    let own = match dir {
        Some(d) => PoolerConfig::from_sentence_transformers(d)?,
        None => None,
    };
    let encoder = config_json.as_ref().is_some_and(architecture_is_encoder);
    let classifier = config_json.as_ref().is_some_and(architecture_is_classifier);
    if let Some(json) = &args.hf_overrides {
        let head = crate::engine::pooling::token_head_from_overrides(json)?;
        if encoder || classifier {
            bail!("--hf-overrides (the Qwen3-Reranker form) applies to a causal model; this checkpoint is already served for pooling without it");
        }
        if args.runner == RunnerKind::Generate {
            bail!("--hf-overrides makes a reranker, which is served for pooling; drop --runner generate");
        }
        if args.pooler_config.is_some() || args.convert == ConvertKind::Embed {
            bail!("--hf-overrides (the Qwen3-Reranker form) scores the last token's logits; drop --pooler-config and --convert embed");
        }
        return Ok((
            Some(PoolerConfig {
                pooling_type: PoolingType::Last,
                normalize: false,
                task: crate::engine::pooling::PoolingTask::Score,
                labels: vec!["LABEL_0".into()],
                token_head: Some(head),
                pair_types: false,
            }),
            false,
        ));
    }
    let pooling = match args.runner {
        RunnerKind::Pooling => true,
        RunnerKind::Generate => false,
        RunnerKind::Auto => {
            args.convert != ConvertKind::Auto
                || config_json.as_ref().is_some_and(architecture_is_pooling)
                || own.is_some()
        }
    };
    if !pooling {
        if encoder {
            bail!("--runner generate: this BERT encoder generates nothing; it is served for pooling (drop --runner, or give --runner pooling)");
        }
        if args.convert != ConvertKind::Auto {
            bail!("--convert applies to pooling models; add --runner pooling");
        }
        let Some(json) = &args.pooler_config else {
            return Ok((None, true));
        };
        if args.runner != RunnerKind::Generate {
            bail!("--pooler-config applies to pooling models: add --runner pooling, or --runner generate to serve both generation and pooling");
        }
        if classifier {
            bail!("--runner generate: this checkpoint is a classifier (*ForSequenceClassification), which generates nothing; drop --runner generate");
        }
        // Generation and pooling in the same engine: the decoder's pooling
        // rows read the last token's final-normed hidden state.
        let cfg = own
            .unwrap_or(PoolerConfig::DECODER_DEFAULT)
            .with_overrides(json)?;
        if cfg.pooling_type != PoolingType::Last {
            bail!(
                "{} pooling of a decoder model is not implemented (its runner pools the last token); use --pooler-config '{{\"pooling_type\": \"LAST\"}}'",
                cfg.pooling_type.name()
            );
        }
        return Ok((
            Some(PoolerConfig {
                pair_types: false,
                ..cfg
            }),
            true,
        ));
    }
    let mut cfg = match (classifier, args.convert) {
        (true, ConvertKind::Auto | ConvertKind::Classify) => match &config_json {
            Some(j) => PoolerConfig::classifier(j)?,
            None => PoolerConfig::CROSS_ENCODER,
        },
        (true, ConvertKind::Embed) => bail!(
            "--convert embed: this checkpoint is a cross-encoder (*ForSequenceClassification), which scores pairs on /score and /rerank; drop --convert"
        ),
        (false, ConvertKind::Classify) if encoder => bail!(
            "--convert classify: this BERT checkpoint has no classifier head (BertModel); serve a BertForSequenceClassification checkpoint for scoring"
        ),
        (false, ConvertKind::Classify) => bail!("--convert classify of a decoder: only the Qwen3-Reranker form is implemented, given as vLLM gives it: --hf-overrides '{{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}}'"),
        (false, _) if encoder => own.unwrap_or(PoolerConfig::ENCODER_DEFAULT),
        (false, _) => own.unwrap_or(PoolerConfig::DECODER_DEFAULT),
    };
    if let Some(json) = &args.pooler_config {
        cfg = cfg.with_overrides(json)?;
    }
    cfg.pair_types = config_json
        .as_ref()
        .is_some_and(architecture_reads_token_types);
    // The decoder families read the hidden state of the row they would
    // sample from, which is the last token's.
    if !encoder && cfg.pooling_type != PoolingType::Last {
        bail!(
            "{} pooling of a decoder model is not implemented (its runner pools the last token); use --pooler-config '{{\"pooling_type\": \"LAST\"}}'",
            cfg.pooling_type.name()
        );
    }
    Ok((Some(cfg), false))
}

/// The Qwen3-Reranker head: `W[true] - W[false]` of the LM head
/// (`lm_head.weight`, else the tied `model.embed_tokens.weight`) for the
/// two tokens `--hf-overrides` names, which must each be one token of the
/// vocabulary.
fn token_head_weight(args: &EngineArgs, tokens: &[String; 2]) -> Result<Vec<f32>> {
    use crate::engine::loader::WeightSource;
    if !args.model.is_dir() {
        bail!(
            "--hf-overrides (the Qwen3-Reranker form) needs a Hugging Face folder of safetensors"
        );
    }
    let config = ModelConfig::from_hf_config(&args.model.join("config.json"))?;
    let tokenizer = match &args.tokenizer {
        Some(t) => load_tokenizer_override(t, config.vocab_size)?,
        None => Tokenizer::from_hf_dir(&args.model)?,
    };
    let ids = tokens
        .iter()
        .map(|t| {
            tokenizer.token_to_id(t).with_context(|| {
                format!(
                    "--hf-overrides: classifier_from_token {t:?} is not a token of the vocabulary"
                )
            })
        })
        .collect::<Result<Vec<u32>>>()?;
    let source = SafetensorsSource::open(&args.model, DType::Float32, None)?;
    let name = if source.contains("lm_head.weight") {
        "lm_head.weight"
    } else if config.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        bail!("the checkpoint has no lm_head.weight and does not tie its embeddings: no logits for the reranker's tokens");
    };
    let (d, vocab) = (config.hidden_size, config.vocab_size);
    let (w, _) = source
        .stacked(name, &[vocab, d])
        .with_context(|| format!("reading {name} for the reranker's head"))?;
    let row = |id: u32| -> Result<&[f32]> {
        let i = id as usize;
        w.get(i * d..(i + 1) * d)
            .with_context(|| format!("token {id} lies past the {vocab} rows of {name}"))
    };
    let (no, yes) = (row(ids[0])?, row(ids[1])?);
    Ok(yes.iter().zip(no).map(|(y, n)| y - n).collect())
}

/// Runs one forward of the largest step the scheduler can plan (a prefill
/// of `--max-num-batched-tokens` tokens, with as many logit rows as
/// `--max-num-seqs` decodes would have) over a throw-away KV pool, so that
/// `ws` and the backend's scratch reach their peak size before the device's
/// free memory is measured, as vLLM's profile run does.
fn profile_forward<B: Backend>(
    backend: &mut B,
    model: &dyn CausalLm<B>,
    ws: &mut Workspace<B>,
    args: &EngineArgs,
    kv_dtype: KvCacheDtype,
    max_model_len: usize,
) -> Result<()> {
    let c = model.config();
    let tokens = args.max_num_batched_tokens.min(max_model_len).max(1);
    let bs = args.block_size;
    let blocks = tokens.div_ceil(bs);
    let spec = kv_spec(model, kv_dtype, blocks, bs);
    let mut kv = backend
        .alloc_kv(&spec)
        .context("allocating the profile forward's KV blocks")?;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| i % c.vocab_size as u32)
        .collect();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut batch = StepBatch::default();
    batch.push_seq(&ids, 0, &table, bs, 0, 0);
    let rows = args.max_num_seqs.min(tokens);
    batch.logit_rows = ((tokens - rows) as u32..tokens as u32).collect();
    batch.state_slots.push(0);
    let mut step = B::Step::default();
    backend.upload_step(&batch, &mut step)?;
    let mut state = model
        .alloc_state(backend, 1)
        .context("allocating the profile forward's recurrent state")?;
    state.slots.push(0);
    model
        .forward(backend, &step, tokens, rows, &mut kv, &mut state, ws)
        .context("the profile forward")?;
    backend
        .to_host(&mut ws.logits, rows * c.vocab_size)
        .context("the profile forward's logits")?;
    Ok(())
}

/// The KV pool `model` needs: `num_blocks` blocks of `block_size` slots in
/// `dtype`, each layer as the model describes it.
pub fn kv_spec<B: Backend>(
    model: &dyn CausalLm<B>,
    dtype: KvCacheDtype,
    num_blocks: usize,
    block_size: usize,
) -> KvSpec {
    KvSpec {
        dtype: dtype.kv_dtype(),
        num_blocks,
        block_size,
        layers: model.kv_layers(),
    }
}

/// The CPU backend `args` ask for: `--threads` workers, and quantized
/// weights laid out for the kernel family an engine of `--max-num-seqs`
/// runs best on ([`pagoda_accel::cpu::weight_level`]).
pub fn cpu_backend(args: &EngineArgs) -> Result<CpuBackend> {
    let ctx = Device::Cpu.open(args.threads)?;
    let level = pagoda_accel::cpu::weight_level(args.max_num_seqs);
    tracing::info!(
        "quantized weights laid out for {level:?} kernels (max-num-seqs {})",
        args.max_num_seqs
    );
    Ok(CpuBackend::new(ctx, level))
}

/// Loads speculative decoding's draft model from `path` onto `backend`,
/// beside the target (`target`), after checking that it can draft for it:
/// the same vocabulary, token for token, and room for `max_model_len`.
fn load_draft_model<B: Backend>(
    backend: &B,
    path: &std::path::Path,
    target: &LoadedModel,
    max_model_len: usize,
) -> Result<Model<B>> {
    let mut draft_args = EngineArgs::new(path);
    draft_args.dtype = DType::Auto;
    draft_args.generation_config = GenerationConfigSource::Vllm;
    let (draft, loaded) = load_model(backend, &draft_args, |_| max_model_len)
        .with_context(|| format!("loading the draft model {}", path.display()))?;
    if draft.state_bytes_per_seq() > 0 {
        bail!(
            "the draft model {} is a hybrid (linear-attention) model, whose recurrent state cannot be rolled back past rejected drafts yet; use a draft model with attention layers only",
            path.display()
        );
    }
    let (t, d) = (&target.tokenizer, &loaded.tokenizer);
    if loaded.config.vocab_size != target.config.vocab_size || d.vocab_size() != t.vocab_size() {
        bail!(
            "the draft model {} has a vocabulary of {} tokens ({} in its tokenizer), the model {} ({}): a draft model must share the model's tokenizer",
            path.display(),
            loaded.config.vocab_size,
            d.vocab_size(),
            target.config.vocab_size,
            t.vocab_size()
        );
    }
    if let Some(id) =
        (0..t.vocab_size() as u32).find(|&id| t.token_to_str(id) != d.token_to_str(id))
    {
        bail!(
            "the draft model {} does not share the model's tokenizer: token {id} is {:?} there and {:?} in the model; use a draft model of the same family and tokenizer",
            path.display(),
            d.token_to_str(id).unwrap_or_default(),
            t.token_to_str(id).unwrap_or_default()
        );
    }
    if loaded.config.max_position_embeddings < max_model_len {
        bail!(
            "the draft model {} reaches {} positions, fewer than --max-model-len {max_model_len}: lower --max-model-len",
            path.display(),
            loaded.config.max_position_embeddings
        );
    }
    tracing::info!(
        "draft model: {} ({} layers, hidden {}, {} weights, {:.1} MiB)",
        path.display(),
        loaded.config.num_layers,
        loaded.config.hidden_size,
        draft.weight_type(),
        draft.weight_bytes() as f64 / (1 << 20) as f64
    );
    Ok(draft)
}

/// Loads the model onto `backend`, allocates the KV pool there and wires
/// the engine around them.
fn assemble<B: Backend>(
    mut backend: B,
    args: &EngineArgs,
    pooler: Option<&crate::engine::pooling::PoolerConfig>,
) -> Result<EngineCore> {
    let (mut model, loaded) = load_model(&backend, args, |c| {
        args.max_model_len.unwrap_or(c.max_position_embeddings)
    })?;
    if let Some(p) = pooler {
        model.set_pooling(p.pooling_type.seq_pooling())?;
    }
    let c = &loaded.config;
    // An encoder's rows attend both ways over their whole prompt: each
    // runs in one step (no chunks), from position 0 (no prefix-cache
    // hits), and keeps no KV (the pool's blocks are bookkeeping only).
    let encoder = c.encoder.is_some();
    let max_model_len = args.max_model_len.unwrap_or(c.max_position_embeddings);
    if max_model_len > c.max_position_embeddings {
        tracing::warn!(
            "--max-model-len {max_model_len} exceeds the model's max_position_embeddings {}; quality beyond it is not guaranteed",
            c.max_position_embeddings
        );
    }
    let kv_dtype = args.kv_cache_dtype.resolve(model.weight_type());
    // A hybrid model's linear layers keep one state per sequence, counted
    // in the memory budget for every one of `--max-num-seqs`, and with
    // prefix caching as many checkpoints of it again (see
    // `kv_cache::state_checkpoints`).
    let hybrid = model.state_bytes_per_seq() > 0;
    let state_slots = if args.enable_prefix_caching {
        2 * args.max_num_seqs
    } else {
        args.max_num_seqs
    };
    let state_bytes = model.state_bytes_per_seq() as u64 * state_slots as u64;
    let draft = match args.speculative.as_ref().map(|s| &s.method) {
        Some(SpecMethod::DraftModel { model: path }) => {
            Some(load_draft_model(&backend, path, &loaded, max_model_len)?)
        }
        _ => None,
    };
    // The draft model's pool has as many blocks as the target's, under
    // the same block tables: a block costs both.
    let per_block = kv_spec(&*model, kv_dtype, 0, args.block_size).bytes_per_block()
        + draft.as_ref().map_or(0, |d| {
            kv_spec(&**d, kv_dtype, 0, args.block_size).bytes_per_block()
        });
    let mut ws = Workspace::<B>::default();
    let budget = match (args.kv_cache_memory, backend.memory_info()?) {
        (Some(b), _) => b,
        // A device with memory of its own: what the weights and the largest
        // step's activations leave of the allowed fraction.
        (None, Some(_)) => {
            profile_forward(
                &mut backend,
                &*model,
                &mut ws,
                args,
                kv_dtype,
                max_model_len,
            )?;
            let (free, total) = backend.memory_info()?.unwrap_or((0, 0));
            let keep = total as f64 * (1.0 - args.gpu_memory_utilization as f64);
            let budget = (free as f64 - keep).max(0.0) as u64;
            tracing::info!(
                "device memory after the profile forward: {:.2} GiB free of {:.2} GiB; --gpu-memory-utilization {} leaves {:.2} GiB for the KV cache",
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                args.gpu_memory_utilization,
                budget as f64 / (1u64 << 30) as f64
            );
            budget
        }
        // A quarter of free memory, at most 4 GiB (vLLM CPU's default
        // space): the pool is committed lazily, as blocks are first used.
        (None, None) => available_memory().map_or(1 << 30, |m| (m / 4).min(4 << 30)),
    };
    if state_bytes > 0 {
        if state_bytes >= budget {
            bail!(
                "the linear-attention layers' state of --max-num-seqs {} sequences{} takes {state_bytes} bytes ({} each), the whole KV-cache budget of {budget} bytes; lower --max-num-seqs or raise --kv-cache-memory",
                args.max_num_seqs,
                if args.enable_prefix_caching {
                    " and as many prefix-cache checkpoints"
                } else {
                    ""
                },
                model.state_bytes_per_seq()
            );
        }
        tracing::info!(
            "recurrent state: {} slots × {:.2} MiB = {:.2} MiB for the linear-attention layers (half of them prefix-cache checkpoints when caching is on), taken from the KV-cache budget",
            state_slots,
            model.state_bytes_per_seq() as f64 / (1 << 20) as f64,
            state_bytes as f64 / (1 << 20) as f64
        );
    }
    let budget = budget - state_bytes;
    let num_blocks = if per_block == 0 {
        // Nothing is kept per token: enough blocks for every sequence at
        // its longest, which cost no memory.
        args.max_num_seqs * max_model_len.div_ceil(args.block_size) + 1
    } else {
        (budget / per_block as u64) as usize
    };
    let tokens = num_blocks * args.block_size;
    let gib = (num_blocks * per_block) as f64 / (1u64 << 30) as f64;
    if tokens < max_model_len {
        bail!(
            "the KV cache ({} bytes) holds {tokens} tokens, fewer than one sequence of --max-model-len {max_model_len} ({} bytes per block of {}). Lower --max-model-len, raise --kv-cache-memory (or free memory), or use a smaller --kv-cache-dtype / a quantized model",
            budget,
            per_block,
            args.block_size
        );
    }
    tracing::info!(
        "KV cache: {num_blocks} blocks × {} tokens = {tokens} tokens ({gib:.2} GiB) in {} (--kv-cache-dtype {}); max concurrency at max-model-len {max_model_len}: {:.2}",
        args.block_size,
        kv_dtype.name(),
        args.kv_cache_dtype.name(),
        tokens as f64 / max_model_len as f64
    );
    tracing::info!(
        "model: {} layers, hidden {}, {} weights, {:.1} MiB on the device; {}",
        c.num_layers,
        c.hidden_size,
        model.weight_type(),
        model.weight_bytes() as f64 / (1 << 20) as f64,
        backend.describe()
    );
    let spec = kv_spec(&*model, kv_dtype, num_blocks, args.block_size);
    let latent = spec.layers.iter().filter(|l| l.is_latent()).count();
    tracing::info!(
        "KV cache: {} bytes per token across {} layers{}",
        spec.bytes_per_token(),
        spec.layers.len(),
        if latent > 0 {
            format!(
                " ({latent} latent-attention layers keep one {}-value latent row per token)",
                spec.layers
                    .iter()
                    .find(|l| l.is_latent())
                    .map_or(0, |l| l.k_head_dim)
            )
        } else {
            String::new()
        }
    );
    let kv = backend.alloc_kv(&spec).context("allocating the KV cache")?;
    let state = model
        .alloc_state(&mut backend, if hybrid { args.max_num_seqs } else { 0 })
        .context("allocating the linear-attention layers' state")?;
    // A prefix-cache hit restores the linear layers' state from a
    // checkpoint at the hit's end: as many checkpoint slots as sequences.
    let prefix_caching = args.enable_prefix_caching && !encoder;
    let checkpoints = if hybrid && prefix_caching {
        model
            .alloc_state(&mut backend, args.max_num_seqs)
            .context("allocating the linear-attention layers' state checkpoints")?
    } else {
        Default::default()
    };
    let mut kvm = KvCacheManager::new(num_blocks, args.block_size, prefix_caching)
        .with_max_seq_len(max_model_len);
    if hybrid {
        kvm = kvm
            .with_state_slots(args.max_num_seqs)
            .with_state_checkpoints(checkpoints.num_slots());
    }
    // Every layer attends over a window shorter than the context: blocks
    // below it go back to the pool as sequences move on.
    let windows = &c.sliding_windows;
    if !windows.is_empty() && windows.iter().all(Option::is_some) {
        let w = windows
            .iter()
            .flatten()
            .copied()
            .max()
            .unwrap_or(usize::MAX);
        if w < max_model_len {
            tracing::info!("every layer attends over {w} positions: KV blocks below the window are freed as sequences advance");
            kvm = kvm.with_sliding_window(w);
        }
    }
    let kv_events = match &args.kv_events {
        Some(config) => {
            kvm = kvm.with_events();
            Some(KvEventPublisher::start(config)?)
        }
        None => None,
    };
    if model.has_prompt_kernel() {
        tracing::info!(
            "prompts of {} tokens or more run on the AMX-BF16 tile kernel",
            crate::engine::request::PROMPT_KERNEL_MIN_LEN
        );
    }
    let mut runner = ModelRunner::with_workspace(backend, model, kv, args.block_size, ws)
        .with_state(state)
        .with_state_checkpoints(checkpoints);
    if let Some(d) = draft {
        let spec = kv_spec(&*d, kv_dtype, num_blocks, args.block_size);
        let dkv = runner
            .backend()
            .alloc_kv(&spec)
            .context("allocating the draft model's KV cache")?;
        runner = runner.with_draft(DraftModel::new(d, dkv));
    }
    let runner: Box<dyn ModelExecutor> = Box::new(runner);
    let max_num_batched_tokens = if encoder && args.max_num_batched_tokens < max_model_len {
        tracing::info!(
            "--max-num-batched-tokens {} raised to --max-model-len {max_model_len}: an encoder runs each prompt whole in one step",
            args.max_num_batched_tokens
        );
        max_model_len
    } else {
        args.max_num_batched_tokens
    };
    let scheduler = Scheduler::new(SchedulerConfig {
        whole_prompts: encoder,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens,
        policy: args.scheduling_policy,
        draft_lookahead: 0,
        draft_max_batch: 0,
        max_loras: 0,
        tenant_prefill_chunk: args.tenant_prefill_chunk,
        tenant_step_tokens: args.tenant_step_tokens,
    });
    let mut core = EngineCore::new(
        scheduler,
        kvm,
        runner,
        Arc::new(loaded.tokenizer),
        max_model_len,
    );
    core.set_default_seed(args.seed);
    core.set_kv_events(kv_events);
    if let Some(spec) = &args.speculative {
        let speculator = Speculator::new(spec, DEFAULT_SPEC_MAX_BATCH);
        tracing::info!(
            "speculative decoding: {:?}, {} tokens per step, paused while more than {} sequences run",
            spec.method,
            spec.num_speculative_tokens,
            spec.disable_by_batch_size.unwrap_or(DEFAULT_SPEC_MAX_BATCH)
        );
        core.set_speculator(Some(speculator));
    }
    if let Some(l) = &args.lora {
        let mut registry = crate::engine::lora::LoraRegistry::new(
            core.runner().config().clone(),
            crate::engine::lora::LoraLimits {
                max_loras: l.max_loras,
                max_rank: l.max_lora_rank,
                max_cpu_loras: l.max_cpu_loras,
            },
        );
        for (name, path) in &l.modules {
            registry
                .load(name, path)
                .with_context(|| format!("--lora-modules {name}={}", path.display()))?;
        }
        core.enable_lora(registry, l.dtype)
            .context("--enable-lora")?;
        tracing::info!(
            "LoRA: {} adapters loaded, up to {} at once, rank up to {}",
            l.modules.len(),
            l.max_loras,
            l.max_lora_rank
        );
    }
    if let Some(g) = loaded.generation_config {
        core.set_sampling_defaults(g.defaults);
        // What actually changes: the sampling defaults, and EOS ids the
        // tokenizer does not already stop on.
        let applied = core.sampling_defaults().describe();
        if !applied.is_empty() {
            tracing::info!(
                "Default sampling parameters have been overridden by the model's Hugging Face generation config ({}): {}. Requests that set these values keep their own; to use vLLM's defaults instead, restart with --generation-config vllm",
                g.path.display(),
                applied.join(", ")
            );
        }
    }
    Ok(core)
}
