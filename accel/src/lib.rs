//! `pagoda-accel`: device contexts and the compute kernels Pagoda's engine
//! runs on.
//!
//! The engine's model code is written against the operations here (matmul
//! over quantized or dense weights, RMSNorm, RoPE, SiLU·mul, paged
//! attention, …) and never against a backend. The CPU backend is always
//! built; its kernels pick AVX-512, AVX2 or scalar code at run time. The
//! accelerator backends (`cuda`, `rocm`, `npu`) are cargo features.

pub mod cpu;
pub mod device;
pub mod ops;
pub mod quant;

pub use cpu::pool::ThreadPool;
pub use device::{CpuContext, Device, DeviceError};
pub use quant::{GgmlType, MatmulScratch, Weight, WeightError};
