//! Several tenants on one server, under the default scheduling policy
//! (fair share) and prefix caching: tenant A's long prompts run in several
//! prefill chunks while tenant B's short requests keep taking slots from
//! it. Every one of A's greedy outputs must equal the same prompt's output
//! on an idle server. (Before the prefix cache took only computed blocks,
//! a sequence preempted in the step that had planned it left findable
//! blocks whose K/V was never written, and one output in eight came back
//! as garbage.)

mod plugins_common;

use pagoda_e2e::{agent, TempDir};
use plugins_common::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const A: &str = "key-tenant-a-1234";
const B: &str = "key-tenant-b-1234";
const ROUNDS: usize = 3;
const PER_ROUND: usize = 8;

const FLAGS: &[&str] = &["--max-num-seqs", "4"];

/// Prompt `i` of round `round`: a shared opening, then about 1,000 tokens
/// of its own, so that each takes several prefill chunks and some share
/// their first blocks with the others.
fn prompt(round: usize, i: usize) -> String {
    let mut p = String::from(
        "The following is a report on how people in a small town spend their evenings. ",
    );
    let topics = [
        "television",
        "reading",
        "walking",
        "cooking",
        "music",
        "games",
        "gardening",
        "letters",
    ];
    for k in 0..60 {
        p.push_str(&format!(
            "Survey {round}-{i} entry {k}: a household of {} reported {} hours of {} on day {}. ",
            (k * 7 + i) % 9 + 1,
            (k * 3 + round) % 5 + 1,
            topics[(k + i + round) % topics.len()],
            k % 7 + 1
        ));
    }
    p.push_str("Summary of the data:");
    p
}

fn completion(prompt: &str) -> Value {
    json!({
        "model": "smol",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": true,
    })
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn server(tag: &str) -> (TempDir, PServer) {
    let dir = TempDir::new(tag);
    let p = start(&dir, FLAGS);
    p.put_tenant("a", json!({"api_keys": [A]}));
    p.put_tenant("b", json!({"api_keys": [B]}));
    (dir, p)
}

#[test]
fn a_tenants_outputs_are_unchanged_by_another_tenant_taking_its_slots() {
    let prompts: Vec<Vec<String>> = (0..ROUNDS)
        .map(|r| (0..PER_ROUND).map(|i| prompt(r, i)).collect())
        .collect();

    // What each prompt gives on an idle server, one at a time.
    let idle: Vec<Vec<String>> = {
        let (_dir, p) = server("prefix-idle");
        prompts
            .iter()
            .map(|round| {
                round
                    .iter()
                    .map(|q| {
                        let (st, v) = p.post_as(A, "/v1/completions", &completion(q));
                        assert_eq!(st, 200, "{v}");
                        text_of(&v)
                    })
                    .collect()
            })
            .collect()
    };

    let (_dir, p) = server("prefix-busy");
    let stop = Arc::new(AtomicBool::new(false));
    let url = p.s.url("/v1/completions");
    let b_clients: Vec<_> = (0..3)
        .map(|c| {
            let (url, stop) = (url.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut served = 0;
                while !stop.load(Ordering::Relaxed) {
                    let r = agent()
                        .post(&url)
                        .header("Authorization", &format!("Bearer {B}"))
                        .send_json(json!({
                            "model": "smol",
                            "prompt": format!("Hi number {c}"),
                            "max_tokens": 4,
                            "temperature": 0,
                        }));
                    if r.is_ok() {
                        served += 1;
                    }
                }
                served
            })
        })
        .collect();

    let mut wrong = Vec::new();
    for (r, round) in prompts.iter().enumerate() {
        let handles: Vec<_> = round
            .iter()
            .cloned()
            .map(|q| {
                let url = url.clone();
                std::thread::spawn(move || {
                    let mut resp = agent()
                        .post(&url)
                        .header("Authorization", &format!("Bearer {A}"))
                        .send_json(completion(&q))
                        .expect("tenant A's completion");
                    let v: Value = resp.body_mut().read_json().expect("JSON body");
                    text_of(&v)
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("client thread");
            if got != idle[r][i] {
                wrong.push(format!(
                    "round {r}, prompt {i}: {got:?}, idle server {:?}",
                    idle[r][i]
                ));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let b_served: usize = b_clients
        .into_iter()
        .map(|h| h.join().expect("tenant B thread"))
        .sum();
    let preemptions = p.s.metric("vllm:num_preemptions_total");

    assert!(
        wrong.is_empty(),
        "{} of {} outputs differ from the idle server's ({preemptions} preemptions):\n{}",
        wrong.len(),
        ROUNDS * PER_ROUND,
        wrong.join("\n")
    );
    // The load did what the test is about: B was served beside A, and
    // took slots from it.
    assert!(b_served > 0, "tenant B was never served");
    assert!(preemptions > 0.0, "no sequence was preempted");
}
