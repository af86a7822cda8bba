//! What both AMX-BF16 kernels ([`super::amx_bf16`] for wide rows,
//! [`super::bf16_tiles`] for every batch size) are built from: rounding f32
//! to bf16, zeroing the C tiles, and the view of an activation buffer that
//! their token-range tasks fill. Kept apart so that neither kernel imports
//! the other.

use core::arch::x86_64::*;
use std::arch::asm;

/// 32 f32 (`lo` then `hi`) rounded to bf16 (to nearest, ties to even;
/// subnormals flush to zero) in order: 16 pairs, one per 32-bit lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) unsafe fn pack_bf16(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: `__m512bh` and `__m512i` are both 64 plain bytes.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// Raw view of an activation buffer that token-range tasks fill disjointly.
pub(super) struct ActOut<T>(pub(super) *mut T);
// SAFETY: each task writes only its own tokens' elements.
unsafe impl<T> Sync for ActOut<T> {}

/// Zeroes tile registers 0–3: the C tiles of both kernels.
///
/// # Safety
/// A tile configuration is loaded on this thread.
#[inline]
pub(super) unsafe fn zero_c() {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
}
