//! `pagoda bench throughput`: every request submitted at once to the
//! engine, as `vllm bench throughput` does; reports requests/s and tok/s.

use super::datasets::BenchRequest;
use crate::engine::core::{EngineCore, RequestOptions};
use crate::engine::request::SamplingParams;
use anyhow::{Context, Result};
use std::time::Instant;

/// The results, under vLLM's key names.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ThroughputResult {
    pub elapsed_time: f64,
    pub num_requests: usize,
    pub total_num_tokens: usize,
    pub total_output_tokens: usize,
    pub requests_per_second: f64,
    pub tokens_per_second: f64,
    pub output_tokens_per_second: f64,
}

/// Runs the requests through `core` and measures the wall time.
pub fn run(core: &mut EngineCore, requests: &[BenchRequest]) -> Result<ThroughputResult> {
    let started = Instant::now();
    let mut prompt_tokens = 0;
    for (i, r) in requests.iter().enumerate() {
        let ids = match &r.prompt {
            crate::engine::llm::Prompt::Tokens(t) => t.clone(),
            crate::engine::llm::Prompt::Text(t) => core.tokenizer().encode(t, true)?,
        };
        prompt_tokens += ids.len();
        let params = SamplingParams {
            max_tokens: Some(r.output_len),
            ignore_eos: true,
            temperature: Some(1.0),
            top_p: Some(1.0),
            seed: Some(i as u64),
            ..Default::default()
        };
        core.add_request(format!("bench-{i}"), ids, params, RequestOptions::default())
            .with_context(|| format!("request {i}"))?;
    }
    let mut output_tokens = 0;
    while core.has_unfinished() {
        for o in core.step()? {
            output_tokens += o.new_token_ids.len();
        }
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(ThroughputResult {
        elapsed_time: secs,
        num_requests: requests.len(),
        total_num_tokens: prompt_tokens + output_tokens,
        total_output_tokens: output_tokens,
        requests_per_second: requests.len() as f64 / secs,
        tokens_per_second: (prompt_tokens + output_tokens) as f64 / secs,
        output_tokens_per_second: output_tokens as f64 / secs,
    })
}
