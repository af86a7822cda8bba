//! Crash safety: `kill -9` during an upload leaves the previous version
//! intact and active after a restart on the same state dir; rollback and
//! precompiled artifacts survive restarts too.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;
use std::io::Write;

fn tag_of(p: &PServer) -> String {
    let (st, v) = p.post_as(
        "key-k-123456",
        "/v1/completions",
        &json!({"model": "smol", "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    let t = v["choices"][0]["text"].as_str().unwrap().to_string();
    if t.ends_with(" [v1]") {
        "v1".into()
    } else if t.ends_with(" [v2]") {
        "v2".into()
    } else {
        panic!("no tag in {t:?}")
    }
}

#[test]
fn kill_during_upload_keeps_previous_version() {
    let dir = TempDir::new("crash");
    let p = start(&dir, &[]);
    p.put_tenant(
        "k",
        json!({"api_keys": ["key-k-123456"], "plugins": ["tag"]}),
    );
    p.upload_ok("k", "tag", "tag-v1", None);
    p.upload_ok("k", "tag", "tag-v2", None);
    let (st, _) = p.admin("POST", "/admin/v1/tenants/k/plugins/tag/rollback", None);
    assert_eq!(st, 200);
    assert_eq!(tag_of(&p), "v1");

    // Start an upload of v2 and kill the server mid-body.
    let wasm = component("tag-v2");
    let addr = p.s.base.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        sock,
        "PUT /admin/v1/tenants/k/plugins/tag HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ADMIN}\r\nContent-Length: {}\r\n\r\n",
        wasm.len()
    )
    .unwrap();
    sock.write_all(&wasm[..wasm.len() / 2]).unwrap();
    sock.flush().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    p.s.signal(9);
    drop(sock);
    let state = p.state.clone();
    drop(p);

    // Restart on the same state dir: v1 (the active version) is intact.
    let s = pagoda_e2e::Server::start(&[
        "--state-dir",
        &state.to_string_lossy(),
        "--admin-token",
        ADMIN,
    ]);
    let p = PServer { s, state };
    assert_eq!(tag_of(&p), "v1");
    let (_, v) = p.admin("GET", "/admin/v1/tenants/k/plugins", None);
    assert_eq!(v["data"][0]["active_version"], 1, "{v}");
    assert_eq!(v["data"][0]["versions"].as_array().unwrap().len(), 2, "{v}");

    // Kill right after a completed upload: the new version is durable.
    p.upload_ok("k", "tag", "tag-v2", None);
    p.s.signal(9);
    let state = p.state.clone();
    drop(p);
    let s = pagoda_e2e::Server::start(&[
        "--state-dir",
        &state.to_string_lossy(),
        "--admin-token",
        ADMIN,
    ]);
    let p = PServer { s, state };
    assert_eq!(tag_of(&p), "v2");
    // Rollback history survived the restart too.
    let (st, v) = p.admin("POST", "/admin/v1/tenants/k/plugins/tag/rollback", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(tag_of(&p), "v1");
    assert!(
        !p.s.log_text().contains("recompiling"),
        "the precompiled artifacts should load:\n{}",
        p.s.log_text()
    );
}
