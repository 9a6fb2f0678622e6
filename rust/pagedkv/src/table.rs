//! One sequence's block table: logical block `i` -> physical block id, plus its token count.

use crate::types::BlockId;

/// The block table of one sequence: the physical blocks holding its tokens, in order, and how
/// many tokens it holds.
///
/// Invariant (docs/design.md, Invariants 3): `block_ids.len() == ceil(num_tokens / block_size)`; every
/// block but the last is full, and the last has `num_tokens - (len - 1) * block_size` tokens.
///
/// ```
/// use pagedkv::{BlockTable, KvCacheManager, ManagerConfig};
/// assert_eq!(BlockTable::blocks_for_tokens(33, 16), Some(3));
/// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 8, block_size: 16, ..Default::default() })?;
/// kv.add_sequence_len(1, 20)?;
/// let table: &BlockTable = kv.table(1)?;
/// assert_eq!(table.block_ids(), &[0, 1]);
/// assert_eq!(table.num_tokens(), 20);
/// assert_eq!(table.free_slots(16), 12);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// Physical block ids, logical order. In the device tier while the sequence is resident,
    /// host block ids while it is swapped out.
    pub(crate) block_ids: Vec<BlockId>,
    /// Tokens the sequence holds; `ceil(num_tokens / block_size) == block_ids.len()`.
    pub(crate) num_tokens: usize,
}

impl BlockTable {
    /// `ceil(num_tokens / block_size)`, or `None` when `block_size` is 0.
    ///
    /// ```
    /// assert_eq!(pagedkv::BlockTable::blocks_for_tokens(0, 16), Some(0));
    /// assert_eq!(pagedkv::BlockTable::blocks_for_tokens(usize::MAX, 16), Some(usize::MAX / 16 + 1));
    /// ```
    #[inline]
    pub fn blocks_for_tokens(num_tokens: usize, block_size: usize) -> Option<usize> {
        // `div_ceil` cannot overflow (no `num_tokens + block_size - 1`).
        (block_size != 0).then(|| num_tokens.div_ceil(block_size))
    }

    /// The physical block ids, in logical order.
    #[inline]
    pub fn block_ids(&self) -> &[BlockId] {
        &self.block_ids
    }

    /// Tokens held.
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Number of blocks in the table.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.block_ids.len()
    }

    /// Unused token slots in the last block (0 when it is full or the table is empty).
    /// Saturating, so a caller passing another `block_size` than the table's gets a wrong
    /// answer, never a panic.
    #[inline]
    pub fn free_slots(&self, block_size: usize) -> usize {
        self.block_ids
            .len()
            .saturating_mul(block_size)
            .saturating_sub(self.num_tokens)
    }

    /// Number of full blocks (0 for `block_size` 0, which no pool has).
    #[inline]
    pub fn num_full_blocks(&self, block_size: usize) -> usize {
        self.num_tokens.checked_div(block_size).unwrap_or(0)
    }

    /// The slot (`block_id * block_size + offset`) of token position `pos < num_tokens`.
    #[inline]
    pub(crate) fn slot_of(&self, pos: usize, block_size: usize) -> i64 {
        let block = self.block_ids[pos / block_size] as i64;
        block * block_size as i64 + (pos % block_size) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_division() {
        assert_eq!(BlockTable::blocks_for_tokens(1, 16), Some(1));
        assert_eq!(BlockTable::blocks_for_tokens(16, 16), Some(1));
        assert_eq!(BlockTable::blocks_for_tokens(17, 16), Some(2));
        assert_eq!(BlockTable::blocks_for_tokens(5, 0), None);
    }

    #[test]
    fn slots_and_free_slots() {
        let t = BlockTable {
            block_ids: vec![7, 2],
            num_tokens: 5,
        };
        assert_eq!(t.free_slots(4), 3);
        assert_eq!(t.num_full_blocks(4), 1);
        // A block size other than the table's never panics.
        assert_eq!(t.num_full_blocks(0), 0);
        assert_eq!(t.free_slots(1), 0);
        assert_eq!(t.free_slots(usize::MAX), usize::MAX - 5);
        assert_eq!(t.slot_of(0, 4), 28);
        assert_eq!(t.slot_of(4, 4), 8);
    }
}
