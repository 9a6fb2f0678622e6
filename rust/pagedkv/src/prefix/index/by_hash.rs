//! Look-ups of indexed content by its hash alone, with no chain: vLLM's
//! `BlockPool.get_cached_block(block_hash, group_ids)`, which its auxiliary-output connector
//! asks of blocks in any order (docs/integrations/vllm.md, Auxiliary outputs).
//!
//! A chained block has no map entry (reachable only through its parent's child hint, see the
//! module docs of `index.rs`), so a look-up by hash alone could miss content that is indexed.
//! The first such look-up gives every chained block its map entry, and from then on an
//! admission enters each block with [`BlockIndex::insert`] (`PrefixCache::register_chained_run`
//! enters none): every indexed block is on the map, and the map answers exactly. The index's
//! content and every hit stay the same; only the chained runs' saving is given up, and only by
//! a manager that asks.

use super::BlockIndex;
use crate::prefix::hash::BlockHash;
use crate::BlockId;

impl BlockIndex {
    /// Whether content is looked up by hash alone (no block is chained then).
    #[inline]
    pub(crate) fn by_hash(&self) -> bool {
        self.by_hash
    }

    /// From now on every indexed block is on the map: each chained block gets its map entry
    /// (O(blocks), once) and no block is chained again. Also asked before the caller names
    /// blocks (its block hashes, or hashes given as pagedkv's own): the caller may give one
    /// name to different contents, and [`BlockIndex::insert`] refuses a name the map holds for
    /// other content, where a chained entry, off the map, would take it a second time.
    pub(crate) fn enter_by_hash(&mut self) {
        if self.by_hash {
            return;
        }
        self.by_hash = true;
        for c in 0..self.stored.len() {
            if self.stored[c].is_chained() {
                self.promote(c as BlockId);
            }
        }
        debug_assert_eq!(self.num_chained, 0);
    }

    /// The indexed block entered under `hash`, from the first call on with no chained block
    /// left (O(blocks) once; O(1) after).
    pub(crate) fn get_by_hash(&mut self, hash: BlockHash) -> Option<BlockId> {
        self.enter_by_hash();
        let stored = &self.stored;
        let b = self.map.get(hash, |b| stored[b as usize].hash)?;
        self.holds(b, hash).then_some(b)
    }
}
