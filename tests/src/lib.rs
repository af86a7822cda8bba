//! Shared pieces of the end-to-end tests: finding the built binary and the
//! demo model, starting `pagoda serve` on a free port, and an HTTP client
//! that returns 4xx/5xx responses instead of failing on them.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `pagoda` binary of the same build as this test (`target/<profile>/pagoda`).
pub fn pagoda_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/pagoda
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("pagoda");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --release --workspace` first",
        bin.display()
    );
    bin
}

/// The demo GGUF: `$PAGODA_DEMO_GGUF`, or what scripts/fetch-demo-model.sh prints.
pub fn demo_gguf() -> PathBuf {
    if let Ok(p) = std::env::var("PAGODA_DEMO_GGUF") {
        return PathBuf::from(p);
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/fetch-demo-model.sh"
    );
    let out = Command::new(script)
        .output()
        .expect("running scripts/fetch-demo-model.sh");
    assert!(
        out.status.success(),
        "fetch-demo-model.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// An HTTP client that hands back error statuses as responses.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// A running `pagoda serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub log: PathBuf,
    _dir: TempDir,
}

/// A temporary directory removed on drop (no extra crate needed).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "pagoda-e2e-{tag}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Server {
    /// Starts the server on the demo model with `extra` flags and waits
    /// until `/health/ready` answers 200.
    pub fn start(extra: &[&str]) -> Server {
        Self::start_with_model(&demo_gguf(), extra)
    }

    /// Starts the server on `model`.
    pub fn start_with_model(model: &std::path::Path, extra: &[&str]) -> Server {
        Self::start_with_env(model, extra, &[])
    }

    /// Starts the server on `model` with extra environment variables.
    pub fn start_with_env(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::spawn(model, extra, env, None)
    }

    /// Starts the server on `model` with extra environment variables, and
    /// waits only until it is live (`/health/live` answers 200), not ready: for
    /// a server that is meant not to become ready yet.
    pub fn start_live(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        for _ in 0..4 {
            match Self::try_spawn_as(model, false, extra, env, None, false) {
                Ok(s) => return s,
                Err(log) if log.contains("Address already in use") => continue,
                Err(log) => panic!("pagoda serve exited:\n{log}"),
            }
        }
        panic!("no free port for pagoda serve")
    }

    /// Starts the server on the demo model given as `serve`'s first
    /// argument (`pagoda serve MODEL`, as `vllm serve MODEL`), not `--model`.
    pub fn start_positional(extra: &[&str]) -> Server {
        Self::spawn_as(&demo_gguf(), true, extra, &[], None)
    }

    /// Starts the server on the demo model, able to open at most
    /// `fd_limit` files (soft and hard limit), as on a host with a low
    /// `ulimit -n`.
    pub fn start_with_fd_limit(fd_limit: u64, extra: &[&str]) -> Server {
        Self::spawn(&demo_gguf(), extra, &[], Some(fd_limit))
    }

    fn spawn(
        model: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
        fd_limit: Option<u64>,
    ) -> Server {
        Self::spawn_as(model, false, extra, env, fd_limit)
    }

    fn spawn_as(
        model: &std::path::Path,
        positional: bool,
        extra: &[&str],
        env: &[(&str, &str)],
        fd_limit: Option<u64>,
    ) -> Server {
        // A port free when picked can be taken before the server binds it
        // (by a client socket of a test running alongside): try another.
        for _ in 0..4 {
            match Self::try_spawn(model, positional, extra, env, fd_limit) {
                Ok(s) => return s,
                Err(log) if log.contains("Address already in use") => continue,
                Err(log) => panic!("pagoda serve exited:\n{log}"),
            }
        }
        match Self::try_spawn(model, positional, extra, env, fd_limit) {
            Ok(s) => s,
            Err(log) => panic!("pagoda serve exited:\n{log}"),
        }
    }

    /// Starts the server on a free port; its log if it exited before it
    /// was ready.
    fn try_spawn(
        model: &std::path::Path,
        positional: bool,
        extra: &[&str],
        env: &[(&str, &str)],
        fd_limit: Option<u64>,
    ) -> Result<Server, String> {
        Self::try_spawn_as(model, positional, extra, env, fd_limit, true)
    }

    fn try_spawn_as(
        model: &std::path::Path,
        positional: bool,
        extra: &[&str],
        env: &[(&str, &str)],
        fd_limit: Option<u64>,
        ready: bool,
    ) -> Result<Server, String> {
        let port = free_port();
        let dir = TempDir::new("server");
        let log = dir.0.join("server.log");
        let logf = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(pagoda_bin());
        if let Some(n) = fd_limit {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe, as pre_exec requires.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd.arg("serve");
        if !positional {
            cmd.arg("--model");
        }
        let child = cmd
            .arg(model)
            .args([
                "--port",
                &port.to_string(),
                "--served-model-name",
                "smol",
                "--threads",
                "2",
            ])
            .args(["--kv-cache-memory", "256MiB", "--max-model-len", "2048"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("starting pagoda serve");
        let mut s = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let probe = if ready {
            "/health/ready"
        } else {
            "/health/live"
        };
        s.wait_for_probe(probe, Duration::from_secs(120))?;
        Ok(s)
    }

    fn wait_for_probe(&mut self, probe: &str, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        let a = agent();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exit {status}:\n{}", self.log_text()));
            }
            if let Ok(r) = a.get(&format!("{}{probe}", self.base)).call() {
                if r.status() == 200 {
                    return Ok(());
                }
            }
            assert!(
                started.elapsed() < limit,
                "server not ready after {limit:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits up to `limit` for the server to exit by itself; its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The server's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `base + path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` and returns the status and the whole response body as
    /// text (for streams: every SSE line).
    pub fn post_text(&self, path: &str, body: &Value) -> (u16, String) {
        let mut r = agent()
            .post(&self.url(path))
            .send_json(body)
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_string().unwrap_or_default())
    }

    /// POSTs JSON; returns (status, parsed body).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = agent()
            .post(&self.url(path))
            .send_json(body)
            .expect("request");
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// GETs a path; returns (status, body text).
    pub fn get(&self, path: &str) -> (u16, String) {
        let mut r = agent().get(&self.url(path)).call().expect("request");
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_string().expect("body"))
    }

    /// The value of a sample in `/metrics` that has no labels but the
    /// server-wide `model_name` and `engine`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| {
                let rest = l.strip_prefix(name)?;
                let value = match rest.strip_prefix('{') {
                    Some(labels) => {
                        let (labels, value) = labels.split_once("} ")?;
                        let only_global = labels
                            .split(',')
                            .all(|kv| kv.starts_with("model_name=") || kv.starts_with("engine="));
                        only_global.then_some(value)?
                    }
                    None => rest.strip_prefix(' ')?,
                };
                value.trim().parse().ok()
            })
            .unwrap_or_else(|| panic!("metric {name} not found in:\n{text}"))
    }

    /// The process's resident memory in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Sends a signal to the server.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads an SSE body: the `data:` payloads of each event, in order, up to
/// and including `[DONE]`. Events are separated by blank lines and may span
/// several `data:` lines, as the SSE spec allows.
pub fn read_sse(reader: impl std::io::Read) -> Vec<String> {
    let mut events = Vec::new();
    let mut data: Vec<String> = Vec::new();
    for line in BufReader::new(reader).lines() {
        let line = line.expect("SSE line");
        if line.is_empty() {
            if !data.is_empty() {
                let ev = data.join("\n");
                data.clear();
                let done = ev == "[DONE]";
                events.push(ev);
                if done {
                    break;
                }
            }
            continue;
        }
        if let Some(d) = line.strip_prefix("data:") {
            data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
        } else if line.starts_with(':') {
            continue; // a comment
        } else {
            panic!("unexpected SSE line: {line:?}");
        }
    }
    events
}

/// A JSON file of the reference outputs (tests/fixtures/reference, a copy
/// of ../shared/reference, or
/// `$PAGODA_REFERENCE_DIR`): llama.cpp's and float32 transformers' runs of
/// the demo model.
pub fn reference_json(name: &str) -> Value {
    let dir = match std::env::var("PAGODA_REFERENCE_DIR") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/reference")),
    };
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The folder of a PEFT adapter fixture (`tests/fixtures/lora/<name>`,
/// e.g. `llama/qv-r8`).
pub fn lora_fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/lora")).join(name)
}

/// The first case of a PEFT adapter fixture's reference: its prompt ids and
/// PEFT's logprobs of prompt tokens 1.. (`name` as for [`lora_fixture`]).
pub fn lora_first_case(name: &str) -> (Vec<u64>, Vec<f64>) {
    let path = lora_fixture(name).join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let r: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let c = &r["cases"][0];
    let ids = c["prompt_ids"]
        .as_array()
        .expect("prompt_ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let lps = c["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs")
        .iter()
        .skip(1)
        .filter_map(Value::as_f64)
        .collect();
    (ids, lps)
}
