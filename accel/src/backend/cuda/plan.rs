//! Launch geometry: the pure arithmetic behind every launch, kept apart from
//! the device calls so it is tested without a GPU.

/// Threads per block of the element-wise kernels.
pub const ELEMWISE_THREADS: u32 = 256;
/// Threads per block of `pg_attention` (`PG_ATT_THREADS` in kernels.cu).
pub const ATT_THREADS: u32 = 128;
/// Threads of a `pg_lora_shrink` block (one token; a warp per rank row).
pub const LORA_SHRINK_THREADS: u32 = 128;
/// Cache positions per attention tile (`PG_ATT_TILE`).
pub const ATT_TILE: usize = 16;
/// Accumulator registers per attention thread (`PG_ATT_ACC`): a block holds
/// at most `ATT_THREADS * ATT_ACC` output elements (rows × head_dim).
pub const ATT_ACC: usize = 32;
/// Most rows (query × q head) per attention block: bounds the scores and
/// per-row state in shared memory when heads are small.
pub const ATT_MAX_ROWS: usize = 128;
/// Output features per mmvq block (`PG_MMVQ_WARPS`).
pub const MMVQ_WARPS: u32 = 4;
/// Activation rows per mmvq block (`PG_MMVQ_COLS`).
pub const MMVQ_COLS: u32 = 8;
/// Rows × features per tile of the tiled quantized matmul (`PG_MMQ_TILE`).
pub const MMQ_TILE: u32 = 64;
/// Threads per tiled-matmul block (`PG_MMQ_THREADS`).
pub const MMQ_THREADS: u32 = 256;
/// Threads per block of the sampling kernels (`PG_SAMPLE_THREADS`): one
/// block per row.
pub const SAMPLE_THREADS: u32 = 256;
/// Words per row of the sampling kernels' `rows_u` (`PG_SU`): logit row,
/// flags, top-k, logprobs k, mask offset, top-list offset, raw slot, 0.
pub const SAMPLE_U: usize = 8;
/// Floats per row of `rows_f` (`PG_SF`): temperature, top-p, min-p,
/// repetition, presence and frequency penalties, 0, 0.
pub const SAMPLE_F: usize = 8;
/// `rows_u` flags (`PG_S_*`): greedy, wants logprobs, restricted (allowed
/// ids, bans or a grammar mask: may leave nothing to sample).
pub const SAMPLE_GREEDY: u32 = 1;
pub const SAMPLE_LOGPROBS: u32 = 2;
pub const SAMPLE_RESTRICTED: u32 = 4;
/// From this many activation rows on, quantized matmuls use the tiled
/// kernel: below it, a 64-row tile would be mostly empty and the
/// matrix-vector kernel reads the weight at most four times.
pub const MMQ_MIN_ROWS: usize = 32;

/// Whether a quantized matmul of `m` rows takes the tiled kernel.
pub fn use_tiled_matmul(m: usize) -> bool {
    m >= MMQ_MIN_ROWS
}

/// The tiled kernel's static shared memory (two int tiles of 64 × 33 words,
/// two 64 × 4 float2 scale tiles) fits the default budget.
const _: () = assert!(2 * 64 * 33 * 4 + 2 * 64 * 4 * 8 <= DEFAULT_SMEM);

/// The shared memory a block may use without opting in (48 KiB on every
/// CUDA GPU since Kepler).
pub const DEFAULT_SMEM: usize = 48 * 1024;
/// The shortest context split of a decode row: shorter splits cost more in
/// the merge than they gain in parallelism.
pub const MIN_SPLIT: usize = 256;

/// Blocks of `threads` that cover `n` elements, or an error naming `what`
/// when the grid would exceed CUDA's 2³¹ − 1 blocks in x.
pub fn blocks_for(n: usize, threads: u32, what: &str) -> Result<u32, String> {
    let b = n.div_ceil(threads as usize);
    u32::try_from(b)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| format!("{what}: {n} elements need {b} blocks, beyond CUDA's grid limit"))
}

/// How the attention kernel covers one (sequence, kv head): `nq` queries per
/// prefill block, and decode contexts cut into `n_splits` splits of
/// `split_len` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnPlan {
    /// q heads per kv head.
    pub group: usize,
    /// Queries per prefill block (decode blocks hold one).
    pub nq: usize,
    /// Positions per decode split (a multiple of [`ATT_TILE`]).
    pub split_len: usize,
    /// Splits of the longest decode context.
    pub n_splits: usize,
    /// Dynamic shared memory per block, bytes.
    pub smem_bytes: usize,
}

/// Why attention cannot run with these heads on this kernel.
pub fn attn_shape_error(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Option<String> {
    if n_kv_heads == 0 || n_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Some(format!(
            "attention: {n_heads} q heads are not a positive multiple of {n_kv_heads} kv heads"
        ));
    }
    let group = n_heads / n_kv_heads;
    if head_dim == 0 || head_dim > 256 {
        return Some(format!("attention: head_dim {head_dim} outside 1..=256"));
    }
    if group > ATT_MAX_ROWS || group * head_dim > ATT_THREADS as usize * ATT_ACC {
        return Some(format!(
            "attention: a group of {group} q heads of {head_dim} exceeds the CUDA kernel's {} accumulators or {ATT_MAX_ROWS} rows per block",
            ATT_THREADS as usize * ATT_ACC
        ));
    }
    None
}

/// Bytes of dynamic shared memory `pg_attention` uses for `rows` rows
/// (`nq × group`) of `head_dim`: the queries, one K/V tile with a padded
/// stride (D + 1 keeps the tile's columns on distinct banks), the tile's
/// scores and three floats per row.
pub fn attn_smem_bytes(rows: usize, head_dim: usize) -> usize {
    4 * (rows * head_dim + ATT_TILE * (head_dim + 1) + rows * ATT_TILE + 3 * rows)
}

/// Plans attention for one step: `max_decode_ctx` is the longest context of
/// its decode rows, `n_seqs` its sequences and `sms` the GPU's
/// multiprocessors. Decode contexts are split until the grid has about two
/// blocks per multiprocessor (flash decoding), but never below
/// [`MIN_SPLIT`] positions.
///
/// # Panics
/// If [`attn_shape_error`] rejects the heads.
pub fn plan_attention(
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    max_decode_ctx: usize,
    n_seqs: usize,
    sms: usize,
) -> AttnPlan {
    if let Some(e) = attn_shape_error(n_heads, n_kv_heads, head_dim) {
        panic!("{e}");
    }
    let group = n_heads / n_kv_heads;
    let nq = ((ATT_THREADS as usize * ATT_ACC) / (group * head_dim))
        .min(ATT_MAX_ROWS / group)
        .max(1);
    let work = (n_seqs * n_kv_heads).max(1);
    let target = 2 * sms.max(1);
    let want_splits = target.div_ceil(work).max(1);
    let ctx = max_decode_ctx.max(1);
    let split_len = ctx
        .div_ceil(want_splits)
        .max(MIN_SPLIT)
        .next_multiple_of(ATT_TILE);
    let n_splits = ctx.div_ceil(split_len);
    AttnPlan {
        group,
        nq,
        split_len,
        n_splits,
        smem_bytes: attn_smem_bytes(nq * group, head_dim),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_and_reject_huge_grids() {
        assert_eq!(blocks_for(0, 256, "x"), Ok(0));
        assert_eq!(blocks_for(1, 256, "x"), Ok(1));
        assert_eq!(blocks_for(256, 256, "x"), Ok(1));
        assert_eq!(blocks_for(257, 256, "x"), Ok(2));
        assert!(blocks_for(usize::MAX / 2, 1, "x").is_err());
    }

    #[test]
    fn matmul_kernel_choice() {
        assert!(!use_tiled_matmul(1));
        assert!(!use_tiled_matmul(MMQ_MIN_ROWS - 1));
        assert!(use_tiled_matmul(MMQ_MIN_ROWS));
        assert!(use_tiled_matmul(4096));
    }

    #[test]
    fn attention_shapes() {
        assert!(attn_shape_error(32, 8, 128).is_none());
        assert!(attn_shape_error(32, 6, 128).is_some());
        assert!(attn_shape_error(32, 0, 128).is_some());
        assert!(attn_shape_error(8, 8, 512).is_some());
        // 64 heads of 128 over one kv head: 8192 accumulators.
        assert!(attn_shape_error(64, 1, 128).is_some());
        assert!(attn_shape_error(32, 1, 128).is_none());
    }

    #[test]
    fn every_admitted_shape_fits_default_shared_memory() {
        for d in (2..=256).step_by(2) {
            for group in 1..=ATT_MAX_ROWS {
                if attn_shape_error(group * 2, 2, d).is_some() {
                    continue;
                }
                let p = plan_attention(group * 2, 2, d, 4096, 1, 132);
                assert!(p.nq * group * d <= ATT_THREADS as usize * ATT_ACC);
                assert!(p.nq * group <= ATT_MAX_ROWS);
                assert!(p.smem_bytes <= DEFAULT_SMEM, "d {d} group {group}: {p:?}");
            }
        }
    }

    #[test]
    fn decode_splits_fill_the_gpu_and_cover_the_context() {
        // One sequence, 8 kv heads, 132 SMs: 264 blocks wanted, 33 splits.
        let p = plan_attention(32, 8, 128, 32768, 1, 132);
        assert_eq!(p.group, 4);
        assert_eq!(p.nq, 8);
        assert!(p.split_len.is_multiple_of(ATT_TILE));
        assert!(p.split_len * p.n_splits >= 32768);
        assert!(p.split_len * (p.n_splits - 1) < 32768);
        assert!(p.n_splits * 8 >= 2 * 132);
        // A big batch already fills the GPU: one split.
        let p = plan_attention(32, 8, 128, 4096, 64, 132);
        assert_eq!(p.n_splits, 1);
        assert_eq!(p.split_len, 4096);
        // Short contexts are not cut below MIN_SPLIT.
        let p = plan_attention(32, 8, 128, 300, 1, 132);
        assert_eq!((p.split_len, p.n_splits), (MIN_SPLIT, 2));
        let p = plan_attention(32, 8, 128, 1, 1, 132);
        assert_eq!(p.n_splits, 1);
    }
}
