//! gpt-oss's harmony format end to end (issue 44): `--tool-call-parser
//! openai` (which implies `--reasoning-parser openai_gptoss`) through the
//! official `openai` Python client: the `analysis` channel as
//! `reasoning_content`, the `final` channel as content, and a call
//! addressed `to=functions.get_weather` as a tool call, streamed and not
//! (tests/python/harmony_client.py). The demo model writes no harmony, and
//! its tokenizer has no harmony tokens, so the markers are text: a regex
//! makes it write a chosen harmony output. `reasoning_effort` (and the
//! Responses API's `reasoning.effort`), the tools and an earlier turn's
//! reasoning (as `thinking`) reach a chat template that reads them as
//! gpt-oss's does; bad flags are refused.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server, TempDir};
use serde_json::{json, Value};

/// A chat template in gpt-oss's shape: `reasoning_effort` and the tools in
/// the system message, each turn a harmony message, the reply opened with
/// `<|start|>assistant`.
const TEMPLATE: &str = "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\
{%- if tools %}\n# Tools\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}{% endif %}<|end|>\
{%- for m in messages %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}\
<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}\
{%- if add_generation_prompt %}<|start|>assistant{% endif %}";

fn server(dir: &TempDir) -> Server {
    let path = dir.0.join("harmony.jinja");
    std::fs::write(&path, TEMPLATE).expect("template");
    let t = path.to_string_lossy().to_string();
    Server::start(&[
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
        "--chat-template",
        &t,
    ])
}

#[test]
fn harmony_reasoning_and_tool_calls_with_the_openai_client() {
    let dir = TempDir::new("harmony");
    let s = server(&dir);
    let path = format!("{}/python/harmony_client.py", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .args([&path, &s.base, "smol"])
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.contains(" passed, 0 failed")),
        "harmony_client.py failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_text()
    );

    // reasoning_effort reaches the template; one it does not know is refused.
    let rendered_messages = |effort: Value, messages: Value| {
        let (st, v) = s.post(
            "/v1/chat/completions/render",
            &json!({"model": "smol", "reasoning_effort": effort, "messages": messages}),
        );
        assert_eq!(st, 200, "{v}");
        let ids = v["token_ids"].clone();
        let ids = if ids.is_null() {
            v["prompt_token_ids"].clone()
        } else {
            ids
        };
        let (st, t) = s.post("/detokenize", &json!({"model": "smol", "tokens": ids}));
        assert_eq!(st, 200, "{t} from {v}");
        t["prompt"].as_str().expect("prompt").to_string()
    };
    let rendered =
        |effort: Value| rendered_messages(effort, json!([{"role": "user", "content": "Hi"}]));
    // An earlier turn's reasoning reaches the template as `thinking`, the
    // name gpt-oss's template reads, under either request name.
    for key in ["reasoning_content", "reasoning"] {
        let mut turn = json!({"role": "assistant", "content": "Sunny."});
        turn[key] = json!("Looked it up.");
        let prompt = rendered_messages(
            Value::Null,
            json!([{"role": "user", "content": "Weather?"}, turn,
                {"role": "user", "content": "Thanks"}]),
        );
        assert!(
            prompt.contains("<|channel|>analysis<|message|>Looked it up.<|end|>"),
            "{prompt}"
        );
    }
    assert!(rendered(json!("high")).contains("Reasoning: high"));
    // Tools reach it in OpenAI's shape, which gpt-oss's template reads.
    let (st, v) = s.post(
        "/v1/chat/completions/render",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {}}}}]}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, t) = s.post(
        "/detokenize",
        &json!({"model": "smol", "tokens": v["token_ids"]}),
    );
    assert_eq!(st, 200, "{t}");
    assert!(
        t["prompt"]
            .as_str()
            .is_some_and(|p| p.contains("# Tools\nget_weather")),
        "{t}"
    );
    // The Responses API's `reasoning.effort` reaches it as `reasoning_effort`.
    let (st, v) = s.post(
        "/v1/responses/render",
        &json!({"model": "smol", "input": "Hi", "reasoning": {"effort": "high"}}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, t) = s.post(
        "/detokenize",
        &json!({"model": "smol", "tokens": v["token_ids"]}),
    );
    assert_eq!(st, 200, "{t}");
    assert!(
        t["prompt"]
            .as_str()
            .is_some_and(|p| p.contains("Reasoning: high")),
        "{t}"
    );
    assert!(rendered(Value::Null).contains("Reasoning: medium"));
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "reasoning_effort": "extreme", "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "reasoning_effort", "{v}");

    // The Responses API shares the pipeline: the analysis channel is a
    // reasoning item, and `reasoning.effort` reaches the template too.
    let (st, v) = s.post(
        "/v1/responses",
        &json!({"model": "smol", "input": "Weather?", "max_output_tokens": 8,
            "temperature": 0, "reasoning": {"effort": "low"}}),
    );
    assert_eq!(st, 200, "{v}");
    let text = v.to_string();
    assert!(!text.contains("<|"), "no harmony marker leaks: {v}");
}

#[test]
fn harmony_flags_are_checked() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(pagoda_bin())
            .arg("serve")
            .arg(demo_gguf())
            .args(args)
            .output()
            .expect("running pagoda serve");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    // Harmony's tool calls cannot be read beside a `<think>` parser.
    let e = run(&[
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
        "--reasoning-parser",
        "qwen3",
    ]);
    assert!(e.contains("openai_gptoss"), "{e}");
    // Unknown names list the known ones.
    let e = run(&["--reasoning-parser", "gptoss"]);
    for name in ["deepseek_r1", "qwen3", "openai_gptoss"] {
        assert!(e.contains(name), "{e}");
    }
    let e = run(&["--enable-auto-tool-choice", "--tool-call-parser", "harmony"]);
    for name in ["hermes", "pythonic", "openai"] {
        assert!(e.contains(name), "{e}");
    }
}
