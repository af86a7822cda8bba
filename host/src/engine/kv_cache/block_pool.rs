//! Block ids, their reference counts, the LRU queue of free blocks, and the
//! map from prefix hashes to cached blocks.
//!
//! A block whose reference count drops to zero keeps its contents and its
//! hash: it sits in the free queue and can be revived by a prefix hit until
//! it is handed out again, which evicts it.
//!
//! The pool also counts, for each block, how many of its slots the model
//! has written since the block was handed out ([`BlockPool::mark_written`]).
//! A hash is accepted only for a block whose every slot was written, so a
//! block can never become findable by prefix before its K/V exists
//! ([`BlockPool::cache`], [`BlockPool::check_invariants`]). The free queue is an intrusive
//! doubly-linked list over arrays, so every operation is O(1) and none
//! allocates after construction.

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

/// All blocks of one device's KV cache.
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
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots each.
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
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
        }
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks nobody references (cached or not): what can be handed out.
    pub fn num_free(&self) -> usize {
        self.num_free
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

    /// Takes the least recently freed block, evicting its cached contents.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.hash[b as usize].take() {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
                if let Some(e) = &mut self.evictions {
                    e.push(h);
                }
            }
        }
        self.ref_cnt[b as usize] = 1;
        self.written[b as usize] = 0;
        Some(b)
    }

    /// Adds a reference to `block` (a prefix hit), reviving it from the
    /// free queue if nobody held it.
    pub fn acquire(&mut self, block: u32) {
        if self.ref_cnt[block as usize] == 0 {
            self.unlink(block);
        }
        self.ref_cnt[block as usize] += 1;
    }

    /// Drops a reference; at zero the block joins the tail of the free
    /// queue, keeping its contents for later prefix hits.
    pub fn release(&mut self, block: u32) {
        let rc = &mut self.ref_cnt[block as usize];
        debug_assert!(*rc > 0, "double free of block {block}");
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
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

    /// Checks the pool's invariants: the free queue holds exactly the
    /// blocks with no references, and the hash map points at blocks that
    /// carry that hash and whose every slot was written. Tests call this
    /// after every scenario (and the engine's tests after every step).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.ref_cnt.len()];
        let mut count = 0;
        let mut prev = NIL;
        let mut b = self.head;
        while b != NIL {
            if seen[b as usize] {
                return Err(format!("block {b} appears twice in the free queue"));
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
            count += 1;
            prev = b;
            b = self.next[b as usize];
        }
        if prev != self.tail {
            return Err("the free queue's tail is wrong".into());
        }
        if count != self.num_free {
            return Err(format!(
                "free queue holds {count} blocks but num_free is {}",
                self.num_free
            ));
        }
        for (i, &rc) in self.ref_cnt.iter().enumerate() {
            if rc == 0 && !seen[i] {
                return Err(format!(
                    "block {i} has no references but is not in the free queue"
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
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
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
}
