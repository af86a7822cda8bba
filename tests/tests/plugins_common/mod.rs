//! Shared helpers of the plugin and tenant end-to-end tests: building the
//! plugin components once, starting the server with a state dir and an
//! admin token, and the admin and tenant HTTP calls.
#![allow(dead_code)]

use pagoda_e2e::{agent, read_sse, Server, TempDir};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

pub const ADMIN: &str = "admin-token-for-tests";

/// The directory `scripts/build-plugins.sh` builds the components into
/// (the last line it prints), built once per test binary.
pub fn plugin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Ok(d) = std::env::var("PAGODA_PLUGIN_DIR") {
            return PathBuf::from(d);
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-plugins.sh");
        if !std::path::Path::new(script).exists() {
            return PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/plugins"));
        }
        let out = Command::new("bash")
            .arg(script)
            .output()
            .expect("running scripts/build-plugins.sh");
        assert!(
            out.status.success(),
            "build-plugins.sh failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        PathBuf::from(
            stdout
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .expect("a directory")
                .trim(),
        )
    })
    .clone()
}

/// A built component's bytes.
pub fn component(name: &str) -> Vec<u8> {
    let p = plugin_dir().join(format!("{name}.wasm"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

/// A server with plugins: a state dir and an admin token.
pub struct PServer {
    pub s: Server,
    pub state: PathBuf,
}

/// One HTTP call to `url` with a bearer token; returns (status, body as
/// JSON, or as a JSON string when it is not JSON).
pub fn call_url(url: &str, method: &str, token: &str, body: Option<&Value>) -> (u16, Value) {
    let auth = format!("Bearer {token}");
    let a = agent();
    let r = match (method, body) {
        ("GET", _) => a.get(url).header("Authorization", &auth).call(),
        ("DELETE", _) => a.delete(url).header("Authorization", &auth).call(),
        ("PUT", Some(b)) => a.put(url).header("Authorization", &auth).send_json(b),
        ("POST", Some(b)) => a.post(url).header("Authorization", &auth).send_json(b),
        ("POST", None) => a.post(url).header("Authorization", &auth).send_empty(),
        _ => panic!("unsupported {method}"),
    };
    let mut r = r.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn start(state: &TempDir, extra: &[&str]) -> PServer {
    let dir = state.0.join("state");
    let d = dir.to_string_lossy().to_string();
    let mut args = vec!["--state-dir", d.as_str(), "--admin-token", ADMIN];
    args.extend_from_slice(extra);
    PServer {
        s: Server::start(&args),
        state: dir,
    }
}

impl PServer {
    pub fn admin(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.admin_as(ADMIN, method, path, body)
    }

    pub fn admin_as(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        call_url(&self.s.url(path), method, token, body)
    }

    pub fn put_tenant(&self, id: &str, body: Value) {
        let (st, v) = self.admin("PUT", &format!("/admin/v1/tenants/{id}"), Some(&body));
        assert!(st == 200 || st == 201, "PUT tenant {id}: {st} {v}");
    }

    /// Uploads a component; returns (status, body).
    pub fn upload(
        &self,
        tenant: &str,
        name: &str,
        wasm: &[u8],
        config: Option<&Value>,
    ) -> (u16, Value) {
        let mut url = self
            .s
            .url(&format!("/admin/v1/tenants/{tenant}/plugins/{name}"));
        if let Some(c) = config {
            url.push_str("?config=");
            url.push_str(&urlencode(&c.to_string()));
        }
        let mut r = agent()
            .put(&url)
            .header("Authorization", &format!("Bearer {ADMIN}"))
            .header("Content-Type", "application/wasm")
            .send(wasm)
            .expect("upload");
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn upload_ok(&self, tenant: &str, name: &str, file: &str, config: Option<&Value>) -> Value {
        let (st, v) = self.upload(tenant, name, &component(file), config);
        assert_eq!(
            st,
            201,
            "upload {file} as {tenant}/{name}: {v}\n{}",
            self.s.log_text()
        );
        v
    }

    /// POSTs as a tenant key; returns (status, body).
    pub fn post_as(&self, key: &str, path: &str, body: &Value) -> (u16, Value) {
        let mut r = agent()
            .post(&self.s.url(path))
            .header("Authorization", &format!("Bearer {key}"))
            .send_json(body)
            .expect("request");
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A streamed chat or completion as a tenant; returns (status, text, error event if any).
    pub fn stream_as(&self, key: &str, path: &str, body: &Value) -> (u16, String, Option<Value>) {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = agent()
            .post(&self.s.url(path))
            .header("Authorization", &format!("Bearer {key}"))
            .send_json(&body)
            .expect("request");
        let status = r.status().as_u16();
        if status != 200 {
            let text = r.into_body().read_to_string().unwrap_or_default();
            return (status, String::new(), serde_json::from_str(&text).ok());
        }
        let events = read_sse(r.into_body().into_reader());
        let mut text = String::new();
        let mut err = None;
        for e in events.iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).expect("chunk JSON");
            if v.get("error").is_some() {
                err = Some(v);
                continue;
            }
            for ch in v["choices"].as_array().into_iter().flatten() {
                if let Some(t) = ch["delta"]["content"]
                    .as_str()
                    .or_else(|| ch["text"].as_str())
                {
                    text.push_str(t);
                }
            }
        }
        (status, text, err)
    }
}

pub fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A short greedy chat body.
pub fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": "smol",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// Asserts that `v` is an error body in OpenAI's shape,
/// `{"error": {"message", "type", "param", "code"}}` with a non-empty
/// message and string type and code, and returns the inner object.
pub fn openai_error(v: &Value) -> &Value {
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no error message in {v}"
    );
    assert!(e["type"].is_string(), "no error type in {v}");
    assert!(e["code"].is_string(), "no error code in {v}");
    assert!(
        e.as_object().is_some_and(|o| o.contains_key("param")),
        "no error param in {v}"
    );
    e
}

/// The sum of the samples of metric `name` in a Prometheus text whose
/// labels include every pair of `labels` (0 when none match).
pub fn metric_sum(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter_map(|rest| {
            let (labels_part, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            labels
                .iter()
                .all(|(k, v)| {
                    labels_part
                        .split(',')
                        .any(|pair| pair == format!("{k}=\"{v}\""))
                })
                .then(|| value.trim().parse::<f64>().ok())
                .flatten()
        })
        .sum()
}
