//! `pagoda bench`: `throughput` (offline, all requests at once),
//! `latency` (one request at a time: prompt and decode speed), `serve`
//! (online load on a server) and `bandwidth` (the machine's read bandwidth).

use super::EngineFlags;
use crate::bench::datasets::{self, Dataset};
use crate::bench::{bandwidth, latency, stats, throughput};
use crate::engine::build_engine;
use crate::engine::llm::Prompt;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Offline throughput: submit every request at once, like `vllm bench throughput`.
    Throughput(ThroughputArgs),
    /// Single-stream latency: prompt (prefill) tok/s and decode tok/s, like llama-bench's pp/tg.
    Latency(LatencyArgs),
    /// Online load against any OpenAI-compatible server, like `vllm bench serve`.
    Serve(ServeBenchArgs),
    /// Read bandwidth per thread count: a STREAM-like sum over a buffer far
    /// larger than the last-level cache, the ceiling decode works against.
    Bandwidth(BandwidthArgs),
}

/// Flags of `pagoda bench bandwidth`.
#[derive(Args, Debug)]
pub struct BandwidthArgs {
    /// Buffer size in bytes; keep it far above the last-level cache.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: usize,
    /// Thread counts to measure, e.g. 1,2; default: 1 up to the number of cores.
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Timed rounds per thread count; the best and the median are reported.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `pagoda bench serve`.
#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://127.0.0.1:8000 (Pagoda or a peer).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// The served model name to put in requests.
    #[arg(long)]
    pub model: String,
    /// A GGUF file or HF folder whose tokenizer builds the prompts.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The API to drive, as `vllm bench serve --backend` names it: `openai`
    /// (or `vllm`) for completions, `openai-chat` for chat.
    #[arg(long, default_value = "openai")]
    pub backend: String,
    /// The path to POST to; default: the backend's endpoint.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// random, seed, prefix-repetition, or a .jsonl file; also as vLLM's
    /// `--dataset-name` (random, prefix_repetition, custom).
    #[arg(long, visible_alias = "dataset-name", default_value = "random")]
    pub dataset: String,
    /// The .jsonl file of `--dataset-name custom`.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    #[arg(long, visible_alias = "random-input-len", default_value_t = 1024)]
    pub input_len: usize,
    #[arg(long, visible_alias = "random-output-len", default_value_t = 128)]
    pub output_len: usize,
    /// Shared prefix length of the prefix-repetition dataset.
    #[arg(
        long,
        visible_alias = "prefix-repetition-prefix-len",
        default_value_t = 1024
    )]
    pub prefix_len: usize,
    /// Ask every request to ignore EOS, so each runs to its output length.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Most requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Mean requests per second (Poisson arrivals); inf sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Gamma shape of inter-arrival times: 1 is Poisson, below 1 is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results (vLLM's key names) here.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// A JSON object merged into every request body, e.g.
    /// '{"response_format": {"type": "json_object"}}'.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Sent as `Authorization: Bearer KEY` (a tenant's key, or the
    /// server's `--api-key`); as in `vllm bench serve`, OPENAI_API_KEY
    /// gives it too.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// LoRA adapter names the server was started with (`--lora-modules`):
    /// each request names one, as `vllm bench serve --lora-modules` does.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
}

/// Flags of `pagoda bench throughput`.
#[derive(Args, Debug)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// random, seed (100 × "介绍一下深度学习" as chat), prefix-repetition, or a .jsonl file;
    /// also as vLLM's `--dataset-name`.
    #[arg(long, visible_alias = "dataset-name", default_value = "random")]
    pub dataset: String,
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    #[arg(long, visible_alias = "random-input-len", default_value_t = 1024)]
    pub input_len: usize,
    #[arg(long, visible_alias = "random-output-len", default_value_t = 128)]
    pub output_len: usize,
    /// Seed of the dataset generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
}

/// Flags of `pagoda bench latency`.
#[derive(Args, Debug)]
pub struct LatencyArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Measured iterations (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub num_iters: usize,
    /// random (input-len random tokens) or rewrite (repeat a passage word
    /// for word: the output quotes the prompt, as speculative decoding's
    /// n-gram drafts like).
    #[arg(long, visible_alias = "dataset-name", default_value = "random")]
    pub dataset: String,
    #[arg(long)]
    pub result_json: Option<PathBuf>,
}

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Throughput(a) => run_throughput(a),
        BenchCommand::Latency(a) => run_latency(a),
        BenchCommand::Serve(a) => run_serve(a),
        BenchCommand::Bandwidth(a) => run_bandwidth(a),
    }
}

fn run_bandwidth(a: BandwidthArgs) -> Result<()> {
    let threads = if a.threads.is_empty() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (1..=cores).collect()
    } else {
        a.threads
    };
    let r = bandwidth::run(a.bytes, &threads, a.rounds)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", bandwidth::table(&r));
    }
    Ok(())
}

/// "; speculative decoding: …" when drafts were verified, else nothing.
fn describe_spec(s: &crate::engine::spec_decode::SpecStats) -> String {
    match s.acceptance_rate() {
        Some(rate) => format!(
            "; speculative decoding: {} of {} drafted tokens accepted ({:.1}%), mean acceptance length {:.2}",
            s.num_accepted_tokens,
            s.num_draft_tokens,
            100.0 * rate,
            1.0 + s.num_accepted_tokens as f64 / s.num_drafts.max(1) as f64
        ),
        None => String::new(),
    }
}

fn write_json(path: &Option<PathBuf>, v: &serde_json::Value) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(v)?)
            .with_context(|| format!("{}: cannot write", p.display()))?;
    }
    Ok(())
}

fn run_throughput(a: ThroughputArgs) -> Result<()> {
    let mut core = build_engine(&a.engine.to_engine_args()?)?;
    let dataset: Dataset = a.dataset.parse()?;
    let reqs = datasets::generate(
        &dataset,
        core.tokenizer(),
        a.num_prompts,
        a.input_len,
        a.output_len,
        a.seed,
    )?;
    let r = throughput::run(&mut core, &reqs)?;
    println!(
        "Throughput: {:.2} requests/s, {:.2} total tokens/s, {:.2} output tokens/s ({} requests, {} output tokens in {:.2} s)",
        r.requests_per_second, r.tokens_per_second, r.output_tokens_per_second, r.num_requests, r.total_output_tokens, r.elapsed_time
    );
    let s = core.stats();
    println!(
        "Preemptions: {}, prefix cache hits: {} of {} tokens{}",
        s.num_preemptions,
        s.prefix.hits,
        s.prefix.queries,
        describe_spec(&s.spec)
    );
    write_json(&a.result_json, &serde_json::to_value(&r)?)
}

fn run_latency(a: LatencyArgs) -> Result<()> {
    let mut core = build_engine(&a.engine.to_engine_args()?)?;
    let dataset: Dataset = a.dataset.parse()?;
    if !matches!(dataset, Dataset::Random | Dataset::Rewrite) {
        anyhow::bail!("bench latency runs --dataset random or rewrite");
    }
    let reqs = datasets::generate(
        &dataset,
        core.tokenizer(),
        a.num_iters + 1,
        a.input_len,
        a.output_len,
        7,
    )?;
    let mut samples = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let Prompt::Tokens(ids) = &r.prompt else {
            continue;
        };
        let s = latency::run_once(&mut core, ids.clone(), r.output_len, i)?;
        if i > 0 {
            samples.push(s);
        }
    }
    let pp: Vec<f64> = samples.iter().map(|s| s.prompt_tps()).collect();
    let tg: Vec<f64> = samples.iter().map(|s| s.decode_tps()).collect();
    let (pp, tg) = (stats::summarize(&pp), stats::summarize(&tg));
    let device = core.runner().describe_device();
    // The first output token comes from the prefill step, so one output
    // token means no decode steps to time.
    let n = samples.len().max(1);
    let prompt_len = samples.iter().map(|s| s.prompt_tokens).sum::<usize>() / n;
    let output_len = samples.iter().map(|s| s.output_tokens).sum::<usize>() / n;
    let decode = if output_len > 1 {
        format!(
            "decode {output_len} tokens: {:.1} tok/s (median)",
            tg.median
        )
    } else {
        "no decode steps (output length 1)".to_string()
    };
    println!(
        "{device}: prompt {prompt_len} tokens: {:.1} tok/s (median of {}); {decode}{}",
        pp.median,
        samples.len(),
        describe_spec(&core.stats().spec),
    );
    write_json(
        &a.result_json,
        &serde_json::json!({
            "device": device, "input_len": a.input_len, "output_len": a.output_len,
            "prompt_tokens_per_second": pp.median, "decode_tokens_per_second": tg.median,
            "samples": samples,
        }),
    )
}

fn load_tokenizer(path: &std::path::Path) -> Result<crate::tokenizer::Tokenizer> {
    if path.is_dir() {
        crate::tokenizer::Tokenizer::from_hf_dir(path)
    } else {
        let g = crate::engine::loader::gguf::GgufFile::open(path)?;
        crate::tokenizer::Tokenizer::from_gguf(&g)
    }
}

fn run_serve(a: ServeBenchArgs) -> Result<()> {
    // Negated on purpose: NaN must be refused too.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    if !(a.burstiness > 0.0) {
        anyhow::bail!("--burstiness must be positive");
    }
    let tok = load_tokenizer(&a.tokenizer)?;
    let endpoint = match (&a.endpoint, a.backend.as_str()) {
        (Some(e), _) => e.clone(),
        (None, "openai" | "vllm") => "/v1/completions".to_string(),
        (None, "openai-chat") => "/v1/chat/completions".to_string(),
        (None, other) => anyhow::bail!(
            "--backend {other} is not openai, vllm or openai-chat (give --endpoint for another path)"
        ),
    };
    let mut dataset: Dataset = match (a.dataset.as_str(), &a.dataset_path) {
        ("custom", Some(p)) | ("random", Some(p))
            if p.extension().is_some_and(|e| e == "jsonl") =>
        {
            Dataset::Jsonl(p.clone())
        }
        (_, Some(p)) => anyhow::bail!(
            "--dataset-path {} needs --dataset-name custom and a .jsonl file",
            p.display()
        ),
        (name, None) => name.parse()?,
    };
    if let Dataset::PrefixRepetition { prefix_len } = &mut dataset {
        *prefix_len = a.prefix_len;
    }
    // As in vLLM, a seed (0 by default) fixes the prompts; runs that must
    // not meet a peer's prompt cache pass a different --seed each.
    let seed = a.seed;
    let reqs = datasets::generate(
        &dataset,
        &tok,
        a.num_prompts,
        a.input_len,
        a.output_len,
        seed,
    )?;
    let cfg = crate::bench::serve::ServeConfig {
        base_url: a.base_url.trim_end_matches('/').to_string(),
        model: a.model.clone(),
        endpoint,
        max_concurrency: a.max_concurrency,
        ignore_eos: a.ignore_eos,
        extra_body: match &a.extra_body {
            None => Default::default(),
            Some(s) => match serde_json::from_str::<serde_json::Value>(s) {
                Ok(serde_json::Value::Object(o)) => o,
                Ok(_) => anyhow::bail!("--extra-body must be a JSON object"),
                Err(e) => anyhow::bail!("--extra-body is not valid JSON: {e}"),
            },
        },
        request_rate: a.request_rate,
        burstiness: a.burstiness,
        seed,
        progress: !a.no_progress,
        api_key: a.api_key.clone(),
        lora_modules: a.lora_modules.clone(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let v = rt.block_on(crate::bench::serve::run(cfg, reqs))?;
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    println!("============ Serving Benchmark Result ============");
    println!("{:<40} {}", "Successful requests:", v["completed"]);
    println!("{:<40} {}", "Failed requests:", v["failed"]);
    println!("{:<40} {:.2}", "Benchmark duration (s):", f("duration"));
    println!("{:<40} {}", "Total input tokens:", v["total_input_tokens"]);
    println!(
        "{:<40} {}",
        "Total generated tokens:", v["total_output_tokens"]
    );
    println!(
        "{:<40} {:.2}",
        "Request throughput (req/s):",
        f("request_throughput")
    );
    println!(
        "{:<40} {:.2}",
        "Output token throughput (tok/s):",
        f("output_throughput")
    );
    println!(
        "{:<40} {:.2}",
        "Total token throughput (tok/s):",
        f("total_token_throughput")
    );
    for (title, key) in [
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
        ("End-to-end Latency", "e2el"),
    ] {
        println!("{:-^50}", title);
        for stat in ["mean", "median", "p99"] {
            println!(
                "{:<40} {:.2}",
                format!(
                    "{} {} (ms):",
                    stat[..1].to_uppercase() + &stat[1..],
                    key.to_uppercase()
                ),
                f(&format!("{stat}_{key}_ms"))
            );
        }
    }
    println!("==================================================");
    write_json(&a.result_json, &v)
}
