//! vLLM's `allowed_token_ids` and `bad_words` on the OpenAI endpoints of
//! the real binary, on the demo model: every completion token is an
//! allowed one; a bad word (as text, tokenized with and without a leading
//! space) never appears in a chat answer; and bad values are 400s naming
//! the field.

use pagoda_e2e::Server;
use serde_json::{json, Value};

/// The ids the response's logprobs name (`return_tokens_as_token_ids`).
fn ids_of(tokens: impl Iterator<Item = Value>) -> Vec<u32> {
    tokens
        .map(|t| {
            let t = t.as_str().expect("a token").to_string();
            t.strip_prefix("token_id:")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("not a token id: {t}"))
        })
        .collect()
}

fn tokenize(s: &Server, text: &str) -> Vec<u32> {
    let (status, t) = s.post(
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    assert_eq!(status, 200, "{t}");
    serde_json::from_value(t["tokens"].clone()).expect("ids")
}

#[test]
fn allowed_ids_and_bad_words_reach_the_sampler() {
    let s = Server::start(&[]);

    // Completions: only the allowed ids, greedy and sampled.
    let allowed: Vec<u32> = tokenize(&s, " one two three four five six seven");
    for temperature in [0.0, 1.0] {
        let body = json!({
            "model": "smol", "prompt": "Count with me:", "max_tokens": 10,
            "temperature": temperature, "seed": 5, "ignore_eos": true,
            "allowed_token_ids": allowed, "logprobs": 0,
            "return_tokens_as_token_ids": true,
        });
        let (status, v) = s.post("/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        let tokens = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .expect("tokens")
            .clone();
        let got = ids_of(tokens.into_iter());
        assert_eq!(got.len(), 10, "{v}");
        assert!(
            got.iter().all(|t| allowed.contains(t)),
            "{got:?} outside {allowed:?}"
        );
    }

    // Chat: the greedy answer's first word, banned as text.
    let chat = |bad_words: Option<Vec<&str>>| {
        let mut body = json!({
            "model": "smol", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "logprobs": true, "return_tokens_as_token_ids": true,
        });
        if let Some(w) = bad_words {
            body["bad_words"] = json!(w);
        }
        let (status, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .expect("logprobs")
            .clone();
        ids_of(content.into_iter().map(|c| c["token"].clone()))
    };
    let free = chat(None);
    assert!(free.len() > 1);
    let (_, d) = s.post("/detokenize", &json!({"tokens": [free[0]]}));
    let word = d["prompt"].as_str().expect("text").trim().to_string();
    assert!(!word.is_empty(), "{d}");
    // Both spellings vLLM bans: at the start of a text and after a space.
    let banned = [tokenize(&s, &word), tokenize(&s, &format!(" {word}"))];
    let got = chat(Some(vec![&word]));
    assert_ne!(got, free, "banning {word:?} changed nothing");
    for b in &banned {
        assert!(
            !got.windows(b.len()).any(|w| w == b.as_slice()),
            "{word:?} ({b:?}) in {got:?}"
        );
    }

    // Bad values: 400s that name the field.
    let cases = [
        (
            json!({"allowed_token_ids": [5, 10_000_000]}),
            "allowed_token_ids",
        ),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (json!({"allowed_token_ids": "5"}), "allowed_token_ids"),
        (json!({"bad_words": ["  "]}), "bad_words"),
        (json!({"bad_words": [3]}), "bad_words"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"model": "smol", "prompt": "hi", "max_tokens": 2});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        let (status, v) = s.post("/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}
