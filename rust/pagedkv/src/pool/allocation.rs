//! Allocation: all-or-nothing and between-bounds takes of free blocks.

use super::cas::{cas_retry, Cas};
use super::BlockPool;
use crate::error::{invalid, Error, Result, Tier};
use crate::sync::Ordering;
use crate::types::BlockId;

impl BlockPool {
    /// Takes `num_blocks` free blocks (each refcount 0 -> 1), all or nothing.
    /// `num_blocks > self.num_blocks()` can never succeed: [`Error::InvalidArgument`]. Fewer free
    /// blocks than requested right now: [`Error::OutOfBlocks`] and nothing changes.
    ///
    /// ```
    /// use pagedkv::{BlockPool, Error};
    /// let pool = BlockPool::new(4, 16)?;
    /// assert_eq!(pool.allocate(2)?, vec![0, 1]);
    /// assert!(matches!(pool.allocate(3), Err(Error::OutOfBlocks { needed_blocks: 3, available_blocks: 2, .. })));
    /// assert!(matches!(pool.allocate(5), Err(Error::InvalidArgument(_))));
    /// assert_eq!(pool.num_free_list_blocks(), 2);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn allocate(&self, num_blocks: usize) -> Result<Vec<BlockId>> {
        let mut out = Vec::new();
        self.allocate_into(num_blocks, &mut out)?;
        Ok(out)
    }

    /// Like [`BlockPool::allocate`] but appends the block ids to `out` (no allocation when `out`
    /// has capacity). On error `out` is unchanged.
    ///
    /// ```
    /// use pagedkv::BlockPool;
    /// let pool = BlockPool::new(4, 16)?;
    /// let mut ids = Vec::with_capacity(4);
    /// pool.allocate_into(1, &mut ids)?;
    /// pool.allocate_into(2, &mut ids)?;
    /// assert_eq!(ids, vec![0, 1, 2]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn allocate_into(&self, num_blocks: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if num_blocks > self.num_blocks {
            return invalid(format!(
                "cannot allocate {num_blocks} blocks from a pool of {} blocks",
                self.num_blocks
            ));
        }
        if num_blocks == 0 {
            return Ok(());
        }
        if let Err(available_blocks) = self.reserve_exact(num_blocks) {
            return Err(Error::OutOfBlocks {
                tier: Tier::Device,
                needed_blocks: num_blocks,
                available_blocks,
            });
        }
        self.pop_reserved(num_blocks, out);
        Ok(())
    }

    /// Takes between `min_blocks` and `max_blocks` free blocks in one step (each refcount
    /// 0 -> 1): as many as are free now, capped at `max_blocks`, appending them to `out`, and
    /// returns how many it took. Fewer than `min_blocks` free: [`Error::OutOfBlocks`]
    /// (`needed_blocks = min_blocks`) and nothing changes; `min_blocks > max_blocks` or
    /// `min_blocks > self.num_blocks()`: [`Error::InvalidArgument`].
    ///
    /// A manager that can make up a shortfall from elsewhere (its prefix cache) asks for
    /// `(needed - spare, needed)`: the reservation either covers what it cannot make up or
    /// takes nothing, so it never has to hand blocks back (which would make another thread's
    /// allocation fail in the window while they are out).
    ///
    /// ```
    /// use pagedkv::{BlockPool, Error};
    /// let pool = BlockPool::new(4, 16)?;
    /// let mut ids = Vec::new();
    /// assert_eq!(pool.allocate_between(1, 3, &mut ids)?, 3);
    /// assert_eq!(pool.allocate_between(1, 3, &mut ids)?, 1);   // only one was left
    /// assert!(matches!(pool.allocate_between(1, 3, &mut ids), Err(Error::OutOfBlocks { .. })));
    /// assert_eq!(ids, vec![0, 1, 2, 3]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn allocate_between(
        &self,
        min_blocks: usize,
        max_blocks: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<usize> {
        if min_blocks > max_blocks || min_blocks > self.num_blocks {
            return invalid(format!(
                "cannot allocate between {min_blocks} and {max_blocks} blocks from a pool of {} blocks",
                self.num_blocks
            ));
        }
        // Acquire: pairs with the AcqRel `fetch_add` after a push, so the pushed links are
        // visible to the pops this reservation licenses.
        let reserved = cas_retry(
            &*self.free_count,
            Ordering::Acquire,
            Ordering::AcqRel,
            |cur| {
                if cur < min_blocks {
                    return Cas::Stop(Err(Error::OutOfBlocks {
                        tier: Tier::Device,
                        needed_blocks: min_blocks,
                        available_blocks: cur,
                    }));
                }
                match cur.min(max_blocks) {
                    0 => Cas::Stop(Ok(0)),
                    take => Cas::Swap(cur - take, Ok(take)),
                }
            },
        );
        let take = reserved?;
        if take == 0 {
            return Ok(0);
        }
        self.pop_reserved(take, out);
        Ok(take)
    }
}
