//! The model runner: lays a step's plan out as one flattened batch (tokens,
//! positions, slot mapping, block tables), runs the model once over it, and
//! hands back the logits of the rows that sample.

use crate::engine::kv_cache::{KvCache, KvCacheManager};
use crate::engine::models::{BatchInput, LlamaModel, Workspace};
use crate::engine::scheduler::{Scheduler, SchedulerOutput};
use pagoda_accel::ops::AttnSeq;
use pagoda_accel::CpuContext;

/// Runs the model on one device context over its KV cache.
pub struct ModelRunner {
    model: LlamaModel,
    ctx: CpuContext,
    kv: KvCache,
    ws: Workspace,
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    logit_rows: Vec<usize>,
    prompt_rows: Vec<bool>,
    /// Kept empty between steps; only its capacity is reused (see `execute`).
    attn_seqs: Vec<AttnSeq<'static>>,
    logits: Vec<f32>,
}

impl ModelRunner {
    /// A runner for `model` over the cache `kv`.
    pub fn new(model: LlamaModel, ctx: CpuContext, kv: KvCache) -> ModelRunner {
        ModelRunner {
            model,
            ctx,
            kv,
            ws: Workspace::default(),
            tokens: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            logit_rows: Vec::new(),
            prompt_rows: Vec::new(),
            attn_seqs: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// The model being run.
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    /// The device context.
    pub fn context(&self) -> &CpuContext {
        &self.ctx
    }

    /// Runs the step planned in `plan`. Returns the logits of the sampling
    /// sequences, one `vocab`-wide row each, in plan order.
    pub fn execute(
        &mut self,
        plan: &SchedulerOutput,
        sched: &Scheduler,
        kvm: &KvCacheManager,
    ) -> &mut [f32] {
        let bs = kvm.block_size();
        self.tokens.clear();
        self.positions.clear();
        self.slots.clear();
        self.logit_rows.clear();
        self.prompt_rows.clear();
        let mut seqs = std::mem::take(&mut self.attn_seqs);
        seqs.clear();
        // SAFETY: `seqs` is empty, so changing the lifetime parameter of its
        // element type reinterprets no element; this only lets a step reuse
        // the buffer's capacity instead of allocating a new one. It is
        // cleared again before being stored back below.
        let mut seqs: Vec<AttnSeq<'_>> =
            unsafe { std::mem::transmute::<Vec<AttnSeq<'static>>, Vec<AttnSeq<'_>>>(seqs) };
        for s in &plan.seqs {
            let Some(req) = sched.get(s.id) else { continue };
            let table = kvm.block_table(s.id);
            let q_start = self.tokens.len();
            for p in s.start..s.start + s.num_tokens {
                self.tokens.push(req.token_ids[p]);
                self.positions.push(p as u32);
                self.slots.push(table[p / bs] * bs as u32 + (p % bs) as u32);
                self.prompt_rows
                    .push(req.prompt_kernel && p < req.prompt_len);
            }
            if s.sample {
                self.logit_rows.push(self.tokens.len() - 1);
            }
            seqs.push(AttnSeq {
                q_start,
                q_len: s.num_tokens,
                ctx_len: s.start + s.num_tokens,
                block_table: table,
            });
        }
        let vocab = self.model.config().vocab_size;
        let need = self.logit_rows.len() * vocab;
        if self.logits.len() < need {
            self.logits.resize(need, 0.0);
        }
        let input = BatchInput {
            tokens: &self.tokens,
            positions: &self.positions,
            slot_mapping: &self.slots,
            seqs: &seqs,
            logit_rows: &self.logit_rows,
            prompt_rows: &self.prompt_rows,
        };
        if !self.tokens.is_empty() {
            self.model.forward(
                &self.ctx,
                &input,
                &mut self.kv,
                &mut self.ws,
                &mut self.logits[..need],
            );
        }
        seqs.clear();
        // SAFETY: empty again; see above.
        self.attn_seqs =
            unsafe { std::mem::transmute::<Vec<AttnSeq<'_>>, Vec<AttnSeq<'static>>>(seqs) };
        &mut self.logits[..need]
    }
}
