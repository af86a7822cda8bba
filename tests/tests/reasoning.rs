//! `--reasoning-parser deepseek_r1` with a chat template that opens
//! `<think>` (given with `--chat-template`, as a DeepSeek-R1 template
//! does): the output goes to `reasoning` and `reasoning_content`, streamed
//! and not, and to a reasoning item on the Responses API, its tokens
//! counted in usage; an assistant turn's reasoning is read under either
//! name; `chat_template_kwargs`
//! (`enable_thinking: false`) reaches the template, which then closes the
//! reasoning in the prompt, so the output is the answer and a JSON schema
//! constrains it from the first token. (The split of an output that
//! writes `</think>` itself, and the constraint that waits for it, are
//! tested where the tokens can be chosen: reasoning.rs's unit tests and
//! host/tests/reasoning_grammar.rs.)

use pagoda_e2e::{Server, TempDir};
use serde_json::{json, Value};

const TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n\
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n\
{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}";

fn server(dir: &TempDir) -> Server {
    let path = dir.0.join("think.jinja");
    std::fs::write(&path, TEMPLATE).expect("template");
    let t = path.to_string_lossy().to_string();
    Server::start(&["--reasoning-parser", "deepseek_r1", "--chat-template", &t])
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "smol", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Is the sky blue?"}]});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

#[test]
fn reasoning_is_split_streamed_and_not_and_thinking_can_be_turned_off() {
    let dir = TempDir::new("reasoning");
    let s = server(&dir);
    // Thinking: the whole output is reasoning (the model never closes it
    // within 12 tokens), the answer is null.
    let (st, v) = s.post("/v1/chat/completions", &chat(json!({})));
    assert_eq!(st, 200, "{v}");
    let msg = &v["choices"][0]["message"];
    let reasoning = msg["reasoning_content"]
        .as_str()
        .expect("reasoning_content")
        .to_string();
    assert!(!reasoning.is_empty(), "{v}");
    assert!(msg["content"].is_null(), "{v}");
    // vLLM 0.32's name beside the older one.
    assert_eq!(msg["reasoning"], msg["reasoning_content"], "{v}");
    // Usage counts the reasoning's tokens: here all of the output's.
    let usage = &v["usage"];
    let thought = usage["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .expect("reasoning_tokens");
    let completion = usage["completion_tokens"].as_u64().expect("tokens");
    assert!(thought > 0 && thought <= completion, "{usage}");

    // Streamed: the same text, as reasoning (and reasoning_content)
    // deltas, and the same count in the usage chunk.
    let (st, text) = s.post_text(
        "/v1/chat/completions",
        &chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(st, 200);
    let mut streamed = String::new();
    let mut streamed_usage = Value::Null;
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(line).expect("chunk");
        if !c["usage"].is_null() {
            streamed_usage = c["usage"].clone();
        }
        let d = &c["choices"][0]["delta"];
        assert!(
            d.get("content").is_none_or(|x| x == ""),
            "no answer text while reasoning: {c}"
        );
        assert_eq!(d.get("reasoning"), d.get("reasoning_content"), "{c}");
        if let Some(r) = d["reasoning"].as_str() {
            streamed.push_str(r);
        }
    }
    assert_eq!(streamed, reasoning);
    assert_eq!(
        streamed_usage["completion_tokens_details"]["reasoning_tokens"].as_u64(),
        Some(thought),
        "{streamed_usage}"
    );

    // An assistant turn's reasoning is read under either name: it reaches
    // the template (which reads `reasoning_content`) the same way.
    let turn = |key: &str| {
        let mut m = json!({"role": "assistant", "content": "Yes."});
        m[key] = json!("The sky scatters blue light.");
        json!({"model": "smol", "messages": [
            {"role": "user", "content": "Is the sky blue?"}, m,
            {"role": "user", "content": "Why?"}]})
    };
    let tokens = |body: &Value| {
        let (st, t) = s.post("/tokenize", body);
        assert_eq!(st, 200, "{t}");
        t["count"].as_u64().expect("count")
    };
    let (with_new, with_old) = (turn("reasoning"), turn("reasoning_content"));
    let mut without = with_new.clone();
    without["messages"][1]
        .as_object_mut()
        .expect("message")
        .remove("reasoning");
    assert_eq!(tokens(&with_new), tokens(&with_old));
    assert!(tokens(&with_new) > tokens(&without));
    for mut body in [with_new, with_old] {
        body["max_tokens"] = json!(4);
        let (st, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
    }

    // enable_thinking: false reaches the template (more prompt tokens: it
    // writes an empty think block), and the output is the answer.
    let count = |extra: Value| {
        let mut body = chat(extra);
        body.as_object_mut().expect("object").remove("max_tokens");
        body.as_object_mut().expect("object").remove("temperature");
        let (st, t) = s.post("/tokenize", &body);
        assert_eq!(st, 200, "{t}");
        t["count"].as_u64().expect("count")
    };
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    assert!(
        count(off.clone()) > count(json!({})),
        "the kwarg changed the prompt"
    );
    let (st, v) = s.post("/v1/chat/completions", &chat(off.clone()));
    assert_eq!(st, 200, "{v}");
    let msg = &v["choices"][0]["message"];
    assert!(
        msg["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{v}"
    );
    assert!(
        msg.get("reasoning_content").is_none_or(Value::is_null),
        "{v}"
    );
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(count(off)));
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64(),
        Some(0),
        "no reasoning, no reasoning tokens: {v}"
    );

    // With thinking off, a JSON schema constrains the answer at once.
    let schema = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"], "additionalProperties": false});
    let (st, v) = s.post(
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 30, "chat_template_kwargs": {"enable_thinking": false},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})),
    );
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let parsed: Value = serde_json::from_str(content).expect("JSON answer");
    assert!(
        parsed["answer"] == "yes" || parsed["answer"] == "no",
        "{content}"
    );
    // With thinking on, the schema waits for the reasoning to end, which
    // it does not here: the output is free reasoning, not JSON.
    let (st, v) = s.post(
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["reasoning_content"].as_str(),
        Some(reasoning.as_str())
    );

    // The Responses API: the reasoning is an item of its own.
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "Is the sky blue?", "max_output_tokens": 12, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    let item = &v["output"][0];
    assert_eq!(item["type"], "reasoning", "{v}");
    assert_eq!(item["content"][0]["type"], "reasoning_text", "{v}");
    assert_eq!(
        item["content"][0]["text"].as_str(),
        Some(reasoning.as_str()),
        "{v}"
    );
    let usage = &v["usage"];
    let thought = usage["output_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .expect("reasoning_tokens");
    let output = usage["output_tokens"].as_u64().expect("output_tokens");
    assert!(thought > 0 && thought <= output, "{usage}");
}

/// `qwen3` with a template that opens `<think>` in the generation prompt
/// (Qwen3-Thinking style, where the model writes only `</think>`): the
/// output starts inside the reasoning instead of leaking into `content`.
/// The demo tokenizer has no think tokens, which start-up warns about once.
#[test]
fn qwen3_reads_a_template_that_opens_the_reasoning() {
    let dir = TempDir::new("reasoning-qwen3");
    let path = dir.0.join("think.jinja");
    std::fs::write(&path, TEMPLATE).expect("template");
    let t = path.to_string_lossy().to_string();
    let s = Server::start(&["--reasoning-parser", "qwen3", "--chat-template", &t]);
    for stream in [false, true] {
        let (st, text) = s.post_text("/v1/chat/completions", &chat(json!({"stream": stream})));
        assert_eq!(st, 200, "{text}");
        let (reasoning, content) = if stream {
            let mut r = String::new();
            let mut c = String::new();
            for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                let d = &v["choices"][0]["delta"];
                r += d["reasoning"].as_str().unwrap_or("");
                c += d["content"].as_str().unwrap_or("");
            }
            (r, c)
        } else {
            let v: Value = serde_json::from_str(&text).expect("json");
            let m = &v["choices"][0]["message"];
            assert!(m["content"].is_null(), "{v}");
            (
                m["reasoning"].as_str().unwrap_or("").to_string(),
                String::new(),
            )
        };
        assert!(!reasoning.is_empty(), "stream={stream}: {text}");
        assert_eq!(content, "", "stream={stream}: the reasoning leaked: {text}");
    }
    // Thinking off: the template closes it, the output is all answer.
    let (st, v) = s.post(
        "/v1/chat/completions",
        &chat(json!({"chat_template_kwargs": {"enable_thinking": false}})),
    );
    assert_eq!(st, 200, "{v}");
    assert!(v["choices"][0]["message"]["reasoning"].is_null(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let log = s.log_text();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains(
                "--reasoning-parser qwen3: the tokenizer has no <think> or </think> token"
            ))
            .count(),
        1,
        "{log}"
    );
}

/// Whether the template closed the reasoning is read from what its
/// generation prompt wrote, not from earlier turns or the client's text:
/// a `</think>` in a user's message or an earlier assistant turn leaves the
/// new output's reasoning to the parser.
#[test]
fn think_tags_in_earlier_turns_or_user_text_do_not_close_the_reasoning() {
    // The demo model's own template, which writes no tags: deepseek_r1
    // reads the output as starting inside the reasoning.
    let s = Server::start(&["--reasoning-parser", "deepseek_r1"]);
    for messages in [
        json!([{"role": "user", "content": "What does </think> mean in a prompt?"}]),
        json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>greet</think>Hello!"},
            {"role": "user", "content": "Is the sky blue?"},
        ]),
    ] {
        let (st, v) = s.post(
            "/v1/chat/completions",
            &json!({"model": "smol", "max_tokens": 8, "temperature": 0, "messages": messages}),
        );
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert!(
            m["reasoning"].as_str().is_some_and(|r| !r.is_empty()),
            "{messages}: the output was not read as reasoning: {v}"
        );
        assert!(
            v["usage"]["completion_tokens_details"]["reasoning_tokens"]
                .as_u64()
                .is_some_and(|n| n > 0),
            "{v}"
        );
    }
}
