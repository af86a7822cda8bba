//! The CPU backend: a parking thread pool, the context that holds it, and
//! instruction-set detection.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod pool;

use pool::ThreadPool;

/// The best SIMD level this CPU supports, detected once at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Plain Rust; what every kernel's fallback and reference path uses.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL with VNNI (Zen 4, Ice Lake and later).
    Avx512Vnni,
    /// [`SimdLevel::Avx512Vnni`] plus the AMX-INT8 tile unit (Sapphire Rapids
    /// and later), which batched quantized matmuls use; every other kernel
    /// runs its AVX-512 path at this level.
    Amx,
    /// [`SimdLevel::Amx`] plus AMX-BF16 and AVX512-BF16: Q4_0, Q4_1 and
    /// Q8_0 weights are laid out for the bf16 tile kernel, which serves
    /// every batch size (`quant::bf16_tiles`).
    AmxBf16,
}

impl SimdLevel {
    /// Whether the AVX-512 kernels run at this level.
    pub fn has_avx512(self) -> bool {
        self >= SimdLevel::Avx512Vnni
    }
}

/// Returns the SIMD level kernels dispatch on: the best the CPU has, up to
/// [`SimdLevel::Amx`] (above that, see [`weight_level`]).
/// `PAGODA_SIMD=scalar|avx2|avx512|amx` lowers it, so tests and benchmarks
/// can exercise every path on one CPU; `PAGODA_SIMD=amx-bf16` raises it to
/// [`SimdLevel::AmxBf16`] where the CPU has it.
pub fn simd_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected_level();
        match std::env::var("PAGODA_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2") => detected.min(SimdLevel::Avx2),
            Ok("avx512") => detected.min(SimdLevel::Avx512Vnni),
            Ok("amx") => detected.min(SimdLevel::Amx),
            Ok("amx-bf16") => detected,
            // The bf16 tile layout is chosen per engine, by
            // [`weight_level`]; plain weights keep the int8 kernels.
            _ => detected.min(SimdLevel::Amx),
        }
    })
}

/// The level to lay out a model's quantized weights for, in an engine that
/// runs at most `max_seqs` sequences per step: [`SimdLevel::AmxBf16`]
/// where the CPU has it and `max_seqs` is above 2, else [`simd_level`].
///
/// The bf16 tile kernel costs about the same for 1 row as for 16, the int8
/// kernels about 5× more for 16 rows than for 1, and a sequence must
/// compute the same numbers alone as batched, so one family serves all of
/// an engine's steps. On a Sapphire Rapids Xeon (SmolLM2-135M, 2 threads,
/// `docs/benchmarks.md`) the tiles decode 1 / 2 / 4 / 16 concurrent streams
/// at 170 / 296 / 449 / 751 tokens/s against the int8 kernels' 258 / 336 /
/// 444 / 571: an engine capped at one or two sequences keeps the int8
/// kernels. An explicit `PAGODA_SIMD` (`amx` for the int8 kernels,
/// `amx-bf16` for the tiles, or lower) overrides the choice.
pub fn weight_level(max_seqs: usize) -> SimdLevel {
    let chosen = std::env::var_os("PAGODA_SIMD").is_some();
    if !chosen && max_seqs > 2 && detected_level() == SimdLevel::AmxBf16 {
        SimdLevel::AmxBf16
    } else {
        simd_level()
    }
}

/// The best level this CPU (and OS) can run, ignoring `PAGODA_SIMD`.
pub(crate) fn detected_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    if avx512 && amx::enable() {
        if amx::has_bf16() {
            SimdLevel::AmxBf16
        } else {
            SimdLevel::Amx
        }
    } else if avx512 {
        SimdLevel::Avx512Vnni
    } else if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// A CPU device context: the thread pool every kernel runs on.
pub struct CpuContext {
    pool: ThreadPool,
}

impl CpuContext {
    /// A context with `threads` worker threads (0 means all cores).
    pub fn new(threads: usize) -> CpuContext {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        CpuContext {
            pool: ThreadPool::new(threads),
        }
    }

    /// The pool kernels split their work over.
    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}
