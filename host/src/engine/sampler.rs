//! Turns one row of logits into the next token on the host: logit
//! processors (allowed ids, bad words, bias, penalties, min_tokens),
//! optional logprobs of the raw model output, then greedy or temperature /
//! top-k / top-p / min-p sampling with the request's own RNG.
//!
//! The model runner samples plain rows for the whole batch at once on the
//! device ([`pagoda_accel::Backend::sample`], whose numbers are bitwise
//! these); this sampler serves what stays on the host: verifying drafts
//! and scoring prompt tokens.

use crate::engine::request::{SamplingParams, TokenLogprob};
use crate::engine::structured_output::TokenMask;
use pagoda_accel::ops;
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;

/// What the sampler reads of one request, and its random stream, which
/// sampling advances.
pub struct SampleRow<'a> {
    pub params: &'a SamplingParams,
    /// Prompt and output so far: what the repetition penalty discourages.
    pub token_ids: &'a [u32],
    /// Tokens generated so far (`min_tokens` bans EOS until enough).
    pub num_output: usize,
    /// How often each token occurs in the output, for the penalties.
    pub output_counts: &'a HashMap<u32, u32>,
    /// Ids banned until `min_tokens` are out.
    pub eos_ids: &'a [u32],
    pub rng: &'a mut StdRng,
}

/// Reusable buffers, so sampling a warm batch allocates nothing on the
/// greedy path.
#[derive(Default)]
pub struct Sampler {
    candidates: Vec<(f32, u32)>,
    logprobs: Vec<f32>,
    seen: Vec<u64>,
    /// Bit per id of the request's allowed ids.
    allowed: Vec<u64>,
}

/// What the sampler chose for one row.
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// The index of the largest value; ties go to the lowest.
pub(crate) fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        // Strictly greater: ties go to the lowest id, as llama.cpp and torch do.
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// log_softmax of `x` into `out`, computed in f64 for the normalizer.
fn log_softmax_into(x: &[f32], out: &mut Vec<f32>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    out.clear();
    out.extend(x.iter().map(|&v| (v as f64 - lse) as f32));
}

impl Sampler {
    /// Chooses the next token of `req` from `logits` (modified in place).
    /// With a grammar's `mask`, only the tokens it allows can be chosen;
    /// logprobs still describe the model's own distribution.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        req: &mut SampleRow,
        mask: Option<&TokenMask>,
    ) -> Sampled {
        let p = req.params;
        let logprob_k = p.logprobs;
        // Logprobs describe the model's own distribution, before any
        // processing, as vLLM v1 reports them by default.
        if logprob_k.is_some() {
            log_softmax_into(logits, &mut self.logprobs);
        }
        self.process(logits, req);
        if let Some(mask) = mask {
            mask.apply(logits);
        }
        let token = if p.is_greedy() {
            argmax(logits) as u32
        } else {
            self.sample_random(logits, p, req.rng)
        };
        let logprob = logprob_k.map(|k| self.describe(token, k, &p.logprob_token_ids));
        Sampled { token, logprob }
    }

    /// The log-probability that the raw `logits` row gives `token`, with
    /// its rank and the `k` likeliest tokens: how a prompt token is scored.
    pub fn score(&mut self, logits: &[f32], token: u32, k: usize) -> TokenLogprob {
        log_softmax_into(logits, &mut self.logprobs);
        self.describe(token, k, &[])
    }

    /// `token`'s entry in the log-probabilities last computed, with its
    /// rank and the `k` best alternatives (ties go to the lower id), or,
    /// when `ids` names some (`logprob_token_ids`), those ids instead.
    fn describe(&mut self, token: u32, k: usize, ids: &[u32]) -> TokenLogprob {
        let lp = &self.logprobs;
        let logprob = lp[token as usize];
        let mut top = Vec::with_capacity(k);
        if !ids.is_empty() {
            top.extend(
                ids.iter()
                    .filter_map(|&i| lp.get(i as usize).map(|&v| (i, v))),
            );
        } else if k > 0 {
            self.candidates.clear();
            self.candidates
                .extend(lp.iter().enumerate().map(|(i, &v)| (v, i as u32)));
            let k = k.min(self.candidates.len());
            self.candidates
                .select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            self.candidates[..k].sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            top.extend(self.candidates[..k].iter().map(|&(v, i)| (i, v)));
        }
        let better = lp.iter().filter(|&&v| v > logprob).count();
        TokenLogprob {
            token_id: token,
            logprob,
            rank: better as u32 + 1,
            top,
        }
    }

    /// Applies allowed ids, bad words, logit bias, the penalties and
    /// min_tokens to `logits`.
    fn process(&mut self, logits: &mut [f32], req: &SampleRow) {
        let p = req.params;
        // Allowed ids and bad words first, as vLLM orders them (they only
        // assign −∞, which the processors below keep).
        if let Some(allowed) = &p.allowed_token_ids {
            self.allowed.clear();
            self.allowed.resize(logits.len().div_ceil(64), 0);
            for &t in allowed {
                if let Some(w) = self.allowed.get_mut(t as usize / 64) {
                    *w |= 1 << (t % 64);
                }
            }
            for (t, l) in logits.iter_mut().enumerate() {
                if self.allowed[t / 64] & (1 << (t % 64)) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let output = &req.token_ids[req.token_ids.len() - req.num_output..];
        for t in bad_word_bans(&p.bad_words_token_ids, output) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let repetition_penalty = p.repetition_penalty();
        if repetition_penalty != 1.0 {
            let words = logits.len().div_ceil(64);
            if self.seen.len() < words {
                self.seen.resize(words, 0);
            }
            for &t in req.token_ids {
                let (w, bit) = (t as usize / 64, 1u64 << (t % 64));
                if w < words && self.seen[w] & bit == 0 {
                    self.seen[w] |= bit;
                    let l = &mut logits[t as usize];
                    *l = if *l > 0.0 {
                        *l / repetition_penalty
                    } else {
                        *l * repetition_penalty
                    };
                }
            }
            for &t in req.token_ids {
                if let Some(w) = self.seen.get_mut(t as usize / 64) {
                    *w = 0;
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in req.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        if req.num_output < p.min_tokens {
            for &t in req.eos_ids.iter().chain(&p.stop_token_ids) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Temperature / top-k / top-p / min-p sampling from `logits` (which
    /// become probabilities in place).
    fn sample_random(&mut self, logits: &mut [f32], p: &SamplingParams, rng: &mut StdRng) -> u32 {
        to_probs(logits, p);
        if !self.select_candidates(logits, p) {
            // Plain temperature sampling: one scan, no sorting.
            return draw(logits, 1.0, rng);
        }
        let cands = &self.candidates;
        let sum: f64 = cands.iter().map(|c| c.0 as f64).sum();
        let mut u = rng.random::<f64>() * sum;
        for c in cands.iter() {
            u -= c.0 as f64;
            if u <= 0.0 {
                return c.1;
            }
        }
        cands[0].1
    }

    /// Leaves in `self.candidates` the tokens that top-k, top-p and min-p
    /// keep of the distribution `probs`, most likely first, and returns
    /// true; returns false (and leaves them alone) when none of the three
    /// limits anything.
    fn select_candidates(&mut self, probs: &[f32], p: &SamplingParams) -> bool {
        let (top_k, top_p, min_p) = (p.top_k(), p.top_p(), p.min_p());
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
        let cands = &mut self.candidates;
        // Take the k most likely tokens; when only top-p limits the set,
        // grow k until it covers top_p of the mass, which avoids sorting the
        // whole vocabulary in the common case.
        let mut k = if top_k < vocab { top_k } else { 64.min(vocab) };
        loop {
            cands.clear();
            cands.extend(probs.iter().enumerate().map(|(i, &w)| (w, i as u32)));
            cands.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            cands.truncate(k);
            cands.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mass: f64 = cands.iter().map(|c| c.0 as f64).sum();
            if k == top_k || k == vocab || mass >= top_p as f64 * total {
                break;
            }
            k = (k * 8).min(top_k).min(vocab);
        }
        pagoda_accel::ops::sample::cut_nucleus(cands, top_p, min_p);
        true
    }

    /// Turns `logits` in place into the distribution the request samples
    /// from: processors, temperature, softmax, and top-k / top-p / min-p
    /// (tokens they drop get 0, the rest are renormalized).
    fn target_probs(&mut self, logits: &mut [f32], req: &SampleRow) {
        self.process(logits, req);
        to_probs(logits, req.params);
        if self.select_candidates(logits, req.params) {
            let sum: f64 = self.candidates.iter().map(|c| c.0 as f64).sum();
            logits.fill(0.0);
            for &(w, t) in &self.candidates {
                logits[t as usize] = (w as f64 / sum) as f32;
            }
        }
    }

    /// Verifies `drafts` of `req` against the target's rows (`draft_probs`:
    /// the distributions a draft model drew them from, one row each, or
    /// empty for drafts chosen outright): `rows` holds
    /// `drafts.len() + 1` rows of `vocab` logits, row `i` predicting the
    /// token after draft `i - 1` (row 0: after the last real token). Pushes
    /// the ids the sequence gains to `tokens` (with their logprobs, if
    /// asked for, to `logprobs`): the drafts the target accepts, then one
    /// of its own — the correction at the first rejection, or a bonus token
    /// when every draft holds.
    ///
    /// Greedy requests accept a draft when it is the target's argmax, so
    /// the output is token for token what plain decoding gives. Others use
    /// rejection sampling (Leviathan et al.; Chen et al.): draft `d`, drawn
    /// from `q`, is accepted with probability `min(1, p(d) / q(d))` under
    /// the request's own sampling distribution `p`, and on rejection the
    /// token is drawn from `max(0, p − q)`, renormalized, so each emitted
    /// token is distributed exactly as plain sampling's. A draft chosen
    /// outright (n-gram, a draft model's argmax) has `q` one-hot: accepted
    /// with probability `p(d)`, else drawn from `p` without `d`.
    pub fn verify(
        &mut self,
        rows: &mut [f32],
        vocab: usize,
        drafts: &[u32],
        draft_probs: &[f32],
        req: &mut SampleRow,
        tokens: &mut Vec<u32>,
        logprobs: &mut Vec<Option<TokenLogprob>>,
    ) {
        let greedy = req.params.is_greedy();
        let logprob_k = req.params.logprobs;
        // Drafts sampled from a draft model carry the distribution each was
        // drawn from.
        let sampled_drafts = draft_probs.len() >= drafts.len() * vocab;
        for (i, &draft) in drafts.iter().enumerate() {
            let row = &mut rows[i * vocab..(i + 1) * vocab];
            if greedy {
                let sampled = self.sample(row, req, None);
                tokens.push(sampled.token);
                logprobs.push(sampled.logprob);
                if sampled.token != draft {
                    return;
                }
                continue;
            }
            if logprob_k.is_some() {
                log_softmax_into(row, &mut self.logprobs);
            }
            self.target_probs(row, req);
            // The draft's own distribution; none for a draft chosen outright.
            let q = draft_probs
                .get(i * vocab..(i + 1) * vocab)
                .filter(|_| sampled_drafts);
            let (token, accept) = accept_or_resample(row, q, draft, req.rng);
            tokens.push(token);
            logprobs
                .push(logprob_k.map(|k| self.describe(token, k, &req.params.logprob_token_ids)));
            if !accept {
                return;
            }
        }
        // Every draft held: the target's own next token comes free.
        let k = drafts.len();
        let sampled = self.sample(&mut rows[k * vocab..(k + 1) * vocab], req, None);
        tokens.push(sampled.token);
        logprobs.push(sampled.logprob);
    }
}

impl Sampler {
    /// Chooses a draft model's next draft for a request sampled by
    /// `params` from its logits `row`: the argmax, unless `sample` and the
    /// request samples, in which case it is drawn (from `rng`) from the
    /// draft model's distribution at the request's temperature (`row`
    /// becomes that distribution), which is appended to `draft_probs` for
    /// verification to divide by.
    pub fn draft(
        &mut self,
        row: &mut [f32],
        params: &SamplingParams,
        rng: &mut StdRng,
        draft_probs: &mut Vec<f32>,
        sample: bool,
    ) -> u32 {
        if !sample || params.is_greedy() {
            return argmax(row) as u32;
        }
        to_probs(row, params);
        let total: f64 = row.iter().map(|&w| w as f64).sum();
        let token = draw(row, total, rng);
        draft_probs.extend_from_slice(row);
        token
    }
}

/// One rejection-sampling decision: keeps `draft`, drawn from `q` (or
/// chosen outright when `q` is `None`), with probability
/// `min(1, p(draft) / q(draft))` under the target distribution `p`; else
/// draws from `max(0, p − q)` renormalized (`p` without `draft` for a
/// certain draft). `p` is overwritten. Returns the token and whether it is
/// the draft.
fn accept_or_resample(
    p: &mut [f32],
    q: Option<&[f32]>,
    draft: u32,
    rng: &mut StdRng,
) -> (u32, bool) {
    let p_draft = p.get(draft as usize).copied().unwrap_or(0.0) as f64;
    let q_draft = q.map_or(1.0, |q| {
        q.get(draft as usize).copied().unwrap_or(0.0) as f64
    });
    if rng.random::<f64>() * q_draft < p_draft {
        return (draft, true);
    }
    match q {
        Some(q) => {
            for (w, &qx) in p.iter_mut().zip(q) {
                *w = (*w - qx).max(0.0);
            }
        }
        None => {
            if let Some(w) = p.get_mut(draft as usize) {
                *w = 0.0;
            }
        }
    }
    let rest: f64 = p.iter().map(|&w| w as f64).sum();
    (draw(p, rest, rng), false)
}

/// The tokens `bad_words` ban after `output` (vLLM's rule): each word's
/// last token, where the output ends with the word's other tokens (a
/// one-token word always).
pub fn bad_word_bans<'a>(
    bad_words: &'a [Vec<u32>],
    output: &'a [u32],
) -> impl Iterator<Item = u32> + 'a {
    bad_words.iter().filter_map(move |w| {
        let (&last, prefix) = w.split_last()?;
        output.ends_with(prefix).then_some(last)
    })
}

/// Temperature, then softmax, in place. A scalar `exp` per vocabulary
/// entry cost about 6% of a 16-sequence decode step, hence the SIMD one.
fn to_probs(logits: &mut [f32], p: &SamplingParams) {
    let inv_t = 1.0 / p.temperature();
    if inv_t != 1.0 {
        for l in logits.iter_mut() {
            *l *= inv_t;
        }
    }
    ops::softmax_inplace(logits);
}

/// Draws a token from the weights `w`, which sum to `total`. A token of
/// weight 0 (masked out) is never chosen, even when the draw is exactly 0.
fn draw(w: &[f32], total: f64, rng: &mut StdRng) -> u32 {
    let mut u = rng.random::<f64>() * total;
    for (i, &x) in w.iter().enumerate() {
        u -= x as f64;
        if u <= 0.0 && x > 0.0 {
            return i as u32;
        }
    }
    argmax(w) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    const LOGITS: [f32; 6] = [2.0, 1.5, 0.3, -0.7, 1.1, -2.0];

    /// Frequencies of `draws` samples of `LOGITS` under `p`.
    fn frequencies(p: &SamplingParams, draws: usize) -> Vec<f64> {
        let (mut sampler, mut rng) = (Sampler::default(), StdRng::seed_from_u64(7));
        let mut counts = vec![0usize; LOGITS.len()];
        for _ in 0..draws {
            let mut logits = LOGITS;
            counts[sampler.sample_random(&mut logits, p, &mut rng) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    /// softmax(LOGITS / t) in f64, over the tokens `keep` allows.
    fn reference(t: f64, keep: impl Fn(usize) -> bool) -> Vec<f64> {
        let w: Vec<f64> = (0..LOGITS.len())
            .map(|i| {
                if keep(i) {
                    (LOGITS[i] as f64 / t).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|v| v / z).collect()
    }

    fn assert_close(got: &[f64], want: &[f64], draws: usize) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            // Five standard deviations of a binomial frequency.
            let tol = 5.0 * (w * (1.0 - w) / draws as f64).sqrt() + 1e-12;
            assert!(
                (g - w).abs() <= tol,
                "token {i}: frequency {g}, expected {w} ± {tol}"
            );
        }
    }

    #[test]
    fn temperature_sampling_draws_from_the_softmax() {
        let draws = 100_000;
        for t in [1.0f32, 0.6, 1.7] {
            let p = SamplingParams {
                temperature: Some(t),
                ..SamplingParams::default()
            };
            assert_close(
                &frequencies(&p, draws),
                &reference(t as f64, |_| true),
                draws,
            );
        }
    }

    /// Emits tokens as one verification position does: the draft drawn
    /// from `q` (or fixed), then kept or replaced by `accept_or_resample`.
    fn verified_frequencies(p: &[f32], q: Option<&[f32]>, fixed: u32, draws: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(11);
        let mut counts = vec![0usize; p.len()];
        for _ in 0..draws {
            let draft = match q {
                Some(q) => draw(q, q.iter().map(|&x| x as f64).sum(), &mut rng),
                None => fixed,
            };
            let mut row = p.to_vec();
            counts[accept_or_resample(&mut row, q, draft, &mut rng).0 as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn rejection_sampling_emits_the_target_distribution() {
        // p has zeros (a top-k cut) where q does not, q has mass where p
        // has none, and neither is proportional to the other.
        let p = [0.5f32, 0.3, 0.15, 0.05, 0.0, 0.0];
        let q = [0.1f32, 0.2, 0.3, 0.1, 0.25, 0.05];
        let draws = 200_000;
        let want: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        assert_close(&verified_frequencies(&p, Some(&q), 0, draws), &want, draws);
        // Drafts chosen outright (n-gram, argmax): any fixed draft.
        for fixed in [0, 2, 4] {
            assert_close(&verified_frequencies(&p, None, fixed, draws), &want, draws);
        }
    }

    #[test]
    fn tiny_temperatures_are_greedy_not_overflowed() {
        // 1/1e-7 times a logit overflows f32 (the softmax then turns to
        // NaN); below vLLM's 1e-5 the request is greedy instead.
        for t in [1e-7f32, 9e-6] {
            let p = SamplingParams {
                temperature: Some(t),
                ..SamplingParams::default()
            };
            assert!(p.is_greedy(), "{t}");
        }
        let p = SamplingParams {
            temperature: Some(2e-5),
            ..SamplingParams::default()
        };
        assert!(!p.is_greedy());
    }

    #[test]
    fn top_k_top_p_and_min_p_keep_only_their_candidates() {
        let draws = 50_000;
        let any = SamplingParams::default();
        // Tokens by probability: 0, 1, 4, 2, 3, 5 (p(0) ≈ 0.44, p(1) ≈ 0.27,
        // p(4) ≈ 0.18): top-k 2 keeps 0 and 1; a nucleus of 0.5 needs both;
        // min_p 0.3 keeps tokens with at least 0.3 × p(0), i.e. 0, 1 and 4.
        let cases: [(SamplingParams, &dyn Fn(usize) -> bool); 3] = [
            (
                SamplingParams {
                    top_k: Some(2),
                    ..any.clone()
                },
                &|i| i <= 1,
            ),
            (
                SamplingParams {
                    top_p: Some(0.5),
                    ..any.clone()
                },
                &|i| i <= 1,
            ),
            (
                SamplingParams {
                    min_p: Some(0.3),
                    ..any.clone()
                },
                &|i| matches!(i, 0 | 1 | 4),
            ),
        ];
        for (p, keep) in cases {
            assert_close(&frequencies(&p, draws), &reference(1.0, keep), draws);
        }
    }
}
