//! A reasoning model's structured output: the constraint applies to the
//! answer only, after the tokens that end the reasoning (`</think>`), as
//! in vLLM. Driven through the engine API on a tiny random model, whose
//! own greedy output supplies an "end of reasoning" token, so the test
//! knows exactly where the reasoning ends.

mod support;

use pagoda::engine::core::RequestOptions;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::structured_output::{GrammarCompiler, OutputConstraint, StructuredOutputs};
use pagoda::engine::{EngineArgs, SamplingParams, LLM};
use support::tiny_model::{token_id, Storage, TinyModel, TinySpec};

const MAX_TOKENS: usize = 12;

fn run(llm: &mut LLM, prompt: &[u32], opts: RequestOptions) -> Vec<u32> {
    let core = llm.engine_mut();
    let mut p = SamplingParams::greedy(MAX_TOKENS);
    p.ignore_eos = true;
    core.add_request("r".into(), prompt.to_vec(), p, opts)
        .unwrap_or_else(|e| panic!("add: {}", e.message));
    let mut out = Vec::new();
    while core.has_unfinished() {
        for o in core.step().expect("step") {
            out.extend(o.new_token_ids);
        }
    }
    out
}

#[test]
fn the_constraint_applies_only_after_the_reasoning_ends() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = dir.path().join("model");
    TinyModel::random(TinySpec::llama()).write_hf(&m, Storage::F32, 1);
    let mut a = EngineArgs::new(&m);
    a.threads = 1;
    a.max_model_len = Some(64);
    a.kv_cache_memory = Some(2 << 20);
    a.kv_cache_dtype = KvCacheDtype::F32;
    let mut llm = LLM::new(a).expect("engine");
    let prompt: Vec<u32> = ["h", "e", "l", "l", "o", "t", "h", "e", "r", "e"]
        .into_iter()
        .map(token_id)
        .collect();
    let free = run(&mut llm, &prompt, RequestOptions::default());
    // The reasoning "ends" with the first token the free output has not
    // produced before, two or more tokens in.
    let k = (2..free.len())
        .find(|&k| !free[..k].contains(&free[k]))
        .expect("a token the output had not produced before");
    let end = vec![free[k]];

    let vocab_size = llm.engine_mut().runner().config().vocab_size;
    let compiler = GrammarCompiler::new(llm.tokenizer().clone(), &[token_id("</s>")], vocab_size)
        .expect("compiler");
    let digits = StructuredOutputs::new(OutputConstraint::Regex("[0-9]+".into()));
    let is_digit = |t: &u32| ('0'..='9').any(|d| token_id(&d.to_string()) == *t);
    assert!(
        !free.iter().all(is_digit),
        "the free output is not already digits"
    );

    // With the end tokens: free up to and including them, digits after.
    let opts = RequestOptions {
        grammar: Some(compiler.compile(&digits).expect("compile")),
        reasoning_end: Some(end.clone()),
        ..Default::default()
    };
    let out = run(&mut llm, &prompt, opts);
    assert_eq!(out[..=k], free[..=k], "the reasoning is not constrained");
    assert!(out.len() > k + 1, "an answer follows");
    assert!(
        out[k + 1..].iter().all(is_digit),
        "the answer follows the grammar: {out:?}"
    );

    // Without them, the constraint applies from the first token.
    let opts = RequestOptions {
        grammar: Some(compiler.compile(&digits).expect("compile")),
        ..Default::default()
    };
    let out = run(&mut llm, &prompt, opts);
    assert!(out.iter().all(is_digit), "{out:?}");
}
