//! The Responses API as vLLM 0.32 serves it: `reasoning` items in `input`
//! (so `input + response.output` continues a reasoning model's turn),
//! logprobs when `include` asks (streamed too), `background` with `store`
//! and cancel, `namespace` tools, `GET /v1/responses/{id}/input_items`,
//! a named tool choice beside a `text.format` (instructor's
//! RESPONSES_TOOLS), a stream cut by `max_output_tokens` that ends with
//! `response.completed`, and `/v1/responses/render`.

use pagoda_e2e::{Server, TempDir};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A template that writes an assistant turn's reasoning, so the prompt
/// shows whether a `reasoning` input item reached it.
const TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n\
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

fn prompt_text(s: &Server, ids: &Value) -> String {
    let (st, d) = s.post("/detokenize", &json!({"model": "smol", "tokens": ids}));
    assert_eq!(st, 200, "{d}");
    d["prompt"].as_str().unwrap_or_default().to_string()
}

#[test]
fn reasoning_items_render_and_input_items() {
    let dir = TempDir::new("responses-vllm");
    let path = dir.0.join("t.jinja");
    std::fs::write(&path, TEMPLATE).expect("template");
    let t = path.to_string_lossy().to_string();
    let s = Server::start(&["--chat-template", &t]);
    let input = json!([
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "GREET-FIRST"}]},
        {"type": "message", "role": "assistant", "id": "msg_a",
         "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]);
    // The reasoning reaches the template with the assistant turn after it.
    let (st, r) = s.post(
        "/v1/responses/render",
        &json!({"model": "smol", "input": input, "instructions": "Be kind."}),
    );
    assert_eq!(st, 200, "{r}");
    let text = prompt_text(&s, &r["token_ids"]);
    assert!(
        text.contains("<think>GREET-FIRST</think>Hello!"),
        "{text:?}"
    );
    assert!(text.starts_with("<|im_start|>system\nBe kind."), "{text:?}");
    // Render is what generation sees: the same ids as chat's render.
    let (_, c) = s.post(
        "/v1/chat/completions/render",
        &json!({"model": "smol", "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "GREET-FIRST"},
            {"role": "user", "content": "How are you?"}]}),
    );
    assert_eq!(r["token_ids"], c["token_ids"], "{r} vs {c}");
    // Served, and its input items listed (newest first by default).
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": input, "max_output_tokens": 3}),
    );
    assert_eq!(st, 200, "{v}");
    let id = v["id"].as_str().expect("id");
    let (st, body) = s.get(&format!("/v1/responses/{id}/input_items"));
    assert_eq!(st, 200, "{body}");
    let list: Value = serde_json::from_str(&body).expect("json");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .map(|a| a.iter().filter_map(|i| i["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids.len(), 4, "{list}");
    assert_eq!(ids[1], "msg_a", "{list}");
    assert_eq!(ids[2], "rs_1", "{list}");
    assert_eq!(list["object"], "list", "{list}");
    assert_eq!(list["has_more"], false, "{list}");
    assert_eq!(
        list["data"][0]["content"][0]["type"], "input_text",
        "{list}"
    );
    let (_, body) = s.get(&format!("/v1/responses/{id}/input_items?order=asc&limit=2"));
    let page: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(page["data"].as_array().map(Vec::len), Some(2), "{page}");
    assert_eq!(page["data"][1]["id"], "rs_1", "{page}");
    assert_eq!(page["has_more"], true, "{page}");
    let (_, body) = s.get(&format!(
        "/v1/responses/{id}/input_items?order=asc&after=rs_1"
    ));
    let rest: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(rest["first_id"], "msg_a", "{rest}");
    let (st, _) = s.get("/v1/responses/resp_nope/input_items");
    assert_eq!(st, 404);
    // Encrypted reasoning cannot be read: a 400, not a silent drop.
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": [{"type": "reasoning", "summary": [],
            "encrypted_content": "gAAA"}, {"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "input[0].encrypted_content", "{v}");
}

#[test]
fn logprobs_streamed_and_a_cut_stream_completes() {
    let s = Server::start(&[]);
    let body = json!({"model": "smol", "input": "Say hi.", "max_output_tokens": 4,
        "temperature": 0, "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let (st, v) = s.post("/v1/responses", &body);
    assert_eq!(st, 200, "{v}");
    let lps = v["output"][0]["content"][0]["logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        Some(lps.len() as u64),
        v["usage"]["output_tokens"].as_u64(),
        "{v}"
    );
    assert!(
        lps.iter()
            .all(|l| l["logprob"].is_number()
                && l["top_logprobs"].as_array().map(Vec::len) == Some(2)),
        "{v}"
    );
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (st, text) = s.post_text("/v1/responses", &b);
    assert_eq!(st, 200, "{text}");
    let evs = events(&text);
    let streamed: Vec<Value> = evs
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(streamed, lps, "{text}");
    // Cut by max_output_tokens (4 here): the stream ends with
    // response.completed, whose response is incomplete.
    let last = evs.last().cloned().unwrap_or_default();
    assert_eq!(last["type"], "response.completed", "{text}");
    assert_eq!(last["response"]["status"], "incomplete", "{text}");
    assert_eq!(
        last["response"]["incomplete_details"]["reason"], "max_output_tokens",
        "{text}"
    );
    // Not asked: no logprobs.
    let (_, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "Say hi.", "max_output_tokens": 2}),
    );
    assert_eq!(v["output"][0]["content"][0]["logprobs"], json!([]), "{v}");
}

#[test]
fn background_responses_complete_in_the_store_and_cancel() {
    let s = Server::start(&[]);
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "What is 2+2?", "max_output_tokens": 5,
                "background": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"], "queued", "{v}");
    assert_eq!(v["background"], true, "{v}");
    let id = v["id"].as_str().expect("id").to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = loop {
        let (st, body) = s.get(&format!("/v1/responses/{id}"));
        assert_eq!(st, 200, "{body}");
        let r: Value = serde_json::from_str(&body).expect("json");
        if r["status"] != "queued" && r["status"] != "in_progress" {
            break r;
        }
        assert!(Instant::now() < deadline, "still {r}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 5, "{done}");
    // Cancelling a finished one returns it as it is.
    let (st, c) = s.post(&format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["status"], "incomplete", "{c}");

    // A long one, cancelled: it stays cancelled and its engine request
    // ends (nothing keeps running).
    let (_, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "Count from one to ten thousand in words.",
                "max_output_tokens": 1900, "background": true}),
    );
    let id = v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string();
    let (st, c) = s.post(&format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["status"], "cancelled", "{c}");
    let deadline = Instant::now() + Duration::from_secs(3);
    while s.metric("vllm:num_requests_running") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the cancelled request still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, body) = s.get(&format!("/v1/responses/{id}"));
    let r: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(r["status"], "cancelled", "{r}");

    // What background needs, and what cannot be cancelled.
    let (_, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "Hi", "max_output_tokens": 2}),
    );
    let (st, c) = s.post(
        &format!("/v1/responses/{}/cancel", v["id"].as_str().unwrap_or("")),
        &json!({}),
    );
    assert_eq!(st, 400, "{c}");
    for bad in [
        json!({"model": "smol", "input": "Hi", "background": true, "store": false}),
        json!({"model": "smol", "input": "Hi", "background": true, "stream": true}),
    ] {
        let (st, v) = s.post("/v1/responses", &bad);
        assert_eq!(st, 400, "{bad}: {v}");
        assert_eq!(v["error"]["param"], "background", "{v}");
    }
    let (st, _) = s.post("/v1/responses/resp_nope/cancel", &json!({}));
    assert_eq!(st, 404);
}

#[test]
fn namespace_tools_and_a_named_choice_beside_text_format() {
    let s = Server::start(&[]);
    let params = json!({"type": "object", "additionalProperties": false,
        "properties": {"title": {"type": "string", "maxLength": 16},
                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
        "required": ["title", "day"]});
    let tools = json!([{"type": "namespace", "name": "calendar", "description": "Your calendar.",
        "tools": [{"type": "function", "name": "add_event", "description": "Adds an event.",
                   "parameters": params}]}]);
    let ask = "Put lunch with Ann on the 3rd in my calendar.";
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": ask, "max_output_tokens": 60, "temperature": 0,
                "tools": tools,
                "tool_choice": {"type": "function", "name": "add_event", "namespace": "calendar"}}),
    );
    assert_eq!(st, 200, "{v}");
    let call = v["output"]
        .as_array()
        .and_then(|o| o.iter().find(|i| i["type"] == "function_call"))
        .cloned()
        .unwrap_or_else(|| panic!("no call: {v}"));
    assert_eq!(call["name"], "add_event", "{v}");
    assert_eq!(call["namespace"], "calendar", "{v}");
    let args: Value =
        serde_json::from_str(call["arguments"].as_str().unwrap_or("")).expect("JSON arguments");
    assert!(
        args["title"].is_string() && args["day"].is_number(),
        "{args}"
    );
    // The call and its output continue the conversation.
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "max_output_tokens": 5, "tools": tools, "input": [
            {"role": "user", "content": ask}, call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "added"}]}),
    );
    assert_eq!(st, 200, "{v}");

    // instructor's RESPONSES_TOOLS: a named choice and a text.format of the
    // same schema together.
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": ask, "max_output_tokens": 60, "temperature": 0,
                "tools": [{"type": "function", "name": "Event", "parameters": params, "strict": true}],
                "tool_choice": {"type": "function", "name": "Event"},
                "text": {"format": {"type": "json_schema", "name": "Event", "schema": params,
                                    "strict": true}}}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(
        v["output"].as_array().is_some_and(|o| o
            .iter()
            .any(|i| i["type"] == "function_call" && i["name"] == "Event")),
        "{v}"
    );
}
