//! Writing new K and V rows into the cache: [`write_kv`].

use super::kv::KvElem;
use super::layout::KvLayout;

/// Writes new K and V rows into the caches, rounding to `T`.
///
/// `k`, `v`: `[n_tokens, n_kv_heads * head_dim]`; token `t` goes to slot
/// `slot_mapping[t] = block_id * block_size + offset_in_block`.
///
/// # Panics
/// If a length disagrees with `layout` or a slot is outside the pool.
pub fn write_kv<T: KvElem>(
    layout: &KvLayout,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
) {
    let d = layout.head_dim;
    let row = layout.n_kv_heads * d;
    assert_eq!(
        k_cache.len(),
        layout.elems(),
        "write_kv: k_cache does not match the layout"
    );
    assert_eq!(
        v_cache.len(),
        layout.elems(),
        "write_kv: v_cache does not match the layout"
    );
    assert_eq!(
        k.len(),
        slot_mapping.len() * row,
        "write_kv: k has the wrong length"
    );
    assert_eq!(
        v.len(),
        slot_mapping.len() * row,
        "write_kv: v has the wrong length"
    );
    let slots = layout.num_blocks * layout.block_size;
    // K is rounded here in runs of `RUN`, then scattered into its
    // transposed slab.
    const RUN: usize = 64;
    let mut run = [T::from_f32(0.0); RUN];
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let slot = slot as usize;
        assert!(
            slot < slots,
            "write_kv: slot {slot} outside the pool of {slots}"
        );
        let (block, off) = (slot / layout.block_size, slot % layout.block_size);
        for h in 0..layout.n_kv_heads {
            let slab = layout.slab(block, h);
            let src = t * row + h * d;
            // K transposed: element `i` of this position is `block_size` apart
            // from element `i + 1`.
            let k_slab = &mut k_cache[slab..slab + d * layout.block_size];
            let mut cells = k_slab[off..].iter_mut().step_by(layout.block_size);
            for part in k[src..src + d].chunks(RUN) {
                let rounded = &mut run[..part.len()];
                T::from_f32_slice(rounded, part);
                // `rounded` leads the zip, so no cell is taken past its end.
                for (&x, c) in rounded.iter().zip(&mut cells) {
                    *c = x;
                }
            }
            let dst = slab + off * d;
            T::from_f32_slice(&mut v_cache[dst..dst + d], &v[src..src + d]);
        }
    }
}
