//! The K/V tensors of every layer, laid out as `pagoda_accel::ops::KvLayout`
//! describes: `[num_blocks, n_kv_heads, block_size, head_dim]`.

use anyhow::{bail, Result};
use half::{bf16, f16};
use pagoda_accel::ops::{KvElem, KvLayout};

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
        match self {
            KvCacheDtype::F32 => 4,
            KvCacheDtype::F16 | KvCacheDtype::Bf16 => 2,
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

/// One layer's K and V.
pub struct LayerKv<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
}

/// The cache of all layers, in one of the supported element types.
pub enum KvCache {
    F32(Vec<LayerKv<f32>>, KvLayout),
    F16(Vec<LayerKv<f16>>, KvLayout),
    Bf16(Vec<LayerKv<bf16>>, KvLayout),
}

fn layers<T: KvElem + bytemuck::Zeroable>(num_layers: usize, layout: &KvLayout) -> Vec<LayerKv<T>> {
    // Zeroed allocations come from calloc, so the OS commits pages only as
    // blocks are first written: a large pool costs address space, not RSS.
    (0..num_layers)
        .map(|_| LayerKv {
            k: bytemuck::zeroed_vec(layout.elems()),
            v: bytemuck::zeroed_vec(layout.elems()),
        })
        .collect()
}

impl KvCache {
    /// Allocates the cache for `num_layers` layers.
    pub fn new(dtype: KvCacheDtype, num_layers: usize, layout: KvLayout) -> KvCache {
        match dtype {
            KvCacheDtype::F32 => KvCache::F32(layers(num_layers, &layout), layout),
            KvCacheDtype::F16 => KvCache::F16(layers(num_layers, &layout), layout),
            KvCacheDtype::Bf16 => KvCache::Bf16(layers(num_layers, &layout), layout),
        }
    }

    /// Bytes one block takes across all layers, K and V.
    pub fn bytes_per_block(
        dtype: KvCacheDtype,
        num_layers: usize,
        block_size: usize,
        kv_dim: usize,
    ) -> usize {
        2 * num_layers * block_size * kv_dim * dtype.size()
    }

    /// The shape of each layer's K (or V).
    pub fn layout(&self) -> &KvLayout {
        match self {
            KvCache::F32(_, l) | KvCache::F16(_, l) | KvCache::Bf16(_, l) => l,
        }
    }
}
