//! `pagoda bench bandwidth`: the machine's read bandwidth per thread count,
//! the ceiling that single-stream decode works against (issue 47).
//!
//! Decoding one token reads every weight once, so a memory-bound decoder
//! runs at best at `bandwidth / weight bytes` tokens per second. This probe
//! measures that bandwidth the way STREAM does, but read-only: it allocates
//! a buffer far larger than the last-level cache (1 GiB by default), writes
//! it once so every page is mapped, then times a sum over all of it. With
//! `n` threads the buffer is cut into `n` contiguous parts, one per thread,
//! and the round's time is from the moment all threads are released to the
//! moment the last one is done: the figure is the buffer's bytes over that
//! time, in GB/s (10⁹ bytes per second, as STREAM and llama.cpp report).
//!
//! The sum adds the buffer's 64-bit words (wrapping) into several
//! independent accumulators, so neither the adds' latency nor a single
//! dependency chain caps the loads; it uses AVX-512 or AVX2 loads where the
//! CPU has them (`PAGODA_SIMD=avx2|scalar` lowers the choice, as for the
//! kernels), else plain Rust. The result goes through
//! [`std::hint::black_box`] so the compiler cannot drop the reads.
//!
//! Threads are plain scoped `std::thread`s, not the engine's pool, so the
//! figure belongs to the machine rather than to Pagoda's scheduling.

use super::stats;
use serde::Serialize;
use std::sync::Barrier;
use std::time::Instant;

/// The loads the sum uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Loads {
    Scalar,
    Avx2,
    Avx512,
}

impl Loads {
    /// The widest loads this CPU runs, lowered by `PAGODA_SIMD` like the
    /// kernels' level ([`pagoda_accel::cpu::simd_level`]).
    pub fn detect() -> Loads {
        #[cfg(target_arch = "x86_64")]
        {
            use pagoda_accel::cpu::{simd_level, SimdLevel};
            let level = simd_level();
            if level.has_avx512() && std::arch::is_x86_feature_detected!("avx512f") {
                return Loads::Avx512;
            }
            if level >= SimdLevel::Avx2 && std::arch::is_x86_feature_detected!("avx2") {
                return Loads::Avx2;
            }
        }
        Loads::Scalar
    }
}

/// Wrapping sum of `words` with `loads`; every variant returns the same
/// value. `loads` must be one this CPU runs ([`Loads::detect`] or lower).
pub fn sum(words: &[u64], loads: Loads) -> u64 {
    match loads {
        #[cfg(target_arch = "x86_64")]
        Loads::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => unsafe {
            sum_avx512(words)
        },
        #[cfg(target_arch = "x86_64")]
        Loads::Avx2 if std::arch::is_x86_feature_detected!("avx2") => unsafe { sum_avx2(words) },
        _ => sum_scalar(words),
    }
}

/// Eight independent accumulators; the compiler may vectorize it.
fn sum_scalar(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*w);
        }
    }
    let head = acc.iter().fold(0u64, |s, a| s.wrapping_add(*a));
    tail.iter().fold(head, |s, w| s.wrapping_add(*w))
}

/// Eight 512-bit accumulators: 512 bytes per iteration.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    const STEP: usize = 8 * LANES;
    let n = words.len() / STEP * STEP;
    let p = words.as_ptr();
    let mut acc = [_mm512_setzero_si512(); 8];
    let mut i = 0;
    while i < n {
        for (k, a) in acc.iter_mut().enumerate() {
            let v = _mm512_loadu_si512(p.add(i + k * LANES) as *const _);
            *a = _mm512_add_epi64(*a, v);
        }
        i += STEP;
    }
    let mut total = 0u64;
    for a in acc {
        total = total.wrapping_add(_mm512_reduce_add_epi64(a) as u64);
    }
    total.wrapping_add(sum_scalar(&words[n..]))
}

/// Eight 256-bit accumulators: 256 bytes per iteration.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    const LANES: usize = 4;
    const STEP: usize = 8 * LANES;
    let n = words.len() / STEP * STEP;
    let p = words.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 8];
    let mut i = 0;
    while i < n {
        for (k, a) in acc.iter_mut().enumerate() {
            let v = _mm256_loadu_si256(p.add(i + k * LANES) as *const __m256i);
            *a = _mm256_add_epi64(*a, v);
        }
        i += STEP;
    }
    let mut total = 0u64;
    for a in acc {
        let mut lanes = [0u64; LANES];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, a);
        total = lanes.iter().fold(total, |s, l| s.wrapping_add(*l));
    }
    total.wrapping_add(sum_scalar(&words[n..]))
}

/// One thread count's figures.
#[derive(Clone, Debug, Serialize)]
pub struct ThreadResult {
    pub threads: usize,
    /// The fastest round, GB/s.
    pub best_gbps: f64,
    /// The median round, GB/s.
    pub median_gbps: f64,
    /// Every round, GB/s, in the order run.
    pub rounds_gbps: Vec<f64>,
}

/// The probe's report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub bytes: usize,
    pub rounds: usize,
    pub loads: Loads,
    pub results: Vec<ThreadResult>,
}

/// Measures read bandwidth over a `bytes`-byte buffer for each of
/// `threads`, `rounds` times each.
pub fn run(bytes: usize, threads: &[usize], rounds: usize) -> anyhow::Result<Report> {
    anyhow::ensure!(rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        threads.iter().all(|&t| t > 0),
        "thread counts must be positive"
    );
    let loads = Loads::detect();
    // Some extra words so the measured part can start on a cache line.
    let total = bytes / 8;
    anyhow::ensure!(total >= 1024, "--bytes must be at least 8 KiB");
    let mut buf: Vec<u64> = Vec::with_capacity(total + 8);
    // Writing every word maps every page before the clock starts.
    buf.extend((0..total as u64 + 8).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    let skip = buf.as_ptr().align_offset(64).min(8);
    let words = &buf[skip..skip + total];
    let expected = sum_scalar(words);
    let mut results = Vec::new();
    for &n in threads {
        let secs = time_rounds(words, n, rounds, loads, expected)?;
        let gbps: Vec<f64> = secs.iter().map(|s| (total * 8) as f64 / s / 1e9).collect();
        results.push(ThreadResult {
            threads: n,
            best_gbps: gbps.iter().copied().fold(0.0, f64::max),
            median_gbps: stats::summarize(&gbps).median,
            rounds_gbps: gbps,
        });
    }
    Ok(Report {
        bytes: total * 8,
        rounds,
        loads,
        results,
    })
}

/// Seconds per round of `n` threads each summing its own contiguous part;
/// checks the parts add up to `expected`.
fn time_rounds(
    words: &[u64],
    n: usize,
    rounds: usize,
    loads: Loads,
    expected: u64,
) -> anyhow::Result<Vec<f64>> {
    // Parts of whole cache lines (8 words), the last one taking the rest.
    let per = words.len() / n / 8 * 8;
    let parts: Vec<&[u64]> = (0..n)
        .map(|i| {
            let end = if i + 1 == n {
                words.len()
            } else {
                (i + 1) * per
            };
            &words[i * per..end]
        })
        .collect();
    // The workers and this thread meet at the barrier before and after
    // every round; this thread only keeps the time.
    let barrier = Barrier::new(n + 1);
    let mut secs = Vec::with_capacity(rounds);
    let sums: Vec<u64> = std::thread::scope(|s| -> anyhow::Result<Vec<u64>> {
        let workers: Vec<_> = parts
            .iter()
            .map(|part| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut last = 0;
                    for _ in 0..rounds {
                        barrier.wait();
                        last = std::hint::black_box(sum(std::hint::black_box(part), loads));
                        barrier.wait();
                    }
                    last
                })
            })
            .collect();
        for _ in 0..rounds {
            barrier.wait();
            let t0 = Instant::now();
            barrier.wait();
            secs.push(t0.elapsed().as_secs_f64());
        }
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| anyhow::anyhow!("bandwidth probe: a reading thread panicked"))
            })
            .collect()
    })?;
    let got = sums.iter().fold(0u64, |a, s| a.wrapping_add(*s));
    anyhow::ensure!(
        got == expected,
        "bandwidth probe: the threads' sums ({got:#x}) differ from the buffer's ({expected:#x})"
    );
    Ok(secs)
}

/// The report as a markdown table.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "read bandwidth: {:.2} GiB buffer, {:?} loads, best and median of {} rounds\n\n",
        r.bytes as f64 / (1u64 << 30) as f64,
        r.loads,
        r.rounds
    );
    s.push_str("| threads | best GB/s | median GB/s |\n|---:|---:|---:|\n");
    for t in &r.results {
        s.push_str(&format!(
            "| {} | {:.2} | {:.2} |\n",
            t.threads, t.best_gbps, t.median_gbps
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sum_matches_the_plain_one() {
        // Lengths around the vector steps, so the tails are exercised.
        for len in [0usize, 1, 7, 31, 32, 63, 64, 65, 1000, 4099] {
            let words: Vec<u64> = (0..len as u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::MAX)
                .collect();
            let want = words.iter().fold(0u64, |a, w| a.wrapping_add(*w));
            for loads in [Loads::Scalar, Loads::Avx2, Loads::Avx512] {
                // `sum` falls back to plain Rust where the CPU lacks them.
                assert_eq!(sum(&words, loads), want, "{loads:?}, {len} words");
            }
        }
    }

    #[test]
    fn threads_split_and_sum_the_whole_buffer() {
        let r = run(1 << 20, &[1, 3], 2).unwrap();
        assert_eq!(r.results.len(), 2);
        assert!(r.results.iter().all(|t| t.best_gbps > 0.0
            && t.median_gbps <= t.best_gbps
            && t.rounds_gbps.len() == 2));
    }
}
