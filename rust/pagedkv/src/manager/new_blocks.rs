//! Per-step deltas: the log of table entries placed since the last `take_new_block_ids`
//! (`ManagerConfig::record_new_block_ids`; docs/design.md, Per-chunk allocation, "Per-step
//! deltas").
//!
//! Every change to a table entry is logged in table order: new positions (fresh blocks and
//! prefix hits), copy-on-write replacements, swap-ins, a fork's entries, and positions a
//! window group released (logged with [`NULL_BLOCK`]). A model runner that keeps its own copy
//! of the tables patches it from the log instead of copying whole tables each step; the
//! entries marked `fresh` (newly allocated blocks whose K/V the caller writes) are vLLM's
//! `take_new_block_ids` list of blocks to zero.
//!
//! Bounded memory when never drained, as the copy queue is (`copy_queue`): past a threshold
//! the log is compacted, keeping only entries that still describe a live table entry
//! (the sequence is resident, the position exists, it holds that block, and no later entry
//! for the same position supersedes it). The threshold doubles past the survivors, so
//! compaction costs amortized O(1) per entry.

use rustc_hash::FxHashSet;

use super::groups::NULL_BLOCK;
use super::KvCacheManager;
use crate::{BlockId, SeqId};

/// Entries a compaction leaves room for beyond twice the pool's blocks.
const COMPACT_SLACK: usize = 64;

/// Table entries placed since the last drain, as parallel arrays in the order they were
/// placed ([`KvCacheManager::take_new_block_ids`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewBlockIds {
    /// The sequence of each entry.
    pub seq_ids: Vec<SeqId>,
    /// Its KV-cache group.
    pub groups: Vec<u32>,
    /// Its table position (logical block index).
    pub positions: Vec<u32>,
    /// The block now at that position ([`NULL_BLOCK`] for a released position).
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
struct Entry {
    seq_id: SeqId,
    group: u32,
    position: u32,
    block: BlockId,
    fresh: bool,
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
}

impl KvCacheManager {
    /// Drains the table entries placed since the last call, oldest first (empty unless
    /// `ManagerConfig::record_new_block_ids`).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, record_new_block_ids: true, ..Default::default()
    /// })?;
    /// kv.add_sequence_len(7, 3)?;                     // positions 0 and 1
    /// let new = kv.take_new_block_ids();
    /// assert_eq!((new.seq_ids, new.positions, new.block_ids), (vec![7, 7], vec![0, 1], vec![0, 1]));
    /// assert_eq!(new.fresh, vec![true, true]);
    /// assert!(kv.take_new_block_ids().is_empty());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn take_new_block_ids(&mut self) -> NewBlockIds {
        let Some(log) = self.new_blocks.as_mut() else {
            return NewBlockIds::default();
        };
        let entries = std::mem::take(&mut log.entries);
        log.compact_at = log.floor;
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

    /// Logs group `group`'s entries at `positions` of resident sequence `seq_id`, as they are
    /// now; `fresh` marks them newly allocated. Nothing when the log is off.
    #[inline]
    pub(super) fn note_placed(
        &mut self,
        seq_id: SeqId,
        group: usize,
        positions: std::ops::Range<usize>,
        fresh: bool,
    ) {
        if self.new_blocks.is_some() && !positions.is_empty() {
            self.note_placed_slow(seq_id, group, positions, fresh);
        }
    }

    /// [`Self::note_placed`] of group 0's fresh `positions` of the sequence in row `row` (the
    /// single-group growth path).
    #[inline]
    pub(super) fn note_placed_row(&mut self, row: usize, positions: std::ops::Range<usize>) {
        if self.new_blocks.is_some() && !positions.is_empty() {
            let id = self.seqs.id_at(row);
            self.note_placed_slow(id, 0, positions, true);
        }
    }

    /// [`Self::note_placed`] over every group.
    #[inline]
    pub(super) fn note_placed_all(
        &mut self,
        seq_id: SeqId,
        positions: std::ops::Range<usize>,
        fresh: bool,
    ) {
        if self.new_blocks.is_some() && !positions.is_empty() {
            for g in 0..self.num_groups() {
                self.note_placed_slow(seq_id, g, positions.clone(), fresh);
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn note_placed_slow(
        &mut self,
        seq_id: SeqId,
        group: usize,
        positions: std::ops::Range<usize>,
        fresh: bool,
    ) {
        let Some(seq) = self.seqs.get(&seq_id) else {
            return;
        };
        let Some(log) = self.new_blocks.as_mut() else {
            return;
        };
        let table = seq.group_table(group);
        for pos in positions {
            let block = table[pos];
            log.entries.push(Entry {
                seq_id,
                group: group as u32,
                position: pos as u32, // positions < num_blocks * ... < 2^32 (pool limit)
                block,
                fresh: fresh && block != NULL_BLOCK,
            });
        }
        if log.entries.len() >= log.compact_at {
            self.compact_new_blocks();
        }
    }

    /// Drops the log's dead entries (see the module docs).
    #[cold]
    fn compact_new_blocks(&mut self) {
        let Some(mut log) = self.new_blocks.take() else {
            return;
        };
        let before = log.entries.len();
        let mut seen: FxHashSet<(SeqId, u32, u32)> = FxHashSet::default();
        let mut kept: Vec<Entry> = Vec::with_capacity(before / 2);
        for e in log.entries.iter().rev() {
            if !seen.insert((e.seq_id, e.group, e.position)) {
                continue; // a later entry supersedes it
            }
            let live = self.seqs.get(&e.seq_id).is_some_and(|s| {
                !s.swapped
                    && (e.group as usize) < s.groups.len() + 1
                    && s.group_table(e.group as usize).get(e.position as usize) == Some(&e.block)
            });
            if live {
                kept.push(*e);
            }
        }
        kept.reverse();
        log.entries = kept;
        log.compact_at = log.floor.max(
            log.entries
                .len()
                .saturating_mul(2)
                .saturating_add(COMPACT_SLACK),
        );
        self.new_blocks = Some(log);
    }

    /// Entries held by the new-block log (for tests and `check_invariants`).
    pub(super) fn new_block_log_len(&self) -> Option<(usize, usize)> {
        self.new_blocks.as_ref().map(|l| (l.len(), l.compact_at))
    }
}
