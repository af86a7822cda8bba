//! Real clients from PyPI against the real server: the official `openai`
//! package (chat, completions, streaming, model listing) and
//! `prometheus_client`'s parser on `/metrics`. scripts/test.sh installs them.

use pagoda_e2e::Server;

#[test]
fn the_official_openai_client_works_unmodified() {
    let s = Server::start(&[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/openai_client.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(&s.base)
        .arg("smol")
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        s.log_text()
    );
    assert!(
        stdout
            .lines()
            .last()
            .is_some_and(|l| l.ends_with("passed, 0 failed")),
        "{stdout}"
    );
}
