//! [`KvCacheManager`]: sequences' block tables on top of a (possibly shared) [`BlockPool`],
//! for any number of KV-cache groups (docs/design.md, KV groups).
//!
//! Every public operation first validates its input and computes how many fresh blocks it
//! needs, then takes them all at once, and only then mutates tables and refcounts, so a failed
//! operation changes nothing (docs/design.md, Invariants 6). The state changes are a handful
//! of named transitions, all in [`transitions`], each used by several operations:
//!
//! * `allocate_fresh`: new blocks for new content (refcount 0 -> 1);
//! * `revive_cached`: a prefix hit on a cached-evictable block (refcount 0 -> 1, hash kept);
//! * `share`: one more table points at an in-use block (refcount +1, fork);
//! * `copy_on_write`: a sequence about to write into a shared partial block gets a private
//!   copy, recorded as a `(src, dst)` copy op;
//! * `release`: one table stops pointing at a block (refcount -1; at 0 it becomes free, or
//!   cached-evictable when its content is indexed).
//!
//! One manager serves every group list: group 0's table lives inline in each [`Sequence`],
//! the other groups' beside it, and what differs between group kinds is the policy layer
//! ([`policy`]). The single full-attention group keeps its tuned paths ([`admission`],
//! [`growth`], [`batch`], [`computed`]); every other group list, and every per-chunk or
//! caller-keyed call, takes the plain group loop ([`admit_groups`], [`grow_groups`],
//! [`indexing`], [`window`], [`slots`]), which the model test compares with the same reference.
//!
//! One file per group of operations: [`admission`] (`add_sequence*`), [`growth`] (`append*`,
//! `can_append`), [`batch`] (`append_*_batch`), [`lifecycle`] (`fork`, `free*`), [`swap`]
//! (host tier), [`prefix`] (prefix-cache integration), [`queries`] (read-only views and
//! stats), [`csr`] (block tables in FlashInfer's CSR layout), [`slots`] (`allocate_slots`,
//! `provide_token_ids`), [`new_blocks`] (`take_new_block_ids`), [`invariants`]
//! (`check_invariants`).

mod admission;
mod admit_groups;
mod batch;
mod computed;
mod config;
mod copy_queue;
mod csr;
mod eviction_priority;
mod groups;
#[cfg(test)]
mod groups_tests;
mod grow_groups;
mod growth;
mod hashed_admission;
mod hits;
mod indexing;
mod invariants;
mod keys;
mod lifecycle;
mod new_blocks;
mod offload;
mod pins;
mod policy;
mod prefix;
mod queries;
mod rollback;
mod slots;
mod swap;
mod swap_plan;
mod transitions;
mod window;

use std::sync::Arc;

use rustc_hash::FxHashSet;

use self::batch::BatchScratch;
pub use self::config::{AdmitOptions, ManagerConfig, Prompt, SlotOptions};
pub use self::csr::CsrPageTable;
pub use self::groups::{KvGroupSpec, MAX_KV_GROUPS, NULL_BLOCK};
use self::keys::BlockKeys;
pub use self::new_blocks::NewBlockIds;
use self::new_blocks::NewBlockLog;
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
    /// Group 0's blocks, and the tokens the sequence declared (`table.num_tokens`: the prompt
    /// plus appended or scheduled tokens). Device block ids while resident, host block ids
    /// while swapped out. Every group's table has this table's length `L`; the capacity
    /// `L * block_size` covers `num_computed`, and `num_tokens` too unless `per_chunk`
    /// (docs/design.md, Invariants 3).
    table: BlockTable,
    /// The tables of groups 1.. (`groups[g - 1]` is group `g`'s), each `L` entries,
    /// [`NULL_BLOCK`] at a window group's released positions (a leading run). Empty for a
    /// single-group manager: no allocation, and the hot paths test it once.
    groups: GroupTables,
    /// Whether the sequence is swapped out to the host tier.
    swapped: bool,
    /// Admitted per chunk (`reserve_prompt == false`): it may declare more tokens than its
    /// capacity while its prompt is being scheduled.
    per_chunk: bool,
    /// Prefix-cache hashing state; `None` when caching is off or some token ids are unknown.
    hashing: Option<SeqHashing>,
    /// Tokens whose K/V are written by the end of the pass that schedules them (vLLM's
    /// `num_computed_tokens`; `<= L * block_size`, and `<= table.num_tokens` unless
    /// `allocate_slots` scheduled tokens past the declared ones). Only blocks wholly below it
    /// are indexed (docs/design.md, Computed watermark).
    num_computed: usize,
}

impl Sequence {
    /// Group `g`'s table (`g < 1 + groups.len()`).
    #[inline]
    fn group_table(&self, g: usize) -> &[BlockId] {
        match g {
            0 => &self.table.block_ids,
            _ => &self.groups[g - 1],
        }
    }

    /// Group `g`'s table, mutable.
    #[inline]
    fn group_table_mut(&mut self, g: usize) -> &mut Vec<BlockId> {
        match g {
            0 => &mut self.table.block_ids,
            _ => &mut self.groups[g - 1],
        }
    }

    /// Table positions (every group's table has this many).
    #[inline]
    fn num_positions(&self) -> usize {
        self.table.block_ids.len()
    }

    /// Drops the sequence: group 0's table inline, the other groups' tables and the hashing
    /// state (absent without prefix caching) out of line, and only when present. The whole
    /// row's drop glue is an out-of-line call even when they are absent (callgrind,
    /// `add_free`).
    #[inline(always)]
    fn dispose(self) {
        let Sequence {
            table,
            groups,
            hashing,
            ..
        } = self;
        drop(table);
        // Forgetting an empty `GroupTables` or a `None` leaks nothing, and spares the drop
        // glue's call.
        if groups.is_empty() {
            std::mem::forget(groups);
        } else {
            drop_out_of_line(groups);
        }
        if hashing.is_none() {
            std::mem::forget(hashing);
        } else {
            drop_out_of_line(hashing);
        }
    }
}

/// Drops `value` out of line (the optional parts of [`Sequence::dispose`]).
#[inline(never)]
fn drop_out_of_line<T>(value: T) {
    drop(value);
}

/// The tables of a sequence's groups after group 0, behind one thin pointer that is null for
/// a single-group manager: the sequence row then stays 128 bytes, whose row address is one
/// shift (callgrind, `append_batch_48`: a 136-byte row cost two instructions per member and
/// the batch loop's register allocation, +13 %).
#[derive(Debug, Clone, Default)]
// A thin pointer is the point (a `Vec` is three words): `box_collection` does not apply.
#[allow(clippy::box_collection)]
struct GroupTables(Option<Box<Vec<Vec<BlockId>>>>);

impl GroupTables {
    /// Tables of groups 1.. (empty: none).
    fn new(tables: Vec<Vec<BlockId>>) -> Self {
        GroupTables((!tables.is_empty()).then(|| Box::new(tables)))
    }

    #[inline]
    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |t| t.len())
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    fn iter(&self) -> std::slice::Iter<'_, Vec<BlockId>> {
        self.0.as_deref().map_or(&[][..], |t| &t[..]).iter()
    }

    fn iter_mut(&mut self) -> std::slice::IterMut<'_, Vec<BlockId>> {
        match self.0.as_deref_mut() {
            Some(t) => t.iter_mut(),
            None => [].iter_mut(),
        }
    }
}

impl std::ops::Index<usize> for GroupTables {
    type Output = Vec<BlockId>;

    fn index(&self, i: usize) -> &Vec<BlockId> {
        &self.0.as_ref().expect("a group past group 0")[i]
    }
}

impl std::ops::IndexMut<usize> for GroupTables {
    fn index_mut(&mut self, i: usize) -> &mut Vec<BlockId> {
        &mut self.0.as_mut().expect("a group past group 0")[i]
    }
}

// The sequence row: 128 bytes (see `GroupTables`).
const _: () = assert!(std::mem::size_of::<Sequence>() <= 128);

/// What a sequence needs to hash its blocks as they fill.
#[derive(Debug, Clone)]
struct SeqHashing {
    /// Salt / adapter id / multimodal hash mixed into every block hash.
    extra_key: Option<Arc<[u8]>>,
    /// Content hash of each block handed to the index, in order (`len == min(num_computed,
    /// known tokens) / block_size`, and no more than the caller's hashes when it gave them).
    block_hashes: Vec<BlockHash>,
    /// Known token ids after the hashed blocks (the partial last block, the scheduled but not
    /// computed blocks of a sequence still prefilling; fewer than the declared tokens while
    /// ids are to come, docs/design.md, Per-chunk allocation).
    pending_tokens: Vec<TokenId>,
    /// The caller's per-block extra keys and block hashes (`None`: neither was given; the
    /// fast paths then apply).
    keys: Option<Box<BlockKeys>>,
}

impl SeqHashing {
    /// Token ids known from position 0 on.
    #[inline]
    fn num_known(&self, block_size: usize) -> usize {
        self.block_hashes.len() * block_size + self.pending_tokens.len()
    }
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
    /// Whether the groups are the single full-attention group, whose tuned paths apply
    /// (every other group list takes the plain group loop; docs/design.md, KV groups).
    plain: bool,
    /// `plain` with no admission limit configured (`max_model_len`, `watermark_blocks`): the
    /// tuned admission applies to the default admissions.
    tuned: bool,
    /// Whether block 0 of the pool is reserved as vLLM's null block (`reserve_null_block`):
    /// held at refcount 1 by the manager, never in a table, not counted in use.
    null_reserved: bool,
    /// The log of table entries placed since the last `take_new_block_ids`
    /// (`record_new_block_ids`).
    new_blocks: Option<Box<NewBlockLog>>,
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
        config.validate_limits()?;
        let plain = groups::is_single_full(&config.kv_groups);
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

    /// The pool this manager allocates from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The configuration in effect.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// The host tier.
    fn host_tier(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// KV-cache groups of this manager.
    #[inline]
    fn num_groups(&self) -> usize {
        self.config.kv_groups.len()
    }

    /// Blocks sequences can use: the pool's, less the null block when reserved.
    #[inline]
    fn num_usable_blocks(&self) -> usize {
        self.pool.num_blocks() - usize::from(self.null_reserved)
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
    #[inline]
    fn blocks_fitting_pool(&self, num_tokens: usize) -> Result<usize> {
        let n = blocks_fitting(num_tokens, &self.pool)?;
        if self.null_reserved && n == self.pool.num_blocks() {
            return Err(cannot_fit(
                num_tokens,
                n,
                self.num_usable_blocks(),
                self.block_size,
            ));
        }
        Ok(n)
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
        return Err(cannot_fit(num_tokens, n, pool.num_blocks(), block_size));
    }
    Ok(n)
}

/// The error of a request for `num_tokens` tokens (`needed` blocks) that no pool of `usable`
/// blocks can ever hold.
#[cold]
#[inline(never)]
fn cannot_fit(num_tokens: usize, needed: usize, usable: usize, block_size: usize) -> Error {
    Error::InvalidArgument(format!(
        "{num_tokens} tokens need {needed} blocks, more than the pool's {usable} blocks of {block_size} tokens",
    ))
}
