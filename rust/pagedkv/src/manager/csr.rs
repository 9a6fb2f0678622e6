//! Block tables in FlashInfer's CSR ("paged-KV") layout: one flat array of every sequence's
//! block ids plus offsets into it, instead of the padded `[B, max_blocks]` matrix.
//!
//! Why a second layout: the padded matrix costs `B * max_blocks` entries, so one long sequence in
//! a batch of short ones pads every row to its length; the CSR form costs exactly the blocks in
//! use, and it is what FlashInfer's `BatchPrefillWithPagedKVCacheWrapper` /
//! `BatchDecodeWithPagedKVCacheWrapper` take, so tables go to either library without conversion.
//! docs/page_tables.md shows both layouts side by side.

use super::checks::check_distinct;
use super::state::KvCacheManager;
use crate::error::{invalid, try_with_capacity, Result};
use crate::SeqId;

/// Sequences' block tables in CSR form (all `i32`, as FlashInfer's `int32` index tensors).
///
/// Row `i` (the i-th requested sequence) owns `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]`, its
/// physical block ids in logical order. `kv_last_page_len[i]` is the number of tokens in its last
/// block, in `1..=block_size`, and 0 for a sequence with no blocks, so that a sequence's length is
/// `(num_blocks - 1) * block_size + kv_last_page_len` when it has blocks and 0 otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CsrPageTable {
    /// `[B + 1]`, non-decreasing, `kv_indptr[0] == 0`, `kv_indptr[B] == kv_indices.len()`.
    pub kv_indptr: Vec<i32>,
    /// `[nnz]`: every row's physical block ids, row after row.
    pub kv_indices: Vec<i32>,
    /// `[B]`: tokens in each row's last block (0 for an empty sequence).
    pub kv_last_page_len: Vec<i32>,
}

impl CsrPageTable {
    /// An empty table sized for `num_seqs` rows and `nnz` block ids, `kv_indptr` holding its
    /// leading 0. Both managers size before building so that a table too large for `int32`
    /// offsets, or an allocation failure, leaves nothing half-built.
    #[inline]
    pub(super) fn sized(num_seqs: usize, nnz: usize) -> Result<Self> {
        if nnz > i32::MAX as usize {
            return invalid(format!(
                "the CSR page table would hold {nnz} block ids, more than int32 offsets address"
            ));
        }
        let mut csr = CsrPageTable {
            kv_indptr: try_with_capacity(num_seqs + 1)?,
            kv_indices: try_with_capacity(nnz)?,
            kv_last_page_len: try_with_capacity(num_seqs)?,
        };
        csr.kv_indptr.push(0);
        Ok(csr)
    }

    /// Appends one row: its block-id entries and the fill of its last block. Infallible once
    /// [`CsrPageTable::sized`] reserved room for every row.
    #[inline]
    pub(super) fn push_row(
        &mut self,
        entries: impl Iterator<Item = i32>,
        num_tokens: usize,
        block_size: usize,
    ) {
        self.kv_indices.extend(entries);
        self.kv_indptr.push(self.kv_indices.len() as i32); // <= nnz <= i32::MAX
        self.kv_last_page_len
            .push(last_page_len(num_tokens, block_size));
    }
}

impl KvCacheManager {
    /// The block tables of `seq_ids` (device-resident, in this order) in FlashInfer's CSR
    /// layout. All-or-nothing: an unknown or swapped-out id, an id given twice (as
    /// [`KvCacheManager::batch_block_tables`], so the result is bounded by the pool), or more
    /// than `i32::MAX` entries in all, is an error and nothing is built; a result that cannot be
    /// allocated is [`crate::Error::OutOfMemory`].
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 8, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;                 // blocks [0, 1], 2 tokens in block 1
    /// kv.add_sequence_len(2, 4)?;                 // block [2], full
    /// let csr = kv.csr_page_table(&[2, 1])?;
    /// assert_eq!(csr.kv_indptr, vec![0, 1, 3]);
    /// assert_eq!(csr.kv_indices, vec![2, 0, 1]);
    /// assert_eq!(csr.kv_last_page_len, vec![4, 2]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn csr_page_table(&self, seq_ids: &[SeqId]) -> Result<CsrPageTable> {
        if !self.plain || self.null_reserved || self.has_slots_beyond_tokens(seq_ids) {
            return self.csr_page_table_group(seq_ids, 0);
        }
        // Plan: look every sequence up and size the output before building anything.
        let mut nnz: usize = 0;
        for &id in seq_ids {
            nnz += self.resident(id)?.table.block_ids.len();
        }
        check_distinct(seq_ids)?;
        let mut csr = CsrPageTable::sized(seq_ids.len(), nnz)?;
        // Infallible from here.
        for &id in seq_ids {
            let table = &self.seqs[&id].table;
            // Block ids < MAX_NUM_BLOCKS (2^24) fit in i32.
            csr.push_row(
                table.block_ids.iter().map(|&b| b as i32),
                table.num_tokens,
                self.block_size,
            );
        }
        Ok(csr)
    }
}

impl KvCacheManager {
    /// Whether any of `seq_ids` holds lookahead slots past its tokens, or declares tokens past
    /// its slots (the general CSR view then trims or caps its row).
    fn has_slots_beyond_tokens(&self, seq_ids: &[SeqId]) -> bool {
        seq_ids.iter().any(|id| {
            self.seqs.get(id).is_some_and(|s| {
                let free = s.table.free_slots(self.block_size);
                free >= self.block_size
                    || s.table.block_ids.len() * self.block_size < s.table.num_tokens
            })
        })
    }
}

/// Tokens in the last block of a sequence of `num_tokens` tokens: `1..=block_size`, 0 when empty.
fn last_page_len(num_tokens: usize, block_size: usize) -> i32 {
    if num_tokens == 0 {
        0
    } else {
        ((num_tokens - 1) % block_size + 1) as i32 // <= block_size <= i32::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Error, ManagerConfig};

    fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
        KvCacheManager::new(ManagerConfig {
            num_blocks,
            block_size,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn last_page_len_covers_every_fill() {
        assert_eq!(last_page_len(0, 4), 0);
        assert_eq!(last_page_len(1, 4), 1);
        assert_eq!(last_page_len(4, 4), 4);
        assert_eq!(last_page_len(5, 4), 1);
        assert_eq!(last_page_len(7, 1), 1);
    }

    #[test]
    fn csr_matches_the_padded_tables_row_by_row() {
        let mut kv = manager(64, 4);
        for (id, len) in [(1u64, 9usize), (2, 0), (3, 4), (4, 17), (5, 1)] {
            kv.add_sequence_len(id, len).unwrap();
        }
        kv.fork(4, 6).unwrap();
        kv.append_len(6, 3).unwrap(); // copy-on-write of the shared last block
        let ids = [5u64, 1, 2, 6, 3, 4];
        let csr = kv.csr_page_table(&ids).unwrap();
        let (tables, max_blocks, lens) = kv.batch_block_tables(&ids).unwrap();
        assert_eq!(csr.kv_indptr.len(), ids.len() + 1);
        assert_eq!(csr.kv_indptr[0], 0);
        assert_eq!(
            *csr.kv_indptr.last().unwrap() as usize,
            csr.kv_indices.len()
        );
        for (row, &id) in ids.iter().enumerate() {
            let (a, b) = (csr.kv_indptr[row] as usize, csr.kv_indptr[row + 1] as usize);
            let blocks = kv.block_table(id).unwrap();
            assert_eq!(b - a, blocks.len());
            assert_eq!(
                &csr.kv_indices[a..b],
                &tables[row * max_blocks..row * max_blocks + blocks.len()]
            );
            let n = lens[row] as usize;
            let last = csr.kv_last_page_len[row] as usize;
            let rebuilt = if b == a { 0 } else { (b - a - 1) * 4 + last };
            assert_eq!(rebuilt, n, "row {row}");
        }
    }

    #[test]
    fn empty_batch_is_one_zero_offset() {
        let kv = manager(4, 2);
        assert_eq!(
            kv.csr_page_table(&[]).unwrap(),
            CsrPageTable {
                kv_indptr: vec![0],
                kv_indices: vec![],
                kv_last_page_len: vec![]
            }
        );
    }

    #[test]
    fn unknown_or_swapped_sequence_is_an_error() {
        let mut kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 8,
            block_size: 2,
            num_host_blocks: 8,
            ..Default::default()
        })
        .unwrap();
        kv.add_sequence_len(1, 3).unwrap();
        kv.add_sequence_len(2, 3).unwrap();
        assert_eq!(kv.csr_page_table(&[1, 9]), Err(Error::UnknownSequence(9)));
        assert!(matches!(
            kv.csr_page_table(&[1, 1]),
            Err(Error::InvalidArgument(_))
        ));
        kv.swap_out(&[2]).unwrap();
        assert!(kv.csr_page_table(&[1, 2]).is_err());
        assert_eq!(kv.csr_page_table(&[1]).unwrap().kv_indices.len(), 2);
    }
}
