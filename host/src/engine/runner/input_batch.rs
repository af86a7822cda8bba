//! The runner's persistent batch (vLLM v1's `InputBatch`): one row per
//! running request, holding what sampling needs for the request's whole
//! life (its parameters, its seeded random stream, the token counts the
//! penalties read, its drafts) and what laying a step out needs (its tokens
//! and block table). It changes only by what a [`SchedulerOutput`] says:
//! rows are added for new requests, parked for preempted ones (which keep
//! their random stream and tokens, so preemption changes no sample),
//! removed (and the rows condensed) for finished ones, and tables patched
//! where blocks changed. A long-running request costs the host nothing per
//! step beyond its row.
//!
//! A row's index is also its slot for per-row device state: the grammar
//! bitmask row. A hybrid model's recurrent-state slot is not the row: the
//! KV-cache manager hands it out with the blocks, so it survives the rows
//! condensing, and each step carries it ([`StepBatch::state_slots`]).

use super::lora_slots::LoraSlots;
use crate::engine::request::SamplingParams;
use crate::engine::sampler::{bad_word_bans, SampleRow};
use crate::engine::scheduler_output::{ScheduledSeq, SchedulerOutput};
use crate::engine::spec_decode::SpecState;
use pagoda_accel::backend::NO_LORA;
use pagoda_accel::ops::sample::{RowSampling, SamplingMetadata};
use pagoda_accel::StepBatch;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// One request as the runner keeps it.
pub struct RequestState {
    pub id: u64,
    /// Prompt followed by every token sampled for it.
    pub token_ids: Vec<u32>,
    pub prompt_len: usize,
    /// Generation ends at this total length (prompt + output).
    pub max_len: usize,
    pub params: SamplingParams,
    /// Ids banned until `min_tokens` are out: EOS (unless ignored).
    pub eos_ids: Vec<u32>,
    /// Its own random stream: seeded requests sample the same whatever
    /// else is in the batch.
    pub rng: StdRng,
    /// How often each token occurs in the output, for the penalties.
    pub output_counts: HashMap<u32, u32>,
    /// Whether its prompt positions run on the prompt kernel.
    pub prompt_kernel: bool,
    /// Whether it follows a grammar (never drafted for).
    pub structured: bool,
    /// Its block table, as the scheduler last sent it.
    pub block_table: Vec<u32>,
    /// Speculative decoding: its drafts and how they have fared.
    pub spec: SpecState,
    /// The LoRA adapter its tokens run with, if any.
    pub lora: Option<std::sync::Arc<crate::engine::lora::LoadedLora>>,
    /// A pooling request (see [`crate::engine::pooling`]).
    pub pooling: bool,
}

impl RequestState {
    /// Tokens generated so far.
    pub fn num_output(&self) -> usize {
        self.token_ids.len() - self.prompt_len
    }

    /// What the sampler reads of it (and its random stream), beside its
    /// drafts.
    pub fn split(&mut self) -> (SampleRow<'_>, &SpecState) {
        let num_output = self.num_output();
        (
            SampleRow {
                params: &self.params,
                token_ids: &self.token_ids,
                num_output,
                output_counts: &self.output_counts,
                eos_ids: &self.eos_ids,
                rng: &mut self.rng,
            },
            &self.spec,
        )
    }

    /// Adds its next token's sampling to `meta` as a row reading logit row
    /// `logit_row`, through the grammar mask `mask` if it has one: its
    /// parameters, the processors' token lists as they stand now (bad
    /// words matched against the output's tail, EOS and stop ids banned
    /// until `min_tokens`), and, unless greedy, the uniform its draw
    /// takes, drawn now from its random stream (sampling draws nothing
    /// else from it, so this is the number the host sampler would draw).
    pub fn push_sampling(
        &mut self,
        meta: &mut SamplingMetadata,
        logit_row: usize,
        mask: Option<&[u32]>,
    ) {
        let p = &self.params;
        let greedy = p.is_greedy();
        meta.push_row(RowSampling {
            logit_row: logit_row as u32,
            greedy,
            temperature: p.temperature(),
            top_k: p.top_k().max(0) as u32,
            top_p: p.top_p(),
            min_p: p.min_p(),
            uniform: if greedy {
                0.0
            } else {
                self.rng.random::<f64>()
            },
            logprobs: p.logprobs.map(|k| k as u32),
            repetition_penalty: p.repetition_penalty(),
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
        });
        if p.repetition_penalty() != 1.0 {
            meta.penalize(&self.token_ids);
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                meta.count_output(t, c);
            }
        }
        for &(t, b) in &p.logit_bias {
            meta.bias(t, b);
        }
        if let Some(allowed) = &p.allowed_token_ids {
            meta.allow(allowed);
        }
        let output = &self.token_ids[self.prompt_len..];
        for t in bad_word_bans(&p.bad_words_token_ids, output) {
            meta.ban(t);
        }
        if self.num_output() < p.min_tokens {
            for &t in self.eos_ids.iter().chain(&p.stop_token_ids) {
                meta.ban(t);
            }
        }
        if let Some(words) = mask {
            meta.mask(words);
        }
    }

    /// Appends a token sampled for it.
    pub fn append(&mut self, token: u32) {
        self.token_ids.push(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// Whether drafts may be proposed for it now: its sampling depends on
    /// nothing a draft would change mid-step (no grammar, no penalties or
    /// bad words over the output so far, no EOS ban still to lift).
    pub fn may_speculate(&self) -> bool {
        let p = &self.params;
        !self.structured
            && p.bad_words_token_ids.is_empty()
            && p.repetition_penalty() == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && self.num_output() >= p.min_tokens
    }
}

/// The runner's requests: the rows of running ones, and the parked.
#[derive(Default)]
pub struct InputBatch {
    rows: Vec<RequestState>,
    /// Request id → row.
    index: HashMap<u64, usize>,
    /// Preempted requests, until they run again or finish.
    parked: HashMap<u64, RequestState>,
    /// A sequence's last tokens and its drafts, laid out for the batch.
    scratch: Vec<u32>,
}

impl InputBatch {
    /// Applies what the scheduler decided: new requests get rows,
    /// preempted ones are parked without their blocks or drafts, finished
    /// ones leave (the last row fills the hole), parked ones that run again
    /// come back, and block tables take their changes.
    pub fn update(&mut self, plan: &SchedulerOutput) {
        for &id in &plan.finished {
            self.remove(id);
            self.parked.remove(&id);
        }
        for &id in &plan.preempted {
            if let Some(mut r) = self.remove(id) {
                r.block_table.clear();
                r.spec.preempted();
                self.parked.insert(id, r);
            }
        }
        for n in &plan.new_requests {
            let state = RequestState {
                id: n.id,
                token_ids: n.prompt_ids.clone(),
                prompt_len: n.prompt_ids.len(),
                max_len: n.max_len,
                params: n.params.clone(),
                eos_ids: n.eos_ids.clone(),
                rng: match n.seed {
                    Some(s) => StdRng::seed_from_u64(s),
                    None => StdRng::from_os_rng(),
                },
                output_counts: HashMap::new(),
                prompt_kernel: n.prompt_kernel,
                structured: n.structured,
                block_table: Vec::new(),
                spec: SpecState::default(),
                lora: n.lora.clone(),
                pooling: n.pooling,
            };
            self.insert(state);
        }
        for s in &plan.seqs {
            if let Some(r) = self.parked.remove(&s.id) {
                self.insert(r);
            }
            if s.admitted {
                if let Some(r) = self.get_mut(s.id) {
                    // What it found cached counts as the draft model's too
                    // (cached blocks were computed by both models).
                    r.spec.draft_computed = s.start;
                }
            }
            if let (Some(u), Some(&row)) = (s.blocks, self.index.get(&s.id)) {
                let table = &mut self.rows[row].block_table;
                table.truncate(u.keep);
                table.extend_from_slice(&plan.new_blocks[u.from..u.from + u.len]);
            }
        }
    }

    fn insert(&mut self, r: RequestState) {
        self.index.insert(r.id, self.rows.len());
        self.rows.push(r);
    }

    /// Takes request `id`'s row out, moving the last row into its place.
    fn remove(&mut self, id: u64) -> Option<RequestState> {
        let row = self.index.remove(&id)?;
        let r = self.rows.swap_remove(row);
        if let Some(moved) = self.rows.get(row) {
            self.index.insert(moved.id, row);
        }
        Some(r)
    }

    /// The row of request `id`.
    pub fn row(&self, id: u64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// Request `id`, if it has a row.
    pub fn get(&self, id: u64) -> Option<&RequestState> {
        self.rows.get(*self.index.get(&id)?)
    }

    /// Request `id`, mutably, if it has a row.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut RequestState> {
        self.rows.get_mut(*self.index.get(&id)?)
    }

    /// The request in row `row`, mutably.
    pub fn row_mut(&mut self, row: usize) -> &mut RequestState {
        &mut self.rows[row]
    }

    /// Rows in use.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// Lays the step's sequences out for the device, in plan order: each
    /// sequence's scheduled tokens (its drafts last), positions, KV slots,
    /// block table and logit rows.
    pub fn lay_out(
        &mut self,
        seqs: &[ScheduledSeq],
        block_size: usize,
        loras: &LoraSlots,
        batch: &mut StepBatch,
    ) {
        batch.clear();
        // Adapter slots per token, only for a step that has adapters.
        let any_lora = seqs.iter().any(|s| {
            self.index
                .get(&s.id)
                .is_some_and(|&row| self.rows[row].lora.is_some())
        });
        for s in seqs {
            let Some(&row) = self.index.get(&s.id) else {
                continue;
            };
            let r = &self.rows[row];
            let prompt_kernel_until = if r.prompt_kernel { r.prompt_len } else { 0 };
            let real = s.num_tokens - s.num_drafts;
            let tokens = if s.num_drafts == 0 {
                &r.token_ids[s.start..s.start + real]
            } else {
                self.scratch.clear();
                self.scratch
                    .extend_from_slice(&r.token_ids[s.start..s.start + real]);
                self.scratch
                    .extend_from_slice(&r.spec.drafts[..s.num_drafts]);
                &self.scratch[..]
            };
            batch.push_seq(
                tokens,
                s.start,
                &r.block_table,
                block_size,
                prompt_kernel_until,
                s.logit_rows,
            );
            batch.state_slots.push(s.state_slot);
            if any_lora {
                let slot = r
                    .lora
                    .as_ref()
                    .and_then(|l| loras.slot_of(l.id))
                    .unwrap_or(NO_LORA);
                let n = batch.tokens.len();
                batch.lora_slots.resize(n, slot);
            }
        }
    }
}
