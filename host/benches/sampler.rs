//! Sampling's cost per step: 64 rows over a 151,936-token vocabulary
//! (Qwen2's), each with temperature 0.8, top-p 0.9 (top-k off), repetition
//! penalty 1.1, presence 0.5, frequency 0.3 and 200 tokens of history (100
//! of prompt, 100 of output). The per-row host path is what the runner did
//! before issue 46: `Sampler::sample` row after row on the engine thread.
//! The batched path is what it does now on the CPU: gather every row's
//! metadata (`RequestState::push_sampling`), then one `ops::sample_rows`
//! over the pool, on 1 and on 2 threads. Both paths run on the same logits
//! with the same seeds, and the bench checks they choose the same ids.
//!
//! Two fixtures, random with a fixed seed: "peaked", where 32 tokens per
//! row stand well above the rest (a trained model's usual shape: the
//! nucleus is a few dozen tokens), and "flat", plain Gaussian logits (the
//! nucleus spans most of the vocabulary: the worst case for top-p). A
//! greedy step is timed too.
//!
//! `cargo bench -p pagoda --bench sampler`

use pagoda::engine::runner::input_batch::RequestState;
use pagoda::engine::sampler::Sampler;
use pagoda::engine::spec_decode::SpecState;
use pagoda::engine::SamplingParams;
use pagoda_accel::ops::sample::{sample_rows, SampleScratch, SampledRows, SamplingMetadata};
use pagoda_accel::ThreadPool;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::Instant;

const VOCAB: usize = 151_936;
const ROWS: usize = 64;
const STEPS: usize = 12;

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// `ROWS` rows of logits of the given shape.
fn fixture(peaked: bool, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut l: Vec<f32> = Vec::with_capacity(ROWS * VOCAB);
    for _ in 0..ROWS {
        let row = l.len();
        let sigma = if peaked { 1.5 } else { 1.0 };
        l.extend((0..VOCAB).map(|_| sigma * normal(&mut rng)));
        if peaked {
            for _ in 0..32 {
                let t = rng.random_range(0..VOCAB);
                l[row + t] += rng.random_range(8.0f32..14.0);
            }
        }
    }
    l
}

/// One request per row, seeded by its row, with 200 tokens of history.
fn requests(params: &SamplingParams) -> Vec<RequestState> {
    (0..ROWS as u64)
        .map(|i| {
            let mut rng = StdRng::seed_from_u64(1000 + i);
            let prompt: Vec<u32> = (0..100)
                .map(|_| rng.random_range(0..VOCAB as u32))
                .collect();
            let mut r = RequestState {
                id: i,
                prompt_len: prompt.len(),
                token_ids: prompt,
                max_len: usize::MAX,
                params: params.clone(),
                eos_ids: vec![151_643],
                rng: StdRng::seed_from_u64(i),
                output_counts: HashMap::new(),
                prompt_kernel: false,
                structured: false,
                block_table: Vec::new(),
                spec: SpecState::default(),
                lora: None,
                pooling: false,
            };
            for _ in 0..100 {
                // Repeats, as real outputs have.
                r.append(rng.random_range(0..2_000));
            }
            r
        })
        .collect()
}

/// Median and minimum of `times`, in ms.
fn summary(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2] * 1e3, times[0] * 1e3)
}

/// Times `STEPS` steps of the per-row path and of the batched one on
/// `threads`, from the same logits and seeds; returns (per-row,
/// batched per thread count) as (median, min) ms, after checking that
/// both choose the same ids.
fn run(
    name: &str,
    logits: &[f32],
    params: &SamplingParams,
    threads: &[usize],
) -> Vec<(String, (f64, f64))> {
    let mut out = Vec::new();
    let mut work = logits.to_vec();
    let mut host_rows = requests(params);
    let mut sampler = Sampler::default();
    let mut host_ids = Vec::new();
    let mut times = Vec::new();
    for _ in 0..STEPS {
        work.copy_from_slice(logits);
        let t0 = Instant::now();
        let mut ids = Vec::with_capacity(ROWS);
        for (i, r) in host_rows.iter_mut().enumerate() {
            let (mut req, _) = r.split();
            ids.push(
                sampler
                    .sample(&mut work[i * VOCAB..(i + 1) * VOCAB], &mut req, None)
                    .token,
            );
        }
        times.push(t0.elapsed().as_secs_f64());
        host_ids.push(ids);
    }
    out.push((
        format!("{name}: per-row Sampler::sample, 1 thread"),
        summary(times),
    ));
    for &n in threads {
        let pool = ThreadPool::new(n);
        let mut rows = requests(params);
        let (mut meta, mut scratch, mut sampled) = (
            SamplingMetadata::default(),
            SampleScratch::default(),
            SampledRows::default(),
        );
        let mut times = Vec::new();
        for ids in &host_ids {
            work.copy_from_slice(logits);
            let t0 = Instant::now();
            meta.clear(VOCAB);
            for (i, r) in rows.iter_mut().enumerate() {
                r.push_sampling(&mut meta, i, None);
            }
            sample_rows(&pool, &mut work, VOCAB, &meta, &mut scratch, &mut sampled);
            times.push(t0.elapsed().as_secs_f64());
            assert_eq!(&sampled.tokens, ids, "{name}: the paths chose differently");
        }
        out.push((
            format!(
                "{name}: batched ops::sample, {n} thread{}",
                if n > 1 { "s" } else { "" }
            ),
            summary(times),
        ));
    }
    out
}

fn main() {
    let top_p = SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.9),
        top_k: Some(0),
        repetition_penalty: Some(1.1),
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        ..SamplingParams::default()
    };
    let greedy = SamplingParams {
        temperature: Some(0.0),
        ..top_p.clone()
    };
    let peaked = fixture(true, 7);
    let flat = fixture(false, 8);
    let mut lines = Vec::new();
    lines.extend(run("peaked, top-p", &peaked, &top_p, &[1, 2]));
    lines.extend(run("flat, top-p", &flat, &top_p, &[1, 2]));
    lines.extend(run("peaked, greedy", &peaked, &greedy, &[1, 2]));
    println!(
        "{ROWS} rows x {VOCAB} vocab, {STEPS} steps each, {:?} kernels; ms per step",
        pagoda_accel::cpu::simd_level()
    );
    println!("{:<58} {:>9} {:>9}", "path", "median", "min");
    for (name, (med, min)) in lines {
        println!("{name:<58} {med:>9.2} {min:>9.2}");
    }
}
