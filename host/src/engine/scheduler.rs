//! Decides, each step, which sequences run and how many of their tokens:
//! running sequences first (decodes and unfinished prefill chunks), then
//! waiting ones, within a token budget (`--max-num-batched-tokens`) and a
//! sequence cap (`--max-num-seqs`). When the KV pool runs dry it preempts by
//! recompute: the newest (or lowest-priority, or most over-share) running
//! sequence gives its blocks back and returns to the front of the queue.
//!
//! Under the `fair` policy (the default) tenants share the engine by weight
//! and priority class ([`crate::engine::fair_share`]); with one tenant it
//! schedules exactly as `fcfs` does.

use crate::engine::core_output::EngineCoreOutput;
use crate::engine::fair_share::{FairShare, TenantLoad};
use crate::engine::kv_cache::{KvCacheManager, PrefixHit, SHARED_OWNER};
use crate::engine::request::{FinishReason, Request, RequestStatus};
use crate::engine::runner_output::ModelRunnerOutput;
use crate::engine::scheduler_output::{BlockUpdate, NewRequest, ScheduledSeq, SchedulerOutput};
use crate::engine::spec_decode::SpecStats;
use crate::engine::structured_output::GuidedRow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// In which order waiting requests are admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// Weighted fair share between tenants, first come first served within
    /// each: see [`crate::engine::fair_share`].
    #[default]
    Fair,
    /// First come, first served, whoever the tenant.
    Fcfs,
    /// Lowest `priority` value first, then arrival order; preemption picks
    /// the highest value (least urgent) first.
    Priority,
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "fair" => Ok(SchedulingPolicy::Fair),
            "fcfs" => Ok(SchedulingPolicy::Fcfs),
            "priority" => Ok(SchedulingPolicy::Priority),
            other => {
                anyhow::bail!("--scheduling-policy '{other}' is not one of fair, fcfs, priority")
            }
        }
    }
}

/// The scheduler's limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Every prompt runs whole in one step or waits (an encoder's rows
    /// attend both ways over the whole prompt); no tenant prefill cap
    /// splits it either.
    pub whole_prompts: bool,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub policy: SchedulingPolicy,
    /// With a draft model: the drafts per sequence and step
    /// (`num_speculative_tokens`), whose K/V slots are reserved ahead for
    /// every sequence that may draft after its step; 0 otherwise.
    pub draft_lookahead: usize,
    /// No slots are reserved for drafts while more sequences than this
    /// run (`disable_by_batch_size`).
    pub draft_max_batch: usize,
    /// Distinct LoRA adapters that may run at once (`--max-loras`, the
    /// model's adapter slots); 0 without `--enable-lora`.
    pub max_loras: usize,
    /// Under `fair` with several tenants: the most prompt tokens one
    /// tenant's prefills add to a step (see [`Scheduler::prefill_cap`]);
    /// 0 for a quarter of `max_num_batched_tokens`.
    pub tenant_prefill_chunk: usize,
    /// Under `fair` with several tenants: the most tokens of any kind
    /// (decodes, drafts and prefill chunks together) one tenant of the
    /// smallest weight adds to a step (a tenant of twice that weight twice
    /// as many); its sequences beyond it take turns. 0 for no such bound.
    pub tenant_step_tokens: usize,
}

/// How long tenants count as contending after two last had work at once:
/// a calm tenant between two requests is still there, and the steps a
/// flood plans in that gap must stay short too.
const CONTENTION_MEMORY: std::time::Duration = std::time::Duration::from_secs(2);

/// The most prompt tokens a request that asked for prompt logprobs runs
/// in one step: each needs a vocabulary-wide row of logits (4 bytes a
/// token, so 256 rows of a 152k vocabulary take 155 MB).
pub const PROMPT_LOGPROBS_CHUNK: usize = 256;

/// The most tokens of `req` a step may run, within `budget`.
fn chunk_limit(req: &Request, budget: usize) -> usize {
    if req.prompt_logprobs_from().is_some() {
        budget.min(PROMPT_LOGPROBS_CHUNK)
    } else {
        budget
    }
}

/// One sequence's share of a step, with its logit rows counted: its
/// tokens from `start`, the last `num_drafts` of them drafts.
fn schedule_seq(req: &Request, start: usize, num_tokens: usize, num_drafts: usize) -> ScheduledSeq {
    let end = start + num_tokens - num_drafts;
    let sample = end == req.token_ids.len();
    let from = match req.prompt_logprobs_from() {
        // Position p scores prompt token p + 1.
        Some(p) if p < end && p + 1 < req.prompt_len => p.max(start),
        _ if sample => end - 1,
        _ => end,
    };
    ScheduledSeq {
        id: req.id,
        start,
        num_tokens,
        sample,
        logit_rows: end - from + num_drafts,
        num_drafts,
        lookahead: 0,
        admitted: false,
        blocks: None,
        state_slot: 0,
        restore_state: None,
        save_state: None,
    }
}

/// Owns the requests and the waiting and running queues.
pub struct Scheduler {
    config: SchedulerConfig,
    requests: HashMap<u64, Request>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    num_preemptions: u64,
    /// Every active tenant's running and waiting requests and virtual time,
    /// kept under every policy (metrics read it); only `fair` orders by it.
    fair: FairShare,
    /// Requests the runner knows that left since the last plan.
    finished: Vec<u64>,
    /// When two or more tenants last had work at once (`fair` only).
    contended_at: Option<std::time::Instant>,
    /// Prompt tokens each tenant's prefills got in the step being planned,
    /// while [`Scheduler::prefill_cap`] holds.
    prefill_taken: Vec<(Arc<str>, usize)>,
    /// The last step was one tenant's alone (see [`Scheduler::first_prefill_of`]).
    last_exclusive: bool,
    /// Tokens of any kind each tenant got in the step being planned, while
    /// [`SchedulerConfig::tenant_step_tokens`] bounds them.
    step_taken: Vec<(Arc<str>, usize)>,
    /// Running sequences that waited out a step at their tenant's bound:
    /// they go first among their tenant's next step (reused).
    turned_away: Vec<u64>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
            fair: FairShare::default(),
            finished: Vec::new(),
            contended_at: None,
            prefill_taken: Vec::new(),
            last_exclusive: false,
            step_taken: Vec::new(),
            turned_away: Vec::new(),
        }
    }

    /// Under contention, the tenant whose first tokens the next step is
    /// for alone, if any: a tenant strictly first in the serving order
    /// (fewest slots per weight, then least virtual time) with a prompt not
    /// yet through its first token. Its step carries no other tenant's
    /// rows, so its time to first token is the step in flight plus its own
    /// prefill, as if it were alone, not one shared with every decode and
    /// prefill chunk of a tenant that floods the server. Never two such
    /// steps in a row: the others' sequences wait at most every other step.
    fn first_prefill_of(&self) -> Option<Arc<str>> {
        // Alone now (the others idle between requests, contention still
        // remembered), a tenant has no one to be served before: its steps
        // stay within the bounds, so that the step in flight when another
        // tenant's request comes is short.
        if self.last_exclusive || self.fair.num_tenants() < 2 {
            return None;
        }
        let prefilling = |id: &u64| {
            self.requests
                .get(id)
                .filter(|r| r.num_computed < r.prompt_len)
                .map(|r| &r.tenant.name)
        };
        let candidate = self
            .waiting
            .iter()
            .chain(self.running.iter())
            .filter_map(prefilling)
            .min_by(|a, b| self.fair.key(a).compare(&self.fair.key(b)))?;
        self.fair.is_first(candidate).then(|| Arc::clone(candidate))
    }

    /// The most prompt tokens one tenant's prefills may add to the next
    /// step, or None for no limit beyond the step's budget.
    ///
    /// Fair share of sequence slots and virtual time decides *who* runs;
    /// this bounds what one tenant adds to a step that others wait on. A
    /// step runs as long as its tokens take, and a calm tenant's first
    /// token waits for the step in flight and then its own: if another
    /// tenant's long prompts filled them (a 512-token chunk per step), the
    /// calm tenant's time to first token would be several of its own
    /// prefills. So while tenants contend (two had work at once within
    /// [`CONTENTION_MEMORY`]), each tenant's prefills get at most
    /// `tenant_prefill_chunk` tokens a step; decodes are not limited (a
    /// tenant's share of them is its share of the slots). With one tenant
    /// nothing changes.
    fn prefill_cap(&mut self) -> Option<usize> {
        if self.config.policy != SchedulingPolicy::Fair {
            return None;
        }
        let now = std::time::Instant::now();
        if self.fair.num_tenants() > 1 {
            self.contended_at = Some(now);
        }
        let recent = self
            .contended_at
            .is_some_and(|t| now.duration_since(t) < CONTENTION_MEMORY);
        if !recent {
            return None;
        }
        let chunk = match self.config.tenant_prefill_chunk {
            0 => self.config.max_num_batched_tokens / 4,
            n => n,
        };
        Some(chunk.max(1))
    }

    /// Of `cap`, what `tenant`'s prefills may still add to this step.
    fn prefill_left(&self, cap: usize, tenant: &str) -> usize {
        cap.saturating_sub(taken_by(&self.prefill_taken, tenant))
    }

    fn take_prefill(&mut self, tenant: &Arc<str>, n: usize) {
        take(&mut self.prefill_taken, tenant, n);
    }

    /// The most tokens of any kind one tenant may add to the next step,
    /// while tenants contend and [`SchedulerConfig::tenant_step_tokens`]
    /// is set (see [`Scheduler::prefill_cap`], which says when they do).
    ///
    /// The prefill bound alone leaves a step in flight with every decode
    /// row of a tenant that keeps many streams open: a calm tenant's first
    /// token waits for that step, which at 32 streams is several times its
    /// own short prefill. Under this bound that tenant's streams decode in
    /// turns instead (those left out go first next step), so the step in
    /// flight is at most one bound per contending tenant.
    fn step_cap(&self, contended: bool) -> Option<usize> {
        match self.config.tenant_step_tokens {
            0 => None,
            n if contended => Some(n),
            _ => None,
        }
    }

    /// Of `cap` per unit of weight, what `tenant` may still add to this
    /// step. Scaling by weight keeps the weighted split of decode rows when
    /// every tenant has more streams than its bound.
    fn step_left(&self, cap: Option<usize>, tenant: &str) -> usize {
        match cap {
            Some(cap) => {
                let units = self.fair.weight_units(tenant);
                let own = ((cap as f64 * units) as usize).max(1);
                own.saturating_sub(taken_by(&self.step_taken, tenant))
            }
            None => usize::MAX,
        }
    }

    /// Reserves K/V slots ahead for the drafts of `speculator`'s draft
    /// model (see [`SchedulerConfig::draft_lookahead`]); none without one.
    pub fn set_draft_lookahead(
        &mut self,
        speculator: Option<&crate::engine::spec_decode::Speculator>,
    ) {
        self.config.draft_lookahead = speculator.map_or(0, |s| s.max_drafts());
        self.config.draft_max_batch = speculator.map_or(0, |s| s.max_batch());
    }

    /// Runs at most `max` distinct LoRA adapters at once (`--max-loras`).
    pub fn set_max_loras(&mut self, max: usize) {
        self.config.max_loras = max;
    }

    /// Queues a new request.
    pub fn add(&mut self, req: Request) {
        self.fair.arrived(&req.tenant);
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// The request with engine id `id`.
    pub fn get(&self, id: u64) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// The request with engine id `id`, mutably.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut Request> {
        self.requests.get_mut(&id)
    }

    /// Requests running now.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission (including preempted ones).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Every tenant with requests in the engine: how many run and wait.
    pub fn tenant_loads(&self) -> Vec<TenantLoad> {
        self.fair.loads()
    }

    /// Preemptions since start.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Removes a request, wherever it is, and frees its blocks at once.
    pub fn remove(
        &mut self,
        id: u64,
        reason: FinishReason,
        kv: &mut KvCacheManager,
    ) -> Option<Request> {
        let mut req = self.requests.remove(&id)?;
        let was_running = self.running.contains(&id);
        self.fair.left(&req.tenant.name, was_running);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        kv.free(id);
        if req.announced {
            self.finished.push(id);
        }
        req.status = RequestStatus::Finished(reason);
        Some(req)
    }

    /// Plans the next step into `out` (emptied first), allocating the KV
    /// slots it needs, and lends the matchers of its constrained sampling
    /// rows to `guided` (in row order) until
    /// [`Scheduler::update_from_output`] takes them back.
    pub fn schedule(
        &mut self,
        kv: &mut KvCacheManager,
        out: &mut SchedulerOutput,
        guided: &mut Vec<GuidedRow>,
    ) {
        out.clear();
        guided.clear();
        out.finished.append(&mut self.finished);
        let mut budget = self.config.max_num_batched_tokens;
        let prefill_cap = if self.config.whole_prompts {
            None
        } else {
            self.prefill_cap()
        };
        self.prefill_taken.clear();
        let exclusive = match prefill_cap {
            Some(_) => self.first_prefill_of(),
            None => None,
        };
        self.last_exclusive = exclusive.is_some();
        // A step of one tenant's alone keeps the prefill bound (others wait
        // on it too, and a tenant that lags in virtual time may have long
        // prompts) but not the step bound, which is there to make room
        // for others in the same step.
        let step_cap = self.step_cap(prefill_cap.is_some() && exclusive.is_none());
        self.step_taken.clear();
        self.turned_away.clear();
        // With one tenant the order is already fcfs order; skipping the
        // (allocating) stable sort keeps a decode step allocation-free.
        if self.config.policy == SchedulingPolicy::Fair && self.fair.num_tenants() > 1 {
            // The budget goes to the better class, then to the tenant with
            // the least virtual time; the sort is stable, so each tenant's
            // sequences keep their order (and one tenant keeps fcfs order).
            let (requests, fair) = (&self.requests, &self.fair);
            self.running.sort_by(|a, b| {
                let key = |id| {
                    requests
                        .get(id)
                        .map_or((0, 0.0), |r: &Request| fair.budget_order(&r.tenant.name))
                };
                let (ka, kb) = (key(a), key(b));
                ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
            });
        }
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            if exclusive.as_ref().is_some_and(|t| *t != req.tenant.name) {
                i += 1;
                continue;
            }
            let step_left = self.step_left(step_cap, &req.tenant.name);
            if step_left == 0 {
                // Its tenant has its part of this step: its turn is next.
                self.turned_away.push(id);
                i += 1;
                continue;
            }
            let mut num_new = (req.token_ids.len() - req.num_computed)
                .min(chunk_limit(req, budget))
                .min(step_left);
            if self.config.whole_prompts && num_new < req.token_ids.len() - req.num_computed {
                i += 1;
                continue;
            }
            // A prefill (more than the one token a decode runs) within its
            // tenant's part of the step, under contention.
            let prefill = num_new > 1;
            if let (true, Some(cap)) = (prefill, prefill_cap) {
                num_new = num_new.min(self.prefill_left(cap, &req.tenant.name));
            }
            if num_new == 0 {
                i += 1;
                continue;
            }
            if prefill && req.prompt_logprobs_from().is_none() {
                num_new = kv.checkpoint_chunk(req.num_computed, num_new, req.token_ids.len());
            }
            // A decode with drafts verifies them in the same step, within
            // the budget and the request's length limit.
            let mut num_drafts = if req.num_computed + 1 == req.token_ids.len() {
                req.num_drafts
                    .min(budget - 1)
                    .min(step_left - 1)
                    .min(req.max_len.saturating_sub(req.token_ids.len() + 1))
            } else {
                0
            };
            let scheduled = loop {
                let req = &self.requests[&id];
                let key = owned_key(kv, req);
                if kv.allocate(
                    id,
                    &req.token_ids,
                    key,
                    None,
                    req.num_computed,
                    num_new + num_drafts,
                ) {
                    break true;
                }
                if num_drafts > 0 {
                    // Short of blocks: give up the drafts before anyone's
                    // cache.
                    num_drafts = 0;
                    continue;
                }
                // A tenant at its KV-cache cap gets nothing from others'
                // blocks: it gives up one of its own requests.
                let victim = if kv.pool().at_cap(key.owner) {
                    self.pick_victim_of(i, &self.requests[&id].tenant.name)
                } else {
                    self.pick_victim(i)
                };
                self.preempt(victim, kv);
                out.preempted.push(victim);
                if victim == id {
                    break false;
                }
            };
            if !scheduled {
                // `id` preempted itself and left the running list at `i`.
                continue;
            }
            let lookahead = self.reserve_lookahead(id, num_new + num_drafts, kv);
            if prefill && prefill_cap.is_some() {
                let tenant = Arc::clone(&self.requests[&id].tenant.name);
                self.take_prefill(&tenant, num_new);
            }
            if step_cap.is_some() {
                let tenant = Arc::clone(&self.requests[&id].tenant.name);
                take(&mut self.step_taken, &tenant, num_new + num_drafts);
            }
            let req = &self.requests[&id];
            num_new += num_drafts;
            let mut seq = schedule_seq(req, req.num_computed, num_new, num_drafts);
            seq.lookahead = lookahead;
            out.seqs.push(seq);
            budget -= num_new;
            out.num_tokens += num_new;
            i += 1;
        }
        // A step that had to preempt is short of blocks: admitting new work
        // now would only preempt again.
        // Requests whose adapter has no slot while others hold them all:
        // they wait, and those behind them may run (back in the queue, in
        // order, once planning is done).
        let mut no_slot: Vec<u64> = Vec::new();
        if out.preempted.is_empty() {
            while budget > 0 {
                let Some(pos) = self.next_waiting() else {
                    break;
                };
                let id = self.waiting[pos];
                let Some(req) = self.requests.get(&id) else {
                    self.waiting.remove(pos);
                    continue;
                };
                if !self.lora_fits(req) || exclusive.as_ref().is_some_and(|t| *t != req.tenant.name)
                {
                    self.waiting.remove(pos);
                    no_slot.push(id);
                    continue;
                }
                if let Some(l) = &req.lora {
                    kv.name_lora(l.id, &l.name);
                }
                // Cached positions have no logits, so a request that wants
                // its prompt's logprobs computes the whole prompt.
                let key = owned_key(kv, req);
                let hit = if req.prompt_logprobs_from().is_some() {
                    PrefixHit::default()
                } else {
                    kv.lookup_prefix(&req.token_ids, key)
                };
                // The next block is being computed for another sequence
                // (a sibling sample, a shared system prompt): wait for it
                // rather than compute the same K/V twice.
                if kv.in_flight(&req.token_ids, key, &hit) {
                    break;
                }
                let cached = hit.num_tokens(kv.block_size());
                let step_left = self.step_left(step_cap, &req.tenant.name);
                if step_left == 0 {
                    self.waiting.remove(pos);
                    no_slot.push(id);
                    continue;
                }
                let mut num_new = (req.token_ids.len() - cached)
                    .min(chunk_limit(req, budget))
                    .min(step_left);
                if self.config.whole_prompts && num_new < req.token_ids.len() - cached {
                    // Whole next step (the budget is at least the longest
                    // prompt), in arrival order.
                    break;
                }
                if let (true, Some(cap)) = (num_new > 1, prefill_cap) {
                    num_new = num_new.min(self.prefill_left(cap, &req.tenant.name));
                    if num_new == 0 {
                        // Its tenant's prefills have their part of this
                        // step; other tenants' requests behind it may run.
                        self.waiting.remove(pos);
                        no_slot.push(id);
                        continue;
                    }
                }
                if req.prompt_logprobs_from().is_none() {
                    num_new = kv.checkpoint_chunk(cached, num_new, req.token_ids.len());
                }
                let admitted = self.running.len() < self.config.max_num_seqs
                    && kv.allocate(id, &req.token_ids, key, Some(hit), cached, num_new);
                if !admitted && key.owner != SHARED_OWNER && kv.pool().at_cap(key.owner) {
                    // Its tenant holds all its KV-cache cap allows: it
                    // waits for its own requests to finish, and the
                    // requests behind it, of other tenants, may run.
                    self.waiting.remove(pos);
                    no_slot.push(id);
                    continue;
                }
                if !admitted {
                    // Under fair share, a tenant below its share may take a
                    // slot (and its blocks) from one above it, then retry.
                    if self.config.policy == SchedulingPolicy::Fair
                        && self.take_slot_for(id, kv, out, &mut budget)
                    {
                        continue;
                    }
                    break;
                }
                let Some(req) = self.requests.get_mut(&id) else {
                    break;
                };
                if req.num_preemptions == 0 {
                    req.num_cached_prompt = cached;
                }
                req.num_computed = cached;
                req.status = RequestStatus::Running;
                req.first_scheduled_at
                    .get_or_insert_with(std::time::Instant::now);
                self.waiting.remove(pos);
                self.running.push(id);
                self.fair.admitted(&req.tenant.name);
                let tenant = Arc::clone(&req.tenant.name);
                if num_new > 1 && prefill_cap.is_some() {
                    self.take_prefill(&tenant, num_new);
                }
                if step_cap.is_some() {
                    take(&mut self.step_taken, &tenant, num_new);
                }
                let lookahead = self.reserve_lookahead(id, num_new, kv);
                let Some(req) = self.requests.get(&id) else {
                    break;
                };
                let mut seq = schedule_seq(req, cached, num_new, 0);
                seq.lookahead = lookahead;
                seq.admitted = true;
                out.seqs.push(seq);
                budget -= num_new;
                out.num_tokens += num_new;
            }
        }
        for &id in no_slot.iter().rev() {
            self.waiting.push_front(id);
        }
        if !self.turned_away.is_empty() {
            // Those left out this step lead their tenant's next (the sort
            // by tenant is stable), so a tenant's streams take turns.
            let away = &self.turned_away;
            self.running.sort_by_key(|id| !away.contains(id));
        }
        // Described once every block is allocated: preemption above takes
        // sequences out of the plan with their blocks, so these tables are
        // final. Each tenant's virtual time advances by what it got.
        let mut rows = 0;
        for s in &mut out.seqs {
            let Some(req) = self.requests.get_mut(&s.id) else {
                continue;
            };
            self.fair.charge(&req.tenant.name, s.num_tokens);
            if !req.announced {
                req.announced = true;
                out.new_requests.push(NewRequest {
                    id: req.id,
                    prompt_ids: req.token_ids[..req.prompt_len].to_vec(),
                    params: req.params.clone(),
                    seed: req.seed,
                    eos_ids: req.eos_ids.clone(),
                    max_len: req.max_len,
                    prompt_kernel: req.prompt_kernel,
                    structured: req.grammar.is_some(),
                    lora: req.lora.clone(),
                    pooling: req.pooling,
                });
            }
            s.state_slot = kv.state_slot(s.id);
            s.restore_state = kv.take_state_restore(s.id);
            // Prompt chunks that end on a block boundary leave the state
            // there for later prefix-cache hits.
            let end = s.start + s.num_tokens;
            if s.num_drafts == 0 && end <= req.prompt_len {
                s.save_state = kv.plan_state_checkpoint(s.id, end);
            }
            let table = kv.block_table(s.id);
            if req.blocks_shrunk || table.len() != req.blocks_sent {
                s.blocks = Some(BlockUpdate {
                    keep: req.blocks_sent,
                    from: out.new_blocks.len(),
                    len: table.len() - req.blocks_sent,
                });
                out.new_blocks.extend_from_slice(&table[req.blocks_sent..]);
                req.blocks_sent = table.len();
                req.blocks_shrunk = false;
            }
            rows += s.logit_rows;
            // Constrained rows: their matchers leave the requests for the
            // step. A request still reasoning samples freely; its grammar
            // waits.
            if s.sample && req.reasoning_end.is_none() {
                if let Some(matcher) = req.grammar.take() {
                    guided.push(GuidedRow {
                        // A sequence's sampling row is its last.
                        row: rows - 1,
                        id: s.id,
                        matcher,
                        mask: None,
                    });
                }
            }
        }
        out.num_running = self.running.len();
    }

    /// The adapters of the running and the waiting requests, by name.
    pub fn lora_load(&self) -> (Vec<String>, Vec<String>) {
        let names = |ids: &mut dyn Iterator<Item = &u64>| {
            let mut out: Vec<String> = Vec::new();
            for r in ids.filter_map(|id| self.requests.get(id)) {
                if let Some(l) = &r.lora {
                    if !out.contains(&l.name) {
                        out.push(l.name.clone());
                    }
                }
            }
            out
        };
        (
            names(&mut self.running.iter()),
            names(&mut self.waiting.iter()),
        )
    }

    /// Whether `req` may run beside the running requests: it has no
    /// adapter, or its adapter already runs, or a slot is free.
    fn lora_fits(&self, req: &Request) -> bool {
        let Some(lora) = &req.lora else {
            return true;
        };
        let mut running: Vec<u32> = Vec::new();
        for r in self.running.iter().filter_map(|id| self.requests.get(id)) {
            if let Some(l) = &r.lora {
                if l.id == lora.id {
                    return true;
                }
                if !running.contains(&l.id) {
                    running.push(l.id);
                }
            }
        }
        running.len() < self.config.max_loras
    }

    /// Reserves K/V slots past `num_scheduled` new tokens of request `id`
    /// for the drafts a draft model may propose after the step (when it
    /// samples, may be drafted for, and few enough sequences run), if the
    /// pool has them; preempts nobody for them. Returns how many.
    fn reserve_lookahead(&self, id: u64, num_scheduled: usize, kv: &mut KvCacheManager) -> usize {
        let k = self.config.draft_lookahead;
        let Some(req) = self.requests.get(&id) else {
            return 0;
        };
        let samples = req.num_computed + num_scheduled >= req.token_ids.len();
        if k == 0
            || !samples
            || self.running.len() > self.config.draft_max_batch
            || !req.may_draft_after_step()
        {
            return 0;
        }
        let from = req.num_computed + num_scheduled;
        let key = owned_key(kv, req);
        if kv.allocate(id, &req.token_ids, key, None, from, k) {
            k
        } else {
            0
        }
    }

    /// Records that a step ran: the first `num_computed` tokens of the
    /// sequence are now in the cache, and the blocks they complete become
    /// findable by prefix.
    fn mark_computed(&mut self, id: u64, num_computed: usize, kv: &mut KvCacheManager) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.num_computed = num_computed;
            kv.commit(id, &r.token_ids, r.num_computed);
        }
    }

    /// Updates the requests from what the step sampled (`out`, from the
    /// model runner): their tokens are computed, prompt scores recorded,
    /// each sampled id goes through the output processor (and a grammar's
    /// matcher, from `guided`, which go back to their requests), drafts
    /// are settled (the verified ones stay computed, the rest give their
    /// slots back, the new ones keep theirs), and finished requests leave,
    /// freeing their blocks. Pushes the step's outputs to `outputs`;
    /// returns how many tokens were generated.
    pub fn update_from_output(
        &mut self,
        plan: &SchedulerOutput,
        out: &mut ModelRunnerOutput,
        guided: &mut Vec<GuidedRow>,
        kv: &mut KvCacheManager,
        outputs: &mut Vec<EngineCoreOutput>,
        spec: &mut SpecStats,
    ) -> u64 {
        for p in out.prompt_logprobs.drain(..) {
            if let Some(req) = self.requests.get_mut(&p.id) {
                req.record_prompt_logprob(p.pos, p.score);
            }
        }
        let mut generated = 0;
        let mut next_guided = 0;
        for (i, s) in plan.seqs.iter().enumerate() {
            let computed = s.start + s.num_tokens - s.num_drafts;
            if !s.sample {
                self.mark_computed(s.id, computed, kv);
                continue;
            }
            let mut guide = None;
            if guided.get(next_guided).is_some_and(|g| g.id == s.id) {
                guide = Some(&mut guided[next_guided]);
                next_guided += 1;
            }
            if let Some(e) = out.seqs.get_mut(i).and_then(|o| o.failure.take()) {
                self.mark_computed(s.id, computed, kv);
                self.abort_guided(s.id, &e, kv, outputs);
                continue;
            }
            let sampled = out.sampled(i).len();
            // The drafts the target agreed with: every sampled id but the
            // last (its own token after them) confirms one.
            let accepted = sampled.saturating_sub(1).min(s.num_drafts);
            // Their K/V was written by this step with the right tokens, so
            // they count as computed; the rejected drafts' slots go back.
            self.mark_computed(s.id, computed + accepted, kv);
            // The runner's new drafts: a draft model wrote the K/V of all
            // but the last into the slots reserved for them.
            let num_drafts = out.seqs.get(i).map_or(0, |o| o.num_drafts);
            let reserved = if s.lookahead > 0 { num_drafts } else { 0 };
            // Blocks beyond held rejected drafts (or slots reserved for
            // drafts that were then not made).
            kv.truncate(s.id, computed + accepted + reserved);
            if s.num_drafts > 0 {
                spec.record(s.num_drafts, accepted);
            }
            let held = kv.block_table(s.id).len();
            let Some(req) = self.requests.get_mut(&s.id) else {
                continue;
            };
            req.num_drafts = num_drafts;
            if held < req.blocks_sent {
                req.blocks_sent = held;
                req.blocks_shrunk = true;
            }
            if sampled == 0 {
                // Nothing was left to generate (max_tokens 0): the prompt
                // ran and was scored.
                let mut done = EngineCoreOutput::prompt_only(req);
                if req.pooling {
                    done.pooled = out.take_pooled(s.id);
                    if done.pooled.is_none() {
                        // The runner pools every pooling row that reaches
                        // its end; a missing vector is a bug, reported to
                        // the client rather than answered with nothing.
                        done.finish_reason = Some(FinishReason::Abort);
                    }
                }
                self.remove(s.id, FinishReason::Length, kv);
                outputs.push(done);
                continue;
            }
            let mut emitted: Option<EngineCoreOutput> = None;
            let mut failed = None;
            let mut appended = 0usize;
            for j in 0..sampled {
                let token = out.sampled(i)[j];
                let mut complete = false;
                if let Some(g) = guide.as_deref_mut() {
                    if let Err(e) = g.matcher.consume(token) {
                        failed = Some(e);
                        break;
                    }
                    complete = g.matcher.is_complete();
                }
                generated += 1;
                appended += 1;
                let logprob = out.take_logprob(i, j);
                let step = EngineCoreOutput::token(req, token, logprob, complete);
                // The reasoning ends with its end tokens; the grammar, if
                // any, takes over at the next token.
                if let Some(end) = &req.reasoning_end {
                    if req.token_ids[req.prompt_len..].ends_with(end) {
                        req.reasoning_end = None;
                    }
                }
                let finished = step.finish_reason.is_some();
                match &mut emitted {
                    None => emitted = Some(step),
                    Some(e) => e.append(step),
                }
                if finished {
                    // A stop among verified drafts ends the output there.
                    break;
                }
            }
            // Every token this step appended but the target's own was an
            // accepted draft (fewer when a stop cut the drafts short).
            req.num_spec_accepted += appended.saturating_sub(1).min(accepted);
            if let Some(e) = &mut emitted {
                e.num_spec_accepted = req.num_spec_accepted;
            }
            if let Some(e) = failed {
                self.abort_guided(s.id, &e, kv, outputs);
                continue;
            }
            let Some(done) = emitted else {
                continue;
            };
            if let Some(reason) = done.finish_reason {
                self.remove(s.id, reason, kv);
            }
            outputs.push(done);
        }
        // Matchers go back to the requests that are still running.
        for g in guided.drain(..) {
            if let Some(req) = self.requests.get_mut(&g.id) {
                req.grammar = Some(g.matcher);
            }
        }
        generated
    }

    /// Ends a request that cannot be sampled on: its grammar cannot go on
    /// (it is too complex, or allows nothing here), or its grammar,
    /// allowed token ids and bans together leave no token, rather than
    /// emit output that breaks them.
    fn abort_guided(
        &mut self,
        id: u64,
        error: &str,
        kv: &mut KvCacheManager,
        outputs: &mut Vec<EngineCoreOutput>,
    ) {
        if let Some(req) = self.remove(id, FinishReason::Abort, kv) {
            // One line: llguidance's errors carry its whole state.
            tracing::warn!(
                request = %req.external_id,
                "no token can be sampled (grammar, allowed_token_ids or bans), aborting the request: {}",
                error.lines().next().unwrap_or("")
            );
            outputs.push(EngineCoreOutput::aborted(req));
        }
    }

    fn next_waiting(&self) -> Option<usize> {
        match self.config.policy {
            SchedulingPolicy::Fcfs => (!self.waiting.is_empty()).then_some(0),
            SchedulingPolicy::Fair => self.next_waiting_fair(),
            SchedulingPolicy::Priority => self
                .waiting
                .iter()
                .enumerate()
                .min_by_key(|(_, id)| self.requests.get(id).map(|r| (r.priority, r.arrival)))
                .map(|(i, _)| i),
        }
    }

    /// The first waiting request of the tenant served next: the best
    /// class, then the fewest running sequences per weight, then the least
    /// virtual time. Within a tenant, queue order (so preempted requests
    /// come back first).
    fn next_waiting_fair(&self) -> Option<usize> {
        if self.fair.num_tenants() <= 1 {
            return (!self.waiting.is_empty()).then_some(0);
        }
        let mut seen: Vec<&str> = Vec::new();
        let mut best: Option<(usize, crate::engine::fair_share::ServeKey)> = None;
        for (pos, id) in self.waiting.iter().enumerate() {
            let Some(req) = self.requests.get(id) else {
                // A stale id: the caller drops it.
                return Some(pos);
            };
            let name = &*req.tenant.name;
            if seen.contains(&name) {
                continue;
            }
            seen.push(name);
            let key = self.fair.key(name);
            if best.is_none_or(|(_, b)| key.compare(&b).is_lt()) {
                best = Some((pos, key));
            }
            if seen.len() == self.fair.num_tenants() {
                break;
            }
        }
        best.map(|(pos, _)| pos)
    }

    /// Makes room for waiting request `id` under fair share: preempts the
    /// newest running sequence of the tenant furthest over its share, if
    /// [`FairShare::may_take_from`] allows it. A victim already planned
    /// this step leaves the plan and gives its tokens back to the budget.
    /// Returns whether a sequence was preempted.
    fn take_slot_for(
        &mut self,
        id: u64,
        kv: &mut KvCacheManager,
        out: &mut SchedulerOutput,
        budget: &mut usize,
    ) -> bool {
        let Some(taker) = self.requests.get(&id).map(|r| r.tenant.name.clone()) else {
            return false;
        };
        let holder = self
            .running
            .iter()
            .filter_map(|r| self.requests.get(r))
            .map(|r| &r.tenant.name)
            .filter(|h| self.fair.may_take_from(&taker, h))
            .max_by(|a, b| self.fair.key(a).compare(&self.fair.key(b)))
            .cloned();
        let Some(holder) = holder else {
            return false;
        };
        let Some(&victim) = self.running.iter().rev().find(|r| {
            self.requests
                .get(r)
                .is_some_and(|q| q.tenant.name == holder)
        }) else {
            return false;
        };
        if let Some(at) = out.seqs.iter().position(|s| s.id == victim) {
            let s = out.seqs.remove(at);
            *budget += s.num_tokens;
            out.num_tokens -= s.num_tokens;
        }
        self.preempt(victim, kv);
        out.preempted.push(victim);
        true
    }

    /// The running request to preempt: the last admitted (FCFS), the least
    /// urgent (priority), or the last of the tenant furthest over its share
    /// (fair). Requests before `first` were already given slots this step
    /// and are not candidates.
    fn pick_victim(&self, first: usize) -> u64 {
        let candidates = &self.running[first..];
        match self.config.policy {
            SchedulingPolicy::Fcfs => *candidates.last().expect("the current request is running"),
            SchedulingPolicy::Fair => {
                let tenant_key =
                    |id: &u64| self.requests.get(id).map(|r| self.fair.key(&r.tenant.name));
                // max_by keeps the last of equal keys: the tenant's newest.
                *candidates
                    .iter()
                    .max_by(|a, b| match (tenant_key(a), tenant_key(b)) {
                        (Some(ka), Some(kb)) => ka.compare(&kb),
                        (a, b) => a.is_some().cmp(&b.is_some()),
                    })
                    .expect("the current request is running")
            }
            SchedulingPolicy::Priority => *candidates
                .iter()
                .max_by_key(|id| self.requests.get(id).map(|r| (r.priority, r.arrival)))
                .expect("the current request is running"),
        }
    }

    /// The newest of `tenant`'s requests from the running list's `first`
    /// on (that at `first` is one of them).
    fn pick_victim_of(&self, first: usize, tenant: &str) -> u64 {
        let of_tenant = |id: &&u64| {
            self.requests
                .get(id)
                .is_some_and(|r| &*r.tenant.name == tenant)
        };
        *self.running[first..]
            .iter()
            .rfind(of_tenant)
            .unwrap_or(&self.running[first])
    }

    fn preempt(&mut self, id: u64, kv: &mut KvCacheManager) {
        kv.free(id);
        self.running.retain(|&r| r != id);
        if let Some(r) = self.requests.get_mut(&id) {
            self.fair.preempted(&r.tenant.name);
            r.num_computed = 0;
            r.num_drafts = 0;
            r.blocks_sent = 0;
            r.blocks_shrunk = false;
            r.status = RequestStatus::Waiting;
            r.num_preemptions += 1;
        }
        self.waiting.push_front(id);
        self.num_preemptions += 1;
    }

    /// Ids of the requests in the running queue, in order.
    pub fn running_ids(&self) -> &[u64] {
        &self.running
    }
}

/// What `tenant` has taken of a step, by `taken`'s count.
fn taken_by(taken: &[(Arc<str>, usize)], tenant: &str) -> usize {
    taken
        .iter()
        .find(|(t, _)| &**t == tenant)
        .map_or(0, |(_, n)| *n)
}

/// Counts `n` more tokens of a step for `tenant`.
fn take(taken: &mut Vec<(Arc<str>, usize)>, tenant: &Arc<str>, n: usize) {
    match taken.iter_mut().find(|(t, _)| t == tenant) {
        Some((_, t)) => *t += n,
        None => taken.push((Arc::clone(tenant), n)),
    }
}

/// `req`'s cache key, its blocks counted for the pool owner its tenant's
/// KV-cache share makes it (see [`KvCacheManager::owner`]).
fn owned_key(kv: &mut KvCacheManager, req: &Request) -> crate::engine::kv_cache::CacheKey {
    let mut key = req.cache_key();
    key.owner = kv.owner(&req.tenant);
    key
}
