//! Plugin overhead: p50/p99 of `route` and of `render-prompt` (a 5-message
//! chat through the chat-template plugin) on a live instance, and the
//! per-request cost of a 3-plugin chain (instantiate + route + render +
//! post-process). Components come from `scripts/build-plugins.sh`
//! (`$PAGODA_PLUGIN_DIR`, default `target/plugins`).
//!
//! `cargo bench -p pagoda --bench plugins`

use pagoda::plugins::{
    validate_config, ChainEntry, Limits, LoadedPlugin, PluginRuntime, RuntimeConfig, Session,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

fn load(
    rt: &Arc<PluginRuntime>,
    dir: &PathBuf,
    file: &str,
    config: Option<&str>,
) -> Option<ChainEntry> {
    let path = dir.join(format!("{file}.wasm"));
    let wasm = match std::fs::read(&path) {
        Ok(w) => w,
        Err(_) => {
            eprintln!("skipping {file}: {} missing", path.display());
            return None;
        }
    };
    let c = rt.compile(&wasm).expect("compile");
    let (pre, meta) = rt.prepare(c, &Limits::default()).expect("prepare");
    let config = validate_config(&meta, config).expect("config");
    Some(ChainEntry {
        plugin: Arc::new(LoadedPlugin::new(
            file.into(),
            1,
            String::new(),
            meta,
            config,
            pre,
        )),
        fail_open: [false; 4],
    })
}

fn report(name: &str, mut us: Vec<f64>) {
    us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |p: f64| us[((us.len() as f64 - 1.0) * p) as usize];
    println!(
        "{name:<44} n={:<6} p50 {:>8.1} µs   p99 {:>8.1} µs",
        us.len(),
        q(0.5),
        q(0.99)
    );
}

fn main() {
    let dir = std::env::var("PAGODA_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/plugins"))
        });
    let rt = PluginRuntime::new(RuntimeConfig::default()).expect("runtime");
    let chat = serde_json::json!({
        "model": "smol",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Germany?"},
            {"role": "assistant", "content": "Berlin."}
        ]
    });
    let route_req =
        serde_json::json!({"endpoint": "/v1/chat/completions", "body": chat}).to_string();
    let body = chat.to_string();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let n = 2000;
    let router = load(&rt, &dir, "router", None);
    let tmpl = load(&rt, &dir, "chat-template", None);
    let tag = load(&rt, &dir, "tag-v1", None);

    if let Some(r) = &router {
        let mut s = Session::new(
            Arc::clone(&rt),
            "bench",
            "req",
            vec!["smol".into()],
            vec![r.clone()],
            Limits::default(),
        );
        s.route(0, &route_req).expect("route");
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let a = Instant::now();
            s.route(0, &route_req).expect("route");
            t.push(a.elapsed().as_secs_f64() * 1e6);
        }
        report("route (router, live instance)", t);
    }
    if let Some(c) = &tmpl {
        let mut s = Session::new(
            Arc::clone(&rt),
            "bench",
            "req",
            vec!["smol".into()],
            vec![c.clone()],
            Limits::default(),
        );
        let _ = s.render_prompt(0, &body, Some(template)).expect("render");
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let a = Instant::now();
            let _ = s.render_prompt(0, &body, Some(template)).expect("render");
            t.push(a.elapsed().as_secs_f64() * 1e6);
        }
        report("render-prompt (chat-template, 5 messages)", t);
    }
    if let Some(c) = &tag {
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let a = Instant::now();
            let mut s = Session::new(
                Arc::clone(&rt),
                "bench",
                "req",
                vec!["smol".into()],
                vec![c.clone()],
                Limits::default(),
            );
            s.post_process(0, 0, "Hello there")
                .expect("post")
                .expect("ok");
            t.push(a.elapsed().as_secs_f64() * 1e6);
        }
        report("instantiate + post-process (tag)", t);
    }
    let chain: Vec<ChainEntry> = [router, tmpl, tag].into_iter().flatten().collect();
    if chain.len() == 3 {
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let a = Instant::now();
            let mut s = Session::new(
                Arc::clone(&rt),
                "bench",
                "req",
                vec!["smol".into()],
                chain.clone(),
                Limits::default(),
            );
            s.route(0, &route_req).expect("route");
            let _ = s.render_prompt(1, &body, Some(template)).expect("render");
            s.post_process(2, 0, "Paris is the capital.")
                .expect("post")
                .expect("ok");
            t.push(a.elapsed().as_secs_f64() * 1e6);
        }
        report("3-plugin chain per request (inst+route+render+post)", t);
    }
}
