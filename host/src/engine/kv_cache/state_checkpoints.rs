//! Checkpoints of a hybrid model's recurrent state at block boundaries, so
//! that a prefix-cache hit restores the linear-attention layers' state as
//! well as the attention layers' K/V (vLLM's "align" mode for hybrid
//! prefix caching).
//!
//! A Gated DeltaNet layer keeps one fixed-size state per sequence, the sum
//! of everything it has read; the state after `k` blocks of a prompt cannot
//! be rebuilt from K/V. So the runner copies a sequence's state slot into a
//! checkpoint slot after a step that ends exactly on a block boundary, and
//! the checkpoint is filed under the hash of the block that ends there (the
//! chain hash of every token before, salted per tenant and adapter like the
//! blocks). A later prompt with the same prefix hits the cache only up to a
//! block whose checkpoint exists, and its first step starts from a copy of
//! that checkpoint. The scheduler ends prefill chunks on block boundaries
//! for this (and splits a prompt's last chunk at its last full block), so a
//! hit computes exactly what the cold run computed after that boundary:
//! the same kernels over the same tokens from the same state.
//!
//! Checkpoints live in a fixed number of slots beside the sequences' own
//! (counted in the memory budget); when all are taken the least recently
//! used is overwritten. A checkpoint only names a state: it is usable while
//! its block (and every block before it) is still in the prefix cache, which
//! [`super::KvCacheManager::lookup_prefix`] checks first.

use super::block_pool::BlockHash;
use std::collections::HashMap;

/// One checkpoint slot's contents.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// The block whose end the state is at.
    hash: BlockHash,
    /// The step that writes it has run ([`StateCheckpoints::confirm`]);
    /// until then the slot holds whatever it held before.
    written: bool,
    /// When it was last planned or used, for eviction.
    used: u64,
}

/// Which checkpoint slot holds the state at the end of which block.
#[derive(Debug)]
pub struct StateCheckpoints {
    slots: Vec<Option<Slot>>,
    by_hash: HashMap<BlockHash, u32>,
    clock: u64,
}

impl StateCheckpoints {
    /// `n` empty checkpoint slots.
    pub fn new(n: usize) -> StateCheckpoints {
        StateCheckpoints {
            slots: vec![None; n],
            by_hash: HashMap::new(),
            clock: 0,
        }
    }

    /// The slot holding the written state at the end of block `hash`.
    pub fn find(&self, hash: BlockHash) -> Option<u32> {
        let &slot = self.by_hash.get(&hash)?;
        let s = self.slots.get(slot as usize)?.as_ref()?;
        s.written.then_some(slot)
    }

    /// Marks `slot` as just used (a hit restored from it), so it is evicted
    /// after the others.
    pub fn touch(&mut self, slot: u32) {
        self.clock += 1;
        if let Some(Some(s)) = self.slots.get_mut(slot as usize) {
            s.used = self.clock;
        }
    }

    /// A slot for the state at the end of block `hash`, which a step about
    /// to run computes: `None` when a written checkpoint already holds it;
    /// otherwise a free slot, or the least recently used one (its old
    /// checkpoint forgotten). The runner copies into it after the step's
    /// forward pass and restores out of slots before it, so a slot restored
    /// from and overwritten in the same step gives the restore its old
    /// contents.
    pub fn plan(&mut self, hash: BlockHash) -> Option<u32> {
        self.clock += 1;
        if let Some(&slot) = self.by_hash.get(&hash) {
            if let Some(Some(s)) = self.slots.get_mut(slot as usize) {
                s.used = self.clock;
                // Planned by a sequence whose step never ran: this one
                // writes it.
                return (!s.written).then_some(slot);
            }
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                let oldest = self
                    .slots
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, s)| s.map_or(0, |s| s.used))
                    .map(|(i, _)| i)?;
                if let Some(old) = self.slots[oldest].take() {
                    self.by_hash.remove(&old.hash);
                }
                oldest
            }
        };
        self.slots[slot] = Some(Slot {
            hash,
            written: false,
            used: self.clock,
        });
        self.by_hash.insert(hash, slot as u32);
        Some(slot as u32)
    }

    /// Records that the step which copies the state at the end of block
    /// `hash` into `slot` has run.
    pub fn confirm(&mut self, slot: u32, hash: BlockHash) {
        if let Some(Some(s)) = self.slots.get_mut(slot as usize) {
            if s.hash == hash {
                s.written = true;
            }
        }
    }

    /// Forgets every checkpoint (the prefix cache was reset).
    pub fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
        self.by_hash.clear();
    }

    /// Slots in all.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u32) -> BlockHash {
        BlockHash::new(None, &[n], 0, 0)
    }

    #[test]
    fn a_checkpoint_is_found_only_once_its_step_ran() {
        let mut c = StateCheckpoints::new(2);
        let s = c.plan(h(1)).expect("a free slot");
        assert_eq!(c.find(h(1)), None, "planned, not written");
        c.confirm(s, h(1));
        assert_eq!(c.find(h(1)), Some(s));
        assert_eq!(c.plan(h(1)), None, "already written");
    }

    #[test]
    fn an_unwritten_plan_is_handed_to_the_next_sequence_that_computes_it() {
        let mut c = StateCheckpoints::new(2);
        let s = c.plan(h(1)).expect("a free slot");
        assert_eq!(c.plan(h(1)), Some(s));
    }

    #[test]
    fn the_least_recently_used_checkpoint_makes_room() {
        let mut c = StateCheckpoints::new(2);
        let a = c.plan(h(1)).expect("slot");
        c.confirm(a, h(1));
        let b = c.plan(h(2)).expect("slot");
        c.confirm(b, h(2));
        c.touch(a);
        let third = c.plan(h(3)).expect("an evicted slot");
        assert_eq!(third, b, "h(2) was used last longest ago");
        assert_eq!(c.find(h(2)), None);
        assert_eq!(c.find(h(1)), Some(a));
        // A confirmation for what the slot no longer holds changes nothing.
        c.confirm(b, h(2));
        assert_eq!(c.find(h(2)), None);
        assert_eq!(c.find(h(3)), None);
    }

    #[test]
    fn no_slots_no_checkpoints() {
        let mut c = StateCheckpoints::new(0);
        assert_eq!(c.plan(h(1)), None);
        assert!(c.is_empty());
    }
}
