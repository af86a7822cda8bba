//! The official `anthropic` package from PyPI, unmodified, against the real
//! server's Messages API: `messages.create` (plain, and with tools: a
//! `tool_use` block parsed, a `tool_result` continued), `messages.stream`
//! and `messages.count_tokens`. scripts/test.sh installs it.

use pagoda_e2e::Server;

#[test]
fn the_official_anthropic_client_works_unmodified() {
    let s = Server::start(&[]);
    let script = format!("{}/python/anthropic_sdk.py", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(&s.base)
        .arg("smol")
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "anthropic_sdk.py failed:\n{stdout}\n{stderr}\nserver log:\n{}",
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
