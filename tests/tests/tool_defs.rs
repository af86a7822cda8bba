//! Tool schemas as Pydantic, the OpenAI Agents SDK, LangChain and
//! instructor write them, with nested models under `$defs` and `$ref`s to
//! them, enforced by `tool_choice: "required"` on chat and on
//! `/v1/responses` (the schema over all tools must keep each tool's
//! references pointing at its own definitions); and a forced call that
//! `max_tokens` cuts is no call at all.

use pagoda_e2e::Server;
use serde_json::{json, Value};

/// `create_user`: a Pydantic `User` with a nested `Address` model.
fn create_user_parameters() -> Value {
    json!({
        "$defs": {
            "Address": {
                "properties": {
                    "street": {"maxLength": 16, "title": "Street", "type": "string"},
                    "city": {"maxLength": 16, "title": "City", "type": "string"}
                },
                "required": ["street", "city"],
                "title": "Address",
                "type": "object"
            },
            "User": {
                "properties": {
                    "name": {"maxLength": 16, "title": "Name", "type": "string"},
                    "address": {"$ref": "#/$defs/Address"}
                },
                "required": ["name", "address"],
                "title": "User",
                "type": "object"
            }
        },
        "properties": {"user": {"$ref": "#/$defs/User"}},
        "required": ["user"],
        "title": "CreateUser",
        "type": "object"
    })
}

/// `open_socket`: its own `Address` definition, of another shape.
fn open_socket_parameters() -> Value {
    json!({
        "$defs": {
            "Address": {
                "properties": {
                    "host": {"maxLength": 15, "title": "Host", "type": "string"},
                    "port": {"maximum": 65535, "minimum": 1, "title": "Port", "type": "integer"}
                },
                "required": ["host", "port"],
                "title": "Address",
                "type": "object"
            }
        },
        "properties": {"address": {"$ref": "#/$defs/Address"}},
        "required": ["address"],
        "title": "OpenSocket",
        "type": "object"
    })
}

fn parameters_of(name: &str) -> Value {
    match name {
        "create_user" => create_user_parameters(),
        "open_socket" => open_socket_parameters(),
        other => panic!("a call to a tool nobody offered: {other}"),
    }
}

fn chat_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "create_user",
            "description": "Register a user", "parameters": create_user_parameters()}},
        {"type": "function", "function": {"name": "open_socket",
            "description": "Open a connection", "parameters": open_socket_parameters()}}
    ])
}

fn responses_tools() -> Value {
    json!([
        {"type": "function", "name": "create_user", "description": "Register a user",
            "parameters": create_user_parameters()},
        {"type": "function", "name": "open_socket", "description": "Open a connection",
            "parameters": open_socket_parameters()}
    ])
}

/// Checks `v` against `schema` (the subset these tools use: object,
/// string, integer, properties, required, maxLength, minimum, maximum and
/// `$ref`s into `root`, the tool's own parameters). Objects are closed, as
/// the server enforces tool arguments.
fn check(v: &Value, schema: &Value, root: &Value, at: &str) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let pointer = r.strip_prefix('#').expect("a local $ref");
        let target = root
            .pointer(pointer)
            .unwrap_or_else(|| panic!("{r} resolves in the tool's schema"));
        return check(v, target, root, at);
    }
    match schema["type"].as_str() {
        Some("object") => {
            let o = v
                .as_object()
                .unwrap_or_else(|| panic!("{at}: {v} is not an object"));
            let props = schema["properties"].as_object().expect("properties");
            for key in o.keys() {
                assert!(props.contains_key(key), "{at}: unexpected key {key} in {v}");
            }
            for req in schema["required"].as_array().into_iter().flatten() {
                let req = req.as_str().expect("a required name");
                assert!(o.contains_key(req), "{at}: {req} missing in {v}");
            }
            for (key, value) in o {
                check(value, &props[key], root, &format!("{at}.{key}"));
            }
        }
        Some("string") => {
            let s = v
                .as_str()
                .unwrap_or_else(|| panic!("{at}: {v} is not a string"));
            if let Some(max) = schema["maxLength"].as_u64() {
                assert!(s.chars().count() as u64 <= max, "{at}: {s:?} is too long");
            }
        }
        Some("integer") => {
            let n = v
                .as_i64()
                .unwrap_or_else(|| panic!("{at}: {v} is not an integer"));
            if let Some(min) = schema["minimum"].as_i64() {
                assert!(n >= min, "{at}: {n} < {min}");
            }
            if let Some(max) = schema["maximum"].as_i64() {
                assert!(n <= max, "{at}: {n} > {max}");
            }
        }
        other => panic!("{at}: unexpected schema type {other:?}"),
    }
}

/// A call's arguments parse as JSON and validate against its tool's schema.
fn check_call(name: &str, arguments: &str) {
    let args: Value = serde_json::from_str(arguments)
        .unwrap_or_else(|e| panic!("{name}'s arguments {arguments:?} are not JSON: {e}"));
    let params = parameters_of(name);
    check(&args, &params, &params, name);
}

#[test]
fn required_tools_with_defs_on_chat_and_responses() {
    let s = Server::start(&[]);

    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({
            "model": "smol", "temperature": 0, "max_tokens": 200,
            "tools": chat_tools(), "tool_choice": "required", "parallel_tool_calls": false,
            "messages": [{"role": "user", "content": "Register Ann, who lives at 1 Main St, Oslo."}],
        }),
    );
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls in {v}"));
    assert_eq!(calls.len(), 1, "{v}");
    for c in calls {
        let name = c["function"]["name"].as_str().expect("a name");
        let arguments = c["function"]["arguments"].as_str().expect("arguments");
        check_call(name, arguments);
    }

    let (status, v) = s.post(
        "/v1/responses",
        &json!({
            "model": "smol", "temperature": 0, "max_output_tokens": 200,
            "tools": responses_tools(), "tool_choice": "required", "parallel_tool_calls": false,
            "input": "Open a connection to 10.0.0.1 on port 8080.",
        }),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "completed", "{v}");
    let calls: Vec<&Value> = v["output"]
        .as_array()
        .unwrap_or_else(|| panic!("no output in {v}"))
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{v}");
    for c in calls {
        let name = c["name"].as_str().expect("a name");
        let arguments = c["arguments"].as_str().expect("arguments");
        check_call(name, arguments);
    }

    // A named choice of a tool with $defs keeps working.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({
            "model": "smol", "temperature": 0, "max_tokens": 200, "tools": chat_tools(),
            "tool_choice": {"type": "function", "function": {"name": "open_socket"}},
            "messages": [{"role": "user", "content": "Connect to example.org:443."}],
        }),
    );
    assert_eq!(status, 200, "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "open_socket", "{v}");
    check_call(
        "open_socket",
        call["arguments"].as_str().expect("arguments"),
    );
}

#[test]
fn forced_calls_cut_by_max_tokens_are_no_calls() {
    let s = Server::start(&[]);
    let named = json!({"type": "function", "function": {"name": "create_user"}});
    for choice in [json!("required"), named] {
        let (status, v) = s.post(
            "/v1/chat/completions",
            &json!({
                "model": "smol", "temperature": 0, "max_tokens": 3,
                "tools": chat_tools(), "tool_choice": choice,
                "messages": [{"role": "user", "content": "Register Ann, who lives at 1 Main St, Oslo."}],
            }),
        );
        assert_eq!(status, 200, "{choice}: {v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "length", "{choice}: {v}");
        let calls = &c["message"]["tool_calls"];
        assert!(
            calls.is_null() || calls.as_array().is_some_and(|a| a.is_empty()),
            "{choice}: a cut call came back as a call: {v}"
        );
        assert!(
            c["message"]["content"].is_null(),
            "{choice}: the fragment of a cut call came back as content: {v}"
        );
    }

    let (status, v) = s.post(
        "/v1/responses",
        &json!({
            "model": "smol", "temperature": 0, "max_output_tokens": 3,
            "tools": responses_tools(), "tool_choice": "required",
            "input": "Register Ann, who lives at 1 Main St, Oslo.",
        }),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "incomplete", "{v}");
    let output = v["output"].as_array().expect("output");
    assert!(
        output.iter().all(|i| i["type"] != "function_call"),
        "a cut call came back as a call: {v}"
    );
    // Its fragment of JSON is no answer either.
    for item in output.iter().filter(|i| i["type"] == "message") {
        for part in item["content"].as_array().into_iter().flatten() {
            assert_eq!(part["text"].as_str().unwrap_or(""), "", "{v}");
        }
    }
}
