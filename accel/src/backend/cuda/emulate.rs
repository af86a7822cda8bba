//! Host transliterations of the trickiest kernels, checked against the CPU
//! reference. No GPU was available to run the kernels themselves; these
//! tests check the index arithmetic, the repacked layout, the integer-dot
//! algebra and the split/merge softmax the kernels are built on. Each
//! function follows its kernel in kernels.cu phase by phase (one loop over
//! "threads" per `__syncthreads` section), so a change to a kernel's
//! indexing must be mirrored here.

use super::plan::{self, ATT_TILE};
use super::weights::{self, Packed};
use crate::backend::HostMatrix;
use crate::ops::{self, AttnSeq, KvLayout};
use crate::quant::GgmlType;
use rand::{Rng, SeedableRng};

fn h2f(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn word(b: &[u8], i: usize) -> i32 {
    i32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// `dp4a.s32.s32`: four signed byte products added to `c`.
fn dp4a(a: i32, b: i32, c: i32) -> i32 {
    let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
    (0..4).fold(c, |acc, k| acc + (a[k] as i8 as i32) * (b[k] as i8 as i32))
}

/// `pg_quantize_x`.
fn quantize_x(x: &[f32]) -> (Vec<u8>, Vec<[f32; 2]>) {
    let mut xq = vec![0u8; x.len()];
    let mut xd = Vec::new();
    for (g, blk) in x.chunks_exact(32).enumerate() {
        let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut s = 0;
        for (lane, &v) in blk.iter().enumerate() {
            let q = ((v * id).round() as i32).clamp(-127, 127);
            xq[g * 32 + lane] = q as i8 as u8;
            s += q;
        }
        xd.push([d, s as f32]);
    }
    (xq, xd)
}

/// `pg_block_dot<TY>`.
fn block_dot(ty: GgmlType, wq: &[u8], xq: &[u8]) -> i32 {
    let xs: Vec<i32> = (0..8).map(|k| word(xq, 4 * k)).collect();
    let mut acc = 0;
    if ty == GgmlType::Q8_0 {
        for (k, &x) in xs.iter().enumerate() {
            acc = dp4a(word(wq, 4 * k), x, acc);
        }
    } else {
        for k in 0..4 {
            let w = word(wq, 4 * k);
            acc = dp4a(w & 0x0f0f0f0f, xs[k], acc);
            acc = dp4a((w >> 4) & 0x0f0f0f0f, xs[4 + k], acc);
        }
    }
    acc
}

/// `pg_mmvq<TY>` over the whole grid.
fn mmvq(
    ty: GgmlType,
    p: &Packed,
    n: usize,
    nb: usize,
    xq: &[u8],
    xd: &[[f32; 2]],
    m: usize,
) -> Vec<f32> {
    let qb = if ty == GgmlType::Q8_0 { 32 } else { 16 };
    let mut out = vec![0f32; m * n];
    for feat in 0..n {
        for r in 0..m {
            let mut acc = 0f32;
            for b in 0..nb {
                let wb = feat * nb + b;
                let wq = &p.bytes[wb * qb..wb * qb + qb];
                let (dw, mw) = if ty == GgmlType::Q4_1 {
                    let o = p.scale_off + 4 * wb;
                    (h2f(&p.bytes, o), h2f(&p.bytes, o + 2))
                } else {
                    (h2f(&p.bytes, p.scale_off + 2 * wb), 0.0)
                };
                let xb = r * nb + b;
                let dot = block_dot(ty, wq, &xq[xb * 32..xb * 32 + 32]);
                let [dx, sx] = xd[xb];
                acc += match ty {
                    GgmlType::Q4_0 => dw * dx * (dot - 8 * sx as i32) as f32,
                    GgmlType::Q4_1 => dw * dx * dot as f32 + mw * dx * sx,
                    _ => dw * dx * dot as f32,
                };
            }
            out[r * n + feat] = acc;
        }
    }
    out
}

/// `pg_mmq<TY>` over the whole grid, phase by phase.
#[allow(clippy::too_many_arguments)]
fn mmq(
    ty: GgmlType,
    p: &Packed,
    n: usize,
    nb: usize,
    xq: &[u8],
    xd: &[[f32; 2]],
    m: usize,
) -> Vec<f32> {
    const TILE: usize = 64;
    const KB: usize = 4;
    const STRIDE: usize = KB * 8 + 1;
    let xw = |i: usize| word(xq, 4 * i);
    let ww = |i: usize| word(&p.bytes, 4 * i);
    let mut out = vec![f32::NAN; m * n];
    for f0 in (0..n).step_by(TILE) {
        for r0 in (0..m).step_by(TILE) {
            let mut acc = vec![[[0f32; 4]; 4]; 256];
            let mut b0 = 0;
            while b0 < nb {
                let mut x_s = vec![0i32; TILE * STRIDE];
                let mut w_s = vec![0i32; TILE * STRIDE];
                let mut xd_s = vec![[0f32; 2]; TILE * KB];
                let mut wd_s = vec![[0f32; 2]; TILE * KB];
                for idx in 0..TILE * KB * 8 {
                    let (row, c) = (idx / (KB * 8), idx % (KB * 8));
                    let b = b0 + c / 8;
                    if r0 + row < m && b < nb {
                        x_s[row * STRIDE + c] = xw(((r0 + row) * nb + b) * 8 + c % 8);
                    }
                }
                if ty == GgmlType::Q8_0 {
                    for idx in 0..TILE * KB * 8 {
                        let (f, c) = (idx / (KB * 8), idx % (KB * 8));
                        let b = b0 + c / 8;
                        if f0 + f < n && b < nb {
                            w_s[f * STRIDE + c] = ww(((f0 + f) * nb + b) * 8 + c % 8);
                        }
                    }
                } else {
                    for idx in 0..TILE * KB * 4 {
                        let (f, rem) = (idx / (KB * 4), idx % (KB * 4));
                        let (blk, k) = (rem / 4, rem % 4);
                        let v = if f0 + f < n && b0 + blk < nb {
                            ww(((f0 + f) * nb + b0 + blk) * 4 + k)
                        } else {
                            0
                        };
                        w_s[f * STRIDE + blk * 8 + k] = v & 0x0f0f0f0f;
                        w_s[f * STRIDE + blk * 8 + 4 + k] = (v >> 4) & 0x0f0f0f0f;
                    }
                }
                for idx in 0..TILE * KB {
                    let (t, blk) = (idx / KB, idx % KB);
                    let b = b0 + blk;
                    if r0 + t < m && b < nb {
                        xd_s[idx] = xd[(r0 + t) * nb + b];
                    }
                    if f0 + t < n && b < nb {
                        let wb = (f0 + t) * nb + b;
                        wd_s[idx] = if ty == GgmlType::Q4_1 {
                            let o = p.scale_off + 4 * wb;
                            [h2f(&p.bytes, o), h2f(&p.bytes, o + 2)]
                        } else {
                            [h2f(&p.bytes, p.scale_off + 2 * wb), 0.0]
                        };
                    }
                }
                for (tid, a) in acc.iter_mut().enumerate() {
                    let (tx, ty_) = (tid % 16, tid / 16);
                    for blk in (0..KB).take_while(|&blk| b0 + blk < nb) {
                        for (i, ai) in a.iter_mut().enumerate() {
                            let r = ty_ + 16 * i;
                            let xs = xd_s[r * KB + blk];
                            for (j, aij) in ai.iter_mut().enumerate() {
                                let f = tx + 16 * j;
                                let dot = (0..8).fold(0, |d, c| {
                                    dp4a(
                                        w_s[f * STRIDE + blk * 8 + c],
                                        x_s[r * STRIDE + blk * 8 + c],
                                        d,
                                    )
                                });
                                let ws = wd_s[f * KB + blk];
                                *aij += match ty {
                                    GgmlType::Q4_0 => {
                                        ws[0] * xs[0] * (dot - 8 * xs[1] as i32) as f32
                                    }
                                    GgmlType::Q4_1 => {
                                        ws[0] * xs[0] * dot as f32 + ws[1] * xs[0] * xs[1]
                                    }
                                    _ => ws[0] * xs[0] * dot as f32,
                                };
                            }
                        }
                    }
                }
                b0 += KB;
            }
            for (tid, a) in acc.iter().enumerate() {
                let (tx, ty_) = (tid % 16, tid / 16);
                for (i, ai) in a.iter().enumerate() {
                    for (j, &aij) in ai.iter().enumerate() {
                        let (r, f) = (r0 + ty_ + 16 * i, f0 + tx + 16 * j);
                        if r < m && f < n {
                            out[r * n + f] = aij;
                        }
                    }
                }
            }
        }
    }
    out
}

/// The tiled kernel computes what the matrix-vector kernel does, including
/// ragged edges: rows and features not multiples of 64, and a block count
/// not a multiple of the K chunk.
#[test]
fn tiled_matmul_matches_the_matrix_vector_kernel() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (n, k, m) = (70, 32 * 6, 67);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let (xq, xd) = quantize_x(&x);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let hm = quantized(ty, n, k, &w);
        let p = weights::pack(ty, n, k, hm.bytes()).expect("packable");
        let want = mmvq(ty, &p, n, k / 32, &xq, &xd, m);
        let got = mmq(ty, &p, n, k / 32, &xq, &xd, m);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{ty:?} element {i}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn mmvq_matches_the_dequantized_product() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (n, k, m) = (5, 128, 3);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let hm = quantized(ty, n, k, &w);
        let wd = hm.dequantize().expect("dequantize");
        let p = weights::pack(ty, n, k, hm.bytes()).expect("packable");
        let (xq, xd) = quantize_x(&x);
        let got = mmvq(ty, &p, n, k / 32, &xq, &xd, m);
        for r in 0..m {
            for f in 0..n {
                let want: f32 = (0..k).map(|j| x[r * k + j] * wd[f * k + j]).sum();
                let g = got[r * n + f];
                // Only the activations' int8 rounding separates the two.
                assert!(
                    (g - want).abs() < 0.05 * (1.0 + want.abs()),
                    "{ty:?} r{r} f{f}: {g} vs {want}"
                );
            }
        }
    }
}

/// A `rows × cols` matrix of `ty` quantized from `w`, through the crate's
/// quantizer.
fn quantized(ty: GgmlType, rows: usize, cols: usize, w: &[f32]) -> HostMatrix<'static> {
    let row_bytes = ty.row_bytes(cols).expect("block multiple");
    let mut data = vec![0u8; rows * row_bytes];
    for (src, dst) in w.chunks_exact(cols).zip(data.chunks_exact_mut(row_bytes)) {
        crate::quant::formats::quantize_row(ty, src, dst);
    }
    HostMatrix::new(ty, rows, cols, data).expect("valid matrix")
}

/// `pg_weight_at` (what `pg_embed` reads).
fn weight_at(ty: GgmlType, p: &Packed, nb: usize, r: usize, j: usize) -> f32 {
    let blk = r * nb + j / 32;
    let e = j % 32;
    let b = &p.bytes;
    match ty {
        GgmlType::Q4_0 => {
            let byte = b[blk * 16 + e % 16];
            let q = if e < 16 { byte & 15 } else { byte >> 4 } as i32;
            (q - 8) as f32 * h2f(b, p.scale_off + 2 * blk)
        }
        GgmlType::Q4_1 => {
            let byte = b[blk * 16 + e % 16];
            let q = if e < 16 { byte & 15 } else { byte >> 4 } as f32;
            q * h2f(b, p.scale_off + 4 * blk) + h2f(b, p.scale_off + 4 * blk + 2)
        }
        GgmlType::Q8_0 => (b[blk * 32 + e] as i8) as f32 * h2f(b, p.scale_off + 2 * blk),
        _ => unreachable!("quantized types only"),
    }
}

#[test]
fn embedding_reads_the_packed_layout_exactly() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (n, k) = (4, 64);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let hm = quantized(ty, n, k, &w);
        let wd = hm.dequantize().expect("dequantize");
        let p = weights::pack(ty, n, k, hm.bytes()).expect("packable");
        for r in 0..n {
            for j in 0..k {
                assert_eq!(
                    weight_at(ty, &p, k / 32, r, j),
                    wd[r * k + j],
                    "{ty:?} {r} {j}"
                );
            }
        }
    }
}

/// `pg_write_kv<KvF32>`.
fn write_kv(l: &KvLayout, k: &[f32], v: &[f32], slots: &[u32], kc: &mut [f32], vc: &mut [f32]) {
    let (d, bs) = (l.head_dim, l.block_size);
    let row = l.n_kv_heads * d;
    for i in 0..slots.len() * row {
        let t = i / row;
        let (h, e) = ((i % row) / d, i % d);
        let slot = slots[t] as usize;
        let (blk, off) = (slot / bs, slot % bs);
        let slab = blk * l.n_kv_heads + h;
        kc[(slab * d + e) * bs + off] = k[i];
        vc[(slab * bs + off) * d + e] = v[i];
    }
}

/// The step's `[n_seqs][4]` sequence array, as `upload_step` builds it.
struct Seq {
    q_start: usize,
    q_len: usize,
    ctx: usize,
    tstart: usize,
}

/// One block of `pg_attention<KvF32>`, phase by phase.
#[allow(clippy::too_many_arguments)]
fn attention_block(
    (x, h, s): (usize, usize, usize),
    q: &[f32],
    out: &mut [f32],
    kc: &[f32],
    vc: &[f32],
    seqs: &[Seq],
    tables: &[u32],
    (n_heads, n_kv, d, bs): (usize, usize, usize, usize),
    scale: f32,
    (nq, split_len, n_splits, decode): (usize, usize, usize, bool),
    part_o: &mut [f32],
    part_ml: &mut [f32],
) {
    let g_n = n_heads / n_kv;
    let sq = &seqs[s];
    if sq.q_len == 0 || decode != (sq.q_len == 1) {
        return;
    }
    let (q_first, n_rows_q, kv_start, kv_end);
    if decode {
        q_first = 0;
        n_rows_q = 1;
        kv_start = x * split_len;
        if kv_start >= sq.ctx {
            return;
        }
        kv_end = sq.ctx.min(kv_start + split_len);
    } else {
        q_first = x * nq;
        if q_first >= sq.q_len {
            return;
        }
        n_rows_q = nq.min(sq.q_len - q_first);
        kv_start = 0;
        kv_end = sq.ctx - sq.q_len + q_first + n_rows_q;
    }
    let (r_n, rd) = (n_rows_q * g_n, n_rows_q * g_n * d);
    let q_row = n_heads * d;
    let p0 = sq.ctx - sq.q_len + q_first;
    let mut q_s = vec![0f32; rd];
    for (e, qv) in q_s.iter_mut().enumerate() {
        let (r, i) = (e / d, e % d);
        let (qi, g) = (r / g_n, r % g_n);
        *qv = q[(sq.q_start + q_first + qi) * q_row + (h * g_n + g) * d + i] * scale;
    }
    let mut m_s = vec![f32::NEG_INFINITY; r_n];
    let mut l_s = vec![0f32; r_n];
    let mut a_s = vec![0f32; r_n];
    let mut acc = vec![0f32; rd];
    let mut kv_s = vec![0f32; ATT_TILE * (d + 1)];
    let mut s_s = vec![0f32; r_n * ATT_TILE];
    let table = &tables[sq.tstart..];
    let mut t0 = kv_start;
    while t0 < kv_end {
        for idx in 0..ATT_TILE * d {
            let (j, i) = (idx % ATT_TILE, idx / ATT_TILE);
            let p = t0 + j;
            let mut val = 0.0;
            if p < kv_end {
                let slab = table[p / bs] as usize * n_kv + h;
                val = kc[(slab * d + i) * bs + p % bs];
            }
            kv_s[j * (d + 1) + i] = val;
        }
        for pr in 0..r_n * ATT_TILE {
            let (r, j) = (pr / ATT_TILE, pr % ATT_TILE);
            let p = t0 + j;
            let qpos = p0 + r / g_n;
            let mut sc = f32::NEG_INFINITY;
            if p < kv_end && p <= qpos {
                sc = (0..d).fold(0.0f32, |a, i| {
                    q_s[r * d + i].mul_add(kv_s[j * (d + 1) + i], a)
                });
            }
            s_s[r * ATT_TILE + j] = sc;
        }
        for r in 0..r_n {
            let row = &mut s_s[r * ATT_TILE..(r + 1) * ATT_TILE];
            let m_old = m_s[r];
            let m_new = row.iter().fold(m_old, |a, &v| a.max(v));
            let alpha = if m_old == f32::NEG_INFINITY {
                0.0
            } else {
                (m_old - m_new).exp()
            };
            let mut sum = 0.0;
            for v in row.iter_mut() {
                *v = if *v == f32::NEG_INFINITY {
                    0.0
                } else {
                    (*v - m_new).exp()
                };
                sum += *v;
            }
            l_s[r] = l_s[r] * alpha + sum;
            m_s[r] = m_new;
            a_s[r] = alpha;
        }
        for idx in 0..ATT_TILE * d {
            let (j, i) = (idx / d, idx % d);
            let p = t0 + j;
            let mut val = 0.0;
            if p < kv_end {
                let slab = table[p / bs] as usize * n_kv + h;
                val = vc[(slab * bs + p % bs) * d + i];
            }
            kv_s[j * (d + 1) + i] = val;
        }
        for (e, a) in acc.iter_mut().enumerate() {
            let (r, i) = (e / d, e % d);
            let mut v = *a * a_s[r];
            for j in 0..ATT_TILE {
                v = s_s[r * ATT_TILE + j].mul_add(kv_s[j * (d + 1) + i], v);
            }
            *a = v;
        }
        t0 += ATT_TILE;
    }
    let direct = !decode || n_splits == 1;
    for (e, &a) in acc.iter().enumerate() {
        let (r, i) = (e / d, e % d);
        let (qi, g) = (r / g_n, r % g_n);
        if direct {
            let l = l_s[r];
            out[(sq.q_start + q_first + qi) * q_row + (h * g_n + g) * d + i] =
                if l > 0.0 { a / l } else { 0.0 };
        } else {
            let part = (s * n_kv + h) * n_splits + x;
            part_o[(part * g_n + g) * d + i] = a;
        }
    }
    if !direct {
        for g in 0..g_n {
            let part = (s * n_kv + h) * n_splits + x;
            part_ml[2 * (part * g_n + g)] = m_s[g];
            part_ml[2 * (part * g_n + g) + 1] = l_s[g];
        }
    }
}

/// `pg_attn_merge` over the whole grid.
#[allow(clippy::too_many_arguments)]
fn merge(
    part_o: &[f32],
    part_ml: &[f32],
    seqs: &[Seq],
    (n_heads, n_kv, d): (usize, usize, usize),
    split_len: usize,
    n_splits: usize,
    out: &mut [f32],
) {
    let g_n = n_heads / n_kv;
    for (s, sq) in seqs.iter().enumerate() {
        if sq.q_len != 1 {
            continue;
        }
        for hq in 0..n_heads {
            let (h, g) = (hq / g_n, hq % g_n);
            let used = n_splits.min(sq.ctx.div_ceil(split_len));
            let base = (s * n_kv + h) * n_splits;
            let m = (0..used).fold(f32::NEG_INFINITY, |a, x| {
                a.max(part_ml[2 * ((base + x) * g_n + g)])
            });
            for i in 0..d {
                let (mut l, mut o) = (0.0f32, 0.0f32);
                for x in 0..used {
                    let pg = (base + x) * g_n + g;
                    let mx = part_ml[2 * pg];
                    let w = if mx == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (mx - m).exp()
                    };
                    l += part_ml[2 * pg + 1] * w;
                    o += part_o[pg * d + i] * w;
                }
                out[sq.q_start * n_heads * d + hq * d + i] = if l > 0.0 { o / l } else { 0.0 };
            }
        }
    }
}

/// The CUDA attention pipeline (write_kv, the decode and prefill launches,
/// the merge) against `ops::write_kv` and `ops::paged_attention`, on a
/// step mixing a long decode (split), a short decode, a prefill chunk after
/// cached context and a fresh prefill, with scattered blocks.
#[test]
fn attention_pipeline_matches_the_cpu() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (n_heads, n_kv, d, bs) = (8, 2, 32, 16);
    let layout = KvLayout {
        num_blocks: 64,
        block_size: bs,
        n_kv_heads: n_kv,
        head_dim: d,
    };
    // (cached before the step, new tokens this step)
    let shapes = [(700usize, 1usize), (5, 1), (40, 23), (0, 37)];
    let mut free: Vec<u32> = (0..layout.num_blocks as u32).rev().collect();
    free.swap(3, 40);
    let mut seqs = Vec::new();
    let mut tables = Vec::new();
    let (mut pre_slots, mut step_slots) = (Vec::new(), Vec::new());
    let mut q_start = 0;
    for &(cached, new) in &shapes {
        let ctx = cached + new;
        let table: Vec<u32> = (0..ctx.div_ceil(bs))
            .map(|_| free.pop().expect("enough blocks"))
            .collect();
        for p in 0..ctx {
            let slot = table[p / bs] * bs as u32 + (p % bs) as u32;
            if p < cached {
                pre_slots.push(slot)
            } else {
                step_slots.push(slot)
            }
        }
        seqs.push(Seq {
            q_start,
            q_len: new,
            ctx,
            tstart: tables.len(),
        });
        tables.extend_from_slice(&table);
        q_start += new;
    }
    let n_tok = q_start;
    let row = n_kv * d;
    let rand_vec = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let (k_pre, v_pre) = (
        rand_vec(&mut rng, pre_slots.len() * row),
        rand_vec(&mut rng, pre_slots.len() * row),
    );
    let (k_new, v_new) = (
        rand_vec(&mut rng, n_tok * row),
        rand_vec(&mut rng, n_tok * row),
    );
    let q = rand_vec(&mut rng, n_tok * n_heads * d);

    let (mut kc, mut vc) = (vec![0f32; layout.elems()], vec![0f32; layout.elems()]);
    let (mut kc_ref, mut vc_ref) = (kc.clone(), vc.clone());
    for (k, v, slots) in [(&k_pre, &v_pre, &pre_slots), (&k_new, &v_new, &step_slots)] {
        write_kv(&layout, k, v, slots, &mut kc, &mut vc);
        ops::write_kv(&layout, &mut kc_ref, &mut vc_ref, k, v, slots);
    }
    assert_eq!(kc, kc_ref, "K layout");
    assert_eq!(vc, vc_ref, "V layout");

    let scale = 1.0 / (d as f32).sqrt();
    let max_decode_ctx = seqs
        .iter()
        .filter(|s| s.q_len == 1)
        .map(|s| s.ctx)
        .max()
        .unwrap_or(0);
    let max_prefill_q = seqs
        .iter()
        .filter(|s| s.q_len > 1)
        .map(|s| s.q_len)
        .max()
        .unwrap_or(0);
    // Few SMs relative to the work would give one split; pretend a big GPU
    // so the long decode is split.
    let p = plan::plan_attention(n_heads, n_kv, d, max_decode_ctx, seqs.len(), 132);
    assert!(p.n_splits > 1, "{p:?}");
    assert!(p.nq > 1 && p.nq < 37, "{p:?}"); // the fresh prefill spans two tiles
    let dims = (n_heads, n_kv, d, bs);
    let mut out = vec![f32::NAN; n_tok * n_heads * d];
    let parts = seqs.len() * n_kv * p.n_splits * p.group;
    let (mut part_o, mut part_ml) = (vec![0f32; parts * d], vec![0f32; 2 * parts]);
    for s in 0..seqs.len() {
        for h in 0..n_kv {
            for x in 0..p.n_splits {
                attention_block(
                    (x, h, s),
                    &q,
                    &mut out,
                    &kc,
                    &vc,
                    &seqs,
                    &tables,
                    dims,
                    scale,
                    (1, p.split_len, p.n_splits, true),
                    &mut part_o,
                    &mut part_ml,
                );
            }
            for x in 0..max_prefill_q.div_ceil(p.nq) {
                attention_block(
                    (x, h, s),
                    &q,
                    &mut out,
                    &kc,
                    &vc,
                    &seqs,
                    &tables,
                    dims,
                    scale,
                    (p.nq, 0, 1, false),
                    &mut part_o,
                    &mut part_ml,
                );
            }
        }
    }
    merge(
        &part_o,
        &part_ml,
        &seqs,
        (n_heads, n_kv, d),
        p.split_len,
        p.n_splits,
        &mut out,
    );

    let pool = crate::ThreadPool::new(1);
    let attn: Vec<AttnSeq<'_>> = seqs
        .iter()
        .map(|s| AttnSeq {
            q_start: s.q_start,
            q_len: s.q_len,
            ctx_len: s.ctx,
            block_table: &tables[s.tstart..s.tstart + s.ctx.div_ceil(bs)],
        })
        .collect();
    let mut want = vec![0f32; out.len()];
    ops::paged_attention(
        &pool, &layout, &kc_ref, &vc_ref, &q, n_heads, &attn, scale, None, &mut want,
    );
    for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
        assert!((g - w).abs() < 1e-4, "element {i}: {g} vs {w}");
    }
}

// ---------------------------------------------------------------------------
// Sampling: pg_sample_process, pg_sample_pick and pg_sample_logprobs, one
// block per row of `plan::SAMPLE_THREADS` threads, against `ops::sample`.
// ---------------------------------------------------------------------------

use crate::ops::sample::{
    sample_rows, RowSampling, SampleScratch, SampledRows, SamplingMetadata, NO_MASK, NO_TOKEN,
};

const ST: usize = plan::SAMPLE_THREADS as usize;
const FX_ONE: f64 = 4611686018427387904.0;

/// `pg_order_key`.
fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// `pg_key_float`.
fn key_float(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & 0x7fff_ffff } else { !k })
}

/// `pg_fx`.
fn fx(p: f32) -> u64 {
    if p > 0.0 {
        (p as f64 * FX_ONE) as u64
    } else {
        0
    }
}

/// Thread `tid`'s contiguous segment of `n` (the ordered scans).
fn segment(n: usize, tid: usize) -> (usize, usize) {
    let len = n.div_ceil(ST);
    let lo = n.min(tid * len);
    (lo, n.min(lo + len))
}

/// The metadata as the kernels read it (what `sample_launch` uploads).
struct SamplePacked {
    rows_u: Vec<u32>,
    rows_f: Vec<f32>,
    uniform: Vec<f64>,
    raw_rows: usize,
}

fn pack(meta: &SamplingMetadata, out: &SampledRows) -> SamplePacked {
    let mut p = SamplePacked {
        rows_u: Vec::new(),
        rows_f: Vec::new(),
        uniform: Vec::new(),
        raw_rows: 0,
    };
    for (r, s) in meta.rows().iter().enumerate() {
        let mut flags = 0;
        if s.greedy {
            flags |= plan::SAMPLE_GREEDY;
        }
        let slot = p.raw_rows as u32;
        if s.logprobs.is_some() {
            flags |= plan::SAMPLE_LOGPROBS;
            p.raw_rows += 1;
        }
        if crate::ops::sample::restricted(meta, r) {
            flags |= plan::SAMPLE_RESTRICTED;
        }
        p.rows_u.extend_from_slice(&[
            s.logit_row,
            flags,
            s.top_k,
            s.logprobs.unwrap_or(0),
            meta.mask_at()[r],
            out.top_ids.offsets()[r],
            slot,
            0,
        ]);
        p.rows_f.extend_from_slice(&[
            s.temperature,
            s.top_p,
            s.min_p,
            s.repetition_penalty,
            s.presence_penalty,
            s.frequency_penalty,
            0.0,
            0.0,
        ]);
        p.uniform.push(s.uniform);
    }
    p
}

/// `pg_sample_process` over the grid.
fn sample_process(
    logits: &mut [f32],
    raw: &mut [f32],
    vocab: usize,
    meta: &SamplingMetadata,
    pk: &SamplePacked,
) {
    let words = vocab.div_ceil(32);
    let neg = f32::NEG_INFINITY;
    for r in 0..meta.num_rows() {
        let pu = &pk.rows_u[r * plan::SAMPLE_U..(r + 1) * plan::SAMPLE_U];
        let pf = &pk.rows_f[r * plan::SAMPLE_F..(r + 1) * plan::SAMPLE_F];
        let row = &mut logits[pu[0] as usize * vocab..(pu[0] as usize + 1) * vocab];
        let (mut allowed, mut seen) = (vec![0u32; words], vec![0u32; words]);
        if pu[1] & plan::SAMPLE_LOGPROBS != 0 {
            let s = pu[6] as usize;
            raw[s * vocab..(s + 1) * vocab].copy_from_slice(row);
        }
        let allow = meta.allowed().row(r);
        if !allow.is_empty() {
            for tid in 0..ST {
                for &t in allow.iter().skip(tid).step_by(ST) {
                    if (t as usize) < vocab {
                        allowed[t as usize / 32] |= 1 << (t % 32);
                    }
                }
            }
            for (j, l) in row.iter_mut().enumerate() {
                if (allowed[j / 32] >> (j % 32)) & 1 == 0 {
                    *l = neg;
                }
            }
        }
        let (bias_tok, bias_val) = meta.biases();
        let from = bias_tok.offsets()[r] as usize;
        for (i, &t) in bias_tok.row(r).iter().enumerate() {
            if (t as usize) < vocab {
                row[t as usize] += bias_val[from + i];
            }
        }
        let rp = pf[3];
        if rp != 1.0 {
            for tid in 0..ST {
                for &t in meta.penalized().row(r).iter().skip(tid).step_by(ST) {
                    if t as usize >= vocab {
                        continue;
                    }
                    let bit = 1u32 << (t % 32);
                    let old = seen[t as usize / 32];
                    seen[t as usize / 32] |= bit;
                    if old & bit == 0 {
                        let l = row[t as usize];
                        row[t as usize] = if l > 0.0 { l / rp } else { l * rp };
                    }
                }
            }
        }
        let (pp, fp) = (pf[4], pf[5]);
        if pp != 0.0 || fp != 0.0 {
            let (tok, cnt) = meta.output_counts();
            let from = tok.offsets()[r] as usize;
            for (i, &t) in tok.row(r).iter().enumerate() {
                if (t as usize) < vocab {
                    row[t as usize] -= pp + fp * cnt[from + i] as f32;
                }
            }
        }
        for &t in meta.banned().row(r) {
            if (t as usize) < vocab {
                row[t as usize] = neg;
            }
        }
        if pu[4] != NO_MASK {
            let m = &meta.masks()[pu[4] as usize..];
            for (j, l) in row.iter_mut().enumerate() {
                if (m[j / 32] >> (j % 32)) & 1 == 0 {
                    *l = neg;
                }
            }
        }
    }
}

/// `pg_block_argmax`: per-thread strided scans, then the tree.
fn block_argmax(x: &[f32]) -> u32 {
    let mut v = [f32::NEG_INFINITY; ST];
    let mut id = [NO_TOKEN; ST];
    for tid in 0..ST {
        for j in (tid..x.len()).step_by(ST) {
            if x[j] > v[tid] {
                v[tid] = x[j];
                id[tid] = j as u32;
            }
        }
    }
    let mut s = ST / 2;
    while s > 0 {
        for tid in 0..s {
            let (ov, oi) = (v[tid + s], id[tid + s]);
            if ov > v[tid] || (ov == v[tid] && oi < id[tid]) {
                v[tid] = ov;
                id[tid] = oi;
            }
        }
        s /= 2;
    }
    id[0]
}

/// `pg_block_sum_d`: per-thread partials, then the tree.
fn tree_sum_d(mut part: [f64; ST]) -> f64 {
    let mut s = ST / 2;
    while s > 0 {
        for tid in 0..s {
            part[tid] += part[tid + s];
        }
        s /= 2;
    }
    part[0]
}

/// `pg_select_kth`.
// Index loops mirror the kernel's threads and segments.
#[allow(clippy::needless_range_loop)]
fn select_kth(p: &[f32], k: u32) -> (u32, u32) {
    let (mut prefix, mut mask, mut rem) = (0u32, 0u32, k);
    for pass in 0..4 {
        let shift = 24 - 8 * pass;
        let mut hist = [0u32; 256];
        for &v in p {
            let key = order_key(v);
            if key & mask == prefix {
                hist[((key >> shift) & 255) as usize] += 1;
            }
        }
        let mut b = 255usize;
        while b > 0 && rem > hist[b] {
            rem -= hist[b];
            b -= 1;
        }
        prefix |= (b as u32) << shift;
        mask |= 255 << shift;
    }
    let mut counts = [0u64; ST];
    for (tid, c) in counts.iter_mut().enumerate() {
        let (lo, hi) = segment(p.len(), tid);
        *c = (lo..hi).filter(|&j| order_key(p[j]) == prefix).count() as u64;
    }
    let mut id = NO_TOKEN;
    let mut before = 0u64;
    for (tid, &c) in counts.iter().enumerate() {
        if before < rem as u64 && rem as u64 <= before + c {
            let (lo, hi) = segment(p.len(), tid);
            let mut seen = before;
            for j in lo..hi {
                if order_key(p[j]) == prefix {
                    seen += 1;
                    if seen == rem as u64 {
                        id = j as u32;
                        break;
                    }
                }
            }
        }
        before += c;
    }
    (prefix, id)
}

/// `pg_upto`.
fn upto(key: u32, j: usize, lim: (u32, u32)) -> bool {
    key > lim.0 || (key == lim.0 && j as u32 <= lim.1)
}

/// `pg_mass_upto` (integer sums: any order gives the same).
fn mass_upto(p: &[f32], lim: (u32, u32), floor_p: f32) -> u64 {
    p.iter()
        .enumerate()
        .filter(|&(j, &v)| upto(order_key(v), j, lim) && v >= floor_p)
        .map(|(_, &v)| fx(v))
        .sum()
}

/// `pg_cross`.
// Index loops mirror the kernel's threads and segments.
#[allow(clippy::needless_range_loop)]
fn cross(p: &[f32], lim: (u32, u32), floor_p: f32, target: u64) -> Option<(u32, u32)> {
    let in_set = |j: usize, v: f32| upto(order_key(v), j, lim) && v >= floor_p;
    let (mut prefix, mut mask, mut acc) = (0u32, 0u32, 0u64);
    for pass in 0..4 {
        let shift = 24 - 8 * pass;
        let (mut hist, mut hmass) = ([0u32; 256], [0u64; 256]);
        for (j, &v) in p.iter().enumerate() {
            let key = order_key(v);
            if key & mask == prefix && in_set(j, v) {
                let d = ((key >> shift) & 255) as usize;
                hist[d] += 1;
                hmass[d] += fx(v);
            }
        }
        let mut word = None;
        for b in (0..256).rev() {
            if hist[b] > 0 && acc + hmass[b] >= target {
                word = Some(b as u32);
                break;
            }
            acc += hmass[b];
        }
        prefix |= word? << shift;
        mask |= 255 << shift;
    }
    let mut id = NO_TOKEN;
    let mut run_start = acc;
    for tid in 0..ST {
        let (lo, hi) = segment(p.len(), tid);
        let ties = |j: usize| order_key(p[j]) == prefix && in_set(j, p[j]);
        let (m, c): (u64, u32) = (lo..hi)
            .filter(|&j| ties(j))
            .fold((0, 0), |(m, c), j| (m + fx(p[j]), c + 1));
        if c > 0 && run_start + m >= target {
            let mut run = run_start;
            for j in lo..hi {
                if ties(j) {
                    run += fx(p[j]);
                    if run >= target {
                        id = id.min(j as u32);
                        break;
                    }
                }
            }
        }
        run_start += m;
    }
    Some((prefix, id))
}

/// `pg_draw_in_order`.
// Index loops mirror the kernel's threads and segments.
#[allow(clippy::needless_range_loop)]
fn draw_in_order(p: &[f32], target: u64) -> u32 {
    let mut cross = NO_TOKEN;
    let mut run_start = 0u64;
    for tid in 0..ST {
        let (lo, hi) = segment(p.len(), tid);
        let m: u64 = p[lo..hi].iter().map(|&v| fx(v)).sum();
        if hi > lo && run_start + m >= target {
            let mut run = run_start;
            for j in lo..hi {
                run += fx(p[j]);
                if run >= target {
                    cross = cross.min(j as u32);
                    break;
                }
            }
        }
        run_start += m;
    }
    if cross != NO_TOKEN {
        let mut first = NO_TOKEN;
        for tid in 0..ST {
            for j in (cross as usize + tid..p.len()).step_by(ST) {
                if p[j] > 0.0 {
                    first = first.min(j as u32);
                    break;
                }
            }
        }
        if first != NO_TOKEN {
            return first;
        }
    }
    match block_argmax(p) {
        NO_TOKEN => 0,
        a => a,
    }
}

/// `pg_sample_pick` over the grid.
// Index loops mirror the kernel's threads and segments.
#[allow(clippy::needless_range_loop)]
fn sample_pick(logits: &mut [f32], vocab: usize, pk: &SamplePacked, tokens: &mut [u32]) {
    for (r, token) in tokens.iter_mut().enumerate() {
        let pu = &pk.rows_u[r * plan::SAMPLE_U..(r + 1) * plan::SAMPLE_U];
        let pf = &pk.rows_f[r * plan::SAMPLE_F..(r + 1) * plan::SAMPLE_F];
        let p = &mut logits[pu[0] as usize * vocab..(pu[0] as usize + 1) * vocab];
        let flags = pu[1];
        if flags & plan::SAMPLE_GREEDY != 0 {
            *token = match block_argmax(p) {
                NO_TOKEN if flags & plan::SAMPLE_RESTRICTED == 0 => 0,
                t => t,
            };
            continue;
        }
        if flags & plan::SAMPLE_RESTRICTED != 0 && !p.iter().any(|&v| v > f32::NEG_INFINITY) {
            *token = NO_TOKEN;
            continue;
        }
        let inv_t = 1.0f32 / pf[0];
        let mut mx = [f32::NEG_INFINITY; ST];
        for tid in 0..ST {
            for j in (tid..vocab).step_by(ST) {
                if inv_t != 1.0 {
                    p[j] *= inv_t;
                }
                mx[tid] = mx[tid].max(p[j]);
            }
        }
        let mx = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut part = [0f64; ST];
        for (tid, s) in part.iter_mut().enumerate() {
            for j in (tid..vocab).step_by(ST) {
                let e = (p[j] - mx).exp();
                p[j] = e;
                *s += e as f64;
            }
        }
        let inv = (1.0 / tree_sum_d(part)) as f32;
        for v in p.iter_mut() {
            *v *= inv;
        }
        let u = pk.uniform[r];
        let top_k = if pu[2] > 0 {
            pu[2].min(vocab as u32)
        } else {
            vocab as u32
        };
        let (top_p, min_p) = (pf[1], pf[2]);
        if top_k == vocab as u32 && top_p >= 1.0 && min_p <= 0.0 {
            *token = draw_in_order(p, (u * FX_ONE) as u64);
            continue;
        }
        let mut k = if top_k < vocab as u32 {
            top_k
        } else {
            64.min(vocab as u32)
        };
        let (mut lim, mut kept);
        loop {
            lim = select_kth(p, k);
            kept = mass_upto(p, lim, f32::NEG_INFINITY);
            if k == top_k || k == vocab as u32 || kept >= (top_p as f64 * FX_ONE) as u64 {
                break;
            }
            k = (k * 8).min(top_k).min(vocab as u32);
        }
        let first = select_kth(p, 1);
        if top_p < 1.0 {
            if let Some(c) = cross(
                p,
                lim,
                f32::NEG_INFINITY,
                (top_p as f64 * kept as f64) as u64,
            ) {
                lim = c;
            }
        }
        let floor_p = if min_p > 0.0 {
            key_float(first.0) * min_p
        } else {
            f32::NEG_INFINITY
        };
        let sum = mass_upto(p, lim, floor_p);
        *token = match cross(p, lim, floor_p, (u * sum as f64) as u64) {
            Some((_, id)) => id,
            None => first.1,
        };
    }
}

/// `pg_sample_logprobs` over the grid.
#[allow(clippy::too_many_arguments)]
fn sample_logprobs(
    raw: &[f32],
    vocab: usize,
    pk: &SamplePacked,
    tokens: &[u32],
    lp_out: &mut [f32],
    rank_out: &mut [u32],
    top_ids: &mut [u32],
    top_lps: &mut [f32],
) {
    for r in 0..tokens.len() {
        let pu = &pk.rows_u[r * plan::SAMPLE_U..(r + 1) * plan::SAMPLE_U];
        if pu[1] & plan::SAMPLE_LOGPROBS == 0 {
            continue;
        }
        let x = &raw[pu[6] as usize * vocab..(pu[6] as usize + 1) * vocab];
        let mx = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut part = [0f64; ST];
        for (tid, s) in part.iter_mut().enumerate() {
            for j in (tid..vocab).step_by(ST) {
                *s += ((x[j] - mx) as f64).exp();
            }
        }
        let lse = mx as f64 + tree_sum_d(part).ln();
        let token = tokens[r];
        if token == NO_TOKEN || token as usize >= vocab {
            lp_out[r] = 0.0;
            rank_out[r] = 0;
            continue;
        }
        let lp = |j: usize| (x[j] as f64 - lse) as f32;
        let chosen = lp(token as usize);
        lp_out[r] = chosen;
        rank_out[r] = (0..vocab).filter(|&j| lp(j) > chosen).count() as u32 + 1;
        let (k, off) = ((pu[3] as usize).min(vocab), pu[5] as usize);
        let mut prev: Option<(u32, u32)> = None;
        for i in 0..k {
            let mut best: Option<(u32, u32)> = None;
            for j in 0..vocab {
                let key = order_key(lp(j));
                let after = prev.is_none_or(|(pk, pi)| key < pk || (key == pk && j as u32 > pi));
                if after && best.is_none_or(|(bk, bi)| key > bk || (key == bk && (j as u32) < bi)) {
                    best = Some((key, j as u32));
                }
            }
            let Some((bk, bi)) = best else { break };
            top_ids[off + i] = bi;
            top_lps[off + i] = key_float(bk);
            prev = best;
        }
    }
}

/// The three sampling kernels, as `CudaBackend::sample` launches them,
/// against `ops::sample_rows` on rows with every processor, greedy and
/// sampled rows mixed, ties, masks and skipped logit rows. The processors
/// are exact in both; the softmax's `exp` and the order of its sum differ,
/// and the kernels keep masses in fixed point where the CPU sums f64, so
/// only a draw landing within rounding of a boundary could differ (none
/// does here); logprobs agree to rounding.
#[test]
fn sampling_kernels_match_the_cpu_op() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(46);
    let pool = crate::ThreadPool::new(1);
    let (mut scratch, mut want, mut got) = (
        SampleScratch::default(),
        SampledRows::default(),
        SampledRows::default(),
    );
    let mut meta = SamplingMetadata::default();
    let mut compared = 0;
    for case in 0..40 {
        let vocab = [50usize, 700, 5000, 40_000][case % 4];
        let n = 1 + case % 6;
        let total_rows = 2 * n;
        let ties = case % 3 == 0;
        let logits: Vec<f32> = (0..total_rows * vocab)
            .map(|i| {
                if ties {
                    rng.random_range(0..5) as f32 * 0.5
                } else if i % 89 == 5 {
                    rng.random_range(4.0f32..9.0)
                } else {
                    rng.random_range(-4.0f32..2.0)
                }
            })
            .collect();
        meta.clear(vocab);
        for i in 0..n {
            let any = |rng: &mut rand::rngs::StdRng| rng.random_range(0..vocab as u32 + 2);
            meta.push_row(RowSampling {
                logit_row: (2 * i + 1) as u32,
                greedy: rng.random_bool(0.3),
                temperature: [0.5f32, 1.0, 1.3][rng.random_range(0..3)],
                top_k: [0u32, 0, 3, 40, 100_000][rng.random_range(0..5)],
                top_p: [1.0f32, 0.9, 0.6][rng.random_range(0..3)],
                min_p: [0.0f32, 0.0, 0.05][rng.random_range(0..3)],
                uniform: rng.random(),
                logprobs: [None, Some(0), Some(4)][rng.random_range(0..3)],
                repetition_penalty: [1.0f32, 1.3][rng.random_range(0..2)],
                presence_penalty: [0.0f32, 0.4][rng.random_range(0..2)],
                frequency_penalty: [0.0f32, 0.25][rng.random_range(0..2)],
            });
            let pen: Vec<u32> = (0..rng.random_range(0..40))
                .map(|_| any(&mut rng))
                .collect();
            meta.penalize(&pen);
            let mut outs: Vec<u32> = (0..rng.random_range(0..10))
                .map(|_| any(&mut rng))
                .collect();
            outs.sort_unstable();
            outs.dedup();
            for t in outs {
                meta.count_output(t, rng.random_range(1..4));
            }
            for _ in 0..rng.random_range(0..4) {
                let t = any(&mut rng);
                meta.bias(t, rng.random_range(-3.0f32..3.0));
            }
            if rng.random_bool(0.3) {
                for _ in 0..3 {
                    let t = any(&mut rng);
                    meta.ban(t);
                }
            }
            if rng.random_bool(0.25) {
                let allowed: Vec<u32> = (0..vocab as u32 / 3).map(|_| any(&mut rng)).collect();
                meta.allow(&allowed);
            }
            if rng.random_bool(0.25) {
                let words: Vec<u32> = (0..meta.mask_words()).map(|_| rng.random()).collect();
                meta.mask(&words);
            }
        }
        let mut cpu = logits.clone();
        sample_rows(&pool, &mut cpu, vocab, &meta, &mut scratch, &mut want);

        got.shape_for(&meta);
        let pk = pack(&meta, &got);
        let mut dev = logits.clone();
        let mut raw = vec![0f32; pk.raw_rows * vocab];
        sample_process(&mut dev, &mut raw, vocab, &meta, &pk);
        sample_pick(&mut dev, vocab, &pk, &mut got.tokens);
        let (ids, lps) = got.top_lists_mut();
        let (mut ids, mut lps) = (ids.to_vec(), lps.to_vec());
        sample_logprobs(
            &raw,
            vocab,
            &pk,
            &got.tokens.clone(),
            &mut got.logprobs,
            &mut got.ranks,
            &mut ids,
            &mut lps,
        );
        got.top_lists_mut().0.copy_from_slice(&ids);
        got.top_lists_mut().1.copy_from_slice(&lps);

        for r in 0..n {
            let p = meta.rows()[r];
            assert_eq!(got.tokens[r], want.tokens[r], "case {case}, row {r}: {p:?}");
            compared += 1;
            if want.tokens[r] == NO_TOKEN {
                continue;
            }
            match (got.logprobs_of(&meta, r), want.logprobs_of(&meta, r)) {
                (Some(g), Some(w)) => {
                    assert!(
                        (g.logprob - w.logprob).abs() <= 1e-5,
                        "case {case}, row {r}: {g:?} {w:?}"
                    );
                    assert_eq!(g.rank, w.rank, "case {case}, row {r}");
                    assert_eq!(g.top_ids, w.top_ids, "case {case}, row {r}");
                    for (a, b) in g.top_logprobs.iter().zip(w.top_logprobs) {
                        assert!((a - b).abs() <= 1e-5, "case {case}, row {r}");
                    }
                }
                (None, None) => {}
                other => panic!("case {case}, row {r}: {other:?}"),
            }
        }
    }
    assert!(compared > 100);
}

/// A warp's butterfly sum (`pg_warp_sum`): every lane ends with the same
/// total, added in the kernel's xor order.
fn warp_sum_lanes(v: &mut [f32; 32]) {
    let mut m = 16;
    while m > 0 {
        let prev = *v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l] + prev[l ^ m];
        }
        m >>= 1;
    }
}

/// `pg_lora_at`.
fn lora_at(ty: GgmlType, m: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F16 => h2f(m, 2 * i),
        GgmlType::BF16 => {
            f32::from_bits((u16::from_le_bytes([m[2 * i], m[2 * i + 1]]) as u32) << 16)
        }
        _ => f32::from_le_bytes([m[4 * i], m[4 * i + 1], m[4 * i + 2], m[4 * i + 3]]),
    }
}

/// `pg_lora_shrink` over its grid (a block per token).
#[allow(clippy::too_many_arguments)]
fn lora_shrink(
    ty: GgmlType,
    a: &[u8],
    x: &[f32],
    in_dim: usize,
    rank: usize,
    scale: f32,
    token_slots: &[u32],
    slot: u32,
    h: &mut [f32],
    h_stride: usize,
) {
    let warps = plan::LORA_SHRINK_THREADS as usize / 32;
    for (t, &ts) in token_slots.iter().enumerate() {
        if ts != slot {
            continue;
        }
        for w in 0..warps {
            let mut k = w;
            while k < rank {
                let mut lanes = [0f32; 32];
                for (lane, s) in lanes.iter_mut().enumerate() {
                    let mut i = lane;
                    while i < in_dim {
                        *s = lora_at(ty, a, k * in_dim + i).mul_add(x[t * in_dim + i], *s);
                        i += 32;
                    }
                }
                warp_sum_lanes(&mut lanes);
                h[t * h_stride + k] = scale * lanes[0];
                k += warps;
            }
        }
    }
}

/// `pg_lora_expand` over its grid (a thread per token and column).
#[allow(clippy::too_many_arguments)]
fn lora_expand(
    ty: GgmlType,
    bt: &[u8],
    h: &[f32],
    h_stride: usize,
    rank: usize,
    token_slots: &[u32],
    slot: u32,
    out: &mut [f32],
    out_stride: usize,
    col: usize,
    out_dim: usize,
) {
    for i in 0..token_slots.len() * out_dim {
        let (t, j) = (i / out_dim, i % out_dim);
        if token_slots[t] != slot {
            continue;
        }
        let o = &mut out[t * out_stride + col + j];
        let mut acc = 0f32;
        for k in 0..rank {
            acc = h[t * h_stride + k].mul_add(lora_at(ty, bt, k * out_dim + j), acc);
        }
        *o += acc;
    }
}

#[test]
fn lora_kernels_match_the_cpu_op() {
    use crate::ops::lora::{lora_add, LoraData, LoraFactors, LoraScratch};
    let mut rng = rand::rngs::StdRng::seed_from_u64(47);
    let (in_dim, out_dim, stride, col) = (75, 41, 50, 6);
    let ranks = [8usize, 3];
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        // Per slot: A (`rank × in`) and Bᵀ (`rank × out`) as the backend
        // uploads them (a dense matrix's bytes are what the kernels read).
        let factors: Vec<(HostMatrix<'static>, HostMatrix<'static>, usize, f32)> = ranks
            .iter()
            .enumerate()
            .map(|(s, &r)| {
                let a: Vec<f32> = (0..r * in_dim)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let b: Vec<f32> = (0..r * out_dim)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                (
                    HostMatrix::from_f32_as(ty, r, in_dim, &a).expect("A"),
                    HostMatrix::from_f32_as(ty, r, out_dim, &b).expect("Bt"),
                    r,
                    0.5 + s as f32,
                )
            })
            .collect();
        let m = 7;
        let token_slots: Vec<u16> = vec![
            0,
            crate::backend::NO_LORA,
            1,
            0,
            1,
            crate::backend::NO_LORA,
            0,
        ];
        let x: Vec<f32> = (0..m * in_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let base: Vec<f32> = (0..m * stride)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();

        // The kernels, launched per slot as `CudaBackend::lora_add` does.
        let widened: Vec<u32> = token_slots.iter().map(|&s| s as u32).collect();
        let max_rank = *ranks.iter().max().expect("ranks");
        let mut h = vec![f32::NAN; m * max_rank];
        let mut got = base.clone();
        for (s, (a, bt, r, scale)) in factors.iter().enumerate() {
            lora_shrink(
                ty,
                a.bytes(),
                &x,
                in_dim,
                *r,
                *scale,
                &widened,
                s as u32,
                &mut h,
                max_rank,
            );
            lora_expand(
                ty,
                bt.bytes(),
                &h,
                max_rank,
                *r,
                &widened,
                s as u32,
                &mut got,
                stride,
                col,
                out_dim,
            );
        }

        // The CPU op on the same stored values, read into aligned
        // vectors.
        let aligned: Vec<(Vec<u16>, Vec<u16>, Vec<f32>, Vec<f32>)> = factors
            .iter()
            .map(|(a, b, _, _)| match ty {
                GgmlType::F32 => (
                    Vec::new(),
                    Vec::new(),
                    a.bytes()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    b.bytes()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                _ => (
                    a.bytes()
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                    b.bytes()
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                    Vec::new(),
                    Vec::new(),
                ),
            })
            .collect();
        let cpu_factors: Vec<LoraFactors<'_>> = aligned
            .iter()
            .zip(&factors)
            .map(|((a16, b16, a32, b32), (_, _, r, scale))| {
                let (a, b) = match ty {
                    GgmlType::F32 => (LoraData::F32(a32), LoraData::F32(b32)),
                    GgmlType::F16 => (LoraData::F16(a16), LoraData::F16(b16)),
                    _ => (LoraData::Bf16(a16), LoraData::Bf16(b16)),
                };
                LoraFactors {
                    a,
                    b,
                    rank: *r,
                    scale: *scale,
                }
            })
            .collect();
        let mut want = base.clone();
        lora_add(
            &x,
            in_dim,
            &token_slots,
            |s| cpu_factors.get(s as usize).copied(),
            &mut want,
            stride,
            col,
            out_dim,
            &mut LoraScratch::default(),
            None,
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() < 1e-4,
                "{ty}: element {i}: kernels {g}, cpu {w}"
            );
            let (t, c) = (i / stride, i % stride);
            if token_slots[t] == crate::backend::NO_LORA || c < col || c >= col + out_dim {
                assert_eq!(*g, base[i], "{ty}: element {i} must not change");
            }
        }
        assert_ne!(got, base, "{ty}: the adapters must change something");
    }
}
