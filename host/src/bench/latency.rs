//! `pagoda bench latency`: one request at a time, split into its prefill
//! (prompt tok/s) and its decode (tok/s), the figures llama-bench reports
//! as pp and tg.

use crate::engine::core::{EngineCore, RequestOptions};
use crate::engine::request::SamplingParams;
use anyhow::Result;
use std::time::Instant;

/// One request's timing.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LatencySample {
    /// Seconds from submission to the first token (the prefill).
    pub prefill_s: f64,
    /// Seconds from the first token to the last.
    pub decode_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

impl LatencySample {
    /// Prompt tokens per second of prefill.
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s
    }

    /// Generated tokens per second after the first.
    pub fn decode_tps(&self) -> f64 {
        (self.output_tokens.saturating_sub(1)) as f64 / self.decode_s
    }
}

/// Runs one request of `prompt` with exactly `output_len` generated tokens.
pub fn run_once(
    core: &mut EngineCore,
    prompt: Vec<u32>,
    output_len: usize,
    tag: usize,
) -> Result<LatencySample> {
    let params = SamplingParams {
        max_tokens: Some(output_len),
        ignore_eos: true,
        ..SamplingParams::greedy(output_len)
    };
    let prompt_tokens = prompt.len();
    let started = Instant::now();
    core.add_request(
        format!("latency-{tag}"),
        prompt,
        params,
        RequestOptions {
            cache_salt: tag as u64,
            ..Default::default()
        },
    )?;
    let mut first = None;
    let mut output_tokens = 0;
    while core.has_unfinished() {
        for o in core.step()? {
            output_tokens += o.new_token_ids.len();
            first.get_or_insert_with(Instant::now);
        }
    }
    let end = Instant::now();
    let first = first.unwrap_or(end);
    Ok(LatencySample {
        prefill_s: (first - started).as_secs_f64(),
        decode_s: (end - first).as_secs_f64(),
        prompt_tokens,
        output_tokens,
    })
}
