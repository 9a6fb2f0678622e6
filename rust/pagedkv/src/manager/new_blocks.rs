//! `take_new_block_ids` and the hooks every table change calls to log its entries
//! (`ManagerConfig::record_new_block_ids`; the log itself, and its compaction, are in
//! `new_block_log.rs`).

use super::group_spec::NULL_BLOCK;
use super::new_block_log::{Entry, NewBlockIds};
use super::state::KvCacheManager;
use crate::SeqId;

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
        match self.new_blocks.as_mut() {
            Some(log) => log.drain(),
            None => NewBlockIds::default(),
        }
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
        let mut compact = false;
        for pos in positions {
            let block = table[pos];
            compact |= log.push(Entry {
                seq_id,
                group: group as u32,
                position: pos as u32, // positions < num_blocks * ... < 2^32 (pool limit)
                block,
                fresh: fresh && block != NULL_BLOCK,
            });
        }
        if compact {
            self.compact_new_blocks();
        }
    }

    /// Drops the log's dead entries (see `new_block_log.rs`): those that no longer describe a
    /// resident sequence's table entry.
    #[cold]
    fn compact_new_blocks(&mut self) {
        let Some(log) = self.new_blocks.as_mut() else {
            return;
        };
        let seqs = &self.seqs;
        log.compact(|e| {
            seqs.get(&e.seq_id).is_some_and(|s| {
                !s.swapped
                    && (e.group as usize) < s.groups.len() + 1
                    && s.group_table(e.group as usize).get(e.position as usize) == Some(&e.block)
            })
        });
    }

    /// Entries held by the new-block log (for tests and `check_invariants`).
    pub(super) fn new_block_log_len(&self) -> Option<(usize, usize)> {
        self.new_blocks.as_ref().map(|l| (l.len(), l.compact_at()))
    }
}
