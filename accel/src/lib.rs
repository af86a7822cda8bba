//! `pagoda-accel`: device contexts and the compute kernels Pagoda's engine
//! runs on.
//!
//! The engine's model code is written against [`Backend`], an op-level
//! abstraction over device buffers (matmul over quantized or dense weights,
//! RMSNorm, RoPE, SiLU·mul, paged attention, …), and never against one
//! backend; [`CpuBackend`] runs the kernels of [`ops`] and [`quant`]. The CPU backend is always
//! built; its kernels pick AVX-512, AVX2 or scalar code at run time. The
//! accelerator backends (`cuda`, `rocm`, `npu`) are cargo features.

pub mod backend;
pub mod cpu;
pub mod device;
pub mod ops;
pub mod quant;

#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
pub use backend::{
    Backend, BackendError, CpuBackend, DeviceLora, DeviceMatrix, HostMatrix, KvLayerSpec, KvSpec,
    LoraSlice, Rows, StepBatch, StepSeq,
};
pub use cpu::pool::ThreadPool;
pub use device::{CpuContext, Device, DeviceError};
pub use quant::{Affine, GgmlType, MatmulScratch, StaticActQuant, Weight, WeightError};
