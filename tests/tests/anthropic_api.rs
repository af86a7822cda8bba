//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`)
//! of the real binary, on the demo model, over raw HTTP.

use pagoda_e2e::{agent, Server};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

fn question(max_tokens: u64) -> Value {
    json!({
        "model": "smol",
        "max_tokens": max_tokens,
        "temperature": 0,
        "system": "You are a helpful assistant.",
        "messages": [{"role": "user", "content": "What is 2+2? Answer briefly."}],
    })
}

fn weather_tool() -> Value {
    json!([{
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }])
}

/// POSTs with extra headers; returns (status, parsed body).
fn post_with(s: &Server, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let mut req = agent().post(&s.url(path));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut r = req.send_json(body).expect("request");
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// A streamed message's events, as (event name, data).
fn events(s: &Server, body: &Value) -> Vec<(String, Value)> {
    let mut r = agent()
        .post(&s.url("/v1/messages"))
        .send_json(body)
        .expect("request");
    assert_eq!(r.status().as_u16(), 200);
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let mut out = Vec::new();
    let mut name = String::new();
    for line in BufReader::new(r.body_mut().as_reader()).lines() {
        let line = line.expect("SSE line");
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            let data: Value = serde_json::from_str(d).expect("event data is JSON");
            assert_eq!(data["type"], name.as_str(), "{d}");
            out.push((name.clone(), data));
        }
    }
    out
}

/// The error shape every failure takes: `{"type": "error", "error": {"type", "message"}}`.
fn assert_error(body: &Value, kind: &str) {
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

#[test]
fn messages_plain_streamed_counted_and_refused() {
    let s = Server::start(&[]);
    // A plain message.
    let (status, msg) = s.post("/v1/messages", &question(24));
    assert_eq!(status, 200, "{msg}");
    assert!(
        msg["id"].as_str().is_some_and(|i| i.starts_with("msg_")),
        "{msg}"
    );
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["role"], "assistant");
    assert_eq!(msg["model"], "smol");
    let content = msg["content"].as_array().expect("content");
    assert_eq!(content.len(), 1, "{msg}");
    assert_eq!(content[0]["type"], "text");
    let text = content[0]["text"].as_str().expect("text").to_string();
    assert!(!text.is_empty());
    assert!(
        matches!(msg["stop_reason"].as_str(), Some("end_turn" | "max_tokens")),
        "{msg}"
    );
    assert!(msg["stop_sequence"].is_null());
    let input = msg["usage"]["input_tokens"].as_u64().expect("input_tokens");
    let output = msg["usage"]["output_tokens"]
        .as_u64()
        .expect("output_tokens");
    assert!(input > 0 && output > 0 && output <= 24, "{msg}");

    // count_tokens counts the prompt /v1/messages ran.
    let mut count = question(24);
    count.as_object_mut().unwrap().remove("max_tokens");
    let (status, counted) = s.post("/v1/messages/count_tokens", &count);
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted, json!({"input_tokens": input}));

    // Streamed: the same text, in Anthropic's event order.
    let mut body = question(24);
    body["stream"] = json!(true);
    let ev = events(&s, &body);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[0], "message_start", "{names:?}");
    assert_eq!(names[1], "ping", "{names:?}");
    assert_eq!(names[2], "content_block_start", "{names:?}");
    let n = names.len();
    assert_eq!(
        &names[n - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{names:?}"
    );
    assert!(names[3..n - 3].iter().all(|k| *k == "content_block_delta"));
    let start = &ev[0].1["message"];
    assert_eq!(start["usage"]["input_tokens"], input);
    assert!(start["content"].as_array().is_some_and(|c| c.is_empty()));
    assert!(start["stop_reason"].is_null());
    assert_eq!(
        ev[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let streamed: String = ev
        .iter()
        .filter(|(k, _)| k == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().expect("text").to_string()
        })
        .collect();
    assert_eq!(streamed, text);
    let delta = &ev[n - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], msg["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], output);

    // A stop sequence ends the message and is named.
    let mut stop = question(24);
    let first_word = text.split_whitespace().nth(1).unwrap_or("4").to_string();
    stop["stop_sequences"] = json!([first_word]);
    let (status, stopped) = s.post("/v1/messages", &stop);
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(
        stopped["stop_reason"], "stop_sequence",
        "{stopped} ({first_word})"
    );
    assert_eq!(stopped["stop_sequence"], first_word.as_str());

    // Refusals, in Anthropic's shape.
    let mut no_max = question(24);
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let (status, e) = s.post("/v1/messages", &no_max);
    assert_eq!(status, 400);
    assert_error(&e, "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));

    let mut unknown = question(4);
    unknown["model"] = json!("claude-sonnet-4-5");
    let (status, e) = s.post("/v1/messages", &unknown);
    assert_eq!(status, 404);
    assert_error(&e, "not_found_error");
    let (status, e) = s.post("/v1/messages/count_tokens", &unknown);
    assert_eq!(status, 404);
    assert_error(&e, "not_found_error");

    let mut image = question(4);
    image["messages"] = json!([{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}]);
    let (status, e) = s.post("/v1/messages", &image);
    assert_eq!(status, 400);
    assert_error(&e, "invalid_request_error");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("image"),
        "{e}"
    );

    let (status, e) = s.post("/v1/messages", &json!("not an object"));
    assert_eq!(status, 400);
    assert_error(&e, "invalid_request_error");

    let mut r = agent().get(&s.url("/v1/messages")).call().expect("GET");
    assert_eq!(r.status().as_u16(), 405);
    let e: Value = serde_json::from_str(&r.body_mut().read_to_string().expect("body")).unwrap();
    assert_error(&e, "invalid_request_error");
}

#[test]
fn tool_use_is_parsed_and_tool_results_continue() {
    let s = Server::start(&[]);
    let ask = json!({
        "model": "smol",
        "max_tokens": 64,
        "temperature": 0,
        "tools": weather_tool(),
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
    });
    let (status, msg) = s.post("/v1/messages", &ask);
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["stop_reason"], "tool_use", "{msg}");
    let blocks = msg["content"].as_array().expect("content");
    let call = blocks
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap_or_else(|| panic!("no tool_use block: {msg}"));
    assert_eq!(call["name"], "get_weather");
    assert!(call["id"].as_str().is_some_and(|i| i.starts_with("toolu_")));
    assert!(call["input"]["city"].is_string(), "{call}");

    // Streamed, the same call arrives as input_json_delta pieces.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let ev = events(&s, &streamed);
    let start = ev
        .iter()
        .find(|(k, _)| k == "content_block_start")
        .expect("a block");
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    let json_text: String = ev
        .iter()
        .filter(|(k, d)| k == "content_block_delta" && d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| {
            d["delta"]["partial_json"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    let input: Value = serde_json::from_str(&json_text).expect("the pieces make JSON");
    assert_eq!(input, call["input"]);
    let delta = ev
        .iter()
        .find(|(k, _)| k == "message_delta")
        .expect("message_delta");
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");

    // `any` must call some tool.
    let mut any = ask.clone();
    any["tool_choice"] = json!({"type": "any", "disable_parallel_tool_use": true});
    let (status, msg2) = s.post("/v1/messages", &any);
    assert_eq!(status, 200, "{msg2}");
    assert_eq!(msg2["stop_reason"], "tool_use", "{msg2}");
    assert_eq!(msg2["content"][0]["type"], "tool_use", "{msg2}");

    // The result goes back as a tool_result; the model answers in text.
    let follow = json!({
        "model": "smol",
        "max_tokens": 32,
        "temperature": 0,
        "tools": weather_tool(),
        "messages": [
            {"role": "user", "content": "What is the weather like in Paris?"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                "content": [{"type": "text", "text": "Sunny, 22 degrees Celsius."}]}]},
        ],
    });
    let (status, answer) = s.post("/v1/messages", &follow);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["content"][0]["type"], "text", "{answer}");
    assert!(matches!(
        answer["stop_reason"].as_str(),
        Some("end_turn" | "max_tokens")
    ));
    // The tool result is in the prompt: it is longer than the question's.
    let (_, q) = s.post(
        "/v1/messages/count_tokens",
        &json!({"model": "smol", "tools": weather_tool(),
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}]}),
    );
    let (_, f) = s.post("/v1/messages/count_tokens", &follow);
    assert_eq!(f["input_tokens"], answer["usage"]["input_tokens"]);
    assert!(
        f["input_tokens"].as_u64() > q["input_tokens"].as_u64(),
        "{q} {f}"
    );

    // A tool_choice naming no offered tool is the client's mistake.
    let mut wrong = ask.clone();
    wrong["tool_choice"] = json!({"type": "tool", "name": "get_time"});
    let (status, e) = s.post("/v1/messages", &wrong);
    assert_eq!(status, 400, "{e}");
    assert_error(&e, "invalid_request_error");
}

#[test]
fn x_api_key_authenticates_like_a_bearer_token() {
    let s = Server::start(&["--api-key", "sekret"]);
    let body = question(4);
    let (status, e) = post_with(&s, "/v1/messages", &[("x-api-key", "wrong")], &body);
    assert_eq!(status, 401, "{e}");
    assert_error(&e, "authentication_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-api-key"),
        "{e}"
    );
    let (status, e) = post_with(&s, "/v1/messages/count_tokens", &[], &body);
    assert_eq!(status, 401, "{e}");
    assert_error(&e, "authentication_error");
    let (status, msg) = post_with(
        &s,
        "/v1/messages",
        &[("x-api-key", "sekret"), ("anthropic-version", "2023-06-01")],
        &body,
    );
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["type"], "message");
    let (status, msg) = post_with(
        &s,
        "/v1/messages",
        &[("authorization", "Bearer sekret")],
        &body,
    );
    assert_eq!(status, 200, "{msg}");
    // The OpenAI routes keep their own header: x-api-key does not open them.
    let (status, e) = post_with(
        &s,
        "/v1/chat/completions",
        &[("x-api-key", "sekret")],
        &json!({"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 401, "{e}");
    assert!(e["error"]["code"] == "invalid_api_key", "{e}");
}

/// A DeepSeek-R1-style template: it opens `<think>` unless
/// `enable_thinking` is false, when it closes it in the prompt.
const THINKING_TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n\
{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}";

#[test]
fn thinking_blocks_come_from_the_reasoning_parser() {
    let dir = pagoda_e2e::TempDir::new("anthropic-thinking");
    let path = dir.0.join("think.jinja");
    std::fs::write(&path, THINKING_TEMPLATE).expect("template");
    let t = path.to_string_lossy().to_string();
    let s = Server::start(&["--reasoning-parser", "deepseek_r1", "--chat-template", &t]);
    let body = |thinking: &str, stream: bool| {
        json!({"model": "smol", "max_tokens": 12, "temperature": 0, "stream": stream,
            "thinking": {"type": thinking, "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "Is the sky blue?"}]})
    };
    // Thinking on: the model never closes it within 12 tokens, so the
    // output is one thinking block.
    let (status, msg) = s.post("/v1/messages", &body("enabled", false));
    assert_eq!(status, 200, "{msg}");
    let block = &msg["content"][0];
    assert_eq!(block["type"], "thinking", "{msg}");
    let thinking = block["thinking"].as_str().expect("thinking").to_string();
    assert!(!thinking.is_empty());
    assert!(block["signature"].is_string(), "{msg}");
    assert_eq!(msg["stop_reason"], "max_tokens");

    // Streamed: thinking_delta pieces, then the signature, then the stop.
    let ev = events(&s, &body("enabled", true));
    assert_eq!(ev[2].1["content_block"]["type"], "thinking", "{ev:?}");
    let mut streamed = String::new();
    let mut signed = false;
    for (k, d) in &ev {
        if k != "content_block_delta" {
            continue;
        }
        match d["delta"]["type"].as_str() {
            Some("thinking_delta") => {
                assert!(!signed, "thinking after the signature");
                streamed.push_str(d["delta"]["thinking"].as_str().unwrap_or(""));
            }
            Some("signature_delta") => signed = true,
            other => panic!("unexpected delta {other:?}"),
        }
    }
    assert!(signed);
    assert_eq!(streamed, thinking);

    // Thinking off: the template closes it in the prompt; the output is text.
    let (status, msg) = s.post("/v1/messages", &body("disabled", false));
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["content"][0]["type"], "text", "{msg}");
    assert!(msg["content"]
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b["type"] != "thinking"));
}
