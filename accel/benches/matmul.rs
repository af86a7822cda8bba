//! Matmul throughput for SmolLM2-135M-like shapes.
//!
//! `cargo bench -p pagoda-accel --bench matmul` (optional filter argument:
//! a substring of the type name, e.g. `Q4_1`). Prints, per type, shape,
//! batch `m` and thread count: microseconds per call (best 20 ms batch), GB/s of weights
//! streamed, GFLOP/s; then a whole-model estimate (30 layers of fused
//! QKV / O / gate-up / down plus the 49152-row head, all distinct matrices
//! so they stream from DRAM as in real decode) as tokens per second.

use pagoda_accel::{GgmlType, MatmulScratch, ThreadPool, Weight};
use std::time::{Duration, Instant};

/// A cheap deterministic generator (benchmarks need no statistical quality).
struct Lcg(u64);
impl Lcg {
    fn next_f32(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Lcg) -> Weight {
    if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
        // No quantizer for K-quants: random blocks with small scales.
        let bb = ty.block_bytes();
        let mut bytes: Vec<u8> = (0..rows * cols / 256 * bb)
            .map(|_| (rng.next_f32().to_bits() >> 3) as u8)
            .collect();
        let d = half::f16::from_f32(0.001).to_bits().to_le_bytes();
        for blk in bytes.chunks_exact_mut(bb) {
            let at = if ty == GgmlType::Q4_K { 0 } else { 208 };
            blk[at..at + 2].copy_from_slice(&d);
            if ty == GgmlType::Q4_K {
                blk[2..4].copy_from_slice(&d);
            }
        }
        return Weight::from_raw(ty, rows, cols, &bytes).expect("benchmark shapes are valid");
    }
    let data: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.05).collect();
    Weight::quantize(ty, rows, cols, &data).expect("benchmark shapes are valid")
}

/// Nanoseconds this thread has spent on a CPU (Linux schedstat), if known.
/// On a busy machine this is a steadier measure than wall time for
/// single-threaded runs, since it excludes time the thread was descheduled.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Seconds per call of `f`, run for about `budget` in batches of ~20 ms:
/// the best batch's wall time (other processes on a shared machine only ever
/// slow a batch down), and the mean on-CPU time of the calling thread.
fn time(budget: Duration, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let start = Instant::now();
    let cpu0 = thread_cpu_ns();
    let (mut n, mut best) = (0u32, f64::INFINITY);
    while start.elapsed() < budget || n < 3 {
        let b0 = Instant::now();
        let mut k = 0u32;
        while b0.elapsed() < Duration::from_millis(20) || k == 0 {
            f();
            k += 1;
        }
        best = best.min(b0.elapsed().as_secs_f64() / k as f64);
        n += k;
    }
    let cpu = match (cpu0, thread_cpu_ns()) {
        (Some(a), Some(b)) => (b - a) as f64 * 1e-9 / n as f64,
        _ => best,
    };
    (best, cpu)
}

fn main() {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let types = [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::BF16,
        GgmlType::F16,
        GgmlType::F32,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    let types: Vec<GgmlType> = types
        .into_iter()
        .filter(|t| filter.as_deref().is_none_or(|f| t.name().contains(f)))
        .collect();
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let mut rng = Lcg(42);
    let budget = Duration::from_millis(300);

    println!("simd level: {:?}", pagoda_accel::cpu::simd_level());
    println!("(cpu-GB/s: from the calling thread's on-CPU time; meaningful for thr = 1 on a busy machine)");
    println!(
        "{:<5} {:>12} {:>3} {:>3} {:>10} {:>8} {:>9} {:>9}",
        "type", "rows x cols", "m", "thr", "us/call", "GB/s", "GFLOP/s", "cpu-GB/s"
    );
    for &ty in &types {
        let mut shapes = vec![(576, 576), (1536, 576), (576, 1536)];
        if ty == GgmlType::Q8_0 {
            shapes.push((49152, 576));
        }
        // K-quant rows are 256-element super-blocks: 576 columns cannot be.
        shapes.retain(|&(_, cols)| cols % ty.block_len() == 0);
        for (rows, cols) in shapes {
            let w = weight(ty, rows, cols, &mut rng);
            for m in [1usize, 16, 64] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.next_f32()).collect();
                let mut out = vec![0.0f32; m * rows];
                let mut scratch = MatmulScratch::default();
                for pool in &pools {
                    let (t, cpu) = time(budget, || w.matmul(pool, &x, m, &mut out, &mut scratch));
                    println!(
                        "{:<5} {:>12} {:>3} {:>3} {:>10.1} {:>8.2} {:>9.1} {:>9.2}",
                        ty.name(),
                        format!("{rows}x{cols}"),
                        m,
                        pool.threads(),
                        t * 1e6,
                        w.size_bytes() as f64 / t / 1e9,
                        2.0 * (m * rows * cols) as f64 / t / 1e9,
                        w.size_bytes() as f64 / cpu / 1e9
                    );
                }
            }
        }
    }

    // Whole-model estimate: SmolLM2-135M (hidden 576, 9 heads + 3 KV heads
    // of 64, FFN 1536, 30 layers, vocabulary 49152, tied embeddings).
    println!("\nSmolLM2-135M-like decode, matmuls only (30 layers + head):");
    println!(
        "{:<5} {:>8} {:>3} {:>3} {:>10} {:>9} {:>8} {:>9}",
        "type", "MB", "m", "thr", "ms/step", "tok/s", "GB/s", "cpu-tok/s"
    );
    for &ty in types.iter().filter(|t| 576 % t.block_len() == 0) {
        let mut layers = Vec::new();
        for _ in 0..30 {
            layers.push([
                weight(ty, 960, 576, &mut rng),
                weight(ty, 576, 576, &mut rng),
                weight(ty, 3072, 576, &mut rng),
                weight(ty, 576, 1536, &mut rng),
            ]);
        }
        let head = weight(ty, 49152, 576, &mut rng);
        let bytes: usize = layers
            .iter()
            .flatten()
            .map(|w| w.size_bytes())
            .sum::<usize>()
            + head.size_bytes();
        for m in [1usize, 16] {
            let x: Vec<f32> = (0..m * 3072).map(|_| rng.next_f32()).collect();
            let mut out = vec![0.0f32; m * 49152];
            let mut scratch = MatmulScratch::default();
            for pool in &pools {
                let (t, cpu) = time(Duration::from_millis(1500), || {
                    for l in &layers {
                        for w in l {
                            w.matmul(
                                pool,
                                &x[..m * w.cols()],
                                m,
                                &mut out[..m * w.rows()],
                                &mut scratch,
                            );
                        }
                    }
                    head.matmul(pool, &x[..m * 576], m, &mut out, &mut scratch);
                });
                println!(
                    "{:<5} {:>8.1} {:>3} {:>3} {:>10.2} {:>9.1} {:>8.2} {:>9.1}",
                    ty.name(),
                    bytes as f64 / 1e6,
                    m,
                    pool.threads(),
                    t * 1e3,
                    m as f64 / t,
                    bytes as f64 / t / 1e9,
                    m as f64 / cpu
                );
            }
        }
    }

    // Prompt-sized batches: every row exact (`matmul`) against every row
    // wide (`matmul_rows`, the bf16 tile kernel where the CPU has one).
    println!("\nPrompt-sized batches, exact against wide rows (2 threads where available):");
    println!(
        "{:<5} {:>12} {:>4} {:>12} {:>12} {:>6}",
        "type", "rows x cols", "m", "exact us", "wide us", "wide?"
    );
    let pool = pools.last().expect("at least one pool");
    for &ty in types.iter().filter(|t| 576 % t.block_len() == 0) {
        for (rows, cols) in [(576usize, 576usize), (1536, 576), (576, 1536)] {
            let w = weight(ty, rows, cols, &mut rng);
            for m in [1usize, 128, 512] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.next_f32()).collect();
                let mut out = vec![0.0f32; m * rows];
                let mut scratch = MatmulScratch::default();
                let flags = vec![true; m];
                let (exact, _) = time(budget, || w.matmul(pool, &x, m, &mut out, &mut scratch));
                let (wide, _) = time(budget, || {
                    w.matmul_rows(pool, &x, m, &mut out, &mut scratch, &flags)
                });
                println!(
                    "{:<5} {:>12} {:>4} {:>12.1} {:>12.1} {:>6}",
                    ty.name(),
                    format!("{rows}x{cols}"),
                    m,
                    exact * 1e6,
                    wide * 1e6,
                    w.has_wide_kernel()
                );
            }
        }
    }
}
