//! The element type of the KV cache, as `--kv-cache-dtype` names it. The
//! K/V tensors themselves live on the device, in the backend's pool
//! ([`pagoda_accel::Backend::alloc_kv`]).

use anyhow::{bail, Result};
use pagoda_accel::ops::KvDtype;

/// The element type of the cache, chosen by `--kv-cache-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The model's own dtype, as in vLLM; see [`KvCacheDtype::resolve`].
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl KvCacheDtype {
    /// The concrete type for a model whose layers are stored as
    /// `weight_type` (a block-type name such as "F32", "BF16" or "Q4_1"):
    /// `auto` follows float weights (f32, bf16, f16), as vLLM follows the
    /// model's dtype, and is f16 for quantized weights, as llama.cpp keeps
    /// its cache. Other choices stay as they are.
    pub fn resolve(self, weight_type: &str) -> KvCacheDtype {
        match (self, weight_type) {
            (KvCacheDtype::Auto, "F32") => KvCacheDtype::F32,
            (KvCacheDtype::Auto, "BF16") => KvCacheDtype::Bf16,
            (KvCacheDtype::Auto, _) => KvCacheDtype::F16,
            (other, _) => other,
        }
    }

    /// The name `--kv-cache-dtype` takes, for logs.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::F32 => "f32",
            KvCacheDtype::F16 => "f16",
            KvCacheDtype::Bf16 => "bf16",
        }
    }

    /// Bytes per stored element.
    pub fn size(self) -> usize {
        self.kv_dtype().size()
    }

    /// The backend's name for this type (`auto` before it is resolved
    /// against a model sizes as f16).
    pub fn kv_dtype(self) -> KvDtype {
        match self {
            KvCacheDtype::F32 => KvDtype::F32,
            KvCacheDtype::F16 | KvCacheDtype::Auto => KvDtype::F16,
            KvCacheDtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = anyhow::Error;
    /// `auto` follows the model ([`KvCacheDtype::resolve`]).
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => KvCacheDtype::Auto,
            "f16" | "fp16" | "float16" => KvCacheDtype::F16,
            "bf16" | "bfloat16" => KvCacheDtype::Bf16,
            "f32" | "fp32" | "float32" => KvCacheDtype::F32,
            other => bail!("--kv-cache-dtype '{other}' is not one of auto, bf16, f16, f32"),
        })
    }
}
