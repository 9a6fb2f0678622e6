//! Window release (docs/design.md, KV groups, "Release rule"): a sliding-window group
//! releases the leading blocks no later query of the sequence reads, at the processed
//! watermark, before an operation sizes its allocation (vLLM's `remove_skipped_blocks`).

use super::group_spec::NULL_BLOCK;
use super::state::KvCacheManager;
use crate::error::{invalid, Result};
use crate::{BlockId, SeqId};

impl KvCacheManager {
    /// Per group, the positions `first..end` of resident sequence `seq_id` that a processed
    /// watermark of `processed` tokens releases: `end` is the group's `skipped_blocks` (at most
    /// the table's length), `first` the first live position (released ones are a leading run,
    /// but in a state group, whose null positions before `first..end` may be interior too).
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
                let first = if spec.is_state() {
                    // A state group's nulls are interior too: from its first live position.
                    table[..end]
                        .iter()
                        .position(|&b| b != NULL_BLOCK)
                        .unwrap_or(end)
                } else {
                    table[..end]
                        .iter()
                        .rposition(|&b| b == NULL_BLOCK)
                        .map_or(0, |p| p + 1)
                };
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
                    .filter(|&b| b != NULL_BLOCK)
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

    /// vLLM's `remove_skipped_blocks(request_id, processed_computed_tokens)` on its own (a KV
    /// connector's scheduler calls it before handing a finished request's tables over): every
    /// window group of resident sequence `seq_id` releases what a processed watermark of
    /// `processed` tokens puts out of its window, the later block first, as `allocate_slots`
    /// does first. Nothing for full-attention groups or positions already released.
    /// `processed` past the sequence's computed tokens: InvalidArgument (a released position
    /// must never be one the next query reads), changing nothing.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt, NULL_BLOCK};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 16, block_size: 2,
    ///     kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::SlidingWindow { window: 3 }],
    ///     ..Default::default()
    /// })?;
    /// let per_chunk = AdmitOptions { reserve_prompt: false, ..Default::default() };
    /// kv.add_sequence_with(1, Prompt::Len(8), &per_chunk)?;   // 8 computed, nothing released
    /// kv.release_skipped_blocks(1, 8)?;                       // 6 tokens out of the window
    /// let table = kv.block_table_group(1, 1)?;
    /// assert_eq!(table[..3], [NULL_BLOCK; 3]);                // 3 whole blocks of them
    /// assert_ne!(table[3], NULL_BLOCK);
    /// assert!(kv.release_skipped_blocks(1, 9).is_err());       // past the computed tokens
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn release_skipped_blocks(&mut self, seq_id: SeqId, processed: usize) -> Result<()> {
        let computed = self.resident(seq_id)?.num_computed;
        if processed > computed {
            return invalid(format!(
                "processed_computed_tokens={processed} is past sequence {seq_id}'s {computed} \
                 computed tokens"
            ));
        }
        self.release_out_of_window(seq_id, processed);
        Ok(())
    }
}
