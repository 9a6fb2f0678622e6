//! Bounding the pending copy-on-write queue when the caller never drains it.
//!
//! `take_copy_ops` is meant to be called before every forward pass; a caller that never calls
//! it would otherwise grow `pending_copies` by one pair per copy-on-write, forever. Dropping
//! pairs would corrupt caches, so instead the queue is compacted by **dead-copy elimination**
//! whenever it passes a threshold: walking the pairs newest first, a copy `(src, dst)` is kept
//! only if the content it writes into `dst` can still be observed, that is if `dst` is held by
//! this manager now (a resident table or its prefix cache) and no later kept copy overwrites
//! `dst` first, or a later kept copy reads `dst`. Executing the compacted queue leaves every
//! block this manager holds with exactly the content the full queue would have given it.
//!
//! Blocks written by a dropped copy are free (or another manager's, on a shared pool), so
//! their content is unobservable through this manager. The threshold doubles past the
//! surviving length after each compaction, so compaction costs amortized O(1) per copy.

use super::state::KvCacheManager;
use crate::BlockId;

/// Compaction starts once this many pairs are pending beyond `2 * num_blocks`.
const COMPACT_SLACK: usize = 64;

/// The pending-copy count of the first compaction for a pool of `num_blocks`.
pub(super) fn initial_threshold(num_blocks: usize) -> usize {
    threshold(num_blocks, 0)
}

/// The pending-copy count at which the next compaction runs, `survivors` pairs having
/// survived the last one.
pub(super) fn threshold(num_blocks: usize, survivors: usize) -> usize {
    num_blocks
        .saturating_mul(2)
        .max(survivors.saturating_mul(2))
        .saturating_add(COMPACT_SLACK)
}

impl KvCacheManager {
    /// Compacts `pending_copies` when it has passed its threshold (see the module docs).
    pub(super) fn bound_pending_copies(&mut self) {
        if self.pending_copies.len() < self.copies_compact_at {
            return;
        }
        let num_blocks = self.pool.num_blocks();
        // `live[b]`: the current content of block b may still be observed.
        let mut live = vec![false; num_blocks];
        for (_, seq) in self.seqs.iter() {
            if !seq.swapped {
                for g in 0..seq.groups.len() + 1 {
                    for &b in seq.group_table(g) {
                        if b != super::group_spec::NULL_BLOCK {
                            live[b as usize] = true;
                        }
                    }
                }
            }
        }
        if let Some(prefix) = &self.prefix {
            for (b, slot) in live.iter_mut().enumerate() {
                if !*slot && prefix.is_indexed(b as BlockId) {
                    *slot = true;
                }
            }
        }
        let kept = compact(&self.pending_copies, live);
        self.counters.copy_ops_elided += (self.pending_copies.len() - kept.len()) as u64;
        self.pending_copies = kept;
        self.copies_compact_at = threshold(num_blocks, self.pending_copies.len());
    }
}

/// The copies of `ops` (executed in order) whose effect on blocks marked in `live` survives,
/// in order; `live` is consumed as scratch.
pub(super) fn compact(ops: &[(BlockId, BlockId)], mut live: Vec<bool>) -> Vec<(BlockId, BlockId)> {
    let mut kept = Vec::with_capacity(ops.len());
    for &(src, dst) in ops.iter().rev() {
        if live[dst as usize] {
            // Earlier writes to dst are dead unless a copy in between reads it.
            live[dst as usize] = false;
            live[src as usize] = true;
            kept.push((src, dst));
        }
    }
    kept.reverse();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splitmix64;
    use crate::{KvCacheManager, ManagerConfig};

    /// Runs `ops` on symbolic contents (block b starts holding value b).
    fn execute(ops: &[(BlockId, BlockId)], num_blocks: usize) -> Vec<usize> {
        let mut content: Vec<usize> = (0..num_blocks).collect();
        for &(src, dst) in ops {
            content[dst as usize] = content[src as usize];
        }
        content
    }

    #[test]
    fn compaction_preserves_every_live_block() {
        let mut state = 11_u64;
        let mut rng = || splitmix64::next(&mut state);
        for _ in 0..2_000 {
            let num_blocks = 1 + (rng() % 8) as usize;
            let len = (rng() % 24) as usize;
            let ops: Vec<(BlockId, BlockId)> = (0..len)
                .map(|_| {
                    let src = (rng() % num_blocks as u64) as BlockId;
                    let dst = (rng() % num_blocks as u64) as BlockId;
                    (src, dst)
                })
                .collect();
            let live: Vec<bool> = (0..num_blocks).map(|_| rng() % 2 == 0).collect();
            let kept = compact(&ops, live.clone());
            assert!(kept.len() <= ops.len());
            let full = execute(&ops, num_blocks);
            let short = execute(&kept, num_blocks);
            for b in 0..num_blocks {
                if live[b] {
                    assert_eq!(full[b], short[b], "block {b}: ops {ops:?} kept {kept:?}");
                }
            }
        }
    }

    #[test]
    fn undrained_copy_on_write_keeps_bounded_memory() {
        // Fork, write into the shared partial block (a copy), free the child: forever, never
        // calling take_copy_ops. Without compaction the queue grows by one pair per cycle.
        let mut kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 16,
            block_size: 4,
            ..Default::default()
        })
        .unwrap();
        kv.add_sequence_len(0, 5).unwrap();
        let mut peak = 0;
        for cycle in 0..20_000_u64 {
            kv.fork(0, 1).unwrap();
            kv.append_len(1, 1).unwrap();
            if cycle % 3 == 0 {
                kv.append_len(0, 1).unwrap(); // the parent grows too: its last block moves on
            }
            kv.free(1).unwrap();
            if kv.num_tokens(0).unwrap() >= 60 {
                kv.free(0).unwrap();
                kv.add_sequence_len(0, 5).unwrap();
            }
            peak = peak.max(kv.pending_copies.len());
        }
        kv.check_invariants().unwrap();
        assert!(peak <= initial_threshold(16), "peak {peak}");
        assert!(kv.stats().copy_ops_elided > 0);
        assert!(kv.stats().cow_copies > 1_000);
    }
}
