//! One decode token's LoRA deltas on the demo model's shapes (SmolLM2-135M:
//! 30 layers, hidden 576, KV width 192, MLP 1536), rank 16 on all seven
//! projections, every factor distinct so each token streams them from
//! memory as real decode does: ms per token, and GB/s of factors, for f32
//! and bf16 factors on one thread and split across the pool.
//!
//! `cargo bench -p pagoda-accel --bench lora` (`LORA_THREADS=2`,
//! `LORA_RANK=16`).

use pagoda_accel::ops::lora::{lora_add, LoraData, LoraFactors, LoraScratch};
use pagoda_accel::ThreadPool;
use std::time::Instant;

const LAYERS: usize = 30;
/// (in, out) of q, k, v, o, gate, up, down.
const MODULES: [(usize, usize); 7] = [
    (576, 576),
    (576, 192),
    (576, 192),
    (576, 576),
    (576, 1536),
    (576, 1536),
    (1536, 576),
];

enum Store {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Store {
    fn new(n: usize, bf16: bool, seed: u64) -> Store {
        let v = (0..n).map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 - 500.0) * 1e-5);
        if bf16 {
            Store::Bf16(v.map(|x| (x.to_bits() >> 16) as u16).collect())
        } else {
            Store::F32(v.collect())
        }
    }
    fn data(&self) -> LoraData<'_> {
        match self {
            Store::F32(v) => LoraData::F32(v),
            Store::Bf16(v) => LoraData::Bf16(v),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Store::F32(v) => v.len() * 4,
            Store::Bf16(v) => v.len() * 2,
        }
    }
}

fn main() {
    let threads: usize = std::env::var("LORA_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let rank: usize = std::env::var("LORA_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let pool = ThreadPool::new(threads);
    println!("LoRA rank {rank}, {LAYERS} layers x 7 projections, one decode token, {threads} threads in the pool");
    for bf16 in [false, true] {
        let factors: Vec<(Store, Store, usize, usize)> = (0..LAYERS)
            .flat_map(|l| MODULES.iter().enumerate().map(move |(m, &d)| (l, m, d)))
            .map(|(l, m, (i, o))| {
                let seed = (l * 7 + m) as u64;
                (
                    Store::new(rank * i, bf16, seed),
                    Store::new(rank * o, bf16, seed + 99),
                    i,
                    o,
                )
            })
            .collect();
        let bytes: usize = factors.iter().map(|f| f.0.bytes() + f.1.bytes()).sum();
        let x = vec![0.01f32; 1536];
        let mut out = vec![0f32; 1536];
        let mut scratch = LoraScratch::default();
        for split in [false, true] {
            let mut run = || {
                for (a, b, i, o) in &factors {
                    let f = LoraFactors {
                        a: a.data(),
                        b: b.data(),
                        rank,
                        scale: 2.0,
                    };
                    lora_add(
                        &x[..*i],
                        *i,
                        &[0],
                        |_| Some(f),
                        &mut out[..*o],
                        *o,
                        0,
                        *o,
                        &mut scratch,
                        split.then_some(&pool),
                    );
                }
            };
            for _ in 0..20 {
                run();
            }
            let mut times = Vec::new();
            for _ in 0..15 {
                let t = Instant::now();
                for _ in 0..10 {
                    run();
                }
                times.push(t.elapsed().as_secs_f64() / 10.0);
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let med = times[times.len() / 2];
            println!(
                "{:>4} factors ({:5.1} MB), {:<14}: {:6.3} ms/token, {:5.1} GB/s",
                if bf16 { "bf16" } else { "f32" },
                bytes as f64 / 1e6,
                if split { "split on pool" } else { "one thread" },
                med * 1e3,
                bytes as f64 / med / 1e9
            );
        }
    }
}
