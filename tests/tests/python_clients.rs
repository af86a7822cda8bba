//! Real clients from PyPI against the real server: the official `openai`
//! package (chat, completions, streaming, model listing) and
//! `prometheus_client`'s parser on `/metrics`; `jsonschema` and LangChain
//! for structured output and tools; the official `anthropic` package on the
//! Messages API; the `openai` package naming a LoRA adapter as its model.
//! scripts/test.sh installs them.

use pagoda_e2e::Server;

/// Runs a client script of tests/python against a server started with
/// `flags`; the script's last line must say that nothing failed.
fn run_client_script(script: &str, flags: &[&str]) {
    let s = Server::start(flags);
    let path = format!("{}/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(&path)
        .arg(&s.base)
        .arg("smol")
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        s.log_text()
    );
    assert!(
        stdout
            .lines()
            .last()
            .is_some_and(|l| l.contains(" passed, 0 failed")),
        "{stdout}"
    );
}

#[test]
fn the_official_openai_client_works_unmodified() {
    run_client_script("openai_client.py", &[]);
}

/// Structured output and tools through the `openai` client, `jsonschema`
/// and LangChain: JSON schemas, json_object, regex, choice, Lark, named /
/// required / auto tool choice, streamed and not.
#[test]
fn structured_output_and_tools_work_with_real_clients() {
    run_client_script(
        "structured_outputs.py",
        &["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    );
}

/// The official `anthropic` package, unmodified, on the Messages API:
/// `messages.create` (plain, and with tools: a `tool_use` block parsed, a
/// `tool_result` continued), `messages.stream` and `messages.count_tokens`.
#[test]
fn the_official_anthropic_client_works_unmodified() {
    run_client_script("anthropic_sdk.py", &[]);
}

/// The `openai` package naming a LoRA adapter as its model, on
/// transformers' tiny Llama with a PEFT adapter (tests/fixtures).
#[test]
fn the_official_openai_client_selects_lora_adapters_by_name() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures");
    let model = std::path::Path::new(fixtures).join("hf-families/llama");
    let qv = format!("qv={fixtures}/lora/llama/qv-r8");
    let s = Server::start_with_model(
        &model,
        &[
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--enable-lora",
            "--lora-modules",
            &qv,
        ],
    );
    let path = format!("{}/python/openai_lora.py", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .args([&path, &s.base, "smol", "qv"])
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout
                .lines()
                .last()
                .is_some_and(|l| l.contains(" passed, 0 failed")),
        "openai_lora.py failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_text()
    );
}
