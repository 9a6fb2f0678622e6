//! Cached-evictable blocks: refcount-0 blocks a manager's prefix cache keeps out of the free
//! list, and their transitions (release into the cache, claim back, free).

use super::handle::refcount_of;
use super::BlockPool;
use crate::error::Result;
use crate::sync::Ordering;
use crate::types::BlockId;

impl BlockPool {
    /// Drops one reference; at 0 the block is *kept out* of the free list as a cached-evictable
    /// block of the calling manager. Returns `true` when it reached 0. (The managers release
    /// through [`Self::release_to_cache_uncounted`] and count once per operation.)
    #[cfg(test)]
    pub(crate) fn release_to_cache(&self, block_id: BlockId) -> Result<bool> {
        let cached = self.release_to_cache_uncounted(block_id)?;
        self.count_cached(usize::from(cached));
        Ok(cached)
    }

    /// [`Self::release_to_cache`] without counting the block in the pool's cached-block count:
    /// the caller counts every block this returned `true` for with one
    /// [`Self::count_cached`] before its operation returns. Freeing a sequence releases a block
    /// per 16 tokens, and one shared-counter update per block was a locked read-modify-write
    /// of one cache line each time.
    #[inline]
    pub(crate) fn release_to_cache_uncounted(&self, block_id: BlockId) -> Result<bool> {
        self.decrement(block_id, None)
    }

    /// Counts `num_blocks` blocks released by [`Self::release_to_cache_uncounted`].
    #[inline]
    pub(crate) fn count_cached(&self, num_blocks: usize) {
        if num_blocks > 0 {
            self.cached_count.fetch_add(num_blocks, Ordering::AcqRel);
        }
    }

    /// A cached-evictable block (refcount 0, held by the caller's cache) becomes in use
    /// (refcount 1): a prefix hit reviving it, or an eviction reusing it for new content.
    /// A new tenancy: the generation goes up, so handles to the cached content's previous
    /// holders are stale.
    pub(crate) fn claim_cached(&self, block_id: BlockId) {
        self.claim_cached_all(&[block_id]);
    }

    /// [`Self::claim_cached`] for each of `block_ids`, with one update of the cached-block
    /// count.
    ///
    /// A cached block is its cache's alone, as a popped free block is: at refcount 0 every
    /// other caller only reads its word and refuses (`increment` and `decrement` both stop at
    /// 0), so each claim is a load and a store ([`Self::start_tenancy`]) rather than a locked
    /// read-modify-write, which on x86 also waits for every earlier store to reach the cache
    /// (an all-miss admission claims a block per 16 tokens, each just unindexed).
    #[inline]
    pub(crate) fn claim_cached_all(&self, block_ids: &[BlockId]) {
        for &block_id in block_ids {
            self.start_tenancy(block_id);
        }
        if !block_ids.is_empty() {
            self.cached_count
                .fetch_sub(block_ids.len(), Ordering::AcqRel);
        }
    }

    /// A cached-evictable block goes back on the free list (cache reset or manager drop).
    pub(crate) fn free_cached(&self, block_id: BlockId) {
        debug_assert_eq!(
            refcount_of(self.refs[block_id as usize].load(Ordering::Relaxed)),
            0
        );
        self.cached_count.fetch_sub(1, Ordering::AcqRel);
        self.push_free(block_id);
    }
}
