//! Whether the single-token decode tiles issue software prefetches: chosen
//! by measuring both ways while decoding, since neither is safe to fix.
//!
//! On one and the same VM (AMD EPYC Zen 4, 2 vCPUs; `cargo bench -p
//! pagoda-accel --bench decode`, the 1B model's Q4_0 matrices, 1 thread)
//! the decode tiles' prefetch of every line 4 KiB ahead measured a 3× gain
//! one day (30 GB/s of weights against 9.8 without) and a 2.7× loss the
//! next (10.4 GB/s against 28 without), the host's memory system having
//! changed under the guest; llama.cpp, which issues none, moved far less.
//! The tiles now prefetch only at page starts (`qkern`'s
//! `prefetch_page_start`), which measured better than none on every kind
//! but Q6_K; still, prefetches change no arithmetic (the kernels give the
//! same bits with or without), so the kernel times both on the matrices it
//! is serving and keeps the faster.
//!
//! Each weight kind has its own choice. The schedule, per kind: every
//! [`PERIOD`] timed calls, the first [`TRIAL`] alternate between the two
//! ways in blocks of [`BLOCK`] (so both see the same mix of matrices, and a
//! drifting machine shows in both), then the way with the fewer
//! nanoseconds per weight byte serves the rest of the period. Only
//! single-token calls on matrices of at least [`MIN_BYTES`] are timed:
//! smaller ones sit in cache, where prefetching neither helps nor hurts.
//! Exploring costs at most `TRIAL / 2 / PERIOD` of the calls in the slower
//! way (1.6%).
//!
//! `PAGODA_PREFETCH=on|off|auto` (default `auto`) fixes the choice, for
//! benchmarks; [`set_decode_prefetch`] does the same from code.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::Instant;

/// How the decode tiles choose to prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePrefetch {
    /// Measure both ways while decoding and keep the faster (the default).
    Auto,
    /// Always prefetch.
    On,
    /// Never prefetch.
    Off,
}

/// Timed calls per period.
const PERIOD: u64 = 32768;
/// Timed calls at the start of a period that try both ways: 16 blocks, so
/// that a few milliseconds of noise in one block do not decide (with 8
/// blocks of 32 calls, repeated 1B decode runs came out 30.4 and 35.2 tok/s
/// where `on` measured 33.2 and `off` 26.3 between them).
const TRIAL: u64 = 1024;
/// Consecutive trial calls in one way.
const BLOCK: u64 = 64;
/// Smallest matrix (weight bytes) whose calls are timed.
pub(crate) const MIN_BYTES: usize = 256 << 10;

/// The mode, `u8::MAX` until first read from the environment.
static MODE: AtomicU8 = AtomicU8::new(u8::MAX);
/// One tuner per weight kind (`layout::K_*`): the kinds differ in what
/// prefetching does for them (Q6_K, with its second stream of high bits,
/// measured slower with it where the others were faster).
static TUNERS: [Tuner; KINDS] = [const { Tuner::new() }; KINDS];
const KINDS: usize = 5;

/// Fixes how the decode tiles prefetch for the rest of the process (or
/// until called again), overriding `PAGODA_PREFETCH`.
pub fn set_decode_prefetch(mode: DecodePrefetch) {
    MODE.store(mode as u8, Relaxed);
}

/// The mode in force: [`set_decode_prefetch`]'s, else `PAGODA_PREFETCH`'s.
pub fn decode_prefetch() -> DecodePrefetch {
    let m = match MODE.load(Relaxed) {
        u8::MAX => {
            let m = match std::env::var("PAGODA_PREFETCH").as_deref() {
                Ok("on") => DecodePrefetch::On,
                Ok("off") => DecodePrefetch::Off,
                _ => DecodePrefetch::Auto,
            } as u8;
            MODE.store(m, Relaxed);
            m
        }
        m => m,
    };
    match m {
        1 => DecodePrefetch::On,
        2 => DecodePrefetch::Off,
        _ => DecodePrefetch::Auto,
    }
}

/// One single-token call's way of prefetching, and whether to time it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(crate) prefetch: bool,
    /// `Some((kind, way))` when the call is a trial whose time [`record`]
    /// takes.
    trial: Option<(u8, usize)>,
}

impl Plan {
    /// Untimed, and no tuned prefetching: calls of several tokens, whose
    /// tiles prefetch by a fixed rule instead (`qkern::run_rows`).
    pub(crate) const NONE: Plan = Plan {
        prefetch: false,
        trial: None,
    };

    /// The clock at the start of a trial call (`None` otherwise: only
    /// trials are timed).
    pub(crate) fn start(&self) -> Option<Instant> {
        self.trial.map(|_| Instant::now())
    }
}

/// How a single-token call on a matrix of kind `kind` (`layout::K_*`) and
/// `bytes` weight bytes prefetches.
pub(crate) fn plan(kind: u8, bytes: usize) -> Plan {
    let tuner = &TUNERS[kind as usize];
    match decode_prefetch() {
        DecodePrefetch::On => Plan {
            prefetch: true,
            trial: None,
        },
        DecodePrefetch::Off => Plan {
            prefetch: false,
            trial: None,
        },
        DecodePrefetch::Auto if bytes < MIN_BYTES => Plan {
            prefetch: tuner.on.load(Relaxed),
            trial: None,
        },
        DecodePrefetch::Auto => tuner.plan(kind),
    }
}

/// Takes a trial call's time, from [`Plan::start`].
pub(crate) fn record(plan: Plan, started: Option<Instant>, bytes: usize) {
    if let (Some((kind, way)), Some(t)) = (plan.trial, started) {
        TUNERS[kind as usize].record(way, t.elapsed().as_nanos() as u64, bytes as u64);
    }
}

/// The trial sums and the current choice. Relaxed atomics: calls from
/// several engines may interleave, which only blurs one trial's figures.
struct Tuner {
    calls: AtomicU64,
    on: AtomicBool,
    ns: [AtomicU64; 2],
    bytes: [AtomicU64; 2],
}

impl Tuner {
    const fn new() -> Tuner {
        Tuner {
            calls: AtomicU64::new(0),
            on: AtomicBool::new(true),
            ns: [AtomicU64::new(0), AtomicU64::new(0)],
            bytes: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    fn plan(&self, kind: u8) -> Plan {
        let c = self.calls.fetch_add(1, Relaxed) % PERIOD;
        if c < TRIAL {
            // Way 0 prefetches, way 1 does not.
            let way = ((c / BLOCK) % 2) as usize;
            return Plan {
                prefetch: way == 0,
                trial: Some((kind, way)),
            };
        }
        if c == TRIAL {
            self.decide();
        }
        Plan {
            prefetch: self.on.load(Relaxed),
            trial: None,
        }
    }

    fn record(&self, way: usize, ns: u64, bytes: u64) {
        self.ns[way].fetch_add(ns, Relaxed);
        self.bytes[way].fetch_add(bytes, Relaxed);
    }

    /// Keeps the way with fewer nanoseconds per byte and clears the sums.
    fn decide(&self) {
        let take = |w: usize| {
            (
                self.ns[w].swap(0, Relaxed) as f64,
                self.bytes[w].swap(0, Relaxed) as f64,
            )
        };
        let ((ns_on, b_on), (ns_off, b_off)) = (take(0), take(1));
        if b_on > 0.0 && b_off > 0.0 {
            self.on.store(ns_on / b_on <= ns_off / b_off, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trial_alternates_blocks_then_keeps_the_faster_way() {
        let t = Tuner::new();
        let mut ways = Vec::new();
        for _ in 0..TRIAL {
            let p = t.plan(0);
            let (_, way) = p.trial.expect("the period opens with a trial");
            assert_eq!(p.prefetch, way == 0);
            ways.push(way);
            // Prefetching is three times slower per byte here.
            t.record(way, if way == 0 { 300 } else { 100 }, 100);
        }
        assert_eq!(ways.iter().filter(|&&w| w == 0).count() as u64, TRIAL / 2);
        assert_eq!(&ways[..BLOCK as usize + 1], {
            let mut v = vec![0; BLOCK as usize];
            v.push(1);
            v
        });
        let p = t.plan(0);
        assert!(p.trial.is_none() && !p.prefetch, "the faster way is kept");
        for _ in TRIAL + 1..PERIOD {
            assert!(!t.plan(0).prefetch);
        }
        // The next period tries again; now prefetching wins.
        for _ in 0..TRIAL {
            let p = t.plan(0);
            let (_, way) = p.trial.expect("a new period opens with a trial");
            t.record(way, if way == 0 { 100 } else { 300 }, 100);
        }
        assert!(t.plan(0).prefetch);
    }
}
