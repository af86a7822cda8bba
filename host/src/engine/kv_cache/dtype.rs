//! The element type of the KV cache, as `--kv-cache-dtype` names it. The
//! K/V tensors themselves live on the device, in the backend's pool
//! ([`pagoda_accel::Backend::alloc_kv`]).

use anyhow::{bail, Result};
use pagoda_accel::ops::KvDtype;

/// The element type of the cache, chosen by `--kv-cache-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCacheDtype {
    F32,
    F16,
    Bf16,
}

impl KvCacheDtype {
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        self.kv_dtype().size()
    }

    /// The backend's name for this type.
    pub fn kv_dtype(self) -> KvDtype {
        match self {
            KvCacheDtype::F32 => KvDtype::F32,
            KvCacheDtype::F16 => KvDtype::F16,
            KvCacheDtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = anyhow::Error;
    /// `auto` is f16: at batch 16 the cache moves more bytes than the
    /// weights, so a 16-bit cache is the better default on the CPU, and f16
    /// keeps 3 more mantissa bits than bf16.
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" | "f16" | "fp16" | "float16" => KvCacheDtype::F16,
            "bf16" | "bfloat16" => KvCacheDtype::Bf16,
            "f32" | "fp32" | "float32" => KvCacheDtype::F32,
            other => bail!("--kv-cache-dtype '{other}' is not one of auto, bf16, f16, f32"),
        })
    }
}
