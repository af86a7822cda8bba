//! LoRA deltas for a batch that mixes adapters (the idea of Punica's BGMV
//! and S-LoRA's kernels): every token of a step carries the slot of its
//! request's adapter (or none), and each adapted projection adds
//! `scale · B (A x)` to the token's output columns, with its own adapter's
//! factors. The base weights are never copied or merged.
//!
//! The factors are f32, bf16 or f16 (vLLM's `--lora-dtype`): at decode a
//! token's delta streams every factor once, so halving their bytes halves
//! its cost beside a quantized base. Arithmetic is f32 either way.
//!
//! A token's result does not depend on which other tokens share the step,
//! nor on how the work is split across threads: every `h[k]` is one dot
//! product computed by one thread, and every output element adds its
//! `h[k] · Bᵀ[k, j]` terms in `k` order with fused multiply-adds, whichever
//! thread owns the column.

/// One factor matrix, row-major, in its storage type.
#[derive(Clone, Copy, Debug)]
pub enum LoraData<'a> {
    F32(&'a [f32]),
    /// bfloat16 bits (the top half of an f32).
    Bf16(&'a [u16]),
    /// IEEE half-precision bits.
    F16(&'a [u16]),
}

impl LoraData<'_> {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            LoraData::F32(v) => v.len(),
            LoraData::Bf16(v) | LoraData::F16(v) => v.len(),
        }
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per element.
    pub fn elem_size(&self) -> usize {
        match self {
            LoraData::F32(_) => 4,
            LoraData::Bf16(_) | LoraData::F16(_) => 2,
        }
    }
}

/// One adapter's factors for one projection.
#[derive(Clone, Copy, Debug)]
pub struct LoraFactors<'a> {
    /// `[rank, in]`, row-major.
    pub a: LoraData<'a>,
    /// `Bᵀ`: `[rank, out]`, row-major, so that the expansion runs along
    /// contiguous rows (one `axpy` per rank) rather than `out` short dots.
    pub b: LoraData<'a>,
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// The most LoRA rank the kernel's stack scratch holds.
pub const MAX_LORA_RANK: usize = 512;

/// Reusable buffers of [`lora_add`], so that a decode step allocates
/// nothing once warm.
#[derive(Debug, Default)]
pub struct LoraScratch {
    /// The visiting order: tokens with factors, grouped by slot.
    order: Vec<u32>,
    /// `scale · A x` per visited token, `max rank` apart (the two-phase
    /// path for small batches).
    h: Vec<f32>,
}

/// Adds the LoRA deltas of a projection to `out`: for every token `t` whose
/// slot `token_slots[t]` has factors (`slot_of` gives them), and every output `j` of
/// `0..out_dim`, `out[t·out_stride + col + j] += Σ_k bᵀ[k,j] · scale ·
/// Σ_i a[k,i] · x[t·in_dim + i]`. Tokens without a slot (`u16::MAX`, or a
/// slot without factors) are left alone. With `pool`, the work is split
/// across its threads: by token for batches, and by rank then by output
/// column for a few tokens (a single decode stream would otherwise leave
/// every other core idle while its delta streams the factors). Each
/// token's bits are the same either way.
///
/// # Panics
/// If a slot's factors are not `rank × in_dim` and `rank × out_dim`, or
/// the rank is above [`MAX_LORA_RANK`] (the loader refuses both).
#[allow(clippy::too_many_arguments)]
pub fn lora_add<'a>(
    x: &[f32],
    in_dim: usize,
    token_slots: &[u16],
    slot_of: impl Fn(u16) -> Option<LoraFactors<'a>> + Sync,
    out: &mut [f32],
    out_stride: usize,
    col: usize,
    out_dim: usize,
    scratch: &mut LoraScratch,
    pool: Option<&crate::ThreadPool>,
) {
    lora_add_split_from(
        x,
        in_dim,
        token_slots,
        slot_of,
        out,
        out_stride,
        col,
        out_dim,
        scratch,
        pool,
        SPLIT_MIN_BYTES,
    )
}

/// The factor bytes a call must stream before its work is shared with the
/// pool. A parallel region costs a few microseconds of waking and joining
/// threads, and a decode step of a small model with adapters on all seven
/// projections runs hundreds of these calls of a microsecond or two each:
/// split, they cost a 135M model's single stream 28% of its speed, done on
/// the calling thread 2-10% (bench/lora.sh). 128 KiB is about ten
/// microseconds of streaming on one core, where halving it starts to pay
/// for the region; an 8B model's projections are above it for one token.
const SPLIT_MIN_BYTES: usize = 128 << 10;

/// [`lora_add`] with the threshold of [`SPLIT_MIN_BYTES`] as a parameter,
/// so that tests can reach every split on small factors.
#[allow(clippy::too_many_arguments)]
fn lora_add_split_from<'a>(
    x: &[f32],
    in_dim: usize,
    token_slots: &[u16],
    slot_of: impl Fn(u16) -> Option<LoraFactors<'a>> + Sync,
    out: &mut [f32],
    out_stride: usize,
    col: usize,
    out_dim: usize,
    scratch: &mut LoraScratch,
    pool: Option<&crate::ThreadPool>,
    split_min_bytes: usize,
) {
    let order = &mut scratch.order;
    order.clear();
    let mut max_rank = 0;
    let mut bytes = 0;
    for t in 0..token_slots.len() {
        if let Some(f) = slot_of(token_slots[t]) {
            assert!(
                f.rank <= MAX_LORA_RANK,
                "LoRA rank {} above the kernel's",
                f.rank
            );
            assert_eq!(f.a.len(), f.rank * in_dim, "lora A is not rank × in");
            assert_eq!(f.b.len(), out_dim * f.rank, "lora Bᵀ is not rank × out");
            assert!(
                t * out_stride + col + out_dim <= out.len(),
                "lora_add: out is too short"
            );
            max_rank = max_rank.max(f.rank);
            bytes += f.a.len() * f.a.elem_size() + f.b.len() * f.b.elem_size();
            order.push(t as u32);
        }
    }
    if order.is_empty() {
        return;
    }
    // Stable: each slot's tokens keep their order, and one adapter's
    // factors stay in cache while its tokens run.
    order.sort_by_key(|&t| token_slots[t as usize]);
    let order = &scratch.order[..];
    // The same path for every token of the process, so a token's bits do
    // not depend on its batch.
    let simd = Simd::detect();
    let o = OutRows(out.as_mut_ptr());
    let pool = pool.filter(|_| bytes >= split_min_bytes);
    let threads = pool.map_or(1, |p| p.threads());
    match pool {
        // Fewer tokens than threads have work to share: first every
        // `h[k]` (split by rank), then every output column (split by
        // column); two regions, since the columns need all of `h`.
        Some(pool) if threads > 1 && order.len() < 2 * threads => {
            let h_len = order.len() * max_rank;
            scratch.h.resize(h_len, 0.0);
            let h = OutRows(scratch.h.as_mut_ptr());
            let (h, o) = (&h, &o);
            let rank_chunks = threads.min(max_rank).max(1);
            pool.run(order.len() * rank_chunks, &|task| {
                let (i, c) = (task / rank_chunks, task % rank_chunks);
                let t = order[i] as usize;
                let Some(f) = slot_of(token_slots[t]) else {
                    return;
                };
                let (k0, k1) = (f.rank * c / rank_chunks, f.rank * (c + 1) / rank_chunks);
                let xt = &x[t * in_dim..(t + 1) * in_dim];
                // SAFETY: task `(i, c)` alone writes `h[i·max_rank + k0..k1]`,
                // within `h_len` since `k1 ≤ rank ≤ max_rank`.
                let hk =
                    unsafe { std::slice::from_raw_parts_mut(h.0.add(i * max_rank + k0), k1 - k0) };
                shrink(&f, k0, xt, hk, simd);
            });
            // Column chunks of whole cache lines.
            let col_chunks = threads.min(out_dim.div_ceil(16)).max(1);
            let per = out_dim.div_ceil(col_chunks).div_ceil(16) * 16;
            pool.run(order.len() * col_chunks, &|task| {
                let (i, c) = (task / col_chunks, task % col_chunks);
                let (j0, j1) = ((c * per).min(out_dim), ((c + 1) * per).min(out_dim));
                let t = order[i] as usize;
                let Some(f) = slot_of(token_slots[t]) else {
                    return;
                };
                if j0 == j1 {
                    return;
                }
                // SAFETY: `h` was filled by the first region, which has
                // ended; task `(i, c)` alone writes columns `j0..j1` of
                // token `t`'s row, in bounds (checked above).
                let (hk, row) = unsafe {
                    (
                        std::slice::from_raw_parts(h.0.add(i * max_rank), f.rank),
                        std::slice::from_raw_parts_mut(o.0.add(t * out_stride + col), out_dim),
                    )
                };
                expand(&f, hk, row, j0, j1, simd, false);
            });
        }
        _ => {
            let run = |r0: usize, r1: usize| {
                let o = &o;
                let mut h = [0f32; MAX_LORA_RANK];
                for &t in &order[r0..r1] {
                    let t = t as usize;
                    let Some(f) = slot_of(token_slots[t]) else {
                        continue;
                    };
                    let xt = &x[t * in_dim..(t + 1) * in_dim];
                    // SAFETY: in bounds (checked above) and this token's
                    // alone: each token appears once in `order`.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(o.0.add(t * out_stride + col), out_dim)
                    };
                    shrink(&f, 0, xt, &mut h[..f.rank], simd);
                    expand(&f, &h[..f.rank], row, 0, out_dim, simd, false);
                }
            };
            match pool {
                // A token's delta is tens of thousands of multiply-adds:
                // worth splitting from two tokens on.
                Some(pool) if threads > 1 => pool.run_ranges(order.len(), 1, &run),
                _ => run(0, order.len()),
            }
        }
    }
}

/// A pointer into rows that tasks write disjointly.
struct OutRows(*mut f32);
// SAFETY: every task writes only its own elements (see the callers).
unsafe impl Sync for OutRows {}

/// Which kernels this process runs: fixed once, so every token takes the
/// same path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Simd {
    Scalar,
    /// AVX2 with FMA; `f16c` for f16 factors.
    Avx2 {
        f16c: bool,
    },
    /// AVX-512 (F, BW, VL) with FMA and F16C: 16 lanes, the prompt's many
    /// tokens of deltas at half the instructions.
    Avx512,
}

impl Simd {
    fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512Vnni {
            return Simd::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
            return Simd::Avx2 {
                f16c: std::arch::is_x86_feature_detected!("f16c"),
            };
        }
        Simd::Scalar
    }
}

/// Asks for the cache lines of elements `from..to` of `d` ahead of use.
fn prefetch(d: LoraData<'_>, from: usize, to: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (ptr, size) = match d {
            LoraData::F32(v) => (v.as_ptr() as *const i8, 4),
            LoraData::Bf16(v) | LoraData::F16(v) => (v.as_ptr() as *const i8, 2),
        };
        let (start, end) = (from.min(d.len()) * size, to.min(d.len()) * size);
        let mut off = start;
        while off < end {
            // SAFETY: `off` is within the slice (checked above); a
            // prefetch never faults and changes nothing but the caches.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (d, from, to);
}

/// `h[k - k0] = scale · A[k] · x` for `k` in `k0..k0 + h.len()`.
///
/// First asks for every line of those rows of `A` and `Bᵀ` at once: a
/// decode step reaches each projection's factors once, after the base's
/// weights have pushed them out of the caches, and rows of a few KB read
/// one after another would wait on memory line by line before the
/// hardware prefetchers catch on.
fn shrink(f: &LoraFactors<'_>, k0: usize, x: &[f32], h: &mut [f32], simd: Simd) {
    let in_dim = x.len();
    let out_dim = f.b.len() / f.rank.max(1);
    let k1 = k0 + h.len();
    prefetch(f.a, k0 * in_dim, k1 * in_dim);
    prefetch(f.b, k0 * out_dim, k1 * out_dim);
    for (i, hk) in h.iter_mut().enumerate() {
        let k = k0 + i;
        let (s, e) = (k * in_dim, (k + 1) * in_dim);
        let d = match (f.a, simd) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::Avx512` only where the CPU has AVX-512 F/BW/VL,
            // FMA and F16C (the Avx512Vnni level).
            (LoraData::F32(a), Simd::Avx512) => unsafe { x86::dot512_f32(&a[s..e], x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (LoraData::Bf16(a), Simd::Avx512) => unsafe { x86::dot512_bf16(&a[s..e], x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (LoraData::F16(a), Simd::Avx512) => unsafe { x86::dot512_f16(&a[s..e], x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::Avx2` only where the CPU has AVX2 and FMA.
            (LoraData::F32(a), Simd::Avx2 { .. }) => unsafe { x86::dot_f32(&a[s..e], x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (LoraData::Bf16(a), Simd::Avx2 { .. }) => unsafe { x86::dot_bf16(&a[s..e], x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, and `f16c` was detected.
            (LoraData::F16(a), Simd::Avx2 { f16c: true }) => unsafe { x86::dot_f16(&a[s..e], x) },
            (a, _) => dot_scalar(a, s, x),
        };
        *hk = f.scale * d;
    }
}

/// `row[j] += d[j]` (or `row[j] = d[j]` with `store`) for `j` in
/// `j0..j1`, where `d[j] = Σ_k h[k] · Bᵀ[k, j]` summed from zero in `k`
/// order. Summing from zero, not from `row[j]`, gives a delta the same bits
/// whether it is added here or stored aside and added later (the fused
/// path of [`lora_token_delta`]).
fn expand(
    f: &LoraFactors<'_>,
    h: &[f32],
    row: &mut [f32],
    j0: usize,
    j1: usize,
    simd: Simd,
    store: bool,
) {
    let out_dim = row.len();
    let row = &mut row[j0..j1];
    match (f.b, simd) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Simd::Avx512` only at the Avx512Vnni level (AVX-512
        // F/BW/VL, FMA, F16C); shapes as below.
        (LoraData::F32(b), Simd::Avx512) => unsafe {
            x86::expand512_f32(h, b, out_dim, j0, row, store)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (LoraData::Bf16(b), Simd::Avx512) => unsafe {
            x86::expand512_bf16(h, b, out_dim, j0, row, store)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (LoraData::F16(b), Simd::Avx512) => unsafe {
            x86::expand512_f16(h, b, out_dim, j0, row, store)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Simd::Avx2` only where the CPU has AVX2 and FMA; `Bᵀ`
        // is `rank × out_dim` (checked by the callers) and `j1 ≤ out_dim`.
        (LoraData::F32(b), Simd::Avx2 { .. }) => unsafe {
            x86::expand_f32(h, b, out_dim, j0, row, store)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (LoraData::Bf16(b), Simd::Avx2 { .. }) => unsafe {
            x86::expand_bf16(h, b, out_dim, j0, row, store)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, and `f16c` was detected.
        (LoraData::F16(b), Simd::Avx2 { f16c: true }) => unsafe {
            x86::expand_f16(h, b, out_dim, j0, row, store)
        },
        (b, _) => {
            for (j, o) in row.iter_mut().enumerate() {
                let mut d = 0f32;
                for (k, &c) in h.iter().enumerate() {
                    d += c * value(b, k * out_dim + j0 + j);
                }
                *o = if store { d } else { *o + d };
            }
        }
    }
}

/// Writes one token's delta of one projection, `scale · B (A x)`, to
/// `dst` (`out_dim` wide): the same bits that [`lora_add`] adds for it,
/// whatever else shares its step. A caller that computes deltas beside the
/// base matmul (which would overwrite them) adds them to its output after.
///
/// # Panics
/// If the factors are not `rank × x.len()` and `rank × dst.len()`, or the
/// rank is above [`MAX_LORA_RANK`].
pub fn lora_token_delta(f: &LoraFactors<'_>, x: &[f32], dst: &mut [f32]) {
    assert!(
        f.rank <= MAX_LORA_RANK,
        "LoRA rank {} above the kernel's",
        f.rank
    );
    assert_eq!(f.a.len(), f.rank * x.len(), "lora A is not rank × in");
    assert_eq!(f.b.len(), dst.len() * f.rank, "lora Bᵀ is not rank × out");
    let simd = Simd::detect();
    let mut h = [0f32; MAX_LORA_RANK];
    shrink(f, 0, x, &mut h[..f.rank], simd);
    let out_dim = dst.len();
    expand(f, &h[..f.rank], dst, 0, out_dim, simd, true);
}

/// Element `i` as f32.
fn value(d: LoraData<'_>, i: usize) -> f32 {
    match d {
        LoraData::F32(v) => v[i],
        LoraData::Bf16(v) => f32::from_bits((v[i] as u32) << 16),
        LoraData::F16(v) => half::f16::from_bits(v[i]).to_f32(),
    }
}

/// `Σ a[s + i]·x[i]` in eight lanes (which the compiler vectorizes), then
/// their sum.
fn dot_scalar(a: LoraData<'_>, s: usize, x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let lanes = x.len() / 8 * 8;
    for i in (0..lanes).step_by(8) {
        for l in 0..8 {
            acc[l] += value(a, s + i + l) * x[i + l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in lanes..x.len() {
        sum += value(a, s + i) * x[i];
    }
    sum
}

/// AVX2 kernels: sixteen-lane dots (two accumulators, so the FMA latency
/// does not bound the stream) and eight-lane `axpy`s, one per storage type.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Loads eight factors as f32.
    trait Load8 {
        unsafe fn load8(p: *const Self) -> __m256;
        fn get(&self) -> f32;
    }

    impl Load8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        fn get(&self) -> f32 {
            *self
        }
    }

    /// bf16 bits.
    #[repr(transparent)]
    struct Bf16(u16);
    impl Load8 for Bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const Bf16) -> __m256 {
            let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
        fn get(&self) -> f32 {
            f32::from_bits((self.0 as u32) << 16)
        }
    }

    /// f16 bits.
    #[repr(transparent)]
    struct F16(u16);
    impl Load8 for F16 {
        #[inline(always)]
        unsafe fn load8(p: *const F16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        fn get(&self) -> f32 {
            half::f16::from_bits(self.0).to_f32()
        }
    }

    #[inline(always)]
    unsafe fn dot<T: Load8>(a: &[T], x: &[f32]) -> f32 {
        let n = x.len();
        let wide = n / 16 * 16;
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY (caller): `a.len() == x.len()`; every load reads below `wide`.
        while i < wide {
            s0 = _mm256_fmadd_ps(
                T::load8(a.as_ptr().add(i)),
                _mm256_loadu_ps(x.as_ptr().add(i)),
                s0,
            );
            s1 = _mm256_fmadd_ps(
                T::load8(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(x.as_ptr().add(i + 8)),
                s1,
            );
            i += 16;
        }
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), _mm256_add_ps(s0, s1));
        let mut s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for j in wide..n {
            s = a[j].get().mul_add(x[j], s);
        }
        s
    }

    /// Adds (or stores) `d[j] = Σ_k h[k] · bt[k·out_dim + j0 + j]` to
    /// `row[j]`, each `d[j]` a chain of fused multiply-adds from zero in
    /// `k` order, kept in registers over all `k` for 32 (then 8) columns at
    /// a time; the tail columns take the same chain one by one.
    #[inline(always)]
    unsafe fn expand<T: Load8>(
        h: &[f32],
        bt: &[T],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        let n = row.len();
        // SAFETY (caller): `bt` holds `h.len()` rows of `out_dim`, and
        // `j0 + n ≤ out_dim`; every load below reads within a row's
        // `j0..j0 + n`.
        let at = |k: usize, j: usize| bt.as_ptr().add(k * out_dim + j0 + j);
        let finish = |o: *mut f32, acc: __m256| {
            let v = if store {
                acc
            } else {
                _mm256_add_ps(_mm256_loadu_ps(o), acc)
            };
            _mm256_storeu_ps(o, v);
        };
        let mut j = 0;
        while j + 32 <= n {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (k, &c) in h.iter().enumerate() {
                let cv = _mm256_set1_ps(c);
                for (q, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(cv, T::load8(at(k, j + 8 * q)), *a);
                }
            }
            for (q, a) in acc.iter().enumerate() {
                finish(row.as_mut_ptr().add(j + 8 * q), *a);
            }
            j += 32;
        }
        while j + 8 <= n {
            let mut acc = _mm256_setzero_ps();
            for (k, &c) in h.iter().enumerate() {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(c), T::load8(at(k, j)), acc);
            }
            finish(row.as_mut_ptr().add(j), acc);
            j += 8;
        }
        // Fused like the lanes, so an element's bits do not depend on
        // whether a column split put it in a lane or in the tail.
        for j in j..n {
            let mut d = 0f32;
            for (k, &c) in h.iter().enumerate() {
                d = c.mul_add((*at(k, j)).get(), d);
            }
            row[j] = if store { d } else { row[j] + d };
        }
    }

    /// Loads sixteen factors as f32.
    trait Load16: Load8 {
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Load16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }

    impl Load16 for Bf16 {
        #[inline(always)]
        unsafe fn load16(p: *const Bf16) -> __m512 {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
    }

    impl Load16 for F16 {
        #[inline(always)]
        unsafe fn load16(p: *const F16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }

    /// [`dot`] on 16 lanes: two sums of 16, added lane by lane, then the
    /// lanes in a fixed tree, then the tail by fused multiply-adds.
    #[inline(always)]
    unsafe fn dot512<T: Load16>(a: &[T], x: &[f32]) -> f32 {
        let n = x.len();
        let wide = n / 32 * 32;
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        // SAFETY (caller): `a.len() == x.len()`; every load reads below `wide`.
        while i < wide {
            s0 = _mm512_fmadd_ps(
                T::load16(a.as_ptr().add(i)),
                _mm512_loadu_ps(x.as_ptr().add(i)),
                s0,
            );
            s1 = _mm512_fmadd_ps(
                T::load16(a.as_ptr().add(i + 16)),
                _mm512_loadu_ps(x.as_ptr().add(i + 16)),
                s1,
            );
            i += 32;
        }
        let mut l = [0f32; 16];
        _mm512_storeu_ps(l.as_mut_ptr(), _mm512_add_ps(s0, s1));
        let mut p = [0f32; 8];
        for (k, v) in p.iter_mut().enumerate() {
            *v = l[k] + l[k + 8];
        }
        let mut s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
        for j in wide..n {
            s = a[j].get().mul_add(x[j], s);
        }
        s
    }

    /// [`expand`] on 16 lanes: 64, then 16 columns at a time in registers
    /// over all `k`, each element the same chain of fused multiply-adds
    /// from zero as the tail's.
    #[inline(always)]
    unsafe fn expand512<T: Load16>(
        h: &[f32],
        bt: &[T],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        let n = row.len();
        // SAFETY (caller): as [`expand`].
        let at = |k: usize, j: usize| bt.as_ptr().add(k * out_dim + j0 + j);
        let finish = |o: *mut f32, acc: __m512| {
            let v = if store {
                acc
            } else {
                _mm512_add_ps(_mm512_loadu_ps(o), acc)
            };
            _mm512_storeu_ps(o, v);
        };
        let mut j = 0;
        while j + 64 <= n {
            let mut acc = [_mm512_setzero_ps(); 4];
            for (k, &c) in h.iter().enumerate() {
                let cv = _mm512_set1_ps(c);
                for (q, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(cv, T::load16(at(k, j + 16 * q)), *a);
                }
            }
            for (q, a) in acc.iter().enumerate() {
                finish(row.as_mut_ptr().add(j + 16 * q), *a);
            }
            j += 64;
        }
        while j + 16 <= n {
            let mut acc = _mm512_setzero_ps();
            for (k, &c) in h.iter().enumerate() {
                acc = _mm512_fmadd_ps(_mm512_set1_ps(c), T::load16(at(k, j)), acc);
            }
            finish(row.as_mut_ptr().add(j), acc);
            j += 16;
        }
        for j in j..n {
            let mut d = 0f32;
            for (k, &c) in h.iter().enumerate() {
                d = c.mul_add((*at(k, j)).get(), d);
            }
            row[j] = if store { d } else { row[j] + d };
        }
    }

    /// # Safety
    /// AVX-512 F/BW/VL, FMA and F16C; `a.len() == x.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn dot512_f32(a: &[f32], x: &[f32]) -> f32 {
        dot512(a, x)
    }

    /// # Safety
    /// As [`dot512_f32`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn dot512_bf16(a: &[u16], x: &[f32]) -> f32 {
        // SAFETY: `Bf16` is a transparent `u16`.
        dot512(
            std::slice::from_raw_parts(a.as_ptr() as *const Bf16, a.len()),
            x,
        )
    }

    /// # Safety
    /// As [`dot512_f32`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn dot512_f16(a: &[u16], x: &[f32]) -> f32 {
        // SAFETY: `F16` is a transparent `u16`.
        dot512(
            std::slice::from_raw_parts(a.as_ptr() as *const F16, a.len()),
            x,
        )
    }

    /// # Safety
    /// AVX-512 F/BW/VL, FMA and F16C; shapes as [`expand_f32`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn expand512_f32(
        h: &[f32],
        bt: &[f32],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        expand512(h, bt, out_dim, j0, row, store)
    }

    /// # Safety
    /// As [`expand512_f32`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn expand512_bf16(
        h: &[f32],
        bt: &[u16],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        // SAFETY: `Bf16` is a transparent `u16`.
        let bt = std::slice::from_raw_parts(bt.as_ptr() as *const Bf16, bt.len());
        expand512(h, bt, out_dim, j0, row, store)
    }

    /// # Safety
    /// As [`expand512_f32`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn expand512_f16(
        h: &[f32],
        bt: &[u16],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        // SAFETY: `F16` is a transparent `u16`.
        let bt = std::slice::from_raw_parts(bt.as_ptr() as *const F16, bt.len());
        expand512(h, bt, out_dim, j0, row, store)
    }

    /// # Safety
    /// AVX2 and FMA; `a.len() == x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_f32(a: &[f32], x: &[f32]) -> f32 {
        dot(a, x)
    }

    /// # Safety
    /// AVX2 and FMA; `a.len() == x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_bf16(a: &[u16], x: &[f32]) -> f32 {
        // SAFETY: `Bf16` is a transparent `u16`.
        dot(
            std::slice::from_raw_parts(a.as_ptr() as *const Bf16, a.len()),
            x,
        )
    }

    /// # Safety
    /// AVX2, FMA and F16C; `a.len() == x.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(a: &[u16], x: &[f32]) -> f32 {
        // SAFETY: `F16` is a transparent `u16`.
        dot(
            std::slice::from_raw_parts(a.as_ptr() as *const F16, a.len()),
            x,
        )
    }

    /// # Safety
    /// AVX2 and FMA; `bt` is `h.len() × out_dim`, `j0 + row.len() ≤ out_dim`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn expand_f32(
        h: &[f32],
        bt: &[f32],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        expand(h, bt, out_dim, j0, row, store)
    }

    /// # Safety
    /// As [`expand_f32`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn expand_bf16(
        h: &[f32],
        bt: &[u16],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        // SAFETY: `Bf16` is a transparent `u16`.
        let bt = std::slice::from_raw_parts(bt.as_ptr() as *const Bf16, bt.len());
        expand(h, bt, out_dim, j0, row, store)
    }

    /// # Safety
    /// As [`expand_f32`], and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn expand_f16(
        h: &[f32],
        bt: &[u16],
        out_dim: usize,
        j0: usize,
        row: &mut [f32],
        store: bool,
    ) {
        // SAFETY: `F16` is a transparent `u16`.
        let bt = std::slice::from_raw_parts(bt.as_ptr() as *const F16, bt.len());
        expand(h, bt, out_dim, j0, row, store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `m` (`[rows, cols]`) transposed.
    fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols * rows)
            .map(|i| m[(i % rows) * cols + i / rows])
            .collect()
    }

    /// One adapter's factors in one storage type, and their values as the
    /// kernel reads them (rounded), for the reference.
    struct Stored {
        a: Stor,
        bt: Stor,
        /// `A` as stored, widened: `[rank, in]`.
        a_val: Vec<f32>,
        /// `B` as stored, widened: `[out, rank]`.
        b_val: Vec<f32>,
        rank: usize,
        scale: f32,
    }

    enum Stor {
        F32(Vec<f32>),
        Bf16(Vec<u16>),
        F16(Vec<u16>),
    }

    impl Stor {
        fn of(kind: usize, v: &[f32]) -> (Stor, Vec<f32>) {
            match kind {
                0 => (Stor::F32(v.to_vec()), v.to_vec()),
                1 => {
                    let bits: Vec<u16> = v
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_bits())
                        .collect();
                    let val = bits
                        .iter()
                        .map(|&b| half::bf16::from_bits(b).to_f32())
                        .collect();
                    (Stor::Bf16(bits), val)
                }
                _ => {
                    let bits: Vec<u16> = v
                        .iter()
                        .map(|&x| half::f16::from_f32(x).to_bits())
                        .collect();
                    let val = bits
                        .iter()
                        .map(|&b| half::f16::from_bits(b).to_f32())
                        .collect();
                    (Stor::F16(bits), val)
                }
            }
        }

        fn data(&self) -> LoraData<'_> {
            match self {
                Stor::F32(v) => LoraData::F32(v),
                Stor::Bf16(v) => LoraData::Bf16(v),
                Stor::F16(v) => LoraData::F16(v),
            }
        }
    }

    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Random factors of `rank` for `in_dim → out_dim`, stored as `kind`
    /// (0 f32, 1 bf16, 2 f16).
    fn stored(
        rng: &mut rand::rngs::StdRng,
        kind: usize,
        rank: usize,
        in_dim: usize,
        out_dim: usize,
        scale: f32,
    ) -> Stored {
        let (a, b) = (random(rng, rank * in_dim), random(rng, out_dim * rank));
        let (a, a_val) = Stor::of(kind, &a);
        let (bt, bt_val) = Stor::of(kind, &transpose(&b, out_dim, rank));
        Stored {
            a,
            bt,
            a_val,
            b_val: transpose(&bt_val, rank, out_dim),
            rank,
            scale,
        }
    }

    impl Stored {
        fn factors(&self) -> LoraFactors<'_> {
            LoraFactors {
                a: self.a.data(),
                b: self.bt.data(),
                rank: self.rank,
                scale: self.scale,
            }
        }
    }

    /// The definition, in f64, on the stored values.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        x: &[f32],
        in_dim: usize,
        token_slots: &[u16],
        slots: &[Option<Stored>],
        out: &mut [f64],
        out_stride: usize,
        col: usize,
        out_dim: usize,
    ) {
        for (t, &s) in token_slots.iter().enumerate() {
            let Some(Some(f)) = slots.get(s as usize) else {
                continue;
            };
            let r = f.rank;
            let h: Vec<f64> = (0..r)
                .map(|k| {
                    (0..in_dim)
                        .map(|i| f.a_val[k * in_dim + i] as f64 * x[t * in_dim + i] as f64)
                        .sum()
                })
                .collect();
            for j in 0..out_dim {
                let d: f64 = (0..r).map(|k| f.b_val[j * r + k] as f64 * h[k]).sum();
                out[t * out_stride + col + j] += f.scale as f64 * d;
            }
        }
    }

    #[test]
    fn mixed_adapters_match_the_definition_and_leave_base_tokens_alone() {
        for kind in 0..3 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(5 + kind as u64);
            let (in_dim, out_dim, stride, col) = (67, 29, 40, 7);
            let slots: Vec<Option<Stored>> = vec![
                Some(stored(&mut rng, kind, 4, in_dim, out_dim, 0.5)),
                Some(stored(&mut rng, kind, 16, in_dim, out_dim, 1.5)),
                // A slot that holds no adapter for this projection.
                None,
            ];
            let m = 23;
            let token_slots: Vec<u16> = (0..m).map(|t| [0u16, 1, u16::MAX, 2, 1][t % 5]).collect();
            let x = random(&mut rng, m * in_dim);
            let base = random(&mut rng, m * stride);
            let slot_of = |s: u16| {
                slots
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .map(Stored::factors)
            };
            let mut want: Vec<f64> = base.iter().map(|&v| v as f64).collect();
            naive(
                &x,
                in_dim,
                &token_slots,
                &slots,
                &mut want,
                stride,
                col,
                out_dim,
            );
            let pool = crate::ThreadPool::new(2);
            // One thread; the pool at the default threshold (below it
            // here); the pool splitting whatever the size.
            let runs = [
                (None, SPLIT_MIN_BYTES),
                (Some(&pool), SPLIT_MIN_BYTES),
                (Some(&pool), 0),
            ];
            for (pool, split_min_bytes) in runs {
                let mut got = base.clone();
                lora_add_split_from(
                    &x,
                    in_dim,
                    &token_slots,
                    slot_of,
                    &mut got,
                    stride,
                    col,
                    out_dim,
                    &mut LoraScratch::default(),
                    pool,
                    split_min_bytes,
                );
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - w).abs() < 1e-4,
                        "kind {kind}, element {i}: {g} vs {w}"
                    );
                    let (t, c) = (i / stride, i % stride);
                    let untouched =
                        matches!(token_slots[t], u16::MAX | 2) || c < col || c >= col + out_dim;
                    if untouched {
                        assert_eq!(*g, base[i], "element {i} must not change");
                    }
                }
            }
        }
    }

    #[test]
    fn the_simd_and_scalar_paths_agree() {
        let simd = Simd::detect();
        if simd == Simd::Scalar {
            eprintln!("note: no AVX2 here; only the scalar path runs");
            return;
        }
        for kind in 0..3 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(4);
            // Lengths off the 16-lane grid, so the tails run too.
            let (in_dim, out_dim, r) = (77, 45, 5);
            let f = stored(&mut rng, kind, r, in_dim, out_dim, 1.5);
            let (x, base) = (random(&mut rng, in_dim), random(&mut rng, out_dim));
            let (mut scalar, mut vector) = (base.clone(), base.clone());
            let (mut hs, mut hv) = ([0f32; 5], [0f32; 5]);
            shrink(&f.factors(), 0, &x, &mut hs, Simd::Scalar);
            shrink(&f.factors(), 0, &x, &mut hv, simd);
            expand(
                &f.factors(),
                &hs,
                &mut scalar,
                0,
                out_dim,
                Simd::Scalar,
                false,
            );
            expand(&f.factors(), &hv, &mut vector, 0, out_dim, simd, false);
            for (i, (s, v)) in scalar.iter().zip(&vector).enumerate() {
                assert!(
                    (s - v).abs() < 1e-4,
                    "kind {kind}, output {i}: scalar {s}, simd {v}"
                );
            }
            assert_ne!(scalar, base);
        }
    }

    #[test]
    fn a_delta_stored_aside_and_added_later_has_the_bits_lora_add_adds() {
        for kind in 0..3 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(21);
            // Widths across the 32- and 8-column blocks and the tail.
            for out_dim in [5usize, 8, 45, 83] {
                let (in_dim, r) = (37, 7);
                let f = stored(&mut rng, kind, r, in_dim, out_dim, 0.75);
                let (x, base) = (random(&mut rng, in_dim), random(&mut rng, out_dim));
                let mut added = base.clone();
                lora_add(
                    &x,
                    in_dim,
                    &[0],
                    |_| Some(f.factors()),
                    &mut added,
                    out_dim,
                    0,
                    out_dim,
                    &mut LoraScratch::default(),
                    None,
                );
                let mut delta = vec![f32::NAN; out_dim];
                lora_token_delta(&f.factors(), &x, &mut delta);
                let later: Vec<u32> = base
                    .iter()
                    .zip(&delta)
                    .map(|(b, d)| (b + d).to_bits())
                    .collect();
                let bits: Vec<u32> = added.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits, later, "kind {kind}, out {out_dim}");
                assert_ne!(added, base);
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_whatever_shares_its_step_and_however_threads_split_it() {
        for kind in 0..3 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            // An output width off the 16-column grid, so the column split
            // puts a lane's elements in another chunk's tail.
            let (in_dim, out_dim, r) = (48, 83, 8);
            let slots = [Some(stored(&mut rng, kind, r, in_dim, out_dim, 2.0))];
            let slot_of = |s: u16| {
                slots
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .map(Stored::factors)
            };
            let x = random(&mut rng, 9 * in_dim);
            let pool = crate::ThreadPool::new(2);
            // Split whatever the size (these factors are far below
            // `SPLIT_MIN_BYTES`, where `lora_add` keeps to one thread).
            let run = |x: &[f32], token_slots: &[u16], pool: Option<&crate::ThreadPool>| {
                let mut out = vec![0f32; token_slots.len() * out_dim];
                lora_add_split_from(
                    x,
                    in_dim,
                    token_slots,
                    slot_of,
                    &mut out,
                    out_dim,
                    0,
                    out_dim,
                    &mut LoraScratch::default(),
                    pool,
                    0,
                );
                out
            };
            // Token 2 alone, on one thread and split by rank and column.
            let alone = run(&x[2 * in_dim..3 * in_dim], &[0], None);
            assert_eq!(run(&x[2 * in_dim..3 * in_dim], &[0], Some(&pool)), alone);
            // Beside two others (the two-phase split) and beside eight
            // (split by token), on one thread or two.
            let few = [0, u16::MAX, 0, 0, u16::MAX];
            let many = [0u16; 9];
            for (slots_of_step, n) in [(&few[..], 5), (&many[..], 9)] {
                for p in [None, Some(&pool)] {
                    let batch = run(&x[..n * in_dim], slots_of_step, p);
                    assert_eq!(
                        &batch[2 * out_dim..3 * out_dim],
                        &alone[..],
                        "kind {kind}, {n} tokens"
                    );
                }
            }
        }
    }
}
