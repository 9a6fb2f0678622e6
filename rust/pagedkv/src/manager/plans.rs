//! The plans growth validates before anything changes: one table's [`GrowthPlan`], and the
//! [`BatchScratch`] buffers a batch call keeps its members' plans in (a field of the manager's
//! state, so a leaf below both `growth.rs` and `batch.rs`).

use rustc_hash::FxHashMap;

use crate::BlockId;

/// What growing one table needs, validated before anything changes.
#[derive(Debug, Clone, Copy)]
pub(super) struct GrowthPlan {
    /// Fresh blocks to take (new blocks, plus one for the copy when `copy_on_write`).
    pub(super) needed_blocks: usize,
    /// Whether the last block is shared and must be copied before it is written.
    pub(super) copy_on_write: bool,
}

/// Buffers a batch call reuses across calls, so an engine step allocates nothing.
#[derive(Debug, Default)]
pub(super) struct BatchScratch {
    /// Per batch member, in order: its row in `KvCacheManager::seqs`.
    pub(super) rows: Vec<usize>,
    /// Per batch member, in order: its validated growth plan.
    pub(super) plans: Vec<GrowthPlan>,
    /// Shared last blocks -> references to them already given up (copied away from) by
    /// earlier members of the batch. Only blocks with refcount > 1 get an entry.
    pub(super) cow_releases: FxHashMap<BlockId, u32>,
    /// Copy-on-write `(src, dst)` pairs of an apply pass, recorded after it (no prefix cache).
    pub(super) copies: Vec<(BlockId, BlockId)>,
}
