//! Pinned prefixes: blocks `pin_prefix` holds a reference on, so that no eviction takes them
//! until the matching `unpin_prefix` (docs/design.md, Pinned prefixes).
//!
//! A pin holds one reference per block (like one more table would), so a pinned block is in
//! use: never in the LRU, never on the free list, never evicted or reset. Each pin is
//! remembered under the chain hash of its prompt's full blocks (which covers the extra key)
//! with the blocks it pinned, because the walk that unpins could find other blocks: a newer
//! copy of the same content, or a longer cached prefix than at pin time. Pins of one prompt
//! nest; an unpin releases the most recent one.

use rustc_hash::FxHashMap;

use super::hash::BlockHash;
use crate::BlockId;

/// Pins by prompt, and per-block pin counts.
#[derive(Debug, Default)]
pub(crate) struct Pins {
    /// Prompt key (the chain hash of its last full block) -> the blocks each of its pins
    /// holds, oldest pin first (never an empty list of pins, never an empty pin).
    by_prompt: FxHashMap<BlockHash, Vec<Vec<BlockId>>>,
    /// Block -> the pins holding it (> 0).
    counts: FxHashMap<BlockId, u32>,
}

impl Pins {
    /// Records a pin of `blocks` (non-empty) under prompt `key`.
    pub(crate) fn add(&mut self, key: BlockHash, blocks: Vec<BlockId>) {
        debug_assert!(!blocks.is_empty());
        for &b in &blocks {
            *self.counts.entry(b).or_insert(0) += 1;
        }
        self.by_prompt.entry(key).or_default().push(blocks);
    }

    /// Takes the most recent pin of prompt `key`: its blocks, whose counts drop by one.
    pub(crate) fn remove(&mut self, key: BlockHash) -> Option<Vec<BlockId>> {
        let pins = self.by_prompt.get_mut(&key)?;
        let blocks = pins.pop()?;
        if pins.is_empty() {
            self.by_prompt.remove(&key);
        }
        for &b in &blocks {
            match self.counts.get_mut(&b) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    self.counts.remove(&b);
                }
            }
        }
        Some(blocks)
    }

    /// Takes every pin: all their blocks, one entry per reference they held.
    pub(crate) fn take_all(&mut self) -> Vec<BlockId> {
        self.counts.clear();
        self.by_prompt
            .drain()
            .flat_map(|(_, p)| p)
            .flatten()
            .collect()
    }

    /// Distinct pinned blocks.
    pub(crate) fn num_pinned_blocks(&self) -> usize {
        self.counts.len()
    }

    /// Pinned blocks with their pin counts.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockId, u32)> + '_ {
        self.counts.iter().map(|(&b, &n)| (b, n))
    }

    /// Verifies the counts against the recorded pins.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut tally: FxHashMap<BlockId, u32> = FxHashMap::default();
        for pins in self.by_prompt.values() {
            if pins.is_empty() || pins.iter().any(Vec::is_empty) {
                return Err("an empty pin is recorded".into());
            }
            for &b in pins.iter().flatten() {
                *tally.entry(b).or_insert(0) += 1;
            }
        }
        if tally != self.counts {
            return Err("pin counts disagree with the recorded pins".into());
        }
        Ok(())
    }
}
