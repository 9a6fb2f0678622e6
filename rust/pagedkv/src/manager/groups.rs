//! [`KvGroupSpec`]: the KV-cache groups of a hybrid model (docs/design.md, Hybrid groups).
//!
//! A model that mixes layer kinds (full attention and sliding-window attention, as Gemma 3 or
//! gpt-oss do) keeps one block table per group of layers, all drawing on one pool. The
//! default configuration is one full-attention group: the manager then behaves, and costs,
//! exactly as without groups.

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

/// Whether `groups` is the default single full-attention group (the plain, fastest path).
pub(crate) fn is_single_full(groups: &[KvGroupSpec]) -> bool {
    matches!(groups, [KvGroupSpec::FullAttention])
}

/// The most groups a manager takes (vLLM's largest hybrid layouts have a handful).
pub const MAX_KV_GROUPS: usize = 64;

/// Per-group views of a manager (group 0 is what the plain views show).
impl super::KvCacheManager {
    /// The KV-cache groups of this manager.
    pub fn kv_groups(&self) -> &[KvGroupSpec] {
        &self.config().kv_groups
    }

    /// InvalidArgument unless `group` is 0 (the only group of a plain manager).
    fn check_plain_group(&self, group: usize) -> Result<()> {
        if group != 0 {
            return invalid(format!(
                "group {group} is out of range: the manager has {} kv_groups",
                self.kv_groups().len()
            ));
        }
        Ok(())
    }

    /// Group `group`'s block table of a resident sequence ([`NULL_BLOCK`] at released
    /// positions).
    pub fn block_table_group(&self, seq_id: crate::SeqId, group: usize) -> Result<&[BlockId]> {
        Ok(self.table_group(seq_id, group)?.block_ids())
    }

    /// Group `group`'s [`crate::BlockTable`] of a resident sequence.
    pub fn table_group(&self, seq_id: crate::SeqId, group: usize) -> Result<&crate::BlockTable> {
        match self.hybrid.as_deref() {
            Some(h) => h.table(seq_id, group),
            None => {
                self.check_plain_group(group)?;
                self.table(seq_id)
            }
        }
    }

    /// [`Self::batch_block_tables`] of group `group` (released positions are -1, as padding).
    pub fn batch_block_tables_group(
        &self,
        seq_ids: &[crate::SeqId],
        group: usize,
    ) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        match self.hybrid.as_deref() {
            Some(h) => h.batch_block_tables(seq_ids, group),
            None => {
                self.check_plain_group(group)?;
                self.batch_block_tables(seq_ids)
            }
        }
    }

    /// [`Self::slot_mapping`] of group `group` (-1 for a token at a released position).
    pub fn slot_mapping_group(
        &self,
        seq_ids: &[crate::SeqId],
        num_new_tokens: usize,
        group: usize,
    ) -> Result<Vec<i64>> {
        match self.hybrid.as_deref() {
            Some(h) => h.slot_mapping(seq_ids, num_new_tokens, group),
            None => {
                self.check_plain_group(group)?;
                self.slot_mapping(seq_ids, num_new_tokens)
            }
        }
    }

    /// [`Self::csr_page_table`] of group `group` (released positions are -1 in `kv_indices`).
    pub fn csr_page_table_group(
        &self,
        seq_ids: &[crate::SeqId],
        group: usize,
    ) -> Result<super::CsrPageTable> {
        match self.hybrid.as_deref() {
            Some(h) => h.csr_page_table(seq_ids, group),
            None => {
                self.check_plain_group(group)?;
                self.csr_page_table(seq_ids)
            }
        }
    }

    /// [`Self::host_block_table`] of group `group`.
    pub fn host_block_table_group(&self, seq_id: crate::SeqId, group: usize) -> Result<&[BlockId]> {
        match self.hybrid.as_deref() {
            Some(h) => h.host_block_table(seq_id, group),
            None => {
                self.check_plain_group(group)?;
                self.host_block_table(seq_id)
            }
        }
    }
}
