//! Shapes and block tables, and the checks that make every later index in bounds.

use crate::error::{CpuError, Result};

/// A paged cache `[num_blocks, block_size, num_kv_heads, head_dim]`, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// Elements in one token's row (all KV heads).
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements in one block.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.token_elems()
    }

    /// Slots (tokens) in the cache.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Elements of the whole cache, or an error when the product overflows.
    pub fn elems(&self) -> Result<usize> {
        [self.block_size, self.num_kv_heads, self.head_dim]
            .iter()
            .try_fold(self.num_blocks, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| CpuError::Shape("cache shape overflows usize".into()))
    }

    /// `len` must be exactly this cache's element count.
    pub fn check_len(&self, name: &str, len: usize) -> Result<()> {
        if self.block_size == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(CpuError::Shape(format!(
                "{name}: block_size, num_kv_heads and head_dim must be >= 1, got {self:?}"
            )));
        }
        let want = self.elems()?;
        if len != want {
            return Err(CpuError::Shape(format!(
                "{name} has {len} elements, the shape {self:?} needs {want}"
            )));
        }
        Ok(())
    }
}

/// Block tables of a batch: row `i`'s logical block `j` is `entries[row_start[i] + j]` for
/// `j < row_len[i]`. Built from a padded `[B, max_blocks]` table or a FlashInfer-style CSR table.
/// Entries are not trusted: each one an attention call reads is checked first
/// (`check_used_blocks`); unread entries may hold anything (-1 padding, released blocks).
#[derive(Debug, Clone)]
pub struct BlockTables<'a> {
    entries: &'a [i32],
    row_start: Vec<usize>,
    row_len: Vec<usize>,
}

impl<'a> BlockTables<'a> {
    /// A padded table of `num_rows` rows of `max_blocks` entries.
    pub fn padded(entries: &'a [i32], num_rows: usize, max_blocks: usize) -> Result<Self> {
        if num_rows.checked_mul(max_blocks) != Some(entries.len()) {
            return Err(CpuError::Shape(format!(
                "block_tables has {} entries, [{num_rows}, {max_blocks}] needs {}",
                entries.len(),
                num_rows.saturating_mul(max_blocks)
            )));
        }
        Ok(Self {
            entries,
            row_start: (0..num_rows).map(|i| i * max_blocks).collect(),
            row_len: vec![max_blocks; num_rows],
        })
    }

    /// A CSR table: row `i` is `indices[indptr[i]..indptr[i + 1]]`; `indptr[0] == 0`,
    /// non-decreasing, `indptr[B] <= indices.len()`.
    pub fn csr(indptr: &[i32], indices: &'a [i32]) -> Result<Self> {
        if indptr.is_empty() {
            return Err(CpuError::Shape(
                "kv_indptr must have B + 1 >= 1 entries".into(),
            ));
        }
        if indptr[0] != 0 {
            return Err(CpuError::Argument(format!(
                "kv_indptr[0] must be 0, got {}",
                indptr[0]
            )));
        }
        let mut row_start = Vec::with_capacity(indptr.len() - 1);
        let mut row_len = Vec::with_capacity(indptr.len() - 1);
        for (i, pair) in indptr.windows(2).enumerate() {
            if pair[1] < pair[0] {
                return Err(CpuError::Argument(format!(
                    "kv_indptr must be non-decreasing: kv_indptr[{}] = {} < kv_indptr[{i}] = {}",
                    i + 1,
                    pair[1],
                    pair[0]
                )));
            }
            row_start.push(pair[0] as usize);
            row_len.push((pair[1] - pair[0]) as usize);
        }
        let end = indptr[indptr.len() - 1] as usize;
        if end > indices.len() {
            return Err(CpuError::Shape(format!(
                "kv_indptr[B] = {end} exceeds len(kv_indices) = {}",
                indices.len()
            )));
        }
        Ok(Self {
            entries: indices,
            row_start,
            row_len,
        })
    }

    /// Number of rows (sequences).
    pub fn num_rows(&self) -> usize {
        self.row_start.len()
    }

    /// Entries in row `row`.
    pub fn row_len(&self, row: usize) -> usize {
        self.row_len[row]
    }

    /// Row `row`'s logical block `j` as a block id; only after `check_used_blocks` covered it.
    #[inline]
    pub(crate) fn block(&self, row: usize, j: usize) -> usize {
        self.entries[self.row_start[row] + j] as usize
    }

    /// Row `row`'s logical blocks `first..last` must name blocks of a `num_blocks` cache.
    pub(crate) fn check_used_blocks(
        &self,
        row: usize,
        first: usize,
        last: usize,
        num_blocks: usize,
    ) -> Result<()> {
        if last > self.row_len[row] {
            return Err(CpuError::Argument(format!(
                "sequence {row} needs {last} blocks, its table row holds {}",
                self.row_len[row]
            )));
        }
        let start = self.row_start[row];
        for (j, &id) in self.entries[start + first..start + last].iter().enumerate() {
            if id < 0 || id as usize >= num_blocks {
                return Err(CpuError::BlockId {
                    row,
                    entry: first + j,
                    value: i64::from(id),
                    num_blocks,
                });
            }
        }
        Ok(())
    }

    /// The CSR tail check FlashInfer's layout implies: each row holds exactly
    /// `ceil(seq_len / block_size)` blocks and `kv_last_page_len[i]` tokens in its last one.
    pub fn check_csr_exact(
        &self,
        last_page_len: &[i32],
        seq_lens: &[i32],
        block_size: usize,
    ) -> Result<()> {
        if last_page_len.len() != self.num_rows() || seq_lens.len() != self.num_rows() {
            return Err(CpuError::Shape(format!(
                "kv_last_page_len ({}) and seq_lens ({}) need one entry per CSR row ({})",
                last_page_len.len(),
                seq_lens.len(),
                self.num_rows()
            )));
        }
        for (i, (&last, &len)) in last_page_len.iter().zip(seq_lens).enumerate() {
            let len = usize::try_from(len)
                .map_err(|_| CpuError::Argument(format!("seq_lens[{i}] = {len} is negative")))?;
            let needed = len.div_ceil(block_size);
            if self.row_len[i] != needed {
                return Err(CpuError::Argument(format!(
                    "CSR row {i} has {} blocks but seq_lens[{i}] = {len} needs {needed}",
                    self.row_len[i]
                )));
            }
            let expect = if len == 0 {
                0
            } else {
                (len - 1) % block_size + 1
            };
            if i64::from(last) != expect as i64 {
                return Err(CpuError::Argument(format!(
                    "kv_last_page_len[{i}] = {last} disagrees with seq_lens[{i}] = {len} \
                     (expected {expect})"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_and_csr_tables_address_the_same_blocks() {
        let padded = [3, 4, -1, 7, -1, -1];
        let p = BlockTables::padded(&padded, 2, 3).unwrap();
        let c = BlockTables::csr(&[0, 2, 3], &[3, 4, 7]).unwrap();
        for (row, n) in [(0, 2), (1, 1)] {
            for j in 0..n {
                assert_eq!(p.block(row, j), c.block(row, j));
            }
        }
        assert!(p.check_used_blocks(0, 0, 2, 8).is_ok());
        assert_eq!(
            p.check_used_blocks(0, 0, 3, 8),
            Err(CpuError::BlockId {
                row: 0,
                entry: 2,
                value: -1,
                num_blocks: 8
            })
        );
        assert!(p.check_used_blocks(1, 0, 1, 7).is_err()); // 7 is not < 7
        assert!(p.check_used_blocks(1, 0, 4, 8).is_err()); // past the row
    }

    #[test]
    fn bad_csr_tables_are_refused() {
        assert!(BlockTables::csr(&[], &[]).is_err());
        assert!(BlockTables::csr(&[1, 2], &[0, 0]).is_err());
        assert!(BlockTables::csr(&[0, 2, 1], &[0, 0]).is_err());
        assert!(BlockTables::csr(&[0, 3], &[0, 0]).is_err());
        let c = BlockTables::csr(&[0, 2], &[0, 1]).unwrap();
        assert!(c.check_csr_exact(&[3], &[7], 4).is_ok());
        assert!(c.check_csr_exact(&[4], &[7], 4).is_err());
        assert!(c.check_csr_exact(&[3], &[9], 4).is_err());
        assert!(BlockTables::padded(&[0; 5], 2, 3).is_err());
    }
}
