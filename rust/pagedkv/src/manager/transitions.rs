//! The named state transitions, the only code that changes refcounts and block states
//! (docs/design.md, Invariants): every operation is validation plus a sequence of these.

use super::group_spec::NULL_BLOCK;
use super::state::{Counters, KvCacheManager};
use crate::error::{Error, Result, Tier};
use crate::pool::BlockPool;
use crate::BlockId;

/// Fresh blocks reserved by [`KvCacheManager::reserve_fresh`]: the pool's part is already in
/// the caller's buffer, the cache's part is evicted by [`KvCacheManager::complete_fresh`].
#[must_use = "complete_fresh must follow a successful reserve_fresh"]
#[derive(Debug, Clone, Copy)]
pub(super) struct FreshReservation {
    /// Blocks reserved in all.
    num_blocks: usize,
    /// Of those, blocks still to evict from the prefix cache's LRU.
    from_cache: usize,
}

impl KvCacheManager {
    /// `allocate_fresh`: takes `num_blocks` blocks for new content (refcount 0 -> 1),
    /// appending them to `out`; truly free pool blocks first, then the least recently used
    /// cached blocks (evicted: they lose their hash). All or nothing.
    #[inline]
    pub(super) fn allocate_fresh(
        &mut self,
        num_blocks: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        let reservation = self.reserve_fresh(num_blocks, 0, out)?;
        self.complete_fresh(reservation, out);
        Ok(())
    }

    /// The fallible half of `allocate_fresh`: takes what the pool has and checks the prefix
    /// cache can supply the rest by eviction while leaving `pinned_cached` of its blocks alone
    /// (cached prefix hits that the caller revives before [`Self::complete_fresh`], so no
    /// eviction can take them). On error nothing changed: `out` and the pool are as before.
    #[inline]
    pub(super) fn reserve_fresh(
        &mut self,
        num_blocks: usize,
        pinned_cached: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<FreshReservation> {
        let none = FreshReservation {
            num_blocks: 0,
            from_cache: 0,
        };
        if num_blocks == 0 {
            return Ok(none);
        }
        let Some(prefix) = self.prefix.as_ref() else {
            self.pool.allocate_into(num_blocks, out)?;
            return Ok(FreshReservation {
                num_blocks,
                from_cache: 0,
            });
        };
        let cached = prefix.num_cached();
        let evictable = cached - pinned_cached;
        let shortage = |pool_free: usize| Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: num_blocks + pinned_cached,
            available_blocks: pool_free + cached,
        };
        if num_blocks > self.pool.num_free_list_blocks() + evictable {
            return Err(shortage(self.pool.num_free_list_blocks()));
        }
        // One step: at least what the cache cannot make up, at most everything. A refusal
        // takes nothing, so no block ever goes back (which would refuse other managers in
        // the window while it was out).
        let got = self
            .pool
            .allocate_between(num_blocks.saturating_sub(evictable), num_blocks, out)
            .map_err(|_| shortage(self.pool.num_free_list_blocks()))?;
        Ok(FreshReservation {
            num_blocks,
            from_cache: num_blocks - got,
        })
    }

    /// The infallible half of `allocate_fresh`: evicts the reserved cached blocks into `out`
    /// and counts the fresh blocks as in use.
    #[inline]
    pub(super) fn complete_fresh(&mut self, reservation: FreshReservation, out: &mut Vec<BlockId>) {
        if reservation.from_cache > 0 {
            let prefix = self
                .prefix
                .as_mut()
                .expect("cache reservations imply a prefix cache");
            prefix.evict_lru_into(
                reservation.from_cache,
                &self.pool,
                out,
                self.offload.as_mut(),
            );
        }
        self.num_blocks_in_use += reservation.num_blocks;
        self.counters.blocks_allocated += reservation.num_blocks as u64;
    }

    /// `revive_cached`: a prefix hit on cached-evictable block `b` puts it back in use
    /// (refcount 0 -> 1), keeping its hash.
    pub(super) fn revive_cached(&mut self, b: BlockId) {
        let prefix = self
            .prefix
            .as_mut()
            .expect("cached blocks imply a prefix cache");
        prefix.revive_cached(b, &self.pool);
        self.num_blocks_in_use += 1;
    }

    /// `share`: one more table references in-use block `b` (refcount +1).
    pub(super) fn share(&mut self, b: BlockId) -> Result<()> {
        self.pool.retain_id(b).map(|_| ())
    }

    /// `copy_on_write`: a table's shared, partly filled last block `src` was replaced by the
    /// private copy `dst` (already refcount 1); records `(src, dst)` and drops one reference
    /// on `src`.
    pub(super) fn copy_on_write(&mut self, src: BlockId, dst: BlockId) {
        self.pending_copies.push((src, dst));
        self.bound_pending_copies();
        self.counters.cow_copies += 1;
        self.release(src);
    }

    /// `release`: one table stops referencing `b` (refcount -1). At 0 the block becomes
    /// cached-evictable (joining the LRU tail) if its content is indexed, else free.
    pub(super) fn release(&mut self, b: BlockId) {
        let cached = self.release_uncounted(b);
        self.pool.count_cached(usize::from(cached));
    }

    /// [`Self::release`] of each block of `blocks`, last first (a freed sequence's tail goes
    /// ahead of its head in the eviction order), counting the blocks that became
    /// cached-evictable in the pool once at the end.
    ///
    /// Every pool release runs before any of the blocks joins the LRU, so that no locked
    /// read-modify-write (which on x86 first waits for every earlier store to reach the cache)
    /// follows a store to a cold LRU link line. Measured: within the noise, ~2 % of all-miss
    /// admission + free, so the order is kept for the reason only. The result is the same:
    /// only this manager's LRU sees the order.
    pub(super) fn release_all(&mut self, blocks: &[BlockId]) {
        let mut cached = std::mem::take(&mut self.scratch);
        cached.clear();
        for &b in blocks.iter().rev() {
            let indexed = self.is_indexed(b);
            if self.release_in_pool(b, indexed) && indexed {
                cached.push(b);
            }
        }
        if let Some(prefix) = self.prefix.as_mut() {
            for &b in &cached {
                prefix.push_lru(b);
            }
        }
        self.pool.count_cached(cached.len());
        self.scratch = cached;
    }

    /// [`Self::release_all`] of a table that may hold released positions ([`NULL_BLOCK`],
    /// skipped): a window group's, or any group's of a manager of several.
    pub(super) fn release_table(&mut self, blocks: &[BlockId]) {
        if blocks.contains(&NULL_BLOCK) {
            let live: Vec<BlockId> = blocks
                .iter()
                .copied()
                .filter(|&b| b != NULL_BLOCK)
                .collect();
            self.release_all(&live);
        } else {
            self.release_all(blocks);
        }
    }

    /// [`Self::release_table`] of each of `tables` in order, except that the blocks that
    /// became cached-evictable join the LRU table by table from the last (each table's last
    /// block first): [`KvCacheManager::free_last_group_first`].
    pub(super) fn release_tables_last_group_first(&mut self, tables: &[&[BlockId]]) {
        let mut cached: Vec<Vec<BlockId>> = Vec::with_capacity(tables.len());
        for table in tables {
            let mut group_cached = Vec::new();
            for &b in table.iter().rev() {
                if b == NULL_BLOCK {
                    continue;
                }
                let indexed = self.is_indexed(b);
                if self.release_in_pool(b, indexed) && indexed {
                    group_cached.push(b);
                }
            }
            cached.push(group_cached);
        }
        let num_cached = cached.iter().map(Vec::len).sum();
        if let Some(prefix) = self.prefix.as_mut() {
            for &b in cached.iter().rev().flatten() {
                prefix.push_lru(b);
            }
        }
        self.pool.count_cached(num_cached);
    }

    /// [`Self::release`] of each live block of `blocks`, last first, one at a time (swap-out:
    /// the same order as `release_table`, for tables whose blocks other members still hold).
    pub(super) fn release_table_each(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            if b != NULL_BLOCK {
                self.release(b);
            }
        }
    }

    /// [`Self::release`] except that a block that became cached-evictable is not yet counted
    /// in the pool (returns `true` for it; the caller counts it with
    /// [`BlockPool::count_cached`](crate::BlockPool) before returning).
    fn release_uncounted(&mut self, b: BlockId) -> bool {
        let indexed = self.is_indexed(b);
        let cached = self.release_in_pool(b, indexed) && indexed;
        if cached {
            if let Some(prefix) = self.prefix.as_mut() {
                prefix.push_lru(b);
            }
        }
        cached
    }

    /// Whether block `b`'s content is in this manager's prefix index.
    #[inline(always)]
    fn is_indexed(&self, b: BlockId) -> bool {
        self.prefix.as_ref().is_some_and(|p| p.is_indexed(b))
    }

    /// [`release_in_pool`] on this manager's pool and counters.
    #[inline(always)]
    fn release_in_pool(&mut self, b: BlockId, indexed: bool) -> bool {
        release_in_pool(
            &self.pool,
            &mut self.num_blocks_in_use,
            &mut self.counters,
            b,
            indexed,
        )
    }
}

/// The pool side of a release, shared by every release path: refcount -1 on table block `b`; at 0
/// it is counted freed and goes back on the pool's free list, unless `indexed` (it then stays
/// the manager's, cached-evictable; the caller queues it in its LRU). Returns whether it
/// reached 0. Inlined: it is on every free and truncate of the plain manager.
#[inline(always)]
pub(super) fn release_in_pool(
    pool: &BlockPool,
    num_blocks_in_use: &mut usize,
    counters: &mut Counters,
    b: BlockId,
    indexed: bool,
) -> bool {
    let result = if indexed {
        pool.release_to_cache_uncounted(b)
    } else {
        pool.release_id(b)
    };
    match result {
        Ok(true) => {
            *num_blocks_in_use -= 1;
            counters.blocks_freed += 1;
            true
        }
        Ok(false) => false,
        // Our tables hold a reference to `b`, so the pool cannot refuse; if it does, the
        // refcount was corrupted elsewhere and check_invariants will report it.
        Err(e) => {
            debug_assert!(false, "release of table block {b} failed: {e}");
            false
        }
    }
}
