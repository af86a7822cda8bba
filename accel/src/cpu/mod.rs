//! The CPU backend: a parking thread pool and instruction-set detection.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod pool;

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
}

impl SimdLevel {
    /// Whether the AVX-512 kernels run at this level.
    pub fn has_avx512(self) -> bool {
        self >= SimdLevel::Avx512Vnni
    }
}

/// Returns the SIMD level kernels dispatch on. `PAGODA_SIMD=scalar|avx2|avx512`
/// lowers it, so tests and benchmarks can exercise every path on one CPU.
pub fn simd_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected_level();
        match std::env::var("PAGODA_SIMD").as_deref() {
            Ok("scalar") => SimdLevel::Scalar,
            Ok("avx2") => detected.min(SimdLevel::Avx2),
            Ok("avx512") => detected.min(SimdLevel::Avx512Vnni),
            _ => detected,
        }
    })
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
        SimdLevel::Amx
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
