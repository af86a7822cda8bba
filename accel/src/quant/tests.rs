//! Tests of the weight types and every kernel at every SIMD level this CPU
//! has, against naive f64 references written straight from the format specs
//! (independently of the decoders in `formats.rs`).

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use super::*;
use crate::HostMatrix;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ALL: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

fn levels() -> Vec<SimdLevel> {
    [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512Vnni,
        SimdLevel::Amx,
    ]
    .into_iter()
    .filter(|&l| l <= max_level())
    .collect()
}

fn f16b(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn rd16(b: &[u8], i: usize) -> f64 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32() as f64
}

/// Naive dequantization of one GGUF block, straight from the spec: returns
/// each element's value and the block's "min" magnitude per element (the
/// affine `m` term for Q4_1 / Q4_K, 0 otherwise) used in error bounds.
fn ref_block(ty: GgmlType, blk: &[u8]) -> Vec<(f64, f64)> {
    match ty {
        GgmlType::Q4_0 => (0..32)
            .map(|e| {
                let byte = blk[2 + e % 16];
                let q = if e < 16 { byte & 15 } else { byte >> 4 } as f64;
                ((q - 8.0) * rd16(blk, 0), 0.0)
            })
            .collect(),
        GgmlType::Q4_1 => (0..32)
            .map(|e| {
                let byte = blk[4 + e % 16];
                let q = if e < 16 { byte & 15 } else { byte >> 4 } as f64;
                (q * rd16(blk, 0) + rd16(blk, 2), rd16(blk, 2).abs())
            })
            .collect(),
        GgmlType::Q8_0 => (0..32)
            .map(|e| (blk[2 + e] as i8 as f64 * rd16(blk, 0), 0.0))
            .collect(),
        GgmlType::Q4_K => {
            let (d, dmin) = (rd16(blk, 0), rd16(blk, 2));
            let s = &blk[4..16];
            (0..256)
                .map(|e| {
                    let sb = e / 32;
                    // 6-bit fields: sub-blocks 0..3 in the low bits of s[sb] / s[sb+4];
                    // 4..7 as nibbles of s[sb+4] plus the top 2 bits of s[sb-4] / s[sb].
                    let (sc, mn) = if sb < 4 {
                        (s[sb] & 63, s[sb + 4] & 63)
                    } else {
                        (
                            (s[sb + 4] & 15) | ((s[sb - 4] >> 6) << 4),
                            (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4),
                        )
                    };
                    let byte = blk[16 + 32 * (e / 64) + e % 32];
                    let q = if (e / 32) % 2 == 0 {
                        byte & 15
                    } else {
                        byte >> 4
                    } as f64;
                    let m = dmin * mn as f64;
                    (d * sc as f64 * q - m, m.abs())
                })
                .collect()
        }
        GgmlType::Q6_K => {
            let d = rd16(blk, 208);
            (0..256)
                .map(|e| {
                    let (h, q4, l) = (e / 128, (e % 128) / 32, e % 32);
                    let low = (blk[64 * h + 32 * (q4 % 2) + l] >> (4 * (q4 / 2))) & 15;
                    let high = (blk[128 + 32 * h + l] >> (2 * q4)) & 3;
                    let q = (low | (high << 4)) as f64 - 32.0;
                    (d * (blk[192 + e / 16] as i8) as f64 * q, 0.0)
                })
                .collect()
        }
        GgmlType::F32 => vec![(
            f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]) as f64,
            0.0,
        )],
        GgmlType::F16 => vec![(rd16(blk, 0), 0.0)],
        // OCP MX: e2m1 code (sign bit 3; exponent bits 1..3 with bias 1,
        // subnormal at 0; mantissa bit 0) times 2^(e - 127); ggml's order,
        // element j < 16 the low nibble of byte 1 + j, j + 16 its high one.
        GgmlType::MXFP4 => (0..32)
            .map(|e| {
                let byte = blk[1 + e % 16];
                let c = if e < 16 { byte & 15 } else { byte >> 4 };
                let (ex, man) = ((c >> 1) & 3, (c & 1) as f64);
                let mag = if ex == 0 {
                    man * 0.5
                } else {
                    (1.0 + man * 0.5) * 2f64.powi(ex as i32 - 1)
                };
                let sign = if c & 8 != 0 { -1.0 } else { 1.0 };
                (sign * mag * 2f64.powi(blk[0] as i32 - 127), 0.0)
            })
            .collect(),
        GgmlType::BF16 => vec![(
            f32::from_bits((u16::from_le_bytes([blk[0], blk[1]]) as u32) << 16) as f64,
            0.0,
        )],
    }
}

/// Dequantizes a whole GGUF matrix with [`ref_block`].
fn ref_matrix(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<(f64, f64)> {
    let out: Vec<(f64, f64)> = bytes
        .chunks_exact(ty.block_bytes())
        .flat_map(|b| ref_block(ty, b))
        .collect();
    assert_eq!(out.len(), rows * cols);
    out
}

/// Random GGUF bytes covering every code value, with moderate scales.
fn random_bytes(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let nblocks = rows * cols / ty.block_len();
    let mut out = Vec::with_capacity(nblocks * ty.block_bytes());
    for _ in 0..nblocks {
        let mut blk: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.random()).collect();
        let mut put16 = |at: usize, v: f32| blk[at..at + 2].copy_from_slice(&f16b(v));
        match ty {
            GgmlType::F32 => blk.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes()),
            GgmlType::F16 => put16(0, rng.random_range(-1.0..1.0)),
            GgmlType::BF16 => blk.copy_from_slice(
                &half::bf16::from_f32(rng.random_range(-1.0..1.0))
                    .to_bits()
                    .to_le_bytes(),
            ),
            GgmlType::Q4_0 | GgmlType::Q8_0 => put16(0, rng.random_range(-0.05..0.05)),
            GgmlType::Q4_1 => {
                put16(0, rng.random_range(0.0..0.05));
                put16(2, rng.random_range(-0.4..0.1));
            }
            GgmlType::Q4_K => {
                put16(0, rng.random_range(0.0..0.004));
                put16(2, rng.random_range(0.0..0.004));
            }
            GgmlType::Q6_K => put16(208, rng.random_range(-0.001..0.001)),
            GgmlType::MXFP4 => blk[0] = rng.random_range(118u8..130),
        }
        out.extend_from_slice(&blk);
    }
    out
}

/// The activation quantization the kernels must use, restated: per lane
/// block of `l`, scale `amax / 127`, codes `round_ties_even(x · 127 / amax)`.
fn ref_act(x: &[f32], l: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks_exact(l) {
        let amax = b.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        out.extend(
            b.iter()
                .map(|&v| (v * id).round_ties_even().clamp(-127.0, 127.0) as f64 * d as f64),
        );
    }
    out
}

fn lane_len_of(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6_K => 16,
        t if t.is_float() => 1,
        _ => 32,
    }
}

/// Checks `got` (m × rows) against f64 references:
/// - exact-activation reference `Σ w·x` within the bound of 8-bit activation
///   rounding: each |x − x̂| ≤ amax_b / 254 for its lane block b, so
///   |Σ w(x − x̂)| ≤ Σ_b (amax_b / 254) Σ_{e∈b} |w_e|, plus float slack;
/// - the same-activation reference `Σ w·x̂` within f32 accumulation error:
///   at most ~(lanes + 16) roundings of 2^-24 relative to Σ(|w| + |min|)|x̂|
///   (the min term because Q4_1 / Q4_K add `m · Σx̂` separately).
fn check(
    ty: GgmlType,
    wref: &[(f64, f64)],
    rows: usize,
    cols: usize,
    x: &[f32],
    m: usize,
    got: &[f32],
    what: &str,
) {
    let l = lane_len_of(ty);
    let xq = if l > 1 {
        ref_act(x, l)
    } else {
        x.iter().map(|&v| v as f64).collect()
    };
    for i in 0..m {
        let xr = &x[i * cols..(i + 1) * cols];
        let xqr = &xq[i * cols..(i + 1) * cols];
        for n in 0..rows {
            let wr = &wref[n * cols..(n + 1) * cols];
            let exact: f64 = wr.iter().zip(xr).map(|(w, &v)| w.0 * v as f64).sum();
            let same: f64 = wr.iter().zip(xqr).map(|(w, &v)| w.0 * v).sum();
            let mag: f64 = wr
                .iter()
                .zip(xqr)
                .map(|(w, &v)| (w.0.abs() + w.1) * v.abs())
                .sum();
            let mag_x: f64 = wr
                .iter()
                .zip(xr)
                .map(|(w, &v)| w.0.abs() * (v as f64).abs())
                .sum();
            let fl = ((cols / l.max(1)) as f64 + 16.0) * 2f64.powi(-24) * 1.5;
            let tight = fl * mag.max(mag_x) + 1e-30;
            let act_bound: f64 = if l > 1 {
                wr.chunks_exact(l)
                    .zip(xr.chunks_exact(l))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                        amax / 254.0 * wb.iter().map(|w| w.0.abs()).sum::<f64>()
                    })
                    .sum()
            } else {
                0.0
            };
            let g = got[i * rows + n] as f64;
            assert!(
                (g - same).abs() <= tight,
                "{what}: out[{i}][{n}] = {g}, same-activation reference {same}, |err| {} > {tight}",
                (g - same).abs()
            );
            assert!(
                (g - exact).abs() <= act_bound * 1.0001 + tight,
                "{what}: out[{i}][{n}] = {g}, exact reference {exact}, |err| {} > {}",
                (g - exact).abs(),
                act_bound + tight
            );
        }
    }
}

fn cols_for(ty: GgmlType, k: usize) -> usize {
    match ty {
        GgmlType::Q4_K | GgmlType::Q6_K => [256, 512, 768, 1024][k % 4],
        // Odd widths for the float types exercise the masked tails.
        t if t.is_float() => [32, 576, 67, 1024, 5, 160][k % 6],
        // 18 lanes = one full group + a 2-lane tail, 5 lanes, 9 lanes, ...
        _ => [32, 576, 160, 1024, 288, 64, 96][k % 7],
    }
}

#[test]
fn matmul_every_type_level_and_shape() {
    let mut rng = StdRng::seed_from_u64(7);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    for ty in ALL {
        let mut k = 0;
        for &rows in &[1usize, 3, 7, 33, 130] {
            for &m in &[1usize, 2, 5, 17] {
                k += 1;
                let cols = cols_for(ty, k);
                let bytes = random_bytes(&mut rng, ty, rows, cols);
                let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
                let wref = ref_matrix(ty, rows, cols, &bytes);
                let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
                for level in levels() {
                    let mut scratch = MatmulScratch::default();
                    let mut out = vec![f32::NAN; m * rows];
                    w.matmul_at(level, &pools[k % 2], &x, m, &mut out, &mut scratch);
                    let what = format!("{ty} {level:?} rows {rows} cols {cols} m {m}");
                    check(ty, &wref, rows, cols, &x, m, &out, &what);
                }
            }
        }
    }
}

/// MXFP4 (from GGUF bytes: 8-bit activations, as llama.cpp) against the
/// naive f64 references at every level, shape and batch of
/// [`matmul_every_type_level_and_shape`] (rows 1..130, batches 1..17, 1 to
/// 32 blocks per row), plus its resident size: 17 bytes per 32 values.
#[test]
fn matmul_mxfp4_every_level_and_shape() {
    let ty = GgmlType::MXFP4;
    let mut rng = StdRng::seed_from_u64(39);
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    let mut k = 0;
    for &rows in &[1usize, 3, 7, 33, 130] {
        for &m in &[1usize, 2, 5, 17] {
            k += 1;
            let cols = cols_for(ty, k);
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
            assert_eq!(w.size_bytes(), rows * cols / 32 * 17);
            let wref = ref_matrix(ty, rows, cols, &bytes);
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            for level in levels() {
                let mut out = vec![f32::NAN; m * rows];
                w.matmul_at(
                    level,
                    &pools[k % 2],
                    &x,
                    m,
                    &mut out,
                    &mut MatmulScratch::default(),
                );
                let what = format!("{ty} {level:?} rows {rows} cols {cols} m {m}");
                check(ty, &wref, rows, cols, &x, m, &out, &what);
            }
            let mut row = vec![0f32; cols];
            w.dequantize_row(rows - 1, &mut row);
            for (c, &v) in row.iter().enumerate() {
                assert_eq!(
                    v as f64,
                    wref[(rows - 1) * cols + c].0,
                    "{what} col {c}",
                    what = ty
                );
            }
        }
    }
}

#[test]
fn short_tail_groups_packed_across_rows_match_the_reference() {
    // Widths whose last group is 1, 2 or 4 lanes, with enough rows for the
    // 8-row decode tile and the 4-row batched tile: the kernels then pack
    // the tail lanes of all the tile's rows into one vector.
    let mut rng = StdRng::seed_from_u64(13);
    let pool = ThreadPool::new(2);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for cols in [32usize, 64, 128, 544, 576] {
            for (rows, m) in [(16usize, 1usize), (24, 1), (12, 3), (20, 6)] {
                let bytes = random_bytes(&mut rng, ty, rows, cols);
                let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
                let wref = ref_matrix(ty, rows, cols, &bytes);
                let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
                for level in levels() {
                    let mut out = vec![f32::NAN; m * rows];
                    w.matmul_at(level, &pool, &x, m, &mut out, &mut MatmulScratch::default());
                    let what = format!("{ty} {level:?} rows {rows} cols {cols} m {m}");
                    check(ty, &wref, rows, cols, &x, m, &out, &what);
                }
            }
        }
    }
}

#[test]
fn matmul_large_m_paths() {
    // m beyond the activation cache block (64 rows).
    let mut rng = StdRng::seed_from_u64(11);
    let pool = ThreadPool::new(2);
    for ty in ALL {
        let (rows, cols, m) = (37, if ty.block_len() == 256 { 512 } else { 96 }, 70);
        let bytes = random_bytes(&mut rng, ty, rows, cols);
        let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
        let wref = ref_matrix(ty, rows, cols, &bytes);
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        for level in levels() {
            let mut out = vec![f32::NAN; m * rows];
            let mut scratch = MatmulScratch::default();
            w.matmul_at(level, &pool, &x, m, &mut out, &mut scratch);
            check(
                ty,
                &wref,
                rows,
                cols,
                &x,
                m,
                &out,
                &format!("{ty} {level:?} m {m}"),
            );
        }
    }
}

/// The encoder GEMM ([`Weight::matmul_gemm`]) for every float type, with
/// ragged column panels (rows not a multiple of 32), inner blocks (cols
/// past 256 and not a multiple of it), row tiles and row blocks (m past 12
/// and past 512), at every level and on 1 and 2 threads, against the f64
/// reference; and each row bitwise the row computed alone.
#[test]
fn gemm_matches_the_reference_and_rows_stand_alone() {
    let mut rng = StdRng::seed_from_u64(45);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, cols, m) in [
            (37usize, 96usize, 13usize),
            (70, 600, 25),
            (33, 300, 530),
            (5, 8, 1),
        ] {
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
            let wref = ref_matrix(ty, rows, cols, &bytes);
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            for level in levels() {
                for threads in [1, 2] {
                    let pool = ThreadPool::new(threads);
                    let mut out = vec![f32::NAN; m * rows];
                    let mut scratch = MatmulScratch::default();
                    w.matmul_gemm_at(level, &pool, &x, m, &mut out, &mut scratch);
                    let what = format!("gemm {ty} {level:?} threads {threads} {rows}x{cols} m {m}");
                    check(ty, &wref, rows, cols, &x, m, &out, &what);
                    for i in [0, m / 2, m - 1] {
                        let mut one = vec![f32::NAN; rows];
                        w.matmul_gemm_at(
                            level,
                            &pool,
                            &x[i * cols..(i + 1) * cols],
                            1,
                            &mut one,
                            &mut scratch,
                        );
                        for n in 0..rows {
                            assert_eq!(
                                one[n].to_bits(),
                                out[i * rows + n].to_bits(),
                                "{what}: row {i} col {n} alone {} in the batch {}",
                                one[n],
                                out[i * rows + n]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Batch invariance: a row of a batched matmul is bitwise the row computed
/// alone (m = 1, the decode kernel), whatever kernel the batch size picks:
/// the AVX2 or VNNI tiles of every shape (with short last groups packed
/// across rows or not), or the AMX tiles (where the CPU has them) with
/// their ragged row and token ends.
#[test]
fn batched_rows_are_bitwise_the_single_row_results() {
    let mut rng = StdRng::seed_from_u64(29);
    let pool = ThreadPool::new(2);
    let wide = [SimdLevel::Avx2, SimdLevel::Avx512Vnni, SimdLevel::Amx];
    let levels: Vec<SimdLevel> = wide.into_iter().filter(|&l| l <= max_level()).collect();
    if !levels.contains(&SimdLevel::Amx) {
        eprintln!(
            "note: no AMX on this CPU (or PAGODA_SIMD lowered the level); checking {levels:?}"
        );
    }
    let small = [
        (16usize, 32usize),
        (48, 576),
        (33, 1536),
        (130, 160),
        (32, 288),
        (40, 96),
    ];
    // K-quant rows are whole super-blocks of 256.
    let k_quant = [
        (16, 256),
        (48, 768),
        (33, 1024),
        (130, 256),
        (32, 512),
        (40, 1280),
    ];
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let shapes = if ty.block_len() == 256 {
            k_quant
        } else {
            small
        };
        for (k, (rows, cols)) in shapes.into_iter().enumerate() {
            let w =
                Weight::from_raw(ty, rows, cols, &random_bytes(&mut rng, ty, rows, cols)).unwrap();
            let m = [12usize, 16, 130, 33, 70, 150][k];
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            for &level in &levels {
                // A single row at Amx runs the VNNI decode kernel.
                let single_level = level.min(SimdLevel::Avx512Vnni);
                let mut single = vec![0.0f32; m * rows];
                for i in 0..m {
                    let mut s = MatmulScratch::default();
                    w.matmul_at(
                        single_level,
                        &pool,
                        &x[i * cols..(i + 1) * cols],
                        1,
                        &mut single[i * rows..(i + 1) * rows],
                        &mut s,
                    );
                }
                let mut out = vec![f32::NAN; m * rows];
                w.matmul_at(level, &pool, &x, m, &mut out, &mut MatmulScratch::default());
                for (e, (a, b)) in out.iter().zip(&single).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} {level:?} rows {rows} cols {cols} m {m}: out[{}][{}] = {a}, alone {b}",
                        e / rows,
                        e % rows
                    );
                }
            }
        }
    }
}

#[test]
fn single_token_results_do_not_depend_on_prefetching() {
    // The decode tiles prefetch or not as measured while serving
    // (`prefetch.rs`); both ways must give the same bits, at every level,
    // on full and partial panels and short last groups.
    use super::{set_decode_prefetch, DecodePrefetch};
    let mut rng = StdRng::seed_from_u64(47);
    let pool = ThreadPool::new(2);
    for ty in ALL {
        for (k, rows) in [8usize, 21, 48].into_iter().enumerate() {
            let cols = cols_for(ty, k + 1);
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let wref = ref_matrix(ty, rows, cols, &bytes);
            let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            for level in levels() {
                let run = |mode| {
                    set_decode_prefetch(mode);
                    let mut out = vec![f32::NAN; rows];
                    w.matmul_at(level, &pool, &x, 1, &mut out, &mut MatmulScratch::default());
                    out
                };
                let (on, off) = (run(DecodePrefetch::On), run(DecodePrefetch::Off));
                for (r, (a, b)) in on.iter().zip(&off).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} {level:?} {rows}x{cols} row {r}: {a} vs {b}"
                    );
                }
                check(
                    ty,
                    &wref,
                    rows,
                    cols,
                    &x,
                    1,
                    &on,
                    &format!("{level:?} prefetch"),
                );
            }
        }
    }
    set_decode_prefetch(DecodePrefetch::Auto);
}

#[test]
fn simd_levels_agree() {
    // All levels see bit-identical quantized activations and exact integer
    // dot products; only the float summation order differs.
    let mut rng = StdRng::seed_from_u64(3);
    let pool = ThreadPool::new(1);
    for ty in ALL {
        let (rows, cols, m) = (9, if ty.block_len() == 256 { 768 } else { 576 }, 3);
        let w = Weight::from_raw(ty, rows, cols, &random_bytes(&mut rng, ty, rows, cols)).unwrap();
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let outs: Vec<Vec<f32>> = levels()
            .into_iter()
            .map(|level| {
                let mut out = vec![0.0; m * rows];
                w.matmul_at(level, &pool, &x, m, &mut out, &mut MatmulScratch::default());
                out
            })
            .collect();
        for o in &outs[1..] {
            for (a, b) in o.iter().zip(&outs[0]) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{ty}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn scratch_reuse_across_shapes() {
    // A scratch warmed on a big call must still give right answers on a
    // smaller one (stale data beyond the used prefix must not leak in).
    let mut rng = StdRng::seed_from_u64(5);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    for (ty, rows, cols, m) in [
        (GgmlType::Q8_0, 40, 1024, 9),
        (GgmlType::Q4_1, 7, 96, 2),
        (GgmlType::Q6_K, 5, 256, 1),
        (GgmlType::Q4_0, 3, 32, 1),
    ] {
        let bytes = random_bytes(&mut rng, ty, rows, cols);
        let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut out = vec![0.0; m * rows];
        w.matmul(&pool, &x, m, &mut out, &mut scratch);
        check(
            ty,
            &ref_matrix(ty, rows, cols, &bytes),
            rows,
            cols,
            &x,
            m,
            &out,
            "reuse",
        );
    }
}

#[test]
fn dequantize_row_matches_reference_for_every_type() {
    let mut rng = StdRng::seed_from_u64(1);
    for ty in ALL {
        let (rows, cols) = (5, if ty.block_len() == 256 { 768 } else { 608 });
        let bytes = random_bytes(&mut rng, ty, rows, cols);
        let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
        let wref = ref_matrix(ty, rows, cols, &bytes);
        let mut row = vec![0.0f32; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut row);
            for (c, (&got, want)) in row.iter().zip(&wref[r * cols..]).enumerate() {
                // The kernels' formulas equal ggml's in f32; the f64
                // reference differs only by the f32 rounding of the products.
                assert!(
                    (got as f64 - want.0).abs() <= 1e-6 * want.0.abs() + 1e-12,
                    "{ty} [{r}][{c}]: {got} vs {}",
                    want.0
                );
            }
        }
    }
}

/// Packs a Q4_K block's 6-bit scales and mins the way the format defines.
fn pack_k4_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j];
            s[j + 4] |= mn[j];
        } else {
            s[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
    }
    s
}

#[test]
fn q4k_hand_built_block() {
    let sc = [1u8, 2, 3, 4, 40, 50, 60, 63];
    let mn = [0u8, 5, 10, 63, 16, 33, 48, 7];
    let mut blk = vec![0u8; 144];
    blk[0..2].copy_from_slice(&f16b(0.5));
    blk[2..4].copy_from_slice(&f16b(0.25));
    blk[4..16].copy_from_slice(&pack_k4_scales(sc, mn));
    let code = |e: usize| ((e * 7 + e / 32) % 16) as u8;
    for e in 0..256 {
        let (c, half_, l) = (e / 64, (e / 32) % 2, e % 32);
        blk[16 + 32 * c + l] |= code(e) << (4 * half_);
    }
    let w = Weight::from_raw(GgmlType::Q4_K, 1, 256, &blk).unwrap();
    let mut row = vec![0.0; 256];
    w.dequantize_row(0, &mut row);
    for e in 0..256 {
        let want = 0.5 * sc[e / 32] as f32 * code(e) as f32 - 0.25 * mn[e / 32] as f32;
        assert_eq!(row[e], want, "element {e}");
    }
}

#[test]
fn q6k_hand_built_block() {
    let mut blk = vec![0u8; 210];
    let code = |e: usize| ((e * 13 + 5) % 64) as u8;
    let scale = |s: usize| (s as i32 * 17 - 128) as i8;
    for e in 0..256 {
        let (h, q, l) = (e / 128, (e % 128) / 32, e % 32);
        blk[64 * h + 32 * (q % 2) + l] |= (code(e) & 15) << (4 * (q / 2));
        blk[128 + 32 * h + l] |= (code(e) >> 4) << (2 * q);
    }
    for s in 0..16 {
        blk[192 + s] = scale(s) as u8;
    }
    blk[208..210].copy_from_slice(&f16b(0.125));
    let w = Weight::from_raw(GgmlType::Q6_K, 1, 256, &blk).unwrap();
    let mut row = vec![0.0; 256];
    w.dequantize_row(0, &mut row);
    for e in 0..256 {
        let want = 0.125 * scale(e / 16) as f32 * (code(e) as f32 - 32.0);
        assert_eq!(row[e], want, "element {e}");
    }
}

#[test]
fn quantize_round_trip_bounds() {
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, cols) = (6, 256);
    let data: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
    ] {
        let w = Weight::quantize(ty, rows, cols, &data).unwrap();
        assert_eq!(w.ty(), ty);
        let mut row = vec![0.0; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut row);
            for (bi, (xb, yb)) in data[r * cols..(r + 1) * cols]
                .chunks(32)
                .zip(row.chunks(32))
                .enumerate()
            {
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let min = xb.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = xb.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                // Rounding to the grid, plus the f16 rounding (2^-11) of the
                // stored scale (times the largest code) and min.
                let bound = match ty {
                    GgmlType::Q8_0 => amax / 127.0 * (0.5 + 127.0 / 2048.0),
                    // The element at +amax opposite the -8 end maps to code 16
                    // and clamps to 15: error up to one step d = amax / 8.
                    GgmlType::Q4_0 => amax / 8.0 * (1.0 + 8.0 / 2048.0),
                    GgmlType::Q4_1 => {
                        (max - min) / 15.0 * (0.5 + 15.0 / 2048.0) + min.abs() / 2048.0
                    }
                    GgmlType::F32 => 0.0,
                    GgmlType::F16 => amax / 2048.0,
                    _ => amax / 256.0,
                } * 1.001
                    + 1e-7;
                for (x, y) in xb.iter().zip(yb) {
                    assert!(
                        (x - y).abs() <= bound,
                        "{ty} row {r} block {bi}: {x} -> {y} (bound {bound})"
                    );
                }
            }
        }
    }
    assert!(matches!(
        Weight::quantize(GgmlType::Q4_K, 1, 256, &[0.0; 256]),
        Err(WeightError::QuantizeUnsupported(_))
    ));
}

#[test]
fn quantize_matches_ggml_reference_values() {
    // Hand-computed: block [-8, 0, ..., 0, 4]: Q4_0 d = -8 / -8 = 1, so -8
    // -> code 0, 0 -> 8, 4 -> 12; Q8_0 d = 8/127.
    let mut x = [0.0f32; 32];
    x[0] = -8.0;
    x[31] = 4.0;
    let w = Weight::quantize(GgmlType::Q4_0, 1, 32, &x).unwrap();
    let mut y = [0.0f32; 32];
    w.dequantize_row(0, &mut y);
    assert_eq!(y, x);
    let w = Weight::quantize(GgmlType::Q8_0, 1, 32, &x).unwrap();
    w.dequantize_row(0, &mut y);
    let d = half::f16::from_f32(8.0 / 127.0).to_f32();
    assert_eq!(y[0], -127.0 * d);
    assert_eq!(y[31], 64.0 * d);
}

#[test]
fn from_raw_validates_lengths() {
    for ty in ALL {
        let cols = ty.block_len() * 2;
        let ok = vec![0u8; 3 * ty.row_bytes(cols).unwrap()];
        assert!(Weight::from_raw(ty, 3, cols, &ok).is_ok());
        let err = Weight::from_raw(ty, 3, cols, &ok[1..]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("expected {}", ok.len()))
                && msg.contains(&format!("got {}", ok.len() - 1)),
            "{msg}"
        );
        if ty.block_len() > 1 {
            let err = Weight::from_raw(ty, 1, cols + 1, &ok).unwrap_err();
            assert!(
                matches!(err, WeightError::ColsNotBlockMultiple { .. }),
                "{err}"
            );
            assert!(err.to_string().contains("not a multiple"), "{err}");
        }
    }
    assert!(matches!(
        Weight::from_f32(2, 3, &[0.0; 5]),
        Err(WeightError::WrongLength {
            unit: "elements",
            ..
        })
    ));
    assert!(Weight::from_bf16_bits(2, 3, &[0; 6]).is_ok());
    assert!(Weight::from_f16_bits(2, 3, &[0; 7]).is_err());
    assert!(Weight::from_raw(GgmlType::Q8_0, usize::MAX, 32, &[]).is_err());
}

#[test]
fn type_metadata() {
    for ty in ALL {
        assert_eq!(GgmlType::from_gguf_id(ty.gguf_id()), Some(ty));
        assert_eq!(ty.name(), format!("{ty:?}"));
    }
    assert_eq!(GgmlType::from_gguf_id(6), None);
    assert_eq!(GgmlType::Q4_1.row_bytes(64).unwrap(), 40);
    assert_eq!(GgmlType::Q6_K.row_bytes(512).unwrap(), 420);
    assert_eq!(GgmlType::BF16.row_bytes(7).unwrap(), 14);
    assert!(GgmlType::Q4_K.row_bytes(128).is_err());
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Weight>();
}

#[test]
fn host_matrices_stack_into_the_rows_of_their_parts() {
    // The engine fuses q|k|v and gate|up by stacking GGUF rows before the
    // backend lays the matrix out; the fused matrix must compute each
    // part's rows exactly as the part alone does.
    let mut rng = StdRng::seed_from_u64(2);
    let pool = ThreadPool::new(2);
    for ty in ALL {
        let cols = if ty.block_len() == 256 { 512 } else { 96 };
        let parts_rows = [3usize, 5, 1];
        let bytes: Vec<Vec<u8>> = parts_rows
            .iter()
            .map(|&r| random_bytes(&mut rng, ty, r, cols))
            .collect();
        let hosts: Vec<HostMatrix<'_>> = parts_rows
            .iter()
            .zip(&bytes)
            .map(|(&r, b)| HostMatrix::new(ty, r, cols, b.as_slice()).unwrap())
            .collect();
        let cat = HostMatrix::concat_rows(&hosts).unwrap();
        assert_eq!((cat.rows(), cat.cols(), cat.ty()), (9, cols, ty));
        assert_eq!(cat.bytes(), bytes.concat().as_slice());
        let fused = Weight::from_raw(ty, 9, cols, cat.bytes()).unwrap();
        let m = 2;
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut all = vec![0.0; m * 9];
        fused.matmul(&pool, &x, m, &mut all, &mut MatmulScratch::default());
        let (mut at, mut a, mut b) = (0, vec![0.0; cols], vec![0.0; cols]);
        for h in &hosts {
            let part = Weight::from_raw(ty, h.rows(), cols, h.bytes()).unwrap();
            let mut out = vec![0.0; m * h.rows()];
            part.matmul(&pool, &x, m, &mut out, &mut MatmulScratch::default());
            for r in 0..h.rows() {
                fused.dequantize_row(at + r, &mut a);
                part.dequantize_row(r, &mut b);
                assert_eq!(a, b, "{ty} row {}", at + r);
                for i in 0..m {
                    assert_eq!(
                        all[i * 9 + at + r].to_bits(),
                        out[i * h.rows() + r].to_bits(),
                        "{ty}: fused row {} token {i}",
                        at + r
                    );
                }
            }
            at += h.rows();
        }
    }
    let a = HostMatrix::new(GgmlType::Q8_0, 1, 32, vec![0u8; 34]).unwrap();
    let b = HostMatrix::new(GgmlType::Q4_0, 1, 32, vec![0u8; 18]).unwrap();
    let c = HostMatrix::new(GgmlType::Q8_0, 1, 64, vec![0u8; 68]).unwrap();
    let err = HostMatrix::concat_rows(&[a.clone(), b]).unwrap_err();
    assert!(err.to_string().contains("part 1 is Q4_0"), "{err}");
    assert!(HostMatrix::concat_rows(&[a, c]).is_err());
    assert!(matches!(
        HostMatrix::concat_rows(&[]),
        Err(WeightError::ConcatEmpty)
    ));
    assert!(
        HostMatrix::new(GgmlType::Q8_0, 2, 32, vec![0u8; 34]).is_err(),
        "a buffer one row short is refused"
    );
}

#[test]
fn kernels_detect_corrupted_weights() {
    // Guard against a vacuous check: flipping one code must break it.
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols, m) = (4, 64, 1);
    let ty = GgmlType::Q8_0;
    let mut bytes = random_bytes(&mut rng, ty, rows, cols);
    bytes[0..2].copy_from_slice(&f16b(0.05));
    let wref = ref_matrix(ty, rows, cols, &bytes);
    bytes[2] = bytes[2].wrapping_add(100);
    let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..cols).map(|i| if i == 0 { 1.0 } else { 0.01 }).collect();
    let mut out = vec![0.0; rows];
    w.matmul(
        &ThreadPool::new(1),
        &x,
        m,
        &mut out,
        &mut MatmulScratch::default(),
    );
    let r = std::panic::catch_unwind(|| check(ty, &wref, rows, cols, &x, m, &out, "corrupt"));
    assert!(r.is_err());
}

#[test]
fn activation_quantization_is_identical_at_every_level() {
    let mut rng = StdRng::seed_from_u64(8);
    for l in [16usize, 32] {
        let lanes = 37;
        let mut x: Vec<f32> = (0..lanes * l)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        // Exact ties after scaling (amax 127 makes id 1), zeros, and a zero block.
        for (k, v) in x[..l].iter_mut().enumerate() {
            *v = if k == 0 { 127.0 } else { k as f32 - 7.5 };
        }
        x[l..2 * l].fill(0.0);
        let run = |level| {
            let n = lanes * l;
            let (mut q, mut d, mut sum, mut s) = (
                vec![0i8; n],
                vec![0f32; lanes],
                vec![0i32; lanes],
                vec![0f32; lanes],
            );
            act::quantize_row(level, l, &x, &mut q, &mut d, &mut sum, &mut s);
            (q, d, sum, s)
        };
        let base = run(SimdLevel::Scalar);
        assert_eq!(base.0[1], -6, "1 - 7.5 = -6.5 rounds to even");
        for level in levels() {
            let got = run(level);
            assert!(got == base, "{level:?} l {l}");
        }
        // The reference restated in the tests agrees with the layout: codes of
        // lane 0 (its own group, 16 lanes wide) at chunk c, lane j = 0.
        let want = ref_act(&x[..l], l);
        for e in 0..l {
            let c = e / 4;
            let got = base.0[c * 64 + e % 4] as f64 * base.1[0] as f64;
            assert_eq!(got, want[e]);
        }
    }
}

/// Rows, columns, batch size and which rows are wide, for the wide-row
/// tests: ragged token tiles, one row alone, every row, mixed.
fn wide_cases() -> Vec<(usize, usize, usize, Vec<bool>)> {
    vec![
        (16, 32, 1, vec![true]),
        (48, 576, 37, (0..37).map(|i| i % 3 != 1).collect()),
        (32, 1536, 70, vec![true; 70]),
        (64, 160, 5, vec![false, true, true, false, true]),
    ]
}

#[test]
fn wide_rows_match_f64_within_bf16_rounding_and_exact_rows_are_untouched() {
    let mut rng = StdRng::seed_from_u64(41);
    let pool = ThreadPool::new(2);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for (rows, cols, m, wide) in wide_cases() {
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let w = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
            if !w.has_wide_kernel() {
                eprintln!("note: no AMX-BF16 here; wide rows take the exact kernels");
            }
            let wref = ref_matrix(ty, rows, cols, &bytes);
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut plain = vec![0.0f32; m * rows];
            w.matmul(&pool, &x, m, &mut plain, &mut MatmulScratch::default());
            let mut got = vec![f32::NAN; m * rows];
            w.matmul_rows(&pool, &x, m, &mut got, &mut MatmulScratch::default(), &wide);
            if w.has_wide_kernel() {
                // The wide rows did take the other kernel.
                let differ = (0..m * rows)
                    .filter(|&e| wide[e / rows] && got[e] != plain[e])
                    .count();
                assert!(
                    differ > 0,
                    "{ty} rows {rows} cols {cols}: no wide result differs"
                );
            }
            for i in 0..m {
                for r in 0..rows {
                    let (g, p) = (got[i * rows + r], plain[i * rows + r]);
                    if !wide[i] || !w.has_wide_kernel() {
                        assert_eq!(g.to_bits(), p.to_bits(), "{ty} exact row {i} col {r}");
                        continue;
                    }
                    // bf16 keeps 8 significant bits: each weight and each
                    // activation is off by at most 2^-9 of itself.
                    let (mut want, mut mag) = (0.0f64, 0.0f64);
                    for k in 0..cols {
                        let (v, _) = wref[r * cols + k];
                        let xv = x[i * cols + k] as f64;
                        want += v * xv;
                        mag += (v * xv).abs();
                    }
                    let err = (g as f64 - want).abs();
                    assert!(
                        err <= mag * 2.0f64.powi(-7) + 1e-6,
                        "{ty} rows {rows} cols {cols} m {m}: wide row {i} col {r}: {g} vs {want} (|w·x| sum {mag})"
                    );
                }
            }
        }
    }
}

#[test]
fn wide_rows_do_not_depend_on_the_batch() {
    let mut rng = StdRng::seed_from_u64(43);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (48usize, 576usize);
        let w = Weight::from_raw(ty, rows, cols, &random_bytes(&mut rng, ty, rows, cols)).unwrap();
        let m = 70;
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        // Each row alone, on one thread.
        let one = ThreadPool::new(1);
        let mut alone = vec![0.0f32; m * rows];
        for i in 0..m {
            w.matmul_rows(
                &one,
                &x[i * cols..(i + 1) * cols],
                1,
                &mut alone[i * rows..(i + 1) * rows],
                &mut MatmulScratch::default(),
                &[true],
            );
        }
        // All together, on two threads, then with every other row exact
        // (so the wide rows sit at other places in their tiles).
        let two = ThreadPool::new(2);
        for pattern in [vec![true; m], (0..m).map(|i| i % 2 == 0).collect()] {
            let mut got = vec![f32::NAN; m * rows];
            let mut s = MatmulScratch::default();
            w.matmul_rows(&two, &x, m, &mut got, &mut s, &pattern);
            for i in (0..m).filter(|&i| pattern[i]) {
                for r in 0..rows {
                    assert_eq!(
                        got[i * rows + r].to_bits(),
                        alone[i * rows + r].to_bits(),
                        "{ty}: row {i} col {r} batched vs alone"
                    );
                }
            }
        }
    }
}

/// Shapes for the bf16 tile kernel: a ragged last row tile, one block,
/// 1536 columns, and batches of one token, a partial token tile, exactly
/// one tile, one past it, and past a group of four.
fn tile_cases() -> Vec<(usize, usize, usize)> {
    vec![
        (16, 32, 1),
        (37, 576, 5),
        (48, 576, 16),
        (130, 160, 17),
        (32, 1536, 70),
        (64, 288, 33),
    ]
}

#[test]
fn bf16_tiles_match_f64_within_bf16_rounding() {
    if max_level() < SimdLevel::AmxBf16 {
        eprintln!("note: no AMX-BF16 on this CPU; the bf16 tile kernel is not run");
        return;
    }
    let mut rng = StdRng::seed_from_u64(53);
    let pool = ThreadPool::new(2);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for (rows, cols, m) in tile_cases() {
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let w = Weight::from_raw_at(SimdLevel::AmxBf16, ty, rows, cols, &bytes).unwrap();
            let wref = ref_matrix(ty, rows, cols, &bytes);
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut got = vec![f32::NAN; m * rows];
            w.matmul(&pool, &x, m, &mut got, &mut MatmulScratch::default());
            for i in 0..m {
                for r in 0..rows {
                    // bf16 keeps 8 significant bits: each weight and each
                    // activation is off by at most 2^-9 of itself, so a
                    // product by at most ~2^-8, plus f32 accumulation.
                    let (mut want, mut mag) = (0.0f64, 0.0f64);
                    for k in 0..cols {
                        let v = wref[r * cols + k].0 * x[i * cols + k] as f64;
                        want += v;
                        mag += v.abs();
                    }
                    let g = got[i * rows + r] as f64;
                    let bound = mag * (2.0f64.powi(-8) * 1.01 + cols as f64 * 2.0f64.powi(-24));
                    assert!(
                        (g - want).abs() <= bound,
                        "{ty} rows {rows} cols {cols} m {m}: out[{i}][{r}] = {g}, want {want} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_tile_rows_do_not_depend_on_the_batch() {
    if max_level() < SimdLevel::AmxBf16 {
        eprintln!("note: no AMX-BF16 on this CPU; the bf16 tile kernel is not run");
        return;
    }
    let mut rng = StdRng::seed_from_u64(59);
    let (one, two) = (ThreadPool::new(1), ThreadPool::new(2));
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        for (rows, cols, m) in tile_cases() {
            let bytes = random_bytes(&mut rng, ty, rows, cols);
            let w = Weight::from_raw_at(SimdLevel::AmxBf16, ty, rows, cols, &bytes).unwrap();
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut alone = vec![0.0f32; m * rows];
            for i in 0..m {
                w.matmul(
                    &one,
                    &x[i * cols..(i + 1) * cols],
                    1,
                    &mut alone[i * rows..(i + 1) * rows],
                    &mut MatmulScratch::default(),
                );
            }
            // The whole batch, and its second half (so rows sit at other
            // places in their token tiles), on two threads.
            for from in [0, m / 2] {
                let mm = m - from;
                let mut got = vec![f32::NAN; mm * rows];
                w.matmul(
                    &two,
                    &x[from * cols..],
                    mm,
                    &mut got,
                    &mut MatmulScratch::default(),
                );
                for (e, (a, b)) in got.iter().zip(&alone[from * rows..]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} rows {rows} cols {cols} batch {mm}: out[{}][{}] = {a}, alone {b}",
                        from + e / rows,
                        e % rows
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_tile_layout_keeps_the_values_for_gathers_and_stacking() {
    if max_level() < SimdLevel::AmxBf16 {
        eprintln!("note: no AMX-BF16 on this CPU; the bf16 tile layout is not built");
        return;
    }
    let mut rng = StdRng::seed_from_u64(61);
    let pool = ThreadPool::new(2);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let cols = 96;
        let parts: Vec<(usize, Vec<u8>)> = [7usize, 16, 21]
            .into_iter()
            .map(|rows| (rows, random_bytes(&mut rng, ty, rows, cols)))
            .collect();
        let weights: Vec<Weight> = parts
            .iter()
            .map(|(rows, b)| Weight::from_raw_at(SimdLevel::AmxBf16, ty, *rows, cols, b).unwrap())
            .collect();
        // The embedding gather reproduces the format's values exactly.
        for ((rows, bytes), w) in parts.iter().zip(&weights) {
            let want = ref_matrix(ty, *rows, cols, bytes);
            let mut row = vec![0.0f32; cols];
            for r in 0..*rows {
                w.dequantize_row(r, &mut row);
                for (k, v) in row.iter().enumerate() {
                    assert_eq!(*v as f64, want[r * cols + k].0, "{ty} row {r} col {k}");
                }
            }
        }
        // Stacked (across ragged tiles), each part's rows are what the part
        // computes alone.
        let hosts: Vec<HostMatrix<'_>> = parts
            .iter()
            .map(|(rows, b)| HostMatrix::new(ty, *rows, cols, b.as_slice()).unwrap())
            .collect();
        let cat = HostMatrix::concat_rows(&hosts).unwrap();
        let stacked =
            Weight::from_raw_at(SimdLevel::AmxBf16, ty, cat.rows(), cols, cat.bytes()).unwrap();
        let m = 3;
        let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let total = stacked.rows();
        let mut all = vec![0.0f32; m * total];
        stacked.matmul(&pool, &x, m, &mut all, &mut MatmulScratch::default());
        let mut at = 0;
        for w in &weights {
            let mut part = vec![0.0f32; m * w.rows()];
            w.matmul(&pool, &x, m, &mut part, &mut MatmulScratch::default());
            for i in 0..m {
                for r in 0..w.rows() {
                    assert_eq!(
                        all[i * total + at + r].to_bits(),
                        part[i * w.rows() + r].to_bits(),
                        "{ty}: stacked row {} token {i}",
                        at + r
                    );
                }
            }
            at += w.rows();
        }
    }
}

/// The test's own statement of an [`Affine`]'s input side: gather through
/// the column order, then round onto `scale · (round(x / scale + offset) −
/// offset)` with the int8 clamp.
fn ref_affine_input(x: &[f32], cols: usize, perm: &[u32], scale: f32, offset: f32) -> Vec<f32> {
    x.chunks_exact(cols)
        .flat_map(|row| {
            perm.iter().map(move |&c| {
                let q = (row[c as usize] / scale + offset).round_ties_even();
                (q.clamp(-128.0, 127.0) - offset) * scale
            })
        })
        .collect()
}

#[test]
fn affine_matmul_is_the_plain_matmul_of_the_rewritten_input_then_scaled_and_biased() {
    let mut rng = StdRng::seed_from_u64(41);
    let pool = ThreadPool::new(2);
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_1,
        GgmlType::Q4_0,
        GgmlType::F32,
    ] {
        let (rows, cols) = (24, 96);
        let bytes = random_bytes(&mut rng, ty, rows, cols);
        let mut perm: Vec<u32> = (0..cols as u32).collect();
        for i in (1..cols).rev() {
            perm.swap(i, rng.random_range(0..=i));
        }
        let act = StaticActQuant {
            scale: 0.01,
            offset: 3.0,
        };
        let scale: Vec<f32> = (0..rows).map(|_| rng.random_range(0.5..2.0)).collect();
        let bias: Vec<f32> = (0..rows).map(|_| rng.random_range(-1.0..1.0)).collect();
        let affine = Affine {
            in_perm: Some(perm.clone()),
            act_quant: Some(act),
            out_scale: Some(scale.clone()),
            out_bias: Some(bias.clone()),
        };
        let plain = Weight::from_raw(ty, rows, cols, &bytes).unwrap();
        let wrapped = Weight::from_raw(ty, rows, cols, &bytes)
            .unwrap()
            .with_affine(Some(affine))
            .unwrap();
        for m in [1, 5, 17] {
            // Inputs past the clamp on both sides, so the int8 range matters.
            let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.5..1.5)).collect();
            let xr = ref_affine_input(&x, cols, &perm, act.scale, act.offset);
            let mut want = vec![0f32; m * rows];
            plain.matmul(&pool, &xr, m, &mut want, &mut MatmulScratch::default());
            for (i, w) in want.iter_mut().enumerate() {
                *w = *w * scale[i % rows] + bias[i % rows];
            }
            let mut got = vec![0f32; m * rows];
            let wide = vec![true; m];
            wrapped.matmul_rows(&pool, &x, m, &mut got, &mut MatmulScratch::default(), &wide);
            let mut got_plain_path = vec![0f32; m * rows];
            wrapped.matmul(
                &pool,
                &x,
                m,
                &mut got_plain_path,
                &mut MatmulScratch::default(),
            );
            assert_eq!(got_plain_path, want, "{ty} m={m}: matmul");
            if !plain.has_wide_kernel() {
                assert_eq!(got, want, "{ty} m={m}: matmul_rows");
            }
        }
        // Dequantized rows come back in input order, scaled.
        let (mut stored, mut layer) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            plain.dequantize_row(r, &mut stored);
            wrapped.dequantize_row(r, &mut layer);
            for (j, &c) in perm.iter().enumerate() {
                assert_eq!(layer[c as usize], stored[j] * scale[r], "{ty} row {r}");
            }
        }
    }
}

#[test]
fn affine_transforms_that_do_not_fit_are_refused() {
    let w = || Weight::from_raw(GgmlType::Q8_0, 2, 32, &[0u8; 68]).unwrap();
    let cases = [
        Affine {
            in_perm: Some((0..31).collect()),
            ..Affine::default()
        },
        Affine {
            in_perm: Some([0u32].repeat(32)),
            ..Affine::default()
        },
        Affine {
            out_scale: Some(vec![1.0; 3]),
            ..Affine::default()
        },
        Affine {
            out_bias: Some(vec![f32::NAN, 0.0]),
            ..Affine::default()
        },
        Affine {
            act_quant: Some(StaticActQuant {
                scale: 0.0,
                offset: 0.0,
            }),
            ..Affine::default()
        },
        Affine {
            act_quant: Some(StaticActQuant {
                scale: 1.0,
                offset: 0.5,
            }),
            ..Affine::default()
        },
    ];
    for a in cases {
        let err = w().with_affine(Some(a.clone())).unwrap_err();
        assert!(matches!(err, WeightError::Affine { .. }), "{a:?}: {err}");
    }
}

#[test]
fn stacked_affine_parts_compute_what_the_parts_compute() {
    let mut rng = StdRng::seed_from_u64(42);
    let pool = ThreadPool::new(1);
    let cols = 64;
    let perm: Vec<u32> = (0..cols as u32).rev().collect();
    let part = |rng: &mut StdRng, rows: usize, scaled: bool| {
        let bytes = random_bytes(rng, GgmlType::Q8_0, rows, cols);
        let affine = Affine {
            in_perm: Some(perm.clone()),
            out_scale: scaled.then(|| (0..rows).map(|r| 1.0 + r as f32).collect()),
            ..Affine::default()
        };
        HostMatrix::new(GgmlType::Q8_0, rows, cols, bytes)
            .unwrap()
            .with_affine(affine)
            .unwrap()
    };
    let parts = [part(&mut rng, 8, true), part(&mut rng, 16, false)];
    assert!(HostMatrix::can_concat(&parts));
    let cat = HostMatrix::concat_rows(&parts).unwrap();
    let upload = |h: &HostMatrix<'_>| {
        Weight::from_raw(h.ty(), h.rows(), h.cols(), h.bytes())
            .unwrap()
            .with_affine(h.affine().cloned())
            .unwrap()
    };
    let x: Vec<f32> = (0..3 * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut whole = vec![0f32; 3 * 24];
    upload(&cat).matmul(&pool, &x, 3, &mut whole, &mut MatmulScratch::default());
    let mut col = 0;
    for p in &parts {
        let mut out = vec![0f32; 3 * p.rows()];
        upload(p).matmul(&pool, &x, 3, &mut out, &mut MatmulScratch::default());
        for i in 0..3 {
            assert_eq!(
                &whole[i * 24 + col..i * 24 + col + p.rows()],
                &out[i * p.rows()..(i + 1) * p.rows()]
            );
        }
        col += p.rows();
    }
    // Another column order cannot share the matmul.
    let mut other = part(&mut rng, 8, false);
    other = other.with_affine(Affine::default()).unwrap();
    assert!(!HostMatrix::can_concat(&[parts[0].clone(), other.clone()]));
    assert!(matches!(
        HostMatrix::concat_rows(&[parts[0].clone(), other]),
        Err(WeightError::ConcatAffineMismatch { index: 1 })
    ));
}

/// The doubled e2m1 value of a 4-bit code from the OCP definition (sign bit
/// 3, exponent bits 1..3 with bias 1, subnormal at 0, mantissa bit 0),
/// times 2: an integer in `{0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}`.
fn e2m1_doubled(c: u8) -> i64 {
    let (ex, man) = ((c >> 1) & 3, (c & 1) as i64);
    let twice = if ex == 0 { man } else { (2 + man) << (ex - 1) };
    if c & 8 != 0 {
        -twice
    } else {
        twice
    }
}

/// The MXFP4 × Q8 product as its definition states it, in the float order
/// the kernels promise, written from scratch: each 32-element block of an
/// activation row quantized as ggml's Q8_0 (as `act.rs` does: scale
/// `amax / 127`, codes `round_ties_even(x · 127 / amax)` clamped to ±127),
/// the block's integer dot of doubled weight codes and activation codes
/// (exact, in i64), times `(2^(e − 128) · d)` rounded to f32, added to
/// partial sum `b mod 16`; the partial sums added pairwise, 8, 4, 2 and 1
/// apart.
fn mxfp4_q8_reference(bytes: &[u8], rows: usize, cols: usize, x: &[f32], m: usize) -> Vec<f32> {
    let nb = cols / 32;
    let mut out = vec![0f32; m * rows];
    for i in 0..m {
        let mut codes = vec![0i64; cols];
        let mut scales = vec![0f32; nb];
        for b in 0..nb {
            let xb = &x[i * cols + 32 * b..][..32];
            let amax = xb.iter().map(|v| v.abs()).fold(0f32, f32::max);
            scales[b] = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for (k, &v) in xb.iter().enumerate() {
                codes[32 * b + k] = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i64;
            }
        }
        for r in 0..rows {
            let mut part = [0f32; 16];
            for b in 0..nb {
                let blk = &bytes[(r * nb + b) * 17..][..17];
                let mut dot = 0i64;
                for k in 0..32 {
                    let code = if k < 16 {
                        blk[1 + k] & 15
                    } else {
                        blk[1 + k - 16] >> 4
                    };
                    dot += e2m1_doubled(code) * codes[32 * b + k];
                }
                let half = 2f64.powi(blk[0] as i32 - 128) as f32;
                part[b % 16] += dot as f32 * (half * scales[b]);
            }
            for h in [8, 4, 2, 1] {
                for j in 0..h {
                    part[j] += part[j + h];
                }
            }
            out[i * rows + r] = part[0];
        }
    }
    out
}

/// The MXFP4 × Q8 kernels give the bits of [`mxfp4_q8_reference`] at every
/// level, for every batch size 1..=16 (taken from any offset of a larger
/// batch), row count (whole and ragged 4-row tiles, one or three threads)
/// and width (one block, a short tail group, whole groups, groups and a
/// tail: 1, 3, 16, 24 and 90 blocks), including scales at the subnormal
/// ends (`e` 0 and 1) and activations with zero and single-value blocks.
#[test]
fn mxfp4_q8_kernels_are_bitwise_the_reference() {
    let mut rng = StdRng::seed_from_u64(4401);
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    for (k, &(rows, cols)) in [(1usize, 32usize), (5, 96), (9, 512), (7, 768), (13, 2880)]
        .iter()
        .enumerate()
    {
        let mut bytes = random_bytes(&mut rng, GgmlType::MXFP4, rows, cols);
        // Exponents at both ends in the first row: 0 and 1 (subnormal half
        // scales), 254 and 255 stay finite against small activations.
        for (b, blk) in bytes.chunks_exact_mut(17).take(cols / 32).enumerate() {
            blk[0] = [0u8, 1, 2, 126, 127, 128][b % 6];
        }
        let m = 16;
        let mut x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        // A zero block and a block of one repeated value (ties in rounding).
        x[..32].fill(0.0);
        if cols >= 64 {
            x[cols + 32..cols + 64].fill(-0.75);
        }
        let want = mxfp4_q8_reference(&bytes, rows, cols, &x, m);
        let w = Weight::from_raw(GgmlType::MXFP4, rows, cols, &bytes).unwrap();
        let mut scratch = MatmulScratch::default();
        for level in levels() {
            let pool = &pools[k % 2];
            for n in 1..=m {
                for i0 in [0, m - n] {
                    let mut out = vec![f32::NAN; n * rows];
                    let xs = &x[i0 * cols..(i0 + n) * cols];
                    w.matmul_at(level, pool, xs, n, &mut out, &mut scratch);
                    for (j, &g) in out.iter().enumerate() {
                        let r = want[i0 * rows + j];
                        assert_eq!(
                            g.to_bits(),
                            r.to_bits(),
                            "{level:?} rows {rows} cols {cols}: batch of {n} from {i0}, out {j}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }
}

/// A kernel that broke would fail [`mxfp4_q8_kernels_are_bitwise_the_reference`]:
/// the reference tells apart a weight code one step off, and the product
/// with f32 activations (the exact path) from the Q8 one.
#[test]
fn mxfp4_q8_reference_tells_a_changed_code_and_exact_activations_apart() {
    let mut rng = StdRng::seed_from_u64(4402);
    let (rows, cols, m) = (3, 96, 2);
    let bytes = random_bytes(&mut rng, GgmlType::MXFP4, rows, cols);
    let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
    let want = mxfp4_q8_reference(&bytes, rows, cols, &x, m);
    let mut changed = bytes.clone();
    changed[17 + 5] ^= 0x01;
    let moved = mxfp4_q8_reference(&changed, rows, cols, &x, m);
    assert_ne!(want, moved);
    let exact = Weight::from_mxfp4_f32_act(rows, cols, &bytes).unwrap();
    let mut out = vec![0f32; m * rows];
    exact.matmul(
        &ThreadPool::new(1),
        &x,
        m,
        &mut out,
        &mut MatmulScratch::default(),
    );
    assert_ne!(out, want);
    let q8 = Weight::from_raw(GgmlType::MXFP4, rows, cols, &bytes).unwrap();
    q8.matmul(
        &ThreadPool::new(1),
        &x,
        m,
        &mut out,
        &mut MatmulScratch::default(),
    );
    assert_eq!(out, want);
}

/// Through the CPU backend's grouped expert product (what the MoE layers
/// run), an MXFP4 expert's rows give the same bits as the expert's own
/// matmul of those rows alone, whatever the other experts' rows.
#[test]
fn mxfp4_grouped_experts_match_each_expert_alone() {
    use crate::backend::Backend;
    let mut rng = StdRng::seed_from_u64(4403);
    let (rows, cols, experts) = (40usize, 768usize, 3usize);
    let mut be =
        crate::backend::CpuBackend::new(crate::CpuContext::new(2), crate::cpu::simd_level());
    let mut mats = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..experts {
        let bytes = random_bytes(&mut rng, GgmlType::MXFP4, rows, cols);
        mats.push(
            be.upload_matrix(&HostMatrix::new(GgmlType::MXFP4, rows, cols, &bytes[..]).unwrap())
                .unwrap(),
        );
        raw.push(bytes);
    }
    // Expert 0 gets 5 rows, expert 1 none, expert 2 gets 2.
    let counts = [5usize, 0, 2];
    let total: usize = counts.iter().sum();
    let x: Vec<f32> = (0..total * cols)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let mut offsets = vec![0usize];
    for c in counts {
        offsets.push(offsets.last().unwrap() + c);
    }
    let mut routes = crate::ops::Routing::default();
    routes.offsets = offsets.clone();
    let mut out = vec![f32::NAN; total * rows];
    be.grouped_matmul(&mats, &x, &routes, &mut out);
    for e in 0..experts {
        let (r0, r1) = (offsets[e], offsets[e + 1]);
        if r0 == r1 {
            continue;
        }
        let want = mxfp4_q8_reference(&raw[e], rows, cols, &x[r0 * cols..r1 * cols], r1 - r0);
        for (j, (&g, &r)) in out[r0 * rows..r1 * rows].iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), r.to_bits(), "expert {e} out {j}");
        }
    }
}
