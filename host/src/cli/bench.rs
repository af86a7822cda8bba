//! `pagoda bench`: `throughput` (offline, all requests at once) and
//! `latency` (one request at a time: prompt and decode speed).

use super::EngineFlags;
use crate::bench::datasets::{self, Dataset};
use crate::bench::{latency, stats, throughput};
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
}

/// Flags of `pagoda bench throughput`.
#[derive(Args, Debug)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// random, seed (100 × "介绍一下深度学习" as chat), prefix-repetition, or a .jsonl file.
    #[arg(long, default_value = "random")]
    pub dataset: String,
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    #[arg(long, default_value_t = 128)]
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
    #[arg(long)]
    pub result_json: Option<PathBuf>,
}

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Throughput(a) => run_throughput(a),
        BenchCommand::Latency(a) => run_latency(a),
    }
}

fn write_json(path: &Option<PathBuf>, v: &serde_json::Value) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(v)?).with_context(|| format!("{}: cannot write", p.display()))?;
    }
    Ok(())
}

fn run_throughput(a: ThroughputArgs) -> Result<()> {
    let mut core = build_engine(&a.engine.to_engine_args()?)?;
    let dataset: Dataset = a.dataset.parse()?;
    let reqs = datasets::generate(&dataset, core.tokenizer(), a.num_prompts, a.input_len, a.output_len, a.seed)?;
    let r = throughput::run(&mut core, &reqs)?;
    println!(
        "Throughput: {:.2} requests/s, {:.2} total tokens/s, {:.2} output tokens/s ({} requests, {} output tokens in {:.2} s)",
        r.requests_per_second, r.tokens_per_second, r.output_tokens_per_second, r.num_requests, r.total_output_tokens, r.elapsed_time
    );
    let s = core.stats();
    println!("Preemptions: {}, prefix cache hits: {} of {} tokens", s.num_preemptions, s.prefix.hits, s.prefix.queries);
    write_json(&a.result_json, &serde_json::to_value(&r)?)
}

fn run_latency(a: LatencyArgs) -> Result<()> {
    let mut core = build_engine(&a.engine.to_engine_args()?)?;
    let reqs = datasets::generate(&Dataset::Random, core.tokenizer(), a.num_iters + 1, a.input_len, a.output_len, 7)?;
    let mut samples = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let Prompt::Tokens(ids) = &r.prompt else { continue };
        let s = latency::run_once(&mut core, ids.clone(), a.output_len, i)?;
        if i > 0 {
            samples.push(s);
        }
    }
    let pp: Vec<f64> = samples.iter().map(|s| s.prompt_tps()).collect();
    let tg: Vec<f64> = samples.iter().map(|s| s.decode_tps()).collect();
    let (pp, tg) = (stats::summarize(&pp), stats::summarize(&tg));
    let threads = core.runner().context().pool().threads();
    println!(
        "threads {threads}: prompt {} tokens: {:.1} tok/s (median of {}); decode {} tokens: {:.1} tok/s (median)",
        a.input_len,
        pp.median,
        samples.len(),
        a.output_len,
        tg.median
    );
    write_json(
        &a.result_json,
        &serde_json::json!({
            "threads": threads, "input_len": a.input_len, "output_len": a.output_len,
            "prompt_tokens_per_second": pp.median, "decode_tokens_per_second": tg.median,
            "samples": samples,
        }),
    )
}
