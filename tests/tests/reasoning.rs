//! `--reasoning-parser deepseek_r1` with a chat template that opens
//! `<think>` (given with `--chat-template`, as a DeepSeek-R1 template
//! does): the output goes to `reasoning_content`, streamed and not, and to
//! a reasoning item on the Responses API; `chat_template_kwargs`
//! (`enable_thinking: false`) reaches the template, which then closes the
//! reasoning in the prompt, so the output is the answer and a JSON schema
//! constrains it from the first token. (The split of an output that
//! writes `</think>` itself, and the constraint that waits for it, are
//! tested where the tokens can be chosen: reasoning.rs's unit tests and
//! host/tests/reasoning_grammar.rs.)

use pagoda_e2e::{Server, TempDir};
use serde_json::{json, Value};

const TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
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

    // Streamed: the same text, as reasoning_content deltas.
    let (st, text) = s.post_text("/v1/chat/completions", &chat(json!({"stream": true})));
    assert_eq!(st, 200);
    let mut streamed = String::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(line).expect("chunk");
        let d = &c["choices"][0]["delta"];
        assert!(
            d.get("content").is_none_or(|x| x == ""),
            "no answer text while reasoning: {c}"
        );
        if let Some(r) = d["reasoning_content"].as_str() {
            streamed.push_str(r);
        }
    }
    assert_eq!(streamed, reasoning);

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
}
