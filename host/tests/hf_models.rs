//! Hugging Face folders and GGUF files of tiny random Llama and Qwen2 models
//! must compute what the model definition says, as an independent, plainly
//! written f64 forward pass computes it.
//!
//! Specification checked here:
//! - An HF folder (`config.json`, `model.safetensors` in F32, BF16 or F16,
//!   or sharded through `model.safetensors.index.json`, plus tokenizer
//!   files) loads, and `CausalLm::forward` gives the logits of the f64
//!   reference at every position: in prefill, in chunked prefill, in decode,
//!   with several sequences in one batch and scattered KV blocks. F32
//!   weights agree to 1e-4 of the logit scale; 16-bit weights agree to 1e-3
//!   with a reference computed from the same rounded weights.
//! - Qwen2's q/k/v biases and untied LM head are applied; Llama's tied head
//!   reuses the embedding; grouped-query attention maps query head `h` to KV
//!   head `h / (heads / kv_heads)`; RoPE rotates HF's half-split pairs.
//! - `--dtype` converts weights on load (bf16 file as float32, f32 file as
//!   float16 / bfloat16) to exactly the rounded values.
//! - The same weights written as a GGUF F32 file (llama.cpp names; q/k rows
//!   permuted for the llama architecture as llama.cpp's converter does, not
//!   for qwen2) give the HF folder's logits to 1e-5.
//! - The public `LLM` API's greedy tokens are the reference's argmax chain.
//! - The comparisons are sensitive: a reference with the wrong RoPE pairing,
//!   the wrong GQA mapping or without biases, and a llama GGUF without the
//!   q/k permutation, all miss by far more than the tolerance.

mod support;

use pagoda::engine::args::LoadedFrom;
use pagoda::engine::config::Arch;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::loader::gguf::GgufFile;
use pagoda::engine::loader::DType;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};
use pagoda::tokenizer::{ChatMessage, Tokenizer};
use pagoda_accel::ops::RopeStyle;
use std::path::Path;
use support::reference::*;
use support::tiny_model::{
    permute_rows_for_gguf, token_id, write_gguf_parts, Family, Storage, TinyModel, TinySpec, BOS,
    EOS,
};

/// Relative tolerance (of the largest reference logit) for f32 weights.
const TOL_F32: f64 = 1e-4;
/// Relative tolerance for 16-bit weights against the rounded-weight reference.
const TOL_16BIT: f64 = 1e-3;
/// Relative tolerance between two loads of the same f32 weights (HF vs GGUF).
const TOL_SAME_WEIGHTS: f64 = 1e-5;

// ---------------------------------------------------------------------------
// HF folders against the reference.
// ---------------------------------------------------------------------------

#[test]
fn llama_hf_f32_logits_match_the_f64_reference_in_prefill_chunked_prefill_and_decode() {
    let m = TinyModel::random(TinySpec::llama());
    let dir = tempfile::tempdir().expect("tempdir");
    m.write_hf(dir.path(), Storage::F32, 1);
    let (model, loaded) = load(dir.path(), DType::Auto);
    assert_eq!(loaded.source, LoadedFrom::HuggingFace);
    let c = &loaded.config;
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size
        ),
        (64, 2, 4, 2, 16, 96)
    );
    assert_eq!(c.vocab_size, m.spec.vocab_size());
    assert!(c.tie_word_embeddings && !c.attention_bias);
    assert_eq!(
        c.rope_style,
        RopeStyle::Neox,
        "HF weights rotate half-split pairs"
    );
    assert_eq!(model.weight_type(), "F32");
    check_against_reference("llama HF f32", &model, &m, TOL_F32);
}

#[test]
fn qwen2_hf_f32_with_qkv_biases_and_untied_head_matches_the_f64_reference() {
    let m = TinyModel::random(TinySpec::qwen2());
    let dir = tempfile::tempdir().expect("tempdir");
    m.write_hf(dir.path(), Storage::F32, 1);
    let (model, loaded) = load(dir.path(), DType::Auto);
    let c = &loaded.config;
    assert_eq!(c.arch, Arch::Qwen2);
    assert_eq!(
        c.head_dim, 16,
        "head_dim is implied by hidden_size / num_attention_heads"
    );
    assert_eq!(c.num_layers, 3);
    assert!(!c.tie_word_embeddings && c.attention_bias);
    assert_eq!(c.rope_style, RopeStyle::Neox);
    check_against_reference("qwen2 HF f32", &model, &m, TOL_F32);
}

#[test]
fn sharded_safetensors_with_an_index_load_the_same_weights_as_one_file() {
    for spec in [TinySpec::llama(), TinySpec::qwen2()] {
        let m = TinyModel::random(spec);
        let one = tempfile::tempdir().expect("tempdir");
        let two = tempfile::tempdir().expect("tempdir");
        m.write_hf(one.path(), Storage::F32, 1);
        m.write_hf(two.path(), Storage::F32, 2);
        assert!(two.path().join("model.safetensors.index.json").exists());
        assert!(two.path().join("model-00002-of-00002.safetensors").exists());
        let (single, _) = load(one.path(), DType::Auto);
        let (sharded, _) = load(two.path(), DType::Auto);
        let what = format!("{:?} sharded", m.spec.family);
        check_against_reference(&what, &sharded, &m, TOL_F32);
        let (a, b) = (engine_logits(&single), engine_logits(&sharded));
        for s in 0..a.len() {
            assert_close(
                &format!("{what} vs one file, sequence {s}"),
                &b[s],
                &to_f64(&a[s]),
                TOL_SAME_WEIGHTS,
            );
        }
    }
}

#[test]
fn bf16_and_f16_safetensors_match_the_reference_on_the_rounded_weights() {
    for spec in [TinySpec::llama(), TinySpec::qwen2()] {
        let m = TinyModel::random(spec);
        for (storage, ty) in [(Storage::BF16, "BF16"), (Storage::F16, "F16")] {
            let dir = tempfile::tempdir().expect("tempdir");
            m.write_hf(dir.path(), storage, 1);
            let (model, _) = load(dir.path(), DType::Auto);
            assert_eq!(
                model.weight_type(),
                ty,
                "--dtype auto keeps the stored dtype"
            );
            let rounded = m.map(false, |x| storage.round(x));
            let what = format!("{:?} HF {ty}", m.spec.family);
            check_against_reference(&what, &model, &rounded, TOL_16BIT);
        }
    }
}

#[test]
fn the_dtype_flag_converts_weights_to_exactly_the_rounded_values() {
    let m = TinyModel::random(TinySpec::qwen2());
    let f32_dir = tempfile::tempdir().expect("tempdir");
    let bf16_dir = tempfile::tempdir().expect("tempdir");
    m.write_hf(f32_dir.path(), Storage::F32, 1);
    m.write_hf(bf16_dir.path(), Storage::BF16, 1);

    // A bf16 file widened to f32: the bf16 values, computed in f32.
    let (model, _) = load(bf16_dir.path(), DType::Float32);
    assert_eq!(model.weight_type(), "F32");
    check_against_reference(
        "bf16 file as float32",
        &model,
        &m.map(false, |x| Storage::BF16.round(x)),
        TOL_F32,
    );

    // An f32 file narrowed: matrices rounded, norms and biases kept in f32.
    for (dtype, storage, ty) in [
        (DType::Float16, Storage::F16, "F16"),
        (DType::BFloat16, Storage::BF16, "BF16"),
    ] {
        let (model, _) = load(f32_dir.path(), dtype);
        assert_eq!(model.weight_type(), ty);
        let rounded = m.map(true, |x| storage.round(x));
        check_against_reference(&format!("f32 file as {ty}"), &model, &rounded, TOL_16BIT);
    }
}

// ---------------------------------------------------------------------------
// GGUF F32 against the HF folder.
// ---------------------------------------------------------------------------

/// Writes `m` as an HF folder and as a GGUF file; returns both models'
/// logits for the two-sequence scenario, after checking the GGUF config.
fn hf_and_gguf_logits(
    m: &TinyModel,
    dir: &Path,
) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<Vec<f32>>>, Model) {
    let hf = dir.join("hf");
    let gguf = dir.join("tiny.gguf");
    m.write_hf(&hf, Storage::F32, 1);
    m.write_gguf(&gguf);
    let (hf_model, hf_loaded) = load(&hf, DType::Auto);
    let (gguf_model, gguf_loaded) = load(&gguf, DType::Auto);
    assert_eq!(gguf_loaded.source, LoadedFrom::Gguf);
    let (a, b) = (&hf_loaded.config, &gguf_loaded.config);
    assert_eq!(
        (
            a.arch,
            a.hidden_size,
            a.num_layers,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim
        ),
        (
            b.arch,
            b.hidden_size,
            b.num_layers,
            b.num_heads,
            b.num_kv_heads,
            b.head_dim
        )
    );
    assert_eq!(
        (a.intermediate_size, a.vocab_size),
        (b.intermediate_size, b.vocab_size)
    );
    assert_eq!(
        (a.tie_word_embeddings, a.attention_bias),
        (b.tie_word_embeddings, b.attention_bias)
    );
    assert_eq!(a.rope_theta, b.rope_theta);
    let want_style = if m.spec.family == Family::Llama {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Neox
    };
    assert_eq!(b.rope_style, want_style);
    assert_eq!(gguf_model.weight_type(), "F32");
    (
        engine_logits(&hf_model),
        engine_logits(&gguf_model),
        gguf_model,
    )
}

#[test]
fn llama_gguf_f32_with_llama_cpp_qk_permutation_matches_the_hf_folder() {
    let m = TinyModel::random(TinySpec::llama());
    let dir = tempfile::tempdir().expect("tempdir");
    let (hf, gguf, gguf_model) = hf_and_gguf_logits(&m, dir.path());
    for s in 0..hf.len() {
        assert_close(
            &format!("llama GGUF vs HF, sequence {s}"),
            &gguf[s],
            &to_f64(&hf[s]),
            TOL_SAME_WEIGHTS,
        );
    }
    check_against_reference("llama GGUF f32", &gguf_model, &m, TOL_F32);
}

#[test]
fn qwen2_gguf_f32_unpermuted_with_biases_and_output_weight_matches_the_hf_folder() {
    let m = TinyModel::random(TinySpec::qwen2());
    let dir = tempfile::tempdir().expect("tempdir");
    let (hf, gguf, gguf_model) = hf_and_gguf_logits(&m, dir.path());
    for s in 0..hf.len() {
        assert_close(
            &format!("qwen2 GGUF vs HF, sequence {s}"),
            &gguf[s],
            &to_f64(&hf[s]),
            TOL_SAME_WEIGHTS,
        );
    }
    check_against_reference("qwen2 GGUF f32", &gguf_model, &m, TOL_F32);
}

#[test]
fn a_llama_gguf_without_the_qk_permutation_does_not_match() {
    // llama-arch GGUF is read with adjacent-pair RoPE; unpermuted HF rows
    // would be rotated in the wrong pairs. The comparison must see that.
    let m = TinyModel::random(TinySpec::llama());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("unpermuted.gguf");
    write_gguf_parts(&path, &m.gguf_metadata(), &m.gguf_tensors(false));
    let (model, _) = load(&path, DType::Auto);
    let (seqs, _) = two_sequences(m.spec.vocab_size());
    let got = engine_logits(&model);
    let (e, _, _) = relative_error(
        &got[0],
        &reference_logits(&m, &seqs[0], Mistakes::default()),
    );
    assert!(
        e > 100.0 * TOL_F32,
        "unpermuted q/k went unnoticed: error only {e:.3e}"
    );
}

#[test]
fn gguf_row_permutation_turns_half_split_rope_into_adjacent_pair_rope() {
    // For random q and k projections and inputs, in f64: rotating adjacent
    // pairs of the permuted projection's output equals permuting the output
    // of HF's half-split rotation, so every q·k score is unchanged.
    let (hd, heads, cols) = (16, 3, 8);
    let rows = hd * heads;
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let x: Vec<f64> = (0..cols).map(|i| (i as f64 * 0.37).sin()).collect();
    let wp = permute_rows_for_gguf(&w, rows, cols, hd);
    let to64 = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    for pos in [0, 1, 7, 33] {
        let mut hf = matvec(&to64(&w), rows, cols, &x);
        rope(&mut hf, hd, pos, 10_000.0, false);
        let mut gg = matvec(&to64(&wp), rows, cols, &x);
        rope(&mut gg, hd, pos, 10_000.0, true);
        for h in 0..heads {
            for i in 0..hd / 2 {
                let base = h * hd;
                assert!(
                    (gg[base + 2 * i] - hf[base + i]).abs() < 1e-12,
                    "pos {pos} head {h} pair {i}"
                );
                assert!(
                    (gg[base + 2 * i + 1] - hf[base + i + hd / 2]).abs() < 1e-12,
                    "pos {pos} head {h} pair {i}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The comparison is sensitive to the mistakes it is meant to catch.
// ---------------------------------------------------------------------------

#[test]
fn wrong_rope_pairing_gqa_mapping_or_missing_biases_miss_by_far_more_than_the_tolerance() {
    let m = TinyModel::random(TinySpec::qwen2());
    let dir = tempfile::tempdir().expect("tempdir");
    m.write_hf(dir.path(), Storage::F32, 1);
    let (model, _) = load(dir.path(), DType::Auto);
    let (seqs, _) = two_sequences(m.spec.vocab_size());
    let got = engine_logits(&model);
    let right = reference_logits(&m, &seqs[0], Mistakes::default());
    assert!(relative_error(&got[0], &right).0 <= TOL_F32);
    let mistakes = [
        (
            "adjacent-pair RoPE",
            Mistakes {
                interleaved_rope: true,
                ..Default::default()
            },
        ),
        (
            "h % kv_heads GQA mapping",
            Mistakes {
                gqa_modulo: true,
                ..Default::default()
            },
        ),
        (
            "no q/k/v biases",
            Mistakes {
                drop_bias: true,
                ..Default::default()
            },
        ),
    ];
    for (name, mistake) in mistakes {
        let (e, _, _) = relative_error(&got[0], &reference_logits(&m, &seqs[0], mistake));
        assert!(
            e > 100.0 * TOL_F32,
            "a reference with {name} is within {e:.3e} of the engine"
        );
    }
}

// ---------------------------------------------------------------------------
// Tokenizers and the public LLM API.
// ---------------------------------------------------------------------------

const PROMPT: &str = "hello world the cat sat on the mat in the dog";

fn prompt_ids() -> Vec<u32> {
    [
        "<s>", "hello", "Ġworld", "Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġthe", "Ġmat", "Ġin", "Ġthe",
        "Ġdog",
    ]
    .iter()
    .map(|t| token_id(t))
    .collect()
}

#[test]
fn hf_and_gguf_tokenizers_of_the_tiny_model_agree() {
    let m = TinyModel::random(TinySpec::llama());
    let dir = tempfile::tempdir().expect("tempdir");
    m.write_hf(dir.path(), Storage::F32, 1);
    let gguf = dir.path().join("tiny.gguf");
    m.write_gguf(&gguf);
    let hf = Tokenizer::from_hf_dir(dir.path()).expect("HF tokenizer");
    let gg =
        Tokenizer::from_gguf(&GgufFile::open(&gguf).expect("open GGUF")).expect("GGUF tokenizer");
    for t in [&hf, &gg] {
        assert_eq!(t.vocab_size(), m.spec.vocab_size());
        assert_eq!(t.bos_id(), Some(BOS));
        assert!(t.add_bos());
        assert_eq!(t.eos_ids(), &[EOS]);
        assert!(t.is_special(BOS) && t.is_special(EOS));
        assert_eq!(t.encode(PROMPT, true).expect("encode"), prompt_ids());
        let ids = t.encode("hi world, 42!", false).expect("encode");
        assert_eq!(t.decode(&ids, true).expect("decode"), "hi world, 42!");
        let chat = t.chat_template().expect("chat template");
        let text = chat
            .render(
                &[ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
                true,
            )
            .expect("render");
        assert_eq!(text, "user: hi\nassistant:");
    }
}

/// Greedy generation of `n` tokens through the public API.
fn llm_greedy(path: &Path, n: usize) -> (Vec<u32>, Vec<u32>, String) {
    let mut args = EngineArgs::new(path);
    args.threads = 2;
    args.max_model_len = Some(MAX_POSITIONS);
    args.kv_cache_memory = Some(4 << 20);
    args.kv_cache_dtype = KvCacheDtype::F32;
    let mut llm = LLM::new(args).unwrap_or_else(|e| panic!("LLM::new({}): {e:#}", path.display()));
    let mut params = SamplingParams::greedy(n);
    params.ignore_eos = true;
    let out = llm
        .generate(&[Prompt::from(PROMPT)], &params)
        .expect("generate");
    let text = llm
        .tokenizer()
        .decode(&out[0].outputs[0].token_ids, true)
        .expect("decode");
    assert_eq!(
        out[0].outputs[0].text, text,
        "streamed text equals the decoded ids"
    );
    (
        out[0].prompt_token_ids.clone(),
        out[0].outputs[0].token_ids.clone(),
        text,
    )
}

/// The reference's greedy continuation of `prompt`, checking at each step
/// that the winner leads by far more than the engine's error could bridge.
fn reference_greedy(m: &TinyModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for step in 0..n {
        let logits = reference_logits(m, &seq, Mistakes::default());
        let last = logits.last().expect("logits");
        let scale = last.iter().fold(0f64, |a, v| a.max(v.abs()));
        let (tok, margin) = argmax(last);
        assert!(
            margin > 20.0 * TOL_F32 * scale,
            "reference step {step}: top-2 margin {margin:.2e} is too small for a stable test; change the seed"
        );
        seq.push(tok);
    }
    seq[prompt.len()..].to_vec()
}

#[test]
fn llm_api_greedy_tokens_follow_the_reference_argmax_chain() {
    const N: usize = 8;
    for spec in [TinySpec::llama(), TinySpec::qwen2()] {
        let m = TinyModel::random(spec);
        let dir = tempfile::tempdir().expect("tempdir");
        let hf = dir.path().join("hf");
        m.write_hf(&hf, Storage::F32, 1);
        let gguf = dir.path().join("tiny.gguf");
        m.write_gguf(&gguf);
        let want = reference_greedy(&m, &prompt_ids(), N);
        let distinct: std::collections::HashSet<u32> = want.iter().copied().collect();
        assert!(
            distinct.len() > N / 2,
            "the reference chain {want:?} is too repetitive to be a meaningful check"
        );
        for path in [&hf, &gguf] {
            let (prompt, got, _) = llm_greedy(path, N);
            assert_eq!(prompt, prompt_ids(), "{}: prompt tokens", path.display());
            assert_eq!(got, want, "{}: greedy tokens", path.display());
        }
    }
}

/// The f64 log-softmax of one row of logits.
fn log_softmax(row: &[f64]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
    let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    row.iter().map(|v| v - lse).collect()
}

#[test]
fn prompt_logprobs_are_the_reference_log_softmax_of_every_prompt_token() {
    const K: usize = 3;
    let m = TinyModel::random(TinySpec::llama());
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = dir.path().join("hf");
    m.write_hf(&hf, Storage::F32, 1);
    let prompt = some_tokens(40, 3, m.spec.vocab_size());
    let raw = reference_logits(&m, &prompt, Mistakes::default());
    let want: Vec<Vec<f64>> = raw.iter().map(|r| log_softmax(r)).collect();
    // (batch budget, max_tokens, n): the whole prompt in one step and
    // nothing generated; then in chunks of 16 with samples after it.
    for (budget, max_tokens, n) in [(2048, 0, 1), (16, 3, 2)] {
        let mut args = EngineArgs::new(&hf);
        args.threads = 2;
        args.max_model_len = Some(MAX_POSITIONS);
        args.kv_cache_memory = Some(4 << 20);
        // `--kv-cache-dtype auto`, the default, keeps f32 weights' K/V in f32.
        assert_eq!(args.kv_cache_dtype, KvCacheDtype::Auto);
        args.max_num_batched_tokens = budget;
        let mut llm = LLM::new(args).expect("LLM::new");
        let mut params = SamplingParams::greedy(max_tokens);
        params.ignore_eos = true;
        params.n = n;
        params.prompt_logprobs = Some(K);
        // Twice: the second run's prompt is in the prefix cache, which a
        // request for prompt logprobs must not use (cached positions have
        // no logits).
        for run in 0..2 {
            let what = format!("budget {budget}, max_tokens {max_tokens}, run {run}");
            let out = llm
                .generate(&[Prompt::Tokens(prompt.clone())], &params)
                .expect("generate");
            let r = &out[0];
            // Later samples of `n` may reuse the first one's blocks: only
            // the first scores the prompt.
            if n == 1 {
                assert_eq!(r.num_cached_tokens, 0, "{what}: cached tokens");
            }
            for c in &r.outputs {
                assert_eq!(c.token_ids.len(), max_tokens, "{what}: generated");
            }
            let got = r.prompt_logprobs.as_ref().expect("prompt logprobs");
            assert_eq!(
                got.len(),
                prompt.len() - 1,
                "{what}: one per token after the first"
            );
            for (i, l) in got.iter().enumerate() {
                let row = &want[i];
                let tok = prompt[i + 1];
                // Log-softmax doubles the logits' error at most.
                let scale = raw[i].iter().fold(0f64, |a, v| a.max(v.abs()));
                let tol = 2.0 * TOL_F32 * scale;
                assert_eq!(
                    l.token_id, tok,
                    "{what}: position {i} scores the next token"
                );
                let err = (l.logprob as f64 - row[tok as usize]).abs();
                assert!(
                    err < tol,
                    "{what}: position {i}: logprob {} vs {} (tol {tol:.1e})",
                    l.logprob,
                    row[tok as usize]
                );
                let above = |margin: f64| {
                    row.iter()
                        .filter(|&&v| v > row[tok as usize] + margin)
                        .count()
                };
                let rank = l.rank as usize - 1;
                assert!(
                    (above(tol)..=above(-tol)).contains(&rank),
                    "{what}: position {i}: rank {} vs the reference's {}",
                    l.rank,
                    above(0.0) + 1
                );
                assert_eq!(l.top.len(), K, "{what}: position {i}: top alternatives");
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                for (j, &(t, lp)) in l.top.iter().enumerate() {
                    assert!(
                        (lp as f64 - row[t as usize]).abs() < tol,
                        "{what}: position {i}: top {j} logprob"
                    );
                    assert!(
                        (row[t as usize] - row[order[j]]).abs() < tol,
                        "{what}: position {i}: top {j} is {t}, the reference's is {}",
                        order[j]
                    );
                }
            }
        }
    }
}
