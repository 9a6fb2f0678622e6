//! The manager of a hybrid model: several KV-cache groups (full attention, sliding window),
//! each with its own block table per sequence, all drawing on one pool (docs/design.md,
//! Hybrid groups).
//!
//! [`KvCacheManager`](super::KvCacheManager) hands every call here when its configuration
//! names anything but the default single full-attention group, so the single-group path keeps
//! its code and its speed. This path is plain code: per sequence a table per group whose
//! released positions hold [`NULL_BLOCK`], a hash map index keyed by (group, block hash) and
//! one LRU shared by the groups. Every operation validates and counts the fresh blocks it
//! needs over all groups before it changes anything (all or nothing).
//!
//! The entry points the plain manager dispatches to are `#[cold]`, so the dispatch is a
//! predicted-not-taken branch and the single-group code keeps its layout: callgrind counts of
//! the `instructions` bench scenarios against the commit before groups were added were within
//! 1 % (`append_batch_48` +0.04 %, `add_free` -0.7 %, `prefix_admit` -0.7 %, `op_mix` -0.2 %);
//! without `#[cold]`, `append_batch_48` was +3 %.
//!
//! One file per concern: [`cache`] (index, LRU, events, pins), [`window`] (the window rules
//! and the hit coordinator), [`admission`], [`growth`] (appends, computed watermark, window
//! release), [`lifecycle`] (fork, free, truncate, pins), [`swap`], [`queries`],
//! [`invariants`].

mod admission;
mod cache;
mod growth;
mod invariants;
mod lifecycle;
mod queries;
mod swap;
#[cfg(test)]
mod tests;
mod window;

use std::collections::BTreeMap;
use std::sync::Arc;

use self::cache::GroupCache;
use super::groups::{KvGroupSpec, NULL_BLOCK};
use super::transitions::release_in_pool;
use super::{copy_queue, new_host_tier, Counters, ManagerConfig};
use crate::error::{Error, Result, Tier};
use crate::host::HostTier;
use crate::pool::BlockPool;
use crate::prefix::hash::BlockHash;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

/// One live sequence of a hybrid manager.
#[derive(Debug, Clone)]
struct HybridSeq {
    /// One table per group, each `ceil(num_tokens / block_size)` entries long; a window
    /// group's released leading positions hold `NULL_BLOCK`. Host block ids while swapped out
    /// (null entries stay null).
    tables: Vec<BlockTable>,
    swapped: bool,
    /// vLLM's `num_computed_tokens` (docs/design.md, Computed watermark).
    num_computed: usize,
    /// Every token id, while all are known and prefix caching is on (what new blocks are
    /// hashed from); `None` otherwise, and then no further block of the sequence is indexed.
    tokens: Option<Vec<TokenId>>,
    extra_key: Option<Arc<[u8]>>,
    /// Chained hashes of the computed full blocks (`num_computed / block_size` of them while
    /// `tokens` is known).
    hashes: Vec<BlockHash>,
}

impl HybridSeq {
    fn num_tokens(&self) -> usize {
        self.tables[0].num_tokens
    }
}

/// The state of a hybrid manager (see the module docs).
pub(crate) struct Hybrid {
    pool: Arc<BlockPool>,
    block_size: usize,
    specs: Vec<KvGroupSpec>,
    /// Live sequences, ordered by id (deterministic iteration).
    seqs: BTreeMap<SeqId, HybridSeq>,
    /// Prefix caching (`enable_prefix_caching`).
    cache: Option<GroupCache>,
    host: Option<HostTier>,
    pending_copies: Vec<(BlockId, BlockId)>,
    /// `pending_copies.len()` at which it is next compacted (`manager/copy_queue.rs`).
    copies_compact_at: usize,
    counters: Counters,
    /// Distinct device blocks referenced by resident tables or pins.
    num_blocks_in_use: usize,
    num_swapped: usize,
}

impl std::fmt::Debug for Hybrid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hybrid")
            .field("kv_groups", &self.specs)
            .field("num_sequences", &self.seqs.len())
            .field("num_blocks_in_use", &self.num_blocks_in_use)
            .finish()
    }
}

impl Hybrid {
    pub(crate) fn new(pool: Arc<BlockPool>, config: &ManagerConfig) -> Result<Self> {
        let cache = config.enable_prefix_caching.then(|| {
            GroupCache::new(
                pool.num_blocks(),
                config.hash_seed,
                config.enable_kv_events,
                config.max_events,
            )
        });
        let host = new_host_tier(config, pool.block_size())?;
        Ok(Hybrid {
            copies_compact_at: copy_queue::initial_threshold(pool.num_blocks()),
            block_size: pool.block_size(),
            pool,
            specs: config.kv_groups.clone(),
            seqs: BTreeMap::new(),
            cache,
            host,
            pending_copies: Vec::new(),
            counters: Counters::default(),
            num_blocks_in_use: 0,
            num_swapped: 0,
        })
    }

    fn num_groups(&self) -> usize {
        self.specs.len()
    }

    /// The sequence, if it exists and is device-resident.
    fn resident(&self, seq_id: SeqId) -> Result<&HybridSeq> {
        match self.seqs.get(&seq_id) {
            None => Err(Error::UnknownSequence(seq_id)),
            Some(s) if s.swapped => Err(Error::SequenceSwappedOut(seq_id)),
            Some(s) => Ok(s),
        }
    }

    /// InvalidArgument unless `group` names one of the groups.
    fn check_group(&self, group: usize) -> Result<()> {
        if group >= self.num_groups() {
            return Err(Error::InvalidArgument(format!(
                "group {group} is out of range: the manager has {} kv_groups",
                self.num_groups()
            )));
        }
        Ok(())
    }

    /// Blocks this manager could allocate now: the pool's free list plus its cached blocks.
    pub(crate) fn num_available_blocks(&self) -> usize {
        self.pool.num_free_list_blocks() + self.cache.as_ref().map_or(0, |c| c.lru.len())
    }

    /// OutOfBlocks unless `fresh` new blocks plus `revived` cached hits fit what is available.
    fn check_available(&self, fresh: usize, revived: usize) -> Result<()> {
        let available = self.num_available_blocks();
        if fresh + revived > available {
            return Err(Error::OutOfBlocks {
                tier: Tier::Device,
                needed_blocks: fresh + revived,
                available_blocks: available,
            });
        }
        Ok(())
    }

    // ---- transitions: the only code here that changes refcounts and block states ----

    /// `allocate_fresh`: `n` blocks for new content, free pool blocks first, then the least
    /// recently used cached blocks (evicted: they lose their hash). All or nothing.
    fn allocate_fresh(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let from_cache = self.reserve_fresh(n, 0, out)?;
        self.complete_fresh(n, from_cache, out);
        Ok(())
    }

    /// The fallible half of `allocate_fresh`: takes from the pool what the cache cannot make
    /// up while leaving `pinned_cached` of its blocks alone (hits the caller revives before
    /// [`Self::complete_fresh`]); returns how many are still to evict. On error nothing
    /// changed.
    fn reserve_fresh(
        &mut self,
        n: usize,
        pinned_cached: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        let evictable = self.cache.as_ref().map_or(0, |c| c.lru.len()) - pinned_cached;
        let got = self
            .pool
            .allocate_between(n.saturating_sub(evictable), n, out)
            .map_err(|_| Error::OutOfBlocks {
                tier: Tier::Device,
                needed_blocks: n + pinned_cached,
                available_blocks: self.num_available_blocks(),
            })?;
        Ok(n - got)
    }

    /// The infallible half of `allocate_fresh`: evicts `from_cache` cached blocks into `out`
    /// and counts the `n` fresh blocks as in use.
    fn complete_fresh(&mut self, n: usize, from_cache: usize, out: &mut Vec<BlockId>) {
        for _ in 0..from_cache {
            let cache = self
                .cache
                .as_mut()
                .expect("a shortfall implies cached blocks");
            out.push(cache.evict_one(&self.pool));
        }
        self.num_blocks_in_use += n;
        self.counters.blocks_allocated += n as u64;
    }

    /// Takes one more reference on hit block `b`: `revive_cached` when it is cached-evictable
    /// (refcount 0 -> 1, hash kept), else `share` (refcount + 1).
    fn take_hit(&mut self, b: BlockId) {
        let cache = self.cache.as_mut().expect("hits imply a prefix cache");
        if cache.lru.contains(b) {
            cache.lru.remove(b);
            self.pool.claim_cached(b);
            self.num_blocks_in_use += 1;
        } else {
            let r = self.pool.retain_id(b);
            debug_assert!(r.is_ok(), "hit block {b} is in use");
        }
    }

    /// `share`: one more table references in-use block `b`.
    fn share(&mut self, b: BlockId) {
        let r = self.pool.retain_id(b);
        debug_assert!(r.is_ok(), "shared block {b} is in use");
    }

    /// `release`: one table (or pin) stops referencing `b`; at 0 it becomes cached-evictable
    /// (the LRU tail) when indexed, else free. `NULL_BLOCK` is skipped.
    fn release(&mut self, b: BlockId) {
        if b == NULL_BLOCK {
            return;
        }
        let indexed = self.cache.as_ref().is_some_and(|c| c.is_indexed(b));
        let freed = release_in_pool(
            &self.pool,
            &mut self.num_blocks_in_use,
            &mut self.counters,
            b,
            indexed,
        );
        if freed && indexed {
            self.cache.as_mut().expect("indexed").lru.push_back(b);
            self.pool.count_cached(1);
        }
    }

    /// Releases `blocks` last first (a table's tail goes ahead of its head in the eviction
    /// order, as vLLM frees a request's blocks).
    fn release_all(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.release(b);
        }
    }

    /// `copy_on_write` of a table's partial last block `src` into `dst`: records the copy,
    /// compacting the queue by dead-copy elimination when a caller never drains it (the
    /// plain manager's rule, `manager/copy_queue.rs`).
    fn record_copy(&mut self, src: BlockId, dst: BlockId) {
        self.pending_copies.push((src, dst));
        self.counters.cow_copies += 1;
        if self.pending_copies.len() < self.copies_compact_at {
            return;
        }
        let mut live = vec![false; self.pool.num_blocks()];
        for seq in self.seqs.values().filter(|s| !s.swapped) {
            for &b in seq.tables.iter().flat_map(|t| &t.block_ids) {
                if b != NULL_BLOCK {
                    live[b as usize] = true;
                }
            }
        }
        if let Some(c) = self.cache.as_ref() {
            for (b, slot) in live.iter_mut().enumerate() {
                *slot |= c.is_indexed(b as BlockId);
            }
        }
        let kept = copy_queue::compact(&self.pending_copies, live);
        self.counters.copy_ops_elided += (self.pending_copies.len() - kept.len()) as u64;
        self.pending_copies = kept;
        self.copies_compact_at =
            copy_queue::threshold(self.pool.num_blocks(), self.pending_copies.len());
    }

    /// Whether dropping one reference to `b` would bring it to refcount 0.
    fn is_last_ref(&self, b: BlockId) -> bool {
        b != NULL_BLOCK && self.pool.refcount(b).is_ok_and(|rc| rc == 1)
    }

    /// Returns every block (in use or cached) to the pool; the manager is being dropped.
    pub(crate) fn teardown(&mut self) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.free(id);
        }
        if let Some(cache) = self.cache.as_mut() {
            for pin in std::mem::take(&mut cache.pins) {
                self.release_all(&pin.blocks);
            }
        }
        self.reset_cache_blocks();
    }

    /// Every cached-evictable block back to the free list, the index emptied.
    fn reset_cache_blocks(&mut self) {
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        while let Some(b) = cache.lru.pop_front() {
            cache.remove_silently(b);
            self.pool.free_cached(b);
        }
    }
}
