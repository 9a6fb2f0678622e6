//! [`KvGroupSpec`]: the KV-cache groups of a manager (docs/design.md, KV groups), the limits
//! on a group list, and [`NULL_BLOCK`], the entry of a released position.
//!
//! A model that mixes layer kinds (full attention and sliding-window attention, as Gemma 3 or
//! gpt-oss do) keeps one block table per group of layers, all drawing on one pool. The
//! default configuration is one full-attention group, whose operations keep their tuned paths;
//! what differs between group kinds is the policy layer (`policy.rs`). A leaf: the manager's
//! state and every operation file name these items, and this file names none of theirs.

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
    /// A recurrent layer's state (vLLM's `MambaSpec` in its `"align"` mode, no speculative
    /// blocks): each allocation (an admission's chunk, a running sequence's chunk or append)
    /// gives the group one block, at the position of the chunk's last token, which holds the
    /// state there; the chunk's earlier new positions are [`NULL_BLOCK`] from the start. A
    /// state block is released once the processed watermark passes its block by a token (the
    /// release of a window of 2 tokens), so a table is null but for its last state blocks, and
    /// its nulls are not a leading run. A hit is the rightmost cached state block, alone
    /// (docs/design.md, KV groups, "State groups"). Lookahead slots, watermark rollbacks and
    /// `truncate` are refused for a manager with such a group (a state cannot be rolled back).
    MambaState,
}

impl KvGroupSpec {
    /// The window in tokens, `None` for full attention.
    pub fn window(&self) -> Option<usize> {
        match *self {
            KvGroupSpec::FullAttention => None,
            KvGroupSpec::SlidingWindow { window } => Some(window),
            KvGroupSpec::MambaState => None,
        }
    }

    /// Whether this is a state group ([`KvGroupSpec::MambaState`]).
    #[inline]
    pub fn is_state(&self) -> bool {
        matches!(self, KvGroupSpec::MambaState)
    }
}

/// Whether any group of `groups` is a state group (lookahead, rollbacks and truncation are
/// refused then: a recurrent state holds no earlier position to go back to).
pub(crate) fn has_state_group(groups: &[KvGroupSpec]) -> bool {
    groups.iter().any(KvGroupSpec::is_state)
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
