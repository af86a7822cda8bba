//! Batch invariance: a row's result must not depend on which other rows
//! share its batch, on how a prompt is chunked, or on the thread count.
//! The engine promises that batching changes no greedy output, and that
//! rests on these kernels being bitwise reproducible per row.

use pagoda_accel::ops::{paged_attention, write_kv, AttnSeq, KvLayout};
use pagoda_accel::{GgmlType, MatmulScratch, ThreadPool, Weight};

/// A small deterministic generator (xorshift), so the test needs no RNG crate.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn matmul_rows_do_not_depend_on_the_batch() {
    let (rows, cols) = (200, 576);
    let w_data = values(1, rows * cols);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
    ] {
        let w = Weight::quantize(ty, rows, cols, &w_data).expect("quantize");
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let mut scratch = MatmulScratch::default();
            let m = 19;
            let x = values(2, m * cols);
            let mut batched = vec![0f32; m * rows];
            w.matmul(&pool, &x, m, &mut batched, &mut scratch);
            for r in 0..m {
                let mut single = vec![0f32; rows];
                w.matmul(
                    &pool,
                    &x[r * cols..(r + 1) * cols],
                    1,
                    &mut single,
                    &mut scratch,
                );
                assert_eq!(
                    single,
                    batched[r * rows..(r + 1) * rows],
                    "{ty:?}, {threads} threads: row {r} of a batch of {m} differs from the same row alone"
                );
            }
            // And a sub-batch at an odd offset.
            let mut sub = vec![0f32; 5 * rows];
            w.matmul(&pool, &x[3 * cols..8 * cols], 5, &mut sub, &mut scratch);
            assert_eq!(
                sub,
                batched[3 * rows..8 * rows],
                "{ty:?}: sub-batch differs"
            );
        }
    }
}

#[test]
fn attention_does_not_depend_on_chunking_or_batch_mates() {
    let (n_heads, n_kv, hd, bs): (usize, usize, usize, usize) = (9, 3, 64, 16);
    let ctx: usize = 150;
    let layout = KvLayout {
        num_blocks: 64,
        block_size: bs,
        n_kv_heads: n_kv,
        head_dim: hd,
    };
    let mut kc = vec![half::f16::ZERO; layout.elems()];
    let mut vc = vec![half::f16::ZERO; layout.elems()];
    // The sequence's blocks, deliberately out of order.
    let table: Vec<u32> = (0..ctx.div_ceil(bs) as u32).map(|i| 40 - 3 * i).collect();
    let k = values(3, ctx * n_kv * hd);
    let v = values(4, ctx * n_kv * hd);
    let slots: Vec<u32> = (0..ctx)
        .map(|p| table[p / bs] * bs as u32 + (p % bs) as u32)
        .collect();
    write_kv(&layout, &mut kc, &mut vc, &k, &v, &slots);
    let q = values(5, ctx * n_heads * hd);
    let pool = ThreadPool::new(2);
    let scale = 0.125;

    // The whole prompt at once.
    let mut whole = vec![0f32; ctx * n_heads * hd];
    let seqs = [AttnSeq {
        q_start: 0,
        q_len: ctx,
        ctx_len: ctx,
        block_table: &table,
    }];
    paged_attention(
        &pool, &layout, &kc, &vc, &q, n_heads, &seqs, scale, None, &mut whole,
    );

    // In chunks of 37, each chunk batched with an unrelated decode row.
    let other_table = [60u32, 61];
    let mut start = 0;
    while start < ctx {
        let len = 37.min(ctx - start);
        let w = n_heads * hd;
        let mut qb = values(9, w); // the batch mate's query comes first
        qb.extend_from_slice(&q[start * w..(start + len) * w]);
        let seqs = [
            AttnSeq {
                q_start: 0,
                q_len: 1,
                ctx_len: 20,
                block_table: &other_table,
            },
            AttnSeq {
                q_start: 1,
                q_len: len,
                ctx_len: start + len,
                block_table: &table,
            },
        ];
        let mut out = vec![0f32; (len + 1) * w];
        paged_attention(
            &pool, &layout, &kc, &vc, &qb, n_heads, &seqs, scale, None, &mut out,
        );
        assert_eq!(
            out[w..],
            whole[start * w..(start + len) * w],
            "chunk at {start} differs from the whole prompt"
        );
        start += len;
    }
}
