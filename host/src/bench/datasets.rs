//! Benchmark workloads: what prompts to send and how long to generate.

use crate::engine::llm::Prompt;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// The seed workload's prompt: "introduce deep learning" as a chat turn.
pub const SEED_PROMPT: &str = "介绍一下深度学习";

/// One benchmark request.
#[derive(Clone, Debug)]
pub struct BenchRequest {
    pub prompt: Prompt,
    /// The same prompt as text, for HTTP clients.
    pub prompt_text: String,
    pub prompt_len: usize,
    pub output_len: usize,
    /// Its place in the workload.
    pub index: usize,
}

/// Which workload to generate.
#[derive(Clone, Debug, PartialEq)]
pub enum Dataset {
    /// Random tokens, `input_len` in and `output_len` out.
    Random,
    /// The seed's workload: the same chat prompt for every request.
    Seed,
    /// A long shared prefix plus a short unique suffix per request.
    PrefixRepetition { prefix_len: usize },
    /// One prompt per line: `{"prompt": "...", "output_len": N}`.
    Jsonl(std::path::PathBuf),
    /// Passage rewriting: a chat turn asking to repeat a passage word for
    /// word, the output as long as the passage (at most `output_len`).
    /// The output quotes the prompt, which is where prompt-lookup
    /// speculative decoding helps; `random` is where it cannot.
    Rewrite,
}

/// The passages of the rewrite workload: plain prose and code, about 80
/// to 130 tokens each.
pub const REWRITE_PASSAGES: &[&str] = &[
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great lens, and wound the clockwork that turned the light. Ships passing the headland saw the beam sweep across the water every ten seconds, and they knew where the rocks lay. In winter the storms came from the north, and spray reached the lantern room a hundred feet above the sea.",
    "Bread needs only flour, water, salt and yeast, but time is the ingredient most recipes forget. A slow first rise in a cool kitchen lets the dough develop flavour, and a second, shorter rise after shaping gives the loaf its height. Bake it hot, with steam for the first ten minutes, so that the crust stays thin while the inside springs up.",
    "fn parse_port(s: &str) -> Result<u16, String> {\n    let n: u32 = s.trim().parse().map_err(|e| format!(\"{s}: {e}\"))?;\n    if n == 0 || n > 65535 {\n        return Err(format!(\"{n} is not a port\"));\n    }\n    Ok(n as u16)\n}",
    "The committee met on Tuesday to review the budget for the coming year. Spending on roads will rise by four percent, while the library keeps its current funding. A new bus route will connect the north side of town to the hospital, starting in March. Residents may comment on the plan at the town hall until the end of the month.",
    "Rivers carry sand and silt from the mountains to the sea. Where the current slows, at a bend or at the mouth, the sediment settles and builds banks, bars and deltas. Over centuries a delta can push the coastline many miles outward, and the channels that cross it shift with every great flood.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be positive\")\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n            out.append(total / window)\n    return out",
    "The museum opens at nine in the morning and closes at five, except on Thursdays, when it stays open until eight. Tickets are free for children under twelve and for students with a card. The east wing, which holds the collection of maps, is closed for repairs until the spring.",
    "A good cup of tea starts with fresh water brought just to the boil. Warm the pot first, add one spoon of leaves for each cup, and pour the water over them. Let it steep for three to five minutes, depending on how strong you like it, then pour through a strainer.",
];

impl std::str::FromStr for Dataset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "random" => Dataset::Random,
            "seed" => Dataset::Seed,
            // vLLM's `--dataset-name prefix_repetition` too.
            "rewrite" | "passage-rewrite" | "passage_rewrite" => Dataset::Rewrite,
            "prefix-repetition" | "prefix_repetition" => {
                Dataset::PrefixRepetition { prefix_len: 1024 }
            }
            path if path.ends_with(".jsonl") => Dataset::Jsonl(path.into()),
            "custom" => bail!("--dataset-name custom needs --dataset-path FILE.jsonl"),
            other => {
                bail!("--dataset '{other}' is not random, seed, rewrite, prefix-repetition (prefix_repetition), custom with --dataset-path, or a .jsonl file")
            }
        })
    }
}

/// Random text of about `len` tokens: random ids from the ordinary part of
/// the vocabulary, decoded and re-encoded so the text round-trips.
fn random_text(tok: &Tokenizer, rng: &mut StdRng, len: usize) -> Result<(String, Vec<u32>)> {
    let vocab = tok.vocab_size() as u32;
    let lo = 256.min(vocab / 4);
    let mut ids: Vec<u32> = Vec::with_capacity(len);
    while ids.len() < len {
        let id = rng.random_range(lo..vocab);
        if !tok.is_special(id) {
            ids.push(id);
        }
    }
    let text = tok.decode(&ids, true)?;
    let mut re = tok.encode(&text, false)?;
    re.truncate(len);
    let text = tok.decode(&re, true)?;
    Ok((text, re))
}

/// Builds `num` requests of the dataset. Random prompts start with a
/// per-run random prefix so that no cache (ours or a peer's) flatters them.
pub fn generate(
    dataset: &Dataset,
    tok: &Tokenizer,
    num: usize,
    input_len: usize,
    output_len: usize,
    seed: u64,
) -> Result<Vec<BenchRequest>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(num);
    match dataset {
        Dataset::Random => {
            for _ in 0..num {
                let (text, ids) = random_text(tok, &mut rng, input_len)?;
                out.push(BenchRequest {
                    index: out.len(),
                    prompt_len: ids.len(),
                    prompt: Prompt::Tokens(ids),
                    prompt_text: text,
                    output_len,
                });
            }
        }
        Dataset::Seed => {
            let text = match tok.chat_template() {
                Some(t) => t.render(
                    &[crate::tokenizer::chat_template::ChatMessage {
                        role: "user".into(),
                        content: SEED_PROMPT.into(),
                    }],
                    true,
                )?,
                None => SEED_PROMPT.to_string(),
            };
            let ids = tok.encode(&text, true)?;
            for _ in 0..num {
                out.push(BenchRequest {
                    index: out.len(),
                    prompt: Prompt::Tokens(ids.clone()),
                    prompt_text: text.clone(),
                    prompt_len: ids.len(),
                    output_len,
                });
            }
        }
        Dataset::Rewrite => {
            for i in 0..num {
                let passage = REWRITE_PASSAGES[i % REWRITE_PASSAGES.len()];
                let ask = format!(
                    "Repeat the following passage exactly, word for word.\n\nPassage: {passage}"
                );
                let text = match tok.chat_template() {
                    Some(t) => t.render(
                        &[crate::tokenizer::chat_template::ChatMessage {
                            role: "user".into(),
                            content: ask,
                        }],
                        true,
                    )?,
                    None => format!("{ask}\n\n"),
                };
                let ids = tok.encode(&text, true)?;
                let passage_len = tok.encode(passage, false)?.len();
                out.push(BenchRequest {
                    index: out.len(),
                    prompt_len: ids.len(),
                    prompt: Prompt::Tokens(ids),
                    prompt_text: text,
                    output_len: output_len.min(passage_len),
                });
            }
        }
        Dataset::PrefixRepetition { prefix_len } => {
            let (prefix, _) = random_text(tok, &mut rng, *prefix_len)?;
            for _ in 0..num {
                let (suffix, _) = random_text(tok, &mut rng, input_len.max(1))?;
                let text = format!("{prefix}{suffix}");
                let ids = tok.encode(&text, false)?;
                out.push(BenchRequest {
                    index: out.len(),
                    prompt_len: ids.len(),
                    prompt: Prompt::Tokens(ids),
                    prompt_text: text,
                    output_len,
                });
            }
        }
        Dataset::Jsonl(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("{}: cannot read", path.display()))?;
            for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
                if out.len() == num {
                    break;
                }
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{}:{}: not a JSON object", path.display(), i + 1))?;
                let prompt = v["prompt"].as_str().with_context(|| {
                    format!("{}:{}: no \"prompt\" string", path.display(), i + 1)
                })?;
                let ids = tok.encode(prompt, true)?;
                let n = v["output_len"].as_u64().map_or(output_len, |n| n as usize);
                out.push(BenchRequest {
                    index: out.len(),
                    prompt_len: ids.len(),
                    prompt: Prompt::Tokens(ids),
                    prompt_text: prompt.into(),
                    output_len: n,
                });
            }
            if out.is_empty() {
                bail!("{}: no prompts", jsonl_name(path));
            }
        }
    }
    Ok(out)
}

fn jsonl_name(p: &Path) -> String {
    p.display().to_string()
}
