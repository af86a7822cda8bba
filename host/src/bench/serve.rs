//! `pagoda bench serve`: an online load generator for any OpenAI-compatible
//! server (Pagoda or a peer), like `vllm bench serve`. Every request
//! streams; TTFT, TPOT, ITL and E2EL come from the arrival times of the SSE
//! chunks.

use super::datasets::BenchRequest;
use super::stats::{summarize, Summary};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to drive the server.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// `http://host:port`, without a trailing slash.
    pub base_url: String,
    pub model: String,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub endpoint: String,
    /// Requests in flight at most; `None` is unbounded.
    pub max_concurrency: Option<usize>,
    /// Send `ignore_eos: true`, so every request runs to its output length
    /// (vLLM's `--ignore-eos`; off by default, as in vLLM).
    pub ignore_eos: bool,
    /// Fields merged into every request body (`--extra-body`), e.g. a
    /// `response_format` to measure structured output under load.
    pub extra_body: serde_json::Map<String, Value>,
    /// Mean arrivals per second; infinite sends everything at once.
    pub request_rate: f64,
    /// Gamma shape of the inter-arrival times: 1 is Poisson, lower is burstier.
    pub burstiness: f64,
    pub seed: u64,
    /// Draw the progress bar on stderr.
    pub progress: bool,
    /// Sent as a bearer token.
    pub api_key: Option<String>,
    /// LoRA adapters served beside the model (`--lora-modules`): each
    /// request names one of them, chosen by its index and the seed.
    pub lora_modules: Vec<String>,
}

impl ServeConfig {
    /// The model request `i` names: the served model, or with
    /// `lora_modules` one of them, picked as vLLM's benchmark does (at
    /// random per request; here reproducibly from the seed).
    pub fn model_for(&self, i: usize) -> &str {
        if self.lora_modules.is_empty() {
            return &self.model;
        }
        // SplitMix64 of (seed, i): spread evenly, the same every run.
        let mut z = self.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        &self.lora_modules[(z % self.lora_modules.len() as u64) as usize]
    }
}

/// One request's measurements.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RequestResult {
    pub success: bool,
    pub error: String,
    pub prompt_len: usize,
    pub output_tokens: usize,
    /// Seconds to the first token.
    pub ttft: f64,
    /// Seconds between successive chunks.
    pub itl: Vec<f64>,
    /// Seconds from send to the last byte.
    pub latency: f64,
    pub generated_text: String,
}

/// Splits `base_url` into host:port.
fn authority(base: &str) -> Result<(String, String)> {
    let rest = base
        .strip_prefix("http://")
        .with_context(|| format!("--base-url {base}: only http:// URLs are supported"))?;
    let host_port = rest.split('/').next().unwrap_or(rest);
    let addr = if host_port.contains(':') {
        host_port.to_string()
    } else {
        format!("{host_port}:80")
    };
    Ok((addr, host_port.to_string()))
}

/// Gamma(shape, scale) by Marsaglia and Tsang's method: the inter-arrival
/// distribution vLLM's benchmark uses (shape 1 is exponential: Poisson).
fn gamma(rng: &mut StdRng, shape: f64, scale: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        return gamma(rng, shape + 1.0, scale) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        // A standard normal by Box-Muller.
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(f64::MIN_POSITIVE), rng.random());
        let x = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v * scale;
        }
    }
}

/// Sends one streaming request and times its chunks.
async fn one_request(cfg: &ServeConfig, req: &BenchRequest) -> RequestResult {
    let mut r = RequestResult {
        prompt_len: req.prompt_len,
        ..Default::default()
    };
    match run_request(cfg, req, &mut r).await {
        Ok(()) => r.success = true,
        Err(e) => r.error = format!("{e:#}"),
    }
    r
}

async fn run_request(cfg: &ServeConfig, req: &BenchRequest, r: &mut RequestResult) -> Result<()> {
    let chat = cfg.endpoint.contains("chat");
    let mut body = json!({
        "model": cfg.model_for(req.index),
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if chat {
        body["messages"] = json!([{"role": "user", "content": req.prompt_text}]);
    } else {
        body["prompt"] = json!(req.prompt_text);
    }
    if cfg.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    for (k, v) in &cfg.extra_body {
        body[k] = v.clone();
    }
    let (addr, host) = authority(&cfg.base_url)?;
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(&addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut http = Request::post(&cfg.endpoint)
        .header("host", host)
        .header("content-type", "application/json");
    if let Some(key) = &cfg.api_key {
        http = http.header("authorization", format!("Bearer {key}"));
    }
    let http = http.body(Full::new(Bytes::from(body.to_string())))?;
    let mut resp = sender.send_request(http).await?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        bail!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&text)
                .chars()
                .take(200)
                .collect::<String>()
        );
    }
    let mut buf = Vec::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut usage_tokens = None;
    'read: while let Some(frame) = resp.body_mut().frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.extend_from_slice(data);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(payload) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if payload == "[DONE]" {
                    break 'read;
                }
                let v: Value = serde_json::from_str(payload)
                    .with_context(|| format!("bad SSE payload: {payload:.100}"))?;
                if let Some(e) = v.get("error") {
                    bail!("server error mid-stream: {e}");
                }
                if let Some(n) = v
                    .get("usage")
                    .and_then(|u| u.get("completion_tokens"))
                    .and_then(Value::as_u64)
                {
                    usage_tokens = Some(n as usize);
                }
                // A chat prompt is what the server's template made of the
                // message, so its length is the server's count, as vLLM
                // takes it.
                if let Some(n) = v
                    .get("usage")
                    .and_then(|u| u.get("prompt_tokens"))
                    .and_then(Value::as_u64)
                    .filter(|_| chat)
                {
                    r.prompt_len = n as usize;
                }
                let piece = v["choices"].get(0).and_then(|c| {
                    if chat {
                        c["delta"]["content"].as_str()
                    } else {
                        c["text"].as_str()
                    }
                });
                if let Some(p) = piece.filter(|p| !p.is_empty()) {
                    let now = Instant::now();
                    match last {
                        None => r.ttft = (now - started).as_secs_f64(),
                        Some(prev) => r.itl.push((now - prev).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                    r.generated_text.push_str(p);
                }
            }
        }
    }
    r.latency = started.elapsed().as_secs_f64();
    // Peers that do not report usage in streams count one token per chunk.
    r.output_tokens = usage_tokens.unwrap_or(chunks);
    if chunks == 0 {
        bail!("the stream carried no tokens");
    }
    Ok(())
}

/// The benchmark's results, under `vllm bench serve`'s key names.
pub fn report(cfg: &ServeConfig, results: &[RequestResult], duration: f64) -> Value {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.success).collect();
    let ms = |v: Vec<f64>| summarize(&v.into_iter().map(|x| x * 1000.0).collect::<Vec<_>>());
    let ttft = ms(ok.iter().map(|r| r.ttft).collect());
    let tpot = ms(ok
        .iter()
        .filter(|r| r.output_tokens > 1)
        .map(|r| (r.latency - r.ttft) / (r.output_tokens - 1) as f64)
        .collect());
    let itl = ms(ok.iter().flat_map(|r| r.itl.iter().copied()).collect());
    let e2el = ms(ok.iter().map(|r| r.latency).collect());
    let input: usize = ok.iter().map(|r| r.prompt_len).sum();
    let output: usize = ok.iter().map(|r| r.output_tokens).sum();
    let mut v = json!({
        "date": chrono_like_now(),
        "backend": "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": cfg.model,
        "num_prompts": results.len(),
        "request_rate": if cfg.request_rate.is_finite() { json!(cfg.request_rate) } else { json!("inf") },
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "duration": duration,
        "completed": ok.len(),
        "failed": results.len() - ok.len(),
        "total_input_tokens": input,
        "total_output_tokens": output,
        "request_throughput": ok.len() as f64 / duration,
        "output_throughput": output as f64 / duration,
        "total_token_throughput": (input + output) as f64 / duration,
        "input_lens": results.iter().map(|r| r.prompt_len).collect::<Vec<_>>(),
        "output_lens": results.iter().map(|r| r.output_tokens).collect::<Vec<_>>(),
        "ttfts": results.iter().map(|r| r.ttft).collect::<Vec<_>>(),
        "itls": results.iter().map(|r| r.itl.clone()).collect::<Vec<_>>(),
        "generated_texts": results.iter().map(|r| r.generated_text.clone()).collect::<Vec<_>>(),
        "errors": results.iter().map(|r| r.error.clone()).collect::<Vec<_>>(),
    });
    for (name, s) in [("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)] {
        let Summary {
            mean,
            median,
            std,
            p90,
            p99,
        } = s;
        v[format!("mean_{name}_ms")] = json!(mean);
        v[format!("median_{name}_ms")] = json!(median);
        v[format!("std_{name}_ms")] = json!(std);
        v[format!("p90_{name}_ms")] = json!(p90);
        v[format!("p99_{name}_ms")] = json!(p99);
    }
    v
}

fn chrono_like_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs}")
}

/// Runs the load and returns the report.
pub async fn run(cfg: ServeConfig, requests: Vec<BenchRequest>) -> Result<Value> {
    let cfg = Arc::new(cfg);
    let limit = Arc::new(tokio::sync::Semaphore::new(
        cfg.max_concurrency
            .unwrap_or(tokio::sync::Semaphore::MAX_PERMITS),
    ));
    let done = Arc::new(AtomicUsize::new(0));
    let total = requests.len();
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let started = Instant::now();
    let progress = if cfg.progress {
        let done = Arc::clone(&done);
        Some(tokio::spawn(async move {
            loop {
                let d = done.load(Ordering::Relaxed);
                let width = 40;
                let filled = d * width / total.max(1);
                eprint!(
                    "\r[{}{}] {d}/{total} requests",
                    "#".repeat(filled),
                    " ".repeat(width - filled)
                );
                if d >= total {
                    eprintln!();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }))
    } else {
        None
    };
    let mut tasks = Vec::with_capacity(total);
    for req in requests {
        if cfg.request_rate.is_finite() && cfg.request_rate > 0.0 {
            let wait = gamma(
                &mut rng,
                cfg.burstiness,
                1.0 / (cfg.request_rate * cfg.burstiness),
            );
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        let permit = Arc::clone(&limit).acquire_owned().await?;
        let (cfg, done) = (Arc::clone(&cfg), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            let r = one_request(&cfg, &req).await;
            drop(permit);
            done.fetch_add(1, Ordering::Relaxed);
            r
        }));
    }
    let mut results = Vec::with_capacity(total);
    for t in tasks {
        results.push(t.await?);
    }
    let duration = started.elapsed().as_secs_f64();
    if let Some(p) = progress {
        let _ = p.await;
    }
    Ok(report(&cfg, &results, duration))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gamma_has_the_requested_mean() {
        let mut rng = StdRng::seed_from_u64(1);
        for (shape, scale) in [(1.0, 0.5), (0.5, 2.0), (4.0, 0.25)] {
            let n = 200_000;
            let mean: f64 = (0..n).map(|_| gamma(&mut rng, shape, scale)).sum::<f64>() / n as f64;
            assert!(
                (mean - shape * scale).abs() < 0.02 * shape * scale + 0.005,
                "shape {shape}: mean {mean}"
            );
        }
    }

    #[test]
    fn each_request_names_one_adapter_reproducibly_and_all_are_used() {
        let cfg = ServeConfig {
            base_url: "http://x".into(),
            model: "m".into(),
            endpoint: "/v1/completions".into(),
            max_concurrency: None,
            ignore_eos: false,
            extra_body: Default::default(),
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            seed: 3,
            progress: false,
            api_key: None,
            lora_modules: (0..8).map(|i| format!("lora{i}")).collect(),
        };
        let picks: Vec<&str> = (0..64).map(|i| cfg.model_for(i)).collect();
        assert_eq!(picks, (0..64).map(|i| cfg.model_for(i)).collect::<Vec<_>>());
        for name in &cfg.lora_modules {
            assert!(picks.contains(&name.as_str()), "{name} never picked");
        }
        let base = ServeConfig {
            lora_modules: Vec::new(),
            ..cfg.clone()
        };
        assert_eq!(base.model_for(5), "m");
    }

    #[test]
    fn tpot_comes_from_the_stream_timestamps() {
        let cfg = ServeConfig {
            base_url: "http://x".into(),
            model: "m".into(),
            endpoint: "/v1/completions".into(),
            max_concurrency: None,
            ignore_eos: false,
            extra_body: Default::default(),
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            seed: 0,
            progress: false,
            api_key: None,
            lora_modules: Vec::new(),
        };
        let r = RequestResult {
            success: true,
            prompt_len: 10,
            output_tokens: 5,
            ttft: 0.5,
            itl: vec![0.1, 0.1, 0.2, 0.2],
            latency: 1.1,
            ..Default::default()
        };
        let v = report(
            &cfg,
            &[
                r.clone(),
                RequestResult {
                    ttft: 0.3,
                    latency: 0.7,
                    ..r
                },
            ],
            2.0,
        );
        assert!((v["mean_ttft_ms"].as_f64().unwrap() - 400.0).abs() < 1e-9);
        // TPOT = (latency - ttft) / (tokens - 1): 150 ms and 100 ms.
        assert!((v["mean_tpot_ms"].as_f64().unwrap() - 125.0).abs() < 1e-9);
        assert!((v["median_itl_ms"].as_f64().unwrap() - 150.0).abs() < 1e-9);
        assert_eq!(v["total_output_tokens"], 10);
        assert!((v["output_throughput"].as_f64().unwrap() - 5.0).abs() < 1e-9);
    }
}
