//! `pagoda generate`: batched offline generation from the command line.
//! Generated text goes to stdout and logs to stderr.

use super::EngineFlags;
use crate::engine::llm::{Prompt, LLM};
use crate::engine::request::{SamplingDefaults, SamplingParams};
use crate::tokenizer::chat_template::ChatMessage;
use anyhow::{Context, Result};
use clap::Args;

/// Flags of `pagoda generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// A prompt; repeat for several, which run batched.
    #[arg(long = "prompt", required = true)]
    pub prompts: Vec<String>,
    /// Default: the model's max_new_tokens (generation_config.json), else 128.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// 0 is greedy. Default: the model's temperature, else 0.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Default: the model's top_p, else 1.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Default: the model's top_k, else 0 (off).
    #[arg(long)]
    pub top_k: Option<i32>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Apply the model's chat template to each prompt as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object per prompt: {"prompt", "text", "token_ids", "finish_reason"}.
    #[arg(long)]
    pub json: bool,
}

/// Runs `pagoda generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let mut llm = LLM::new(args.engine.to_engine_args()?)?;
    let prompts: Vec<Prompt> = if args.chat {
        let tmpl = llm
            .tokenizer()
            .chat_template()
            .context("--chat: the model has no chat template")?;
        args.prompts
            .iter()
            .map(|p| {
                tmpl.render(
                    &[ChatMessage {
                        role: "user".into(),
                        content: p.clone(),
                    }],
                    true,
                )
                .map(Prompt::Text)
            })
            .collect::<Result<_>>()?
    } else {
        args.prompts.iter().cloned().map(Prompt::Text).collect()
    };
    let mut params = SamplingParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        ..Default::default()
    };
    // This command's own defaults (greedy, 128 tokens) sit under the
    // model's: the engine fills the rest from its generation config.
    params.apply_defaults(&llm.sampling_defaults().fallback_under(SamplingDefaults {
        temperature: Some(0.0),
        max_tokens: Some(128),
        ..Default::default()
    }));
    let started = std::time::Instant::now();
    let outputs = llm.generate(&prompts, &params)?;
    let secs = started.elapsed().as_secs_f64();
    let mut generated = 0;
    for (prompt, out) in args.prompts.iter().zip(&outputs) {
        let c = &out.outputs[0];
        generated += c.token_ids.len();
        if args.json {
            let v = serde_json::json!({
                "prompt": prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason.map(|f| f.as_str()),
            });
            println!("{v}");
        } else {
            println!("{}", c.text);
        }
    }
    tracing::info!(
        "generated {generated} tokens for {} prompts in {secs:.2} s ({:.1} tok/s)",
        outputs.len(),
        generated as f64 / secs.max(1e-9)
    );
    Ok(())
}
