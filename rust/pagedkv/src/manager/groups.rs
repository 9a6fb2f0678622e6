//! Per-group views of a manager's tables (docs/design.md, KV groups): one group's block
//! table, batch block tables, slot mapping and CSR page table (group 0 is what the ungrouped
//! views show). The group list itself, [`KvGroupSpec`], is in `group_spec.rs`.

use super::checks::check_distinct;
use super::csr::CsrPageTable;
use super::group_spec::{KvGroupSpec, NULL_BLOCK};
use super::queries;
use super::state::{KvCacheManager, Sequence};
use crate::error::{invalid, Result};
use crate::{BlockId, SeqId};

/// Per-group views of a manager (group 0 is what the ungrouped views show).
impl KvCacheManager {
    /// The KV-cache groups of this manager.
    pub fn kv_groups(&self) -> &[KvGroupSpec] {
        &self.config().kv_groups
    }

    /// InvalidArgument unless `group` names one of the groups.
    pub(super) fn check_group(&self, group: usize) -> Result<()> {
        if group >= self.kv_groups().len() {
            return invalid(format!(
                "group {group} is out of range: the manager has {} kv_groups",
                self.kv_groups().len()
            ));
        }
        Ok(())
    }

    /// What the integer views show for a released position: 0 when block 0 is the reserved
    /// null block (`ManagerConfig::reserve_null_block`), else -1.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let kv = KvCacheManager::new(ManagerConfig { reserve_null_block: true, ..Default::default() })?;
    /// assert_eq!((kv.null_entry(), kv.refcount(0)?), (0, 1));
    /// assert_eq!(kv.num_available_blocks(), 1023);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn null_entry(&self) -> i32 {
        if self.null_reserved {
            0
        } else {
            -1
        }
    }

    /// A table entry as the integer views show it (see [`Self::null_entry`]).
    #[inline]
    pub fn entry_i32(&self, b: BlockId) -> i32 {
        if b == NULL_BLOCK {
            self.null_entry()
        } else {
            b as i32 // < MAX_NUM_BLOCKS (2^24)
        }
    }

    /// Group `group`'s block table of a resident sequence ([`NULL_BLOCK`] at released
    /// positions).
    pub fn block_table_group(&self, seq_id: SeqId, group: usize) -> Result<&[BlockId]> {
        self.check_group(group)?;
        Ok(self.resident(seq_id)?.group_table(group))
    }

    /// [`Self::batch_block_tables`] of group `group` (released positions as
    /// [`Self::null_entry`]; -1 pads short rows).
    pub fn batch_block_tables_group(
        &self,
        seq_ids: &[SeqId],
        group: usize,
    ) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        self.check_group(group)?;
        let mut max_blocks = 0;
        for &id in seq_ids {
            max_blocks = max_blocks.max(self.resident(id)?.num_positions());
        }
        check_distinct(seq_ids)?;
        let (mut tables, mut lens) = queries::padded_buffers(seq_ids.len(), max_blocks)?;
        for (row, id) in seq_ids.iter().enumerate() {
            let seq = &self.seqs[id];
            for (cell, &b) in tables[row * max_blocks..]
                .iter_mut()
                .zip(seq.group_table(group))
            {
                *cell = self.entry_i32(b);
            }
            lens.push(i32::try_from(seq.table.num_tokens).unwrap_or(i32::MAX));
        }
        Ok((tables, max_blocks, lens))
    }

    /// [`Self::slot_mapping`] of group `group` (a token at a released position has the slot of
    /// its offset in the null block: -1 without a reserved null block).
    pub fn slot_mapping_group(
        &self,
        seq_ids: &[SeqId],
        num_new_tokens: usize,
        group: usize,
    ) -> Result<Vec<i64>> {
        self.check_group(group)?;
        let bs = self.block_size;
        for &id in seq_ids {
            let seq = self.resident(id)?;
            queries::check_new_tokens(id, seq.table.num_tokens, num_new_tokens)?;
            queries::check_slots(id, seq.table.num_tokens, seq.num_positions() * bs)?;
        }
        check_distinct(seq_ids)?;
        let mut out = queries::slot_buffer(seq_ids.len(), num_new_tokens)?;
        for id in seq_ids {
            let seq = &self.seqs[id];
            let table = seq.group_table(group);
            let n = seq.table.num_tokens;
            for pos in n - num_new_tokens..n {
                let b = table[pos / bs];
                out.push(if b != NULL_BLOCK {
                    b as i64 * bs as i64 + (pos % bs) as i64
                } else if self.null_reserved {
                    (pos % bs) as i64
                } else {
                    -1
                });
            }
        }
        Ok(out)
    }

    /// [`Self::csr_page_table`] of group `group` (released positions as
    /// [`Self::null_entry`] in `kv_indices`).
    pub fn csr_page_table_group(&self, seq_ids: &[SeqId], group: usize) -> Result<CsrPageTable> {
        self.check_group(group)?;
        let bs = self.block_size;
        // A row covers the sequence's tokens: lookahead pages past them are left out, and a
        // sequence admitted per chunk shows the tokens it holds slots for.
        let pages = |seq: &Sequence| seq.table.num_tokens.div_ceil(bs).min(seq.num_positions());
        let mut nnz: usize = 0;
        for &id in seq_ids {
            nnz += pages(self.resident(id)?);
        }
        check_distinct(seq_ids)?;
        let mut csr = CsrPageTable::sized(seq_ids.len(), nnz)?;
        for id in seq_ids {
            let seq = &self.seqs[id];
            let n = pages(seq);
            csr.push_row(
                seq.group_table(group)[..n]
                    .iter()
                    .map(|&b| self.entry_i32(b)),
                seq.table.num_tokens.min(n * bs),
                bs,
            );
        }
        Ok(csr)
    }
}
