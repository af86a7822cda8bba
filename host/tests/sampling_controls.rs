//! `allowed_token_ids` and bad words through the engine, on the demo
//! model: allowed ids restrict every sampled token, greedy or sampled; a
//! bad word never appears, however likely the model finds it; bad words
//! written as text are tokenized as vLLM does; ids outside the vocabulary
//! are refused as parameter errors.

mod common;

use pagoda::engine::core::RequestOptions;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};

fn llm() -> LLM {
    let mut a = EngineArgs::new(common::demo_gguf());
    a.threads = 2;
    a.max_model_len = Some(256);
    a.kv_cache_memory = Some(32 << 20);
    LLM::new(a).expect("engine")
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "List three prime numbers:",
    "Once upon a time, there lived an old miller who",
];

fn prompts() -> Vec<Prompt> {
    PROMPTS
        .iter()
        .map(|t| Prompt::Text(t.to_string()))
        .collect()
}

/// The outputs' ids, prompt by prompt and sample by sample.
fn outputs(llm: &mut LLM, p: &SamplingParams) -> Vec<Vec<Vec<u32>>> {
    llm.generate(&prompts(), p)
        .expect("generate")
        .into_iter()
        .map(|r| r.outputs.into_iter().map(|c| c.token_ids).collect())
        .collect()
}

#[test]
fn allowed_ids_restrict_every_sampled_token() {
    let mut llm = llm();
    let mut greedy = SamplingParams::greedy(12);
    greedy.ignore_eos = true;
    let free = outputs(&mut llm, &greedy);
    // Allowed: a few ids the model would not choose on its own, and one it
    // would (the first greedy token of the first prompt).
    let allowed: Vec<u32> = vec![free[0][0][0], 11, 284, 1552, 5024, 9018];
    assert!(
        free.iter()
            .flatten()
            .flatten()
            .any(|t| !allowed.contains(t)),
        "the unrestricted outputs already keep to the allowed ids: the test proves nothing"
    );
    let sampled = SamplingParams {
        n: 2,
        max_tokens: Some(12),
        temperature: Some(1.2),
        top_p: Some(0.95),
        seed: Some(3),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    for base in [greedy, sampled] {
        let p = SamplingParams {
            allowed_token_ids: Some(allowed.clone()),
            logprobs: Some(2),
            ..base
        };
        let got = llm.generate(&prompts(), &p).expect("generate");
        for r in &got {
            for c in &r.outputs {
                assert_eq!(c.token_ids.len(), 12);
                for &t in &c.token_ids {
                    assert!(
                        allowed.contains(&t),
                        "{t} is not allowed: {:?}",
                        c.token_ids
                    );
                }
                // Logprobs describe the model's own distribution (vLLM's
                // default), so they are there for the chosen ids.
                let lps = c.logprobs.as_ref().expect("logprobs");
                assert_eq!(lps.len(), c.token_ids.len());
                for (l, &t) in lps.iter().zip(&c.token_ids) {
                    assert_eq!(l.token_id, t);
                    assert!(l.logprob.is_finite() && l.logprob <= 0.0);
                }
            }
        }
    }
}

#[test]
fn a_bad_word_never_appears() {
    let mut llm = llm();
    let mut greedy = SamplingParams::greedy(16);
    greedy.ignore_eos = true;
    let free = outputs(&mut llm, &greedy);
    // A one-token word the greedy output uses, and a two-token word (a
    // pair of its consecutive tokens).
    let out = &free[2][0];
    let single = out[1];
    let pair = [out[4], out[5]];
    let contains_pair = |ids: &[u32]| ids.windows(2).any(|w| w == pair);
    assert!(out.contains(&single) && contains_pair(out));
    for base in [
        greedy.clone(),
        SamplingParams {
            n: 3,
            max_tokens: Some(16),
            temperature: Some(0.8),
            seed: Some(11),
            ignore_eos: true,
            ..SamplingParams::default()
        },
    ] {
        let p = SamplingParams {
            bad_words_token_ids: vec![vec![single], pair.to_vec()],
            ..base
        };
        for (i, per_prompt) in outputs(&mut llm, &p).iter().enumerate() {
            for ids in per_prompt {
                assert!(!ids.contains(&single), "prompt {i}: {single} in {ids:?}");
                assert!(!contains_pair(ids), "prompt {i}: {pair:?} in {ids:?}");
            }
        }
    }
    // The ban changed the greedy output: the word was really the model's
    // choice.
    let p = SamplingParams {
        bad_words_token_ids: vec![vec![single]],
        ..greedy
    };
    assert_ne!(outputs(&mut llm, &p)[2][0], *out);
}

#[test]
fn ids_outside_the_vocabulary_are_parameter_errors() {
    let mut llm = llm();
    let vocab = llm.engine().runner().config().vocab_size as u32;
    let cases = [
        (
            SamplingParams {
                allowed_token_ids: Some(vec![5, vocab]),
                ..SamplingParams::greedy(4)
            },
            "allowed_token_ids",
        ),
        (
            SamplingParams {
                allowed_token_ids: Some(Vec::new()),
                ..SamplingParams::greedy(4)
            },
            "allowed_token_ids",
        ),
        (
            SamplingParams {
                bad_words_token_ids: vec![vec![7], vec![3, vocab + 9]],
                ..SamplingParams::greedy(4)
            },
            "bad_words",
        ),
        (
            SamplingParams {
                bad_words_token_ids: vec![Vec::new()],
                ..SamplingParams::greedy(4)
            },
            "bad_words",
        ),
    ];
    for (p, param) in cases {
        let e = llm
            .engine_mut()
            .add_request("bad".into(), vec![1, 2, 3], p, RequestOptions::default())
            .expect_err("refused");
        assert_eq!(e.param, param, "{e}");
    }
    // The last id of the vocabulary is fine.
    llm.engine_mut()
        .add_request(
            "ok".into(),
            vec![1, 2, 3],
            SamplingParams {
                allowed_token_ids: Some(vec![vocab - 1]),
                bad_words_token_ids: vec![vec![vocab - 1, 4]],
                ..SamplingParams::greedy(4)
            },
            RequestOptions::default(),
        )
        .expect("accepted");
}

#[test]
fn bad_words_as_text_are_tokenized_with_and_without_a_leading_space() {
    let llm = llm();
    let tok = llm.tokenizer();
    let enc = |t: &str| tok.encode(t, false).expect("encode");
    // "Paris" and " Paris" start with different tokens in as many tokens:
    // both are banned (at the start of a text, and after a space).
    let ids = tok
        .bad_words_ids(&["  Paris".to_string(), "hello world".to_string()])
        .expect("tokenized");
    let mut want = Vec::new();
    for w in ["Paris", "hello world"] {
        let (alone, spaced) = (enc(w), enc(&format!(" {w}")));
        let keep = spaced[0] != alone[0] && spaced.len() == alone.len();
        want.push(alone);
        if keep {
            want.push(spaced);
        }
    }
    assert_eq!(ids, want);
    assert!(ids.contains(&enc(" Paris")), "{ids:?}");
    assert!(tok.bad_words_ids(&[" \t".to_string()]).is_err());
}
