//! The managers attached to a pool: how many there are, so that a manager's check can tell
//! when the pool's cached-block count must equal its own prefix cache's (or, for a
//! [`crate::PoolPeers`] group holding every member's lock, the sum of theirs).
//!
//! Only managers change the cached-block count (the transitions in `cached.rs` are
//! crate-private), each only inside its own operations (`&mut self`), and each counts what it
//! released before the operation returns. So while the managers whose caches are summed are
//! the only ones attached and none of them is mid-operation, the count is exact, whatever
//! embedders do with their own blocks meanwhile. The free-list equalities still need the whole
//! pool at rest (`check_invariants_quiescent`).

use super::BlockPool;
use crate::sync::Ordering;

/// An attach adds 1 to the change tag (high half) and to the count (low half).
const ATTACH: u64 = (1 << 32) | 1;
/// A detach adds 1 to the tag and takes 1 from the count: `count + (2^32 - 1)` carries one
/// into the tag while the count is at least 1, which a detach's own attach guarantees.
const DETACH: u64 = (1 << 32) - 1;

impl BlockPool {
    /// A manager starts allocating from this pool (its construction, before its first call).
    pub(crate) fn attach_manager(&self) {
        self.managers.fetch_add(ATTACH, Ordering::AcqRel);
    }

    /// A manager stopped: called at the end of its drop, once its cached blocks are back on the
    /// free list.
    pub(crate) fn detach_manager(&self) {
        self.managers.fetch_add(DETACH, Ordering::AcqRel);
    }

    /// The cached-block count, when exactly `managers` managers were attached throughout the
    /// read and none attached or detached meanwhile; `None` otherwise.
    ///
    /// The attach word is read before and after the count, and both reads must see the same
    /// change: a manager that detached before the first read had already freed its cached
    /// blocks (its detach publishes them), and one whose cached-count change the count read
    /// saw had attached before the second read (the count's release publishes its attach).
    pub(crate) fn cached_count_with_managers(&self, managers: usize) -> Option<usize> {
        let before = self.managers.load(Ordering::Acquire);
        let cached = self.cached_count.load(Ordering::Acquire);
        let after = self.managers.load(Ordering::Acquire);
        let count = (before & u64::from(u32::MAX)) as usize;
        (before == after && count == managers).then_some(cached)
    }
}
