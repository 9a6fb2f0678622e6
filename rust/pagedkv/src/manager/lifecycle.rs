//! Fork and free: sequences sharing every block of a parent, and sequences leaving.

use super::checks::check_distinct;
use super::group_spec::NULL_BLOCK;
use super::state::{KvCacheManager, Sequence};
use crate::error::{Error, Result};
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Creates `child_id` sharing every block of `parent_id` (refcounts +1).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;
    /// kv.fork(1, 2)?;
    /// assert_eq!(kv.block_table(2)?, kv.block_table(1)?);
    /// assert_eq!(kv.fork(1, 2), Err(Error::SequenceExists(2)));
    /// assert_eq!(kv.fork(9, 3), Err(Error::UnknownSequence(9)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn fork(&mut self, parent_id: SeqId, child_id: SeqId) -> Result<()> {
        let parent = self.resident(parent_id)?;
        if self.seqs.contains_key(&child_id) {
            return Err(Error::SequenceExists(child_id));
        }
        // A prefilling parent would share blocks both would write (docs/design.md, Computed
        // watermark); the child copies the watermark, which is then the parent's length.
        Self::check_computed(parent_id, parent)?;
        let mut child = parent.clone();
        // The child shares the blocks that hold the parent's tokens; a parent holding
        // lookahead slots (`allocate_slots`) gives them up, since its partial block becomes
        // shared (docs/design.md, Invariants 4: a sequence holding slots past its tokens shares
        // none of the blocks its appends write).
        let bs = self.block_size;
        let lookahead = child.table.free_slots(bs) >= bs;
        if lookahead {
            let keep = child.table.num_tokens.div_ceil(bs);
            child.table.block_ids.truncate(keep);
            for t in child.groups.iter_mut() {
                t.truncate(keep);
            }
        }
        let live = |child: &Sequence| {
            (0..child.groups.len() + 1)
                .flat_map(|g| child.group_table(g).iter().copied())
                .filter(|&b| b != NULL_BLOCK)
                .collect::<Vec<BlockId>>()
        };
        let mut failure = None;
        let mut shared = 0;
        for &b in child.table.block_ids.iter().filter(|&&b| b != NULL_BLOCK) {
            if let Err(e) = self.share(b) {
                failure = Some(e);
                break;
            }
            shared += 1;
        }
        if failure.is_none() && !child.groups.is_empty() {
            for b in live(&child).into_iter().skip(shared) {
                if let Err(e) = self.share(b) {
                    failure = Some(e);
                    break;
                }
                shared += 1;
            }
        }
        if let Some(e) = failure {
            for b in live(&child).into_iter().take(shared) {
                self.release(b);
            }
            return Err(e);
        }
        let positions = child.num_positions();
        self.seqs.insert(child_id, child);
        self.counters.forks += 1;
        self.note_placed_all(child_id, 0..positions, false);
        if lookahead {
            self.drop_lookahead(parent_id, positions);
        }
        Ok(())
    }

    /// Shrinks resident sequence `seq_id`'s tables to `keep` positions, releasing the
    /// lookahead blocks past them (private, never indexed).
    #[cold]
    fn drop_lookahead(&mut self, seq_id: SeqId, keep: usize) {
        let row = self.seqs.row(seq_id).expect("a live sequence");
        for g in 0..self.num_groups() {
            let tail = self.seqs.at_mut(row).group_table_mut(g).split_off(keep);
            self.release_table(&tail);
        }
    }

    /// Frees a sequence (resident or swapped out): every block loses one reference; blocks
    /// reaching 0 become free, or cached-evictable when their content is indexed.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;
    /// kv.free(1)?;
    /// assert_eq!(kv.free(1), Err(Error::UnknownSequence(1)));
    /// assert_eq!(kv.num_available_blocks(), 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn free(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .remove(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if seq.swapped {
            self.num_swapped -= 1;
            let host = self
                .host
                .as_mut()
                .expect("swapped sequences imply a host tier");
            for g in 0..seq.groups.len() + 1 {
                for &h in seq.group_table(g) {
                    if h != NULL_BLOCK {
                        host.release(h);
                    }
                }
            }
            return Ok(());
        }
        if !self.plain {
            // Group by group, each table tail first (vLLM's order); released positions hold
            // no block.
            for g in 0..seq.groups.len() + 1 {
                self.release_table(seq.group_table(g));
            }
            return Ok(());
        }
        // Tail first: with prefix caching the tail blocks then sit ahead of the head blocks in
        // the eviction order (a shared prefix is likelier to be hit again than a tail).
        if self.prefix.is_none() {
            // The blocks reaching 0 go back to the pool together (one free-list update).
            let mut freed = 0;
            let result = self
                .pool
                .release_chain(seq.table.block_ids.iter().rev().copied(), &mut freed);
            self.num_blocks_in_use -= freed;
            self.counters.blocks_freed += freed as u64;
            // Our table held a reference to each block, so the pool cannot refuse; if it does,
            // a refcount was corrupted elsewhere and check_invariants will report it.
            debug_assert!(
                result.is_ok(),
                "release of a table block failed: {result:?}"
            );
            seq.dispose();
            return Ok(());
        }
        self.release_all(&seq.table.block_ids);
        seq.dispose();
        Ok(())
    }

    /// Frees a sequence as [`Self::free`] does, except the order in which its blocks that
    /// become cached-evictable join the eviction order: the last group's first, each table
    /// tail first. That is the order of one release of every group's table joined group after
    /// group and reversed, as vLLM's scheduler returns a deferred free's blocks (popped in
    /// allocation order, freed reversed in one call); the blocks that become free go back in
    /// [`Self::free`]'s order, which that one release keeps. One group: [`Self::free`].
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;
    /// kv.free_last_group_first(1)?;
    /// assert_eq!(kv.num_available_blocks(), 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn free_last_group_first(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if self.plain || seq.swapped || seq.groups.is_empty() {
            return self.free(seq_id);
        }
        let seq = self
            .seqs
            .remove(&seq_id)
            .expect("the sequence was just looked up");
        let tables: Vec<&[BlockId]> = (0..seq.groups.len() + 1)
            .map(|g| seq.group_table(g))
            .collect();
        self.release_tables_last_group_first(&tables);
        Ok(())
    }

    /// Frees several sequences; every id is validated (known, no duplicates) before any is
    /// freed.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 1)?;
    /// kv.add_sequence_len(2, 1)?;
    /// assert!(kv.free_batch(&[1, 3]).is_err());
    /// assert!(kv.contains(1));
    /// kv.free_batch(&[1, 2])?;
    /// assert_eq!(kv.num_sequences(), 0);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn free_batch(&mut self, seq_ids: &[SeqId]) -> Result<()> {
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            if !self.seqs.contains_key(&id) {
                return Err(Error::UnknownSequence(id));
            }
        }
        for &id in seq_ids {
            self.free(id)?;
        }
        Ok(())
    }
}
