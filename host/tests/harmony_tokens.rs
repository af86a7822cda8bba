//! Harmony's markers as gpt-oss's tokenizer has them, special tokens: the
//! `openai_gptoss` reasoning parser and the `openai` tool parser read the
//! text the incremental detokenizer streams with special tokens kept (what
//! the server asks for when harmony is read), one token at a time; with
//! them skipped, as by default, the markers would be gone and nothing
//! could be split, which is why the server keeps them. The tokenizer is
//! the byte-level BPE of tests/fixtures/hf-families/llama with the seven
//! markers added as special tokens, as o200k_harmony adds them. Where the
//! markers are special, a structured-output constraint waits for the
//! `final` channel's header; where they are text, it does not.

use pagoda::server::openai::harmony;
use pagoda::server::openai::reasoning::{ReasoningParser, ReasoningStream};
use pagoda::server::openai::tool_parsers::ToolCallParser;
use pagoda::tokenizer::detokenizer::IncrementalDetokenizer;
use pagoda::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

const MARKERS: [&str; 7] = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
];

fn harmony_tokenizer(dir: &Path) -> Tokenizer {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families/llama");
    let mut tj: Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer.json")).expect("tokenizer.json"))
            .expect("json");
    let vocab = tj["model"]["vocab"].as_object().expect("vocab").len();
    let added = tj["added_tokens"].as_array_mut().expect("added_tokens");
    let next = added
        .iter()
        .filter_map(|t| t["id"].as_u64())
        .map(|id| id as usize + 1)
        .max()
        .unwrap_or(0)
        .max(vocab);
    for (i, m) in MARKERS.iter().enumerate() {
        added.push(
            json!({"id": next + i, "content": m, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).expect("write");
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .expect("copy");
    Tokenizer::from_hf_dir(dir).expect("tokenizer")
}

/// Streams `ids` through the detokenizer into the reasoning parser, one
/// token per step; returns (reasoning, answer).
fn stream(tok: &Arc<Tokenizer>, ids: &[u32], skip_special: bool) -> (String, String) {
    let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], skip_special);
    let mut s = ReasoningStream::default();
    let p = ReasoningParser::GptOss { calls: true };
    let (mut r, mut a) = (String::new(), String::new());
    for (i, &id) in ids.iter().enumerate() {
        let mut text = detok.push(id).expect("push");
        let last = i + 1 == ids.len();
        if last {
            text.push_str(&detok.finish());
        }
        let (rd, ad) = s.push(p, &text, 1, last);
        r += &rd;
        a += &ad;
    }
    (r, a)
}

#[test]
fn harmony_special_tokens_are_read_from_the_streamed_text() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = Arc::new(harmony_tokenizer(dir.path()));
    let output = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}<|call|>";
    let ids = tok.encode(output, false).expect("encode");
    // Each marker is one special token.
    for m in MARKERS.iter().filter(|m| **m != "<|return|>") {
        let id = tok.token_to_id(m).expect("marker token");
        assert!(tok.is_special(id), "{m}");
        assert!(ids.contains(&id), "{m} encoded as its token");
    }

    let (reasoning, answer) = stream(&tok, &ids, false);
    assert_eq!(reasoning, "Need the weather.");
    let parsed = ToolCallParser::OpenAi.parse(&answer);
    assert_eq!(parsed.content, None, "{answer:?}");
    assert_eq!(parsed.calls.len(), 1, "{answer:?}");
    assert_eq!(parsed.calls[0].name, "get_weather");
    let args: Value = serde_json::from_str(&parsed.calls[0].arguments).expect("arguments");
    assert_eq!(args, json!({"location": "Paris"}));

    // The final channel, ended by `<|return|>`.
    let output = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>";
    let ids = tok.encode(output, false).expect("encode");
    assert_eq!(
        stream(&tok, &ids, false),
        ("Easy.".to_string(), "It is sunny.".to_string())
    );
    // Skipped, the markers are gone: nothing tells the channels apart.
    let (reasoning, answer) = stream(&tok, &ids, true);
    assert_eq!(reasoning, "");
    assert!(
        answer.contains("analysis") && answer.contains("final"),
        "{answer}"
    );
}

#[test]
fn a_constraint_waits_for_the_final_header_only_where_markers_are_special() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = harmony_tokenizer(dir.path());
    let ids = harmony::final_header_ids(&tok);
    let channel = tok.token_to_id("<|channel|>").expect("channel");
    let message = tok.token_to_id("<|message|>").expect("message");
    assert_eq!(ids.first(), Some(&channel), "{ids:?}");
    assert_eq!(ids.last(), Some(&message), "{ids:?}");
    assert_eq!(
        tok.decode(&ids, false).expect("decode"),
        "<|channel|>final<|message|>"
    );
    // The plain tokenizer: no special markers, no wait.
    let plain = Tokenizer::from_hf_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families/llama"),
    )
    .expect("tokenizer");
    assert!(harmony::final_header_ids(&plain).is_empty());
}
