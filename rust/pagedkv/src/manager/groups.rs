//! [`KvGroupSpec`]: the KV-cache groups of a manager (docs/design.md, KV groups), and the
//! per-group views of its tables.
//!
//! A model that mixes layer kinds (full attention and sliding-window attention, as Gemma 3 or
//! gpt-oss do) keeps one block table per group of layers, all drawing on one pool. The
//! default configuration is one full-attention group, whose operations keep their tuned paths;
//! what differs between group kinds is the policy layer (`policy.rs`).

use crate::error::{invalid, Result};
use crate::BlockId;

/// The table entry of a position a sliding-window group has released (its block is no longer
/// visible to any query of the sequence). Python sees it as `-1` in block tables, CSR page
/// tables and slot mappings.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// What one KV-cache group's layers attend to.
///
/// ```
/// use pagedkv::{KvCacheManager, KvGroupSpec, ManagerConfig, NULL_BLOCK};
/// let mut kv = KvCacheManager::new(ManagerConfig {
///     num_blocks: 16, block_size: 2,
///     kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::SlidingWindow { window: 3 }],
///     ..Default::default()
/// })?;
/// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;   // 3 blocks in each group
/// kv.append_tokens(1, &[6])?;                     // 5 computed: the window releases block 0
/// assert_eq!(kv.block_table_group(1, 0)?.len(), 3);
/// assert_eq!(kv.block_table_group(1, 1)?[0], NULL_BLOCK);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvGroupSpec {
    /// Every token attends to every earlier token: the group keeps all its blocks.
    FullAttention,
    /// Every token attends to itself and the `window - 1` tokens before it (the inclusive
    /// convention of Hugging Face configs and vLLM's `sliding_window`): blocks wholly before
    /// `num_computed_tokens - window + 1` are released.
    SlidingWindow {
        /// Tokens each query sees, itself included (`>= 1`).
        window: usize,
    },
}

impl KvGroupSpec {
    /// The window in tokens, `None` for full attention.
    pub fn window(&self) -> Option<usize> {
        match *self {
            KvGroupSpec::FullAttention => None,
            KvGroupSpec::SlidingWindow { window } => Some(window),
        }
    }
}

/// InvalidArgument unless `groups` is a usable group list: at least one group, at most
/// [`MAX_KV_GROUPS`], every window at least 1 token.
pub(crate) fn validate_groups(groups: &[KvGroupSpec]) -> Result<()> {
    if groups.is_empty() {
        return invalid("kv_groups must name at least one group");
    }
    if groups.len() > MAX_KV_GROUPS {
        return invalid(format!(
            "kv_groups has {} groups, more than the {MAX_KV_GROUPS} supported",
            groups.len()
        ));
    }
    for (g, spec) in groups.iter().enumerate() {
        if spec.window() == Some(0) {
            return invalid(format!(
                "kv_groups[{g}]: a sliding window must be at least 1 token"
            ));
        }
    }
    Ok(())
}

/// Whether `groups` is the default single full-attention group (the tuned paths).
pub(crate) fn is_single_full(groups: &[KvGroupSpec]) -> bool {
    matches!(groups, [KvGroupSpec::FullAttention])
}

/// The most groups a manager takes (vLLM's largest hybrid layouts have a handful).
pub const MAX_KV_GROUPS: usize = 64;

/// Per-group views of a manager (group 0 is what the ungrouped views show).
impl super::KvCacheManager {
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
    pub fn block_table_group(&self, seq_id: crate::SeqId, group: usize) -> Result<&[BlockId]> {
        self.check_group(group)?;
        Ok(self.resident(seq_id)?.group_table(group))
    }

    /// [`Self::batch_block_tables`] of group `group` (released positions as
    /// [`Self::null_entry`]; -1 pads short rows).
    pub fn batch_block_tables_group(
        &self,
        seq_ids: &[crate::SeqId],
        group: usize,
    ) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        self.check_group(group)?;
        let mut max_blocks = 0;
        for &id in seq_ids {
            max_blocks = max_blocks.max(self.resident(id)?.num_positions());
        }
        super::check_distinct(seq_ids)?;
        let (mut tables, mut lens) = super::queries::padded_buffers(seq_ids.len(), max_blocks)?;
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
        seq_ids: &[crate::SeqId],
        num_new_tokens: usize,
        group: usize,
    ) -> Result<Vec<i64>> {
        self.check_group(group)?;
        let bs = self.block_size;
        for &id in seq_ids {
            let seq = self.resident(id)?;
            super::queries::check_new_tokens(id, seq.table.num_tokens, num_new_tokens)?;
            super::queries::check_slots(id, seq.table.num_tokens, seq.num_positions() * bs)?;
        }
        super::check_distinct(seq_ids)?;
        let mut out = super::queries::slot_buffer(seq_ids.len(), num_new_tokens)?;
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
    pub fn csr_page_table_group(
        &self,
        seq_ids: &[crate::SeqId],
        group: usize,
    ) -> Result<super::CsrPageTable> {
        self.check_group(group)?;
        let bs = self.block_size;
        // A row covers the sequence's tokens: lookahead pages past them are left out, and a
        // sequence admitted per chunk shows the tokens it holds slots for.
        let pages =
            |seq: &super::Sequence| seq.table.num_tokens.div_ceil(bs).min(seq.num_positions());
        let mut nnz: usize = 0;
        for &id in seq_ids {
            nnz += pages(self.resident(id)?);
        }
        super::check_distinct(seq_ids)?;
        let mut csr = super::CsrPageTable::sized(seq_ids.len(), nnz)?;
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
