//! The seed's offline-throughput script, on Pagoda's `LLM` API:
//! 100 × "介绍一下深度学习" as chat turns, max_tokens 256, all batched.
//!
//! ```bash
//! cargo run --release --example offline_throughput -- "$(scripts/fetch-demo-model.sh)"
//! ```

use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use pagoda::tokenizer::chat_template::ChatMessage;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let model = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: offline_throughput MODEL [THREADS]"))?;
    let mut args = EngineArgs::new(model);
    args.threads = std::env::args()
        .nth(2)
        .map(|t| t.parse())
        .transpose()?
        .unwrap_or(0);
    args.max_model_len = Some(2048);
    let mut llm = LLM::new(args)?;
    let template = llm
        .tokenizer()
        .chat_template()
        .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))?;
    let text = template.render(
        &[ChatMessage {
            role: "user".into(),
            content: "介绍一下深度学习".into(),
        }],
        true,
    )?;
    let prompts: Vec<Prompt> = (0..100).map(|_| Prompt::Text(text.clone())).collect();
    let params = SamplingParams {
        max_tokens: Some(256),
        temperature: Some(0.8),
        top_p: Some(0.95),
        seed: Some(0),
        ..Default::default()
    };
    let started = Instant::now();
    let outputs = llm.generate(&prompts, &params)?;
    let secs = started.elapsed().as_secs_f64();
    let total: usize = outputs.iter().map(|o| o.outputs[0].token_ids.len()).sum();
    println!("total tokens: {total}");
    println!("seconds: {secs:.2}");
    println!("tok/s: {:.1}", total as f64 / secs);
    Ok(())
}
