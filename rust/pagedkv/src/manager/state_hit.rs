//! Look-ups of a state group's hit by one hash, from the right (docs/design.md, KV groups,
//! "State hits"): what vLLM's `MambaManager.find_longest_cache_hit` asks its block pool in
//! `"align"` mode, on pagedkv's index. A state block (a recurrent model's state at a block
//! boundary) holds everything before its boundary, so its hit is the rightmost block whose
//! hash is cached, one block, not a chain (`policy::state_hit`). Read-only for what a caller
//! sees, as `cached_block` (whose first call stops chaining index entries).

use super::policy::state_hit;
use super::state::KvCacheManager;
use crate::error::Result;
use crate::prefix::hash::BlockHash;
use crate::BlockId;

impl KvCacheManager {
    /// The longest state hit of a prompt whose block hashes are `hashes`, at most
    /// `max_blocks` blocks: the rightmost `i < min(max_blocks, hashes.len())` whose hash
    /// group `group` holds a block under (in use or cached-evictable), as `(i + 1, block)`
    /// (the hit's length in blocks and the block that ends it); `None` when no such hash is
    /// cached or without prefix caching. Searched from the right, stopping at the first
    /// cached hash, as vLLM does. `InvalidArgument` for a group this manager does not have.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;          // blocks 0 and 1 indexed
    /// let hashes = kv.prefix_block_hashes(&[1, 2, 3, 4, 9, 9], None);
    /// let second = kv.block_table(1)?[1];
    /// assert_eq!(kv.longest_cached_block(&hashes, 3, 0)?, Some((2, second)));
    /// assert_eq!(kv.longest_cached_block(&hashes, 1, 0)?.map(|h| h.0), Some(1));
    /// // Not a chain: the second block's hash alone is a hit.
    /// assert_eq!(kv.longest_cached_block(&[0, hashes[1]], 2, 0)?, Some((2, second)));
    /// assert_eq!(kv.longest_cached_block(&hashes[2..], 4, 0)?, None);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn longest_cached_block(
        &mut self,
        hashes: &[BlockHash],
        max_blocks: usize,
        group: usize,
    ) -> Result<Option<(usize, BlockId)>> {
        self.check_group(group)?;
        let Some(prefix) = self.prefix.as_mut() else {
            return Ok(None);
        };
        let mut found = None;
        let num_blocks = state_hit(max_blocks.min(hashes.len()), |i| {
            found = prefix.cached_block(group as u32, hashes[i]);
            found.is_some()
        });
        Ok(found.map(|b| (num_blocks, b)))
    }
}
