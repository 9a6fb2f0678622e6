//! Window release (docs/design.md, KV groups, "Release rule"): a sliding-window group
//! releases the leading blocks no later query of the sequence reads, at the processed
//! watermark, before an operation sizes its allocation (vLLM's `remove_skipped_blocks`).

use super::group_spec::NULL_BLOCK;
use super::state::KvCacheManager;
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Per group, the positions `first..end` of resident sequence `seq_id` that a processed
    /// watermark of `processed` tokens releases: `end` is the group's `skipped_blocks` (at most
    /// the table's length), `first` the first live position (released ones are a leading run).
    pub(super) fn release_plan(&self, seq_id: SeqId, processed: usize) -> Vec<(usize, usize)> {
        let seq = &self.seqs[&seq_id];
        self.config
            .kv_groups
            .iter()
            .enumerate()
            .map(|(g, spec)| {
                let table = seq.group_table(g);
                let end = spec
                    .skipped_blocks(processed, self.block_size)
                    .min(table.len());
                let first = table[..end]
                    .iter()
                    .rposition(|&b| b == NULL_BLOCK)
                    .map_or(0, |p| p + 1);
                (first, end)
            })
            .collect()
    }

    /// Releases the planned positions of each group, the later block first (vLLM walks back
    /// from the window start, so the later block goes first into the eviction order).
    pub(super) fn apply_release(&mut self, seq_id: SeqId, plan: &[(usize, usize)]) {
        for (g, &(first, end)) in plan.iter().enumerate() {
            if first >= end {
                continue;
            }
            let row = self.seqs.row(seq_id).expect("planned for a live sequence");
            let released: Vec<BlockId> = {
                let table = self.seqs.at_mut(row).group_table_mut(g);
                (first..end)
                    .rev()
                    .map(|i| std::mem::replace(&mut table[i], NULL_BLOCK))
                    .collect()
            };
            for b in released {
                self.release(b);
            }
            self.note_placed(seq_id, g, first..end, false);
        }
    }

    /// The window release of resident sequence `seq_id` at a processed watermark of
    /// `processed` tokens (infallible; nothing for a manager without window groups).
    #[inline]
    pub(super) fn release_out_of_window(&mut self, seq_id: SeqId, processed: usize) {
        if self.plain {
            return;
        }
        let plan = self.release_plan(seq_id, processed);
        self.apply_release(seq_id, &plan);
    }
}
