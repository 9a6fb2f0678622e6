//! References to blocks: handles, retain and release (checked against the handle's generation,
//! or by id for the managers), and the refcount word's transitions under them.

use super::cas::{cas_retry, Cas};
use super::handle::{generation_of, next_tenancy, refcount_of};
use super::BlockPool;
use crate::error::{invalid, Error, Result};
use crate::sync::{AtomicU64, Ordering};
use crate::types::{BlockHandle, BlockId};

impl BlockPool {
    /// A handle to the current tenancy of in-use block `block_id` (see [`BlockHandle`]). Take
    /// it while you hold a reference to the block (right after allocating it): a handle to a
    /// block you do not hold names its current holder's tenancy. A free or cached block has no
    /// tenancy: [`Error::InvalidArgument`]; so has an unknown id.
    ///
    /// ```
    /// use pagedkv::BlockPool;
    /// let pool = BlockPool::new(2, 16)?;
    /// assert!(pool.handle(0).is_err());       // free
    /// let h = pool.handle(pool.allocate(1)?[0])?;
    /// assert_eq!(h.id(), 0);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn handle(&self, block_id: BlockId) -> Result<BlockHandle> {
        let word = self.ref_cell(block_id)?.load(Ordering::Acquire);
        if refcount_of(word) == 0 {
            return invalid(format!(
                "block {block_id} is not in use; there is no tenancy to take a handle to"
            ));
        }
        Ok(BlockHandle::new(block_id, generation_of(word)))
    }

    /// Adds one reference to the block `handle` names and returns the new refcount. A handle
    /// whose block was freed since it was taken: [`Error::StaleHandle`], and nothing changes
    /// (a stale handle never revives a freed block nor adds to a new tenant's count).
    ///
    /// ```
    /// use pagedkv::{BlockPool, Error};
    /// let pool = BlockPool::new(2, 16)?;
    /// let h = pool.handle(pool.allocate(1)?[0])?;
    /// assert_eq!(pool.retain(h)?, 2);
    /// pool.release(h)?;
    /// pool.release(h)?;                      // freed
    /// assert_eq!(pool.retain(h), Err(Error::StaleHandle(h)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn retain(&self, handle: BlockHandle) -> Result<u32> {
        self.increment(handle.id(), Some(handle.generation()))
    }

    /// Adds one reference to in-use block `block_id` without a generation check (the managers,
    /// whose tables hold the references). A free block: [`Error::InvalidArgument`].
    pub(crate) fn retain_id(&self, block_id: BlockId) -> Result<u32> {
        self.increment(block_id, None)
    }

    /// Drops one reference to the block `handle` names. Returns `true` when the refcount
    /// reached 0 and the block went back on the free list. The block was freed and handed out
    /// again since the handle was taken: [`Error::StaleHandle`]; freed and not yet handed out:
    /// [`Error::DoubleFree`]. Either way nothing changes.
    ///
    /// ```
    /// use pagedkv::{BlockPool, Error};
    /// let pool = BlockPool::new(2, 16)?;
    /// let h = pool.handle(pool.allocate(1)?[0])?;
    /// assert!(pool.release(h)?);
    /// assert_eq!(pool.release(h), Err(Error::DoubleFree(h.id())));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn release(&self, handle: BlockHandle) -> Result<bool> {
        self.release_checked(handle.id(), Some(handle.generation()))
    }

    /// Drops one reference to `block_id` without a generation check (the managers).
    pub(crate) fn release_id(&self, block_id: BlockId) -> Result<bool> {
        self.release_checked(block_id, None)
    }

    #[inline]
    fn release_checked(&self, block_id: BlockId, generation: Option<u32>) -> Result<bool> {
        if self.decrement(block_id, generation)? {
            self.push_free(block_id);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Drops one reference to each block of `handles`, in order; the blocks reaching 0 go back
    /// on the free list together (one update of the list and of the free count instead of one
    /// per block), leaving it exactly as releasing them one by one would. Returns how many were
    /// freed. Stops at the first error ([`Error::StaleHandle`], [`Error::DoubleFree`]), after
    /// releasing the blocks before it.
    ///
    /// ```
    /// use pagedkv::{BlockPool, Error};
    /// let pool = BlockPool::new(4, 16)?;
    /// let blocks = pool.allocate(3)?;
    /// let h: Vec<_> = blocks.iter().map(|&b| pool.handle(b)).collect::<Result<_, _>>()?;
    /// pool.retain(h[1])?;
    /// assert_eq!(pool.release_all(h.iter().rev().copied())?, 2);   // h[1] still held
    /// assert_eq!(pool.num_free_list_blocks(), 3);
    /// assert_eq!(pool.release_all([h[1], h[1]]), Err(Error::DoubleFree(blocks[1])));
    /// assert_eq!(pool.num_free_list_blocks(), 4);
    /// pool.check_invariants_quiescent()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn release_all(&self, handles: impl IntoIterator<Item = BlockHandle>) -> Result<usize> {
        let mut freed = 0;
        let items = handles.into_iter().map(|h| (h.id(), Some(h.generation())));
        self.release_chain_checked(items, &mut freed)
            .map(|()| freed)
    }

    /// [`BlockPool::release_all`] by id, without generation checks (the managers), that counts
    /// the freed blocks in `freed` even when it fails.
    pub(crate) fn release_chain(
        &self,
        block_ids: impl IntoIterator<Item = BlockId>,
        freed: &mut usize,
    ) -> Result<()> {
        self.release_chain_checked(block_ids.into_iter().map(|b| (b, None)), freed)
    }

    /// Drops one reference to each `(block, expected generation)`, pushing the freed blocks
    /// with one update; stops at the first error.
    #[inline]
    fn release_chain_checked(
        &self,
        items: impl IntoIterator<Item = (BlockId, Option<u32>)>,
        freed: &mut usize,
    ) -> Result<()> {
        // The freed blocks, linked as they would lie on the stack: `top` last freed, `bottom`
        // first (both meaningful once `count > 0`). They are ours alone (refcount 0, not yet
        // on the list) until the push. Two plain ids rather than an `Option` pair: the
        // compiler keeps them in registers (callgrind, `add_free`).
        let (mut top, mut bottom, mut count) = (0, 0, 0usize);
        let mut result = Ok(());
        for (b, generation) in items {
            match self.decrement(b, generation) {
                Ok(true) => {
                    if count == 0 {
                        bottom = b;
                    } else {
                        // Release: see `push_chain`.
                        self.next[b as usize].store(top, Ordering::Release);
                    }
                    top = b;
                    count += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if count > 0 {
            self.push_chain(top, bottom, count);
        }
        *freed += count;
        result
    }

    /// The current refcount of a block (a snapshot if other threads touch it).
    ///
    /// ```
    /// use pagedkv::BlockPool;
    /// let pool = BlockPool::new(2, 16)?;
    /// assert_eq!(pool.refcount(1)?, 0);
    /// assert!(pool.refcount(2).is_err());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn refcount(&self, block_id: BlockId) -> Result<u32> {
        Ok(refcount_of(
            self.ref_cell(block_id)?.load(Ordering::Acquire),
        ))
    }

    #[inline]
    fn ref_cell(&self, block_id: BlockId) -> Result<&AtomicU64> {
        match self.refs.get(block_id as usize) {
            Some(rc) => Ok(rc),
            None => invalid(format!(
                "block id {block_id} out of range for a pool of {} blocks",
                self.num_blocks
            )),
        }
    }

    /// Refcount +1 on an in-use block whose generation is `generation` (any, if `None`).
    /// Returns the new refcount. A generation mismatch is [`Error::StaleHandle`]; so is a free
    /// block when a generation is given (the handle's tenancy ended), else it is
    /// [`Error::InvalidArgument`].
    #[inline]
    fn increment(&self, block_id: BlockId, generation: Option<u32>) -> Result<u32> {
        let rc = self.ref_cell(block_id)?;
        cas_retry(rc, Ordering::Relaxed, Ordering::AcqRel, |cur| {
            if let Err(e) = check_generation(block_id, cur, generation) {
                return Cas::Stop(Err(e));
            }
            match refcount_of(cur) {
                0 => Cas::Stop(match generation {
                    Some(generation) => {
                        Err(Error::StaleHandle(BlockHandle::new(block_id, generation)))
                    }
                    None => invalid(format!("block {block_id} is not in use; cannot retain it")),
                }),
                u32::MAX => Cas::Stop(invalid(format!("block {block_id} refcount would overflow"))),
                n => Cas::Swap(cur + 1, Ok(n + 1)),
            }
        })
    }

    /// Refcount -1, never below 0, on a block whose generation is `generation` (any, if
    /// `None`). Returns whether it reached 0.
    #[inline]
    pub(super) fn decrement(&self, block_id: BlockId, generation: Option<u32>) -> Result<bool> {
        let rc = self.ref_cell(block_id)?;
        // AcqRel: every holder's accesses to the block happen-before the last release, and
        // through the push and the next pop, before the next tenant's (as `Arc`'s drop).
        cas_retry(rc, Ordering::Relaxed, Ordering::AcqRel, |cur| {
            if let Err(e) = check_generation(block_id, cur, generation) {
                return Cas::Stop(Err(e));
            }
            match refcount_of(cur) {
                0 => Cas::Stop(Err(Error::DoubleFree(block_id))),
                n => Cas::Swap(cur - 1, Ok(n == 1)),
            }
        })
    }

    /// Starts the tenancy of a block just popped off the free stack: refcount 0 -> 1 and the
    /// next generation. The block is ours alone (off the stack, refcount 0: every other
    /// caller only reads its word and refuses), so a load and a store suffice; the load sees
    /// the last release's decrement because our pop acquired the push that followed it.
    #[inline]
    pub(super) fn start_tenancy(&self, block_id: BlockId) {
        let word = &self.refs[block_id as usize];
        // Release: a concurrent checker that sees refcount 1 must also see the pop.
        word.store(
            next_tenancy(word.load(Ordering::Relaxed)),
            Ordering::Release,
        );
    }
}

/// A generation mismatch (the block was freed and handed out again since the handle with
/// `expected` was taken): [`Error::StaleHandle`], with the block's id and the expected
/// generation.
#[inline]
fn check_generation(block_id: BlockId, word: u64, expected: Option<u32>) -> Result<()> {
    match expected {
        Some(g) if g != generation_of(word) => {
            Err(Error::StaleHandle(BlockHandle::new(block_id, g)))
        }
        _ => Ok(()),
    }
}
