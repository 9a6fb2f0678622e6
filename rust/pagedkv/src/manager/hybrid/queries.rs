//! Read-only views of a hybrid manager: per-group block tables (released positions as
//! `NULL_BLOCK`, `-1` in the i32/i64 views), slot mappings, CSR page tables, stats.

use super::Hybrid;
use crate::error::{Error, Result};
use crate::manager::check_distinct;
use crate::manager::groups::NULL_BLOCK;
use crate::manager::queries::{check_new_tokens, hit_rate, padded_buffers, slot_buffer};
use crate::manager::CsrPageTable;
use crate::stats::Stats;
use crate::table::BlockTable;
use crate::{BlockId, SeqId};

/// A table entry as the i32 views show it: `-1` for a released position.
#[inline]
fn entry_i32(b: BlockId) -> i32 {
    if b == NULL_BLOCK {
        -1
    } else {
        b as i32 // < MAX_NUM_BLOCKS (2^24)
    }
}

impl Hybrid {
    pub(crate) fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    pub(crate) fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub(crate) fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Group `group`'s table of a resident sequence.
    #[cold]
    pub(crate) fn table(&self, seq_id: SeqId, group: usize) -> Result<&BlockTable> {
        self.check_group(group)?;
        Ok(&self.resident(seq_id)?.tables[group])
    }

    pub(crate) fn num_tokens(&self, seq_id: SeqId) -> Result<usize> {
        self.seqs
            .get(&seq_id)
            .map(|s| s.num_tokens())
            .ok_or(Error::UnknownSequence(seq_id))
    }

    /// Validates a batch view: group in range, every id resident, no id twice.
    fn check_batch(&self, seq_ids: &[SeqId], group: usize) -> Result<()> {
        self.check_group(group)?;
        for &id in seq_ids {
            self.resident(id)?;
        }
        check_distinct(seq_ids)
    }

    /// See [`crate::KvCacheManager::batch_block_tables_group`].
    #[cold]
    pub(crate) fn batch_block_tables(
        &self,
        seq_ids: &[SeqId],
        group: usize,
    ) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        self.check_batch(seq_ids, group)?;
        let max_blocks = seq_ids
            .iter()
            .map(|id| self.seqs[id].tables[group].block_ids.len())
            .max()
            .unwrap_or(0);
        let (mut tables, mut lens) = padded_buffers(seq_ids.len(), max_blocks)?;
        for (row, id) in seq_ids.iter().enumerate() {
            let t = &self.seqs[id].tables[group];
            for (cell, &b) in tables[row * max_blocks..].iter_mut().zip(&t.block_ids) {
                *cell = entry_i32(b);
            }
            lens.push(i32::try_from(t.num_tokens).unwrap_or(i32::MAX));
        }
        Ok((tables, max_blocks, lens))
    }

    /// See [`crate::KvCacheManager::slot_mapping_group`]: `-1` for a token whose position was
    /// released.
    #[cold]
    pub(crate) fn slot_mapping(
        &self,
        seq_ids: &[SeqId],
        num_new_tokens: usize,
        group: usize,
    ) -> Result<Vec<i64>> {
        self.check_group(group)?;
        for &id in seq_ids {
            check_new_tokens(id, self.resident(id)?.num_tokens(), num_new_tokens)?;
        }
        check_distinct(seq_ids)?;
        let mut out = slot_buffer(seq_ids.len(), num_new_tokens)?;
        let bs = self.block_size;
        for id in seq_ids {
            let t = &self.seqs[id].tables[group];
            for pos in t.num_tokens - num_new_tokens..t.num_tokens {
                let b = t.block_ids[pos / bs];
                out.push(if b == NULL_BLOCK {
                    -1
                } else {
                    b as i64 * bs as i64 + (pos % bs) as i64
                });
            }
        }
        Ok(out)
    }

    /// See [`crate::KvCacheManager::csr_page_table_group`]: released positions are `-1`.
    #[cold]
    pub(crate) fn csr_page_table(&self, seq_ids: &[SeqId], group: usize) -> Result<CsrPageTable> {
        self.check_batch(seq_ids, group)?;
        let nnz: usize = seq_ids
            .iter()
            .map(|id| self.seqs[id].tables[group].block_ids.len())
            .sum();
        let mut csr = CsrPageTable::sized(seq_ids.len(), nnz)?;
        for id in seq_ids {
            let t = &self.seqs[id].tables[group];
            csr.push_row(
                t.block_ids.iter().map(|&b| entry_i32(b)),
                t.num_tokens,
                self.block_size,
            );
        }
        Ok(csr)
    }

    pub(crate) fn take_copy_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        std::mem::take(&mut self.pending_copies)
    }

    pub(crate) fn usage(&self) -> f64 {
        self.num_blocks_in_use as f64 / self.pool.num_blocks() as f64
    }

    /// See [`crate::KvCacheManager::stats`]: `num_blocks_in_use` counts every group's blocks.
    #[cold]
    pub(crate) fn stats(&self) -> Stats {
        let mut s = Stats {
            num_blocks: self.pool.num_blocks(),
            block_size: self.block_size,
            num_blocks_in_use: self.num_blocks_in_use,
            num_free_list_blocks: self.pool.num_free_list_blocks(),
            num_available_blocks: self.num_available_blocks(),
            num_sequences: self.seqs.len(),
            num_swapped_sequences: self.num_swapped,
            num_pinned_blocks: self.num_pinned_blocks(),
            ..Stats::default()
        };
        self.counters.write_to(&mut s);
        if let Some(c) = self.cache.as_ref() {
            s.num_cached_blocks = c.lru.len();
            s.prefix_query_tokens = c.query_tokens;
            s.prefix_hit_tokens = c.hit_tokens;
            s.prefix_hit_rate = hit_rate(c.query_tokens, c.hit_tokens);
            s.blocks_evicted = c.blocks_evicted;
            s.events_dropped = c.events.dropped;
            s.event_queue_bytes = c.events.bytes();
        }
        if let Some(h) = self.host.as_ref() {
            s.num_host_blocks = h.num_blocks();
            s.num_host_blocks_in_use = h.num_in_use();
        }
        s
    }
}
