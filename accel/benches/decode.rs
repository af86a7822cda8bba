//! Single-token decode through a 1B-shaped model's matrices: how fast the
//! quantized matmul kernels stream weights when nothing else runs.
//!
//! `cargo bench -p pagoda-accel --bench decode [TYPE...]` (types by name,
//! e.g. `Q4_0 Q6_K`; default Q4_0 Q4_1 Q8_0 Q4_K Q6_K; MXFP4 when named). Llama-3.2-1B's
//! shapes: 16 layers of fused QKV (3072 × 2048), O (2048 × 2048), gate-up
//! (16384 × 2048) and down (2048 × 8192), plus the 49152-row head, all
//! distinct matrices, so every step streams them from DRAM as real decode
//! does. Per type and thread count: ms per step, tok/s, GB/s of weights.
//! `DECODE_M=8` decodes 8 tokens per step, as 8 concurrent streams do.
//! `PAGODA_SIMD` picks the kernel level as in the server. Compare the GB/s
//! with `pagoda bench bandwidth` on the same machine.
//!
//! `DECODE_MODEL=smollm2` takes the demo model's shapes instead
//! (SmolLM2-135M: 30 layers of 960 × 576, 576 × 576, 3072 × 576 and
//! 576 × 1536, and its tied 49152 × 576 head in Q8_0, as the GGUF stores
//! it), whose 576-column rows stress the kernels' per-row work more than
//! the bytes. Each line also gives the head's share of the step.
//!
//! `DECODE_MODEL=moe` takes bench/moe.sh's Mixtral-shaped model: 8 layers
//! of fused QKV (1536 × 1024) and O (1024 × 1024), 16 experts of fused
//! gate-up (1024 × 1024) and down (1024 × 512) of which each step runs two
//! drawn at random per layer (as routed decode does, so the experts stream
//! from DRAM), and a 320-row head; GB/s counts the bytes a step reads.
//!
//! `DECODE_SHAPES=1` also gives each matrix shape's mean GB/s over all its
//! calls (timed one by one), which shows the shapes that stream slower than
//! the step as a whole (the 8192-column down projection, for one).

use pagoda_accel::{GgmlType, MatmulScratch, ThreadPool, Weight};
use std::time::{Duration, Instant};

/// A cheap deterministic generator (benchmarks need no statistical quality).
struct Lcg(u64);
impl Lcg {
    fn next_u8(&mut self) -> u8 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 56) as u8
    }
}

/// Random blocks of `ty` with small, finite scales (the kernels' speed
/// does not depend on the values, but NaNs would hide wrong arithmetic).
fn weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Lcg) -> Weight {
    let bb = ty.block_bytes();
    let mut bytes: Vec<u8> = (0..rows * cols / ty.block_len() * bb)
        .map(|_| rng.next_u8())
        .collect();
    let d = half::f16::from_f32(0.001).to_bits().to_le_bytes();
    // Where each type keeps its f16 scales (and mins) in a block.
    let at: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for blk in bytes.chunks_exact_mut(bb) {
        for &o in at {
            blk[o..o + 2].copy_from_slice(&d);
        }
        if ty == GgmlType::MXFP4 {
            // An E8M0 scale of 2^0 (random bytes reach 2^127).
            blk[0] = 127;
        }
    }
    Weight::from_raw(ty, rows, cols, &bytes).expect("benchmark shapes are valid")
}

fn main() {
    let names: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let default = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    // MXFP4 (gpt-oss's experts) only when named.
    let types: Vec<GgmlType> = if names.is_empty() {
        default.to_vec()
    } else {
        default
            .into_iter()
            .chain([GgmlType::MXFP4])
            .filter(|t| names.iter().any(|n| n == t.name()))
            .collect()
    };
    // Tokens per step: 1 for single-stream decode, more for concurrent
    // streams decoding together (`DECODE_M=8`).
    let m: usize = std::env::var("DECODE_M")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    println!(
        "simd level: {:?}, {m} token(s) per step",
        pagoda_accel::cpu::simd_level()
    );
    println!(
        "{:<5} {:>8} {:>3} {:>9} {:>7} {:>7} {:>8} {:>8} {:>9} {:>7}",
        "type",
        "MB",
        "thr",
        "ms/step",
        "tok/s",
        "GB/s",
        "head ms",
        "head GB/s",
        "median ms",
        "med GB/s"
    );
    let model = std::env::var("DECODE_MODEL").unwrap_or_default();
    let smollm2 = model == "smollm2";
    // Experts per layer and experts a token runs (1 and 1: a dense FFN).
    let (experts, top_k) = if model == "moe" { (16, 2) } else { (1, 1) };
    let (hidden, ffn, qkv, vocab, layers) = match model.as_str() {
        "smollm2" => (576, 1536, 960, 49152, 30),
        "moe" => (1024, 512, 1536, 320, 8),
        _ => (2048, 8192, 3072, 49152, 16),
    };
    let shapes = std::env::var("DECODE_SHAPES").is_ok_and(|v| v == "1");
    let mut rng = Lcg(47);
    for ty in types {
        // Per layer: QKV, O, then each expert's gate-up and down.
        let per_layer = 2 + 2 * experts;
        let mut ws = Vec::new();
        for _ in 0..layers {
            ws.push(weight(ty, qkv, hidden, &mut rng));
            ws.push(weight(ty, hidden, hidden, &mut rng));
            for _ in 0..experts {
                ws.push(weight(ty, 2 * ffn, hidden, &mut rng));
                ws.push(weight(ty, hidden, ffn, &mut rng));
            }
        }
        let head_ty = if smollm2 { GgmlType::Q8_0 } else { ty };
        ws.push(weight(head_ty, vocab, hidden, &mut rng));
        let head_bytes = ws.last().map_or(0, Weight::size_bytes);
        // The matrices one step multiplies: every layer's attention and
        // `top_k` distinct experts, drawn anew each step.
        let pick = |rng: &mut Lcg| -> Vec<usize> {
            let mut ix = Vec::new();
            for l in 0..layers {
                let base = l * per_layer;
                ix.extend([base, base + 1]);
                let mut chosen: Vec<usize> = Vec::new();
                while chosen.len() < top_k {
                    let e = rng.next_u8() as usize % experts;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                for e in chosen {
                    ix.extend([base + 2 + 2 * e, base + 3 + 2 * e]);
                }
            }
            ix
        };
        let bytes: usize = pick(&mut rng)
            .iter()
            .map(|&i| ws[i].size_bytes())
            .sum::<usize>()
            + head_bytes;
        let x: Vec<f32> = (0..m * ffn.max(hidden))
            .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
            .collect();
        let mut out = vec![0.0f32; m * vocab.max(qkv).max(2 * ffn).max(hidden)];
        let mut scratch = MatmulScratch::default();
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            // One step; returns the seconds its last matrix (the head) took.
            // Per matrix position in a layer (`DECODE_SHAPES=1`): the
            // seconds and bytes of every call, to see which shapes stream
            // slower than the step as a whole.
            let mut by_shape = vec![(0.0f64, 0usize); per_layer];
            let mut step = || {
                let (head, layers) = ws.split_last().expect("the head is pushed last");
                for i in pick(&mut rng) {
                    let w = &layers[i];
                    let s = shapes.then(Instant::now);
                    w.matmul(
                        &pool,
                        &x[..m * w.cols()],
                        m,
                        &mut out[..m * w.rows()],
                        &mut scratch,
                    );
                    if let Some(s) = s {
                        let e = &mut by_shape[i % per_layer];
                        e.0 += s.elapsed().as_secs_f64();
                        e.1 += w.size_bytes();
                    }
                }
                let s = Instant::now();
                let (k, n) = (m * head.cols(), m * head.rows());
                head.matmul(&pool, &x[..k], m, &mut out[..n], &mut scratch);
                s.elapsed().as_secs_f64()
            };
            step();
            // The step's best and median times, and the head's time within
            // the best step (timed in place, so it streams from DRAM after
            // the layers as in real decode). On a shared VM the best is one
            // lucky step; the median is the figure to compare.
            let (mut best, mut best_head) = (f64::INFINITY, 0.0);
            let mut times = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(3) {
                let s = Instant::now();
                let head = step();
                let t = s.elapsed().as_secs_f64();
                times.push(t);
                if t < best {
                    (best, best_head) = (t, head);
                }
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            println!(
                "{:<5} {:>8.1} {:>3} {:>9.2} {:>7.1} {:>7.2} {:>8.2} {:>8.2} {:>9.2} {:>7.2}",
                ty.name(),
                bytes as f64 / 1e6,
                threads,
                best * 1e3,
                m as f64 / best,
                bytes as f64 / best / 1e9,
                best_head * 1e3,
                head_bytes as f64 / best_head / 1e9,
                median * 1e3,
                bytes as f64 / median / 1e9
            );
            if shapes {
                for (k, &(t, b)) in by_shape.iter().enumerate().filter(|(_, e)| e.1 > 0) {
                    let w = &ws[k];
                    println!(
                        "      {:>5} x {:<5} {:>7.2} GB/s (all calls, mean)",
                        w.rows(),
                        w.cols(),
                        b as f64 / t / 1e9
                    );
                }
            }
        }
    }
}
