//! Block ids, their reference counts, the LRU queues of free blocks (one per
//! owner: a tenant with a KV-cache reservation or cap, or the shared one),
//! and the map from prefix hashes to cached blocks.
//!
//! A block whose reference count drops to zero keeps its contents and its
//! hash: it sits in its owner's free queue and can be revived by a prefix
//! hit until it is handed out again, which evicts it. Which free block an
//! allocation takes is the least recently freed one among the queues it may
//! evict from: the shared queue, its own, and those of owners holding more
//! than their reservation ([`OwnerLimits`]).
//!
//! The pool also counts, for each block, how many of its slots the model
//! has written since the block was handed out ([`BlockPool::mark_written`]).
//! A hash is accepted only for a block whose every slot was written, so a
//! block can never become findable by prefix before its K/V exists
//! ([`BlockPool::cache`], [`BlockPool::check_invariants`]). The free queues are intrusive
//! doubly-linked lists over arrays, so every operation is O(1) but an
//! allocation, which compares the queues' heads (O(owners)), and none
//! allocates after construction but [`BlockPool::add_owner`].

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The identity of a full block: its tokens, everything before it (through
/// the parent's hash) and the cache salt. 128 bits, so that an accidental
/// collision between different prefixes is not a practical concern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hashes one full block of `tokens` that follows `parent`.
    /// `prompt_kernel` counts the block's leading positions computed on the
    /// prompt kernel (see [`super::CacheKey::prompt_kernel`]): blocks whose
    /// K/V came from different kernels never stand in for each other.
    pub fn new(
        parent: Option<BlockHash>,
        tokens: &[u32],
        salt: u64,
        prompt_kernel: usize,
    ) -> BlockHash {
        let half = |lane: u8| {
            // DefaultHasher::new() has fixed keys, so hashes are stable
            // within and across processes of the same build.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            lane.hash(&mut h);
            parent.map(|p| p.0).hash(&mut h);
            salt.hash(&mut h);
            prompt_kernel.hash(&mut h);
            tokens.hash(&mut h);
            h.finish() as u128
        };
        BlockHash(half(0) << 64 | half(1))
    }
}

const NIL: u32 = u32::MAX;

/// The owner of everything no tenant policy covers: every block of a server
/// without KV-cache reservations or caps, and every free block that holds
/// nothing (any owner may take it).
pub const SHARED_OWNER: u16 = 0;

/// What one owner (a tenant) may keep of the pool, in blocks. A block
/// counts for its owner while it is held or keeps cached contents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerLimits {
    /// While the owner has no more blocks than this, other owners'
    /// allocations never evict its cached blocks.
    pub reserved: usize,
    /// The most blocks the owner may have at once (held plus cached); at
    /// the cap it recycles its own cached blocks or waits.
    pub cap: Option<usize>,
}

/// One owner's free blocks, least recently freed first.
#[derive(Clone, Copy, Debug)]
struct Queue {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY_QUEUE: Queue = Queue {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// Per owner: what it has and what it lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerUsage {
    /// Blocks it holds or keeps cached.
    pub blocks: usize,
    /// Of those, cached blocks nobody holds.
    pub cached: usize,
    /// Its cached blocks evicted by other owners' allocations, ever.
    pub evicted_by_others: u64,
}

/// All blocks of one device's KV cache.
///
/// Free blocks sit in one queue per owner, so that eviction can skip the
/// owners under their reservation: a block goes to the queue of the owner
/// it counts for, and a block that holds nothing to the shared queue. An
/// allocation takes the least recently freed block among the queues it may
/// evict from; with one owner (no tenant policies) that is the plain LRU
/// of every free block.
pub struct BlockPool {
    block_size: usize,
    ref_cnt: Vec<u32>,
    /// Slots written since the block was last handed out.
    written: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Hashes evicted since the last [`BlockPool::take_evictions`], when
    /// someone listens ([`BlockPool::record_evictions`]).
    evictions: Option<Vec<BlockHash>>,
    /// Links within the block's free queue.
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Whom the block counts for (and, while free, whose queue holds it).
    owner: Vec<u16>,
    /// When the block was last freed, so that queues' heads compare by age.
    freed_at: Vec<u64>,
    clock: u64,
    queues: Vec<Queue>,
    limits: Vec<OwnerLimits>,
    usage: Vec<OwnerUsage>,
    num_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots each, all
    /// of [`SHARED_OWNER`].
    pub fn new(num_blocks: usize, block_size: usize) -> BlockPool {
        assert!(num_blocks < NIL as usize, "block ids are u32");
        let n = num_blocks as u32;
        BlockPool {
            block_size,
            ref_cnt: vec![0; num_blocks],
            written: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::with_capacity(num_blocks),
            evictions: None,
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n)
                .map(|i| if i + 1 == n { NIL } else { i + 1 })
                .collect(),
            owner: vec![SHARED_OWNER; num_blocks],
            freed_at: (0..num_blocks as u64).collect(),
            clock: num_blocks as u64,
            queues: vec![Queue {
                head: if n == 0 { NIL } else { 0 },
                tail: if n == 0 { NIL } else { n - 1 },
                len: num_blocks,
            }],
            limits: vec![OwnerLimits::default()],
            usage: vec![OwnerUsage::default()],
            num_free: num_blocks,
        }
    }

    /// Adds an owner with `limits`, returning its id.
    pub fn add_owner(&mut self, limits: OwnerLimits) -> u16 {
        let id = self.queues.len();
        assert!(id < u16::MAX as usize, "too many KV-cache owners");
        self.queues.push(EMPTY_QUEUE);
        self.limits.push(limits);
        self.usage.push(OwnerUsage::default());
        id as u16
    }

    /// Changes an owner's limits (the shared owner has none).
    pub fn set_limits(&mut self, owner: u16, limits: OwnerLimits) {
        if owner != SHARED_OWNER {
            self.limits[owner as usize] = limits;
        }
    }

    /// What `owner` has now.
    pub fn owner_usage(&self, owner: u16) -> OwnerUsage {
        self.usage[owner as usize]
    }

    /// Whether `owner` has as many blocks as its cap allows.
    pub fn at_cap(&self, owner: u16) -> bool {
        let o = owner as usize;
        owner != SHARED_OWNER
            && self.limits[o]
                .cap
                .is_some_and(|c| self.usage[o].blocks >= c)
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks nobody references (cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// How many blocks [`BlockPool::allocate`] would hand `owner` one after
    /// another: the free blocks of the queues it may evict from (another
    /// owner's only down to that owner's reservation), within its cap.
    pub fn available_for(&self, owner: u16) -> usize {
        let o = owner as usize;
        let mut others = 0;
        for (q, queue) in self.queues.iter().enumerate() {
            if q == o {
                continue;
            }
            others += if q == SHARED_OWNER as usize {
                queue.len
            } else {
                queue
                    .len
                    .min(self.usage[q].blocks.saturating_sub(self.limits[q].reserved))
            };
        }
        // Recycling its own cached blocks does not grow what it has.
        let own = self.queues[o].len;
        match self.limits[o].cap {
            Some(cap) if owner != SHARED_OWNER => {
                own + others.min(cap.saturating_sub(self.usage[o].blocks))
            }
            _ => own + others,
        }
    }

    /// The fraction of blocks in use, 0.0 to 1.0.
    pub fn usage(&self) -> f64 {
        if self.ref_cnt.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free as f64 / self.ref_cnt.len() as f64
    }

    /// References held on `block`.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_cnt[block as usize]
    }

    /// The cached block holding `hash`, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// Takes the least recently freed block of [`SHARED_OWNER`]'s reach
    /// (every block, without tenant policies), evicting its cached
    /// contents.
    pub fn allocate(&mut self) -> Option<u32> {
        self.allocate_for(SHARED_OWNER)
    }

    /// Takes a block for `owner`: the least recently freed among the
    /// queues it may evict from (the shared queue, its own, and those of
    /// owners above their reservation), or at its cap only its own cached
    /// blocks. Evicts the block's cached contents.
    pub fn allocate_for(&mut self, owner: u16) -> Option<u32> {
        let q = self.pick_queue(owner)?;
        let b = self.queues[q].head;
        self.unlink(b);
        let old = self.owner[b as usize];
        if let Some(h) = self.hash[b as usize].take() {
            let u = &mut self.usage[old as usize];
            u.blocks -= 1;
            u.cached -= 1;
            if old != owner && old != SHARED_OWNER {
                u.evicted_by_others += 1;
            }
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
                if let Some(e) = &mut self.evictions {
                    e.push(h);
                }
            }
        }
        self.owner[b as usize] = owner;
        self.usage[owner as usize].blocks += 1;
        self.ref_cnt[b as usize] = 1;
        self.written[b as usize] = 0;
        Some(b)
    }

    /// The queue [`BlockPool::allocate_for`] takes from.
    fn pick_queue(&self, owner: u16) -> Option<usize> {
        let o = owner as usize;
        if self.at_cap(owner) {
            return (self.queues[o].len > 0).then_some(o);
        }
        let mut best: Option<usize> = None;
        for (q, queue) in self.queues.iter().enumerate() {
            if queue.len == 0 {
                continue;
            }
            let may_evict = q == o
                || q == SHARED_OWNER as usize
                || self.usage[q].blocks > self.limits[q].reserved;
            let older = best.is_none_or(|b| {
                self.freed_at[queue.head as usize] < self.freed_at[self.queues[b].head as usize]
            });
            if may_evict && older {
                best = Some(q);
            }
        }
        best
    }

    /// Adds a reference to `block` (a prefix hit), reviving it from the
    /// free queue if nobody held it. It keeps counting for its owner.
    pub fn acquire(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_cnt[b] == 0 {
            self.unlink(block);
            let u = &mut self.usage[self.owner[b] as usize];
            if self.hash[b].is_some() {
                u.cached -= 1;
            } else {
                u.blocks += 1;
            }
        }
        self.ref_cnt[b] += 1;
    }

    /// Drops a reference; at zero the block joins the tail of its owner's
    /// free queue, keeping its contents for later prefix hits (or, holding
    /// nothing, of the shared queue).
    pub fn release(&mut self, block: u32) {
        let b = block as usize;
        let rc = &mut self.ref_cnt[b];
        debug_assert!(*rc > 0, "double free of block {block}");
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            let u = &mut self.usage[self.owner[b] as usize];
            if self.hash[b].is_some() {
                u.cached += 1;
            } else {
                u.blocks -= 1;
                self.owner[b] = SHARED_OWNER;
            }
            self.push_tail(block);
        }
    }

    /// Records that the model wrote the first `slots` slots of `block`
    /// (a step ran over them). Counts only grow until the block is handed
    /// out again.
    pub fn mark_written(&mut self, block: u32, slots: usize) {
        let w = &mut self.written[block as usize];
        *w = (*w).max(slots.min(self.block_size) as u32);
    }

    /// Whether every slot of `block` has been written.
    pub fn is_full(&self, block: u32) -> bool {
        self.written[block as usize] as usize == self.block_size
    }

    /// Records that `block` holds `hash`, making it findable by prefix. The
    /// block must be full: every slot written ([`BlockPool::mark_written`]).
    /// If another block already holds the same hash, that one stays the
    /// canonical copy. Returns whether `block` became the canonical copy
    /// of `hash` (what a KV-cache event reports as stored).
    pub fn cache(&mut self, block: u32, hash: BlockHash) -> bool {
        debug_assert!(
            self.is_full(block),
            "block {block} entered the prefix cache with {} of {} slots written",
            self.written[block as usize],
            self.block_size
        );
        debug_assert!(self.ref_cnt[block as usize] > 0, "caching a free block");
        if self.hash[block as usize].is_some() || !self.is_full(block) {
            return false;
        }
        self.hash[block as usize] = Some(hash);
        *self.cached.entry(hash).or_insert(block) == block
    }

    /// Forgets every cached hash, so nothing is found by prefix any more.
    /// Refused (with how many blocks are held) while any block is in use:
    /// a running sequence's blocks must keep what they hold.
    pub fn reset_prefix_cache(&mut self) -> Result<(), usize> {
        let held = self.ref_cnt.iter().filter(|&&r| r > 0).count();
        if held > 0 {
            return Err(held);
        }
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
        // Every block is free and empty now: one shared queue, oldest first.
        let mut order: Vec<u32> = (0..self.ref_cnt.len() as u32).collect();
        order.sort_by_key(|&b| self.freed_at[b as usize]);
        self.queues.iter_mut().for_each(|q| *q = EMPTY_QUEUE);
        for u in &mut self.usage {
            u.blocks = 0;
            u.cached = 0;
        }
        self.num_free = 0;
        for b in order {
            self.owner[b as usize] = SHARED_OWNER;
            let stamp = self.freed_at[b as usize];
            self.push_tail(b);
            self.freed_at[b as usize] = stamp;
        }
        Ok(())
    }

    /// Starts keeping the hashes of evicted canonical blocks, for
    /// [`BlockPool::take_evictions`].
    pub fn record_evictions(&mut self) {
        self.evictions.get_or_insert_with(Vec::new);
    }

    /// Moves the hashes evicted since the last call to `out`.
    pub fn take_evictions(&mut self, out: &mut Vec<BlockHash>) {
        if let Some(e) = &mut self.evictions {
            out.append(e);
        }
    }

    /// Checks the pool's invariants: the free queues hold exactly the
    /// blocks with no references, each in its owner's queue (a block that
    /// holds nothing in the shared one); every owner's counts match its
    /// blocks; and the hash map points at blocks that carry that hash and
    /// whose every slot was written. Tests call this after every scenario
    /// (and the engine's tests after every step).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.ref_cnt.len()];
        let mut count = 0;
        for (q, queue) in self.queues.iter().enumerate() {
            let mut prev = NIL;
            let mut b = queue.head;
            let mut len = 0;
            while b != NIL {
                if seen[b as usize] {
                    return Err(format!("block {b} appears twice in the free queues"));
                }
                seen[b as usize] = true;
                if self.prev[b as usize] != prev {
                    return Err(format!("block {b} has a broken back link"));
                }
                if self.ref_cnt[b as usize] != 0 {
                    return Err(format!(
                        "block {b} is free but referenced {} times",
                        self.ref_cnt[b as usize]
                    ));
                }
                if self.owner[b as usize] as usize != q {
                    return Err(format!(
                        "block {b} of owner {} sits in queue {q}",
                        self.owner[b as usize]
                    ));
                }
                if self.hash[b as usize].is_none() && q != SHARED_OWNER as usize {
                    return Err(format!("empty block {b} sits in owner {q}'s queue"));
                }
                len += 1;
                prev = b;
                b = self.next[b as usize];
            }
            if prev != queue.tail || len != queue.len {
                return Err(format!("free queue {q}'s tail or length is wrong"));
            }
            count += len;
        }
        if count != self.num_free {
            return Err(format!(
                "free queues hold {count} blocks but num_free is {}",
                self.num_free
            ));
        }
        let mut usage = vec![OwnerUsage::default(); self.usage.len()];
        for (i, &rc) in self.ref_cnt.iter().enumerate() {
            if rc == 0 && !seen[i] {
                return Err(format!(
                    "block {i} has no references but is not in a free queue"
                ));
            }
            let u = &mut usage[self.owner[i] as usize];
            if rc > 0 || self.hash[i].is_some() {
                u.blocks += 1;
            }
            if rc == 0 && self.hash[i].is_some() {
                u.cached += 1;
            }
        }
        for (o, (want, have)) in usage.iter().zip(&self.usage).enumerate() {
            if (want.blocks, want.cached) != (have.blocks, have.cached) {
                return Err(format!(
                    "owner {o} counts {} blocks ({} cached) but has {} ({} cached)",
                    have.blocks, have.cached, want.blocks, want.cached
                ));
            }
        }
        for (h, &b) in &self.cached {
            if self.hash[b as usize] != Some(*h) {
                return Err(format!(
                    "the prefix map points at block {b}, which holds another hash"
                ));
            }
            if !self.is_full(b) {
                return Err(format!(
                    "block {b} is findable by prefix but only {} of its {} slots were computed",
                    self.written[b as usize], self.block_size
                ));
            }
        }
        Ok(())
    }

    fn unlink(&mut self, b: u32) {
        let q = &mut self.queues[self.owner[b as usize] as usize];
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            q.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            q.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        q.len -= 1;
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, b: u32) {
        let q = &mut self.queues[self.owner[b as usize] as usize];
        self.prev[b as usize] = q.tail;
        self.next[b as usize] = NIL;
        if q.tail == NIL {
            q.head = b;
        } else {
            self.next[q.tail as usize] = b;
        }
        q.tail = b;
        q.len += 1;
        self.freed_at[b as usize] = self.clock;
        self.clock += 1;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_until_empty_and_frees_back() {
        let mut p = BlockPool::new(4, 2);
        let got: Vec<u32> = (0..4).filter_map(|_| p.allocate()).collect();
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert_eq!(p.allocate(), None);
        assert_eq!(p.usage(), 1.0);
        for b in got {
            p.release(b);
        }
        assert_eq!(p.num_free(), 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_blocks_are_revived_by_hits_and_evicted_lru() {
        let mut p = BlockPool::new(3, 2);
        let h = |i: u32| BlockHash::new(None, &[i], 0, 0);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.mark_written(a, 2);
        p.mark_written(b, 2);
        p.cache(a, h(1));
        p.cache(b, h(2));
        p.release(a); // a is least recently freed
        p.release(b);
        assert_eq!(p.lookup(h(1)), Some(a));
        p.acquire(a); // a hit revives a
        p.check_invariants().unwrap();
        // The free queue is now [2, b]: block 2 is handed out first, then
        // b, which evicts its hash.
        assert_eq!(p.allocate(), Some(2));
        assert_eq!(p.allocate(), Some(b));
        assert_eq!(p.lookup(h(2)), None);
        assert_eq!(p.lookup(h(1)), Some(a));
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_block_not_fully_written_is_never_findable() {
        let mut p = BlockPool::new(2, 4);
        let h = BlockHash::new(None, &[1, 2, 3, 4], 0, 0);
        let a = p.allocate().unwrap();
        p.mark_written(a, 3);
        // Release builds refuse the hash; debug builds stop at the bug.
        if !cfg!(debug_assertions) {
            p.cache(a, h);
            assert_eq!(p.lookup(h), None);
        }
        p.mark_written(a, 4);
        p.cache(a, h);
        assert_eq!(p.lookup(h), Some(a));
        p.check_invariants().unwrap();
        // Handed out again, the block starts empty and loses its hash.
        p.release(a);
        let _ = p.allocate();
        let again = p.allocate().unwrap();
        assert_eq!(again, a);
        assert!(!p.is_full(a));
        assert_eq!(p.lookup(h), None);
    }

    #[test]
    fn salt_and_parent_change_the_hash() {
        let a = BlockHash::new(None, &[1, 2, 3], 0, 0);
        assert_ne!(a, BlockHash::new(None, &[1, 2, 3], 1, 0));
        assert_ne!(a, BlockHash::new(Some(a), &[1, 2, 3], 0, 0));
        assert_ne!(a, BlockHash::new(None, &[1, 2, 3], 0, 3));
        assert_eq!(a, BlockHash::new(None, &[1, 2, 3], 0, 0));
    }

    /// Allocates, fills and caches one block for `owner`, then frees it:
    /// a cached block of `owner` in the free queue.
    fn cached_block(p: &mut BlockPool, owner: u16, tag: u32) -> Option<u32> {
        let b = p.allocate_for(owner)?;
        p.mark_written(b, p.block_size);
        p.cache(b, BlockHash::new(None, &[tag], 0, 0));
        p.release(b);
        Some(b)
    }

    #[test]
    fn a_reservation_keeps_an_owners_cached_blocks_from_other_owners() {
        let mut p = BlockPool::new(8, 2);
        let calm = p.add_owner(OwnerLimits {
            reserved: 3,
            cap: None,
        });
        let flood = p.add_owner(OwnerLimits::default());
        for tag in 0..3 {
            cached_block(&mut p, calm, tag).unwrap();
        }
        assert_eq!(p.owner_usage(calm).blocks, 3);
        assert_eq!(p.owner_usage(calm).cached, 3);
        // The flood may take the five other blocks, and no more: the calm
        // owner's three are older but reserved.
        assert_eq!(p.available_for(flood), 5);
        let taken: Vec<u32> = std::iter::from_fn(|| p.allocate_for(flood)).collect();
        assert_eq!(taken.len(), 5);
        p.check_invariants().unwrap();
        for tag in 0..3 {
            let h = BlockHash::new(None, &[tag], 0, 0);
            assert!(
                p.lookup(h).is_some(),
                "the calm owner's block {tag} was evicted"
            );
        }
        assert_eq!(p.owner_usage(calm).evicted_by_others, 0);
        // The calm owner itself may recycle its own.
        assert_eq!(p.available_for(calm), 3);
        assert!(p.allocate_for(calm).is_some());
        p.check_invariants().unwrap();
    }

    #[test]
    fn above_its_reservation_an_owner_loses_its_oldest_blocks_first() {
        let mut p = BlockPool::new(6, 2);
        let a = p.add_owner(OwnerLimits {
            reserved: 2,
            cap: None,
        });
        let b = p.add_owner(OwnerLimits::default());
        let first = cached_block(&mut p, a, 1).unwrap();
        cached_block(&mut p, a, 2).unwrap();
        cached_block(&mut p, a, 3).unwrap();
        // Three blocks, one above the reservation: the oldest goes first,
        // but only after the shared queue's older blocks.
        assert_eq!(p.available_for(b), 3 + 1);
        let mut got = Vec::new();
        while let Some(x) = p.allocate_for(b) {
            got.push(x);
        }
        assert_eq!(got.len(), 4);
        assert!(got.contains(&first));
        assert_eq!(p.lookup(BlockHash::new(None, &[1], 0, 0)), None);
        assert!(p.lookup(BlockHash::new(None, &[2], 0, 0)).is_some());
        assert!(p.lookup(BlockHash::new(None, &[3], 0, 0)).is_some());
        assert_eq!(p.owner_usage(a).evicted_by_others, 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_capped_owner_recycles_its_own_blocks_or_gets_none() {
        let mut p = BlockPool::new(8, 2);
        let capped = p.add_owner(OwnerLimits {
            reserved: 0,
            cap: Some(2),
        });
        let x = p.allocate_for(capped).unwrap();
        let y = p.allocate_for(capped).unwrap();
        assert_eq!(p.available_for(capped), 0);
        assert_eq!(p.allocate_for(capped), None);
        // Cached and freed, its blocks still count, and are what it gets.
        p.mark_written(x, 2);
        p.cache(x, BlockHash::new(None, &[9], 0, 0));
        p.release(x);
        assert_eq!(p.available_for(capped), 1);
        assert_eq!(p.allocate_for(capped), Some(x));
        assert_eq!(p.owner_usage(capped).blocks, 2);
        // Freed empty, a block no longer counts.
        p.release(y);
        assert_eq!(p.owner_usage(capped).blocks, 1);
        assert!(p.allocate_for(capped).is_some());
        p.check_invariants().unwrap();
        // Others are not limited by it.
        assert_eq!(p.available_for(SHARED_OWNER), 6);
    }

    #[test]
    fn owners_without_limits_evict_in_plain_lru_order() {
        // Two owners, no limits: the same order one queue would give.
        let mut p = BlockPool::new(4, 2);
        let a = p.add_owner(OwnerLimits::default());
        let b = p.add_owner(OwnerLimits::default());
        let blocks: Vec<u32> = (0..4)
            .map(|i| p.allocate_for(if i % 2 == 0 { a } else { b }).unwrap())
            .collect();
        for (i, &x) in blocks.iter().enumerate() {
            p.mark_written(x, 2);
            p.cache(x, BlockHash::new(None, &[i as u32], 0, 0));
        }
        for &x in blocks.iter().rev() {
            p.release(x);
        }
        let order: Vec<u32> = std::iter::from_fn(|| p.allocate_for(a)).collect();
        assert_eq!(order, blocks.iter().rev().copied().collect::<Vec<_>>());
        p.check_invariants().unwrap();
    }

    #[test]
    fn resetting_the_cache_returns_every_block_to_the_shared_queue() {
        let mut p = BlockPool::new(4, 2);
        let a = p.add_owner(OwnerLimits {
            reserved: 4,
            cap: None,
        });
        cached_block(&mut p, a, 1).unwrap();
        p.reset_prefix_cache().unwrap();
        assert_eq!(p.owner_usage(a).blocks, 0);
        assert_eq!(p.available_for(SHARED_OWNER), 4);
        p.check_invariants().unwrap();
    }
}
