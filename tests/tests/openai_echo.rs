//! Scoring prompts over HTTP, as evaluation harnesses do: completions'
//! `echo` with `logprobs`, vLLM's `prompt_logprobs` and `max_tokens: 0`,
//! checked against llama.cpp's logprobs on the demo model.

use pagoda_e2e::{agent, read_sse, reference_json, Server};
use serde_json::{json, Value};

/// The reference checker's tolerance (check_greedy.py's TOL): two correct
/// implementations of the quantized model may differ by this much in one
/// token's logprob.
const TOL_TOKEN: f64 = 0.4;

/// Their mean difference over a continuation is far smaller (0.02–0.05
/// nats when this was written); a systematic error is not.
const TOL_MEAN: f64 = 0.1;

fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(Value::as_f64)
        .collect()
}

fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).expect("token ids")
}

/// Scores `prompt_ids + output_ids` of a reference case in one request.
fn score(s: &Server, case: &Value, k: usize) -> Value {
    let all: Vec<u64> = ids(&case["prompt_ids"])
        .into_iter()
        .chain(ids(&case["output_ids"]))
        .collect();
    let body = json!({
        "model": "smol", "prompt": all, "max_tokens": 0,
        "echo": true, "logprobs": k, "prompt_logprobs": k,
    });
    let (status, v) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v
}

#[test]
fn echo_scores_the_reference_continuations_as_llama_cpp_and_f32_do() {
    let s = Server::start(&[]);
    let mut report = String::new();
    for file in ["smollm2_llamacpp.json", "smollm2_hf_f32.json"] {
        let reference = reference_json(file);
        for case in reference["greedy"].as_array().expect("cases") {
            let name = case["name"].as_str().expect("name");
            let prompt_len = ids(&case["prompt_ids"]).len();
            let output = ids(&case["output_ids"]);
            let v = score(&s, case, 5);
            let lps = floats(&v["choices"][0]["logprobs"]["token_logprobs"]);
            assert_eq!(lps.len(), prompt_len + output.len(), "{file} {name}");
            let mut sum = 0.0;
            let mut worst = 0f64;
            for (j, step) in case["top5_logprobs"]
                .as_array()
                .expect("top5")
                .iter()
                .enumerate()
            {
                let step: Vec<(u64, f64)> = serde_json::from_value(step.clone()).expect("pairs");
                let want = step
                    .iter()
                    .find(|(t, _)| *t == output[j])
                    .map(|&(_, lp)| lp)
                    .expect("the reference's token is in its top 5");
                let got = lps[prompt_len + j].expect("a scored token");
                let d = (got - want).abs();
                assert!(
                    d < TOL_TOKEN,
                    "{file} {name}, step {j}: logprob {got} vs {want}"
                );
                sum += d;
                worst = worst.max(d);
            }
            let mean = sum / output.len() as f64;
            assert!(
                mean < TOL_MEAN,
                "{file} {name}: mean |difference| {mean:.3}"
            );
            report.push_str(&format!(
                "{file} {name}: {} tokens, mean {mean:.4}, max {worst:.3}\n",
                output.len()
            ));
        }
    }
    eprintln!("{report}");
}

#[test]
fn echo_has_openai_shape_and_vllm_prompt_logprobs_agree_with_it() {
    let s = Server::start(&[]);
    let reference = reference_json("smollm2_llamacpp.json");
    let case = &reference["greedy"][0];
    let prompt_len = ids(&case["prompt_ids"]).len();
    let output = ids(&case["output_ids"]);
    let total = prompt_len + output.len();
    let v = score(&s, case, 5);
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], total, "{v}");
    let full = format!(
        "{}{}",
        case["prompt"].as_str().expect("prompt"),
        case["output_text"].as_str().expect("text")
    );
    assert_eq!(
        c["text"].as_str(),
        Some(full.as_str()),
        "the echo is the prompt's text"
    );
    let lp = &c["logprobs"];
    let token_logprobs = floats(&lp["token_logprobs"]);
    assert_eq!(token_logprobs[0], None, "nothing predicts the first token");
    assert!(lp["top_logprobs"][0].is_null(), "{lp}");
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(tokens.concat(), full, "the tokens spell the text");
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .filter_map(|o| o.as_u64().map(|o| o as usize))
        .collect();
    // Offsets count characters, as OpenAI's do.
    let chars: Vec<char> = full.chars().collect();
    for (k, t) in tokens.iter().enumerate() {
        let at: String = chars[offsets[k]..offsets[k] + t.chars().count()]
            .iter()
            .collect();
        assert_eq!(at, *t, "token {k}");
    }
    let prompt_logprobs = c["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(prompt_logprobs.len(), total);
    assert!(prompt_logprobs[0].is_null());
    let all: Vec<u64> = ids(&case["prompt_ids"]).into_iter().chain(output).collect();
    for pos in 1..total {
        let top = lp["top_logprobs"][pos].as_object().expect("top map");
        assert_eq!(top.len(), 5, "position {pos}: {top:?}");
        let got = token_logprobs[pos].expect("scored");
        // vLLM's view: keyed by id, the token itself with its rank, then
        // the alternatives; the same numbers as the OpenAI view.
        let row = prompt_logprobs[pos].as_object().expect("a map");
        assert!((5..=6).contains(&row.len()), "position {pos}: {row:?}");
        let entry = &row[&all[pos].to_string()];
        assert_eq!(
            entry["logprob"].as_f64(),
            Some(got),
            "position {pos}: {entry}"
        );
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        let rank = entry["rank"].as_u64().expect("rank");
        // Rank 1 exactly when the token is the best (lm-eval's is_greedy).
        assert_eq!(
            rank == 1,
            got == best,
            "position {pos}: rank {rank}, {got} vs {best}"
        );
        for (id, e) in row {
            let lp = e["logprob"].as_f64().expect("logprob");
            assert!(lp <= best, "position {pos}: {id} {e}");
            assert!(e["decoded_token"].is_string(), "{e}");
        }
    }
}

/// lm-eval's `gguf` adapter (written for llama.cpp's server) names no
/// model, sends `context + continuation` as one text with `max_tokens: 1`,
/// and splits the tokens where `text_offset` reaches the context's length
/// in characters.
#[test]
fn a_scoring_request_without_a_model_is_served_and_splits_by_text_offset() {
    let s = Server::start(&[]);
    let context = "Question: What is the capital of France?\nAnswer:";
    let continuation = " Paris";
    let body = json!({
        "prompt": format!("{context}{continuation}"), "max_tokens": 1,
        "echo": true, "logprobs": 10, "temperature": 0.0,
    });
    let (status, v) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "smol", "the served model answers");
    let lp = &v["choices"][0]["logprobs"];
    let offsets = lp["text_offset"].as_array().expect("offsets");
    let split = offsets
        .iter()
        .position(|o| o.as_u64().expect("offset") as usize >= context.chars().count())
        .expect("the continuation's tokens");
    let tokens: Vec<&str> = lp["tokens"].as_array().expect("tokens")[split..]
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let generated = v["choices"][0]["text"]
        .as_str()
        .expect("text")
        .strip_prefix(&format!("{context}{continuation}"))
        .expect("the echo comes first")
        .to_string();
    assert_eq!(tokens.concat(), format!("{continuation}{generated}"));
    let scores = floats(&lp["token_logprobs"]);
    assert!(
        scores[split..].iter().all(|x| x.is_some_and(|x| x <= 0.0)),
        "{lp}"
    );
}

#[test]
fn echo_streams_the_prompt_first_and_matches_the_unstreamed_body() {
    let s = Server::start(&[]);
    let body = json!({
        "model": "smol", "prompt": "The capital of France is", "max_tokens": 6,
        "temperature": 0, "echo": true, "logprobs": 2, "n": 2,
    });
    let (status, whole) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    for c in whole["choices"].as_array().expect("choices") {
        let text = c["text"].as_str().expect("text");
        assert!(text.starts_with("The capital of France is"), "{text:?}");
        assert!(text.len() > "The capital of France is".len(), "{text:?}");
        let lps = floats(&c["logprobs"]["token_logprobs"]);
        assert_eq!(lps.len(), 5 + 6, "five prompt tokens, six generated");
        assert_eq!(lps[0], None);
        assert!(
            lps[1..].iter().all(|l| l.is_some_and(|l| l <= 0.0)),
            "{lps:?}"
        );
    }
    // The generated part's logprobs are those an unechoed request gets.
    let mut plain = body.clone();
    plain["echo"] = json!(false);
    let (_, plain) = s.post("/v1/completions", &plain);
    let tail = floats(&plain["choices"][0]["logprobs"]["token_logprobs"]);
    let echoed = floats(&whole["choices"][0]["logprobs"]["token_logprobs"]);
    for (a, b) in echoed[5..].iter().zip(&tail) {
        assert!(
            (a.expect("scored") - b.expect("scored")).abs() < 1e-3,
            "{echoed:?} vs {tail:?}"
        );
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = agent()
        .post(&s.url("/v1/completions"))
        .send_json(&streamed)
        .expect("stream");
    assert_eq!(r.status(), 200);
    let events = read_sse(r.into_body().into_reader());
    let mut text = [String::new(), String::new()];
    let mut lps: [Vec<Option<f64>>; 2] = Default::default();
    let mut first = [true, true];
    for e in events.iter().filter(|e| e.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(e).expect("chunk JSON");
        for c in chunk["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            let t = c["text"].as_str().expect("text");
            if first[i] {
                assert!(
                    t.starts_with("The capital of France is"),
                    "first chunk {t:?}"
                );
                first[i] = false;
            }
            text[i].push_str(t);
            if !c["logprobs"].is_null() {
                lps[i].extend(floats(&c["logprobs"]["token_logprobs"]));
            }
        }
    }
    for i in 0..2 {
        assert_eq!(text[i], whole["choices"][i]["text"].as_str().expect("text"));
        assert_eq!(lps[i].len(), 11, "choice {i}: {:?}", lps[i]);
        let want = floats(&whole["choices"][i]["logprobs"]["token_logprobs"]);
        for (a, b) in lps[i].iter().zip(&want) {
            match (a, b) {
                (None, None) => {}
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-3, "choice {i}: {a} vs {b}"),
                _ => panic!("choice {i}: {:?} vs {want:?}", lps[i]),
            }
        }
    }
}

#[test]
fn chat_prompt_logprobs_and_bad_scoring_requests() {
    let s = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "What is 2+2?"}]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let (_, tok) = s.post(
        "/tokenize",
        &json!({"model": "smol", "messages": messages, "add_special_tokens": false}),
    );
    let pl = v["prompt_logprobs"]
        .as_array()
        .expect("top-level prompt_logprobs");
    assert_eq!(Some(pl.len() as u64), tok["count"].as_u64(), "{tok}");
    assert!(pl[0].is_null());
    let ids = tok["tokens"].as_array().expect("tokens");
    for (k, row) in pl.iter().enumerate().skip(1) {
        let row = row.as_object().expect("a map");
        // With 0 alternatives, only the token itself.
        assert_eq!(row.len(), 1, "{row:?}");
        assert!(
            row.contains_key(&ids[k].to_string()),
            "position {k}: {row:?}"
        );
    }
    for (body, param) in [
        (
            json!({"model": "smol", "prompt": "hi", "prompt_logprobs": 21}),
            "prompt_logprobs",
        ),
        (
            json!({"model": "smol", "prompt": "hi", "prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
        (
            json!({"model": "smol", "prompt": "hi", "logprobs": 21, "echo": true}),
            "logprobs",
        ),
        (
            json!({"model": "smol", "prompt": "hi", "echo": "yes"}),
            "echo",
        ),
        (
            json!({"model": "smol", "messages": messages, "echo": "yes"}),
            "echo",
        ),
    ] {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (status, e) = s.post(path, &body);
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
    // Nothing above harmed the server.
    let (status, _) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(status, 200);
}

#[test]
fn the_server_flag_names_tokens_by_id_without_the_request_asking() {
    let s = Server::start(&["--return-tokens-as-token-ids"]);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smol", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
                   "temperature": 0, "logprobs": true, "top_logprobs": 1}),
        ),
    ] {
        let (status, v) = s.post(path, &body);
        assert_eq!(status, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let tokens: Vec<String> = match lp["tokens"].as_array() {
            Some(t) => t
                .iter()
                .filter_map(|t| t.as_str().map(String::from))
                .collect(),
            None => lp["content"]
                .as_array()
                .expect("content logprobs")
                .iter()
                .filter_map(|c| c["token"].as_str().map(String::from))
                .collect(),
        };
        assert_eq!(tokens.len(), 3, "{path}: {v}");
        assert!(
            tokens.iter().all(|t| t.starts_with("token_id:")),
            "{path}: {tokens:?}"
        );
    }
}

#[test]
fn return_tokens_as_token_ids_names_every_token_by_its_id() {
    let s = Server::start(&[]);
    let reference = reference_json("smollm2_llamacpp.json");
    let case = &reference["greedy"][0];
    let prompt = ids(&case["prompt_ids"]);
    let body = json!({
        "model": "smol", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "echo": true, "logprobs": 2, "return_tokens_as_token_ids": true,
    });
    let (status, v) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_str().expect("a token"))
        .collect();
    assert_eq!(tokens.len(), prompt.len() + 4, "{v}");
    for (t, id) in tokens.iter().zip(&prompt) {
        assert_eq!(*t, format!("token_id:{id}"));
    }
    // The generated tokens, and every alternative, are named alike.
    let output = ids(&case["output_ids"]);
    assert_eq!(
        tokens[prompt.len()],
        format!("token_id:{}", output[0]),
        "{v}"
    );
    let top = lp["top_logprobs"][prompt.len()].as_object().expect("top");
    assert!(top.keys().all(|k| k.starts_with("token_id:")), "{top:?}");
}
