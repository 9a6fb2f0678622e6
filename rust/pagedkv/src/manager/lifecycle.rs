//! Fork and free: sequences sharing every block of a parent, and sequences leaving.

use super::{check_distinct, KvCacheManager};
use crate::error::{Error, Result};
use crate::SeqId;

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
        if let Some(h) = self.hybrid.as_deref_mut() {
            return h.fork(parent_id, child_id);
        }
        let parent = self.resident(parent_id)?;
        if self.seqs.contains_key(&child_id) {
            return Err(Error::SequenceExists(child_id));
        }
        // A prefilling parent would share blocks both would write (docs/design.md, Computed
        // watermark); the child copies the watermark, which is then the parent's length.
        Self::check_computed(parent_id, parent)?;
        let child = parent.clone();
        for (i, &b) in child.table.block_ids.iter().enumerate() {
            if let Err(e) = self.share(b) {
                for &done in &child.table.block_ids[..i] {
                    self.release(done);
                }
                return Err(e);
            }
        }
        self.seqs.insert(child_id, child);
        self.counters.forks += 1;
        Ok(())
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
        if let Some(h) = self.hybrid.as_deref_mut() {
            return h.free(seq_id);
        }
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
            for &h in &seq.table.block_ids {
                host.release(h);
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
            return Ok(());
        }
        self.release_all(&seq.table.block_ids);
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
        if let Some(h) = self.hybrid.as_deref_mut() {
            return h.free_batch(seq_ids);
        }
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
