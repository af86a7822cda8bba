//! What `--state-dir` holds is the server's alone and is checked before it
//! is trusted: files are 0600 and directories 0700, API keys are stored
//! as salted hashes (never the key, never its plain sha256), and a
//! precompiled plugin artifact that is not the one recorded is not run.

mod plugins_common;

use pagoda_e2e::{Server, TempDir};
use plugins_common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const KEY: &str = "key-k-123456";

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o777
}

fn restart(p: PServer) -> PServer {
    let state = p.state.clone();
    drop(p);
    let s = Server::start(&[
        "--state-dir",
        &state.to_string_lossy(),
        "--admin-token",
        ADMIN,
    ]);
    PServer { s, state }
}

/// Every file and directory under `root`.
fn walk(root: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(root).expect("read_dir").flatten() {
        let p = e.path();
        out.push(p.clone());
        if p.is_dir() {
            walk(&p, out);
        }
    }
}

fn completion_text(p: &PServer, key: &str) -> String {
    let (st, v) = p.post_as(
        key,
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

#[test]
fn state_files_are_private_and_api_keys_are_stored_salted() {
    let dir = TempDir::new("state-private");
    let p = start(&dir, &[]);
    p.put_tenant("k", json!({"api_keys": [KEY]}));
    p.upload_ok("k", "tag", "tag-v1", None);

    let mut paths = Vec::new();
    walk(&p.state, &mut paths);
    assert!(paths.len() >= 5, "{paths:?}");
    for path in &paths {
        let want = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode(path), want, "{} is {:o}", path.display(), mode(path));
    }
    let salt = std::fs::read(p.state.join("key-salt")).expect("key-salt");
    assert_eq!(salt.len(), 32);

    let config: Value = serde_json::from_slice(
        &std::fs::read(p.state.join("tenants/k/tenant.json")).expect("tenant.json"),
    )
    .expect("JSON");
    let hash = config["api_key_hashes"][0]
        .as_str()
        .expect("a hash")
        .to_string();
    assert!(hash.starts_with("s1:"), "{hash}");
    let raw = std::fs::read_to_string(p.state.join("tenants/k/tenant.json")).expect("read");
    assert!(!raw.contains(KEY), "the key itself is stored");

    // The same key still works after a restart (the salt persisted); a
    // wrong one does not.
    let p = restart(p);
    assert!(completion_text(&p, KEY).ends_with(" [v1]"));
    let (st, v) = p.post_as(
        "key-wrong-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 1}),
    );
    assert_eq!(st, 401, "{v}");
}

#[test]
fn a_precompiled_artifact_that_is_not_the_recorded_one_is_rebuilt_not_run() {
    let dir = TempDir::new("state-artifact");
    let p = start(&dir, &[]);
    p.put_tenant("k", json!({"api_keys": [KEY], "plugins": ["tag"]}));
    p.put_tenant(
        "other",
        json!({"api_keys": ["key-other-123456"], "plugins": ["tag"]}),
    );
    p.upload_ok("k", "tag", "tag-v1", None);
    p.upload_ok("other", "tag", "tag-v2", None);
    assert!(completion_text(&p, KEY).ends_with(" [v1]"));

    // Swap in native code the admin API never vouched for: the other
    // tenant's artifact, which wasmtime itself would happily load.
    let state = p.state.clone();
    let mine = state.join("tenants/k/plugins/tag/1.cwasm");
    let theirs = state.join("tenants/other/plugins/tag/1.cwasm");
    p.s.signal(9);
    drop(p);
    std::fs::copy(&theirs, &mine).expect("swap the artifact");
    let s = Server::start(&[
        "--state-dir",
        &state.to_string_lossy(),
        "--admin-token",
        ADMIN,
    ]);
    let p = PServer { s, state };
    // k still runs its own plugin, rebuilt from the uploaded component.
    assert!(
        completion_text(&p, KEY).ends_with(" [v1]"),
        "the swapped artifact ran"
    );
    let log = p.s.log_text();
    assert!(
        log.contains("recompiling k/tag v1") && log.contains("sha256"),
        "{log}"
    );
    // The rewritten artifact is recorded and loads without a rebuild.
    let p = restart(p);
    assert!(completion_text(&p, KEY).ends_with(" [v1]"));
    assert!(
        !p.s.log_text().contains("recompiling"),
        "{}",
        p.s.log_text()
    );
}
