//! Which LoRA adapter sits in which of the model's adapter slots
//! (`--max-loras`): the runner keeps every adapter the step's rows use
//! resident, loading an adapter into a free slot, or else into the slot of
//! the adapter least recently used that no row of the step needs. The
//! scheduler never runs more distinct adapters than there are slots, so a
//! slot is always found.

use crate::engine::lora::LoadedLora;
use anyhow::{bail, Result};
use std::sync::Arc;

/// The slots' occupants.
#[derive(Debug, Default)]
pub struct LoraSlots {
    /// Per slot: the adapter's id and the step that last used it.
    slots: Vec<Option<(u32, u64)>>,
    step: u64,
}

impl LoraSlots {
    /// `n` empty slots.
    pub fn new(n: usize) -> LoraSlots {
        LoraSlots {
            slots: vec![None; n],
            step: 0,
        }
    }

    /// The slot adapter `id` sits in.
    pub fn slot_of(&self, id: u32) -> Option<u16> {
        self.slots
            .iter()
            .position(|s| s.is_some_and(|(i, _)| i == id))
            .map(|p| p as u16)
    }

    /// Makes every adapter of `needed` (distinct) resident for the next
    /// step; pushes to `loads` the slots whose occupant must be (re)loaded.
    pub fn assign(
        &mut self,
        needed: &[Arc<LoadedLora>],
        loads: &mut Vec<(usize, Arc<LoadedLora>)>,
    ) -> Result<()> {
        self.step += 1;
        for lora in needed {
            if let Some(s) = self.slot_of(lora.id) {
                self.slots[s as usize] = Some((lora.id, self.step));
                continue;
            }
            // A free slot, else the least recently used one that this step
            // does not need.
            let free = self.slots.iter().position(Option::is_none).or_else(|| {
                self.slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.is_some_and(|(_, used)| used < self.step))
                    .min_by_key(|(_, s)| s.map_or(0, |(_, used)| used))
                    .map(|(i, _)| i)
            });
            let Some(s) = free else {
                bail!(
                    "a step needs {} LoRA adapters at once, above the {} slots (--max-loras)",
                    needed.len(),
                    self.slots.len()
                );
            };
            self.slots[s] = Some((lora.id, self.step));
            loads.push((s, Arc::clone(lora)));
        }
        Ok(())
    }
}
