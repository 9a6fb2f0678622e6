//! `evict_blocks`: drops chosen blocks from the prefix index by id, as a KV connector needs
//! when the content it loaded into them turned out invalid (vLLM's `evict_blocks`, called on a
//! failed synchronous load). No other block is touched and nothing is allocated.

use rustc_hash::FxHashSet;

use super::state::KvCacheManager;
use crate::error::{invalid, Result};
use crate::BlockId;

impl KvCacheManager {
    /// Removes the prefix-index entry of every block of `block_ids` that has one, in the given
    /// order, each with its `BlockRemoved` event; returns how many entries it removed.
    ///
    /// * a block in use stays in the tables holding it, as a private block: no later prompt
    ///   hits it, and when its last holder releases it, it goes back to the free list;
    /// * a cached-evictable block goes back to the pool's free list at once (counted as an
    ///   eviction), without passing through the offload tier (its content is not trusted);
    /// * a block without an index entry (free, the null block, a block of another manager on
    ///   a shared pool, one named twice) is left as it is, as vLLM leaves a block without a
    ///   hash.
    ///
    /// Without prefix caching nothing is indexed: `Ok(0)` for ids in range. An id past the
    /// pool, or a pinned block (a pin promises its entry stays), is
    /// [`crate::Error::InvalidArgument`], changing nothing.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4], None)?;   // two full blocks, both indexed
    /// let table = kv.block_table(1)?.to_vec();
    /// kv.take_events();
    /// assert_eq!(kv.evict_blocks(&table[1..])?, 1);
    /// assert_eq!(kv.take_events().len(), 1);    // one BlockRemoved
    /// kv.add_sequence(2, &[1, 2, 3, 4], None)?; // hits the first block only
    /// assert_eq!(kv.block_table(2)?[0], table[0]);
    /// assert_ne!(kv.block_table(2)?[1], table[1]);
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn evict_blocks(&mut self, block_ids: &[BlockId]) -> Result<usize> {
        let num_blocks = self.pool.num_blocks();
        if let Some(&b) = block_ids.iter().find(|&&b| b as usize >= num_blocks) {
            return invalid(format!(
                "evict_blocks: block id {b} is out of range (the pool has {num_blocks} blocks)"
            ));
        }
        let Some(prefix) = self.prefix.as_mut() else {
            return Ok(0);
        };
        if prefix.pins.num_pinned_blocks() > 0 {
            let pinned: FxHashSet<BlockId> = prefix.pins.iter().map(|(b, _)| b).collect();
            if let Some(&b) = block_ids.iter().find(|b| pinned.contains(b)) {
                return invalid(format!(
                    "evict_blocks: block {b} is pinned (unpin its prefix first)"
                ));
            }
        }
        let mut removed = 0;
        for &b in block_ids {
            if !prefix.is_indexed(b) {
                continue;
            }
            if prefix.is_cached(b) {
                prefix.release_cached(b, &self.pool);
            } else {
                prefix.unindex_in_use(b);
            }
            removed += 1;
        }
        Ok(removed)
    }
}
