//! When the engine thread dies (here a panic injected into a step), the
//! server is honest about it: the requests in flight and any new ones get a
//! 503 with an OpenAI error body, `/health` and `/health/ready` stop
//! answering 200, and the process exits non-zero so that its supervisor
//! (Kubernetes) restarts it.

use pagoda_e2e::{agent, demo_gguf, read_sse, Server};
use serde_json::{json, Value};
use std::time::Duration;

/// Step 1 is the server's warm-up forward; the panic comes at step 4, in
/// the middle of the test's first request.
const PANIC_AT_STEP: &str = "4";

fn assert_unavailable(status: u16, body: &Value) {
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "service_unavailable", "{body}");
    assert_eq!(body["error"]["type"], "server_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

#[test]
fn a_dead_engine_fails_its_requests_with_503_turns_unhealthy_and_exits_non_zero() {
    let mut s = Server::start_with_env(
        &demo_gguf(),
        &[],
        &[("PAGODA_INJECT_ENGINE_PANIC_AT_STEP", PANIC_AT_STEP)],
    );
    assert_eq!(s.get("/health").0, 200, "healthy before the fault");

    // A streamed request is running when the step panics (its response
    // headers, sent once it is admitted, come back before the fault), and a
    // plain one is in flight or arrives just after.
    let stream = agent()
        .post(&s.url("/v1/completions"))
        .send_json(json!({
            "model": "smol", "prompt": "Once upon a time", "max_tokens": 64,
            "temperature": 0, "stream": true,
        }))
        .expect("stream");
    assert_eq!(stream.status(), 200);
    let (status, body) = s.post(
        "/v1/completions",
        &json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 64, "temperature": 0}),
    );
    assert_unavailable(status, &body);
    // The stream's failure comes as an error event inside it.
    let events = read_sse(stream.into_body().into_reader());
    let errors: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|e| e.get("error").is_some())
        .collect();
    assert_eq!(errors.len(), 1, "one error event in {events:?}");
    assert_eq!(errors[0]["error"]["code"], "service_unavailable");

    // Probes and new requests see the dead engine while the server drains.
    let (h, hb) = s.get("/health");
    assert_eq!(h, 503, "/health after the fault: {hb}");
    let (r, rb) = s.get("/health/ready");
    assert_eq!(r, 503, "/health/ready after the fault: {rb}");
    let (status, body) = s.post(
        "/v1/chat/completions",
        &json!({"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_unavailable(status, &body);

    // Then it exits, non-zero, saying why.
    let exit = s.wait_exit(Duration::from_secs(30));
    let log = s.log_text();
    let exit =
        exit.unwrap_or_else(|| panic!("the server did not exit after its engine died:\n{log}"));
    assert!(!exit.success(), "exit status {exit}:\n{log}");
    assert!(
        log.contains("injected fault"),
        "the log names the panic:\n{log}"
    );
    assert!(
        log.contains("the engine died"),
        "the log says it exits:\n{log}"
    );
}
