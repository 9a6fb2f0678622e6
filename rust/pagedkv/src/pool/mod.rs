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
//! batch). A quiescent check compares it with the refcounts; a manager alone on the pool, or a
//! `PoolPeers` group holding all its members, compares it with their caches (`managers.rs`).
//!
//! # Files
//!
//! This file holds the pool's state and construction; one concept per child: `free_stack.rs`
//! (reservations, pops and pushes) over `tagged_head.rs` (the head word) and `cas.rs` (the
//! retry loop), `allocation.rs` (the public takes), `refcounts.rs` (handles, retain and
//! release) over `handle.rs` (the per-block word), `cached.rs` (cached-evictable blocks),
//! `geometry.rs` (size limits), `managers.rs` (how many managers are attached, for the exact
//! cached-count check) and `invariants.rs` (the checks).

use std::fmt;

mod allocation;
mod cached;
mod cas;
mod free_stack;
mod geometry;
mod handle;
mod invariants;
mod managers;
mod refcounts;
mod tagged_head;

pub(crate) use geometry::validate_geometry;
pub use geometry::{MAX_NUM_BLOCKS, MAX_NUM_SLOTS};

use crate::error::Result;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, CachePadded, Ordering};
use tagged_head::{pack, NIL};

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
    /// `{changes: u32, managers: u32}`: the managers allocating from this pool, and a tag that
    /// goes up on every attach and detach (`managers.rs`). Written only when a manager is
    /// built or dropped.
    managers: AtomicU64,
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
            managers: AtomicU64::new(0),
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
}

#[cfg(all(test, not(loom)))]
mod tests;
