//! A forced tool call (`tool_choice: "required"` or a named function) that
//! `max_tokens` cuts is no call when streamed either: no `tool_calls`
//! delta (not `arguments: "{"`), and no fragment of it as content. A call
//! that completes streams as one valid call.

use pagoda_e2e::Server;
use serde_json::{json, Value};

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "create_user",
        "parameters": {"type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "city": {"type": "string", "maxLength": 12}},
            "required": ["name", "city"]}}}])
}

/// The chunks of a streamed chat.
fn stream(s: &Server, body: &Value) -> Vec<Value> {
    let (st, text) = s.post_text("/v1/chat/completions", body);
    assert_eq!(st, 200, "{text}");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect()
}

#[test]
fn a_cut_forced_call_streams_no_call_and_a_whole_one_streams_valid() {
    let s = Server::start(&[]);
    let named = json!({"type": "function", "function": {"name": "create_user"}});
    let ask = json!([{"role": "user", "content": "Register Ann, who lives in Oslo."}]);
    for choice in [json!("required"), named.clone()] {
        let chunks = stream(
            &s,
            &json!({"model": "smol", "temperature": 0, "max_tokens": 3, "stream": true,
                    "tools": tools(), "tool_choice": choice, "messages": ask}),
        );
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert!(
            deltas.iter().all(|d| d.get("tool_calls").is_none()),
            "{choice}: a cut call was streamed: {chunks:?}"
        );
        assert!(
            deltas
                .iter()
                .all(|d| d["content"].as_str().unwrap_or("").is_empty()),
            "{choice}: the fragment of a cut call came back as content: {chunks:?}"
        );
        let finish: Vec<&Value> = chunks
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("length")], "{choice}: {chunks:?}");
    }
    // Given room, the named call streams whole and valid, as the
    // unstreamed answer has it.
    let body = json!({"model": "smol", "temperature": 0, "max_tokens": 80,
        "tools": tools(), "tool_choice": named, "messages": ask});
    let (st, whole) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{whole}");
    let want = &whole["choices"][0]["message"]["tool_calls"][0]["function"];
    let mut b = body.clone();
    b["stream"] = json!(true);
    let chunks = stream(&s, &b);
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0]["type"], "function", "{chunks:?}");
    assert!(
        calls[0]["id"]
            .as_str()
            .is_some_and(|i| i.starts_with("chatcmpl-tool-")),
        "{chunks:?}"
    );
    assert_eq!(&calls[0]["function"], want, "{chunks:?} vs {whole}");
    let args: Value =
        serde_json::from_str(want["arguments"].as_str().unwrap_or("")).expect("JSON arguments");
    assert!(
        args["name"].is_string() && args["city"].is_string(),
        "{args}"
    );
    let finish = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .find(|f| !f.is_null());
    assert_eq!(finish, Some(&json!("tool_calls")), "{chunks:?}");
}
