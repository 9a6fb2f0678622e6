//! Per-step deltas: the log of table entries placed since the last `take_new_block_ids`
//! (`ManagerConfig::record_new_block_ids`; docs/design.md, Per-chunk allocation, "Per-step
//! deltas").
//!
//! Every change to a table entry is logged in table order: new positions (fresh blocks and
//! prefix hits), copy-on-write replacements, swap-ins, a fork's entries, and positions a
//! window group released (logged with [`NULL_BLOCK`](crate::NULL_BLOCK)). A model runner
//! that keeps its own copy of the tables patches it from the log instead of copying whole
//! tables each step; the entries marked `fresh` (newly allocated blocks whose K/V the caller
//! writes) are vLLM's `take_new_block_ids` list of blocks to zero.
//!
//! Bounded memory when never drained, as the copy queue is (`copy_queue`): past a threshold
//! the log is compacted, keeping only entries that still describe a live table entry
//! (the sequence is resident, the position exists, it holds that block, and no later entry
//! for the same position supersedes it). The threshold doubles past the survivors, so
//! compaction costs amortized O(1) per entry.

use rustc_hash::FxHashSet;

use crate::{BlockId, SeqId};

/// Entries a compaction leaves room for beyond twice the pool's blocks.
const COMPACT_SLACK: usize = 64;

/// Table entries placed since the last drain, as parallel arrays in the order they were
/// placed ([`KvCacheManager::take_new_block_ids`](crate::KvCacheManager::take_new_block_ids)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewBlockIds {
    /// The sequence of each entry.
    pub seq_ids: Vec<SeqId>,
    /// Its KV-cache group.
    pub groups: Vec<u32>,
    /// Its table position (logical block index).
    pub positions: Vec<u32>,
    /// The block now at that position ([`NULL_BLOCK`](crate::NULL_BLOCK) for a released position).
    pub block_ids: Vec<BlockId>,
    /// Whether the block was newly allocated for the caller to write (a fresh block or a
    /// copy-on-write destination; not a prefix hit, load, swap-in, fork or release): vLLM's
    /// list of blocks to zero.
    pub fresh: Vec<bool>,
}

impl NewBlockIds {
    /// Entries drained.
    pub fn len(&self) -> usize {
        self.seq_ids.len()
    }

    /// Whether nothing was drained.
    pub fn is_empty(&self) -> bool {
        self.seq_ids.is_empty()
    }
}

/// One logged placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) seq_id: SeqId,
    pub(super) group: u32,
    pub(super) position: u32,
    pub(super) block: BlockId,
    pub(super) fresh: bool,
}

/// The log (see the module docs). Invariant: `entries.len() < compact_at` after every call.
#[derive(Debug)]
pub(crate) struct NewBlockLog {
    entries: Vec<Entry>,
    /// Length at which the log is next compacted.
    compact_at: usize,
    /// `2 * num_blocks + COMPACT_SLACK`, the least threshold.
    floor: usize,
}

impl NewBlockLog {
    pub(crate) fn new(num_blocks: usize) -> Self {
        let floor = num_blocks.saturating_mul(2).saturating_add(COMPACT_SLACK);
        NewBlockLog {
            entries: Vec::new(),
            compact_at: floor,
            floor,
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The length at which the log is next compacted.
    pub(super) fn compact_at(&self) -> usize {
        self.compact_at
    }

    /// Appends `entry`; true when the log has reached its compaction threshold (the caller then
    /// calls [`Self::compact`], which needs the tables to tell live entries).
    #[inline]
    pub(super) fn push(&mut self, entry: Entry) -> bool {
        self.entries.push(entry);
        self.entries.len() >= self.compact_at
    }

    /// Drains every entry, oldest first, as parallel arrays; the threshold drops to its floor.
    pub(super) fn drain(&mut self) -> NewBlockIds {
        let entries = std::mem::take(&mut self.entries);
        self.compact_at = self.floor;
        let mut out = NewBlockIds {
            seq_ids: Vec::with_capacity(entries.len()),
            groups: Vec::with_capacity(entries.len()),
            positions: Vec::with_capacity(entries.len()),
            block_ids: Vec::with_capacity(entries.len()),
            fresh: Vec::with_capacity(entries.len()),
        };
        for e in entries {
            out.seq_ids.push(e.seq_id);
            out.groups.push(e.group);
            out.positions.push(e.position);
            out.block_ids.push(e.block);
            out.fresh.push(e.fresh);
        }
        out
    }

    /// Drops the dead entries (see the module docs): an entry superseded by a later one for
    /// the same position, or one `live` says no longer describes a table entry. The threshold
    /// doubles past the survivors.
    #[cold]
    pub(super) fn compact(&mut self, live: impl Fn(&Entry) -> bool) {
        let before = self.entries.len();
        let mut seen: FxHashSet<(SeqId, u32, u32)> = FxHashSet::default();
        let mut kept: Vec<Entry> = Vec::with_capacity(before / 2);
        for e in self.entries.iter().rev() {
            if !seen.insert((e.seq_id, e.group, e.position)) {
                continue; // a later entry supersedes it
            }
            if live(e) {
                kept.push(*e);
            }
        }
        kept.reverse();
        self.entries = kept;
        self.compact_at = self.floor.max(
            self.entries
                .len()
                .saturating_mul(2)
                .saturating_add(COMPACT_SLACK),
        );
    }
}
