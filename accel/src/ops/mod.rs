//! The CPU implementations of the model's non-matmul operations: RMSNorm,
//! residual adds, SiLU·mul, softmax, RoPE and paged attention.
//!
//! Activations are f32 and row-major throughout. Every function here is
//! allocation-free (scratch lives on the stack), so a decode step can run
//! without touching the heap. The heavy kernels (paged attention, the
//! exp-bound activations) pick AVX-512, AVX2 or scalar code from
//! [`crate::cpu::simd_level`] once per call; the cheap ones are plain loops
//! the compiler vectorizes.

mod act;
mod attention;
mod norm;
mod rope;
pub(crate) mod simd;

pub use act::{log_softmax_inplace, silu_mul, softmax_inplace};
pub use attention::{paged_attention, write_kv, AttnSeq, KvDtype, KvElem, KvLayout, MAX_HEAD_DIM};
pub use norm::{add_inplace, rms_norm, rms_norm_inplace};
pub use rope::{rope_inplace, RopeScaling, RopeStyle, RopeTable};
