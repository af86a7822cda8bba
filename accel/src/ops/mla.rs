//! Multi-head latent attention (DeepSeek-V2/V3's MLA) over a latent KV
//! cache, in the absorbed form.
//!
//! The cache keeps one row per token: the compressed KV latent
//! (`kv_lora_rank` values, after its RMSNorm) followed by the shared
//! rotary key (`qk_rope_head_dim`, after RoPE). With the key up-projection
//! absorbed into each query head (`q_latent = W_UK[h]ᵀ · q_nope[h]`), a
//! head's score against position `s` is `q[h] · row[s]` over the whole row,
//! and its output is the softmax-weighted sum of the rows' latent parts,
//! which the caller up-projects by `W_UV[h]`. So every head reads the same
//! rows: the cache is `width` values per token, not per head.

use super::attention::{AttnSeq, KvElem};
use crate::ThreadPool;

/// Most elements of a latent row (DeepSeek-V3: 512 + 64).
pub const MAX_LATENT: usize = 1024;
/// Heads one task attends (its running maxima and sums live on the stack).
const HEADS_PER_TASK: usize = 16;

/// Writes the step's latent rows (`latent: [n_tokens, width]`) into the
/// cache (`[slots, width]`, slot `block · block_size + offset`), rounding
/// to `T`.
///
/// # Panics
/// If a length disagrees or a slot is outside the cache.
pub fn write_latent<T: KvElem>(cache: &mut [T], width: usize, latent: &[f32], slots: &[u32]) {
    assert_eq!(
        latent.len(),
        slots.len() * width,
        "write_latent: latent rows"
    );
    let n_slots = cache.len() / width.max(1);
    for (row, &slot) in latent.chunks_exact(width).zip(slots) {
        let slot = slot as usize;
        assert!(
            slot < n_slots,
            "write_latent: slot {slot} outside the cache of {n_slots}"
        );
        T::from_f32_slice(&mut cache[slot * width..(slot + 1) * width], row);
    }
}

struct OutPtr(*mut f32);
// SAFETY: every task writes the output rows of its own (token, heads), and
// the pool joins all tasks before `latent_attention` returns the borrow.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Causal attention of every query head over the latent rows of its
/// sequence.
///
/// `q: [n_tokens, n_heads, width]` (each head's absorbed latent query then
/// its roped part); `out: [n_tokens, n_heads, v_width]` receives each
/// head's softmax-weighted sum of the rows' first `v_width` values. Query
/// `i` of a sequence is at position `ctx_len − q_len + i` and sees
/// positions `0..=` that.
///
/// # Panics
/// If the shapes disagree, `width` exceeds [`MAX_LATENT`], or a block id
/// is outside the cache.
#[allow(clippy::too_many_arguments)]
pub fn latent_attention<T: KvElem>(
    pool: &ThreadPool,
    cache: &[T],
    block_size: usize,
    width: usize,
    q: &[f32],
    n_heads: usize,
    v_width: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut [f32],
) {
    assert!(
        width > 0 && width <= MAX_LATENT,
        "latent_attention: width {width}"
    );
    assert!(
        v_width <= width,
        "latent_attention: v_width {v_width} > width {width}"
    );
    let n_tokens: usize = seqs.iter().map(|s| s.q_len).sum();
    assert!(q.len() >= n_tokens * n_heads * width, "latent_attention: q");
    assert!(
        out.len() >= n_tokens * n_heads * v_width,
        "latent_attention: out"
    );
    let n_slots = cache.len() / width;
    let chunks = n_heads.div_ceil(HEADS_PER_TASK);
    // Every token of the step, as (sequence, index in it).
    let out_ptr = OutPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let (tok, chunk) = (t / chunks, t % chunks);
        // The sequence holding batch row `tok` (rows are in sequence order).
        let Some(s) = seqs
            .iter()
            .find(|s| tok >= s.q_start && tok < s.q_start + s.q_len)
        else {
            return;
        };
        let pos = s.ctx_len - s.q_len + (tok - s.q_start);
        let h0 = chunk * HEADS_PER_TASK;
        let h1 = (h0 + HEADS_PER_TASK).min(n_heads);
        let mut max = [f32::NEG_INFINITY; HEADS_PER_TASK];
        let mut sum = [0f32; HEADS_PER_TASK];
        let mut row = [0f32; MAX_LATENT];
        // SAFETY: this task alone writes heads h0..h1 of row `tok`.
        let acc = unsafe {
            std::slice::from_raw_parts_mut(
                out_ptr.at((tok * n_heads + h0) * v_width),
                (h1 - h0) * v_width,
            )
        };
        acc.fill(0.0);
        for p in 0..=pos {
            let block = s.block_table[p / block_size] as usize;
            let slot = block * block_size + p % block_size;
            assert!(
                slot < n_slots,
                "latent_attention: slot {slot} outside the cache"
            );
            for (r, c) in row[..width]
                .iter_mut()
                .zip(&cache[slot * width..(slot + 1) * width])
            {
                *r = c.to_f32();
            }
            for h in h0..h1 {
                let qh = &q[(tok * n_heads + h) * width..(tok * n_heads + h + 1) * width];
                let score = qh
                    .iter()
                    .zip(&row[..width])
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    * scale;
                let j = h - h0;
                let a = &mut acc[j * v_width..(j + 1) * v_width];
                if score > max[j] {
                    let shrink = (max[j] - score).exp();
                    sum[j] *= shrink;
                    a.iter_mut().for_each(|x| *x *= shrink);
                    max[j] = score;
                }
                let w = (score - max[j]).exp();
                sum[j] += w;
                for (x, &r) in a.iter_mut().zip(&row[..v_width]) {
                    *x += w * r;
                }
            }
        }
        for j in 0..h1 - h0 {
            let inv = 1.0 / sum[j];
            acc[j * v_width..(j + 1) * v_width]
                .iter_mut()
                .for_each(|x| *x *= inv);
        }
    };
    pool.run(n_tokens * chunks, &task);
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Attention in f64 from the unabsorbed definition's pieces: scores
    /// `q · row`, softmax over positions `0..=pos`, values the rows' first
    /// `v_width` entries.
    fn naive(rows: &[Vec<f64>], q: &[f64], pos: usize, v_width: usize, scale: f64) -> Vec<f64> {
        let scores: Vec<f64> = rows[..=pos]
            .iter()
            .map(|r| r.iter().zip(q).map(|(a, b)| a * b).sum::<f64>() * scale)
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..v_width)
            .map(|d| {
                rows[..=pos]
                    .iter()
                    .zip(&e)
                    .map(|(r, w)| w * r[d])
                    .sum::<f64>()
                    / z
            })
            .collect()
    }

    fn check<T: KvElem>(tol: f64) {
        let pool = ThreadPool::new(2);
        let (width, v_width, heads, bs) = (40, 32, 5, 4);
        let mut state = 7u64;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f64 / (1u64 << 31) as f64) - 0.5
        };
        // Two sequences in scattered blocks: one decoding at position 9,
        // one prefilling positions 3..7 after 3 cached ones.
        let tables: [Vec<u32>; 2] = [vec![5, 1, 7], vec![2, 0]];
        let lens = [10usize, 7];
        let rows: Vec<Vec<Vec<f64>>> = lens
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| (0..width).map(|_| rnd()).collect())
                    .collect()
            })
            .collect();
        let mut cache = vec![T::from_f32(0.0); 8 * bs * width];
        for (s, seq_rows) in rows.iter().enumerate() {
            let slots: Vec<u32> = (0..seq_rows.len())
                .map(|p| tables[s][p / bs] * bs as u32 + (p % bs) as u32)
                .collect();
            let flat: Vec<f32> = seq_rows.iter().flatten().map(|&x| x as f32).collect();
            write_latent(&mut cache, width, &flat, &slots);
        }
        // The reference reads what the cache holds (rounded to T).
        let stored: Vec<Vec<Vec<f64>>> = rows
            .iter()
            .map(|r| {
                r.iter()
                    .map(|x| {
                        x.iter()
                            .map(|&v| T::from_f32(v as f32).to_f32() as f64)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let seqs = [
            AttnSeq {
                q_start: 0,
                q_len: 1,
                ctx_len: 10,
                block_table: &tables[0],
            },
            AttnSeq {
                q_start: 1,
                q_len: 4,
                ctx_len: 7,
                block_table: &tables[1],
            },
        ];
        let n = 5;
        let q: Vec<f64> = (0..n * heads * width).map(|_| rnd()).collect();
        let qf: Vec<f32> = q.iter().map(|&x| x as f32).collect();
        let mut out = vec![0f32; n * heads * v_width];
        let scale = 0.3;
        latent_attention(
            &pool, &cache, bs, width, &qf, heads, v_width, &seqs, scale, &mut out,
        );
        for tok in 0..n {
            let (s, pos) = if tok == 0 { (0, 9) } else { (1, 3 + tok - 1) };
            for h in 0..heads {
                let qh = &q[(tok * heads + h) * width..(tok * heads + h + 1) * width];
                let want = naive(&stored[s], qh, pos, v_width, scale as f64);
                let got = &out[(tok * heads + h) * v_width..(tok * heads + h + 1) * v_width];
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() < tol,
                        "token {tok} head {h}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn latent_attention_matches_a_naive_softmax_over_the_sequence_rows() {
        check::<f32>(1e-5);
        check::<bf16>(1e-5);
    }
}
