//! Device selection and per-device contexts.

use std::fmt;
use std::str::FromStr;

// Defined with the pool it wraps, below both this module and the backends
// (the CPU backend holds one; `Device::detect` asks the CUDA backend).
pub use crate::cpu::CpuContext;

/// A kind of device the engine can run on, as named by `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host CPU, always available.
    Cpu,
    /// NVIDIA GPUs through CUDA (cargo feature `cuda`).
    Cuda,
    /// AMD GPUs and Hygon DCUs through ROCm/HIP (cargo feature `rocm`).
    Rocm,
    /// Huawei Ascend NPUs through CANN (cargo feature `npu`).
    Npu,
}

/// Why a device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The name given to `--device` is not one we know.
    #[error("unknown device '{0}': expected one of cpu, cuda, rocm, npu (or auto)")]
    Unknown(String),
    /// The backend exists but this binary was built without it.
    #[error(
        "device '{device}' is not available in this build: rebuild with `cargo build --release --features pagoda-accel/{feature}` on a machine with {runtime}, or use --device cpu"
    )]
    NotBuilt {
        device: Device,
        feature: &'static str,
        runtime: &'static str,
    },
    /// The device's backend is built in but is not a CPU context: it is
    /// opened through its own backend type (for `cuda`,
    /// [`crate::CudaBackend::new`]), or the device cannot be used here.
    #[cfg(feature = "cuda")]
    #[error("device '{device}': {reason}")]
    Unavailable { device: Device, reason: String },
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Rocm => "rocm",
            Device::Npu => "npu",
        })
    }
}

impl FromStr for Device {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            // The best backend compiled in that finds a device here.
            "auto" => Ok(Device::detect()),
            "cuda" | "gpu" => Ok(Device::Cuda),
            "rocm" | "hip" | "dcu" => Ok(Device::Rocm),
            "npu" | "ascend" => Ok(Device::Npu),
            _ => Err(DeviceError::Unknown(s.to_string())),
        }
    }
}

impl Device {
    /// The device `auto` means: a CUDA GPU where this build has the CUDA
    /// backend and the driver reports one, else the CPU.
    pub fn detect() -> Device {
        #[cfg(feature = "cuda")]
        if crate::backend::cuda::device_count().is_ok_and(|n| n > 0) {
            return Device::Cuda;
        }
        Device::Cpu
    }

    /// Opens a CPU context with `threads` threads, or explains why the
    /// requested accelerator is unavailable (with the `cuda` feature,
    /// `Device::Cuda` reports whether a GPU is present and that it is opened
    /// with `CudaBackend::new`).
    pub fn open(self, threads: usize) -> Result<CpuContext, DeviceError> {
        match self {
            Device::Cpu => Ok(CpuContext::new(threads)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => Err(DeviceError::NotBuilt {
                device: self,
                feature: "cuda",
                runtime: "the CUDA driver (libcuda) and an NVIDIA GPU",
            }),
            // Built with CUDA: say whether a GPU is there, and how it is
            // driven (a CPU context cannot be).
            #[cfg(feature = "cuda")]
            Device::Cuda => Err(DeviceError::Unavailable {
                device: self,
                reason: match crate::backend::cuda::device_count() {
                    Err(e) => e.to_string(),
                    Ok(0) => "the CUDA driver reports no GPU".into(),
                    Ok(n) => format!(
                        "{n} CUDA GPU(s) found; they are driven by pagoda_accel::CudaBackend::new(ordinal), not a CPU context"
                    ),
                },
            }),
            Device::Rocm => Err(DeviceError::NotBuilt {
                device: self,
                feature: "rocm",
                runtime: "the ROCm/HIP runtime and an AMD GPU or Hygon DCU",
            }),
            Device::Npu => Err(DeviceError::NotBuilt {
                device: self,
                feature: "npu",
                runtime: "the Ascend CANN toolkit and an Ascend NPU",
            }),
        }
    }
}
