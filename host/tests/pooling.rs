//! Pooling models through the engine's ordinary batches, against
//! sentence-transformers' float32 outputs (tests/fixtures/pooling, written
//! by scripts/make-pooling-fixtures.py).
//!
//! qwen3-embed is Qwen3-Embedding's form: a `Qwen3Model` checkpoint without
//! the `model.` prefix, a tokenizer that appends `<|endoftext|>`, and
//! sentence-transformers' modules.json with last-token pooling and
//! Normalize. Each vector must reach cosine 0.99999 with
//! sentence-transformers', batched with the others or alone.

use pagoda::engine::core::RequestOptions;
use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use serde_json::Value;
use std::path::{Path, PathBuf};

const MIN_COSINE: f64 = 0.99999;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/pooling")
        .join(name)
}

fn reference(name: &str) -> Value {
    let p = fixture(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json"))
        .expect("reference.json is JSON")
}

fn args(model: &Path) -> EngineArgs {
    let mut a = EngineArgs::new(model);
    a.threads = 2;
    a.dtype = DType::Float32;
    a.max_model_len = Some(64);
    a.kv_cache_memory = Some(8 << 20);
    a
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "vector lengths differ");
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * y).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn qwen3_embedding_matches_sentence_transformers_batched_and_alone() {
    let r = reference("qwen3-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    // `Qwen3Model` with modules.json: served for pooling without flags.
    let mut llm = LLM::new(args(&fixture("qwen3-embed"))).expect("load qwen3-embed");
    let prompts: Vec<Prompt> = inputs
        .iter()
        .map(|i| Prompt::Text(i["text"].as_str().expect("text").into()))
        .collect();
    for (p, i) in prompts.iter().zip(inputs) {
        let want: Vec<u32> = i["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let Prompt::Text(t) = p else { unreachable!() };
        let got = llm.tokenizer().encode_for_pooling(t).expect("encode");
        assert_eq!(got, want, "tokenization (EOS appended)");
    }
    let batched = llm.embed(&prompts, None).expect("embed batched");
    for (k, (v, i)) in batched.iter().zip(inputs).enumerate() {
        let want = floats(&i["embedding"]);
        let c = cosine(v, &want);
        assert!(
            c >= MIN_COSINE,
            "input {k}: cosine {c} with sentence-transformers"
        );
        let norm: f64 = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "input {k}: norm {norm}");
        // Componentwise too: a cosine near 1 with a wrong scale would
        // still pass the check above if normalization were skipped.
        for (x, y) in v.iter().zip(&want) {
            assert!((f64::from(*x) - y).abs() < 1e-4, "input {k}: {x} vs {y}");
        }
        let alone = llm.embed(&prompts[k..=k], None).expect("embed alone");
        assert_eq!(&alone[0], v, "input {k}: batched and alone differ");
    }
    let dims = &r["dimensions"]["16"].as_array().expect("dimensions 16");
    let short = llm.embed(&prompts, Some(16)).expect("embed dimensions 16");
    for (k, (v, want)) in short.iter().zip(dims.iter()).enumerate() {
        let c = cosine(v, &floats(want));
        assert!(c >= MIN_COSINE, "input {k}, 16 dimensions: cosine {c}");
    }
}

#[test]
fn pooling_and_generation_refuse_each_other_naming_the_endpoint() {
    let mut llm = LLM::new(args(&fixture("qwen3-embed"))).expect("load qwen3-embed");
    let e = llm
        .generate(&[Prompt::Tokens(vec![5, 6, 7])], &SamplingParams::default())
        .expect_err("generation on a pooling model");
    assert!(format!("{e:#}").contains("/v1/embeddings"), "{e:#}");
    // Over the context: vLLM's message for embedding inputs.
    let long = Prompt::Tokens(vec![5; 65]);
    let e = llm.embed(&[long], None).expect_err("65 tokens in 64");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("maximum context length is 64 tokens")
            && msg.contains("65 tokens in the input for embedding generation"),
        "{msg}"
    );
    // A whole context's worth fits: nothing is generated after it.
    llm.embed(&[Prompt::Tokens(vec![5; 64])], None)
        .expect("64 tokens in 64");

    let mut gen_args = args(&fixture("qwen3-embed"));
    gen_args.runner = pagoda::engine::pooling::RunnerKind::Generate;
    let mut gen = LLM::new(gen_args).expect("the same checkpoint for generation");
    let e = gen
        .engine_mut()
        .add_request(
            "x".into(),
            vec![5, 6],
            SamplingParams::default(),
            RequestOptions {
                pooling: true,
                ..Default::default()
            },
        )
        .expect_err("pooling on a generation model");
    assert!(e.message.contains("--runner pooling"), "{}", e.message);
}

/// A copy of qwen3-embed as a plain causal checkpoint: `Qwen3ForCausalLM`,
/// no sentence-transformers files. Only the flags can make it pool.
fn causal_copy(tag: &str) -> PathBuf {
    let src = fixture("qwen3-embed");
    let dst = std::env::temp_dir().join(format!("pagoda-pooling-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy fixture file");
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("config JSON");
    c["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    std::fs::write(dst.join("config.json"), c.to_string()).expect("write config");
    dst
}

#[test]
fn runner_convert_and_pooler_config_flags_decide_pooling_as_vllm_reads_them() {
    use pagoda::engine::pooling::{ConvertKind, RunnerKind};
    let dir = causal_copy("flags");
    let r = reference("qwen3-embed");
    let first = &r["inputs"][0];
    let prompt = Prompt::Text(first["text"].as_str().expect("text").into());
    let want = floats(&first["embedding"]);

    // A causal checkpoint without pooling files generates by default.
    let mut gen = LLM::new(args(&dir)).expect("load as generation");
    let e = gen
        .embed(std::slice::from_ref(&prompt), None)
        .expect_err("embedding with a generation model");
    assert!(format!("{e:#}").contains("--runner pooling"), "{e:#}");

    // --runner pooling, and --convert embed under --runner auto: vLLM's
    // default for a converted decoder is the last token, normalized, which
    // is what Qwen3-Embedding's own files say.
    for (runner, convert) in [
        (RunnerKind::Pooling, ConvertKind::Auto),
        (RunnerKind::Auto, ConvertKind::Embed),
    ] {
        let mut a = args(&dir);
        a.runner = runner;
        a.convert = convert;
        let mut llm = LLM::new(a).expect("load for pooling");
        let v = llm
            .embed(std::slice::from_ref(&prompt), None)
            .expect("embed");
        let c = cosine(&v[0], &want);
        assert!(c >= MIN_COSINE, "{runner:?}/{convert:?}: cosine {c}");
    }

    // --pooler-config normalize false: the raw hidden state, whose
    // direction is still sentence-transformers'.
    let mut a = args(&dir);
    a.runner = RunnerKind::Pooling;
    a.pooler_config = Some(r#"{"normalize": false}"#.into());
    let mut raw = LLM::new(a).expect("load unnormalized");
    let v = raw
        .embed(std::slice::from_ref(&prompt), None)
        .expect("embed raw");
    let norm: f64 = v[0]
        .iter()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        (norm - 1.0).abs() > 1e-2,
        "not normalized, yet its norm is {norm}"
    );
    assert!(cosine(&v[0], &want) >= MIN_COSINE);

    // What is not implemented is refused at start-up, by name.
    for (json, word) in [
        (r#"{"pooling_type": "MEAN"}"#, "MEAN"),
        (r#"{"softmax": true}"#, "softmax"),
    ] {
        let mut a = args(&dir);
        a.runner = RunnerKind::Pooling;
        a.pooler_config = Some(json.into());
        let e = LLM::new(a).err().expect("refused");
        assert!(format!("{e:#}").contains(word), "{json}: {e:#}");
    }
    let mut a = args(&dir);
    a.convert = ConvertKind::Classify;
    let e = LLM::new(a).err().expect("classify refused");
    assert!(format!("{e:#}").contains("classify"), "{e:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A long input is prefilled in chunks over several steps (here 8 tokens
/// a step, beside the other inputs' chunks), and queued inputs wait for a
/// sequence slot: the vector is read only at the chunk that ends the
/// prompt, and is still sentence-transformers'.
#[test]
fn chunked_and_queued_pooling_rows_give_the_same_vectors() {
    let r = reference("qwen3-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let mut a = args(&fixture("qwen3-embed"));
    a.max_num_batched_tokens = 8;
    a.max_num_seqs = 2;
    a.enable_prefix_caching = false;
    let mut llm = LLM::new(a).expect("load qwen3-embed");
    let prompts: Vec<Prompt> = inputs
        .iter()
        .map(|i| Prompt::Text(i["text"].as_str().expect("text").into()))
        .collect();
    let got = llm.embed(&prompts, None).expect("embed in chunks");
    for (k, (v, i)) in got.iter().zip(inputs).enumerate() {
        let c = cosine(v, &floats(&i["embedding"]));
        assert!(c >= MIN_COSINE, "input {k}: cosine {c}");
    }
    // 8 tokens a step: every token of every input was computed in chunks.
    let total: usize = inputs
        .iter()
        .map(|i| i["token_ids"].as_array().map_or(0, Vec::len))
        .sum();
    let steps = llm.engine().stats().steps;
    assert!(
        steps as usize >= total.div_ceil(8),
        "{total} tokens in {steps} steps of at most 8"
    );
}

/// bert-embed: a sentence-transformers `BertModel` (WordPiece, mean
/// pooling, Normalize, layer_norm_eps 1e-7, three token types), served for
/// pooling without flags. Its rows attend both ways, so each input runs
/// whole in one step even under a budget of 8 tokens a step.
#[test]
fn bert_embedding_matches_sentence_transformers() {
    let r = reference("bert-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let prompts: Vec<Prompt> = inputs
        .iter()
        .map(|i| Prompt::Text(i["text"].as_str().expect("text").into()))
        .collect();
    for budget in [None, Some(8)] {
        let mut a = args(&fixture("bert-embed"));
        if let Some(b) = budget {
            a.max_num_batched_tokens = b;
            a.max_num_seqs = 2;
        }
        let mut llm = LLM::new(a).expect("load bert-embed");
        for (p, i) in prompts.iter().zip(inputs) {
            let want: Vec<u32> = i["token_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            let Prompt::Text(t) = p else { unreachable!() };
            let got = llm.tokenizer().encode_for_pooling(t).expect("encode");
            assert_eq!(got, want, "WordPiece with [CLS] and [SEP]");
        }
        let batched = llm.embed(&prompts, None).expect("embed batched");
        for (k, (v, i)) in batched.iter().zip(inputs).enumerate() {
            let want = floats(&i["embedding"]);
            let c = cosine(v, &want);
            assert!(
                c >= MIN_COSINE,
                "budget {budget:?}, input {k}: cosine {c} with sentence-transformers"
            );
            for (x, y) in v.iter().zip(&want) {
                assert!((f64::from(*x) - y).abs() < 1e-4, "input {k}: {x} vs {y}");
            }
            let alone = llm.embed(&prompts[k..=k], None).expect("embed alone");
            assert_eq!(&alone[0], v, "input {k}: batched and alone differ");
        }
        let dims = &r["dimensions"]["16"].as_array().expect("dimensions 16");
        let short = llm.embed(&prompts, Some(16)).expect("embed dimensions 16");
        for (k, (v, want)) in short.iter().zip(dims.iter()).enumerate() {
            let c = cosine(v, &floats(want));
            assert!(c >= MIN_COSINE, "input {k}, 16 dimensions: cosine {c}");
        }
    }
}

/// `--pooler-config` over the model's own 1_Pooling: CLS pooling gives
/// another vector (the `[CLS]` row, not the mean), normalize false leaves
/// the mean unnormalized, whose direction is still the reference's.
#[test]
fn bert_pooler_config_overrides_the_sentence_transformers_files() {
    let r = reference("bert-embed");
    let first = &r["inputs"][0];
    let prompt = Prompt::Text(first["text"].as_str().expect("text").into());
    let want = floats(&first["embedding"]);
    let mut a = args(&fixture("bert-embed"));
    a.pooler_config = Some(r#"{"normalize": false}"#.into());
    let mut raw = LLM::new(a).expect("load unnormalized");
    let v = raw
        .embed(std::slice::from_ref(&prompt), None)
        .expect("embed");
    let norm: f64 = v[0]
        .iter()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        (norm - 1.0).abs() > 1e-2,
        "not normalized, yet its norm is {norm}"
    );
    assert!(cosine(&v[0], &want) >= MIN_COSINE);

    let mut a = args(&fixture("bert-embed"));
    a.pooler_config = Some(r#"{"pooling_type": "CLS"}"#.into());
    let mut cls = LLM::new(a).expect("load CLS");
    let v = cls
        .embed(std::slice::from_ref(&prompt), None)
        .expect("embed");
    let c = cosine(&v[0], &want);
    assert!(c < 0.999, "CLS pooling gave the mean's vector (cosine {c})");
    let norm: f64 = v[0]
        .iter()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
}

/// bert-rerank: `BertForSequenceClassification` with one label; each pair
/// is `[CLS] q [SEP] d [SEP]` with token types 0 then 1, its `[CLS]` row
/// through the pooler (dense, tanh) and the classifier, then a sigmoid:
/// CrossEncoder's scores within 1e-4.
#[test]
fn bert_cross_encoder_scores_match_cross_encoder() {
    let r = reference("bert-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let mut llm = LLM::new(args(&fixture("bert-rerank"))).expect("load bert-rerank");
    for (d, want) in docs
        .iter()
        .zip(r["token_ids"].as_array().expect("token_ids"))
    {
        let packed = llm
            .tokenizer()
            .encode_pair_for_scoring(query, d)
            .expect("encode pair");
        let ids: Vec<u64> = packed
            .iter()
            .map(|&t| u64::from(pagoda_accel::ops::encoder::unpack_token(t).0))
            .collect();
        let want: Vec<u64> = want
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id"))
            .collect();
        assert_eq!(ids, want, "pair tokens");
        // Types: 0 through the first [SEP], 1 after.
        let sep = want.iter().position(|&t| t == 3).expect("[SEP]");
        for (i, &t) in packed.iter().enumerate() {
            let ty = pagoda_accel::ops::encoder::unpack_token(t).1;
            assert_eq!(ty, u32::from(i > sep), "token {i}'s type");
        }
    }
    let pairs: Vec<(&str, &str)> = docs.iter().map(|d| (query, *d)).collect();
    let got = llm.score(&pairs).expect("score");
    let want = floats(&r["scores"]);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() < 1e-4,
            "pair {k}: score {g}, CrossEncoder {w}"
        );
    }
    // Token types matter: the same tokens all of type 0 score otherwise.
    let flat: Vec<u32> = llm
        .tokenizer()
        .encode_pair_for_scoring(query, docs[0])
        .expect("encode")
        .iter()
        .map(|&t| pagoda_accel::ops::encoder::unpack_token(t).0)
        .collect();
    let e = llm.embed(&[Prompt::Tokens(flat)], None).expect("raw logit");
    let s = pagoda::engine::pooling::score_of(&e[0]).expect("one logit");
    assert!((f64::from(s) - want[0]).abs() > 1e-4, "types ignored: {s}");
}

/// An encoder refuses generation and inputs over its context, and the
/// flags that cannot apply to it, each saying what to do instead.
#[test]
fn bert_refuses_generation_long_inputs_and_wrong_flags() {
    use pagoda::engine::pooling::{ConvertKind, RunnerKind};
    let mut llm = LLM::new(args(&fixture("bert-embed"))).expect("load bert-embed");
    let e = llm
        .generate(&[Prompt::Tokens(vec![5, 6, 7])], &SamplingParams::default())
        .expect_err("generation on an encoder");
    assert!(format!("{e:#}").contains("/v1/embeddings"), "{e:#}");
    let e = llm
        .embed(&[Prompt::Tokens(vec![5; 65])], None)
        .expect_err("65 tokens in 64");
    assert!(
        format!("{e:#}").contains("maximum context length is 64 tokens"),
        "{e:#}"
    );
    llm.embed(&[Prompt::Tokens(vec![5; 64])], None)
        .expect("64 tokens in 64");
    let e = llm
        .score(&[("a", "b")])
        .expect_err("scoring with an embedder");
    assert!(format!("{e:#}").contains("cross-encoder"), "{e:#}");

    let mut a = args(&fixture("bert-embed"));
    a.runner = RunnerKind::Generate;
    let e = LLM::new(a).err().expect("--runner generate refused");
    assert!(format!("{e:#}").contains("pooling"), "{e:#}");
    let mut a = args(&fixture("bert-embed"));
    a.max_model_len = Some(129);
    let e = LLM::new(a).err().expect("past the position table");
    assert!(format!("{e:#}").contains("128 positions"), "{e:#}");
    let mut a = args(&fixture("bert-rerank"));
    a.convert = ConvertKind::Embed;
    let e = LLM::new(a)
        .err()
        .expect("--convert embed of a cross-encoder");
    assert!(format!("{e:#}").contains("cross-encoder"), "{e:#}");
}

/// xlmr-embed: `XLMRobertaModel` (BGE-M3's form): positions start after
/// padding_idx (66 rows of positions, a context of 64), one token type,
/// a Unigram tokenizer, CLS pooling and Normalize.
#[test]
fn xlm_roberta_embedding_matches_sentence_transformers() {
    let r = reference("xlmr-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let mut a = args(&fixture("xlmr-embed"));
    // The context is the position table less the offset.
    a.max_model_len = None;
    let mut llm = LLM::new(a).expect("load xlmr-embed");
    let prompts: Vec<Prompt> = inputs
        .iter()
        .map(|i| Prompt::Text(i["text"].as_str().expect("text").into()))
        .collect();
    let got = llm.embed(&prompts, None).expect("embed");
    for (k, (v, i)) in got.iter().zip(inputs).enumerate() {
        let want: Vec<u32> = i["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let Prompt::Text(t) = &prompts[k] else {
            unreachable!()
        };
        assert_eq!(llm.tokenizer().encode_for_pooling(t).expect("encode"), want);
        let c = cosine(v, &floats(&i["embedding"]));
        assert!(
            c >= MIN_COSINE,
            "input {k}: cosine {c} with sentence-transformers"
        );
    }
    let dims = &r["dimensions"]["16"].as_array().expect("dimensions 16");
    let short = llm.embed(&prompts, Some(16)).expect("embed dimensions 16");
    for (k, (v, want)) in short.iter().zip(dims.iter()).enumerate() {
        let c = cosine(v, &floats(want));
        assert!(c >= MIN_COSINE, "input {k}, 16 dimensions: cosine {c}");
    }
    // 64 positions after the offset: the last one is reachable, one more
    // is refused.
    llm.embed(&[Prompt::Tokens(vec![4; 64])], None)
        .expect("64 tokens in 64");
    let e = llm
        .embed(&[Prompt::Tokens(vec![4; 65])], None)
        .expect_err("65 tokens in 64");
    assert!(
        format!("{e:#}").contains("maximum context length is 64 tokens"),
        "{e:#}"
    );
}

/// xlmr-rerank: `XLMRobertaForSequenceClassification` with one label (the
/// bge-reranker form): pairs `<s> q </s></s> d </s>`, positions after
/// padding_idx, the <s> row through `classifier.dense`, tanh and
/// `classifier.out_proj`, then a sigmoid: CrossEncoder's scores within
/// 1e-4, and transformers' logits within 1e-4 without the activation.
#[test]
fn xlm_roberta_cross_encoder_scores_match_cross_encoder() {
    let r = reference("xlmr-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let mut a = args(&fixture("xlmr-rerank"));
    a.max_model_len = None;
    let mut llm = LLM::new(a).expect("load xlmr-rerank");
    let mut token_ids = Vec::new();
    for (d, want) in docs
        .iter()
        .zip(r["token_ids"].as_array().expect("token_ids"))
    {
        let packed = llm
            .tokenizer()
            .encode_pair_for_scoring(query, d)
            .expect("encode pair");
        let ids: Vec<u32> = packed
            .iter()
            .map(|&t| pagoda_accel::ops::encoder::unpack_token(t).0)
            .collect();
        let want: Vec<u32> = want
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, want, "pair tokens");
        token_ids.push(ids);
    }
    let pairs: Vec<(&str, &str)> = docs.iter().map(|d| (query, *d)).collect();
    let got = llm.score(&pairs).expect("score");
    let want = floats(&r["scores"]);
    let mut worst = 0f64;
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        worst = worst.max(err);
        assert!(err < 1e-4, "pair {k}: score {g}, CrossEncoder {w}");
    }
    eprintln!("xlmr-rerank: largest |score - CrossEncoder| {worst:.3e}");
    // The raw logits, batched together.
    let prompts: Vec<Prompt> = token_ids.into_iter().map(Prompt::Tokens).collect();
    let raw = llm.embed(&prompts, None).expect("raw logits");
    for (k, (v, w)) in raw.iter().zip(floats(&r["logits"])).enumerate() {
        assert_eq!(v.len(), 1, "one logit");
        assert!(
            (f64::from(v[0]) - w).abs() < 1e-4,
            "pair {k}: logit {}, transformers {w}",
            v[0]
        );
    }
}

/// bert-classify: `BertForSequenceClassification` with three labels
/// (id2label negative, neutral, positive): each text's `[CLS]` row through
/// the pooler and classifier, then a softmax: transformers' probabilities
/// within 1e-4, batched together; scoring pairs is refused, naming
/// classify.
#[test]
fn bert_classifier_probabilities_match_transformers() {
    let r = reference("bert-classify");
    let inputs = r["inputs"].as_array().expect("inputs");
    let mut llm = LLM::new(args(&fixture("bert-classify"))).expect("load bert-classify");
    let texts: Vec<&str> = inputs
        .iter()
        .map(|i| i["text"].as_str().expect("text"))
        .collect();
    for (t, i) in texts.iter().zip(inputs) {
        let want: Vec<u32> = i["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(llm.tokenizer().encode_for_pooling(t).expect("encode"), want);
    }
    let got = llm.classify(&texts).expect("classify");
    let mut worst = 0f64;
    for (k, (p, i)) in got.iter().zip(inputs).enumerate() {
        let want = floats(&i["probs"]);
        assert_eq!(p.len(), 3, "three labels");
        for (g, w) in p.iter().zip(&want) {
            let err = (f64::from(*g) - w).abs();
            worst = worst.max(err);
            assert!(err < 1e-4, "input {k}: probs {p:?}, transformers {want:?}");
        }
    }
    eprintln!("bert-classify: largest |prob - transformers| {worst:.3e}");
    // The raw logits, one input alone.
    let raw = llm
        .embed(&[Prompt::Text(texts[1].into())], None)
        .expect("logits");
    for (g, w) in raw[0].iter().zip(floats(&inputs[1]["logits"])) {
        assert!(
            (f64::from(*g) - w).abs() < 1e-4,
            "logit {g}, transformers {w}"
        );
    }
    let e = llm
        .score(&[("a", "b")])
        .expect_err("scoring with a classifier");
    assert!(format!("{e:#}").contains("classify"), "{e:#}");
    let e = llm
        .generate(&[Prompt::Tokens(vec![5, 6, 7])], &SamplingParams::default())
        .expect_err("generation on a classifier");
    assert!(format!("{e:#}").contains("/classify"), "{e:#}");
}

/// The labels come from id2label, num_labels or transformers' defaults.
#[test]
fn classifier_labels_follow_the_config() {
    use pagoda::engine::pooling::{class_probs, classifier_labels};
    let l = classifier_labels(&serde_json::json!({"id2label": {"0": "no", "1": "yes"}}))
        .expect("labels");
    assert_eq!(l, ["no", "yes"]);
    let l = classifier_labels(&serde_json::json!({"num_labels": 3})).expect("labels");
    assert_eq!(l, ["LABEL_0", "LABEL_1", "LABEL_2"]);
    assert_eq!(
        classifier_labels(&serde_json::json!({}))
            .expect("labels")
            .len(),
        2
    );
    // softmax of (0, ln 3): 1/4, 3/4; a lone logit's sigmoid.
    let p = class_probs(&[0.0, 3f32.ln()]);
    assert!(
        (p[0] - 0.25).abs() < 1e-6 && (p[1] - 0.75).abs() < 1e-6,
        "{p:?}"
    );
    let p = class_probs(&[0.0]);
    assert!((p[0] - 0.5).abs() < 1e-7, "{p:?}");
}

const QWEN3_RERANKER: &str = r#"{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}"#;

/// qwen3-rerank: a causal Qwen3 served as Qwen3-Reranker is with vLLM's
/// `--hf-overrides`: each pair (the two texts' tokens concatenated) scores
/// P(yes) of the softmax over the logits of "no" and "yes" at its last
/// token: transformers' within 1e-4, batched together; the overrides'
/// other forms are refused by name.
#[test]
fn qwen3_reranker_scores_match_transformers() {
    let r = reference("qwen3-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let mut a = args(&fixture("qwen3-rerank"));
    a.hf_overrides = Some(QWEN3_RERANKER.into());
    // Byte-level pieces: the longest pair has 66 tokens.
    a.max_model_len = Some(128);
    let mut llm = LLM::new(a).expect("load qwen3-rerank as a reranker");
    for (d, want) in docs
        .iter()
        .zip(r["token_ids"].as_array().expect("token_ids"))
    {
        let ids: Vec<u32> = llm
            .tokenizer()
            .encode_pair_for_scoring(query, d)
            .expect("encode pair")
            .iter()
            .map(|&t| pagoda_accel::ops::encoder::unpack_token(t).0)
            .collect();
        let want: Vec<u32> = want
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, want, "pair tokens");
    }
    let pairs: Vec<(&str, &str)> = docs.iter().map(|d| (query, *d)).collect();
    let got = llm.score(&pairs).expect("score");
    let want = floats(&r["scores"]);
    let mut worst = 0f64;
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        worst = worst.max(err);
        assert!(err < 1e-4, "pair {k}: score {g}, transformers {w}");
    }
    eprintln!("qwen3-rerank: largest |P(yes) - transformers| {worst:.3e}");
    // Without the overrides the same folder is a generation model.
    let mut a = args(&fixture("qwen3-rerank"));
    a.max_model_len = Some(128);
    let e = LLM::new(a)
        .expect("load as a generator")
        .score(&pairs)
        .expect_err("no scoring without the overrides");
    assert!(format!("{e:#}").contains("generation"), "{e:#}");
    for (json, word) in [
        (
            r#"{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true, "rope_theta": 1}"#,
            "rope_theta",
        ),
        (
            r#"{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["yes"], "is_original_qwen3_reranker": true}"#,
            "two tokens",
        ),
        (
            r#"{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "maybe"], "is_original_qwen3_reranker": true}"#,
            "maybe",
        ),
    ] {
        let mut a = args(&fixture("qwen3-rerank"));
        a.hf_overrides = Some(json.into());
        let e = LLM::new(a).err().expect("refused");
        assert!(format!("{e:#}").contains(word), "{json}: {e:#}");
    }
}

/// modernbert-embed: `ModernBertModel` saved by sentence-transformers
/// (byte-level BPE, mean pooling, Normalize): rotary positions with bases
/// 2e4 on the global layers (0, 3) and 5e3 on the local ones, which see
/// four tokens on either side; GeGLU; LayerNorms without bias. The fifth
/// input (73 tokens) is far longer than the local window. Each vector
/// reaches cosine 0.99999 with sentence-transformers', batched or alone.
#[test]
fn modernbert_embedding_matches_sentence_transformers() {
    let r = reference("modernbert-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let mut a = args(&fixture("modernbert-embed"));
    a.max_model_len = Some(128);
    let mut llm = LLM::new(a).expect("load modernbert-embed");
    let prompts: Vec<Prompt> = inputs
        .iter()
        .map(|i| Prompt::Text(i["text"].as_str().expect("text").into()))
        .collect();
    for (p, i) in prompts.iter().zip(inputs) {
        let want: Vec<u32> = i["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let Prompt::Text(t) = p else { unreachable!() };
        let got = llm.tokenizer().encode_for_pooling(t).expect("encode");
        assert_eq!(got, want, "byte-level BPE with [CLS] and [SEP]");
    }
    assert!(
        inputs[4]["token_ids"].as_array().map_or(0, Vec::len) > 8 * 4,
        "the long input spans several local windows"
    );
    let batched = llm.embed(&prompts, None).expect("embed batched");
    for (k, (v, i)) in batched.iter().zip(inputs).enumerate() {
        let want = floats(&i["embedding"]);
        let c = cosine(v, &want);
        let diff = v
            .iter()
            .zip(&want)
            .map(|(x, y)| (f64::from(*x) - y).abs())
            .fold(0.0, f64::max);
        eprintln!("modernbert-embed input {k}: cosine {c:.9}, max |diff| {diff:.3e}");
        assert!(
            c >= MIN_COSINE,
            "input {k}: cosine {c} with sentence-transformers"
        );
        assert!(diff < 1e-4, "input {k}: max |diff| {diff}");
        let alone = llm.embed(&prompts[k..=k], None).expect("embed alone");
        assert_eq!(&alone[0], v, "input {k}: batched and alone differ");
    }
    let dims = &r["dimensions"]["16"].as_array().expect("dimensions 16");
    let short = llm.embed(&prompts, Some(16)).expect("embed dimensions 16");
    for (k, (v, want)) in short.iter().zip(dims.iter()).enumerate() {
        let c = cosine(v, &floats(want));
        assert!(c >= MIN_COSINE, "input {k}, 16 dimensions: cosine {c}");
    }
}

/// A copy of fixture `name` whose config.json `edit` rewrites.
fn edited_copy(name: &str, tag: &str, edit: impl Fn(&mut Value)) -> PathBuf {
    let src = fixture(name);
    let dst = std::env::temp_dir().join(format!("pagoda-{name}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    copy_dir(&src, &dst);
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("config JSON");
    edit(&mut c);
    std::fs::write(dst.join("config.json"), c.to_string()).expect("write config");
    dst
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("mkdir");
    for e in std::fs::read_dir(src).expect("read fixture dir") {
        let e = e.expect("dir entry");
        let to = dst.join(e.file_name());
        if e.file_type().expect("file type").is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).expect("copy fixture file");
        }
    }
}

/// The keys that shape ModernBERT's math are read: the older config form
/// on the Hub (`global_attn_every_n_layers`, `global_rope_theta`,
/// `local_rope_theta`) gives the same vectors; a window wide enough to
/// see everything (or another RoPE base) moves the long input's vector
/// away from sentence-transformers'; and what is not implemented is
/// refused at load, by name.
#[test]
fn modernbert_config_keys_are_computed_or_refused_by_name() {
    let r = reference("modernbert-embed");
    let long = &r["inputs"][4];
    let prompt = Prompt::Text(long["text"].as_str().expect("text").into());
    let want = floats(&long["embedding"]);
    let embed = |dir: &Path| {
        let mut a = args(dir);
        a.max_model_len = Some(128);
        let mut llm = LLM::new(a).expect("load edited modernbert-embed");
        let v = llm
            .embed(std::slice::from_ref(&prompt), None)
            .expect("embed");
        cosine(&v[0], &want)
    };

    let old = edited_copy("modernbert-embed", "old-form", |c| {
        let o = c.as_object_mut().expect("object");
        o.remove("layer_types");
        o.remove("rope_parameters");
        o.insert("global_rope_theta".into(), 20000.0.into());
        o.insert("local_rope_theta".into(), 5000.0.into());
        o.insert("reference_compile".into(), false.into());
    });
    let c = embed(&old);
    assert!(c >= MIN_COSINE, "the older config form: cosine {c}");
    let _ = std::fs::remove_dir_all(&old);

    for (tag, edit) in [
        (
            "wide-window",
            Box::new(|c: &mut Value| c["local_attention"] = 512.into()) as Box<dyn Fn(&mut Value)>,
        ),
        (
            "local-theta",
            Box::new(|c: &mut Value| {
                c["rope_parameters"]["sliding_attention"]["rope_theta"] = 100.0.into()
            }),
        ),
        (
            "all-global",
            Box::new(|c: &mut Value| {
                c["layer_types"] = serde_json::json!(vec!["full_attention"; 5]);
            }),
        ),
    ] {
        let dir = edited_copy("modernbert-embed", tag, edit);
        let c = embed(&dir);
        eprintln!("modernbert-embed {tag}: the long input's cosine {c:.6}");
        assert!(
            c < 0.9999,
            "{tag}: the long input still matches (cosine {c})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    for (tag, edit, word) in [
        (
            "silu",
            Box::new(|c: &mut Value| c["hidden_activation"] = "silu".into())
                as Box<dyn Fn(&mut Value)>,
            "hidden_activation",
        ),
        (
            "rope-linear",
            Box::new(|c: &mut Value| {
                c["rope_parameters"]["full_attention"] =
                    serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0})
            }),
            "rope_parameters.full_attention",
        ),
        (
            "chunked",
            Box::new(|c: &mut Value| c["layer_types"][1] = "chunked_attention".into()),
            "layer_types",
        ),
        (
            "head-dim",
            Box::new(|c: &mut Value| c["head_dim"] = 8.into()),
            "head_dim",
        ),
        (
            "rope-scaling",
            Box::new(|c: &mut Value| {
                c["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0})
            }),
            "rope_scaling",
        ),
    ] {
        let dir = edited_copy("modernbert-embed", tag, edit);
        let mut a = args(&dir);
        a.max_model_len = Some(128);
        let e = LLM::new(a).err().expect("refused");
        assert!(format!("{e:#}").contains(word), "{tag}: {e:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// modernbert-rerank: `ModernBertForSequenceClassification` with one
/// label: the mean of the final-normed rows (classifier_pooling mean), the
/// head (dense with bias, gelu, LayerNorm with bias) and the classifier,
/// then a sigmoid: CrossEncoder's scores within 1e-4, and transformers'
/// logits within 1e-4 batched together. The tokenizer types the pair's
/// second text 1; ModernBERT reads no types, so the pair goes untyped.
#[test]
fn modernbert_cross_encoder_scores_match_cross_encoder() {
    let r = reference("modernbert-rerank");
    let query = r["query"].as_str().expect("query");
    let docs: Vec<&str> = r["documents"]
        .as_array()
        .expect("documents")
        .iter()
        .map(|d| d.as_str().expect("document"))
        .collect();
    let mut a = args(&fixture("modernbert-rerank"));
    a.max_model_len = Some(128);
    let mut llm = LLM::new(a).expect("load modernbert-rerank");
    let mut token_ids = Vec::new();
    let mut typed = false;
    for (d, want) in docs
        .iter()
        .zip(r["token_ids"].as_array().expect("token_ids"))
    {
        let packed = llm
            .tokenizer()
            .encode_pair_for_scoring(query, d)
            .expect("encode pair");
        typed |= packed
            .iter()
            .any(|&t| pagoda_accel::ops::encoder::unpack_token(t).1 == 1);
        let ids: Vec<u32> = packed
            .iter()
            .map(|&t| pagoda_accel::ops::encoder::unpack_token(t).0)
            .collect();
        let want: Vec<u32> = want
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, want, "pair tokens");
        token_ids.push(ids);
    }
    assert!(typed, "the tokenizer's template types the second text 1");
    let pairs: Vec<(&str, &str)> = docs.iter().map(|d| (query, *d)).collect();
    let got = llm.score(&pairs).expect("score");
    let want = floats(&r["scores"]);
    let mut worst = 0f64;
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        worst = worst.max(err);
        assert!(err < 1e-4, "pair {k}: score {g}, CrossEncoder {w}");
    }
    eprintln!("modernbert-rerank: largest |score - CrossEncoder| {worst:.3e}");
    let prompts: Vec<Prompt> = token_ids.into_iter().map(Prompt::Tokens).collect();
    let raw = llm.embed(&prompts, None).expect("raw logits");
    let mut worst = 0f64;
    for (k, (v, w)) in raw.iter().zip(floats(&r["logits"])).enumerate() {
        assert_eq!(v.len(), 1, "one logit");
        let err = (f64::from(v[0]) - w).abs();
        worst = worst.max(err);
        assert!(err < 1e-4, "pair {k}: logit {}, transformers {w}", v[0]);
    }
    eprintln!("modernbert-rerank: largest |logit - transformers| {worst:.3e}");
    // classifier_pooling decides the rows pooled: cls gives other logits.
    let dir = edited_copy("modernbert-rerank", "cls", |c| {
        c["classifier_pooling"] = "cls".into()
    });
    let mut a = args(&dir);
    a.max_model_len = Some(128);
    let mut cls = LLM::new(a).expect("load with cls pooling");
    let v = cls.embed(&prompts[..1], None).expect("cls logit");
    let w = floats(&r["logits"])[0];
    assert!(
        (f64::from(v[0][0]) - w).abs() > 1e-3,
        "cls pooling gave the mean's logit"
    );
    let _ = std::fs::remove_dir_all(&dir);
    for (tag, value, word) in [
        ("pool-max", "max", "classifier_pooling"),
        ("act-relu", "relu", "classifier_activation"),
    ] {
        let dir = edited_copy("modernbert-rerank", tag, |c| {
            let key = if tag == "pool-max" {
                "classifier_pooling"
            } else {
                "classifier_activation"
            };
            c[key] = value.into();
        });
        let mut a = args(&dir);
        a.max_model_len = Some(128);
        let e = LLM::new(a).err().expect("refused");
        assert!(format!("{e:#}").contains(word), "{tag}: {e:#}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// What one request of a mixed batch gave: a pooling row's raw vector, or
/// a generation row's tokens and their logprobs.
#[derive(Debug)]
enum Outcome {
    Pooled(Vec<f32>),
    Generated(Vec<u32>, Vec<f32>),
}

/// A mixed request: a pooling row (`None`) or a generation row with its
/// sampling parameters.
type Mixed = (Vec<u32>, Option<SamplingParams>);

/// Runs `reqs` all at once on `llm`, stepping by hand so the KV accounting
/// is checked after every step, and returns each one's outcome in order;
/// checks that every block came back to the pool.
fn run_mixed(llm: &mut LLM, reqs: &[Mixed]) -> Vec<Outcome> {
    let core = llm.engine_mut();
    let ids: Vec<u64> = reqs
        .iter()
        .enumerate()
        .map(|(i, (p, sp))| {
            let opts = RequestOptions {
                pooling: sp.is_none(),
                ..Default::default()
            };
            core.add_request(
                format!("m{i}"),
                p.clone(),
                sp.clone().unwrap_or_default(),
                opts,
            )
            .unwrap_or_else(|e| panic!("request {i}: {}", e.message))
        })
        .collect();
    let mut tokens = vec![Vec::new(); reqs.len()];
    let mut logprobs = vec![Vec::new(); reqs.len()];
    let mut pooled: Vec<Option<Vec<f32>>> = vec![None; reqs.len()];
    let mut finished = vec![false; reqs.len()];
    while core.has_unfinished() {
        for o in core.step().expect("a step") {
            let i = ids.iter().position(|&e| e == o.id).expect("known request");
            assert!(!finished[i], "request {i}: output after it finished");
            tokens[i].extend_from_slice(&o.new_token_ids);
            logprobs[i].extend(o.logprobs.iter().map(|l| l.logprob));
            if let Some(v) = o.pooled {
                assert!(
                    reqs[i].1.is_none(),
                    "request {i}: a vector for a generation row"
                );
                pooled[i] = Some(v);
            }
            if o.finish_reason.is_some() {
                finished[i] = true;
            }
        }
        core.check_kv_accounting().expect("KV accounting");
    }
    let kv = llm.engine().kv_cache();
    assert_eq!(
        kv.pool().num_free(),
        kv.pool().num_blocks(),
        "blocks leaked"
    );
    assert_eq!(kv.num_seqs(), 0, "a finished row kept its KV");
    reqs.iter()
        .enumerate()
        .map(|(i, (_, sp))| {
            assert!(finished[i], "request {i} never finished");
            match sp {
                None => {
                    assert!(
                        tokens[i].is_empty(),
                        "pooling row {i} generated {:?}",
                        tokens[i]
                    );
                    Outcome::Pooled(
                        pooled[i]
                            .take()
                            .unwrap_or_else(|| panic!("pooling row {i}: no vector")),
                    )
                }
                Some(_) => Outcome::Generated(tokens[i].clone(), logprobs[i].clone()),
            }
        })
        .collect()
}

/// One engine, a causal model served with `--runner generate` and a
/// `--pooler-config`, carries pooling and generation rows in the same
/// continuous batches: in one batch, in 8-token chunks, and in 8-token
/// chunks over a 6-block pool small enough to preempt, every request gives what it
/// gives alone (a pooling row's vector, a generation row's greedy tokens
/// and logprobs), and the fixture's vectors are still
/// sentence-transformers'.
#[test]
fn pooling_and_generation_rows_share_batches_each_giving_its_solo_result() {
    use pagoda::engine::pooling::RunnerKind;
    let r = reference("qwen3-embed");
    let inputs = r["inputs"].as_array().expect("inputs");
    let mixed_args = || {
        let mut a = args(&fixture("qwen3-embed"));
        a.runner = RunnerKind::Generate;
        a.pooler_config = Some(r#"{"pooling_type": "LAST"}"#.into());
        a
    };
    let probe = LLM::new(mixed_args()).expect("load for generation and pooling");
    assert!(probe.engine().generates() && probe.engine().pooler().is_some());
    let vocab = probe.engine().runner().config().vocab_size as u32;
    let per_block = (8usize << 20) / probe.engine().kv_cache().pool().num_blocks();
    let tok = probe.tokenizer().clone();
    drop(probe);

    // Pooling rows: the fixture's texts (2 to 32 tokens), and two token
    // prompts of 45 and 9 tokens; generation rows: six prompts of 5 to 40
    // tokens, 16 greedy tokens each with their logprobs. Interleaved.
    let texts: Vec<Vec<u32>> = inputs
        .iter()
        .map(|i| {
            tok.encode_for_pooling(i["text"].as_str().expect("text"))
                .expect("encode")
        })
        .collect();
    let ids = |len: u32, k: u32| -> Vec<u32> {
        (0..len)
            .map(|j| 3 + (k * 71 + j * 37 + 11) % (vocab - 3))
            .collect()
    };
    let mut gen = SamplingParams::greedy(16);
    gen.ignore_eos = true;
    gen.logprobs = Some(1);
    let mut reqs: Vec<Mixed> = Vec::new();
    let pool_prompts: Vec<Vec<u32>> = texts
        .iter()
        .cloned()
        .chain([ids(45, 1), ids(9, 2)])
        .collect();
    let gen_prompts: Vec<Vec<u32>> = [5, 40, 12, 27, 33, 8]
        .iter()
        .enumerate()
        .map(|(k, &len)| ids(len, 10 + k as u32))
        .collect();
    for k in 0..6 {
        reqs.push((gen_prompts[k].clone(), Some(gen.clone())));
        reqs.push((pool_prompts[k].clone(), None));
    }

    // Each alone, on an engine without prefix caching.
    let mut solo_args = mixed_args();
    solo_args.enable_prefix_caching = false;
    let mut solo_llm = LLM::new(solo_args).expect("solo engine");
    let solo: Vec<Outcome> = reqs
        .iter()
        .map(|r| {
            run_mixed(&mut solo_llm, std::slice::from_ref(r))
                .pop()
                .expect("one outcome")
        })
        .collect();
    // The fixture's vectors, alone, are sentence-transformers'.
    let pooler = solo_llm.engine().pooler().cloned().expect("a pooler");
    for (k, i) in inputs.iter().enumerate() {
        let Outcome::Pooled(v) = &solo[2 * k + 1] else {
            panic!("request {} is a pooling row", 2 * k + 1)
        };
        let c = cosine(&pooler.finish(v.clone(), None), &floats(&i["embedding"]));
        assert!(c >= MIN_COSINE, "input {k} alone: cosine {c}");
    }
    // Rows that leaked into each other would give each other's results:
    // the solo results must differ between requests for the check below
    // to mean anything.
    for a in 0..solo.len() {
        for b in a + 1..solo.len() {
            let same = match (&solo[a], &solo[b]) {
                (Outcome::Pooled(x), Outcome::Pooled(y)) => x == y,
                (Outcome::Generated(x, _), Outcome::Generated(y, _)) => x == y,
                _ => false,
            };
            assert!(!same, "requests {a} and {b} give the same result alone");
        }
    }

    let conditions: Vec<(&str, pagoda::engine::EngineArgs)> = vec![
        ("one batch, prefix caching", mixed_args()),
        ("8-token steps", {
            let mut a = mixed_args();
            a.max_num_batched_tokens = 8;
            a
        }),
        ("8-token steps over a 6-block pool", {
            let mut a = mixed_args();
            a.max_num_batched_tokens = 8;
            a.kv_cache_memory = Some((6 * per_block) as u64);
            a
        }),
    ];
    let mut max_dv = 0f32;
    let mut max_dlp = 0f32;
    for (name, a) in conditions {
        let mut llm = LLM::new(a).expect("mixed engine");
        let got = run_mixed(&mut llm, &reqs);
        for (i, (g, s)) in got.iter().zip(&solo).enumerate() {
            match (g, s) {
                (Outcome::Pooled(x), Outcome::Pooled(y)) => {
                    assert_eq!(x.len(), y.len());
                    let d = x
                        .iter()
                        .zip(y)
                        .map(|(p, q)| (p - q).abs())
                        .fold(0f32, f32::max);
                    max_dv = max_dv.max(d);
                    assert!(
                        d <= 1e-5,
                        "{name}: pooling row {i} differs from its solo vector by {d}"
                    );
                }
                (Outcome::Generated(x, lx), Outcome::Generated(y, ly)) => {
                    assert_eq!(
                        x, y,
                        "{name}: generation row {i} differs from its solo tokens"
                    );
                    assert_eq!(lx.len(), x.len(), "{name}: row {i}: a logprob per token");
                    let d = lx
                        .iter()
                        .zip(ly)
                        .map(|(p, q)| (p - q).abs())
                        .fold(0f32, f32::max);
                    max_dlp = max_dlp.max(d);
                    assert!(
                        d <= 1e-5,
                        "{name}: generation row {i}: logprobs differ by {d}"
                    );
                }
                _ => panic!("{name}: request {i} changed kind"),
            }
        }
        let stats = llm.engine().stats();
        if name.starts_with("8-token") {
            assert!(
                stats.steps as usize >= reqs.iter().map(|r| r.0.len()).sum::<usize>().div_ceil(8),
                "{name}: {} steps do not chunk",
                stats.steps
            );
        }
        if name.ends_with("pool") {
            assert!(
                stats.num_preemptions > 0,
                "{name}: the small pool should preempt"
            );
        }
        eprintln!(
            "{name}: {} blocks, {} steps, {} preemptions",
            llm.engine().kv_cache().pool().num_blocks(),
            stats.steps,
            stats.num_preemptions
        );
    }
    eprintln!("max |Δvector| {max_dv:e}, max |Δlogprob| {max_dlp:e}");
}

/// Which flags serve a decoder for both: `--runner generate` with a
/// `--pooler-config`. Without `--runner generate` the pooler config still
/// means a pooling-only model (vLLM's reading); what the decoder's runner
/// cannot pool is refused by name.
#[test]
fn generation_and_pooling_in_one_engine_is_asked_for_by_flags() {
    use pagoda::engine::pooling::RunnerKind;
    let dir = causal_copy("both");
    let mut a = args(&dir);
    a.runner = RunnerKind::Generate;
    a.pooler_config = Some(r#"{"normalize": true}"#.into());
    let mut both = LLM::new(a).expect("generation and pooling");
    let r = reference("qwen3-embed");
    let first = &r["inputs"][0];
    let prompt = Prompt::Text(first["text"].as_str().expect("text").into());
    let v = both
        .embed(std::slice::from_ref(&prompt), None)
        .expect("embed");
    let c = cosine(&v[0], &floats(&first["embedding"]));
    assert!(c >= MIN_COSINE, "cosine {c}");
    let out = both
        .generate(&[Prompt::Tokens(vec![5, 6, 7])], &SamplingParams::greedy(4))
        .expect("generate");
    assert_eq!(out[0].outputs[0].token_ids.len(), 4);

    // --pooler-config under --runner auto on a causal model is refused,
    // naming the runner that serves both.
    let mut a = args(&dir);
    a.pooler_config = Some(r#"{"normalize": true}"#.into());
    let e = LLM::new(a).err().expect("--pooler-config without a runner");
    assert!(format!("{e:#}").contains("--runner generate"), "{e:#}");
    // Mean pooling of a decoder's rows is not implemented.
    let mut a = args(&dir);
    a.runner = RunnerKind::Generate;
    a.pooler_config = Some(r#"{"pooling_type": "MEAN"}"#.into());
    let e = LLM::new(a).err().expect("MEAN refused");
    assert!(format!("{e:#}").contains("MEAN"), "{e:#}");
    let _ = std::fs::remove_dir_all(&dir);
}
