//! Prefix-cache integration: reset, events, the LRU view, and hashing of appended tokens.

use super::group_spec::KvGroupSpec;
use super::indexing::index_ready_in;
use super::state::{KvCacheManager, Sequence};
use crate::error::Result;
use crate::pool::BlockPool;
use crate::prefix::events::{block_stored, DrainedEvents, KvEvent};
use crate::prefix::hash::BlockHash;
use crate::prefix::PrefixCache;
use crate::{BlockId, TokenId};

impl KvCacheManager {
    /// Empties the prefix index and returns every cached-evictable block to the pool. Refuses
    /// (returns `false`, changing nothing) while any of this manager's blocks is in use.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, KvEvent, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// assert!(!kv.reset_prefix_cache());
    /// kv.free(1)?;
    /// assert_eq!(kv.stats().num_cached_blocks, 1);
    /// assert!(kv.reset_prefix_cache());
    /// assert_eq!(kv.stats().num_cached_blocks, 0);
    /// assert_eq!(kv.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks_in_use > 0 {
            return false;
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.reset(&self.pool);
        }
        if let Some(tier) = self.offload.as_mut() {
            tier.clear();
        }
        true
    }

    /// Returns up to `max_blocks` cached-evictable blocks, least recently used first, to the
    /// pool's free list, where any manager sharing the pool can allocate them; each loses its
    /// hash (a `BlockRemoved` event). Returns how many were released. This is how managers on
    /// one shared [`crate::BlockPool`] reclaim each other's cached blocks
    /// ([`crate::PoolPeers`] calls it on the peers of a manager short of blocks).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use pagedkv::{BlockPool, KvCacheManager, ManagerConfig};
    /// let pool = Arc::new(BlockPool::new(2, 2)?);
    /// let cfg = ManagerConfig { enable_prefix_caching: true, ..Default::default() };
    /// let mut a = KvCacheManager::with_pool(pool.clone(), cfg.clone())?;
    /// let mut b = KvCacheManager::with_pool(pool.clone(), cfg)?;
    /// a.add_sequence(1, &[1, 2, 3, 4], None)?;
    /// a.free(1)?;                                   // both blocks stay cached by `a`
    /// assert!(b.add_sequence_len(1, 4).is_err());   // the pool's free list is empty
    /// assert_eq!(a.evict_cached(2), 2);
    /// b.add_sequence_len(1, 4)?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn evict_cached(&mut self, max_blocks: usize) -> usize {
        let Some(prefix) = self.prefix.as_mut() else {
            return 0;
        };
        let mut released = 0;
        while released < max_blocks && prefix.release_lru(&self.pool).is_some() {
            released += 1;
        }
        released
    }

    /// The block of KV-cache group `group` holding the content whose hash is `hash`, if the
    /// prefix index holds it (in use or cached-evictable): a look-up by that one hash, in any
    /// order, as vLLM's `BlockPool.get_cached_block` answers it (its auxiliary-output connector
    /// asks it). `hash` is the content hash the index keys the block by: the caller's block
    /// hash (`AdmitOptions::block_hashes`, reduced by [`crate::reduce_block_hash`]) or
    /// pagedkv's own (`prefix_block_hashes`). Changes nothing a caller sees; the first call
    /// gives every chained block its map entry and later admissions chain none
    /// (prefix/index/by_hash.rs). `None` without prefix caching; `InvalidArgument` for a
    /// group this manager does not have.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;
    /// let hashes = kv.prefix_block_hashes(&[1, 2, 3, 4], None);
    /// let second = kv.block_table(1)?[1];
    /// assert_eq!(kv.cached_block(hashes[1], 0)?, Some(second));
    /// kv.free(1)?;                                  // cached-evictable: still held
    /// assert_eq!(kv.cached_block(hashes[1], 0)?, Some(second));
    /// assert_eq!(kv.cached_block(hashes[1] ^ 1, 0)?, None);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn cached_block(&mut self, hash: BlockHash, group: usize) -> Result<Option<BlockId>> {
        self.check_group(group)?;
        Ok(self
            .prefix
            .as_mut()
            .and_then(|p| p.cached_block(group as u32, hash)))
    }

    /// Drains the recorded KV events, oldest first (empty without prefix caching).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.take_drained_events().into_events()
    }

    /// Drains the same events as [`Self::take_events`] as the queue holds them, for a consumer
    /// that encodes them at once (`pagedkv::wire::encode_drained_events`): no `KvEvent` is built
    /// and nothing is allocated per block removal.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// let drained = kv.take_drained_events();
    /// assert_eq!(drained.len(), 1);                  // one BlockStored
    /// assert_eq!(drained.into_events().len(), 1);
    /// assert!(kv.take_events().is_empty());          // one queue
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn take_drained_events(&mut self) -> DrainedEvents {
        self.prefix
            .as_mut()
            .map_or_else(DrainedEvents::default, PrefixCache::take_drained_events)
    }

    /// Cached-evictable blocks in eviction order (least recently used first).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;   // blocks 0, 1 full, 2 partial
    /// kv.free(1)?;
    /// assert_eq!(kv.cached_blocks(), vec![1, 0]);     // tail before head
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn cached_blocks(&self) -> Vec<BlockId> {
        self.prefix
            .as_ref()
            .map_or_else(Vec::new, PrefixCache::lru_order)
    }
}

/// Feeds appended tokens to a sequence's hashing state (its table and watermark already cover
/// them), entering each block they fill in the prefix index. Unknown tokens (`None`), or ids
/// still missing before these (given later, docs/design.md, Per-chunk allocation), end hashing
/// for the sequence. A sequence with caller-supplied keys takes the plain path
/// (`indexing.rs`). Only the single full-attention group's paths call this.
pub(super) fn record_tokens(
    prefix: &mut PrefixCache,
    pool: &BlockPool,
    seq: &mut Sequence,
    block_size: usize,
    token_ids: Option<&[TokenId]>,
) {
    let Some(h) = seq.hashing.as_mut() else {
        return;
    };
    let Some(mut tokens) = token_ids else {
        seq.hashing = None;
        return;
    };
    if h.num_known(block_size) + tokens.len() != seq.table.num_tokens {
        seq.hashing = None;
        return;
    }
    if h.keys.is_some() {
        h.pending_tokens.extend_from_slice(tokens);
        index_ready_in(prefix, pool, seq, &[KvGroupSpec::FullAttention], block_size);
        return;
    }
    while !tokens.is_empty() {
        let take = tokens.len().min(block_size - h.pending_tokens.len());
        h.pending_tokens.extend_from_slice(&tokens[..take]);
        tokens = &tokens[take..];
        if h.pending_tokens.len() == block_size {
            let i = h.block_hashes.len();
            let parent = h.block_hashes.last().copied();
            let hash = prefix
                .hasher
                .hash_block(parent, &h.pending_tokens, h.extra_key.as_deref());
            let b = seq.table.block_ids[i];
            let parent_block = i.checked_sub(1).map(|p| seq.table.block_ids[p]);
            // Never chained: the content a decode step fills may be indexed elsewhere already.
            let entered = prefix
                .register(
                    b,
                    hash,
                    parent,
                    parent_block,
                    &h.block_hashes,
                    &h.pending_tokens,
                    &h.extra_key,
                    pool,
                )
                .is_new();
            if entered && prefix.events.enabled() {
                // One event per filled block, as each block fills.
                let event = block_stored(
                    &[hash],
                    parent,
                    &h.pending_tokens,
                    block_size,
                    h.extra_key.as_deref(),
                );
                prefix.events.push(event);
            }
            h.block_hashes.push(hash);
            h.pending_tokens.clear();
        }
    }
}
