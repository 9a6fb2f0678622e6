//! [`ManagerConfig`]: how to build a [`super::KvCacheManager`].

use super::groups::KvGroupSpec;

/// How to build a [`KvCacheManager`](crate::KvCacheManager).
///
/// ```
/// use pagedkv::ManagerConfig;
/// let cfg = ManagerConfig { num_blocks: 256, block_size: 16, ..Default::default() };
/// assert!(!cfg.enable_prefix_caching);
/// assert_eq!(cfg.num_host_blocks, 0);
/// assert!(!cfg.enable_kv_events);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Device blocks in a fresh pool (ignored by `KvCacheManager::with_pool`).
    pub num_blocks: usize,
    /// Token slots per block (ignored by `KvCacheManager::with_pool`).
    pub block_size: usize,
    /// Reuse cached full blocks across sequences with a common prefix (docs/design.md,
    /// Prefix cache).
    pub enable_prefix_caching: bool,
    /// Blocks in the host swap tier; 0 means no host tier (docs/design.md, Swap tier).
    pub num_host_blocks: usize,
    /// Seed of the keyed block hash (reproducible runs).
    pub hash_seed: u64,
    /// Capacity of the KV-event queue; when full, the oldest event is dropped and counted.
    pub max_events: usize,
    /// Record KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) for
    /// `take_events`. Off by default, as in vLLM (`enable_kv_cache_events`): when off, no event
    /// is built, so admission pays nothing for them.
    pub enable_kv_events: bool,
    /// The KV-cache groups, each with its own block table per sequence on the one pool
    /// (docs/design.md, Hybrid groups). The default, one full-attention group, is the plain
    /// single-table manager.
    pub kv_groups: Vec<KvGroupSpec>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            num_blocks: 1024,
            block_size: 16,
            enable_prefix_caching: false,
            num_host_blocks: 0,
            hash_seed: 0,
            max_events: 65_536,
            enable_kv_events: false,
            kv_groups: vec![KvGroupSpec::FullAttention],
        }
    }
}
