//! Queue-aware eviction (docs/scheduling.md): a scheduler marks the block hashes its waiting
//! requests will hit, and the prefix cache evicts those blocks only after every other cached
//! block (`prefix/eviction_order.rs`). Off until the first mark.

use super::KvCacheManager;
use crate::error::{invalid, Result};
use crate::prefix::hash::BlockHash;

impl KvCacheManager {
    /// Marks the prefix-cache blocks named by `block_hashes` (chained hashes, as
    /// [`Self::prefix_block_hashes`] returns them) as `wanted` by a waiting request, or no
    /// longer wanted. A cached block under a wanted hash is evicted only when no other cached
    /// block is left (by `add_sequence`'s evictions and by [`Self::evict_cached`] alike). A mark
    /// names a hash, so it may come before the block is cached or while it is in use; marking a
    /// hash twice, or unmarking one never marked, changes nothing. The first call turns the
    /// queue-aware order on for the manager's lifetime; until then eviction is the plain LRU.
    /// Needs prefix caching and a single KV-cache group (`InvalidArgument` otherwise, changing
    /// nothing).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// let (wanted, other) = ([1, 2, 9], [3, 4, 9]);
    /// kv.add_sequence(1, &wanted, None)?;
    /// kv.free(1)?;                                  // older in the LRU
    /// kv.add_sequence(2, &other, None)?;
    /// kv.free(2)?;
    /// kv.set_eviction_priority(&kv.prefix_block_hashes(&wanted, None), true)?;
    /// assert_eq!(kv.evict_cached(1), 1);            // evicts `other`'s block, not `wanted`'s
    /// assert_eq!(kv.match_prefix(&wanted, None)?, 2);
    /// assert_eq!(kv.match_prefix(&other, None)?, 0);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn set_eviction_priority(
        &mut self,
        block_hashes: &[BlockHash],
        wanted: bool,
    ) -> Result<()> {
        let grouped = self.num_groups() > 1;
        let Some(prefix) = self.prefix.as_mut() else {
            return invalid("set_eviction_priority needs prefix caching");
        };
        if grouped || prefix.grouped {
            return invalid("set_eviction_priority needs a single KV-cache group");
        }
        for &h in block_hashes {
            prefix.set_wanted(h, wanted);
        }
        Ok(())
    }

    /// Whether queue-aware eviction is on ([`Self::set_eviction_priority`] was called), and then
    /// how many hashes are marked wanted.
    pub fn wanted_block_hashes(&self) -> Option<usize> {
        self.prefix.as_ref().and_then(|p| p.wanted_hashes())
    }
}

#[cfg(test)]
mod tests;
