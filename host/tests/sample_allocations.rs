//! Sampling a warm step on the device path makes no heap allocation: the
//! runner's metadata gathering ([`RequestState::push_sampling`]) and the
//! CPU backend's [`Backend::sample`] reuse their buffers, for greedy rows
//! and for rows with every processor and truncation on. A counting global
//! allocator enforces it.

mod counting_alloc;

use pagoda::engine::runner::input_batch::RequestState;
use pagoda::engine::spec_decode::SpecState;
use pagoda::engine::SamplingParams;
use pagoda_accel::cpu::SimdLevel;
use pagoda_accel::ops::sample::{SampledRows, SamplingMetadata};
use pagoda_accel::{Backend, CpuBackend, Device};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

fn request(id: u64, params: SamplingParams, prompt: Vec<u32>) -> RequestState {
    RequestState {
        id,
        prompt_len: prompt.len(),
        token_ids: prompt,
        max_len: usize::MAX,
        params,
        eos_ids: vec![2],
        rng: StdRng::seed_from_u64(id),
        output_counts: HashMap::new(),
        prompt_kernel: false,
        structured: false,
        block_table: Vec::new(),
        spec: SpecState::default(),
        lora: None,
        pooling: false,
    }
}

/// Runs 8 sampling steps over `rows` (appending what they sample when
/// `grow`) and checks that steps after the second allocate nothing.
fn warm_steps_allocate_nothing(rows: &mut [RequestState], grow: bool) {
    // The allocation counter is global to the process: one test at a time,
    // or another test's allocations count against this one's steps.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _only = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let vocab = 49_152;
    let ctx = Device::Cpu.open(2).expect("a CPU context");
    let mut b = CpuBackend::new(ctx, SimdLevel::Scalar);
    let mut rng = StdRng::seed_from_u64(1);
    let mut logits: Vec<f32> = Vec::new();
    let (mut meta, mut out) = (SamplingMetadata::default(), SampledRows::default());
    for step in 0..8 {
        logits.clear();
        logits.extend((0..rows.len() * vocab).map(|_| rng.random_range(-6.0f32..6.0)));
        // The first steps size the buffers; later ones must not allocate.
        counting_alloc::arm(step >= 2);
        meta.clear(vocab);
        for (i, r) in rows.iter_mut().enumerate() {
            r.push_sampling(&mut meta, i, None);
        }
        b.sample(&mut logits, vocab, &meta, &mut out)
            .expect("sampling");
        let allocated = counting_alloc::disarm();
        if step >= 2 {
            assert_eq!(allocated, 0, "sampling step {step} allocated");
        }
        for (r, &t) in rows.iter_mut().zip(&out.tokens) {
            assert!(t != pagoda_accel::ops::sample::NO_TOKEN);
            if r.params.allowed_token_ids.is_some() {
                assert_eq!(t % 3, 0, "{t} is not allowed");
            }
            if grow {
                r.append(t);
            }
        }
    }
}

fn prompt(i: u64) -> Vec<u32> {
    (0..40).map(|t| t * 31 + i as u32).collect()
}

#[test]
fn warm_greedy_steps_allocate_nothing() {
    // As the requests grow: greedy rows gather nothing that grows with
    // them.
    let mut rows: Vec<RequestState> = (0..6)
        .map(|i| request(i, SamplingParams::greedy(64), prompt(i)))
        .collect();
    warm_steps_allocate_nothing(&mut rows, true);
}

#[test]
fn warm_steps_with_every_processor_allocate_nothing() {
    // The lists of a request with penalties grow with its output, as its
    // own token vectors do (amortized); a step of the same shape reuses
    // everything.
    let every = SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.9),
        top_k: Some(50),
        min_p: Some(0.01),
        repetition_penalty: Some(1.1),
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        logit_bias: vec![(13, 2.0)],
        allowed_token_ids: Some((0..49_152).step_by(3).collect()),
        bad_words_token_ids: vec![vec![7], vec![100, 101]],
        min_tokens: 20,
        ..SamplingParams::default()
    };
    let mut rows: Vec<RequestState> = (0..6)
        .map(|i| {
            let p = if i % 2 == 0 {
                SamplingParams::greedy(64)
            } else {
                every.clone()
            };
            let mut r = request(i, p, prompt(i));
            for t in [5, 9, 5, 100] {
                r.append(t);
            }
            r
        })
        .collect();
    warm_steps_allocate_nothing(&mut rows, false);
}
