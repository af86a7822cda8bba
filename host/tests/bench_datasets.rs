//! The benchmark workloads of `pagoda bench`, on the demo model's tokenizer.

mod common;

use pagoda::bench::datasets::{generate, Dataset, SEED_PROMPT};
use pagoda::engine::loader::gguf::GgufFile;
use pagoda::engine::Prompt;
use pagoda::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    let g = GgufFile::open(&common::demo_gguf()).expect("demo GGUF");
    Tokenizer::from_gguf(&g).expect("tokenizer")
}

fn ids(p: &Prompt) -> &[u32] {
    match p {
        Prompt::Tokens(t) => t,
        Prompt::Text(_) => panic!("datasets hand the engine token ids"),
    }
}

#[test]
fn random_prompts_have_the_requested_length_and_differ_by_seed() {
    let tok = tokenizer();
    let a = generate(&Dataset::Random, &tok, 5, 64, 7, 1).expect("random");
    assert_eq!(a.len(), 5);
    for r in &a {
        assert_eq!(r.prompt_len, 64);
        assert_eq!(ids(&r.prompt).len(), 64);
        assert_eq!(r.output_len, 7);
        // The text round-trips to the same ids, so HTTP peers see the same prompt.
        assert_eq!(
            tok.encode(&r.prompt_text, false).expect("encode"),
            ids(&r.prompt)
        );
    }
    assert_ne!(a[0].prompt_text, a[1].prompt_text);
    let b = generate(&Dataset::Random, &tok, 5, 64, 7, 2).expect("random");
    assert_ne!(
        a[0].prompt_text, b[0].prompt_text,
        "another seed, other prompts"
    );
    let again = generate(&Dataset::Random, &tok, 5, 64, 7, 1).expect("random");
    assert_eq!(
        a[3].prompt_text, again[3].prompt_text,
        "the same seed, the same prompts"
    );
}

#[test]
fn the_seed_workload_is_the_chat_templated_prompt_every_time() {
    let tok = tokenizer();
    let r = generate(&Dataset::Seed, &tok, 3, 0, 256, 0).expect("seed");
    assert_eq!(r.len(), 3);
    assert!(r[0].prompt_text.contains(SEED_PROMPT));
    assert!(r[0].prompt_text.starts_with("<|im_start|>"));
    assert!(r
        .iter()
        .all(|x| x.prompt_text == r[0].prompt_text && x.output_len == 256));
}

#[test]
fn prefix_repetition_shares_a_long_prefix() {
    let tok = tokenizer();
    let r = generate(
        &Dataset::PrefixRepetition { prefix_len: 200 },
        &tok,
        4,
        16,
        8,
        3,
    )
    .expect("prefix");
    let shared = ids(&r[0].prompt)
        .iter()
        .zip(ids(&r[1].prompt))
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared >= 190, "only {shared} shared tokens");
    assert_ne!(r[0].prompt_text, r[1].prompt_text);
}

#[test]
fn jsonl_prompts_are_read_with_their_output_lengths_and_bad_lines_are_named() {
    let tok = tokenizer();
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("p.jsonl");
    std::fs::write(
        &f,
        "{\"prompt\": \"Hello\", \"output_len\": 3}\n\n{\"prompt\": \"World\"}\n",
    )
    .expect("write");
    let r = generate(&Dataset::Jsonl(f.clone()), &tok, 10, 0, 9, 0).expect("jsonl");
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].output_len, r[1].output_len), (3, 9));
    std::fs::write(&f, "{\"prompt\": \"ok\"}\n{\"text\": 1}\n").expect("write");
    let e = format!(
        "{:#}",
        generate(&Dataset::Jsonl(f), &tok, 10, 0, 9, 0).expect_err("bad line")
    );
    assert!(e.contains(":2:") && e.contains("prompt"), "{e}");
}

#[test]
fn rewrite_prompts_ask_for_their_passage_and_expect_its_length() {
    use pagoda::bench::datasets::REWRITE_PASSAGES;
    let tok = tokenizer();
    let n = REWRITE_PASSAGES.len() + 2;
    let reqs = generate(&"rewrite".parse().expect("dataset"), &tok, n, 0, 100, 0).expect("rewrite");
    assert_eq!(reqs.len(), n);
    for (i, r) in reqs.iter().enumerate() {
        let passage = REWRITE_PASSAGES[i % REWRITE_PASSAGES.len()];
        assert!(r.prompt_text.contains(passage), "{}", r.prompt_text);
        // A chat turn of the model's template, which opens the answer.
        assert!(
            r.prompt_text.contains("<|im_start|>assistant"),
            "{}",
            r.prompt_text
        );
        let passage_len = tok.encode(passage, false).expect("encode").len();
        assert_eq!(r.output_len, passage_len.min(100));
        assert_eq!(r.prompt_len, ids(&r.prompt).len());
    }
}
