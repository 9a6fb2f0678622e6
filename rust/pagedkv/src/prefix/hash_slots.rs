//! The prefix index's hash table: 128-bit block hash -> block id, by open addressing with
//! linear probing, sized once for every block of the pool and never grown.
//!
//! Each slot is 8 bytes, the block id and the hash's low 32 bits (its *tag*); the full hash
//! lives in the block's own record, which the caller reads through `hash_of` only when a tag
//! matches (a hit reads that record anyway, to verify the block's tokens). The table has at
//! least four times as many slots as the pool has blocks (32 bytes per block, what one
//! hashbrown bucket of a `u128 -> u32` map takes), and a block is indexed at most once, so the
//! load factor never exceeds 1/4: a hit probes ~1.2 slots, a miss ~1.4. Removal shifts
//! the following entries of the cluster back (no tombstones), so probe lengths do not decay
//! under the all-miss churn where every admitted block evicts a cached one.
//!
//! Why not std's `HashMap` (hashbrown) keyed by the hash: on all-miss prefix admission its
//! inserts and removals were a large share of the cost (callgrind, `prefix_miss`, in
//! benches/results/2026-12-02-prefix-admission.md; group probing, control-byte mirroring,
//! 32-byte buckets), for a table whose keys are already uniform keyed
//! hashes, whose size is fixed and whose every key is stored elsewhere. The home slot is the
//! hash's low bits with no further mixing: the keyed hash spreads them (see `hash.rs` on
//! keeping the seed secret where clients choose prompts).

use super::hash::BlockHash;
use crate::BlockId;

/// An empty slot's block id (no block has it: pools hold fewer than 2^24 blocks).
const EMPTY: BlockId = BlockId::MAX;

/// One slot: a block id and the low 32 bits of the hash it is indexed under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    tag: u32,
    block: BlockId,
}

const VACANT: Slot = Slot {
    tag: 0,
    block: EMPTY,
};

/// The low 32 bits of a hash: the slot's tag, and (masked) its home slot.
#[inline]
fn tag_of(hash: BlockHash) -> u32 {
    hash as u32
}

/// Where a probe for a hash ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The hash is present at this slot, naming this block.
    Found { slot: usize, block: BlockId },
    /// The hash is absent; this is the empty slot it would go to.
    Vacant { slot: usize },
}

/// Block hash -> block id (see the module docs).
///
/// Invariants (checked by [`HashSlots::check`]): `len` slots are occupied; every occupied
/// slot is reachable from its home slot (no empty slot between them, cyclically); no two
/// occupied slots name the same block.
#[derive(Debug)]
pub(crate) struct HashSlots {
    /// A power of two of them.
    slots: Box<[Slot]>,
    /// Occupied slots.
    len: usize,
}

impl HashSlots {
    /// A table for at most `max_entries` entries (at least four times as many slots).
    pub(crate) fn new(max_entries: usize) -> Self {
        let num_slots = max_entries.saturating_mul(4).max(4).next_power_of_two();
        HashSlots {
            slots: vec![VACANT; num_slots].into_boxed_slice(),
            len: 0,
        }
    }

    /// `slots.len() - 1`, a power of two minus one: `i & mask` is always in bounds, which the
    /// compiler sees when the mask is read from the slice length (no bounds checks).
    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Finds `hash`; `hash_of(block)` returns the full hash a block is indexed under.
    #[inline]
    pub(crate) fn probe(&self, hash: BlockHash, hash_of: impl Fn(BlockId) -> BlockHash) -> Probe {
        let tag = tag_of(hash);
        let mask = self.mask();
        let mut slot = tag as usize & mask;
        loop {
            let s = self.slots[slot];
            if s.block == EMPTY {
                return Probe::Vacant { slot };
            }
            if s.tag == tag && hash_of(s.block) == hash {
                return Probe::Found {
                    slot,
                    block: s.block,
                };
            }
            slot = (slot + 1) & mask;
        }
    }

    /// The block indexed under `hash`.
    #[inline]
    pub(crate) fn get(
        &self,
        hash: BlockHash,
        hash_of: impl Fn(BlockId) -> BlockHash,
    ) -> Option<BlockId> {
        match self.probe(hash, hash_of) {
            Probe::Found { block, .. } => Some(block),
            Probe::Vacant { .. } => None,
        }
    }

    /// The home slot of `hash`'s block id, read only to load its cache line
    /// (`crate::prefetch`).
    #[inline]
    pub(crate) fn home_word(&self, hash: BlockHash) -> u64 {
        u64::from(self.slots[tag_of(hash) as usize & self.mask()].block)
    }

    /// Fills the empty `slot` a probe for `hash` returned with `block`.
    #[inline]
    pub(crate) fn fill(&mut self, slot: usize, hash: BlockHash, block: BlockId) {
        debug_assert_eq!(self.slots[slot].block, EMPTY);
        debug_assert!(block != EMPTY);
        debug_assert!(
            self.len < self.slots.len() / 4,
            "table sized for fewer entries"
        );
        self.slots[slot] = Slot {
            tag: tag_of(hash),
            block,
        };
        self.len += 1;
    }

    /// Makes the occupied `slot` (same hash) name `block` instead.
    #[inline]
    pub(crate) fn replace(&mut self, slot: usize, block: BlockId) {
        debug_assert!(self.slots[slot].block != EMPTY && block != EMPTY);
        self.slots[slot].block = block;
    }

    /// Empties the occupied `slot`, moving later entries of its cluster back so that each
    /// stays reachable from its home slot (Knuth's algorithm R for linear probing).
    pub(crate) fn remove_at(&mut self, mut slot: usize) {
        debug_assert!(self.slots[slot].block != EMPTY);
        let mask = self.mask();
        let mut next = slot;
        loop {
            next = (next + 1) & mask;
            let s = self.slots[next];
            if s.block == EMPTY {
                break;
            }
            // `s` may move to `slot` unless its home lies cyclically in (slot, next].
            let home = s.tag as usize & mask;
            let stays = if slot <= next {
                slot < home && home <= next
            } else {
                slot < home || home <= next
            };
            if !stays {
                self.slots[slot] = s;
                slot = next;
            }
        }
        self.slots[slot] = VACANT;
        self.len -= 1;
    }

    /// The blocks named by occupied slots.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.slots
            .iter()
            .filter(|s| s.block != EMPTY)
            .map(|s| s.block)
    }

    /// Verifies the invariants above; `hash_of` gives each named block's hash.
    pub(crate) fn check(&self, hash_of: impl Fn(BlockId) -> BlockHash) -> Result<(), String> {
        let occupied = self.slots.iter().filter(|s| s.block != EMPTY).count();
        if occupied != self.len {
            return Err(format!("{occupied} slots occupied, len {}", self.len));
        }
        // A probe ends at an empty slot: with none, one would never end.
        if occupied >= self.slots.len() {
            return Err("hash table has no empty slot".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (at, s) in self.slots.iter().enumerate() {
            if s.block == EMPTY {
                continue;
            }
            if !seen.insert(s.block) {
                return Err(format!("hash table names block {} twice", s.block));
            }
            let hash = hash_of(s.block);
            if s.tag != tag_of(hash) {
                return Err(format!("slot {at}: tag does not match block {}", s.block));
            }
            let found = Probe::Found {
                slot: at,
                block: s.block,
            };
            if self.probe(hash, &hash_of) != found {
                return Err(format!(
                    "slot {at}: block {} unreachable from home",
                    s.block
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Hashes chosen to collide on their home slot and tag in a small table: the high bits
    /// tell them apart (so `hash_of` is consulted), the low bits pick a few homes.
    fn hash(key: u8) -> BlockHash {
        (u128::from(key) << 64) | u128::from(key % 3)
    }

    /// Every operation against a `HashMap` model, with the invariants checked after each,
    /// in a table of 16 slots (4 entries), so clusters wrap around the end.
    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8),
        Remove(u8),
        Replace(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..24).prop_map(Op::Insert),
            (0u8..24).prop_map(Op::Remove),
            (0u8..24).prop_map(Op::Replace),
        ]
    }

    proptest! {
        #[test]
        fn matches_a_map_model(ops in proptest::collection::vec(op(), 1..200), shift in 0u32..16) {
            // Rotating every hash's low bits moves the clusters across the table's end.
            let h = |k: u8| hash(k).wrapping_add(u128::from(shift) * 5);
            let mut table = HashSlots::new(4);
            let mut model: HashMap<u8, BlockId> = HashMap::new();
            // Block ids are unique per entry; `key_of[b]` is the key block b holds.
            let mut key_of: HashMap<BlockId, u8> = HashMap::new();
            let mut next_block: BlockId = 0;
            for op in ops {
                let hash_of = |b: BlockId| h(key_of[&b]);
                match op {
                    Op::Insert(k) => {
                        let probe = table.probe(h(k), hash_of);
                        match (probe, model.get(&k)) {
                            (Probe::Found { block, .. }, Some(&want)) => prop_assert_eq!(block, want),
                            (Probe::Vacant { slot }, None) => {
                                if model.len() < 4 {
                                    table.fill(slot, h(k), next_block);
                                    model.insert(k, next_block);
                                    key_of.insert(next_block, k);
                                    next_block += 1;
                                }
                            }
                            (probe, want) => prop_assert!(false, "{probe:?} vs {want:?}"),
                        }
                    }
                    Op::Remove(k) => match table.probe(h(k), hash_of) {
                        Probe::Found { slot, block } => {
                            prop_assert_eq!(model.remove(&k), Some(block));
                            table.remove_at(slot);
                        }
                        Probe::Vacant { .. } => prop_assert!(!model.contains_key(&k)),
                    },
                    Op::Replace(k) => {
                        if let Probe::Found { slot, .. } = table.probe(h(k), hash_of) {
                            table.replace(slot, next_block);
                            model.insert(k, next_block);
                            key_of.insert(next_block, k);
                            next_block += 1;
                        }
                    }
                }
                let hash_of = |b: BlockId| h(key_of[&b]);
                table.check(hash_of).map_err(TestCaseError::fail)?;
                prop_assert_eq!(table.len(), model.len());
                for k in 0u8..24 {
                    prop_assert_eq!(table.get(h(k), hash_of), model.get(&k).copied());
                }
            }
        }
    }

    #[test]
    fn sized_for_twice_the_entries() {
        assert_eq!(HashSlots::new(0).slots.len(), 4);
        assert_eq!(HashSlots::new(3).slots.len(), 16);
        assert_eq!(HashSlots::new(4).slots.len(), 16);
        assert_eq!(HashSlots::new(5).slots.len(), 32);
    }
}
