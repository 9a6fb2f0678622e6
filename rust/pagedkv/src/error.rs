//! Typed errors: one variant per kind of caller mistake or resource shortage.
//!
//! The Python bindings map every variant to its own exception class (docs/design.md, Python API), so the
//! variants are part of the public contract.

use std::fmt;

use crate::types::{BlockHandle, BlockId, SeqId};

/// The memory tier a block lives in: device (GPU) memory or the host (CPU) swap tier.
///
/// ```
/// use pagedkv::{Error, Tier};
/// let err = Error::OutOfBlocks { tier: Tier::Host, needed_blocks: 4, available_blocks: 1 };
/// assert!(err.to_string().contains("host"));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Device (accelerator) memory: the block pool that attention kernels read.
    Device,
    /// Host (CPU) memory: the swap tier.
    Host,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
        })
    }
}

/// Every way a pagedkv operation can fail. A failed operation changes nothing.
///
/// ```
/// use pagedkv::{Error, KvCacheManager, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 2, block_size: 4, ..Default::default() })?;
/// // More than the pool could ever hold: a malformed request, not a transient shortage.
/// assert!(matches!(kv.add_sequence_len(1, 100), Err(Error::InvalidArgument(_))));
/// kv.add_sequence_len(1, 8)?;
/// // Fits the pool in principle, but not now: retry later.
/// assert_eq!(
///     kv.add_sequence_len(2, 1),
///     Err(Error::OutOfBlocks { tier: pagedkv::Tier::Device, needed_blocks: 1, available_blocks: 0 })
/// );
/// assert_eq!(kv.free(7), Err(Error::UnknownSequence(7)));
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Not enough free blocks in `tier` right now; retrying after others free blocks may succeed.
    OutOfBlocks {
        /// Which tier ran short.
        tier: Tier,
        /// Blocks the operation needed in that tier.
        needed_blocks: usize,
        /// Blocks that were available to it.
        available_blocks: usize,
    },
    /// No sequence with this id exists.
    UnknownSequence(SeqId),
    /// A sequence with this id already exists.
    SequenceExists(SeqId),
    /// Malformed input, including a request that can never fit the pool.
    InvalidArgument(String),
    /// The operation needs a device-resident sequence, but this one is swapped out to the host.
    SequenceSwappedOut(SeqId),
    /// A block was released more often than it was referenced (refcount underflow).
    DoubleFree(BlockId),
    /// A [`BlockHandle`] outlived its tenancy: the block was freed (and maybe handed out again)
    /// since the handle was taken, so the handle's holder no longer owns a reference to it.
    StaleHandle(BlockHandle),
    /// An internal invariant (docs/design.md, Invariants) does not hold; a bug in pagedkv or in unsafe caller use.
    InvariantViolation(String),
    /// A result of `bytes` bytes could not be allocated (host memory, not blocks). Nothing
    /// changed; Python raises `MemoryError`.
    OutOfMemory {
        /// The size of the allocation that failed.
        bytes: usize,
    },
}

impl Error {
    /// How many blocks short an [`Error::OutOfBlocks`] was (`needed - available`), else `None`.
    ///
    /// ```
    /// use pagedkv::{Error, Tier};
    /// let e = Error::OutOfBlocks { tier: Tier::Device, needed_blocks: 5, available_blocks: 2 };
    /// assert_eq!(e.blocks_short(), Some(3));
    /// ```
    pub fn blocks_short(&self) -> Option<usize> {
        match self {
            Error::OutOfBlocks {
                needed_blocks,
                available_blocks,
                ..
            } => Some(needed_blocks.saturating_sub(*available_blocks)),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfBlocks { tier, needed_blocks, available_blocks } => write!(
                f,
                "out of {tier} blocks: needed {needed_blocks}, available {available_blocks} ({} short)",
                needed_blocks.saturating_sub(*available_blocks)
            ),
            Error::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            Error::SequenceExists(id) => write!(f, "sequence id {id} already exists"),
            Error::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            Error::SequenceSwappedOut(id) => {
                write!(f, "sequence {id} is swapped out to the host; swap it in first")
            }
            Error::DoubleFree(b) => {
                write!(f, "block {b} released more often than referenced (double free)")
            }
            Error::StaleHandle(h) => write!(
                f,
                "stale handle to {h}: the block was freed since the handle was taken"
            ),
            Error::InvariantViolation(msg) => write!(f, "invariant violated: {msg}"),
            Error::OutOfMemory { bytes } => {
                write!(f, "out of host memory: cannot allocate a result of {bytes} bytes")
            }
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with pagedkv's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::InvalidArgument(msg.into()))
}

/// A vector of `len` copies of `fill`, or [`Error::OutOfMemory`] when the allocation fails
/// (`vec![fill; len]` would abort the process instead).
pub(crate) fn try_filled<T: Clone>(len: usize, fill: T) -> Result<Vec<T>> {
    let mut out = try_with_capacity(len)?;
    out.resize(len, fill);
    Ok(out)
}

/// An empty vector with room for `len` items, or [`Error::OutOfMemory`].
pub(crate) fn try_with_capacity<T>(len: usize) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    })?;
    Ok(out)
}
