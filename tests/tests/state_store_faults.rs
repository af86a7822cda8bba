//! The shared state store fails closed: three `pagoda serve` replicas
//! sharing tenants through a moto S3 server, and again through a
//! `file://` store, while the test breaks the store behind their backs.
//!
//! In every phase no request is served without a valid key, the tenants
//! the fault does not touch keep syncing (a key rotation and a deletion
//! through one replica reach every replica), and each replica's log says
//! what happened at WARN or ERROR.
//!
//! 1. One tenant's manifest is overwritten with garbage: that tenant is
//!    held at its last good state, logged once, counted; the others sync;
//!    a PUT through the admin API repairs it, a DELETE removes it.
//! 2. A manifest names a component whose blob does not hash to its name:
//!    the tenant keeps its last good plugin; uploading the component again
//!    replaces the bad blob.
//! 3. The key salt is deleted: the replicas write back the salt they hold.
//!    It is replaced by another: every replica refuses to serve (503) and
//!    says why, until it is restored.
//! 4. The bucket is emptied: nobody is dropped (a suspected store fault,
//!    logged at ERROR and counted), keyless and bogus keys get 401, a
//!    re-created tenant syncs, and an admin's confirmation drops the rest.
//! 5. (S3) A replica started while the store is unreachable is not ready
//!    and serves nobody until it has read the store.

mod plugins_common;
mod store_common;

use pagoda_e2e::{agent, demo_gguf, Server, TempDir};
use plugins_common::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use store_common::*;

const K1: &str = "key-tenant-one-1";
const K2: &str = "key-tenant-two-1";
const K2B: &str = "key-tenant-two-rotated";
const K2C: &str = "key-tenant-two-rotated-again";
const K3: &str = "key-tenant-three";
const K4: &str = "key-tenant-four";
const K5: &str = "key-tenant-five";

/// A poll every second: every wait below is a few polls.
const POLL: &str = "1";
const WAIT: Duration = Duration::from_secs(20);

/// The store's objects, reached behind the replicas' backs.
trait Objects {
    fn get(&self, key: &str) -> Option<Vec<u8>>;
    fn put(&self, key: &str, bytes: &[u8]);
    fn delete(&self, key: &str);
    fn keys(&self) -> Vec<String>;
}

/// Objects under `replicas/` of the moto bucket. moto checks no
/// signature, but treats a request without one as anonymous (which object
/// ACLs then refuse), so each carries a well-formed, unchecked one.
struct S3Objects {
    port: u16,
}

const SIGNED: &str = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";

impl S3Objects {
    fn url(&self, key: &str) -> String {
        format!("http://127.0.0.1:{}/{BUCKET}/replicas/{key}", self.port)
    }
}

impl Objects for S3Objects {
    fn get(&self, key: &str) -> Option<Vec<u8>> {
        let mut r = agent()
            .get(&self.url(key))
            .header("Authorization", SIGNED)
            .call()
            .expect("GET object");
        (r.status() == 200).then(|| r.body_mut().read_to_vec().expect("object body"))
    }
    fn put(&self, key: &str, bytes: &[u8]) {
        let r = agent()
            .put(&self.url(key))
            .header("Authorization", SIGNED)
            .send(bytes)
            .expect("PUT object");
        assert_eq!(r.status(), 200, "PUT {key}");
    }
    fn delete(&self, key: &str) {
        let r = agent()
            .delete(&self.url(key))
            .header("Authorization", SIGNED)
            .call()
            .expect("DELETE object");
        assert!(r.status().is_success(), "DELETE {key}: {}", r.status());
    }
    fn keys(&self) -> Vec<String> {
        let url = format!(
            "http://127.0.0.1:{}/{BUCKET}?list-type=2&prefix=replicas/",
            self.port
        );
        let mut r = agent()
            .get(&url)
            .header("Authorization", SIGNED)
            .call()
            .expect("list");
        let xml = r.body_mut().read_to_string().expect("listing");
        xml.split("<Key>")
            .skip(1)
            .filter_map(|p| p.split_once("</Key>"))
            .filter_map(|(k, _)| k.strip_prefix("replicas/").map(str::to_string))
            .collect()
    }
}

/// Objects of a `file://` store: files under its root.
struct FileObjects {
    root: PathBuf,
}

impl Objects for FileObjects {
    fn get(&self, key: &str) -> Option<Vec<u8>> {
        std::fs::read(self.root.join(key)).ok()
    }
    fn put(&self, key: &str, bytes: &[u8]) {
        let p = self.root.join(key);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, bytes).expect("write object");
    }
    fn delete(&self, key: &str) {
        std::fs::remove_file(self.root.join(key)).expect("delete object");
    }
    fn keys(&self) -> Vec<String> {
        fn walk(dir: &std::path::Path, root: &std::path::Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, root, out);
                } else if !e.file_name().to_string_lossy().starts_with('.') {
                    let rel = p.strip_prefix(root).expect("under the root");
                    out.push(rel.to_string_lossy().to_string());
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &self.root, &mut out);
        out
    }
}

/// How replicas of one test reach their store.
struct Cluster {
    dir: TempDir,
    store: String,
    env: Vec<(String, String)>,
}

impl Cluster {
    fn args(&self, name: &str) -> (Vec<String>, Vec<(&str, &str)>) {
        let state = self.dir.0.join(name);
        let args = [
            "--state-dir",
            state.to_str().expect("utf-8 path"),
            "--state-store",
            &self.store,
            "--state-poll-seconds",
            POLL,
            "--state-store-max-drop-fraction",
            "0.2",
            "--admin-token",
            ADMIN,
            "--kv-cache-memory",
            "64MiB",
        ]
        .map(str::to_string)
        .to_vec();
        let env = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([("RUST_LOG", "info")])
            .collect();
        (args, env)
    }

    fn replica(&self, name: &str) -> PServer {
        let (args, env) = self.args(name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        PServer {
            s: Server::start_with_env(&demo_gguf(), &args, &env),
            state: self.dir.0.join(name),
        }
    }

    /// A replica that is not waited on to become ready.
    fn replica_live(&self, name: &str) -> PServer {
        let (args, env) = self.args(name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        PServer {
            s: Server::start_live(&demo_gguf(), &args, &env),
            state: self.dir.0.join(name),
        }
    }
}

/// A one-token completion through `p` with `key` (none: no header);
/// (status, text or error message).
fn complete(p: &PServer, key: Option<&str>) -> (u16, String) {
    let body = json!({"model": "smol", "prompt": "Count:", "max_tokens": 4, "temperature": 0});
    let mut req = agent().post(&p.s.url("/v1/completions"));
    if let Some(k) = key {
        req = req.header("Authorization", &format!("Bearer {k}"));
    }
    let mut r = req.send_json(&body).expect("request");
    let status = r.status().as_u16();
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap_or_default())
        .unwrap_or(Value::Null);
    let text = v["choices"][0]["text"]
        .as_str()
        .or(v["error"]["message"].as_str())
        .unwrap_or("")
        .to_string();
    (status, text)
}

fn status(p: &PServer, key: Option<&str>) -> u16 {
    complete(p, key).0
}

/// Nobody gets in without a valid key.
fn assert_closed(p: &PServer) {
    for key in [None, Some("bogus-key-never-issued")] {
        let (st, text) = complete(p, key);
        assert_eq!(st, 401, "{key:?} got {st}: {text}");
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut c = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(bytes)
        .expect("to sha256sum");
    let out = c.wait_with_output().expect("sha256sum output");
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

fn log_count(p: &PServer, needle: &str) -> usize {
    p.s.log_text()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

fn manifest(objects: &dyn Objects, id: &str) -> Value {
    let b = objects
        .get(&format!("tenants/{id}/manifest.json"))
        .unwrap_or_else(|| panic!("no manifest for {id}"));
    serde_json::from_slice(&b).expect("manifest JSON")
}

/// The faults, on whichever store `objects` reaches.
fn break_the_store(cluster: &Cluster, objects: &dyn Objects, mut outage: Option<&mut Proxy>) {
    let reps: Vec<PServer> = ["a", "b", "c"].iter().map(|n| cluster.replica(n)).collect();
    let (a, b, c) = (&reps[0], &reps[1], &reps[2]);
    // Set up for tenants, yet with none: still closed.
    for s in &reps {
        assert_closed(s);
    }
    a.put_tenant("t1", json!({"api_keys": [K1], "plugins": ["tag"]}));
    a.upload_ok("t1", "tag", "tag-v1", None);
    a.put_tenant("t2", json!({"api_keys": [K2]}));
    b.put_tenant("t3", json!({"api_keys": [K3]}));
    c.put_tenant("t4", json!({"api_keys": [K4]}));
    a.put_tenant("t5", json!({"api_keys": [K5]}));
    for s in &reps {
        wait_for(WAIT, "every tenant on every replica", || {
            complete(s, Some(K1)).1.ends_with(" [v1]")
                && [K2, K3, K4, K5].iter().all(|k| status(s, Some(k)) == 200)
        });
    }

    // 1. One corrupt manifest.
    objects.put(
        "tenants/t1/manifest.json",
        b"{\"revision\": \"not a manifest",
    );
    let (st, v) = a.admin(
        "PUT",
        "/admin/v1/tenants/t2",
        Some(&json!({"api_keys": [K2B]})),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = b.admin("DELETE", "/admin/v1/tenants/t3", None);
    assert_eq!(st, 200, "{v}");
    for s in &reps {
        wait_for(
            WAIT,
            "a rotation and a deletion beside a corrupt manifest",
            || {
                status(s, Some(K2B)) == 200
                    && status(s, Some(K2)) == 401
                    && status(s, Some(K3)) == 401
            },
        );
        wait_for(WAIT, "the corrupt manifest logged", || {
            log_count(s, "tenant t1: its shared state cannot be applied") == 1
        });
    }
    std::thread::sleep(Duration::from_secs(3));
    for s in &reps {
        // Held at its last good state; logged once, not once a poll.
        assert!(complete(s, Some(K1)).1.ends_with(" [v1]"));
        let log = s.s.log_text();
        assert_eq!(
            log_count(s, "tenant t1: its shared state cannot be applied"),
            1,
            "{log}"
        );
        let line = log
            .lines()
            .find(|l| l.contains("tenant t1: its shared state"))
            .expect("line");
        assert!(
            line.contains("WARN") && line.contains("tenants/t1/manifest.json"),
            "{line}"
        );
        let m = s.s.get("/metrics").1;
        assert!(
            metric_sum(&m, "pagoda_state_store_tenant_errors_total", &[]) >= 1.0,
            "{m}"
        );
        assert_eq!(s.s.metric("pagoda_state_store_up"), 1.0);
        let (_, v) = s.admin("GET", "/admin/v1/tenants/t1", None);
        assert!(
            v["state_error"]
                .as_str()
                .is_some_and(|e| e.contains("manifest.json")),
            "{v}"
        );
        assert_closed(s);
    }
    // A DELETE removes a corrupt manifest (a tombstone in its place).
    objects.put("tenants/t5/manifest.json", b"not JSON at all");
    let (st, v) = c.admin("DELETE", "/admin/v1/tenants/t5", None);
    assert_eq!(st, 200, "{v}");
    for s in &reps {
        wait_for(WAIT, "a corrupt tenant deleted everywhere", || {
            status(s, Some(K5)) == 401
        });
    }
    // Repaired by a PUT through any replica.
    let (st, v) = c.admin(
        "PUT",
        "/admin/v1/tenants/t1",
        Some(&json!({"api_keys": [K1], "plugins": ["tag"]})),
    );
    assert_eq!(st, 200, "{v}");
    for s in &reps {
        wait_for(WAIT, "the repaired tenant", || {
            let (_, v) = s.admin("GET", "/admin/v1/tenants/t1", None);
            v["state_error"].is_null() && complete(s, Some(K1)).1.ends_with(" [v1]")
        });
    }

    // 2. A plugin blob whose content does not match its name.
    let v2 = component("tag-v2");
    let sha_v2 = sha256_hex(&v2);
    objects.put(&format!("blobs/{sha_v2}"), b"not the component");
    let mut m = manifest(objects, "t1");
    let mut record = m["plugins"]["tag"]["versions"]["1"].clone();
    record["version"] = json!(2);
    record["sha256"] = json!(sha_v2);
    record["size"] = json!(v2.len());
    m["plugins"]["tag"]["versions"]["2"] = record;
    m["plugins"]["tag"]["active"] = json!(2);
    m["plugins"]["tag"]["history"] = json!([1]);
    m["revision"] = json!(m["revision"].as_u64().expect("revision") + 1);
    objects.put(
        "tenants/t1/manifest.json",
        &serde_json::to_vec(&m).expect("JSON"),
    );
    let blob_line = format!("blobs/{sha_v2}");
    for s in &reps {
        wait_for(WAIT, "the bad blob logged", || {
            s.s.log_text()
                .lines()
                .any(|l| l.contains("cannot be applied") && l.contains(&blob_line))
        });
    }
    std::thread::sleep(Duration::from_secs(3));
    for s in &reps {
        let lines =
            s.s.log_text()
                .lines()
                .filter(|l| l.contains("cannot be applied") && l.contains(&blob_line))
                .count();
        assert_eq!(lines, 1, "logged once per change:\n{}", s.s.log_text());
        assert!(
            complete(s, Some(K1)).1.ends_with(" [v1]"),
            "the last good plugin"
        );
        assert_eq!(status(s, Some(K2B)), 200);
    }
    // Uploading the component again replaces the bad blob.
    let (st, v) = a.upload("t1", "tag", &v2, None);
    assert_eq!(st, 201, "{v}");
    assert_eq!(objects.get(&blob_line).as_deref(), Some(&v2[..]));
    for s in &reps {
        wait_for(WAIT, "the repaired plugin", || {
            complete(s, Some(K1)).1.ends_with(" [v2]")
        });
    }

    // 3. The key salt deleted, then replaced.
    let salt = objects.get("key-salt").expect("a key salt");
    objects.delete("key-salt");
    wait_for(WAIT, "the salt written back", || {
        objects.get("key-salt").as_deref() == Some(&salt[..])
    });
    assert!(reps
        .iter()
        .any(|s| log_count(s, "key-salt was missing; wrote back") >= 1));
    objects.put("key-salt", &[0x55; 32]);
    for s in &reps {
        wait_for(WAIT, "a replica with another salt refuses", || {
            status(s, Some(K1)) == 503
        });
        let (st, text) = complete(s, Some(K1));
        assert_eq!(st, 503);
        assert!(text.contains("salt"), "{text}");
        assert_eq!(s.s.get("/health/ready").0, 503);
        assert_eq!(s.s.metric("pagoda_state_store_salt_conflict"), 1.0);
        let log = s.s.log_text();
        assert!(
            log.lines()
                .any(|l| l.contains("ERROR") && l.contains("salt is not the state store's")),
            "{log}"
        );
    }
    objects.put("key-salt", &salt);
    for s in &reps {
        wait_for(WAIT, "serving again", || status(s, Some(K1)) == 200);
    }

    // 4. The bucket emptied.
    for k in objects.keys() {
        objects.delete(&k);
    }
    for s in &reps {
        wait_for(WAIT, "the drop held", || {
            s.s.metric("pagoda_state_store_drop_held") == 1.0
        });
        let log = s.s.log_text();
        assert!(
            log.lines()
                .any(|l| l.contains("ERROR") && l.contains("gone from the store at once")),
            "{log}"
        );
        assert!(s.s.metric("pagoda_state_store_refused_drops_total") >= 1.0);
        assert_closed(s);
        assert_eq!(status(s, Some(K1)), 200, "held, not dropped");
        assert_eq!(status(s, Some(K2B)), 200, "held, not dropped");
    }
    wait_for(WAIT, "the salt written back", || {
        objects.get("key-salt").as_deref() == Some(&salt[..])
    });
    // A tenant re-created through one replica syncs to all.
    let (st, v) = a.admin(
        "PUT",
        "/admin/v1/tenants/t2",
        Some(&json!({"api_keys": [K2C]})),
    );
    assert_eq!(st, 200, "{v}");
    for s in &reps {
        wait_for(WAIT, "the rotation in an emptied store", || {
            status(s, Some(K2C)) == 200 && status(s, Some(K2B)) == 401
        });
    }
    // The admin confirms: the rest goes, on each replica.
    for s in &reps {
        let (st, v) = s.admin("POST", "/admin/v1/state-store/confirm-drop", None);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["dropped"], json!(["t1", "t4"]), "{v}");
        assert_eq!(status(s, Some(K1)), 401);
        assert_eq!(status(s, Some(K4)), 401);
        assert_eq!(status(s, Some(K2C)), 200);
        assert_eq!(s.s.metric("pagoda_state_store_drop_held"), 0.0);
        assert_closed(s);
    }

    // 5. A replica started while the store is unreachable.
    if let Some(proxy) = outage.as_deref_mut() {
        proxy.take_down();
        let e = cluster.replica_live("e");
        wait_for(Duration::from_secs(120), "the model loaded", || {
            e.s.log_text().contains("ready: serving")
        });
        let (st, body) = e.s.get("/health/ready");
        assert_eq!(st, 503, "not ready before reading the store: {body}");
        assert!(body.contains("state store"), "{body}");
        // vLLM's /health answers as readiness does; liveness is elsewhere.
        let (st, body) = e.s.get("/health");
        assert_eq!(st, 503, "/health before the store was read: {body}");
        assert_eq!(e.s.get("/health/live").0, 200, "live while not ready");
        assert_closed(&e);
        assert_eq!(status(&e, Some(K2C)), 401);
        proxy.bring_up();
        wait_for(WAIT, "ready once the store is read", || {
            e.s.get("/health/ready").0 == 200
        });
        assert_eq!(e.s.get("/health").0, 200, "/health once serving");
        assert_eq!(status(&e, Some(K2C)), 200);
        assert_closed(&e);
    }
}

#[test]
fn an_s3_store_that_breaks_never_opens_freezes_or_splits_the_replicas() {
    let moto = Moto::start();
    let mut proxy = Proxy::start(moto.port);
    let endpoint = format!("http://127.0.0.1:{}", proxy.port);
    let cluster = Cluster {
        dir: TempDir::new("store-faults-s3"),
        store: format!("s3://{BUCKET}/replicas"),
        env: [
            ("AWS_ENDPOINT", endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_REGION", "us-east-1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .to_vec(),
    };
    let objects = S3Objects { port: moto.port };
    break_the_store(&cluster, &objects, Some(&mut proxy));
}

#[test]
fn a_file_store_that_breaks_never_opens_freezes_or_splits_the_replicas() {
    let dir = TempDir::new("store-faults-file");
    let root = dir.0.join("store");
    let cluster = Cluster {
        store: format!("file://{}", root.display()),
        dir,
        env: Vec::new(),
    };
    let objects = FileObjects { root };
    break_the_store(&cluster, &objects, None);
}
