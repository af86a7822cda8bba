//! Maps requests to block tables over one [`BlockPool`], and reuses cached
//! blocks for prompts that share a prefix.
//!
//! # The prefix-cache invariant
//!
//! A block becomes findable by prefix only once every token in it has been
//! computed: its K/V written by a step that ran. [`KvCacheManager::allocate`]
//! hands out slots for a step that has not run yet, and never caches;
//! [`KvCacheManager::commit`], called after the step, is the one place
//! where blocks enter the prefix cache. So a sequence that is preempted or
//! aborted before its step runs, or whose tokens are never computed (the
//! token sampled as `max_tokens` is reached, or later a rejected draft),
//! leaves nothing findable behind: its blocks return to the free queue
//! with only the hashes of what was computed. The block pool checks the
//! same rule from below: it accepts a hash only for a block whose every
//! slot was reported written.
//!
//! # Sliding windows
//!
//! In a model whose every layer attends over a window of `w` positions
//! (Mistral v0.1), a sequence's blocks that lie wholly below what its next
//! query can read ([`pagoda_accel::ops::window_reads_from`]) are given back
//! to the pool as soon as a step commits past them, as vLLM's sliding-window
//! manager does: a long sequence then holds about `w` positions of blocks,
//! not its whole length. The block table keeps their ids (no later query
//! reads them); [`KvCacheManager::free`] releases only the rest. Released
//! blocks were computed and keep their hashes, so other requests can still
//! find them in the prefix cache until they are evicted.
//!
//! # Recurrent-state slots (hybrid models)
//!
//! A hybrid model's linear-attention layers (Gated DeltaNet) keep one
//! fixed-size state per sequence instead of K/V per token (vLLM's hybrid
//! KV-cache manager). With [`KvCacheManager::with_state_slots`] the manager
//! also hands each sequence one of that many state slots when it first
//! gets blocks, and takes it back in [`KvCacheManager::free`] (finish,
//! abort, preemption): a sequence that cannot get a slot is not admitted,
//! like one that cannot get blocks. The slot's contents are the runner's;
//! a sequence that starts at position 0 (new, or preempted and recomputed)
//! starts from a zero state whatever the slot held before. With prefix
//! caching, [`KvCacheManager::with_state_checkpoints`] adds checkpoints of
//! that state at block boundaries ([`super::state_checkpoints`]): a hit
//! reaches only as far as the last block with one, and the sequence's
//! first step restores it ([`KvCacheManager::take_state_restore`]); steps
//! that end on a boundary save one ([`KvCacheManager::plan_state_checkpoint`]).
//!
//! Blocks planned for a step that has not run are tracked as *in flight*
//! ([`KvCacheManager::in_flight`]), never as cached: the scheduler holds a
//! new request back while the block after its cache hit is being computed
//! by another sequence (the other samples of an `n > 1` request, say), so
//! it finds that block in the cache a step later instead of computing the
//! same K/V again.

use super::block_pool::{BlockHash, BlockPool, OwnerUsage, SHARED_OWNER};
use super::events::{external_hash, salt_key, KvEvent};
use super::state_checkpoints::StateCheckpoints;
use std::collections::HashMap;

/// Prefix-cache counters, in tokens, as vLLM reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens looked up in the cache.
    pub queries: u64,
    /// Of those, tokens found cached and not recomputed.
    pub hits: u64,
}

/// What, besides its tokens, decides whether a sequence's blocks can be
/// shared: the salt (tenant and per-request `cache_salt`) and which of its
/// positions were computed on the prompt kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheKey {
    /// Hash of the tenant and the request's `cache_salt`.
    pub salt: u64,
    /// Positions below this are the prompt.
    pub prompt_len: usize,
    /// Whether the prompt positions run on the prompt kernel (the dense
    /// bf16 tiles, `Weight::matmul_rows`) rather than the exact kernels that
    /// generated positions always use. The same tokens then have slightly
    /// different K/V, and a request must find in the cache exactly what it
    /// would have computed itself.
    pub prompt_kernel: bool,
    /// The LoRA adapter its K/V was computed under (its id; 0 for the base
    /// model): a prompt cached under one adapter is never a hit for
    /// another, or for the base.
    pub lora: u32,
    /// Whom its blocks count for ([`KvCacheManager::owner`]): a tenant with
    /// a KV-cache reservation or cap, else [`SHARED_OWNER`]. Not hashed:
    /// it decides capacity, not sharing.
    pub owner: u16,
}

#[derive(Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// Hashes of the sequence's full, computed blocks, in order.
    hashes: Vec<BlockHash>,
    /// Hashes of the full blocks after `hashes` that a planned step will
    /// compute, in order; they move to `hashes` when the step commits.
    planned: Vec<BlockHash>,
    /// Tokens whose K/V is in `blocks`: committed by steps that ran, or
    /// found in the prefix cache.
    computed: usize,
    /// Leading entries of `blocks` already given back to the pool because
    /// they fell out of the sliding window.
    released: usize,
    key: CacheKey,
    /// Its recurrent-state slot, when the model has linear layers.
    state_slot: Option<u32>,
    /// The checkpoint its prefix-cache hit starts from, until its first
    /// step takes it ([`KvCacheManager::take_state_restore`]).
    restore: Option<u32>,
    /// A checkpoint its planned step writes: the slot, the block it ends,
    /// and the tokens computed once it has run.
    saving: Option<(u32, BlockHash, usize)>,
}

/// The KV-cache manager of one device.
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    caching: bool,
    seqs: HashMap<u64, SeqBlocks>,
    /// Full blocks that planned steps will compute: hash → how many
    /// sequences are computing it.
    in_flight: HashMap<BlockHash, u32>,
    stats: PrefixStats,
    /// The attention window every layer shares, if they all have one.
    window: Option<usize>,
    /// KV-cache events since the last [`KvCacheManager::take_events`],
    /// when they are published ([`KvCacheManager::with_events`]).
    events: Option<Vec<KvEvent>>,
    /// LoRA adapters' names by id, for the events ([`KvCacheManager::name_lora`]).
    lora_names: HashMap<u32, String>,
    /// Tenants with KV-cache limits, by name: their owner ids in the pool.
    owners: HashMap<std::sync::Arc<str>, u16>,
    /// Blocks of the longest sequence the engine admits: no tenant's cap
    /// goes below it, or that tenant's longest request could never run.
    max_seq_blocks: usize,
    /// Recurrent-state slots nobody holds (see the module docs); `None`
    /// for a model without linear layers.
    free_state_slots: Option<Vec<u32>>,
    /// How many state slots there are in all.
    num_state_slots: usize,
    /// Checkpoints of the recurrent state at block boundaries, for prefix
    /// caching of a hybrid model.
    checkpoints: Option<StateCheckpoints>,
}

/// What a prefix lookup found: cached blocks a new sequence can start from.
#[derive(Debug, Default)]
pub struct PrefixHit {
    blocks: Vec<u32>,
    hashes: Vec<BlockHash>,
    /// The checkpoint of the recurrent state at the hit's end (hybrid
    /// models).
    restore: Option<u32>,
}

impl PrefixHit {
    /// Tokens covered by the hit.
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }
}

impl KvCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
    ) -> KvCacheManager {
        KvCacheManager {
            pool: BlockPool::new(num_blocks, block_size),
            block_size,
            caching: enable_prefix_caching,
            seqs: HashMap::new(),
            in_flight: HashMap::new(),
            stats: PrefixStats::default(),
            window: None,
            events: None,
            lora_names: HashMap::new(),
            owners: HashMap::new(),
            max_seq_blocks: 1,
            free_state_slots: None,
            num_state_slots: 0,
            checkpoints: None,
        }
    }

    /// Keeps `n` checkpoints of the recurrent state at block boundaries,
    /// so a hybrid model's prefix-cache hits restore it (see the module
    /// docs); nothing without prefix caching.
    pub fn with_state_checkpoints(mut self, n: usize) -> KvCacheManager {
        if self.caching {
            self.checkpoints = Some(StateCheckpoints::new(n));
        }
        self
    }

    /// Whether prefix-cache hits need a checkpoint of the recurrent state
    /// at their end, so prefill chunks should end on block boundaries
    /// ([`KvCacheManager::checkpoint_chunk`]).
    pub fn checkpoints_state(&self) -> bool {
        self.checkpoints.as_ref().is_some_and(|c| !c.is_empty())
    }

    /// How many of `num_new` tokens from `start` (of `len` to compute) a
    /// prefill chunk should run so that it ends on a block boundary, where
    /// the state can be checkpointed: a chunk that stops short of the end
    /// is cut back to the last boundary it crosses, and one that reaches
    /// the end stops at the last boundary a later hit can use (a prompt's
    /// last token is never a hit), which leaves the rest for the next
    /// step. Unchanged when no boundary lies inside the chunk, or when the
    /// state is not checkpointed.
    pub fn checkpoint_chunk(&self, start: usize, num_new: usize, len: usize) -> usize {
        if !self.checkpoints_state() || len == 0 {
            return num_new;
        }
        let bs = self.block_size;
        let end = start + num_new;
        let boundary = if end < len {
            end / bs * bs
        } else {
            (len - 1) / bs * bs
        };
        if boundary > start && boundary < end {
            boundary - start
        } else {
            num_new
        }
    }

    /// Plans a checkpoint of `seq`'s recurrent state after its planned
    /// step, which computes up to token `end`: the checkpoint slot to copy
    /// its state slot into, when `end` is a block boundary whose state is
    /// not already checkpointed.
    pub fn plan_state_checkpoint(&mut self, seq: u64, end: usize) -> Option<u32> {
        let bs = self.block_size;
        if end == 0 || end % bs != 0 {
            return None;
        }
        let checkpoints = self.checkpoints.as_mut()?;
        let entry = self.seqs.get_mut(&seq)?;
        let j = end / bs - 1;
        let hash = match j.checked_sub(entry.hashes.len()) {
            None => entry.hashes[j],
            Some(p) => *entry.planned.get(p)?,
        };
        let slot = checkpoints.plan(hash)?;
        entry.saving = Some((slot, hash, end));
        Some(slot)
    }

    /// The checkpoint `seq`'s prefix-cache hit starts from, once: its first
    /// step copies it into the sequence's state slot before running.
    pub fn take_state_restore(&mut self, seq: u64) -> Option<u32> {
        self.seqs.get_mut(&seq)?.restore.take()
    }

    /// Gives each sequence one of `slots` recurrent-state slots for as long
    /// as it holds blocks (a hybrid model's linear layers; `slots` is the
    /// engine's `--max-num-seqs`).
    pub fn with_state_slots(mut self, slots: usize) -> KvCacheManager {
        // Handed out from the end: slot 0 first.
        self.free_state_slots = Some((0..slots as u32).rev().collect());
        self.num_state_slots = slots;
        self
    }

    /// Recurrent-state slots in all, and of those nobody holds (0 and 0
    /// for a model without linear layers).
    pub fn state_slot_usage(&self) -> (usize, usize) {
        let free = self.free_state_slots.as_ref().map_or(0, Vec::len);
        (self.num_state_slots, free)
    }

    /// Checks that every sequence holding blocks holds its own state slot,
    /// and that held and free slots together are every slot, once.
    pub fn check_state_slots(&self) -> Result<(), String> {
        let Some(free) = &self.free_state_slots else {
            return Ok(());
        };
        let mut seen = vec![false; self.num_state_slots];
        let held = self.seqs.iter().map(|(&id, s)| (Some(id), s.state_slot));
        for (owner, slot) in held.chain(free.iter().map(|&f| (None, Some(f)))) {
            let Some(slot) = slot else {
                return Err(format!("sequence {owner:?} holds blocks but no state slot"));
            };
            match seen.get_mut(slot as usize) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(format!("state slot {slot} is counted twice ({owner:?})")),
                None => return Err(format!("state slot {slot} is out of range ({owner:?})")),
            }
        }
        match seen.iter().position(|s| !s) {
            Some(lost) => Err(format!("state slot {lost} is neither held nor free")),
            None => Ok(()),
        }
    }

    /// The recurrent-state slot of `seq` (0 for a model without linear
    /// layers, or a sequence that holds nothing).
    pub fn state_slot(&self, seq: u64) -> u32 {
        self.seqs.get(&seq).and_then(|s| s.state_slot).unwrap_or(0)
    }

    /// Bounds tenants' caps from below by the blocks of a `len`-token
    /// sequence (the engine's `--max-model-len`).
    pub fn with_max_seq_len(mut self, len: usize) -> KvCacheManager {
        self.max_seq_blocks = len.div_ceil(self.block_size).max(1);
        self
    }

    /// The pool owner the blocks of `tenant`'s requests count for: the
    /// tenant's own when it has a KV-cache share (registered on first
    /// sight, its limits refreshed on every call so a config change takes
    /// effect), else [`SHARED_OWNER`].
    pub fn owner(&mut self, tenant: &crate::engine::fair_share::TenantShare) -> u16 {
        let Some(share) = tenant.kv else {
            return SHARED_OWNER;
        };
        let mut limits = share.limits(self.pool.num_blocks());
        limits.cap = limits.cap.map(|c| c.max(self.max_seq_blocks));
        match self.owners.get(&tenant.name) {
            Some(&o) => {
                self.pool.set_limits(o, limits);
                o
            }
            None => {
                let o = self.pool.add_owner(limits);
                self.owners.insert(tenant.name.clone(), o);
                o
            }
        }
    }

    /// Every tenant with a KV-cache share, and what it has of the pool.
    pub fn owner_usage(&self) -> Vec<(std::sync::Arc<str>, OwnerUsage)> {
        let mut v: Vec<_> = self
            .owners
            .iter()
            .map(|(n, &o)| (n.clone(), self.pool.owner_usage(o)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Keeps KV-cache events (blocks stored in and evicted from the prefix
    /// cache) for [`KvCacheManager::take_events`].
    pub fn with_events(mut self) -> KvCacheManager {
        self.events = Some(Vec::new());
        self.pool.record_evictions();
        self
    }

    /// Empties the prefix cache (vLLM's `reset_prefix_cache`), telling
    /// subscribers with `AllBlocksCleared`. Refused, with how many blocks
    /// are held, while any sequence holds blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        self.pool.reset_prefix_cache()?;
        self.in_flight.clear();
        if let Some(c) = &mut self.checkpoints {
            c.clear();
        }
        if let Some(events) = &mut self.events {
            // Evictions before the reset are moot now.
            let mut evicted = Vec::new();
            self.pool.take_evictions(&mut evicted);
            events.clear();
            events.push(KvEvent::AllBlocksCleared);
        }
        Ok(())
    }

    /// Moves the events since the last call to `out`, in the order they
    /// happened within a step: evictions (planning) before stores
    /// (commits).
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        let Some(events) = &mut self.events else {
            return;
        };
        let mut evicted = Vec::new();
        self.pool.take_evictions(&mut evicted);
        if !evicted.is_empty() {
            out.push(KvEvent::BlockRemoved {
                block_hashes: evicted.into_iter().map(external_hash).collect(),
            });
        }
        out.append(events);
    }

    /// Gives back blocks that fell out of a window of `window` positions
    /// (one that every layer of the model has; see the module docs).
    pub fn with_sliding_window(mut self, window: usize) -> KvCacheManager {
        self.window = Some(window.max(1));
        self
    }

    /// Blocks `seq` still holds (its table, less what the window released).
    pub fn num_held_blocks(&self, seq: u64) -> usize {
        self.seqs
            .get(&seq)
            .map_or(0, |s| s.blocks.len() - s.released)
    }

    /// Names adapter `id` in the events of blocks computed under it.
    pub fn name_lora(&mut self, id: u32, name: &str) {
        if self.events.is_some() && !self.lora_names.contains_key(&id) {
            self.lora_names.insert(id, name.to_string());
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether full blocks are shared between requests by prefix hash.
    pub fn prefix_caching(&self) -> bool {
        self.caching
    }

    /// The hash of block `j` (of `tokens`) after `parent`.
    fn hash(
        &self,
        parent: Option<BlockHash>,
        j: usize,
        tokens: &[u32],
        key: CacheKey,
    ) -> BlockHash {
        block_hash(self.block_size, parent, j, tokens, key)
    }

    /// The block pool, for usage figures and invariant checks.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Prefix-cache counters so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.stats
    }

    /// The block table of a sequence that holds blocks.
    pub fn block_table(&self, seq: u64) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.blocks)
    }

    /// Finds the longest run of cached full blocks at the start of `tokens`.
    /// The last token is never taken from the cache, since the model must
    /// run at least one token to produce the next token's logits.
    pub fn lookup_prefix(&self, tokens: &[u32], key: CacheKey) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.caching || tokens.is_empty() {
            return hit;
        }
        let full = (tokens.len() - 1) / self.block_size;
        let mut parent = None;
        for j in 0..full {
            let h = self.hash(parent, j, tokens, key);
            match self.pool.lookup(h) {
                Some(b) => {
                    hit.blocks.push(b);
                    hit.hashes.push(h);
                    parent = Some(h);
                }
                None => break,
            }
        }
        if let Some(checkpoints) = &self.checkpoints {
            // The linear layers can start only where their state was
            // checkpointed: the hit ends at the last such block.
            let at = hit
                .hashes
                .iter()
                .rposition(|&h| checkpoints.find(h).is_some());
            let keep = at.map_or(0, |i| i + 1);
            hit.restore = at.and_then(|i| checkpoints.find(hit.hashes[i]));
            hit.blocks.truncate(keep);
            hit.hashes.truncate(keep);
        }
        hit
    }

    /// Whether the block of `tokens` right after `hit` is being computed by
    /// a step already planned for another sequence: the request would find
    /// it in the cache once that step has run.
    pub fn in_flight(&self, tokens: &[u32], key: CacheKey, hit: &PrefixHit) -> bool {
        if !self.caching || self.in_flight.is_empty() || tokens.is_empty() {
            return false;
        }
        let j = hit.blocks.len();
        if j >= (tokens.len() - 1) / self.block_size {
            return false;
        }
        let h = self.hash(hit.hashes.last().copied(), j, tokens, key);
        self.in_flight.contains_key(&h)
    }

    /// Makes room for `num_new` more tokens of sequence `seq`, whose first
    /// `num_computed` tokens are already in the cache (counting `hit`, for a
    /// sequence that holds no blocks yet). Returns false, changing nothing,
    /// when the pool cannot supply the blocks. Nothing enters the prefix
    /// cache here: the new slots hold nothing until the step runs and
    /// [`KvCacheManager::commit`] records it.
    pub fn allocate(
        &mut self,
        seq: u64,
        tokens: &[u32],
        key: CacheKey,
        hit: Option<PrefixHit>,
        num_computed: usize,
        num_new: usize,
    ) -> bool {
        let bs = self.block_size;
        let total = num_computed + num_new;
        let needed_blocks = total.div_ceil(bs);
        let held = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        let hit_blocks = hit.as_ref().map_or(&[][..], |h| &h.blocks[..]);
        let new_blocks = needed_blocks.saturating_sub(held + hit_blocks.len());
        // Hit blocks nobody holds sit in the free queue; taking them shrinks
        // what is left for fresh blocks.
        let revived = hit_blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        if new_blocks + revived > self.pool.available_for(key.owner) {
            return false;
        }
        let new_seq = !self.seqs.contains_key(&seq);
        let state_slot = match &mut self.free_state_slots {
            Some(free) if new_seq => match free.pop() {
                Some(slot) => Some(slot),
                // Every slot is held: like a pool without blocks.
                None => return false,
            },
            _ => None,
        };
        let entry = self.seqs.entry(seq).or_insert_with(|| SeqBlocks {
            key,
            state_slot,
            ..Default::default()
        });
        if let Some(hit) = hit {
            if entry.blocks.is_empty() {
                self.stats.queries += tokens.len() as u64;
                self.stats.hits += (hit.blocks.len() * bs) as u64;
                for &b in &hit.blocks {
                    self.pool.acquire(b);
                }
                entry.computed = hit.blocks.len() * bs;
                entry.blocks = hit.blocks;
                entry.hashes = hit.hashes;
                entry.restore = hit.restore;
                if let (Some(slot), Some(c)) = (hit.restore, &mut self.checkpoints) {
                    c.touch(slot);
                }
            }
        }
        for _ in 0..new_blocks {
            match self.pool.allocate_for(key.owner) {
                Some(b) => entry.blocks.push(b),
                None => unreachable!("free blocks were counted above"),
            }
        }
        if self.caching {
            // Announce the full blocks the step will compute (see
            // `in_flight`); they become findable only in `commit`.
            let full = total.min(tokens.len()) / bs;
            let key = entry.key;
            while entry.hashes.len() + entry.planned.len() < full {
                let j = entry.hashes.len() + entry.planned.len();
                let parent = entry.planned.last().or(entry.hashes.last()).copied();
                let h = block_hash(bs, parent, j, tokens, key);
                *self.in_flight.entry(h).or_insert(0) += 1;
                entry.planned.push(h);
            }
        }
        true
    }

    /// Records that a step ran: the first `num_computed` tokens of `seq`
    /// (whose token ids are `tokens`) now have their K/V in its blocks.
    /// Blocks this completes enter the prefix cache; this is the only place
    /// they do (see the module docs).
    pub fn commit(&mut self, seq: u64, tokens: &[u32], num_computed: usize) {
        let bs = self.block_size;
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return;
        };
        let num_computed = num_computed.min(entry.blocks.len() * bs);
        if num_computed <= entry.computed {
            return;
        }
        for j in entry.computed / bs..num_computed.div_ceil(bs) {
            self.pool
                .mark_written(entry.blocks[j], num_computed - j * bs);
        }
        entry.computed = num_computed;
        if let (Some((slot, hash, end)), Some(c)) = (entry.saving, &mut self.checkpoints) {
            if num_computed >= end {
                c.confirm(slot, hash);
                entry.saving = None;
            }
        }
        if self.caching {
            let full = num_computed.min(tokens.len()) / bs;
            let key = entry.key;
            let mut done = 0;
            while entry.hashes.len() < full {
                let j = entry.hashes.len();
                let h = match entry.planned.get(done) {
                    Some(&h) => {
                        done += 1;
                        forget_in_flight(&mut self.in_flight, h);
                        h
                    }
                    None => block_hash(bs, entry.hashes.last().copied(), j, tokens, key),
                };
                let stored = self.pool.cache(entry.blocks[j], h);
                if let (true, Some(events)) = (stored, &mut self.events) {
                    let lora = (key.lora != 0).then(|| {
                        let name = self.lora_names.get(&key.lora).cloned().unwrap_or_default();
                        (key.lora, name)
                    });
                    record_stored(events, &entry.hashes, j, h, tokens, bs, key.salt, lora);
                }
                entry.hashes.push(h);
            }
            entry.planned.drain(..done);
        }
        if let Some(w) = self.window {
            // The next query sits at `num_computed` and sees from
            // `num_computed + 1 - w`; the kernel reads from the chunk
            // boundary below that. Blocks wholly below are done with.
            let lowest =
                pagoda_accel::ops::window_reads_from((num_computed + 1).saturating_sub(w), bs);
            let dead = (lowest / bs).min(entry.blocks.len());
            while entry.released < dead {
                self.pool.release(entry.blocks[entry.released]);
                entry.released += 1;
            }
        }
    }

    /// Gives back the blocks of `seq` past its first `num_tokens` tokens:
    /// the slots of drafts the target rejected. They were never committed,
    /// so nothing of theirs is findable by prefix.
    pub fn truncate(&mut self, seq: u64, num_tokens: usize) {
        let bs = self.block_size;
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return;
        };
        let keep = num_tokens.div_ceil(bs).max(entry.released);
        while entry.blocks.len() > keep {
            if let Some(b) = entry.blocks.pop() {
                self.pool.release(b);
            }
        }
    }

    /// Releases every block of `seq`. Blocks are released from the end of
    /// the sequence backwards, so its tail (least likely to be shared) is
    /// evicted before its prefix.
    pub fn free(&mut self, seq: u64) {
        if let Some(s) = self.seqs.remove(&seq) {
            if let (Some(slot), Some(free)) = (s.state_slot, &mut self.free_state_slots) {
                free.push(slot);
            }
            for &b in s.blocks[s.released..].iter().rev() {
                self.pool.release(b);
            }
            for h in s.planned {
                forget_in_flight(&mut self.in_flight, h);
            }
        }
    }

    /// Sequences holding blocks.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }
}

/// Records that block `j` of `tokens` (hash `h`, after `hashes[..j]`)
/// entered the cache: it extends the last event when that one stored the
/// block before it, so a sequence's run of blocks is one event, as vLLM
/// sends them.
#[allow(clippy::too_many_arguments)]
fn record_stored(
    events: &mut Vec<KvEvent>,
    hashes: &[BlockHash],
    j: usize,
    h: BlockHash,
    tokens: &[u32],
    bs: usize,
    salt: u64,
    lora: Option<(u32, String)>,
) {
    let parent = j
        .checked_sub(1)
        .and_then(|p| hashes.get(p))
        .map(|&p| external_hash(p));
    let block_tokens = &tokens[j * bs..(j + 1) * bs];
    // vLLM's order: the adapter's name on every block, the salt on block 0.
    let mut keys: Vec<String> = lora.iter().map(|l| l.1.clone()).collect();
    if j == 0 && salt != 0 {
        keys.push(salt_key(salt));
    }
    let extra = (!keys.is_empty()).then_some(keys);
    if let Some(KvEvent::BlockStored {
        block_hashes,
        token_ids,
        extra_keys,
        lora: last_lora,
        ..
    }) = events.last_mut()
    {
        if parent.is_some() && block_hashes.last().copied() == parent && *last_lora == lora {
            block_hashes.push(external_hash(h));
            token_ids.extend_from_slice(block_tokens);
            extra_keys.push(extra);
            return;
        }
    }
    events.push(KvEvent::BlockStored {
        block_hashes: vec![external_hash(h)],
        parent_block_hash: parent,
        token_ids: block_tokens.to_vec(),
        block_size: bs,
        extra_keys: vec![extra],
        lora,
    });
}

/// Drops one sequence's claim that it is computing block `h`.
fn forget_in_flight(in_flight: &mut HashMap<BlockHash, u32>, h: BlockHash) {
    if let Some(n) = in_flight.get_mut(&h) {
        *n -= 1;
        if *n == 0 {
            in_flight.remove(&h);
        }
    }
}

/// The hash of block `j` of `tokens` (blocks of `bs`) after `parent`,
/// tagged with how many of its positions ran on the prompt kernel.
fn block_hash(
    bs: usize,
    parent: Option<BlockHash>,
    j: usize,
    tokens: &[u32],
    key: CacheKey,
) -> BlockHash {
    let on_prompt_kernel = if key.prompt_kernel {
        key.prompt_len.saturating_sub(j * bs).min(bs)
    } else {
        0
    };
    // The adapter joins the salt, so the base model's hashes (and the
    // events routers already know) stay what they were.
    let salt = if key.lora == 0 {
        key.salt
    } else {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(key.salt, key.lora), &mut h);
        std::hash::Hasher::finish(&h)
    };
    BlockHash::new(
        parent,
        &tokens[j * bs..(j + 1) * bs],
        salt,
        on_prompt_kernel,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key whose tokens are all prompt, on the exact kernels.
    fn k(salt: u64) -> CacheKey {
        CacheKey {
            salt,
            prompt_len: usize::MAX,
            prompt_kernel: false,
            lora: 0,
            owner: SHARED_OWNER,
        }
    }

    #[test]
    fn each_sequence_holds_its_own_state_slot_until_freed_and_none_are_admitted_past_them() {
        let mut m = KvCacheManager::new(16, 4, false).with_state_slots(2);
        let t = [1u32, 2, 3, 4, 5];
        assert!(m.allocate(10, &t, k(0), None, 0, 5));
        assert!(m.allocate(11, &t, k(0), None, 0, 5));
        let (a, b) = (m.state_slot(10), m.state_slot(11));
        assert_ne!(a, b, "two running sequences share a state slot");
        // A sequence already holding a slot grows without another.
        assert!(m.allocate(10, &t, k(0), None, 5, 1));
        assert_eq!(m.state_slot(10), a);
        // Blocks are left, slots are not: the third sequence waits, and
        // nothing of it is left behind.
        assert!(!m.allocate(12, &t, k(0), None, 0, 5));
        assert_eq!(m.num_seqs(), 2);
        m.check_state_slots().expect("slots accounted");
        // Freed (finish, abort or preemption), its slot serves the next.
        m.free(10);
        assert_eq!(m.state_slot_usage(), (2, 1));
        assert!(m.allocate(12, &t, k(0), None, 0, 5));
        assert_eq!(m.state_slot(12), a);
        m.check_state_slots().expect("slots accounted");
        m.free(11);
        m.free(12);
        assert_eq!(m.state_slot_usage(), (2, 2));
        m.check_state_slots().expect("slots accounted");
        // Without slots (no linear layers), nothing is counted.
        let mut plain = KvCacheManager::new(16, 4, false);
        for id in 0..3 {
            assert!(plain.allocate(id, &t, k(0), None, 0, 5));
        }
    }

    #[test]
    fn stores_and_evictions_are_told_as_vllm_kv_events() {
        use crate::engine::kv_cache::events::{encode_batch, external_hash, WireFormat};
        let key = CacheKey {
            salt: 7,
            prompt_len: usize::MAX,
            prompt_kernel: false,
            lora: 0,
            owner: SHARED_OWNER,
        };
        let mut m = KvCacheManager::new(4, 4, true).with_events();
        let t: Vec<u32> = (10..20).collect();
        // Ten tokens: two full blocks enter the cache, as one event.
        assert!(m.allocate(1, &t, key, None, 0, 10));
        m.commit(1, &t, 10);
        let mut ev = Vec::new();
        m.take_events(&mut ev);
        let [KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            extra_keys,
            lora: None,
        }] = ev.as_slice()
        else {
            panic!("{ev:?}");
        };
        assert_eq!(block_hashes.len(), 2);
        assert_eq!(*parent_block_hash, None);
        assert_eq!(token_ids, &t[..8]);
        assert_eq!(*block_size, 4);
        // The salt rides on block 0, so tenants stay apart for a router.
        assert_eq!(
            extra_keys,
            &vec![Some(vec!["0000000000000007".to_string()]), None]
        );
        let stored = block_hashes.clone();
        assert_eq!(stored[0], external_hash(m.seqs[&1].hashes[0]));
        // The next block of the same sequence names its parent.
        let t2: Vec<u32> = (10..22).collect();
        assert!(m.allocate(1, &t2, key, None, 10, 2));
        m.commit(1, &t2, 12);
        ev.clear();
        m.take_events(&mut ev);
        assert!(
            matches!(&ev[..], [KvEvent::BlockStored { parent_block_hash: Some(p), block_hashes, .. }]
                if *p == stored[1] && block_hashes.len() == 1),
            "{ev:?}"
        );
        let third = match &ev[0] {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes[0],
            _ => unreachable!(),
        };
        // Freed, the blocks stay cached; handed out to another sequence,
        // they are evicted, and told so, oldest first.
        m.free(1);
        let other: Vec<u32> = (100..116).collect();
        assert!(m.allocate(2, &other, CacheKey::default(), None, 0, 16));
        ev.clear();
        m.take_events(&mut ev);
        let [KvEvent::BlockRemoved { block_hashes }] = ev.as_slice() else {
            panic!("{ev:?}");
        };
        let mut removed = block_hashes.clone();
        removed.sort_unstable();
        let mut all = vec![stored[0], stored[1], third];
        all.sort_unstable();
        assert_eq!(removed, all);

        // vLLM 0.32's wire form: {"ts", "events": [{"type": "BlockRemoved",
        // "block_hashes", "medium"}], "data_parallel_rank"}.
        let bytes = encode_batch(1.5, &ev, 0, WireFormat::Map).expect("encode");
        let v: serde_json::Value = rmp_serde::from_slice(&bytes).expect("msgpack");
        assert_eq!(v["ts"], 1.5);
        assert_eq!(v["events"][0]["type"], "BlockRemoved");
        assert_eq!(v["events"][0]["medium"], "GPU");
        assert_eq!(
            v["events"][0]["block_hashes"].as_array().map(Vec::len),
            Some(3)
        );
        assert_eq!(v["data_parallel_rank"], 0);
        // The older positional form: [ts, [["BlockRemoved", hashes, "GPU"]], 0].
        let bytes = encode_batch(1.5, &ev, 0, WireFormat::Array).expect("encode");
        let v: serde_json::Value = rmp_serde::from_slice(&bytes).expect("msgpack");
        assert_eq!(v[0], 1.5);
        assert_eq!(v[1][0][0], "BlockRemoved");
        assert_eq!(v[1][0][2], "GPU");
        assert_eq!(v[2], 0);
    }

    #[test]
    fn a_prefix_cached_under_an_adapter_serves_only_that_adapter() {
        let mut m = KvCacheManager::new(8, 4, true);
        let t: Vec<u32> = (0..9).collect();
        let under = |lora| CacheKey { lora, ..k(3) };
        assert!(m.allocate(1, &t, under(1), None, 0, 9));
        m.commit(1, &t, 9);
        m.free(1);
        assert_eq!(m.lookup_prefix(&t, under(1)).num_tokens(4), 8);
        assert_eq!(m.lookup_prefix(&t, under(0)).num_tokens(4), 0, "the base");
        assert_eq!(
            m.lookup_prefix(&t, under(2)).num_tokens(4),
            0,
            "another adapter"
        );
    }

    #[test]
    fn blocks_stored_under_an_adapter_carry_its_id_and_name() {
        let mut m = KvCacheManager::new(8, 4, true).with_events();
        m.name_lora(5, "sql");
        let t: Vec<u32> = (0..9).collect();
        let key = CacheKey { lora: 5, ..k(3) };
        assert!(m.allocate(1, &t, key, None, 0, 9));
        m.commit(1, &t, 9);
        let mut ev = Vec::new();
        m.take_events(&mut ev);
        let [KvEvent::BlockStored {
            extra_keys, lora, ..
        }] = ev.as_slice()
        else {
            panic!("{ev:?}");
        };
        assert_eq!(lora, &Some((5, "sql".to_string())));
        // vLLM's extra keys: the adapter on every block, the salt on the first.
        assert_eq!(
            extra_keys,
            &vec![
                Some(vec!["sql".to_string(), "0000000000000003".to_string()]),
                Some(vec!["sql".to_string()])
            ]
        );
        let bytes = crate::engine::kv_cache::events::encode_batch(
            1.0,
            &ev,
            0,
            crate::engine::kv_cache::events::WireFormat::Map,
        )
        .expect("encode");
        let v: serde_json::Value = rmp_serde::from_slice(&bytes).expect("msgpack");
        assert_eq!(v["events"][0]["lora_id"], 5);
        assert_eq!(v["events"][0]["lora_name"], "sql");
    }

    #[test]
    fn a_reset_empties_the_cache_only_when_idle_and_is_told() {
        let mut m = KvCacheManager::new(4, 4, true).with_events();
        let t: Vec<u32> = (0..8).collect();
        assert!(m.allocate(1, &t, k(1), None, 0, 8));
        m.commit(1, &t, 8);
        assert_eq!(m.reset_prefix_cache(), Err(2), "blocks in use are kept");
        m.free(1);
        assert!(m.lookup_prefix(&t, k(1)).num_tokens(4) > 0);
        assert_eq!(m.reset_prefix_cache(), Ok(()));
        assert_eq!(m.lookup_prefix(&t, k(1)).num_tokens(4), 0);
        let mut ev = Vec::new();
        m.take_events(&mut ev);
        assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
        m.pool().check_invariants().expect("invariants");
    }

    #[test]
    fn nothing_is_recorded_unless_events_are_on() {
        let mut m = KvCacheManager::new(4, 4, true);
        let t: Vec<u32> = (0..8).collect();
        assert!(m.allocate(1, &t, k(1), None, 0, 8));
        m.commit(1, &t, 8);
        let mut ev = Vec::new();
        m.take_events(&mut ev);
        assert!(ev.is_empty());
    }

    #[test]
    fn blocks_stand_in_for_each_other_only_when_their_kernels_agree() {
        // Request 1: a 4-token prompt and 8 generated tokens. Request 2's
        // prompt is all 12 of them (a chat's next turn), and 1 more.
        let t: Vec<u32> = (0..13).collect();
        let key = |prompt_len, prompt_kernel| CacheKey {
            salt: 0,
            prompt_len,
            prompt_kernel,
            lora: 0,
            owner: SHARED_OWNER,
        };
        // (request 1 on the prompt kernel, request 2 on it, tokens reused)
        for (first, next, reused) in [
            (false, false, 12), // one kernel for everything
            (true, true, 4),    // only the block that was prompt for both
            (false, true, 0),   // request 2 would compute every block otherwise
            (true, false, 0),
        ] {
            let mut m = KvCacheManager::new(16, 4, true);
            assert!(m.allocate(1, &t[..12], key(4, first), None, 0, 12));
            m.commit(1, &t[..12], 12);
            let hit = m.lookup_prefix(&t, key(12, next)).num_tokens(4);
            assert_eq!(hit, reused, "first {first}, next {next}");
            m.free(1);
            m.pool().check_invariants().unwrap();
        }
    }

    #[test]
    fn shared_prefix_is_reused_and_counted() {
        let mut m = KvCacheManager::new(16, 4, true);
        let a: Vec<u32> = (0..10).collect();
        assert!(m.allocate(1, &a, k(7), Some(m.lookup_prefix(&a, k(7))), 0, 10));
        m.commit(1, &a, 10);
        // Same first 8 tokens, other tail.
        let b: Vec<u32> = (0..8).chain([99, 98, 97]).collect();
        let hit = m.lookup_prefix(&b, k(7));
        assert_eq!(hit.num_tokens(4), 8);
        assert!(m.allocate(2, &b, k(7), Some(hit), 8, 3));
        assert_eq!(m.block_table(2)[..2], m.block_table(1)[..2]);
        assert_eq!(
            m.prefix_stats(),
            PrefixStats {
                queries: 21,
                hits: 8
            }
        );
        // Another salt sees nothing.
        assert_eq!(m.lookup_prefix(&b, k(8)).num_tokens(4), 0);
        m.free(1);
        m.free(2);
        assert_eq!(m.pool().num_free(), 16);
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn refuses_without_changes_when_the_pool_is_short() {
        let mut m = KvCacheManager::new(3, 4, true);
        let t: Vec<u32> = (0..16).collect();
        assert!(!m.allocate(1, &t, k(0), None, 0, 16));
        assert_eq!(m.pool().num_free(), 3);
        assert!(m.allocate(1, &t, k(0), None, 0, 12));
        assert!(!m.allocate(1, &t, k(0), None, 12, 1));
        m.free(1);
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn a_fully_cached_prompt_still_computes_its_last_token() {
        let mut m = KvCacheManager::new(8, 4, true);
        let t: Vec<u32> = (0..8).collect();
        assert!(m.allocate(1, &t, k(0), None, 0, 8));
        m.commit(1, &t, 8);
        m.free(1);
        assert_eq!(m.lookup_prefix(&t, k(0)).num_tokens(4), 4);
    }

    #[test]
    fn blocks_are_findable_only_once_their_step_has_run() {
        let mut m = KvCacheManager::new(8, 4, true);
        let t: Vec<u32> = (0..13).collect();
        assert!(m.allocate(1, &t, k(0), None, 0, 12));
        // Planned but not run: nothing to find, for this sequence or
        // another, though another can tell that it is on its way.
        let hit = m.lookup_prefix(&t, k(0));
        assert_eq!(hit.num_tokens(4), 0);
        assert!(m.in_flight(&t, k(0), &hit));
        // The step ran over its first 6 tokens only: one block is full.
        m.commit(1, &t, 6);
        assert_eq!(m.lookup_prefix(&t, k(0)).num_tokens(4), 4);
        m.pool().check_invariants().unwrap();
        // Preempted before the rest ran: the computed block stays findable,
        // the planned ones do not, and nothing is in flight any more.
        m.free(1);
        let hit = m.lookup_prefix(&t, k(0));
        assert_eq!(hit.num_tokens(4), 4);
        assert!(!m.in_flight(&t, k(0), &hit));
        m.pool().check_invariants().unwrap();
        // Re-admitted from the hit, it recomputes the rest and commits it.
        let hit = m.lookup_prefix(&t, k(0));
        assert!(m.allocate(1, &t, k(0), Some(hit), 4, 8));
        m.commit(1, &t, 12);
        assert_eq!(m.lookup_prefix(&t, k(0)).num_tokens(4), 12);
        m.free(1);
        m.pool().check_invariants().unwrap();
    }
}
