//! The CPU implementations of the model's non-matmul operations: RMSNorm,
//! residual adds, SiLU·mul, softmax, RoPE, paged attention, and the
//! sampling of a whole batch's logit rows ([`sample`]).
//!
//! Activations are f32 and row-major throughout. Every function here is
//! allocation-free once warm (scratch lives on the stack, or, for the
//! sampler, in buffers the caller keeps), so a decode step can run
//! without touching the heap. The heavy kernels (paged attention, the
//! exp-bound activations) pick AVX-512, AVX2 or scalar code from
//! [`crate::cpu::simd_level`] once per call; the cheap ones are plain loops
//! the compiler vectorizes.

mod act;
mod attention;
pub mod conv1d;
pub mod encoder;
pub mod gated_delta;
pub mod gated_norm;
pub mod lora;
pub mod mla;
pub mod moe;
mod norm;
mod recurrent;
mod rope;
pub mod sample;
pub(crate) mod simd;

pub use act::{
    gelu_tanh_mul, log_softmax_inplace, mul_sigmoid, scale_inplace, silu_mul, softcap_inplace,
    softmax_inplace, swiglu_clamped,
};
pub use attention::{
    paged_attention, paged_attention_with_sinks, window_reads_from, write_kv, AttnSeq, KvDtype,
    KvElem, KvLayout, MAX_HEAD_DIM,
};
pub use conv1d::{causal_conv1d_silu, ConvSpec};
pub use encoder::{Activation, EncoderSeq, SeqPooling, TOKEN_TYPE_SHIFT};
pub use gated_delta::{gated_delta_rule, GatedDeltaSpec};
pub use gated_norm::rms_norm_gated;
pub use moe::{GroupLimit, GroupScore, RouterScoring, RouterSpec, Routing};
pub use norm::{add_inplace, rms_norm, rms_norm_inplace};
pub use recurrent::RecurrentSeq;
pub use rope::{rope_inplace, RopeScaling, RopeStyle, RopeTable};
pub use sample::{sample_rows, RowSampling, SampleScratch, SampledRows, SamplingMetadata};

use crate::ThreadPool;

/// Rows below which [`for_row_ranges`] runs on the calling thread: a
/// decode step's few rows cost less than waking the pool.
const PAR_MIN_ROWS: usize = 64;

/// Runs a row-wise kernel `f(x_rows, out_rows)` over the rows of `x`
/// (`x_row` values each) and `out` (`out_row` each), split into row ranges
/// across `pool` when there are enough rows (a prefill step's thousands).
/// Row-wise kernels give the same bits however the rows are split.
///
/// # Panics
/// If `x` and `out` do not hold the same number of rows.
pub fn for_row_ranges(
    pool: &ThreadPool,
    x: &[f32],
    x_row: usize,
    out: &mut [f32],
    out_row: usize,
    f: &(dyn Fn(&[f32], &mut [f32]) + Sync),
) {
    assert!(x_row > 0 && out_row > 0, "for_row_ranges: empty rows");
    let n = out.len() / out_row;
    assert!(
        x.len() == n * x_row && out.len() == n * out_row,
        "for_row_ranges: x and out differ in rows"
    );
    if n < PAR_MIN_ROWS || pool.threads() == 1 {
        f(x, out);
        return;
    }
    struct Out(*mut f32);
    // SAFETY: each range below writes only its own rows of `out`.
    unsafe impl Sync for Out {}
    let o = Out(out.as_mut_ptr());
    pool.run_ranges(n, 16, &|r0, r1| {
        let o = &o;
        // SAFETY: rows r0..r1 are in bounds and disjoint from every other
        // range's, and `out` outlives the pool region.
        let rows =
            unsafe { std::slice::from_raw_parts_mut(o.0.add(r0 * out_row), (r1 - r0) * out_row) };
        f(&x[r0 * x_row..r1 * x_row], rows);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_ranges_give_the_bits_of_one_call() {
        let pool = ThreadPool::new(2);
        let (ffn, dim) = (24usize, 40usize);
        for n in [1usize, 63, 64, 200, 1001] {
            let gu: Vec<f32> = (0..n * 2 * ffn)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                .collect();
            let (mut one, mut split) = (vec![0f32; n * ffn], vec![f32::NAN; n * ffn]);
            silu_mul(&gu, ffn, &mut one);
            for_row_ranges(&pool, &gu, 2 * ffn, &mut split, ffn, &|g, o| {
                silu_mul(g, ffn, o)
            });
            assert_eq!(one, split, "silu_mul, {n} rows");

            let x: Vec<f32> = (0..n * dim)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 7.0)
                .collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 / 64.0).collect();
            let (mut one, mut split) = (vec![0f32; n * dim], vec![f32::NAN; n * dim]);
            rms_norm(&x, &w, 1e-5, &mut one);
            for_row_ranges(&pool, &x, dim, &mut split, dim, &|xr, o| {
                rms_norm(xr, &w, 1e-5, o)
            });
            assert_eq!(one, split, "rms_norm, {n} rows");
        }
    }
}
