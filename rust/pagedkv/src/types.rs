//! The id types every module shares: a leaf (it imports nothing from the crate), so a module
//! that names a block or a sequence depends on this file rather than on the crate root (or,
//! for a [`BlockHandle`], on the pool: the error type names handles, and the pool returns
//! errors).

use std::fmt;

/// Caller-chosen sequence id.
pub type SeqId = u64;
/// Physical block id in `[0, num_blocks)`.
pub type BlockId = u32;
/// Vocabulary token id.
pub type TokenId = u32;

/// A reference to one tenancy of a block: the block id and the generation the block had when
/// the handle was taken. [`BlockPool::retain`](crate::BlockPool::retain) and
/// [`BlockPool::release`](crate::BlockPool::release) accept it only while that tenancy lasts
/// (the block has not been freed and handed out again since); otherwise they return
/// [`Error::StaleHandle`](crate::Error::StaleHandle) and change nothing. Why a generation, and
/// the atomic word it is checked against: `pool/handle.rs`.
///
/// Take a handle with [`BlockPool::handle`](crate::BlockPool::handle) right after allocating,
/// while you hold a reference: a handle taken to a block you do not hold names whoever holds it
/// now, and the check cannot protect that block.
///
/// ```
/// use pagedkv::{BlockPool, Error};
/// let pool = BlockPool::new(1, 16)?;
/// let id = pool.allocate(1)?[0];
/// let mine = pool.handle(id)?;
/// assert_eq!(mine.id(), id);
/// assert!(pool.release(mine)?);               // freed
/// let theirs = pool.handle(pool.allocate(1)?[0])?;
/// assert_eq!(theirs.id(), id);                // same block, next tenancy
/// assert!(matches!(pool.release(mine), Err(Error::StaleHandle(h)) if h == mine));
/// assert_eq!(pool.refcount(id)?, 1);          // the new tenant's reference is intact
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHandle {
    /// The block (an index into the KV cache tensors).
    id: BlockId,
    /// The block's generation when the handle was taken; only the pool makes handles, so it is
    /// a generation the block really had.
    generation: u32,
}

impl BlockHandle {
    /// The handle of tenancy `generation` of block `id` (only the pool knows which is current).
    #[inline]
    pub(crate) fn new(id: BlockId, generation: u32) -> Self {
        BlockHandle { id, generation }
    }

    /// The block id (the index into the KV cache tensors).
    #[inline]
    pub fn id(self) -> BlockId {
        self.id
    }

    /// The block's generation when the handle was taken.
    #[inline]
    pub fn generation(self) -> u32 {
        self.generation
    }
}

impl fmt::Debug for BlockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHandle({}@{})", self.id, self.generation)
    }
}

impl fmt::Display for BlockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {} (generation {})", self.id, self.generation)
    }
}
