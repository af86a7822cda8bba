use super::*;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

fn levels() -> Vec<SimdLevel> {
    [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
        .into_iter()
        .filter(|&l| l <= simd_level())
        .collect()
}

/// (q_len, ctx_len) of one sequence in a test batch.
type SeqShape = (usize, usize);

struct Case {
    head_dim: usize,
    n_heads: usize,
    n_kv: usize,
    block_size: usize,
    seqs: Vec<SeqShape>,
}

/// Plain causal GQA over contiguous per-sequence K/V, in f64.
/// `k[p][kvh*d + i]` holds the cache's (rounded) values.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    n_heads: usize,
    n_kv: usize,
    d: usize,
    q_start: usize,
    q_len: usize,
    ctx_len: usize,
    scale: f64,
    window: Option<usize>,
    sinks: Option<&[f32]>,
    out: &mut [f64],
) {
    let g = n_heads / n_kv;
    for i in 0..q_len {
        let pos = ctx_len - q_len + i;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..n_heads {
            let kvh = h / g;
            let qr = &q[((q_start + i) * n_heads + h) * d..][..d];
            let scores: Vec<f64> = (lo..=pos)
                .map(|p| {
                    let kr = &k[p][kvh * d..][..d];
                    qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum::<f64>() * scale
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            // A sink joins the denominator only: it has no value.
            let sink = sinks.map_or(0.0, |s| (s[h] as f64 - mx).exp());
            let total: f64 = w.iter().sum::<f64>() + sink;
            let o = &mut out[((q_start + i) * n_heads + h) * d..][..d];
            o.fill(0.0);
            for (p, wp) in w.iter().enumerate() {
                for (oi, vi) in o.iter_mut().zip(&v[lo + p][kvh * d..][..d]) {
                    *oi += wp / total * vi;
                }
            }
        }
    }
}

fn run_case<T: KvElem>(case: &Case, rng: &mut StdRng, shuffle_seqs: bool) {
    run_case_windowed::<T>(case, rng, shuffle_seqs, None)
}

fn run_case_windowed<T: KvElem>(
    case: &Case,
    rng: &mut StdRng,
    shuffle_seqs: bool,
    window: Option<usize>,
) {
    run_case_full::<T>(case, rng, shuffle_seqs, window, None)
}

/// One case against the f64 reference, with a window and sink logits.
fn run_case_full<T: KvElem>(
    case: &Case,
    rng: &mut StdRng,
    shuffle_seqs: bool,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) {
    let (d, n_heads, n_kv, bs) = (case.head_dim, case.n_heads, case.n_kv, case.block_size);
    let blocks_needed: usize = case.seqs.iter().map(|&(_, c)| c.div_ceil(bs)).sum();
    let layout = KvLayout {
        num_blocks: blocks_needed + 5,
        block_size: bs,
        n_kv_heads: n_kv,
        head_dim: d,
    };
    // A shuffled pool: sequences get scattered, non-contiguous blocks.
    let mut free: Vec<u32> = (0..layout.num_blocks as u32).collect();
    free.shuffle(rng);
    // Poison so a read of an unwritten slot shows up as a wrong result.
    let mut k_cache = vec![T::from_f32(1e3); layout.elems()];
    let mut v_cache = vec![T::from_f32(-1e3); layout.elems()];
    let row = n_kv * d;
    let mut tables = Vec::new();
    let mut contig_k = Vec::new();
    let mut contig_v = Vec::new();
    for &(_, ctx) in &case.seqs {
        let table: Vec<u32> = free.drain(..ctx.div_ceil(bs)).collect();
        let k: Vec<f32> = (0..ctx * row)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..ctx * row)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let slots: Vec<u32> = (0..ctx)
            .map(|p| table[p / bs] * bs as u32 + (p % bs) as u32)
            .collect();
        write_kv(&layout, &mut k_cache, &mut v_cache, &k, &v, &slots);
        // The reference sees exactly the rounded values the cache holds.
        let round = |x: &[f32]| -> Vec<Vec<f64>> {
            x.chunks(row)
                .map(|r| r.iter().map(|&a| T::from_f32(a).to_f32() as f64).collect())
                .collect()
        };
        contig_k.push(round(&k));
        contig_v.push(round(&v));
        tables.push(table);
    }
    let n_tokens: usize = case.seqs.iter().map(|&(q, _)| q).sum();
    let q: Vec<f32> = (0..n_tokens * n_heads * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut seqs = Vec::new();
    let mut start = 0;
    for (i, &(q_len, ctx_len)) in case.seqs.iter().enumerate() {
        seqs.push(AttnSeq {
            q_start: start,
            q_len,
            ctx_len,
            block_table: &tables[i],
        });
        start += q_len;
    }
    let scale = 1.0 / (d as f32).sqrt();
    let mut want = vec![0.0f64; q.len()];
    for (i, s) in seqs.iter().enumerate() {
        reference(
            &q,
            &contig_k[i],
            &contig_v[i],
            n_heads,
            n_kv,
            d,
            s.q_start,
            s.q_len,
            s.ctx_len,
            scale as f64,
            window,
            sinks,
            &mut want,
        );
    }
    if shuffle_seqs {
        seqs.shuffle(rng);
    }
    for threads in [1usize, 3] {
        let pool = ThreadPool::new(threads);
        for level in levels() {
            let mut out = vec![f32::NAN; q.len()];
            paged_attention_at(
                level, &pool, &layout, &k_cache, &v_cache, &q, n_heads, &seqs, scale, window,
                sinks, &mut out,
            );
            for (idx, (&got, &w)) in out.iter().zip(&want).enumerate() {
                let (tok, rest) = (idx / (n_heads * d), idx % (n_heads * d));
                assert!(
                    (got as f64 - w).abs() <= 3e-5,
                    "{:?} {level:?} window={window:?} threads={threads} d={d} heads={n_heads}/{n_kv} bs={bs} seqs={:?}: \
                     token {tok} head {} dim {}: {got} vs {w}",
                    T::DTYPE,
                    case.seqs,
                    rest / d,
                    rest % d
                );
            }
        }
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for &(head_dim, n_heads, n_kv) in &[
        (64usize, 9usize, 3usize),
        (32, 4, 4),
        (80, 8, 2),
        (64, 16, 1),
    ] {
        for &block_size in &[1usize, 4, 16, 32] {
            v.push(Case {
                head_dim,
                n_heads,
                n_kv,
                block_size,
                seqs: vec![
                    (1, 1),   // first decode step
                    (1, 37),  // decode
                    (5, 5),   // short prefill
                    (2, 50),  // speculative-style short chunk
                    (3, 19),  // rows = 3 * group: straddles the kernel switch
                    (70, 70), // prefill: several wide tiles
                    (23, 90), // chunked prefill
                    (1, 64),  // decode at a block boundary
                ],
            });
        }
    }
    v
}

#[test]
fn paged_attention_matches_reference_f32() {
    let mut rng = StdRng::seed_from_u64(11);
    for (i, case) in cases().iter().enumerate() {
        run_case::<f32>(case, &mut rng, i % 3 == 0);
    }
}

#[test]
fn paged_attention_matches_reference_f16() {
    let mut rng = StdRng::seed_from_u64(12);
    for (i, case) in cases().iter().enumerate() {
        run_case::<f16>(case, &mut rng, i % 3 == 1);
    }
}

#[test]
fn paged_attention_matches_reference_bf16() {
    let mut rng = StdRng::seed_from_u64(13);
    for (i, case) in cases().iter().enumerate() {
        run_case::<bf16>(case, &mut rng, i % 3 == 2);
    }
}

#[test]
fn a_sliding_window_matches_the_reference() {
    // Windows of one position, shorter than a chunk, a block and a
    // chunk exactly, and longer than some contexts.
    let mut rng = StdRng::seed_from_u64(15);
    for (i, case) in cases().iter().enumerate() {
        let window = [1usize, 5, 16, 32, 45][i % 5];
        match i % 3 {
            0 => run_case_windowed::<f32>(case, &mut rng, true, Some(window)),
            1 => run_case_windowed::<f16>(case, &mut rng, false, Some(window)),
            _ => run_case_windowed::<bf16>(case, &mut rng, true, Some(window)),
        }
    }
}

/// A sink logit per q head joins each row's softmax denominator and
/// contributes no value: against the f64 reference for every cache type,
/// with and without a window, sinks from far below to far above the scores
/// (a sink of +40 leaves outputs near 0, one of -40 changes nothing).
#[test]
fn attention_sinks_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(16);
    for (i, case) in cases().iter().enumerate() {
        let sinks: Vec<f32> = (0..case.n_heads)
            .map(|h| match h % 4 {
                0 => 40.0,
                1 => -40.0,
                _ => rng.random_range(-3.0..3.0),
            })
            .collect();
        let window = [None, Some(5), Some(32)][i % 3];
        match i % 3 {
            0 => run_case_full::<f32>(case, &mut rng, true, window, Some(&sinks)),
            1 => run_case_full::<f16>(case, &mut rng, false, window, Some(&sinks)),
            _ => run_case_full::<bf16>(case, &mut rng, true, window, Some(&sinks)),
        }
    }
}

#[test]
fn paged_attention_random_shapes() {
    let mut rng = StdRng::seed_from_u64(14);
    for _ in 0..12 {
        let &(head_dim, n_heads, n_kv) = [
            (32usize, 9usize, 3usize),
            (64, 4, 4),
            (80, 8, 2),
            (72, 6, 3),
            (128, 32, 8),
        ]
        .choose(&mut rng)
        .unwrap();
        let block_size = *[1usize, 4, 8, 16, 32, 64].choose(&mut rng).unwrap();
        let n = rng.random_range(1..6);
        let seqs = (0..n)
            .map(|_| {
                let ctx = rng.random_range(1..160);
                let q = if rng.random_bool(0.5) {
                    1
                } else {
                    rng.random_range(1..=ctx)
                };
                (q, ctx)
            })
            .collect();
        let case = Case {
            head_dim,
            n_heads,
            n_kv,
            block_size,
            seqs,
        };
        match rng.random_range(0..3) {
            0 => run_case::<f32>(&case, &mut rng, true),
            1 => run_case::<f16>(&case, &mut rng, false),
            _ => run_case::<bf16>(&case, &mut rng, true),
        }
    }
}

#[test]
fn large_scores_stay_finite() {
    // Scores in the hundreds: a softmax without max subtraction (or a
    // rescale bug in the online update) overflows here.
    let d = 64;
    let layout = KvLayout {
        num_blocks: 8,
        block_size: 16,
        n_kv_heads: 1,
        head_dim: d,
    };
    let mut kc = vec![0.0f32; layout.elems()];
    let mut vc = vec![0.0f32; layout.elems()];
    let ctx = 100;
    let k: Vec<f32> = (0..ctx * d)
        .map(|i| if i % d == 0 { (i / d) as f32 } else { 0.0 })
        .collect();
    let v: Vec<f32> = (0..ctx * d).map(|i| (i / d) as f32).collect();
    let table = [3u32, 1, 7, 0, 2, 6, 5];
    let slots: Vec<u32> = (0..ctx as u32)
        .map(|p| table[p as usize / 16] * 16 + p % 16)
        .collect();
    write_kv(&layout, &mut kc, &mut vc, &k, &v, &slots);
    let mut q = vec![0.0f32; 40 * d];
    for t in 0..40 {
        q[t * d] = 10.0;
    }
    let pool = ThreadPool::new(2);
    for level in levels() {
        let mut out = vec![0.0f32; q.len()];
        let seqs = [AttnSeq {
            q_start: 0,
            q_len: 40,
            ctx_len: ctx,
            block_table: &table,
        }];
        paged_attention_at(
            level, &pool, &layout, &kc, &vc, &q, 1, &seqs, 1.0, None, None, &mut out,
        );
        for t in 0..40 {
            // Score of position p is 10p: the last visible position wins.
            let pos = (ctx - 40 + t) as f32;
            let got = out[t * d];
            assert!(
                (got - pos).abs() < 1e-3,
                "{level:?} token {t}: {got} vs ~{pos}"
            );
        }
    }
}

#[test]
fn write_kv_round_trips() {
    fn check<T: KvElem>() {
        let layout = KvLayout {
            num_blocks: 6,
            block_size: 4,
            n_kv_heads: 3,
            head_dim: 8,
        };
        let mut kc = vec![T::from_f32(0.0); layout.elems()];
        let mut vc = vec![T::from_f32(0.0); layout.elems()];
        let row = 3 * 8;
        let slots = [5u32, 23, 0, 14];
        let k: Vec<f32> = (0..slots.len() * row)
            .map(|i| i as f32 * 0.37 - 3.0)
            .collect();
        let v: Vec<f32> = (0..slots.len() * row)
            .map(|i| 7.0 - i as f32 * 0.11)
            .collect();
        write_kv(&layout, &mut kc, &mut vc, &k, &v, &slots);
        let mut written = 0;
        for (t, &slot) in slots.iter().enumerate() {
            let (b, off) = (slot as usize / 4, slot as usize % 4);
            for h in 0..3 {
                for i in 0..8 {
                    // Slabs of 4 positions × 8 elements: V by position,
                    // K transposed.
                    let slab = (b * 3 + h) * 4 * 8;
                    let src = t * row + h * 8 + i;
                    assert_eq!(
                        kc[slab + i * 4 + off].to_f32(),
                        T::from_f32(k[src]).to_f32()
                    );
                    assert_eq!(
                        vc[slab + off * 8 + i].to_f32(),
                        T::from_f32(v[src]).to_f32()
                    );
                    written += 1;
                }
            }
        }
        // Nothing else was touched (k values are never exactly 0 here).
        let nonzero = kc.iter().filter(|x| x.to_f32() != 0.0).count();
        assert_eq!(nonzero, written);
    }
    check::<f32>();
    check::<f16>();
    check::<bf16>();
    assert_eq!(f32::DTYPE, KvDtype::F32);
    assert_eq!(f16::DTYPE, KvDtype::F16);
    assert_eq!(bf16::DTYPE, KvDtype::Bf16);
}

#[test]
fn rows_outside_sequences_are_untouched() {
    let layout = KvLayout {
        num_blocks: 2,
        block_size: 4,
        n_kv_heads: 1,
        head_dim: 16,
    };
    let kc = vec![0.5f32; layout.elems()];
    let vc = vec![0.25f32; layout.elems()];
    let q = vec![1.0f32; 3 * 16];
    let mut out = vec![9.0f32; 3 * 16];
    let table = [1u32];
    let seqs = [AttnSeq {
        q_start: 1,
        q_len: 1,
        ctx_len: 3,
        block_table: &table,
    }];
    paged_attention(
        &ThreadPool::new(2),
        &layout,
        &kc,
        &vc,
        &q,
        1,
        &seqs,
        0.25,
        None,
        &mut out,
    );
    assert!(out[..16].iter().chain(&out[32..]).all(|&x| x == 9.0));
    assert!(out[16..32].iter().all(|&x| (x - 0.25).abs() < 1e-6));
}

#[test]
#[should_panic(expected = "overlap")]
fn overlapping_sequences_panic() {
    let layout = KvLayout {
        num_blocks: 2,
        block_size: 4,
        n_kv_heads: 1,
        head_dim: 16,
    };
    let kc = vec![0.0f32; layout.elems()];
    let q = vec![0.0f32; 3 * 16];
    let mut out = vec![0.0f32; 3 * 16];
    let table = [0u32];
    let seqs = [
        AttnSeq {
            q_start: 1,
            q_len: 2,
            ctx_len: 2,
            block_table: &table,
        },
        AttnSeq {
            q_start: 0,
            q_len: 2,
            ctx_len: 2,
            block_table: &table,
        },
    ];
    paged_attention(
        &ThreadPool::new(2),
        &layout,
        &kc,
        &kc,
        &q,
        1,
        &seqs,
        1.0,
        None,
        &mut out,
    );
}

/// One prompt's K/V in a shuffled pool, plus a second sequence's for
/// batch mates, for the invariance tests.
struct Prompt<T> {
    layout: KvLayout,
    k: Vec<T>,
    v: Vec<T>,
    table: Vec<u32>,
    mate_table: Vec<u32>,
    q: Vec<f32>,
    n_heads: usize,
}

const PROMPT_LEN: usize = 150;
const MATE_LEN: usize = 45;

fn prompt<T: KvElem>(
    rng: &mut StdRng,
    head_dim: usize,
    n_heads: usize,
    n_kv: usize,
    block_size: usize,
) -> Prompt<T> {
    let blocks = PROMPT_LEN.div_ceil(block_size) + MATE_LEN.div_ceil(block_size);
    let layout = KvLayout {
        num_blocks: blocks + 3,
        block_size,
        n_kv_heads: n_kv,
        head_dim,
    };
    let mut free: Vec<u32> = (0..layout.num_blocks as u32).collect();
    free.shuffle(rng);
    let table: Vec<u32> = free.drain(..PROMPT_LEN.div_ceil(block_size)).collect();
    let mate_table: Vec<u32> = free.drain(..MATE_LEN.div_ceil(block_size)).collect();
    let mut k = vec![T::from_f32(0.0); layout.elems()];
    let mut v = vec![T::from_f32(0.0); layout.elems()];
    let row = n_kv * head_dim;
    for (t, len) in [(&table, PROMPT_LEN), (&mate_table, MATE_LEN)] {
        // Keys with a drift over the positions, so the running max moves
        // in later chunks and the online rescale is exercised.
        let kv: Vec<f32> = (0..len * row)
            .map(|i| rng.random_range(-1.0..1.0) + (i / row) as f32 * 0.01)
            .collect();
        let vv: Vec<f32> = (0..len * row)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let slots: Vec<u32> = (0..len)
            .map(|p| t[p / block_size] * block_size as u32 + (p % block_size) as u32)
            .collect();
        write_kv(&layout, &mut k, &mut v, &kv, &vv, &slots);
    }
    // Large enough queries that scores spread over several units.
    let q = (0..PROMPT_LEN * n_heads * head_dim)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    Prompt {
        layout,
        k,
        v,
        table,
        mate_table,
        q,
        n_heads,
    }
}

/// The prompt's output rows computed in chunks of `chunk` queries (each
/// call attending to the cache up to the chunk's end), each call with a
/// decode row and a short chunk of another sequence around it.
fn chunked<T: KvElem>(
    p: &Prompt<T>,
    level: SimdLevel,
    pool: &ThreadPool,
    chunk: usize,
    window: Option<usize>,
    sinks: Option<&[f32]>,
    rng: &mut StdRng,
) -> Vec<f32> {
    let w = p.n_heads * p.layout.head_dim;
    let scale = 1.0 / (p.layout.head_dim as f32).sqrt();
    let mut out = vec![f32::NAN; PROMPT_LEN * w];
    let mut start = 0;
    while start < PROMPT_LEN {
        let len = chunk.min(PROMPT_LEN - start);
        let mate_ctx = rng.random_range(3..=MATE_LEN);
        let mate_q = rng.random_range(1..=3);
        // Rows: [decode mate][our chunk][mate chunk].
        let mut qb: Vec<f32> = (0..w).map(|_| rng.random_range(-3.0..3.0)).collect();
        qb.extend_from_slice(&p.q[start * w..(start + len) * w]);
        qb.extend((0..mate_q * w).map(|_| rng.random_range(-3.0..3.0)));
        let seqs = [
            AttnSeq {
                q_start: 0,
                q_len: 1,
                ctx_len: mate_ctx,
                block_table: &p.mate_table,
            },
            AttnSeq {
                q_start: 1,
                q_len: len,
                ctx_len: start + len,
                block_table: &p.table,
            },
            AttnSeq {
                q_start: 1 + len,
                q_len: mate_q,
                ctx_len: MATE_LEN,
                block_table: &p.mate_table,
            },
        ];
        let mut ob = vec![f32::NAN; qb.len()];
        paged_attention_at(
            level, pool, &p.layout, &p.k, &p.v, &qb, p.n_heads, &seqs, scale, window, sinks,
            &mut ob,
        );
        out[start * w..(start + len) * w].copy_from_slice(&ob[w..(1 + len) * w]);
        start += len;
    }
    out
}

/// A query row's output is bitwise the same whatever tile it is
/// computed in: the prompt in chunks of 1 (decode), 2, 5, 17, 64 and all
/// 150 queries at once, on 1 or 3 threads, with batch mates; with and
/// without a window, and with sink logits.
fn check_tile_invariance<T: KvElem>(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    // (head_dim, n_heads, n_kv, block_size): group sizes 3, 4, 1, 2 and
    // 7, head dims with and without a partial vector, an f32 cache read
    // in place in chunks of 8 (block size 8), one gathered (bs 1), and
    // decode reading the cache in place with and without a partial
    // vector of values (bs 16 and 32).
    for &(d, h, kv, bs) in &[
        (64usize, 9usize, 3usize, 16usize),
        (72, 8, 2, 8),
        (40, 4, 4, 1),
        (40, 4, 2, 16),
        (128, 14, 2, 32),
    ] {
        let p = prompt::<T>(&mut rng, d, h, kv, bs);
        let sink_logits: Vec<f32> = (0..h).map(|_| rng.random_range(-2.0..4.0)).collect();
        let sk = Some(sink_logits.as_slice());
        // Full attention, and windows below and above a chunk; sinks with
        // and without a window.
        for (level, window, sinks) in levels().into_iter().flat_map(|l| {
            [
                (l, None, None),
                (l, Some(20), None),
                (l, Some(71), None),
                (l, None, sk),
                (l, Some(20), sk),
            ]
        }) {
            let want = chunked(
                &p,
                level,
                &ThreadPool::new(1),
                PROMPT_LEN,
                window,
                sinks,
                &mut rng,
            );
            assert!(want.iter().all(|x| x.is_finite()));
            for threads in [1usize, 3] {
                let pool = ThreadPool::new(threads);
                for chunk in [1usize, 2, 5, 17, 64, PROMPT_LEN] {
                    let got = chunked(&p, level, &pool, chunk, window, sinks, &mut rng);
                    let w = h * d;
                    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits())
                    {
                        panic!(
                            "{:?} {level:?} window={window:?} sinks={} d={d} heads={h}/{kv} bs={bs} threads={threads}: \
                             in chunks of {chunk}, position {} head {} dim {} is {} \
                             but {} in one prefill",
                            T::DTYPE,
                            sinks.is_some(),
                            i / w,
                            i % w / d,
                            i % d,
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rows_do_not_depend_on_the_tile_f32() {
    check_tile_invariance::<f32>(21);
}

#[test]
fn rows_do_not_depend_on_the_tile_f16() {
    check_tile_invariance::<f16>(22);
}

#[test]
fn rows_do_not_depend_on_the_tile_bf16() {
    check_tile_invariance::<bf16>(23);
}
