//! The per-block word that block handles ([`BlockHandle`](crate::BlockHandle), `types.rs`) are
//! checked against: the generation and the refcount in one atomic word.
//!
//! # Why a generation next to the refcount
//!
//! A block id names a physical block, not one tenancy of it: once the last reference is
//! dropped, the same id is handed to the next allocation, possibly another manager's. An
//! id-based `release` from a caller that has already let go (a double release, or a release
//! after a reallocation) would silently drop a reference that now belongs to someone else.
//!
//! Each block therefore carries a 32-bit *generation* that the pool bumps every time the block
//! goes from refcount 0 to 1 (an allocation, or a manager reviving it from its prefix cache).
//! A [`BlockHandle`](crate::BlockHandle) (an id type, in `types.rs`) remembers the generation
//! it was taken under, and the public
//! [`BlockPool::retain`](super::BlockPool::retain) and
//! [`BlockPool::release`](super::BlockPool::release) refuse it with
//! [`Error::StaleHandle`](crate::Error::StaleHandle) once the block has been freed and handed
//! out again.
//!
//! The generation and the refcount share one `AtomicU64` (`{generation: u32, refcount: u32}`)
//! because the check and the update must be one atomic step: with two words, a `retain` could
//! check the generation, lose the CPU while the block is freed and reallocated, and then
//! increment the new tenant's refcount. With one word, a single CAS compares both. The
//! generation wraps after 2^32 reallocations of the same block; a handle kept across exactly a
//! multiple of 2^32 of them would pass the check, which no realistic holder does.

/// One in the generation half of a block's word.
const GENERATION_ONE: u64 = 1 << 32;

/// The refcount half of a block's word.
#[inline]
pub(super) fn refcount_of(word: u64) -> u32 {
    word as u32
}

/// The generation half of a block's word.
#[inline]
pub(super) fn generation_of(word: u64) -> u32 {
    (word >> 32) as u32
}

/// A block's word with refcount 1 and the next generation: what an allocation installs on a
/// free block whose word is `word` (refcount 0, so one add does both, and the generation's
/// carry out of bit 63 is its wrap).
#[inline]
pub(super) fn next_tenancy(word: u64) -> u64 {
    debug_assert_eq!(refcount_of(word), 0);
    word.wrapping_add(GENERATION_ONE + 1)
}
