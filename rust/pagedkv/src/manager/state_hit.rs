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

    /// Each group's own hit, in tokens, for a prompt whose block hashes are `hashes` (the
    /// caller's names), at most `max_tokens` tokens (whole blocks): each group evaluated on its
    /// own, not reconciled (vLLM's `find_longest_cache_hit_per_group`, what a KV connector
    /// reads to restore a group's missing part): full attention's leading run of cached
    /// hashes, a window group's run before the hit point, a state group's rightmost cached
    /// block ([`KvCacheManager::longest_cached_block`]). Zeros without prefix caching. Looks
    /// blocks up by hash (docs/design.md, Chained blocks, "Look-ups by one hash").
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, KvGroupSpec, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 16, block_size: 2, enable_prefix_caching: true,
    ///     kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;   // the state block at position 2 only
    /// let hashes = kv.prefix_block_hashes(&[1, 2, 3, 4, 5, 6, 7], None);
    /// // Full attention holds blocks 0 and 1; the state group no full block (its one block
    /// // holds token 5, a partial block).
    /// assert_eq!(kv.group_hits(&hashes, 6), vec![4, 0]);
    /// kv.append_tokens(1, &[6])?;                     // block 2 full: its state is cached
    /// assert_eq!(kv.group_hits(&hashes, 6), vec![6, 6]);
    /// assert_eq!(kv.group_hits(&hashes, 5), vec![4, 0]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn group_hits(&mut self, hashes: &[BlockHash], max_tokens: usize) -> Vec<usize> {
        let bs = self.block_size;
        let Some(prefix) = self.prefix.as_mut() else {
            return vec![0; self.config.kv_groups.len()];
        };
        let max_blocks = (max_tokens / bs).min(hashes.len());
        self.config
            .kv_groups
            .iter()
            .enumerate()
            .map(|(g, spec)| {
                let blocks = spec.longest_hit(max_blocks, bs, |i| {
                    prefix.cached_block(g as u32, hashes[i]).is_some()
                });
                blocks * bs
            })
            .collect()
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`): the state blocks cached so far
    /// no longer refuse a hit. Until the first call nothing is refused: an admission whose hit
    /// ends at a state block cached since the last call is `OutOfBlocks` (the pass writing
    /// that state has not run yet; prefix/states_this_step.rs).
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 16, block_size: 2, enable_prefix_caching: true,
    ///     kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
    ///     ..Default::default()
    /// })?;
    /// let per_chunk = AdmitOptions { reserve_prompt: false, num_scheduled: 8, ..Default::default() };
    /// kv.new_step();
    /// kv.add_sequence_with(1, Prompt::Tokens(&[1, 2, 3, 4]), &per_chunk)?;   // state at 4 cached
    /// let again = kv.add_sequence_with(2, Prompt::Tokens(&[1, 2, 3, 4, 9]), &per_chunk);
    /// assert!(matches!(again, Err(Error::OutOfBlocks { .. })));   // its state: this step's
    /// kv.new_step();
    /// assert_eq!(kv.add_sequence_with(2, Prompt::Tokens(&[1, 2, 3, 4, 9]), &per_chunk)?, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn new_step(&mut self) {
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.states_this_step.start_step();
        }
    }
}
