//! `--skip-tokenizer-init`, as vLLM's: token ids in, token ids out.
//! Completions take prompts of ids and answer with `token_ids` and empty
//! text (the same ids a normal server generates); what needs the tokenizer
//! (text prompts, chat, /tokenize, stop strings, structured output) is a
//! 400 with OpenAI's error shape.

use pagoda_e2e::Server;
use serde_json::{json, Value};

const PROMPT: [u32; 5] = [504, 3458, 282, 4649, 314];

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

#[test]
fn token_ids_in_token_ids_out() {
    let body = json!({"model": "smol", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": true});
    // What a server with its tokenizer generates for these ids.
    let want = {
        let s = Server::start(&[]);
        let mut b = body.clone();
        b["return_token_ids"] = json!(true);
        let (st, v) = s.post("/v1/completions", &b);
        assert_eq!(st, 200, "{v}");
        ids(&v["choices"][0]["token_ids"])
    };
    assert_eq!(want.len(), 6);

    let s = Server::start(&["--skip-tokenizer-init"]);
    let (st, v) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "", "{v}");
    assert_eq!(ids(&c["token_ids"]), want, "{v}");
    assert_eq!(ids(&c["prompt_token_ids"]), PROMPT.map(u64::from), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    // Logprobs name tokens by id.
    let mut b = body.clone();
    b["logprobs"] = json!(2);
    let (st, v) = s.post("/v1/completions", &b);
    assert_eq!(st, 200, "{v}");
    let tokens: Vec<&str> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let named: Vec<String> = want.iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(tokens, named, "{v}");
    // Streamed: empty text, the same ids chunk by chunk.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (st, text) = s.post_text("/v1/completions", &b);
    assert_eq!(st, 200, "{text}");
    let mut streamed = Vec::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(c) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        assert_eq!(c["choices"][0]["text"], "", "{text}");
        streamed.extend(ids(&c["choices"][0]["token_ids"]));
    }
    assert_eq!(streamed, want, "{text}");

    // What needs the tokenizer.
    for (path, bad, param) in [
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": "Hello"}),
            json!("prompt"),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": PROMPT, "stop": ["."]}),
            json!("stop"),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": PROMPT, "echo": true}),
            json!("echo"),
        ),
        (
            "/v1/completions",
            json!({"model": "smol", "prompt": PROMPT,
            "response_format": {"type": "json_object"}}),
            json!("response_format"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smol",
            "messages": [{"role": "user", "content": "Hi"}]}),
            Value::Null,
        ),
        (
            "/v1/responses",
            json!({"model": "smol", "input": "Hi"}),
            Value::Null,
        ),
        (
            "/tokenize",
            json!({"model": "smol", "prompt": "Hi"}),
            Value::Null,
        ),
    ] {
        let (st, v) = s.post(path, &bad);
        assert_eq!(st, 400, "{path} {bad}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"], param, "{path} {bad}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("--skip-tokenizer-init")),
            "{v}"
        );
    }
}
