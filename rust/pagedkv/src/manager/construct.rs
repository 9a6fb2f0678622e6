//! Building and dropping a [`KvCacheManager`]: `new` / `with_pool` validate the configuration
//! and set up the state's parts (prefix cache, host tiers, null block, new-block log); `Drop`
//! returns every block the manager holds to its pool.

use std::sync::Arc;

use super::config::ManagerConfig;
use super::copy_queue;
use super::group_spec::{is_single_full, validate_groups};
use super::new_block_log::NewBlockLog;
use super::plans::BatchScratch;
use super::state::{Counters, KvCacheManager};
use crate::error::{invalid, Error, Result};
use crate::host::HostTier;
use crate::offload_tier::OffloadTier;
use crate::pool::BlockPool;
use crate::prefix::PrefixCache;
use crate::seqmap::SeqMap;
use crate::SeqId;

impl KvCacheManager {
    /// A manager owning a fresh pool of `config.num_blocks` blocks of `config.block_size`.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// assert!(KvCacheManager::new(ManagerConfig { block_size: 0, ..Default::default() }).is_err());
    /// let kv = KvCacheManager::new(ManagerConfig::default())?;
    /// assert_eq!((kv.num_blocks(), kv.block_size()), (1024, 16));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn new(config: ManagerConfig) -> Result<Self> {
        let pool = Arc::new(BlockPool::new(config.num_blocks, config.block_size)?);
        Self::with_pool(pool, config)
    }

    /// A manager allocating from a shared pool; `config.num_blocks` / `config.block_size` are
    /// replaced by the pool's.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use pagedkv::{BlockPool, KvCacheManager, ManagerConfig};
    /// let pool = Arc::new(BlockPool::new(64, 16)?);
    /// let mut a = KvCacheManager::with_pool(pool.clone(), ManagerConfig::default())?;
    /// let mut b = KvCacheManager::with_pool(pool.clone(), ManagerConfig::default())?;
    /// a.add_sequence_len(1, 32)?;
    /// b.add_sequence_len(1, 16)?;              // ids are per manager
    /// assert_eq!(pool.num_free_list_blocks(), 61);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn with_pool(pool: Arc<BlockPool>, mut config: ManagerConfig) -> Result<Self> {
        config.num_blocks = pool.num_blocks();
        config.block_size = pool.block_size();
        validate_groups(&config.kv_groups)?;
        config.validate_limits()?;
        let plain = is_single_full(&config.kv_groups);
        let prefix = config.enable_prefix_caching.then(|| {
            let mut p = PrefixCache::new(
                pool.num_blocks(),
                pool.block_size(),
                config.hash_seed,
                config.enable_kv_events,
                config.max_events,
            );
            p.grouped = config.kv_groups.len() > 1;
            p
        });
        let host = new_host_tier(&config, pool.block_size())?;
        let offload = match config.num_offload_blocks {
            0 => None,
            _ if !config.enable_prefix_caching => {
                return invalid("num_offload_blocks needs enable_prefix_caching (the tier keeps evicted prefix blocks)");
            }
            n => Some(OffloadTier::new(n, pool.block_size(), pool.num_blocks())?),
        };
        let null_reserved = config.reserve_null_block;
        if null_reserved {
            reserve_null_block(&pool)?;
        }
        let new_blocks = config
            .record_new_block_ids
            .then(|| Box::new(NewBlockLog::new(pool.num_blocks())));
        let copies_compact_at = copy_queue::initial_threshold(pool.num_blocks());
        // Infallible from here: the drop that detaches runs for every manager that attached.
        pool.attach_manager();
        Ok(KvCacheManager {
            block_size: pool.block_size(),
            pool,
            seqs: SeqMap::default(),
            num_blocks_in_use: 0,
            num_swapped: 0,
            pending_copies: Vec::new(),
            copies_compact_at,
            counters: Counters::default(),
            scratch: Vec::new(),
            batch: BatchScratch::default(),
            prefix,
            host,
            offload,
            tuned: plain && config_is_unlimited(&config),
            config,
            plain,
            null_reserved,
            new_blocks,
        })
    }
}

/// The host swap tier `config` asks for (none for `num_host_blocks == 0`).
fn new_host_tier(config: &ManagerConfig, block_size: usize) -> Result<Option<HostTier>> {
    match config.num_host_blocks {
        0 => Ok(None),
        n => HostTier::new(n, block_size).map(Some),
    }
}

impl Drop for KvCacheManager {
    /// Returns every block this manager holds (in use, cached, or its null block) to the pool,
    /// so a shared pool outlives it intact.
    fn drop(&mut self) {
        self.unpin_all();
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.free(id);
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.reset(&self.pool);
        }
        if self.null_reserved {
            let released = self.pool.release_id(0);
            debug_assert_eq!(released, Ok(true), "the null block is held once");
        }
        self.pool.detach_manager();
    }
}

/// Whether `config` sets no admission limit (the tuned single-group admission checks none).
fn config_is_unlimited(config: &ManagerConfig) -> bool {
    config.max_model_len == usize::MAX && config.watermark_blocks == 0
}

/// Takes block 0 of `pool` for good, as vLLM's null block (`ManagerConfig::reserve_null_block`):
/// a fresh pool hands it out first; a pool whose block 0 is taken cannot give one.
fn reserve_null_block(pool: &BlockPool) -> Result<()> {
    let mut got = Vec::with_capacity(1);
    pool.allocate_into(1, &mut got).map_err(|_| {
        Error::InvalidArgument("reserve_null_block needs a pool with block 0 free".into())
    })?;
    if got[0] != 0 {
        let _ = pool.release_id(got[0]);
        return invalid(
            "reserve_null_block needs block 0 of the pool free (use a pool of its own)",
        );
    }
    Ok(())
}
