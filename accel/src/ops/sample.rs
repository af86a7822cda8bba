//! Sampling for a whole batch of logit rows: the logit processors, then
//! greedy or temperature / top-k / top-p / min-p sampling, for every row
//! that samples, in one call ([`sample_rows`]).
//!
//! What each row asks for is plain data ([`SamplingMetadata`]): its
//! parameters, one uniform number the host drew from the request's own
//! random stream (so a seeded request samples the same in any batch, and a
//! device needs no random state of its own), and flat per-row lists (CSR)
//! of the tokens its processors touch. What comes back ([`SampledRows`]) is
//! one id per row and, for the rows that asked, the chosen token's
//! log-probability, rank and top alternatives, computed on the raw logits
//! before any processor (vLLM v1's default).
//!
//! Every row goes through the same steps, in this order:
//!
//! 1. log-softmax of the raw row, if the row wants logprobs;
//! 2. allowed ids (every other id gets −∞);
//! 3. logit bias, in list order;
//! 4. repetition penalty on each distinct token of prompt and output
//!    (divided when positive, multiplied otherwise);
//! 5. presence and frequency penalties over the output counts;
//! 6. banned ids get −∞ (EOS and stop tokens before `min_tokens`, the
//!    last token of each bad word whose other tokens end the output);
//! 7. the grammar's bitmask (bit `t % 32` of word `t / 32` set: allowed;
//!    ids past the mask are not);
//! 8. greedy rows: the argmax (ties to the lowest id); others: temperature,
//!    softmax, the top-k / top-p / min-p candidates and one draw.
//!
//! vLLM applies allowed ids and bad words before the bias and the
//! penalties, and min_tokens between them; steps 2 and 6 only assign −∞,
//! which the additive and multiplicative processors (finite biases,
//! positive penalties) leave at −∞, so where the assignments sit among
//! them changes no value.
//!
//! The numbers are bitwise those of the engine's one-row-at-a-time host
//! sampler (`pagoda::engine::sampler::Sampler`): the same f32 processors
//! in the same order, the same [`super::softmax_inplace`], the same f64
//! sums in the same order, and the same candidate set and order (the
//! selection below finds it faster, but the set of the `k` largest under a
//! strict total order is unique). The tests hold the op to a plain
//! reference written from these definitions.
//!
//! Each row runs all its steps before the next row starts, rows spread
//! over the pool's threads (a 150k-entry row is 600 KB: pass after pass
//! over every row would stream the whole batch through the caches once
//! per processor).
//!
//! The CUDA backend runs the same steps as kernels (backend/cuda/
//! kernels.cu). Its processors give these bits; its softmax's `exp` and
//! the order of its sums differ, and it keeps masses in fixed point, so
//! its draws agree with these except within rounding of a boundary.

use super::softmax_inplace;
use crate::ThreadPool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Per-row lists laid end to end (CSR): row `r`'s entries are
/// `values[offsets[r]..offsets[r + 1]]`. `offsets` always holds one more
/// entry than there are rows.
#[derive(Clone, Debug)]
pub struct RowLists<T> {
    offsets: Vec<u32>,
    values: Vec<T>,
}

impl<T> Default for RowLists<T> {
    fn default() -> Self {
        RowLists {
            offsets: vec![0],
            values: Vec::new(),
        }
    }
}

impl<T: Copy> RowLists<T> {
    /// Empties it (no rows), keeping its allocations.
    pub fn clear(&mut self) {
        self.offsets.clear();
        self.offsets.push(0);
        self.values.clear();
    }

    /// Starts an empty list for the next row.
    fn open_row(&mut self) {
        let end = self.values.len() as u32;
        self.offsets.push(end);
    }

    /// Appends `v` to the last row's list.
    fn push(&mut self, v: T) {
        self.values.push(v);
        self.close();
    }

    /// Appends `vs` to the last row's list.
    fn extend(&mut self, vs: &[T]) {
        self.values.extend_from_slice(vs);
        self.close();
    }

    fn close(&mut self) {
        // The lists hold at most the batch's tokens in context (bounded by
        // the KV pool, far below 2^32) and a few per-request ids.
        let end = self.values.len() as u32;
        if let Some(last) = self.offsets.last_mut() {
            *last = end;
        }
    }

    /// Row `r`'s list.
    pub fn row(&self, r: usize) -> &[T] {
        &self.values[self.offsets[r] as usize..self.offsets[r + 1] as usize]
    }

    /// Where each row's list starts, and the end: `rows + 1` entries.
    pub fn offsets(&self) -> &[u32] {
        &self.offsets
    }

    /// Every row's entries, back to back.
    pub fn values(&self) -> &[T] {
        &self.values
    }
}

/// One row's scalar sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// The row of the logits buffer it samples from. Rows of one call are
    /// strictly increasing.
    pub logit_row: u32,
    /// Take the argmax: temperature below vLLM's 1e-5, or top-k of 1.
    pub greedy: bool,
    /// Divides the logits before the softmax (read only when not greedy).
    pub temperature: f32,
    /// Keep the `top_k` likeliest tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the smallest set of likeliest tokens whose mass reaches it; 1
    /// keeps all.
    pub top_p: f32,
    /// Keep tokens at least this fraction as likely as the likeliest; 0
    /// keeps all.
    pub min_p: f32,
    /// The row's draw, uniform in `[0, 1)`, from the request's own random
    /// stream (read only when not greedy).
    pub uniform: f64,
    /// Return the chosen token's logprob, rank and this many top
    /// alternatives.
    pub logprobs: Option<u32>,
    /// Multiplicative penalty on the tokens of [`SamplingMetadata::penalize`]
    /// (1: off).
    pub repetition_penalty: f32,
    /// Subtracted from every token of the output.
    pub presence_penalty: f32,
    /// Subtracted from every token of the output, times its count.
    pub frequency_penalty: f32,
}

impl Default for RowSampling {
    /// A greedy row that changes nothing.
    fn default() -> Self {
        RowSampling {
            logit_row: 0,
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            uniform: 0.0,
            logprobs: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// What every row of one call asks for. Filled row by row
/// ([`SamplingMetadata::push_row`], then the lists of that row); cleared
/// and refilled each step, so a warm step reuses its allocations.
#[derive(Clone, Debug, Default)]
pub struct SamplingMetadata {
    vocab: usize,
    rows: Vec<RowSampling>,
    /// Tokens the repetition penalty discourages (prompt and output, in
    /// any order; repeats count once).
    penalized: RowLists<u32>,
    /// Distinct output tokens, with [`Self::output_counts`] beside them.
    output_tokens: RowLists<u32>,
    output_counts: Vec<u32>,
    /// Logit bias: ids, with [`Self::bias_values`] beside them.
    bias: RowLists<u32>,
    bias_values: Vec<f32>,
    banned: RowLists<u32>,
    /// An empty list allows every id (a request's allowed list is never
    /// empty).
    allowed: RowLists<u32>,
    /// Per row, the first word of its grammar mask in `masks`, or
    /// [`NO_MASK`].
    mask_at: Vec<u32>,
    /// Grammar masks, [`SamplingMetadata::mask_words`] words each.
    masks: Vec<u32>,
}

/// [`SamplingMetadata::mask_at`] of a row without a grammar mask.
pub const NO_MASK: u32 = u32::MAX;

/// The token [`sample_rows`] gives a row whose allowed ids, bans and
/// grammar mask leave no logit above −∞: nothing may be sampled there.
pub const NO_TOKEN: u32 = u32::MAX;

impl SamplingMetadata {
    /// Empties it for a step over rows of `vocab` logits, keeping its
    /// allocations.
    pub fn clear(&mut self, vocab: usize) {
        self.vocab = vocab;
        self.rows.clear();
        self.penalized.clear();
        self.output_tokens.clear();
        self.output_counts.clear();
        self.bias.clear();
        self.bias_values.clear();
        self.banned.clear();
        self.allowed.clear();
        self.mask_at.clear();
        self.masks.clear();
    }

    /// Adds a row; the list methods below then fill its lists.
    pub fn push_row(&mut self, row: RowSampling) {
        self.rows.push(row);
        self.penalized.open_row();
        self.output_tokens.open_row();
        self.bias.open_row();
        self.banned.open_row();
        self.allowed.open_row();
        self.mask_at.push(NO_MASK);
    }

    fn check_row(&self, what: &str) {
        assert!(
            !self.rows.is_empty(),
            "SamplingMetadata::{what}: no row pushed yet"
        );
    }

    /// Adds tokens the last row's repetition penalty applies to (repeats
    /// are penalized once).
    pub fn penalize(&mut self, tokens: &[u32]) {
        self.check_row("penalize");
        self.penalized.extend(tokens);
    }

    /// Says the last row's output holds `token` `count` times, for the
    /// presence and frequency penalties. Each token once per row.
    pub fn count_output(&mut self, token: u32, count: u32) {
        self.check_row("count_output");
        self.output_tokens.push(token);
        self.output_counts.push(count);
    }

    /// Adds `value` to the last row's logit of `token` (biases of one
    /// token add up, in order).
    pub fn bias(&mut self, token: u32, value: f32) {
        self.check_row("bias");
        self.bias.push(token);
        self.bias_values.push(value);
    }

    /// Bans `token` in the last row.
    pub fn ban(&mut self, token: u32) {
        self.check_row("ban");
        self.banned.push(token);
    }

    /// Restricts the last row to `tokens` (with the other restrictions:
    /// bans and the grammar still apply). An empty slice restricts nothing.
    pub fn allow(&mut self, tokens: &[u32]) {
        self.check_row("allow");
        self.allowed.extend(tokens);
    }

    /// Sets the last row's grammar mask: bit `t % 32` of `words[t / 32]`
    /// set means token `t` is allowed. Words past the vocabulary are
    /// ignored; missing ones allow nothing.
    pub fn mask(&mut self, words: &[u32]) {
        self.check_row("mask");
        let n = self.mask_words();
        let at = self.masks.len();
        let take = words.len().min(n);
        self.masks.extend_from_slice(&words[..take]);
        self.masks.resize(at + n, 0);
        if let Some(m) = self.mask_at.last_mut() {
            *m = at as u32;
        }
    }

    /// The vocabulary the rows are over.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Words in one row's grammar mask.
    pub fn mask_words(&self) -> usize {
        self.vocab.div_ceil(32)
    }

    /// Rows to sample.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// Every row's scalar parameters.
    pub fn rows(&self) -> &[RowSampling] {
        &self.rows
    }

    /// The repetition penalty's tokens, per row.
    pub fn penalized(&self) -> &RowLists<u32> {
        &self.penalized
    }

    /// The output's distinct tokens, per row, and their counts (one per
    /// token, back to back as the tokens are).
    pub fn output_counts(&self) -> (&RowLists<u32>, &[u32]) {
        (&self.output_tokens, &self.output_counts)
    }

    /// The logit biases' tokens, per row, and their values.
    pub fn biases(&self) -> (&RowLists<u32>, &[f32]) {
        (&self.bias, &self.bias_values)
    }

    /// The banned tokens, per row.
    pub fn banned(&self) -> &RowLists<u32> {
        &self.banned
    }

    /// The allowed tokens, per row (empty: all).
    pub fn allowed(&self) -> &RowLists<u32> {
        &self.allowed
    }

    /// Row `r`'s grammar mask, if it has one.
    pub fn row_mask(&self, r: usize) -> Option<&[u32]> {
        let at = self.mask_at[r];
        (at != NO_MASK).then(|| &self.masks[at as usize..at as usize + self.mask_words()])
    }

    /// Per row, where its mask starts in [`SamplingMetadata::masks`]
    /// ([`NO_MASK`]: none).
    pub fn mask_at(&self) -> &[u32] {
        &self.mask_at
    }

    /// The rows' grammar masks, back to back.
    pub fn masks(&self) -> &[u32] {
        &self.masks
    }
}

/// What [`sample_rows`] chose, row by row in the metadata's order.
#[derive(Clone, Debug, Default)]
pub struct SampledRows {
    /// The sampled id of each row.
    pub tokens: Vec<u32>,
    /// Per row, the chosen token's log-probability under the raw logits
    /// (0 where the row asked for no logprobs).
    pub logprobs: Vec<f32>,
    /// Per row, 1 + how many tokens the raw logits make likelier than the
    /// chosen one (0 where the row asked for no logprobs).
    pub ranks: Vec<u32>,
    /// Per row, the top alternatives asked for: ids, best first (ties to
    /// the lower id), with [`SampledRows::top_logprobs`] beside them.
    pub top_ids: RowLists<u32>,
    pub top_logprobs: Vec<f32>,
}

/// One row's logprobs in a [`SampledRows`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowLogprobs<'a> {
    pub logprob: f32,
    pub rank: u32,
    /// The top alternatives' ids, best first.
    pub top_ids: &'a [u32],
    /// Their log-probabilities.
    pub top_logprobs: &'a [f32],
}

impl SampledRows {
    /// Row `r`'s logprobs, if `meta` (the metadata it was sampled with)
    /// asked for them.
    pub fn logprobs_of(&self, meta: &SamplingMetadata, r: usize) -> Option<RowLogprobs<'_>> {
        meta.rows[r].logprobs?;
        let (a, b) = (
            self.top_ids.offsets[r] as usize,
            self.top_ids.offsets[r + 1] as usize,
        );
        Some(RowLogprobs {
            logprob: self.logprobs[r],
            rank: self.ranks[r],
            top_ids: &self.top_ids.values[a..b],
            top_logprobs: &self.top_logprobs[a..b],
        })
    }

    /// The top lists' ids and log-probabilities, to be written in place (a
    /// device backend copies them back into them).
    #[cfg(feature = "cuda")]
    pub(crate) fn top_lists_mut(&mut self) -> (&mut [u32], &mut [f32]) {
        (&mut self.top_ids.values, &mut self.top_logprobs)
    }

    /// Sizes every array for `meta`'s rows (the top lists' offsets from
    /// what each row asked for), keeping allocations.
    pub fn shape_for(&mut self, meta: &SamplingMetadata) {
        let n = meta.rows.len();
        self.tokens.clear();
        self.tokens.resize(n, 0);
        self.logprobs.clear();
        self.logprobs.resize(n, 0.0);
        self.ranks.clear();
        self.ranks.resize(n, 0);
        self.top_ids.offsets.clear();
        self.top_ids.offsets.push(0);
        let mut total = 0usize;
        for p in &meta.rows {
            total += p.logprobs.map_or(0, |k| (k as usize).min(meta.vocab));
            self.top_ids.offsets.push(total as u32);
        }
        self.top_ids.values.clear();
        self.top_ids.values.resize(total, 0);
        self.top_logprobs.clear();
        self.top_logprobs.resize(total, 0.0);
    }
}

/// Buckets of the histogram that narrows a top-k selection: the high 12
/// bits of [`order_key`].
const HIST_SHIFT: u32 = 20;
const HIST_BUCKETS: usize = 1 << (32 - HIST_SHIFT);

/// One thread's scratch: grown to the vocabulary on first use, reused.
struct RowScratch {
    /// Raw log-probabilities of the row.
    logprobs: Vec<f32>,
    /// `(value, id)` pairs of a selection.
    cands: Vec<(f32, u32)>,
    /// The other half of [`sort_all`]'s passes.
    radix: Vec<(f32, u32)>,
    /// Bit per id: the allowed set.
    bits: Vec<u64>,
    /// Bit per id: the repetition penalty's tokens seen so far (all zero
    /// between rows).
    seen: Vec<u64>,
    hist: Box<[u32; HIST_BUCKETS]>,
}

impl RowScratch {
    /// Sizes every buffer for rows of `vocab` at once: which thread gets
    /// which row varies from step to step, and how many candidates a
    /// selection gathers varies with the values, so buffers grown on
    /// demand would keep allocating long after the first step.
    fn prepare(&mut self, vocab: usize) {
        let words = vocab.div_ceil(64);
        if self.seen.len() < words {
            self.seen.resize(words, 0);
        }
        room(&mut self.bits, words);
        room(&mut self.logprobs, vocab);
        room(&mut self.cands, vocab);
        room(&mut self.radix, vocab);
    }
}

/// Makes `v`'s capacity at least `n` (whatever it holds now).
fn room<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() < n {
        v.reserve(n - v.len());
    }
}

impl Default for RowScratch {
    fn default() -> Self {
        RowScratch {
            logprobs: Vec::new(),
            cands: Vec::new(),
            radix: Vec::new(),
            bits: Vec::new(),
            seen: Vec::new(),
            hist: Box::new([0; HIST_BUCKETS]),
        }
    }
}

/// Scratch for [`sample_rows`], one per thread of the pool; keep it
/// between calls so a warm step allocates nothing.
#[derive(Default)]
pub struct SampleScratch {
    threads: Vec<Mutex<RowScratch>>,
}

/// Samples every row `meta` describes from `logits` (`[rows, vocab]`,
/// row-major; each row named by [`RowSampling::logit_row`]), writing the
/// results to `out`. The rows it samples are overwritten (processed
/// logits, then probabilities); other rows are untouched. Rows run in
/// parallel on `pool`, each wholly on one thread, so the results do not
/// depend on the thread count.
///
/// Token ids in the lists that lie outside the vocabulary are ignored.
///
/// # Panics
/// If `meta` is for another vocabulary, or its logit rows are not
/// strictly increasing or lie past `logits`.
pub fn sample_rows(
    pool: &ThreadPool,
    logits: &mut [f32],
    vocab: usize,
    meta: &SamplingMetadata,
    scratch: &mut SampleScratch,
    out: &mut SampledRows,
) {
    check_rows(meta, vocab, logits.len());
    let n = meta.rows.len();
    out.shape_for(meta);
    if n == 0 {
        return;
    }
    let threads = if n == 1 { 1 } else { pool.threads() };
    while scratch.threads.len() < threads {
        scratch.threads.push(Mutex::new(RowScratch::default()));
    }

    struct Shared {
        logits: *mut f32,
        tokens: *mut u32,
        logprobs: *mut f32,
        ranks: *mut u32,
        top_ids: *mut u32,
        top_logprobs: *mut f32,
    }
    // SAFETY: each row below writes only its own logit row (rows are
    // distinct: strictly increasing) and its own output slots (top lists
    // at disjoint offsets), and every buffer outlives the region.
    unsafe impl Sync for Shared {}
    let sh = Shared {
        logits: logits.as_mut_ptr(),
        tokens: out.tokens.as_mut_ptr(),
        logprobs: out.logprobs.as_mut_ptr(),
        ranks: out.ranks.as_mut_ptr(),
        top_ids: out.top_ids.values.as_mut_ptr(),
        top_logprobs: out.top_logprobs.as_mut_ptr(),
    };
    let offsets = &out.top_ids.offsets;
    let next = AtomicUsize::new(0);
    let work = |t: usize| {
        let sh = &sh;
        let mut s = scratch.threads[t]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.prepare(vocab);
        loop {
            let r = next.fetch_add(1, Ordering::Relaxed);
            if r >= n {
                break;
            }
            let p = &meta.rows[r];
            let (a, b) = (offsets[r] as usize, offsets[r + 1] as usize);
            // SAFETY: see `Shared`; the row lies in `logits` (checked
            // above) and `a..b` in the top arrays (`shape_for`).
            let (row, top_ids, top_lps) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        sh.logits.add(p.logit_row as usize * vocab),
                        vocab,
                    ),
                    std::slice::from_raw_parts_mut(sh.top_ids.add(a), b - a),
                    std::slice::from_raw_parts_mut(sh.top_logprobs.add(a), b - a),
                )
            };
            let (token, logprob, rank) = sample_row(row, meta, r, &mut s, top_ids, top_lps);
            // SAFETY: `r < n`, the arrays' length; no other row writes
            // slot `r`.
            unsafe {
                *sh.tokens.add(r) = token;
                *sh.logprobs.add(r) = logprob;
                *sh.ranks.add(r) = rank;
            }
        }
    };
    if threads == 1 {
        work(0);
    } else {
        pool.broadcast(&work);
    }
}

/// Checks what [`sample_rows`] (and a device backend's sample) requires of
/// `meta` over a buffer of `len` values: its vocabulary is `vocab`, and its
/// logit rows are strictly increasing and within the buffer.
///
/// # Panics
/// If not: a bug in the caller.
pub(crate) fn check_rows(meta: &SamplingMetadata, vocab: usize, len: usize) {
    assert!(vocab > 0, "sample_rows: empty vocabulary");
    assert_eq!(
        meta.vocab, vocab,
        "sample_rows: metadata for another vocabulary"
    );
    let mut prev: Option<u32> = None;
    for p in &meta.rows {
        assert!(
            prev.is_none_or(|q| p.logit_row > q),
            "sample_rows: logit rows must be strictly increasing"
        );
        prev = Some(p.logit_row);
    }
    if let Some(last) = prev {
        assert!(
            (last as usize + 1) * vocab <= len,
            "sample_rows: logit row {last} is past the buffer"
        );
    }
}

/// Whether row `r` of `meta` restricts its tokens (allowed ids, bans or a
/// grammar mask): only such a row can be left with nothing to sample.
pub(crate) fn restricted(meta: &SamplingMetadata, r: usize) -> bool {
    !meta.allowed.row(r).is_empty() || !meta.banned.row(r).is_empty() || meta.mask_at[r] != NO_MASK
}

/// All the steps of one row; returns its token, and (0 unless asked) the
/// token's raw logprob and rank, with the top alternatives written to
/// `top_ids` and `top_lps`.
fn sample_row(
    row: &mut [f32],
    meta: &SamplingMetadata,
    r: usize,
    s: &mut RowScratch,
    top_ids: &mut [u32],
    top_lps: &mut [f32],
) -> (u32, f32, u32) {
    let p = &meta.rows[r];
    if p.logprobs.is_some() {
        log_softmax_into(row, &mut s.logprobs);
    }
    allow_only(row, meta.allowed.row(r), &mut s.bits);
    let (bias, values) = (
        meta.bias.row(r),
        &meta.bias_values[meta.bias.offsets[r] as usize..],
    );
    for (&t, &b) in bias.iter().zip(values) {
        if let Some(l) = row.get_mut(t as usize) {
            *l += b;
        }
    }
    if p.repetition_penalty != 1.0 {
        repetition_penalty(
            row,
            meta.penalized.row(r),
            p.repetition_penalty,
            &mut s.seen,
        );
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let from = meta.output_tokens.offsets[r] as usize;
        let tokens = meta.output_tokens.row(r);
        for (&t, &c) in tokens.iter().zip(&meta.output_counts[from..]) {
            if let Some(l) = row.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
    for &t in meta.banned.row(r) {
        if let Some(l) = row.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    if let Some(words) = meta.row_mask(r) {
        apply_mask(row, words);
    }
    // Only the restrictions can leave every logit at −∞ (biases and
    // penalties are finite); sampling from nothing has no answer.
    if restricted(meta, r) && !row.iter().any(|&v| v > f32::NEG_INFINITY) {
        return (NO_TOKEN, 0.0, 0);
    }
    let token = if p.greedy {
        argmax(row) as u32
    } else {
        sample_random(row, p, s)
    };
    if p.logprobs.is_none() {
        return (token, 0.0, 0);
    }
    let lp = &s.logprobs;
    let logprob = lp[token as usize];
    let k = top_ids.len();
    if k > 0 {
        build_histogram(lp, &mut s.hist);
        top_sorted(lp, k, &s.hist, &mut s.cands);
        for ((id, v), &(w, t)) in top_ids.iter_mut().zip(top_lps.iter_mut()).zip(&s.cands) {
            *id = t;
            *v = w;
        }
    }
    let better = lp.iter().filter(|&&v| v > logprob).count();
    (token, logprob, better as u32 + 1)
}

/// The index of the largest value; ties go to the lowest.
pub fn argmax(x: &[f32]) -> usize {
    // What a scan keeping the first strictly greater value finds (ties go
    // to the lowest id, as llama.cpp and torch do; NaN is never greater),
    // in two passes the compiler vectorizes: the largest value above −∞,
    // then its first index.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(chunks.remainder()) {
        if v > best {
            best = v;
        }
    }
    if best == f32::NEG_INFINITY {
        return 0;
    }
    x.iter().position(|&v| v == best).unwrap_or(0)
}

/// log_softmax of `x` into `out`, with the normalizer summed in f64.
pub fn log_softmax_into(x: &[f32], out: &mut Vec<f32>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    out.clear();
    out.extend(x.iter().map(|&v| (v as f64 - lse) as f32));
}

/// Gives −∞ to every id of `row` not in `allowed` (none when it is empty).
fn allow_only(row: &mut [f32], allowed: &[u32], bits: &mut Vec<u64>) {
    if allowed.is_empty() {
        return;
    }
    bits.clear();
    bits.resize(row.len().div_ceil(64), 0);
    for &t in allowed {
        if let Some(w) = bits.get_mut(t as usize / 64) {
            *w |= 1 << (t % 64);
        }
    }
    for (chunk, &b) in row.chunks_mut(64).zip(bits.iter()) {
        if b == u64::MAX {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if b & (1 << i) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Divides positive logits of the distinct `tokens` by `penalty`,
/// multiplies the others. `seen` is left all zero.
fn repetition_penalty(row: &mut [f32], tokens: &[u32], penalty: f32, seen: &mut Vec<u64>) {
    let words = row.len().div_ceil(64);
    if seen.len() < words {
        seen.resize(words, 0);
    }
    for &t in tokens {
        let (w, bit) = (t as usize / 64, 1u64 << (t % 64));
        if (t as usize) < row.len() && seen[w] & bit == 0 {
            seen[w] |= bit;
            let l = &mut row[t as usize];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
    for &t in tokens {
        if let Some(w) = seen.get_mut(t as usize / 64) {
            *w = 0;
        }
    }
}

/// Gives −∞ to the ids a grammar's mask `words` disallows.
pub fn apply_mask(row: &mut [f32], words: &[u32]) {
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << i) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Temperature, softmax, the candidates of top-k / top-p / min-p, and the
/// draw from the row's uniform.
fn sample_random(row: &mut [f32], p: &RowSampling, s: &mut RowScratch) -> u32 {
    let inv_t = 1.0 / p.temperature;
    if inv_t != 1.0 {
        for l in row.iter_mut() {
            *l *= inv_t;
        }
    }
    softmax_inplace(row);
    if !select_candidates(row, p, s) {
        // Plain temperature sampling: one scan, no sorting.
        return draw(row, 1.0, p.uniform);
    }
    let cands = &s.cands;
    let sum: f64 = cands.iter().map(|c| c.0 as f64).sum();
    let mut u = p.uniform * sum;
    for c in cands.iter() {
        u -= c.0 as f64;
        if u <= 0.0 {
            return c.1;
        }
    }
    cands[0].1
}

/// Leaves in `s.cands` the tokens top-k, top-p and min-p keep of `probs`,
/// likeliest first, and returns true; false (candidates untouched) when
/// none of the three limits anything.
///
/// Which set top-p keeps follows the host sampler exactly: the top `k`
/// tokens are taken for `k` = the top-k, or else 64, 512, 4096, … until
/// their mass reaches `top_p`, and top-p then keeps the shortest prefix
/// holding `top_p` of *that* set's mass.
fn select_candidates(probs: &[f32], p: &RowSampling, s: &mut RowScratch) -> bool {
    let (top_k, top_p, min_p) = (p.top_k, p.top_p, p.min_p);
    let vocab = probs.len();
    let top_k = if top_k > 0 {
        (top_k as usize).min(vocab)
    } else {
        vocab
    };
    if top_k == vocab && top_p >= 1.0 && min_p <= 0.0 {
        return false;
    }
    let total = 1f64;
    let mut k = if top_k < vocab { top_k } else { 64.min(vocab) };
    // Whether `s.cands` holds the whole vocabulary, sorted: the top `k`
    // for any `k` are then its prefix.
    let mut all_sorted = false;
    let mut hist_built = false;
    loop {
        if !all_sorted {
            if k > vocab / 8 {
                // A large share of the vocabulary: one radix sort of all
                // of it costs less than selecting and sorting that share.
                sort_all(probs, &mut s.cands, &mut s.radix);
                all_sorted = true;
            } else {
                if !hist_built {
                    build_histogram(probs, &mut s.hist);
                    hist_built = true;
                }
                top_sorted(probs, k, &s.hist, &mut s.cands);
            }
        }
        let mass: f64 = s.cands[..k].iter().map(|c| c.0 as f64).sum();
        if k == top_k || k == vocab || mass >= top_p as f64 * total {
            break;
        }
        k = (k * 8).min(top_k).min(vocab);
    }
    let cands = &mut s.cands;
    cands.truncate(k);
    cut_nucleus(cands, top_p, min_p);
    true
}

/// Cuts the candidates `cands` (probabilities with their ids, likeliest
/// first) to the nucleus: the fewest whose mass reaches `top_p` of theirs
/// (top-k renormalizes before top-p is applied, as in vLLM), then those at
/// least `min_p` times the likeliest. At least one always stays. The host
/// sampler (speculative verification) cuts with this too, so both agree.
pub fn cut_nucleus(cands: &mut Vec<(f32, u32)>, top_p: f32, min_p: f32) {
    if cands.is_empty() {
        return;
    }
    let kept_mass: f64 = cands.iter().map(|c| c.0 as f64).sum();
    if top_p < 1.0 {
        let mut cum = 0f64;
        let mut keep = cands.len();
        for (i, c) in cands.iter().enumerate() {
            cum += c.0 as f64;
            if cum >= top_p as f64 * kept_mass {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep.max(1));
    }
    if min_p > 0.0 {
        let threshold = cands[0].0 * min_p;
        let best = cands[0];
        cands.retain(|c| c.0 >= threshold);
        // The likeliest always passes (min_p <= 1), unless the row held a
        // NaN; a draw needs a candidate either way.
        if cands.is_empty() {
            cands.push(best);
        }
    }
}

/// Draws a token from the weights `w`, which sum to `total`, with the
/// uniform `u01`. A token of weight 0 (masked out) is never chosen, even
/// when the draw is exactly 0.
fn draw(w: &[f32], total: f64, u01: f64) -> u32 {
    let mut u = u01 * total;
    for (i, &x) in w.iter().enumerate() {
        u -= x as f64;
        if u <= 0.0 && x > 0.0 {
            return i as u32;
        }
    }
    argmax(w) as u32
}

/// Maps `v` to a `u32` that orders as `f32::total_cmp` orders the floats
/// (−NaN < −∞ < … < −0 < +0 < … < +∞ < +NaN).
#[inline]
fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Counts `values` by the high bits of their [`order_key`].
fn build_histogram(values: &[f32], hist: &mut [u32; HIST_BUCKETS]) {
    hist.fill(0);
    for &v in values {
        hist[(order_key(v) >> HIST_SHIFT) as usize] += 1;
    }
}

/// Sorts all of `values` into `out` as `(value, id)` pairs by
/// [`by_value_then_id`]: a least-significant-digit radix sort on the
/// inverted [`order_key`] (largest value first), which is stable, so
/// equal values keep the id order they start in. `tmp` is scratch.
fn sort_all(values: &[f32], out: &mut Vec<(f32, u32)>, tmp: &mut Vec<(f32, u32)>) {
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    let key = |v: f32| !order_key(v);
    out.clear();
    out.extend(values.iter().enumerate().map(|(i, &v)| (v, i as u32)));
    tmp.clear();
    tmp.resize(values.len(), (0.0, 0));
    let mut counts = [[0u32; BUCKETS]; 3];
    for &v in values {
        let k = key(v);
        for (d, c) in counts.iter_mut().enumerate() {
            c[(k >> (BITS * d as u32)) as usize & (BUCKETS - 1)] += 1;
        }
    }
    for (d, c) in counts.iter_mut().enumerate() {
        // A digit every key shares moves nothing.
        if c.iter().any(|&n| n as usize == values.len()) {
            continue;
        }
        let mut at = 0u32;
        for n in c.iter_mut() {
            let here = *n;
            *n = at;
            at += here;
        }
        let shift = BITS * d as u32;
        for &e in out.iter() {
            let b = (key(e.0) >> shift) as usize & (BUCKETS - 1);
            tmp[c[b] as usize] = e;
            c[b] += 1;
        }
        std::mem::swap(out, tmp);
    }
}

/// Largest first; equal values by the lower id. A strict total order, so
/// the `k` largest and their order are unique.
fn by_value_then_id(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Leaves in `cands` the `k` (at least 1, at most `values.len()`) largest
/// of `(values[i], i)` under [`by_value_then_id`], sorted. `hist` is
/// `values`' histogram: only the buckets that hold the `k` largest are
/// gathered and selected from, instead of the whole vocabulary.
fn top_sorted(values: &[f32], k: usize, hist: &[u32; HIST_BUCKETS], cands: &mut Vec<(f32, u32)>) {
    let mut bucket = HIST_BUCKETS;
    let mut count = 0usize;
    while bucket > 0 {
        bucket -= 1;
        count += hist[bucket] as usize;
        if count >= k {
            break;
        }
    }
    // Every value of a bucket below `bucket` orders below every value
    // gathered here, so the `k` largest are all among them.
    let min_key = (bucket as u32) << HIST_SHIFT;
    cands.clear();
    cands.extend(
        values
            .iter()
            .enumerate()
            .filter(|&(_, &v)| order_key(v) >= min_key)
            .map(|(i, &v)| (v, i as u32)),
    );
    if cands.len() > k {
        cands.select_nth_unstable_by(k - 1, by_value_then_id);
        cands.truncate(k);
    }
    cands.sort_unstable_by(by_value_then_id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::{BTreeMap, BTreeSet};

    /// One row as the reference takes it: everything a request asks for,
    /// as plain collections.
    #[derive(Clone, Debug)]
    struct Row {
        p: RowSampling,
        penalized: Vec<u32>,
        counts: BTreeMap<u32, u32>,
        bias: Vec<(u32, f32)>,
        banned: Vec<u32>,
        allowed: Vec<u32>,
        mask: Option<Vec<u32>>,
    }

    /// What the reference chose for a row: token, and (logprob, rank,
    /// top) when asked.
    type Chosen = (u32, Option<(f32, u32, Vec<(u32, f32)>)>);

    /// The definitions, one row at a time, written plainly: full sorts,
    /// sets, no scratch. `softmax_inplace` is shared with the op (its
    /// vector `exp` decides the bits), as is the f64 summation order the
    /// definitions fix (sorted order, then id order).
    fn reference(logits: &[f32], row: &Row) -> Chosen {
        let p = &row.p;
        let vocab = logits.len();
        let mut l = logits.to_vec();
        // Raw logprobs.
        let lp: Vec<f32> = {
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for &v in &l {
                sum += ((v - max) as f64).exp();
            }
            let lse = max as f64 + sum.ln();
            l.iter().map(|&v| (v as f64 - lse) as f32).collect()
        };
        if !row.allowed.is_empty() {
            let allowed: BTreeSet<u32> = row.allowed.iter().copied().collect();
            for (t, v) in l.iter_mut().enumerate() {
                if !allowed.contains(&(t as u32)) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, b) in &row.bias {
            if (t as usize) < vocab {
                l[t as usize] += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let distinct: BTreeSet<u32> = row.penalized.iter().copied().collect();
            for t in distinct {
                if (t as usize) < vocab {
                    let v = &mut l[t as usize];
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &row.counts {
                if (t as usize) < vocab {
                    l[t as usize] -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        for &t in &row.banned {
            if (t as usize) < vocab {
                l[t as usize] = f32::NEG_INFINITY;
            }
        }
        if let Some(words) = &row.mask {
            for (t, v) in l.iter_mut().enumerate() {
                let w = words.get(t / 32).copied().unwrap_or(0);
                if w & (1 << (t % 32)) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        let order = |x: &[f32]| {
            let mut all: Vec<(f32, u32)> =
                x.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
            all.sort_by(by_value_then_id);
            all
        };
        // The first index of the largest value above −∞ (NaNs compare
        // false), else 0.
        let first_max = |x: &[f32]| {
            let m = x
                .iter()
                .copied()
                .filter(|v| !v.is_nan())
                .fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                0
            } else {
                x.iter().position(|&v| v == m).unwrap_or(0)
            }
        };
        let restricted = !row.allowed.is_empty() || !row.banned.is_empty() || row.mask.is_some();
        if restricted && !l.iter().any(|&v| v > f32::NEG_INFINITY) {
            return (NO_TOKEN, None);
        }
        let token = if p.greedy {
            first_max(&l) as u32
        } else {
            let inv_t = 1.0 / p.temperature;
            if inv_t != 1.0 {
                l.iter_mut().for_each(|v| *v *= inv_t);
            }
            softmax_inplace(&mut l);
            let top_k = if p.top_k > 0 {
                (p.top_k as usize).min(vocab)
            } else {
                vocab
            };
            if top_k == vocab && p.top_p >= 1.0 && p.min_p <= 0.0 {
                let mut u = p.uniform;
                let mut pick = None;
                for (i, &x) in l.iter().enumerate() {
                    u -= x as f64;
                    if u <= 0.0 && x > 0.0 {
                        pick = Some(i as u32);
                        break;
                    }
                }
                pick.unwrap_or(first_max(&l) as u32)
            } else {
                let sorted = order(&l);
                let mass = |k: usize| sorted[..k].iter().map(|c| c.0 as f64).sum::<f64>();
                let mut k = if top_k < vocab { top_k } else { 64.min(vocab) };
                while !(k == top_k || k == vocab || mass(k) >= p.top_p as f64) {
                    k = (k * 8).min(top_k).min(vocab);
                }
                let mut cands = sorted[..k].to_vec();
                let kept = mass(k);
                if p.top_p < 1.0 {
                    let mut cum = 0f64;
                    let mut keep = cands.len();
                    for (i, c) in cands.iter().enumerate() {
                        cum += c.0 as f64;
                        if cum >= p.top_p as f64 * kept {
                            keep = i + 1;
                            break;
                        }
                    }
                    cands.truncate(keep.max(1));
                }
                if p.min_p > 0.0 {
                    let th = cands[0].0 * p.min_p;
                    let best = cands[0];
                    cands.retain(|c| c.0 >= th);
                    if cands.is_empty() {
                        cands.push(best);
                    }
                }
                let sum: f64 = cands.iter().map(|c| c.0 as f64).sum();
                let mut u = p.uniform * sum;
                let mut pick = cands[0].1;
                for c in &cands {
                    u -= c.0 as f64;
                    if u <= 0.0 {
                        pick = c.1;
                        break;
                    }
                }
                pick
            }
        };
        let logprobs = p.logprobs.map(|k| {
            let k = (k as usize).min(vocab);
            let top: Vec<(u32, f32)> = order(&lp)[..k].iter().map(|&(v, i)| (i, v)).collect();
            let chosen = lp[token as usize];
            let rank = lp.iter().filter(|&&v| v > chosen).count() as u32 + 1;
            (chosen, rank, top)
        });
        (token, logprobs)
    }

    fn fill(meta: &mut SamplingMetadata, rows: &[Row]) {
        for row in rows {
            meta.push_row(row.p);
            meta.penalize(&row.penalized);
            for (&t, &c) in &row.counts {
                meta.count_output(t, c);
            }
            for &(t, b) in &row.bias {
                meta.bias(t, b);
            }
            for &t in &row.banned {
                meta.ban(t);
            }
            meta.allow(&row.allowed);
            if let Some(m) = &row.mask {
                meta.mask(m);
            }
        }
    }

    /// Logits of one of several shapes: smooth, peaked, or quantized to a
    /// few levels (many exact ties).
    fn random_logits(rng: &mut StdRng, vocab: usize, kind: usize) -> Vec<f32> {
        (0..vocab)
            .map(|i| match kind {
                0 => rng.random_range(-4.0f32..4.0),
                1 => {
                    if i % 97 == 3 {
                        rng.random_range(5.0f32..9.0)
                    } else {
                        rng.random_range(-6.0f32..1.0)
                    }
                }
                _ => (rng.random_range(0..5) as f32) * 0.75 - 1.0,
            })
            .collect()
    }

    fn random_row(rng: &mut StdRng, vocab: usize, logit_row: u32) -> Row {
        let on = |rng: &mut StdRng| rng.random_bool(0.5);
        let greedy = rng.random_bool(0.3);
        let p = RowSampling {
            logit_row,
            greedy,
            temperature: [0.3, 0.8, 1.0, 1.7][rng.random_range(0..4)],
            top_k: [0, 0, 1, 5, 40, 100_000][rng.random_range(0..6)],
            top_p: [1.0, 0.9, 0.5, 0.999][rng.random_range(0..4)],
            min_p: [0.0, 0.0, 0.05, 0.3][rng.random_range(0..4)],
            uniform: rng.random::<f64>(),
            logprobs: if on(rng) {
                Some(rng.random_range(0..6))
            } else {
                None
            },
            repetition_penalty: if on(rng) { 1.3 } else { 1.0 },
            presence_penalty: if on(rng) { 0.5 } else { 0.0 },
            frequency_penalty: if on(rng) { -0.3 } else { 0.0 },
        };
        let ids = |rng: &mut StdRng, n: usize| -> Vec<u32> {
            // A few ids past the vocabulary, which are ignored.
            (0..n)
                .map(|_| rng.random_range(0..vocab as u32 + 3))
                .collect()
        };
        let n = rng.random_range(0..60);
        let penalized = ids(rng, n);
        let mut counts = BTreeMap::new();
        let n = rng.random_range(0..20);
        for t in ids(rng, n) {
            *counts.entry(t).or_insert(0) += 1;
        }
        let n = rng.random_range(0..6);
        let bias = ids(rng, n)
            .into_iter()
            .map(|t| (t, rng.random_range(-5.0f32..5.0)))
            .collect();
        let banned = if on(rng) { ids(rng, 4) } else { Vec::new() };
        let allowed = if rng.random_bool(0.25) {
            let n = rng.random_range(1..vocab / 2);
            ids(rng, n)
        } else {
            Vec::new()
        };
        let mask = rng.random_bool(0.25).then(|| {
            // Short masks too: missing words allow nothing.
            let words = vocab.div_ceil(32) - rng.random_range(0..2);
            (0..words).map(|_| rng.random::<u32>()).collect()
        });
        Row {
            p,
            penalized,
            counts,
            bias,
            banned,
            allowed,
            mask,
        }
    }

    fn check_against_reference(vocab: usize, n_rows: usize, threads: usize, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let pool = ThreadPool::new(threads);
        // Some logit rows are skipped (prompt rows the op does not read).
        let mut logit_rows = Vec::new();
        let mut r = 0u32;
        for _ in 0..n_rows {
            r += rng.random_range(1..3);
            logit_rows.push(r);
        }
        let total_rows = r as usize + 1;
        let kind = rng.random_range(0..3);
        let logits: Vec<f32> = (0..total_rows)
            .flat_map(|_| random_logits(&mut rng, vocab, kind))
            .collect();
        let rows: Vec<Row> = logit_rows
            .iter()
            .map(|&lr| random_row(&mut rng, vocab, lr))
            .collect();
        let mut meta = SamplingMetadata::default();
        meta.clear(vocab);
        fill(&mut meta, &rows);
        let (mut scratch, mut out) = (SampleScratch::default(), SampledRows::default());
        let mut batch = logits.clone();
        sample_rows(&pool, &mut batch, vocab, &meta, &mut scratch, &mut out);
        for (i, row) in rows.iter().enumerate() {
            let lr = row.p.logit_row as usize;
            let (token, lps) = reference(&logits[lr * vocab..(lr + 1) * vocab], row);
            assert_eq!(out.tokens[i], token, "seed {seed}, row {i}: {:?}", row.p);
            if token == NO_TOKEN {
                continue;
            }
            let got = out.logprobs_of(&meta, i).map(|l| {
                let top = l
                    .top_ids
                    .iter()
                    .copied()
                    .zip(l.top_logprobs.iter().copied());
                (
                    l.logprob.to_bits(),
                    l.rank,
                    top.map(|(t, v)| (t, v.to_bits())).collect::<Vec<_>>(),
                )
            });
            let want = lps.map(|(lp, rank, top)| {
                (
                    lp.to_bits(),
                    rank,
                    top.into_iter().map(|(t, v)| (t, v.to_bits())).collect(),
                )
            });
            assert_eq!(got, want, "seed {seed}, row {i}: logprobs");
        }
        // Rows the op does not sample are left alone.
        for r in 0..total_rows {
            if !logit_rows.contains(&(r as u32)) {
                assert_eq!(
                    batch[r * vocab..(r + 1) * vocab],
                    logits[r * vocab..(r + 1) * vocab],
                    "row {r} was touched"
                );
            }
        }
    }

    #[test]
    fn batched_sampling_matches_the_reference_row_by_row() {
        for seed in 0..40 {
            let vocab = [7usize, 64, 100, 1000, 5003][seed as usize % 5];
            let rows = 1 + seed as usize % 9;
            check_against_reference(vocab, rows, 1 + seed as usize % 3, seed);
        }
    }

    #[test]
    fn a_large_vocabulary_grows_the_nucleus_like_the_reference() {
        // Flat logits over a large vocabulary: top-p alone walks k through
        // 64, 512, 4096, ... before the mass suffices.
        for seed in 100..104 {
            check_against_reference(40_000, 6, 2, seed);
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let vocab = 3000;
        let mut rng = StdRng::seed_from_u64(5);
        let logits: Vec<f32> = (0..16)
            .flat_map(|_| random_logits(&mut rng, vocab, 0))
            .collect();
        let rows: Vec<Row> = (0..16).map(|r| random_row(&mut rng, vocab, r)).collect();
        let mut meta = SamplingMetadata::default();
        meta.clear(vocab);
        fill(&mut meta, &rows);
        let run = |threads: usize| {
            let (mut s, mut out) = (SampleScratch::default(), SampledRows::default());
            let mut l = logits.clone();
            sample_rows(
                &ThreadPool::new(threads),
                &mut l,
                vocab,
                &meta,
                &mut s,
                &mut out,
            );
            (
                out.tokens,
                out.logprobs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            )
        };
        assert_eq!(run(1), run(2));
        assert_eq!(run(1), run(4));
    }

    #[test]
    fn restrictions_hold_whatever_the_logits_say() {
        let vocab = 500;
        let mut rng = StdRng::seed_from_u64(9);
        let pool = ThreadPool::new(2);
        let (mut s, mut out) = (SampleScratch::default(), SampledRows::default());
        let mut meta = SamplingMetadata::default();
        for _ in 0..50 {
            let mut logits = random_logits(&mut rng, vocab, 1);
            // The likeliest token is banned; only 10..20 are allowed, and
            // the mask takes away the even ones.
            let best = argmax(&logits[10..20]) as u32 + 10;
            meta.clear(vocab);
            meta.push_row(RowSampling {
                greedy: rng.random_bool(0.5),
                temperature: 1.5,
                uniform: rng.random(),
                ..RowSampling::default()
            });
            meta.allow(&(10..20).collect::<Vec<u32>>());
            meta.ban(best);
            let words: Vec<u32> = (0..meta.mask_words()).map(|_| 0xAAAA_AAAA).collect();
            meta.mask(&words);
            sample_rows(&pool, &mut logits, vocab, &meta, &mut s, &mut out);
            let t = out.tokens[0];
            assert!(
                (10..20).contains(&t) && t % 2 == 1 && t != best,
                "sampled {t}"
            );
        }
    }

    #[test]
    fn the_radix_sort_and_the_argmax_agree_with_their_definitions() {
        let mut rng = StdRng::seed_from_u64(21);
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -0.0,
            0.0,
            1e-42,
        ];
        let (mut out, mut tmp) = (Vec::new(), Vec::new());
        for case in 0..60 {
            let n = [1usize, 2, 17, 300, 5000][case % 5];
            let v: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..10) {
                    0 => specials[rng.random_range(0..specials.len())],
                    1..=4 => rng.random_range(0..4) as f32 * 0.5,
                    _ => rng.random_range(-3.0f32..3.0),
                })
                .collect();
            let mut want: Vec<(f32, u32)> =
                v.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
            want.sort_by(by_value_then_id);
            sort_all(&v, &mut out, &mut tmp);
            let bits =
                |p: &[(f32, u32)]| p.iter().map(|&(x, i)| (x.to_bits(), i)).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want), "case {case}");
            // The scan argmax is defined by.
            let mut best = (0, f32::NEG_INFINITY);
            for (i, &x) in v.iter().enumerate() {
                if x > best.1 {
                    best = (i, x);
                }
            }
            assert_eq!(argmax(&v), best.0, "case {case}: {v:?}");
        }
    }

    #[test]
    fn order_keys_sort_as_total_cmp() {
        let vals = [
            f32::NAN,
            -f32::NAN,
            f32::NEG_INFINITY,
            -1.5,
            -0.0,
            0.0,
            1e-40,
            0.25,
            3.0,
            f32::INFINITY,
        ];
        for a in vals {
            for b in vals {
                assert_eq!(
                    order_key(a).cmp(&order_key(b)),
                    a.total_cmp(&b),
                    "{a} vs {b}"
                );
            }
        }
    }
}
