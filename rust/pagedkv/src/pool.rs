//! The lock-free physical block pool: a free list plus one atomic refcount per block.
//!
//! # Why a tagged-index Treiber stack with a reserve-first counter
//!
//! Several managers on several threads allocate and release blocks of one pool at once, and the
//! allocation of one block is on every engine step's hot path, so the free list must be
//! lock-free and cheap when uncontended. The candidates were:
//!
//! * an atomic bitmap: allocation scans words for a set bit (O(num_blocks / 64) when the pool is
//!   nearly full) and needs a cursor to avoid every thread hammering word 0;
//! * a Treiber stack of block indices: O(1) push and pop, a single CAS each, and LIFO reuse keeps
//!   recently freed (cache-warm) blocks in play.
//!
//! We use the stack. Its links are `AtomicU32` indices into a fixed array (`next`), so nodes are
//! never allocated or freed and there is no memory-reclamation problem. The classic ABA hazard
//! (thread A reads head = x, next = y; others pop x, pop y, push x; A's CAS would install the
//! stale y) is closed by packing a 32-bit tag next to the 32-bit head index in one `AtomicU64`
//! and bumping the tag on every successful push and pop: A's CAS then fails because the tag
//! moved. (The tag would have to wrap through 2^32 successful operations while A is paused
//! between two instructions for ABA to reappear.)
//!
//! A multi-block allocation must be all-or-nothing. Popping blocks one by one and pushing them
//! back on shortage would let two threads each grab half of what they need and both fail, and it
//! makes failures visible to others. Instead an atomic `free_count` is **reserved first** with a
//! CAS loop (`free_count -= n` only if `free_count >= n`); a thread that wins its reservation is
//! then guaranteed that its `n` pops succeed, because the pool maintains
//! `stack length >= free_count + reserved-but-not-yet-popped`:
//! release pushes onto the stack *before* incrementing `free_count`, and allocation decrements
//! `free_count` *before* popping. Shortage is therefore reported without touching the stack.
//!
//! # Contention
//!
//! Every failed CAS waits a bounded, doubling number of spin hints (`sync::Backoff`)
//! before retrying, and `head` and `free_count` each sit on their own 128-byte line, away from
//! the read-only fields every operation reads. Without them two threads hammering the pool
//! bounced the shared line on every retry and lost to a `Mutex<Vec<u32>>` free list; with them
//! they beat it (the criterion bench against that baseline: `benches/README.md`). The
//! uncontended path is unchanged.
//!
//! # Refcounts
//!
//! Each block has one `AtomicU64` word `{generation: u32, refcount: u32}`. The refcount is the
//! number of references to the block (block-table entries, or an embedder's own). Allocation
//! sets it to 1 and bumps the generation; retain increments it (only on an in-use block);
//! release decrements it with a CAS loop that refuses to go below zero ([`Error::DoubleFree`])
//! and pushes the block back on the free list when it reaches zero.
//!
//! The public [`BlockPool::retain`], [`BlockPool::release`] and [`BlockPool::release_all`] take
//! a [`BlockHandle`] (id + generation) and refuse it with [`Error::StaleHandle`] once the block
//! has been freed since the handle was taken, so a caller that lets go twice cannot drop a
//! reference that now belongs to another manager (`pool/handle.rs` says why the generation
//! shares the refcount's word). The managers own their blocks' references through their block
//! tables and use the id-based crate-private calls (`retain_id`, `release_id`,
//! `release_chain`), which skip the check. docs/pool.md lists what an embedder may call.
//!
//! A manager with prefix caching keeps some refcount-0 blocks out of the free list as
//! *cached-evictable* (their KV content may be reused). Those transitions are crate-internal:
//! `release_to_cache_uncounted` + `count_cached`, `claim_cached(_all)` and `free_cached`; the
//! pool only counts such blocks (the managers update the count once per free and per eviction
//! batch, and only quiescent checks compare it with the refcounts).

use std::fmt;

mod handle;
mod invariants;

use handle::{generation_of, next_tenancy, refcount_of};

use crate::error::{invalid, Error, Result, Tier};
use crate::sync::{spin_hint, AtomicU32, AtomicU64, AtomicUsize, Backoff, CachePadded, Ordering};
use crate::types::{BlockHandle, BlockId};

/// The largest `num_blocks` a pool accepts (2^24 blocks; metadata is 8 bytes per block).
pub const MAX_NUM_BLOCKS: usize = 1 << 24;
/// The largest number of token slots (`num_blocks * block_size`) a pool accepts, so every slot
/// index and every sequence length fits an `i32` (the dtype of `seq_lens` and block tables).
pub const MAX_NUM_SLOTS: usize = i32::MAX as usize;

const NIL: u32 = u32::MAX;

#[inline]
fn pack(tag: u32, index: u32) -> u64 {
    ((tag as u64) << 32) | index as u64
}

#[inline]
fn head_index(word: u64) -> u32 {
    word as u32
}

#[inline]
fn head_tag(word: u64) -> u32 {
    (word >> 32) as u32
}

/// A fixed set of `num_blocks` physical KV blocks of `block_size` token slots each, with a
/// lock-free free list and atomic per-block refcounts. `Send + Sync`: share it through
/// `Arc` among several [`crate::KvCacheManager`]s (one per thread).
///
/// ```
/// use pagedkv::BlockPool;
/// let pool = BlockPool::new(8, 16)?;
/// let blocks = pool.allocate(3)?;            // all-or-nothing
/// assert_eq!(pool.num_free_list_blocks(), 5);
/// let handles = blocks.iter().map(|&b| pool.handle(b)).collect::<Result<Vec<_>, _>>()?;
/// pool.retain(handles[0])?;                  // a second holder now points at it
/// assert_eq!(pool.refcount(blocks[0])?, 2);
/// assert!(!pool.release(handles[0])?);       // still referenced once
/// for h in handles {
///     assert!(pool.release(h)?);             // back on the free list
/// }
/// assert_eq!(pool.num_free_list_blocks(), 8);
/// pool.check_invariants_quiescent()?;
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub struct BlockPool {
    /// Token slots per block; fixed for the pool's life.
    block_size: usize,
    /// Number of blocks; block ids are `0..num_blocks` and fit in 24 bits (< [`MAX_NUM_BLOCKS`]).
    num_blocks: usize,
    /// Per block: `{generation: u32, refcount: u32}` (pool/handle.rs). The refcount is the
    /// number of references, 0 exactly when the block is free or cached-evictable, never
    /// decremented below 0 (CAS loop); the generation goes up on every 0 -> 1.
    refs: Box<[AtomicU64]>,
    /// Per block: the index of the block below it on the free stack (`NIL` at the bottom).
    /// Meaningful only while the block is on the stack.
    next: Box<[AtomicU32]>,
    /// `{tag: u32, index: u32}` of the top of the free stack (`index == NIL`: empty). The tag
    /// increases on every successful push and pop (ABA guard).
    head: CachePadded<AtomicU64>,
    /// Blocks on the free stack not yet reserved by an allocation. Always
    /// `<= stack length - outstanding reservations`; equal to the stack length when quiescent.
    free_count: CachePadded<AtomicUsize>,
    /// Blocks with refcount 0 held outside the free list by managers' prefix caches. Written
    /// on every cache release, revival and eviction, so padded like `head` and `free_count`
    /// to keep those writes off the line of the read-mostly fields every operation reads.
    cached_count: CachePadded<AtomicUsize>,
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .field("num_free_list_blocks", &self.num_free_list_blocks())
            .finish()
    }
}

impl BlockPool {
    /// Creates a pool with every block free. `num_blocks` must be in `1..=MAX_NUM_BLOCKS`,
    /// `block_size >= 1`, and `num_blocks * block_size <= MAX_NUM_SLOTS`, else
    /// [`Error::InvalidArgument`].
    ///
    /// ```
    /// use pagedkv::BlockPool;
    /// assert!(BlockPool::new(0, 16).is_err());
    /// assert!(BlockPool::new(16, 0).is_err());
    /// assert!(BlockPool::new(usize::MAX, 16).is_err());
    /// assert_eq!(BlockPool::new(4, 16)?.num_free_list_blocks(), 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn new(num_blocks: usize, block_size: usize) -> Result<BlockPool> {
        validate_geometry(num_blocks, block_size, "num_blocks")?;
        let refs = (0..num_blocks).map(|_| AtomicU64::new(0)).collect();
        // Block 0 on top, so a fresh pool hands out 0, 1, 2, ... (readable tests and tables).
        let next = (0..num_blocks)
            .map(|b| {
                AtomicU32::new(if b + 1 < num_blocks {
                    b as u32 + 1
                } else {
                    NIL
                })
            })
            .collect();
        Ok(BlockPool {
            block_size,
            num_blocks,
            refs,
            next,
            head: CachePadded(AtomicU64::new(pack(0, 0))),
            free_count: CachePadded(AtomicUsize::new(num_blocks)),
            cached_count: CachePadded(AtomicUsize::new(0)),
        })
    }

    /// Number of blocks in the pool.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Token slots per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks on the free list and not reserved (a snapshot when other threads are active).
    /// Excludes managers' cached-evictable blocks.
    #[inline]
    pub fn num_free_list_blocks(&self) -> usize {
        self.free_count.load(Ordering::Acquire)
    }

    /// Refcount-0 blocks held outside the free list by managers' prefix caches (a snapshot).
    #[inline]
    pub fn num_cached_blocks(&self) -> usize {
        self.cached_count.load(Ordering::Acquire)
    }

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

    // ---- internals ----

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
    fn decrement(&self, block_id: BlockId, generation: Option<u32>) -> Result<bool> {
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
    fn start_tenancy(&self, block_id: BlockId) {
        let word = &self.refs[block_id as usize];
        // Release: a concurrent checker that sees refcount 1 must also see the pop.
        word.store(
            next_tenancy(word.load(Ordering::Relaxed)),
            Ordering::Release,
        );
    }

    /// Reserves exactly `n` free blocks, or returns the free count seen when it could not.
    #[inline]
    fn reserve_exact(&self, n: usize) -> std::result::Result<(), usize> {
        cas_retry(
            &*self.free_count,
            Ordering::Acquire,
            Ordering::AcqRel,
            |cur| {
                if cur < n {
                    Cas::Stop(Err(cur))
                } else {
                    Cas::Swap(cur - n, Ok(()))
                }
            },
        )
    }

    /// Pops `n` blocks (each refcount 0 -> 1), appending them to `out` top first; the caller
    /// holds a reservation of `n`, so the stack holds them.
    ///
    /// Uncontended, one walk of `n` links and one update of the head take them all. The walk
    /// sits between reading the head and the CAS, so under contention any concurrent push or
    /// pop fails a long walk, and retrying the same walk can lose again and again (a 512-block
    /// allocation against one churning thread waited milliseconds). So after each failed CAS
    /// the chunk halves (down to single pops, whose window is as short as a push's) and after
    /// each success it doubles back. Taking the blocks in several pops is still
    /// all-or-nothing for the caller: the reservation already guarantees every pop succeeds.
    ///
    /// A walk reads a consistent chain whenever its CAS succeeds: an unchanged tag means no
    /// push or pop happened since the head was read, and a link of a block is only written
    /// while the block is off the stack. (The one CAS loop not written with [`cas_retry`]: a
    /// failure also shrinks the chunk and drops the walked ids, a success keeps its own head.)
    #[inline]
    fn pop_reserved(&self, n: usize, out: &mut Vec<BlockId>) {
        if n == 1 {
            let b = self.pop_one_reserved();
            out.push(b);
            return;
        }
        out.reserve(n);
        let mut remaining = n;
        let mut chunk = n;
        let mut head = self.head.load(Ordering::Acquire);
        let mut backoff = Backoff::new();
        while remaining > 0 {
            let want = chunk.min(remaining);
            let start = out.len();
            let mut index = head_index(head);
            while out.len() - start < want && index != NIL {
                out.push(index);
                // A stale link (the block was popped and pushed again meanwhile) is harmless:
                // the tag moved, so the CAS below fails and we retry.
                index = self.next[index as usize].load(Ordering::Relaxed);
            }
            if out.len() - start < want {
                // A stale snapshot ran off the end of the stack (`stack length >= free_count +
                // reservations` holds for the current one): reread. Spinning rather than failing
                // half-way keeps the allocation all-or-nothing regardless.
                out.truncate(start);
                spin_hint();
                head = self.head.load(Ordering::Acquire);
                continue;
            }
            let new_head = pack(head_tag(head).wrapping_add(1), index);
            match self.head.compare_exchange_weak(
                head,
                new_head,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    for &b in &out[start..] {
                        self.start_tenancy(b);
                    }
                    remaining -= want;
                    chunk = chunk.saturating_mul(2);
                    // The contention that failed earlier CASes has passed: wait short again.
                    backoff = Backoff::new();
                    // Our own CAS installed it; if it moved since, the next CAS says so.
                    head = new_head;
                }
                Err(_) => {
                    out.truncate(start);
                    chunk = (chunk / 2).max(1);
                    backoff.snooze();
                    // Reload after the wait: the value the CAS saw is older than the spin.
                    head = self.head.load(Ordering::Acquire);
                }
            }
        }
    }

    /// [`BlockPool::pop_reserved`] of one block (the common case: a sequence crossing into a
    /// new block), without the buffer bookkeeping of the walk.
    #[inline]
    fn pop_one_reserved(&self) -> BlockId {
        let index = cas_retry(&*self.head, Ordering::Acquire, Ordering::AcqRel, |head| {
            let index = head_index(head);
            if index == NIL {
                // Unreachable while `stack length >= free_count + reservations` holds; spinning
                // (rather than failing half-way) keeps the allocation all-or-nothing regardless.
                debug_assert!(false, "free stack empty under a reservation");
                return Cas::Spin;
            }
            // A stale `next` (the block was popped and pushed again) is harmless: the tag moved,
            // so the CAS fails and we retry.
            let next = self.next[index as usize].load(Ordering::Relaxed);
            Cas::Swap(pack(head_tag(head).wrapping_add(1), next), index)
        });
        self.start_tenancy(index);
        index
    }

    /// Pushes a refcount-0 block on the free stack, then makes it allocatable.
    #[inline]
    fn push_free(&self, block_id: BlockId) {
        self.push_chain(block_id, block_id, 1);
    }

    /// Pushes `count` refcount-0 blocks already linked from `top` down to `bottom` (through
    /// `next`) onto the free stack with one CAS, then makes them allocatable.
    #[inline]
    fn push_chain(&self, top: BlockId, bottom: BlockId, count: usize) {
        cas_retry(&*self.head, Ordering::Relaxed, Ordering::AcqRel, |head| {
            // Release (like the refcount store on allocation): a concurrent checker that reads
            // this link or refcount also sees the pop that preceded it, so it notices the head
            // moved and discards its walk instead of reporting a torn snapshot.
            self.next[bottom as usize].store(head_index(head), Ordering::Release);
            Cas::Swap(pack(head_tag(head).wrapping_add(1), top), ())
        });
        // Only after the push: keeps `stack length >= free_count + reservations`.
        self.free_count.fetch_add(count, Ordering::AcqRel);
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

/// Validates a tier's geometry (shared by the device pool and the host tier).
pub(crate) fn validate_geometry(num_blocks: usize, block_size: usize, what: &str) -> Result<()> {
    if num_blocks == 0 || num_blocks > MAX_NUM_BLOCKS {
        return invalid(format!(
            "{what} must be in 1..={MAX_NUM_BLOCKS}, got {num_blocks}"
        ));
    }
    if block_size == 0 {
        return invalid("block_size must be at least 1");
    }
    match num_blocks.checked_mul(block_size) {
        Some(slots) if slots <= MAX_NUM_SLOTS => Ok(()),
        _ => invalid(format!(
            "{what} * block_size = {num_blocks} * {block_size} exceeds the {MAX_NUM_SLOTS} token slots a pool may have"
        )),
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

/// What one pass of [`cas_retry`] does with the value it read.
enum Cas<V, R> {
    /// Compare-exchange the value read for `V`; on success the loop returns `R`.
    Swap(V, R),
    /// Return `R` without writing.
    Stop(R),
    /// Reread after a spin hint, without a CAS (a snapshot that cannot be right yet).
    Spin,
}

/// An atomic word [`cas_retry`] runs on (the std or loom types of `crate::sync`).
trait CasWord {
    type Value: Copy;
    fn load(&self, order: Ordering) -> Self::Value;
    fn compare_exchange_weak(
        &self,
        current: Self::Value,
        new: Self::Value,
        success: Ordering,
        failure: Ordering,
    ) -> std::result::Result<Self::Value, Self::Value>;
}

macro_rules! cas_word {
    ($atomic:ty, $value:ty) => {
        impl CasWord for $atomic {
            type Value = $value;
            #[inline(always)]
            fn load(&self, order: Ordering) -> $value {
                <$atomic>::load(self, order)
            }
            #[inline(always)]
            fn compare_exchange_weak(
                &self,
                current: $value,
                new: $value,
                success: Ordering,
                failure: Ordering,
            ) -> std::result::Result<$value, $value> {
                <$atomic>::compare_exchange_weak(self, current, new, success, failure)
            }
        }
    };
}
cas_word!(AtomicU64, u64);
cas_word!(AtomicUsize, usize);

/// The pool's compare-exchange retry loop: reads `word` with `load` ordering, asks `step` what
/// to do with the value, and on a failed CAS (`success` ordering on success, `load` on failure)
/// waits a growing backoff and reads again, until a CAS succeeds or `step` stops. The reread
/// after the wait matters: the value a failed CAS saw is older than the spin.
#[inline(always)]
fn cas_retry<W: CasWord, R>(
    word: &W,
    load: Ordering,
    success: Ordering,
    mut step: impl FnMut(W::Value) -> Cas<W::Value, R>,
) -> R {
    let mut cur = word.load(load);
    let mut backoff = Backoff::new();
    loop {
        match step(cur) {
            Cas::Stop(result) => return result,
            Cas::Spin => {
                spin_hint();
                cur = word.load(load);
            }
            Cas::Swap(new, result) => match word.compare_exchange_weak(cur, new, success, load) {
                Ok(_) => return result,
                Err(_) => {
                    backoff.snooze();
                    cur = word.load(load);
                }
            },
        }
    }
}
