//! Where each cached position of each KV head lives: [`KvLayout`].

/// Shape of one layer's K (or V) cache: `[num_blocks, n_kv_heads, slab]`,
/// one contiguous `block_size × head_dim` slab per (block, KV head), so a
/// task streams its KV head's part of a block without striding over the
/// other heads.
///
/// Inside a slab, V is stored by position (`[block_size][head_dim]`) and K
/// transposed (`[head_dim][block_size]`): decode scores put keys in the SIMD
/// lanes (see the docs of `ops::attention`), and with K stored this way a vector of keys'
/// `i`-th elements is one load instead of a transpose per chunk.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Token positions per block.
    pub block_size: usize,
    /// KV heads of the layer.
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements in one K (or V) cache of this layout.
    pub fn elems(&self) -> usize {
        self.num_blocks * self.n_kv_heads * self.block_size * self.head_dim
    }

    /// Index of the first element of the slab of `(block, kv_head)`.
    #[inline(always)]
    pub(super) fn slab(&self, block: usize, kv_head: usize) -> usize {
        (block * self.n_kv_heads + kv_head) * self.block_size * self.head_dim
    }
}
