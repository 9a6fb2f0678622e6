//! [`KvCacheManager`]: sequences' block tables on top of a (possibly shared) [`BlockPool`].
//!
//! Every public operation first validates its input and computes how many fresh blocks it
//! needs, then takes them all at once, and only then mutates tables and refcounts, so a failed
//! operation changes nothing (docs/design.md, Invariants 6). The state changes are a handful
//! of named transitions, all in [`transitions`], each used by several operations:
//!
//! * `allocate_fresh`: new blocks for new content (refcount 0 -> 1);
//! * `revive_cached`: a prefix hit on a cached-evictable block (refcount 0 -> 1, hash kept);
//! * `share`: one more table points at an in-use block (refcount +1, fork);
//! * `copy_on_write`: a sequence about to write into a shared partial last block gets a private
//!   copy, recorded as a `(src, dst)` copy op;
//! * `release`: one table stops pointing at a block (refcount -1; at 0 it becomes free, or
//!   cached-evictable when its content is indexed).
//!
//! One file per group of operations: [`admission`] (`add_sequence*`), [`growth`] (`append*`,
//! `can_append`), [`batch`] (`append_*_batch`), [`lifecycle`] (`fork`, `free*`), [`swap`]
//! (host tier), [`prefix`] (prefix-cache integration), [`queries`] (read-only views and
//! stats), [`csr`] (block tables in FlashInfer's CSR layout), [`invariants`] (`check_invariants`).

mod admission;
mod batch;
mod computed;
mod config;
mod copy_queue;
mod csr;
mod groups;
mod growth;
mod hybrid;
mod invariants;
mod lifecycle;
mod offload;
mod pins;
mod prefix;
mod queries;
mod rollback;
mod swap;
mod swap_plan;
mod transitions;

use std::sync::Arc;

use rustc_hash::FxHashSet;

use self::batch::BatchScratch;
pub use self::config::ManagerConfig;
pub use self::csr::CsrPageTable;
pub use self::groups::{KvGroupSpec, MAX_KV_GROUPS, NULL_BLOCK};
use self::hybrid::Hybrid;
use crate::error::{invalid, Error, Result};
use crate::host::HostTier;
use crate::offload_tier::OffloadTier;
use crate::pool::BlockPool;
use crate::prefix::hash::BlockHash;
use crate::prefix::PrefixCache;
use crate::seqmap::SeqMap;
use crate::stats::Stats;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

/// One live sequence.
#[derive(Debug, Clone)]
struct Sequence {
    /// Its blocks and token count (invariant: len == ceil(num_tokens / block_size)). Device
    /// block ids while resident, host block ids while swapped out.
    table: BlockTable,
    /// Whether the sequence is swapped out to the host tier.
    swapped: bool,
    /// Prefix-cache hashing state; `None` when caching is off or some token ids are unknown.
    hashing: Option<SeqHashing>,
    /// Tokens whose K/V are written by the end of the pass that schedules them (vLLM's
    /// `num_computed_tokens`; `<= table.num_tokens`). Only blocks wholly below it are indexed
    /// (docs/design.md, Computed watermark).
    num_computed: usize,
}

/// What a sequence needs to hash its blocks as they fill.
#[derive(Debug, Clone)]
struct SeqHashing {
    /// Salt / adapter id / multimodal hash mixed into every block hash.
    extra_key: Option<Arc<[u8]>>,
    /// Hash of each full, computed block, in order (len == num_computed / block_size).
    block_hashes: Vec<BlockHash>,
    /// Token ids after the hashed blocks (len == num_tokens - block_hashes.len() *
    /// block_size): the partial last block, plus the scheduled-but-not-computed blocks of a
    /// sequence still prefilling.
    pending_tokens: Vec<TokenId>,
}

/// Lifetime counters; each name says its unit.
#[derive(Debug, Clone, Default)]
struct Counters {
    /// Blocks handed out as fresh blocks (from the pool or evicted from the cache).
    blocks_allocated: u64,
    /// Blocks whose refcount dropped to 0 (to the free list or the cache).
    blocks_freed: u64,
    /// Copy-on-write copies recorded (one block each).
    cow_copies: u64,
    /// Successful forks (sequences created by `fork`).
    forks: u64,
    /// Device blocks copied to the host tier.
    blocks_swapped_out: u64,
    /// Host blocks copied back to the device.
    blocks_swapped_in: u64,
    /// Pending copies dropped by dead-copy elimination (`copy_queue`).
    copy_ops_elided: u64,
}

impl Counters {
    /// Copies the counters into their [`Stats`] fields (both managers keep the same ones).
    fn write_to(&self, s: &mut Stats) {
        s.blocks_allocated = self.blocks_allocated;
        s.blocks_freed = self.blocks_freed;
        s.cow_copies = self.cow_copies;
        s.forks = self.forks;
        s.blocks_swapped_out = self.blocks_swapped_out;
        s.blocks_swapped_in = self.blocks_swapped_in;
        s.copy_ops_elided = self.copy_ops_elided;
    }
}

/// The KV-cache manager: sequences, their copy-on-write block tables, the prefix cache and
/// the host swap tier. `Send`; mutating calls take `&mut self`, so use one manager per thread
/// (several may share one [`BlockPool`] through `Arc`).
///
/// ```
/// use pagedkv::{KvCacheManager, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 16, block_size: 4, ..Default::default() })?;
/// kv.add_sequence(1, &[10, 11, 12, 13, 14], None)?;   // 5 tokens -> 2 blocks
/// assert_eq!(kv.block_table(1)?, &[0, 1]);
/// kv.fork(1, 2)?;                                     // parallel sampling: share everything
/// assert_eq!(kv.refcount(0)?, 2);
/// kv.append_tokens(2, &[99])?;                        // shared partial block: copy-on-write
/// assert_eq!(kv.take_copy_ops(), vec![(1, 2)]);
/// assert_eq!(kv.block_table(2)?, &[0, 2]);
/// assert_eq!(kv.slot_mapping(&[2], 1)?, vec![2 * 4 + 1]);
/// kv.free(1)?;
/// kv.free(2)?;
/// assert_eq!(kv.num_available_blocks(), 16);
/// kv.check_invariants()?;
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub struct KvCacheManager {
    /// The device pool; possibly shared with other managers, which never touch our blocks.
    pool: Arc<BlockPool>,
    /// `pool.block_size()`, cached for the hot path.
    block_size: usize,
    /// The configuration (num_blocks/block_size always equal to the pool's).
    config: ManagerConfig,
    /// Live sequences by caller id (dense rows: batch calls resolve each id once).
    seqs: SeqMap<Sequence>,
    /// Distinct device blocks referenced by resident tables; each has refcount > 0 equal to its
    /// number of table references (inv. 1).
    num_blocks_in_use: usize,
    /// Sequences with `swapped == true`.
    num_swapped: usize,
    /// Pending copy-on-write copies `(src, dst)` for the data plane, oldest first.
    pending_copies: Vec<(BlockId, BlockId)>,
    /// `pending_copies.len()` at which it is next compacted (`copy_queue`), so that a caller
    /// who never drains it keeps bounded memory.
    copies_compact_at: usize,
    /// Lifetime counters.
    counters: Counters,
    /// Reused buffer for freshly allocated block ids (keeps allocation off the hot path).
    scratch: Vec<BlockId>,
    /// Reused buffers of batch calls (cleared at the start of each use).
    batch: BatchScratch,
    /// The prefix cache (`enable_prefix_caching`): index, cached-evictable blocks, events.
    prefix: Option<PrefixCache>,
    /// The host swap tier (`num_host_blocks > 0`).
    host: Option<HostTier>,
    /// The host offload tier of evicted prefix blocks (`num_offload_blocks > 0`).
    offload: Option<OffloadTier>,
    /// The manager of several KV-cache groups (`kv_groups` other than the default single
    /// full-attention group): every public operation is handed to it, and the fields above
    /// stay empty (docs/design.md, Hybrid groups).
    hybrid: Option<Box<Hybrid>>,
}

impl std::fmt::Debug for KvCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCacheManager")
            .field("num_blocks", &self.pool.num_blocks())
            .field("block_size", &self.block_size)
            .field("num_sequences", &self.seqs.len())
            .field("num_blocks_in_use", &self.num_blocks_in_use)
            .finish()
    }
}

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
        groups::validate_groups(&config.kv_groups)?;
        if !groups::is_single_full(&config.kv_groups) {
            if config.num_offload_blocks > 0 {
                // The offload tier keys a block by its tokens alone; a hybrid manager's groups
                // hold different layers for the same tokens (docs/offload.md, Limits).
                return invalid("num_offload_blocks needs the single full-attention KV group");
            }
            let hybrid = Box::new(Hybrid::new(pool.clone(), &config)?);
            return Ok(Self::assemble(pool, config, None, None, None, Some(hybrid)));
        }
        let prefix = config.enable_prefix_caching.then(|| {
            PrefixCache::new(
                pool.num_blocks(),
                pool.block_size(),
                config.hash_seed,
                config.enable_kv_events,
                config.max_events,
            )
        });
        let host = new_host_tier(&config, pool.block_size())?;
        let offload = match config.num_offload_blocks {
            0 => None,
            _ if !config.enable_prefix_caching => {
                return invalid("num_offload_blocks needs enable_prefix_caching (the tier keeps evicted prefix blocks)");
            }
            n => Some(OffloadTier::new(n, pool.block_size(), pool.num_blocks())?),
        };
        Ok(Self::assemble(pool, config, prefix, host, offload, None))
    }

    /// The manager's fields from its parts.
    fn assemble(
        pool: Arc<BlockPool>,
        config: ManagerConfig,
        prefix: Option<PrefixCache>,
        host: Option<HostTier>,
        offload: Option<OffloadTier>,
        hybrid: Option<Box<Hybrid>>,
    ) -> Self {
        let copies_compact_at = copy_queue::initial_threshold(pool.num_blocks());
        KvCacheManager {
            block_size: pool.block_size(),
            pool,
            config,
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
            hybrid,
        }
    }

    /// The pool this manager allocates from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The configuration in effect.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// The host tier, whichever path owns it.
    fn host_tier(&self) -> Option<&HostTier> {
        match self.hybrid.as_deref() {
            Some(h) => h.host(),
            None => self.host.as_ref(),
        }
    }

    /// The sequence, if it exists and is device-resident.
    fn resident(&self, seq_id: SeqId) -> Result<&Sequence> {
        match self.seqs.get(&seq_id) {
            None => Err(Error::UnknownSequence(seq_id)),
            Some(s) if s.swapped => Err(Error::SequenceSwappedOut(seq_id)),
            Some(s) => Ok(s),
        }
    }

    /// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit.
    fn blocks_fitting_pool(&self, num_tokens: usize) -> Result<usize> {
        blocks_fitting(num_tokens, &self.pool)
    }

    /// InvalidArgument when the sequence is still prefilling (some scheduled tokens are not
    /// computed): growing or forking it would write or share blocks whose K/V do not exist.
    #[inline(always)]
    fn check_computed(seq_id: SeqId, seq: &Sequence) -> Result<()> {
        if seq.num_computed < seq.table.num_tokens {
            return Err(still_prefilling(seq_id, seq));
        }
        Ok(())
    }
}

/// The host swap tier `config` asks for (none for `num_host_blocks == 0`), shared by both
/// managers' constructors.
pub(super) fn new_host_tier(config: &ManagerConfig, block_size: usize) -> Result<Option<HostTier>> {
    match config.num_host_blocks {
        0 => Ok(None),
        n => HostTier::new(n, block_size).map(Some),
    }
}

/// InvalidArgument when an id appears twice in `seq_ids` (both managers' batch calls: a
/// repeated id would apply one sequence's operation twice).
pub(super) fn check_distinct(seq_ids: &[SeqId]) -> Result<()> {
    if seq_ids.len() > 1 {
        let mut seen = FxHashSet::default();
        seen.reserve(seq_ids.len());
        for &id in seq_ids {
            if !seen.insert(id) {
                return invalid(format!("sequence id {id} appears twice in the batch"));
            }
        }
    }
    Ok(())
}

impl Drop for KvCacheManager {
    /// Returns every block this manager holds (in use or cached) to the pool, so a shared
    /// pool outlives it intact.
    fn drop(&mut self) {
        if let Some(h) = self.hybrid.as_deref_mut() {
            h.teardown();
            return;
        }
        self.unpin_all();
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.free(id);
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.reset(&self.pool);
        }
    }
}

/// The error of growing or forking a sequence that is still prefilling (off the hot path; it
/// takes the sequence, as in the plain manager's inlined checks a reference costs the fewest
/// instructions at the call site).
#[cold]
#[inline(never)]
fn still_prefilling(seq_id: SeqId, seq: &Sequence) -> Error {
    prefilling_error(seq_id, seq.num_computed, seq.table.num_tokens)
}

/// The error of growing or forking a sequence of which `num_computed` of `num_tokens` tokens
/// are computed (both managers refuse with it).
#[cold]
#[inline(never)]
pub(super) fn prefilling_error(seq_id: SeqId, num_computed: usize, num_tokens: usize) -> Error {
    Error::InvalidArgument(format!(
        "sequence {seq_id} is still prefilling ({num_computed} of {num_tokens} tokens computed): \
         advance_computed to its length first"
    ))
}

/// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit `pool`.
#[inline]
fn blocks_fitting(num_tokens: usize, pool: &BlockPool) -> Result<usize> {
    let block_size = pool.block_size();
    let n = num_tokens.div_ceil(block_size);
    if n > pool.num_blocks() {
        return invalid(format!(
            "{num_tokens} tokens need {n} blocks, more than the pool's {} blocks of {block_size} tokens",
            pool.num_blocks(),
        ));
    }
    Ok(n)
}
