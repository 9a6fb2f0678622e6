//! `KvCacheManager`: sequences' block tables on top of a (possibly shared) [`BlockPool`].
//!
//! Every public operation first validates its input and computes how many fresh blocks it
//! needs, then takes them all at once, and only then mutates tables and refcounts, so a failed
//! operation changes nothing (DESIGN.md §2 inv. 6). The state changes are a handful of named
//! transitions, each used by several operations:
//!
//! * `allocate_fresh`: new blocks for new content (refcount 0 -> 1);
//! * `share`: one more table points at an in-use block (refcount +1, fork);
//! * `copy_on_write`: a sequence about to write into a shared partial last block gets a private
//!   copy, recorded as a `(src, dst)` copy op;
//! * `release`: one table stops pointing at a block (refcount -1; at 0 it becomes free).

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{invalid, Error, Result, Tier};
use crate::host::HostTier;
use crate::pool::BlockPool;
use crate::prefix::{BlockHash, KvEvent, PrefixCache};
use crate::seqmap::SeqMap;
use crate::stats::Stats;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

/// How to build a [`KvCacheManager`].
///
/// ```
/// use pagedkv::ManagerConfig;
/// let cfg = ManagerConfig { num_blocks: 256, block_size: 16, ..Default::default() };
/// assert!(!cfg.enable_prefix_caching);
/// assert_eq!(cfg.num_host_blocks, 0);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Device blocks in a fresh pool (ignored by [`KvCacheManager::with_pool`]).
    pub num_blocks: usize,
    /// Token slots per block (ignored by [`KvCacheManager::with_pool`]).
    pub block_size: usize,
    /// Reuse cached full blocks across sequences with a common prefix (issue 5).
    pub enable_prefix_caching: bool,
    /// Blocks in the host swap tier; 0 means no host tier (issue 6).
    pub num_host_blocks: usize,
    /// Seed of the keyed block hash (reproducible runs).
    pub hash_seed: u64,
    /// Capacity of the KV-event queue; when full, the oldest event is dropped and counted.
    pub max_events: usize,
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
        }
    }
}

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
}

/// What a sequence needs to hash its blocks as they fill.
#[derive(Debug, Clone)]
struct SeqHashing {
    /// Salt / adapter id / multimodal hash mixed into every block hash.
    extra_key: Option<Arc<[u8]>>,
    /// Hash of each full block, in order (len == num_tokens / block_size).
    block_hashes: Vec<BlockHash>,
    /// Token ids of the partial last block (len == num_tokens % block_size).
    partial_tokens: Vec<TokenId>,
}

#[derive(Debug, Clone, Default)]
struct Counters {
    allocations: u64,
    frees: u64,
    cow_copies: u64,
    forks: u64,
    swap_out_blocks: u64,
    swap_in_blocks: u64,
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
/// assert_eq!(kv.num_free_blocks(), 16);
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
    /// Live sequences by caller id (dense slots: batch calls resolve each id once).
    seqs: SeqMap<Sequence>,
    /// Distinct device blocks referenced by resident tables; each has refcount > 0 equal to its
    /// number of table references (inv. 1).
    num_blocks_in_use: usize,
    /// Sequences with `swapped == true`.
    num_swapped: usize,
    /// Pending copy-on-write copies `(src, dst)` for the data plane, oldest first.
    pending_copies: Vec<(BlockId, BlockId)>,
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
    /// assert_eq!(pool.num_free_blocks(), 61);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn with_pool(pool: Arc<BlockPool>, mut config: ManagerConfig) -> Result<Self> {
        config.num_blocks = pool.num_blocks();
        config.block_size = pool.block_size();
        let prefix = config.enable_prefix_caching.then(|| {
            PrefixCache::new(
                pool.num_blocks(),
                pool.block_size(),
                config.hash_seed,
                config.max_events,
            )
        });
        let host = match config.num_host_blocks {
            0 => None,
            n => Some(HostTier::new(n, pool.block_size())?),
        };
        Ok(KvCacheManager {
            block_size: pool.block_size(),
            pool,
            config,
            seqs: SeqMap::default(),
            num_blocks_in_use: 0,
            num_swapped: 0,
            pending_copies: Vec::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
            batch: BatchScratch::default(),
            prefix,
            host,
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

    // ------------------------------------------------------------------ admission

    /// Admits a sequence with prompt `token_ids`. Returns the number of prompt tokens served
    /// from the prefix cache (0 without prefix caching): the longest chain of cached full
    /// blocks, never the whole prompt (its last token is always left to compute). `extra_key`
    /// (cache salt, adapter id, multimodal hash) isolates prefix-cache namespaces.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// assert_eq!(kv.add_sequence(7, &[1, 2, 3, 4, 5], None)?, 0);
    /// assert_eq!(kv.num_tokens(7)?, 5);
    /// assert_eq!(kv.add_sequence(7, &[1], None), Err(Error::SequenceExists(7)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        if self.prefix.is_some() {
            self.admit_cached(seq_id, token_ids, extra_key)
        } else {
            self.admit(seq_id, token_ids.len())
        }
    }

    /// Admits a sequence of `num_tokens` tokens whose ids are unknown (never prefix-cached).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 9)?;
    /// assert_eq!(kv.block_table(1)?.len(), 3);
    /// assert!(kv.add_sequence_len(2, usize::MAX).is_err());   // InvalidArgument, not a panic
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence_len(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<usize> {
        self.admit(seq_id, num_tokens)
    }

    fn admit(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        let num_blocks = self.blocks_fitting_pool(num_tokens)?;
        let mut block_ids = Vec::with_capacity(num_blocks);
        self.allocate_fresh(num_blocks, &mut block_ids)?;
        let table = BlockTable {
            block_ids,
            num_tokens,
        };
        self.seqs.insert(
            seq_id,
            Sequence {
                table,
                swapped: false,
                hashing: None,
            },
        );
        Ok(0)
    }

    /// Admission with prefix caching: reuse the longest verified chain of cached blocks,
    /// allocate the rest, index the new full blocks. Nothing changes unless all of it succeeds.
    fn admit_cached(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        let num_tokens = token_ids.len();
        let total_blocks = self.blocks_fitting_pool(num_tokens)?;
        let bs = self.block_size;
        let num_full = num_tokens / bs;
        let max_hits = num_tokens.saturating_sub(1) / bs; // never the whole prompt
        let prefix = self.prefix.as_ref().expect("prefix caching on");

        // 1. Hash every full block; collect the verified hit chain (no mutation yet).
        let mut block_hashes = Vec::with_capacity(num_full);
        let mut hits: Vec<BlockId> = Vec::new();
        let mut chain_alive = true;
        let mut num_revive = 0usize;
        for (i, chunk) in token_ids.chunks_exact(bs).enumerate() {
            let parent = block_hashes.last().copied();
            let h = prefix.hasher.hash_block(parent, chunk, extra_key);
            block_hashes.push(h);
            if chain_alive && i < max_hits {
                match prefix.lookup(h, parent, chunk, extra_key) {
                    Some(b) => {
                        if prefix.is_cached(b) {
                            num_revive += 1;
                        } else if self.pool.refcount(b)? == u32::MAX {
                            return invalid(format!("block {b} refcount would overflow"));
                        }
                        hits.push(b);
                    }
                    None => chain_alive = false,
                }
            }
        }

        // 2. Reserve the new blocks: pool first, then cached blocks other than our hits.
        let num_new = total_blocks - hits.len();
        let cached_spare = prefix.num_cached() - num_revive;
        let shortage = |pool_free: usize| Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: num_new + num_revive,
            available_blocks: pool_free + cached_spare + num_revive,
        };
        if num_new > self.pool.num_free_blocks() + cached_spare {
            return Err(shortage(self.pool.num_free_blocks()));
        }
        let mut block_ids = Vec::with_capacity(total_blocks);
        block_ids.extend_from_slice(&hits);
        let got = self.pool.allocate_up_to(num_new, &mut block_ids);
        if num_new - got > cached_spare {
            // Another manager took pool blocks meanwhile: give ours back, change nothing.
            for b in block_ids.drain(hits.len()..).rev() {
                let _ = self.pool.release(b);
            }
            return Err(shortage(self.pool.num_free_blocks()));
        }

        // 3. Commit (infallible from here).
        let prefix = self.prefix.as_mut().expect("prefix caching on");
        for &b in &hits {
            if prefix.is_cached(b) {
                prefix.revive_cached(b, &self.pool);
                self.num_blocks_in_use += 1;
            } else {
                let _ = self.pool.retain(b);
            }
        }
        for _ in got..num_new {
            block_ids.push(prefix.evict_lru(&self.pool));
        }
        self.num_blocks_in_use += num_new;
        self.counters.allocations += num_new as u64;
        prefix.query_tokens += num_tokens as u64;
        prefix.hit_tokens += (hits.len() * bs) as u64;

        let extra: Option<Arc<[u8]>> = extra_key.map(Arc::from);
        let mut stored = StoredRun::default();
        for i in hits.len()..num_full {
            let parent = i.checked_sub(1).map(|p| block_hashes[p]);
            let chunk = &token_ids[i * bs..(i + 1) * bs];
            if prefix.register(block_ids[i], block_hashes[i], parent, chunk, &extra) {
                stored.add(block_hashes[i], parent, chunk);
            } else {
                stored.flush(prefix, bs, &extra);
            }
        }
        stored.flush(prefix, bs, &extra);

        let hashing = SeqHashing {
            extra_key: extra,
            block_hashes,
            partial_tokens: token_ids[num_full * bs..].to_vec(),
        };
        let table = BlockTable {
            block_ids,
            num_tokens,
        };
        self.seqs.insert(
            seq_id,
            Sequence {
                table,
                swapped: false,
                hashing: Some(hashing),
            },
        );
        Ok(hits.len() * bs)
    }

    // ------------------------------------------------------------------ growth

    /// Appends tokens to a sequence, taking new blocks as needed and copying a shared partial
    /// last block first (copy-on-write). With prefix caching, each block these tokens fill
    /// becomes hittable.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence(1, &[5], None)?;
    /// kv.append_tokens(1, &[6, 7])?;
    /// assert_eq!(kv.block_table(1)?, &[0, 1]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn append_tokens(&mut self, seq_id: SeqId, token_ids: &[TokenId]) -> Result<()> {
        self.append(seq_id, token_ids.len(), Some(token_ids))
    }

    /// Appends `num_tokens` tokens whose ids are unknown (the sequence's later blocks are then
    /// never prefix-cached).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 2, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 1)?;
    /// kv.append_len(1, 3)?;
    /// assert!(matches!(kv.append_len(1, 1), Err(Error::InvalidArgument(_))));  // can never fit
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn append_len(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<()> {
        self.append(seq_id, num_tokens, None)
    }

    #[inline]
    fn append(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        let block_size = self.block_size;
        let slot = self
            .seqs
            .slot(seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        let seq = self.seqs.at_mut(slot);
        if seq.swapped {
            return Err(Error::SequenceSwappedOut(seq_id));
        }
        // Hot path: room in a private last block.
        if num_tokens <= seq.table.free_slots(block_size) {
            if num_tokens == 0 {
                return Ok(());
            }
            let last = *seq
                .table
                .block_ids
                .last()
                .expect("free slots imply a last block");
            if self.pool.refcount(last)? == 1 {
                seq.table.num_tokens += num_tokens;
                if let Some(prefix) = self.prefix.as_mut() {
                    record_tokens(prefix, seq, block_size, token_ids);
                }
                return Ok(());
            }
        }
        let plan = growth_plan(&self.seqs.at(slot).table, num_tokens, &self.pool, None)?;
        self.scratch.clear();
        let mut fresh = std::mem::take(&mut self.scratch);
        let result = self.allocate_fresh(plan.needed_blocks, &mut fresh);
        if result.is_ok() {
            self.apply_growth(slot, num_tokens, token_ids, plan, &mut fresh.drain(..));
        }
        self.scratch = fresh;
        result
    }

    /// Whether `num_tokens` more tokens could be appended to the sequence right now.
    /// A count that can never fit the pool answers `false`.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 2, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// assert!(kv.can_append(1, 5)?);
    /// assert!(!kv.can_append(1, 6)?);
    /// assert!(!kv.can_append(1, usize::MAX)?);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn can_append(&self, seq_id: SeqId, num_tokens: usize) -> Result<bool> {
        match self.plan_growth(seq_id, num_tokens) {
            Ok(plan) => Ok(plan.needed_blocks <= self.num_free_blocks()),
            Err(Error::InvalidArgument(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Appends `num_tokens` tokens to each of `seq_ids` (one engine step), all or nothing.
    /// Duplicate ids are [`Error::InvalidArgument`]; a shortage reports the blocks the whole
    /// batch needed.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 3, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 2)?;
    /// kv.add_sequence_len(2, 2)?;
    /// let err = kv.append_len_batch(&[1, 2], 1).unwrap_err();   // needs 2, 1 free
    /// assert_eq!(err.blocks_short(), Some(1));
    /// assert_eq!((kv.num_tokens(1)?, kv.num_tokens(2)?), (2, 2)); // nothing changed
    /// kv.free(2)?;
    /// kv.append_len_batch(&[1], 1)?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn append_len_batch(&mut self, seq_ids: &[SeqId], num_tokens: usize) -> Result<()> {
        self.append_batch(seq_ids, num_tokens, None)
    }

    /// Appends row `i` of `token_ids` (`[B * num_tokens]`, row-major, `B = seq_ids.len()`) to
    /// `seq_ids[i]`, all or nothing.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence(1, &[1], None)?;
    /// kv.add_sequence(2, &[1], None)?;
    /// kv.append_tokens_batch(&[1, 2], &[10, 20], 1)?;
    /// assert!(kv.append_tokens_batch(&[1, 2], &[10, 20, 30], 1).is_err());   // wrong length
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn append_tokens_batch(
        &mut self,
        seq_ids: &[SeqId],
        token_ids: &[TokenId],
        num_tokens: usize,
    ) -> Result<()> {
        match seq_ids.len().checked_mul(num_tokens) {
            Some(n) if n == token_ids.len() => {}
            _ => {
                return invalid(format!(
                    "token_ids has {} entries, expected {} sequences x {num_tokens} tokens",
                    token_ids.len(),
                    seq_ids.len()
                ))
            }
        }
        self.append_batch(seq_ids, num_tokens, Some(token_ids))
    }

    fn append_batch(
        &mut self,
        seq_ids: &[SeqId],
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        if num_tokens == 0 {
            self.check_distinct(seq_ids)?;
            // Still validate the ids: a step naming an unknown sequence is a caller bug.
            for &id in seq_ids {
                self.resident(id)?;
            }
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.batch);
        let mut fresh = std::mem::take(&mut self.scratch);
        fresh.clear();
        let result = self
            .plan_batch(seq_ids, num_tokens, &mut batch)
            .and_then(|needed_blocks| self.allocate_fresh(needed_blocks, &mut fresh));
        if result.is_ok() {
            let mut supply = fresh.drain(..);
            for (row, (&slot, &plan)) in batch.slots.iter().zip(&batch.plans).enumerate() {
                let tokens = token_ids.map(|t| &t[row * num_tokens..(row + 1) * num_tokens]);
                self.apply_growth(slot, num_tokens, tokens, plan, &mut supply);
            }
        }
        self.scratch = fresh;
        self.batch = batch;
        result
    }

    /// Validates a batch append of `num_tokens > 0` tokens to each of `seq_ids` (distinct,
    /// known, resident, fitting the pool); fills `batch` with each member's slot and plan and
    /// returns the fresh blocks the batch needs. Changes nothing observable.
    fn plan_batch(
        &mut self,
        seq_ids: &[SeqId],
        num_tokens: usize,
        batch: &mut BatchScratch,
    ) -> Result<usize> {
        batch.slots.clear();
        batch.plans.clear();
        batch.cow_releases.clear();
        self.seqs.begin_batch();
        let mut needed_blocks = 0usize;
        for &id in seq_ids {
            let Some(slot) = self.seqs.slot(id) else {
                return Err(self.batch_error(seq_ids, Error::UnknownSequence(id)));
            };
            if !self.seqs.mark(slot) {
                return invalid(format!("sequence id {id} appears twice in the batch"));
            }
            let seq = self.seqs.at(slot);
            if seq.swapped {
                return Err(self.batch_error(seq_ids, Error::SequenceSwappedOut(id)));
            }
            // Copy-on-write of a block shared by two batch members happens only for the first
            // one to append; afterwards the other holds the last reference and writes in place.
            let plan = match growth_plan(
                &seq.table,
                num_tokens,
                &self.pool,
                Some(&mut batch.cow_releases),
            ) {
                Ok(plan) => plan,
                Err(e) => return Err(self.batch_error(seq_ids, e)),
            };
            needed_blocks += plan.needed_blocks;
            batch.slots.push(slot);
            batch.plans.push(plan);
        }
        if needed_blocks > self.pool.num_blocks() {
            return invalid(format!(
                "the batch needs {needed_blocks} new blocks, more than the pool's {}",
                self.pool.num_blocks()
            ));
        }
        Ok(needed_blocks)
    }

    /// The error a batch reports when one member fails validation with `member_error`: a
    /// duplicate id anywhere in the batch takes precedence (it is checked first by contract).
    #[cold]
    fn batch_error(&self, seq_ids: &[SeqId], member_error: Error) -> Error {
        match self.check_distinct(seq_ids) {
            Err(duplicate) => duplicate,
            Ok(()) => member_error,
        }
    }

    /// Validates growth of `seq_id` by `num_tokens` and counts the fresh blocks it needs.
    fn plan_growth(&self, seq_id: SeqId, num_tokens: usize) -> Result<GrowthPlan> {
        growth_plan(&self.resident(seq_id)?.table, num_tokens, &self.pool, None)
    }

    /// Applies a validated plan to the sequence in `slot` with blocks drawn from `supply`
    /// (cannot fail).
    #[inline]
    fn apply_growth(
        &mut self,
        slot: usize,
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
        plan: GrowthPlan,
        supply: &mut impl Iterator<Item = BlockId>,
    ) {
        let block_size = self.block_size;
        let seq = self.seqs.at_mut(slot);
        let mut copied = None;
        if plan.copy_on_write {
            let dst = supply.next().expect("planned block");
            let last = seq
                .table
                .block_ids
                .last_mut()
                .expect("copy-on-write of an empty table");
            copied = Some((std::mem::replace(last, dst), dst));
        }
        let new_len = seq.table.num_tokens + num_tokens;
        // `len * block_size < new_len` is `len < ceil(new_len / block_size)` without a division.
        while seq.table.block_ids.len() * block_size < new_len {
            seq.table
                .block_ids
                .push(supply.next().expect("planned block"));
        }
        seq.table.num_tokens = new_len;
        if let Some(prefix) = self.prefix.as_mut() {
            record_tokens(prefix, seq, block_size, token_ids);
        }
        if let Some((src, dst)) = copied {
            self.copy_on_write(src, dst);
        }
    }

    // ------------------------------------------------------------------ fork / free

    /// Creates `child_id` sharing every block of `parent_id` (refcounts +1).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;
    /// kv.fork(1, 2)?;
    /// assert_eq!(kv.block_table(2)?, kv.block_table(1)?);
    /// assert_eq!(kv.fork(1, 2), Err(Error::SequenceExists(2)));
    /// assert_eq!(kv.fork(9, 3), Err(Error::UnknownSequence(9)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn fork(&mut self, parent_id: SeqId, child_id: SeqId) -> Result<()> {
        let parent = self.resident(parent_id)?;
        if self.seqs.contains_key(&child_id) {
            return Err(Error::SequenceExists(child_id));
        }
        let child = parent.clone();
        for (i, &b) in child.table.block_ids.iter().enumerate() {
            if let Err(e) = self.share(b) {
                for &done in &child.table.block_ids[..i] {
                    self.release(done);
                }
                return Err(e);
            }
        }
        self.seqs.insert(child_id, child);
        self.counters.forks += 1;
        Ok(())
    }

    /// Frees a sequence (resident or swapped out): every block loses one reference; blocks
    /// reaching 0 become free, or cached-evictable when their content is indexed.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 6)?;
    /// kv.free(1)?;
    /// assert_eq!(kv.free(1), Err(Error::UnknownSequence(1)));
    /// assert_eq!(kv.num_free_blocks(), 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn free(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .remove(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if seq.swapped {
            self.num_swapped -= 1;
            let host = self
                .host
                .as_mut()
                .expect("swapped sequences imply a host tier");
            for &h in &seq.table.block_ids {
                host.release(h);
            }
            return Ok(());
        }
        // Tail first: with prefix caching the tail blocks then sit ahead of the head blocks in
        // the eviction order (a shared prefix is likelier to be hit again than a tail).
        if self.prefix.is_none() {
            // The blocks reaching 0 go back to the pool together (one free-list update).
            let mut freed = 0;
            let result = self
                .pool
                .release_chain(seq.table.block_ids.iter().rev().copied(), &mut freed);
            self.num_blocks_in_use -= freed;
            self.counters.frees += freed as u64;
            // Our table held a reference to each block, so the pool cannot refuse; if it does,
            // a refcount was corrupted elsewhere and check_invariants will report it.
            debug_assert!(
                result.is_ok(),
                "release of a table block failed: {result:?}"
            );
            return Ok(());
        }
        for &b in seq.table.block_ids.iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    /// Frees several sequences; every id is validated (known, no duplicates) before any is
    /// freed.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 1)?;
    /// kv.add_sequence_len(2, 1)?;
    /// assert!(kv.free_batch(&[1, 3]).is_err());
    /// assert!(kv.contains(1));
    /// kv.free_batch(&[1, 2])?;
    /// assert_eq!(kv.num_sequences(), 0);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn free_batch(&mut self, seq_ids: &[SeqId]) -> Result<()> {
        self.check_distinct(seq_ids)?;
        for &id in seq_ids {
            if !self.seqs.contains_key(&id) {
                return Err(Error::UnknownSequence(id));
            }
        }
        for &id in seq_ids {
            self.free(id)?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------ host tier

    /// Moves the sequences `seq_ids` (one sequence or a fork group) to the host tier: each
    /// distinct device block of the group gets one host block (a block shared inside the group
    /// is copied once and stays shared on the host), and the group's device references are
    /// dropped. Returns the copies to run, `(device_block, host_block)`, before any of those
    /// device blocks is written again (run pending [`KvCacheManager::take_copy_ops`] first).
    ///
    /// Swapping out part of a group that shares blocks is supported: a block also referenced
    /// by sequences left on the device is copied to the host and keeps its device copy for
    /// them. All or nothing: too few free host blocks is [`Error::OutOfBlocks`] with
    /// `tier: Host`, and nothing moves.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig, Tier};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 4, num_host_blocks: 8, ..Default::default()
    /// })?;
    /// kv.add_sequence_len(1, 6)?;            // device blocks [0, 1]
    /// kv.fork(1, 2)?;
    /// kv.append_len(2, 1)?;                  // 2 = [0, 2] after copy-on-write of block 1
    /// kv.take_copy_ops();
    /// let copies = kv.swap_out(&[1, 2])?;    // block 0 copied once
    /// assert_eq!(copies, vec![(0, 0), (1, 1), (2, 2)]);
    /// assert_eq!(kv.num_free_blocks(), 8);
    /// assert_eq!(kv.append_len(1, 1), Err(Error::SequenceSwappedOut(1)));
    /// let back = kv.swap_in(&[1, 2])?;       // (host_block, device_block)
    /// assert_eq!(back.len(), 3);
    /// assert_eq!(kv.block_table(1)?[0], kv.block_table(2)?[0]);   // shared again
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn swap_out(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_out needs a host tier (num_host_blocks > 0)");
        }
        self.check_distinct(seq_ids)?;
        for &id in seq_ids {
            self.resident(id)?;
        }
        let (blocks, refs) = self.group_blocks(seq_ids);
        let host = self.host.as_mut().expect("checked");
        if blocks.len() > host.num_blocks() {
            return invalid(format!(
                "the group holds {} distinct blocks, more than the host tier's {}",
                blocks.len(),
                host.num_blocks()
            ));
        }
        let host_ids = host.allocate(&refs)?;
        // Commit (infallible from here).
        let to_host: FxHashMap<BlockId, BlockId> = blocks
            .iter()
            .copied()
            .zip(host_ids.iter().copied())
            .collect();
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            let device_ids = std::mem::take(&mut seq.table.block_ids);
            seq.table.block_ids = device_ids.iter().map(|d| to_host[d]).collect();
            seq.swapped = true;
            self.num_swapped += 1;
            for &d in device_ids.iter().rev() {
                self.release(d);
            }
        }
        self.counters.swap_out_blocks += blocks.len() as u64;
        Ok(blocks.into_iter().zip(host_ids).collect())
    }

    /// Moves swapped-out sequences back onto free device blocks (evicting cached blocks if
    /// needed). Returns the copies to run, `(host_block, device_block)`. A host block shared by
    /// several of `seq_ids` becomes one shared device block. All or nothing: too few device
    /// blocks is [`Error::OutOfBlocks`] with `tier: Device`. Blocks brought back are not
    /// re-entered in the prefix index (their cached twins may still be there).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 2, block_size: 4, num_host_blocks: 2, ..Default::default()
    /// })?;
    /// kv.add_sequence_len(1, 8)?;
    /// kv.swap_out(&[1])?;
    /// kv.add_sequence_len(2, 4)?;            // takes a device block meanwhile
    /// assert!(matches!(kv.swap_in(&[1]), Err(Error::OutOfBlocks { .. })));
    /// assert!(kv.is_swapped_out(1)?);        // nothing moved
    /// kv.free(2)?;
    /// assert_eq!(kv.swap_in(&[1])?, vec![(0, 0), (1, 1)]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn swap_in(&mut self, seq_ids: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        if self.host.is_none() {
            return invalid("swap_in needs a host tier (num_host_blocks > 0)");
        }
        self.check_distinct(seq_ids)?;
        for &id in seq_ids {
            let seq = self.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            if !seq.swapped {
                return invalid(format!("sequence {id} is not swapped out"));
            }
        }
        let (host_blocks, refs) = self.group_blocks(seq_ids);
        if host_blocks.len() > self.pool.num_blocks() {
            return invalid(format!(
                "the group holds {} distinct blocks, more than the pool's {}",
                host_blocks.len(),
                self.pool.num_blocks()
            ));
        }
        let mut device_ids = Vec::with_capacity(host_blocks.len());
        self.allocate_fresh(host_blocks.len(), &mut device_ids)?;
        // Commit (infallible from here).
        for (&d, &r) in device_ids.iter().zip(&refs) {
            for _ in 1..r {
                let _ = self.pool.retain(d);
            }
        }
        let to_device: FxHashMap<BlockId, BlockId> = host_blocks
            .iter()
            .copied()
            .zip(device_ids.iter().copied())
            .collect();
        let host = self.host.as_mut().expect("checked");
        for &id in seq_ids {
            let seq = self.seqs.get_mut(&id).expect("validated");
            for h in seq.table.block_ids.iter_mut() {
                host.release(*h);
                *h = to_device[h];
            }
            seq.swapped = false;
            self.num_swapped -= 1;
        }
        self.counters.swap_in_blocks += host_blocks.len() as u64;
        Ok(host_blocks.into_iter().zip(device_ids).collect())
    }

    /// Whether a sequence is swapped out to the host tier.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_host_blocks: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// assert!(!kv.is_swapped_out(1)?);
    /// assert!(kv.is_swapped_out(2).is_err());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn is_swapped_out(&self, seq_id: SeqId) -> Result<bool> {
        Ok(self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?
            .swapped)
    }

    /// Free host blocks (0 without a host tier).
    pub fn num_free_host_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::num_free)
    }

    /// Host blocks in the tier (0 without a host tier).
    pub fn num_host_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::num_blocks)
    }

    /// The refcount of a host block.
    pub fn host_refcount(&self, host_block_id: BlockId) -> Result<u32> {
        self.host
            .as_ref()
            .and_then(|h| h.refcount(host_block_id))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("host block id {host_block_id} out of range"))
            })
    }

    /// The host block ids of a swapped-out sequence, in logical order.
    pub fn host_block_table(&self, seq_id: SeqId) -> Result<&[BlockId]> {
        let seq = self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        if !seq.swapped {
            return invalid(format!("sequence {seq_id} is not swapped out"));
        }
        Ok(&seq.table.block_ids)
    }

    /// Distinct blocks of the group's tables in first-appearance order, with how many of the
    /// group's table entries point at each.
    fn group_blocks(&self, seq_ids: &[SeqId]) -> (Vec<BlockId>, Vec<u32>) {
        let mut position: FxHashMap<BlockId, usize> = FxHashMap::default();
        let mut blocks = Vec::new();
        let mut refs: Vec<u32> = Vec::new();
        for id in seq_ids {
            for &b in &self.seqs[id].table.block_ids {
                match position.get(&b) {
                    Some(&i) => refs[i] += 1,
                    None => {
                        position.insert(b, blocks.len());
                        blocks.push(b);
                        refs.push(1);
                    }
                }
            }
        }
        (blocks, refs)
    }

    // ------------------------------------------------------------------ prefix cache

    /// Empties the prefix index and returns every cached-evictable block to the pool. Refuses
    /// (returns `false`, changing nothing) while any of this manager's blocks is in use.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, KvEvent, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// assert!(!kv.reset_prefix_cache());
    /// kv.free(1)?;
    /// assert_eq!(kv.stats().num_cached_blocks, 1);
    /// assert!(kv.reset_prefix_cache());
    /// assert_eq!(kv.stats().num_cached_blocks, 0);
    /// assert_eq!(kv.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks_in_use > 0 {
            return false;
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.reset(&self.pool);
        }
        true
    }

    /// Drains the recorded KV events, oldest first (empty without prefix caching).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.prefix
            .as_mut()
            .map_or_else(Vec::new, PrefixCache::take_events)
    }

    /// Cached-evictable blocks in eviction order (least recently used first).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;   // blocks 0, 1 full, 2 partial
    /// kv.free(1)?;
    /// assert_eq!(kv.cached_blocks(), vec![1, 0]);     // tail before head
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn cached_blocks(&self) -> Vec<BlockId> {
        self.prefix
            .as_ref()
            .map_or_else(Vec::new, PrefixCache::lru_order)
    }

    // ------------------------------------------------------------------ queries

    /// Whether a sequence with this id is live.
    pub fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Live sequences (resident and swapped out).
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The ids of all live sequences (arbitrary order).
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// The physical block ids of a device-resident sequence, in logical order.
    pub fn block_table(&self, seq_id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.resident(seq_id)?.table.block_ids)
    }

    /// The full [`BlockTable`] of a device-resident sequence.
    pub fn table(&self, seq_id: SeqId) -> Result<&BlockTable> {
        Ok(&self.resident(seq_id)?.table)
    }

    /// Tokens held by a sequence (resident or swapped out).
    pub fn num_tokens(&self, seq_id: SeqId) -> Result<usize> {
        Ok(self
            .seqs
            .get(&seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?
            .table
            .num_tokens)
    }

    /// `ceil(num_tokens / block_size)`: blocks a prompt needs, ignoring prefix-cache hits.
    pub fn blocks_needed_for_prompt(&self, num_tokens: usize) -> usize {
        num_tokens / self.block_size + usize::from(num_tokens % self.block_size != 0)
    }

    /// Block tables of `seq_ids` as one row-major `[B, max_blocks]` i32 matrix padded with -1,
    /// plus `max_blocks` and the sequences' lengths (`[B]`, i32).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// kv.add_sequence_len(2, 1)?;
    /// let (tables, max_blocks, lens) = kv.batch_block_tables(&[1, 2])?;
    /// assert_eq!((tables, max_blocks, lens), (vec![0, 1, 2, -1], 2, vec![3, 1]));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn batch_block_tables(&self, seq_ids: &[SeqId]) -> Result<(Vec<i32>, usize, Vec<i32>)> {
        let mut max_blocks = 0;
        for &id in seq_ids {
            max_blocks = max_blocks.max(self.resident(id)?.table.block_ids.len());
        }
        let mut tables = vec![-1i32; seq_ids.len() * max_blocks];
        let mut lens = Vec::with_capacity(seq_ids.len());
        for (row, &id) in seq_ids.iter().enumerate() {
            let table = &self.seqs[&id].table;
            let dst = &mut tables[row * max_blocks..row * max_blocks + table.block_ids.len()];
            for (d, &b) in dst.iter_mut().zip(&table.block_ids) {
                *d = b as i32; // block ids < 2^24
            }
            lens.push(table.num_tokens as i32); // pool capacity <= i32::MAX slots
        }
        Ok((tables, max_blocks, lens))
    }

    /// Slots (`block_id * block_size + offset`) of each sequence's last `num_new_tokens`
    /// tokens, row-major `[B * num_new_tokens]`.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;                 // blocks [0, 1]
    /// assert_eq!(kv.slot_mapping(&[1], 2)?, vec![1, 2]);
    /// assert!(kv.slot_mapping(&[1], 4).is_err());
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn slot_mapping(&self, seq_ids: &[SeqId], num_new_tokens: usize) -> Result<Vec<i64>> {
        for &id in seq_ids {
            let n = self.resident(id)?.table.num_tokens;
            if num_new_tokens > n {
                return invalid(format!(
                    "sequence {id} holds {n} tokens, fewer than num_new_tokens={num_new_tokens}"
                ));
            }
        }
        let mut slots = Vec::with_capacity(seq_ids.len() * num_new_tokens);
        for &id in seq_ids {
            let table = &self.seqs[&id].table;
            for pos in table.num_tokens - num_new_tokens..table.num_tokens {
                slots.push(table.slot_of(pos, self.block_size));
            }
        }
        Ok(slots)
    }

    /// Drains the pending copy-on-write copies `(src, dst)`, oldest first.
    pub fn take_copy_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        std::mem::take(&mut self.pending_copies)
    }

    /// The refcount of a device block.
    pub fn refcount(&self, block_id: BlockId) -> Result<u32> {
        self.pool.refcount(block_id)
    }

    /// Device blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks this manager could allocate now: the pool's free blocks plus its own
    /// cached-evictable blocks.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks() + self.prefix.as_ref().map_or(0, PrefixCache::num_cached)
    }

    /// This manager's in-use blocks / `num_blocks`, in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.num_blocks_in_use as f64 / self.pool.num_blocks() as f64
    }

    /// A snapshot of counters and occupancy.
    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            num_blocks: self.pool.num_blocks(),
            block_size: self.block_size,
            num_blocks_in_use: self.num_blocks_in_use,
            num_free_blocks: self.pool.num_free_blocks(),
            num_sequences: self.seqs.len(),
            allocations: self.counters.allocations,
            frees: self.counters.frees,
            cow_copies: self.counters.cow_copies,
            forks: self.counters.forks,
            num_swapped_sequences: self.num_swapped,
            swap_out_blocks: self.counters.swap_out_blocks,
            swap_in_blocks: self.counters.swap_in_blocks,
            ..Stats::default()
        };
        if let Some(p) = &self.prefix {
            s.num_cached_blocks = p.num_cached();
            s.prefix_query_tokens = p.query_tokens;
            s.prefix_hit_tokens = p.hit_tokens;
            s.prefix_hit_rate = if p.query_tokens == 0 {
                0.0
            } else {
                p.hit_tokens as f64 / p.query_tokens as f64
            };
            s.evictions = p.evictions;
            s.events_dropped = p.events_dropped;
        }
        if let Some(h) = &self.host {
            s.num_host_blocks = h.num_blocks();
            s.num_host_blocks_in_use = h.num_in_use();
        }
        s
    }

    /// Verifies DESIGN.md §2 for this manager's blocks, its prefix cache and host tier, and the
    /// pool's consistency; safe to call while other managers use the same pool. Returns
    /// [`Error::InvariantViolation`] naming the first broken invariant. (With a pool shared by
    /// several managers, the pool-wide equalities are checked as bounds.)
    ///
    /// ```
    /// let mut kv = pagedkv::KvCacheManager::new(Default::default())?;
    /// kv.add_sequence_len(1, 100)?;
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_invariants(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::InvariantViolation(msg));
        let exclusive_pool = Arc::strong_count(&self.pool) == 1;
        if exclusive_pool {
            self.pool.check_invariants_quiescent()?;
        } else {
            self.pool.check_invariants()?;
        }
        let bs = self.block_size;
        let mut refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut host_refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut swapped = 0;
        for (&id, seq) in self.seqs.iter() {
            let t = &seq.table;
            let expect = t.num_tokens.div_ceil(bs);
            if t.block_ids.len() != expect {
                return fail(format!(
                    "sequence {id}: {} blocks for {} tokens (expected {expect})",
                    t.block_ids.len(),
                    t.num_tokens
                ));
            }
            if let Some(h) = &seq.hashing {
                if h.block_hashes.len() != t.num_tokens / bs
                    || h.partial_tokens.len() != t.num_tokens % bs
                {
                    return fail(format!(
                        "sequence {id}: hashing state out of step with its length"
                    ));
                }
            }
            let tally = if seq.swapped {
                swapped += 1;
                &mut host_refs
            } else {
                &mut refs
            };
            let mut distinct = FxHashSet::default();
            for (i, &b) in t.block_ids.iter().enumerate() {
                if !distinct.insert(b) {
                    return fail(format!(
                        "sequence {id}: block {b} appears twice in its table"
                    ));
                }
                *tally.entry(b).or_insert(0) += 1;
                if seq.swapped {
                    continue;
                }
                if b as usize >= self.pool.num_blocks() {
                    return fail(format!("sequence {id}: block id {b} out of range"));
                }
                if let Some(p) = &self.prefix {
                    if p.is_indexed(b) {
                        if (i + 1) * bs > t.num_tokens {
                            return fail(format!("sequence {id}: partial block {b} is indexed"));
                        }
                        let recorded = seq.hashing.as_ref().and_then(|h| h.block_hashes.get(i));
                        if let Some(&h) = recorded {
                            if !p.holds(b, h) {
                                return fail(format!(
                                    "sequence {id}: block {b} indexed under another hash"
                                ));
                            }
                        }
                    }
                }
            }
        }
        if swapped != self.num_swapped {
            return fail(format!(
                "{swapped} swapped sequences, counter says {}",
                self.num_swapped
            ));
        }
        for (&b, &n) in &refs {
            let rc = self.pool.refcount(b)?;
            if rc != n {
                return fail(format!("block {b}: refcount {rc} but {n} table references"));
            }
        }
        if refs.len() != self.num_blocks_in_use {
            return fail(format!(
                "{} distinct blocks referenced but num_blocks_in_use = {}",
                refs.len(),
                self.num_blocks_in_use
            ));
        }
        let cached = match &self.prefix {
            Some(p) => {
                p.check(|b| self.pool.refcount(b).unwrap_or(u32::MAX))
                    .map_err(Error::InvariantViolation)?;
                p.num_cached()
            }
            None => 0,
        };
        let free = self.pool.num_free_blocks();
        let total = self.num_blocks_in_use + cached + free;
        if (exclusive_pool && total != self.pool.num_blocks()) || total > self.pool.num_blocks() {
            return fail(format!(
                "in use {} + cached {cached} + free {free} vs num_blocks {}",
                self.num_blocks_in_use,
                self.pool.num_blocks()
            ));
        }
        if exclusive_pool && self.pool.num_cached_blocks() != cached {
            return fail(format!(
                "pool counts {} cached blocks, cache holds {cached}",
                self.pool.num_cached_blocks()
            ));
        }
        match &self.host {
            Some(host) => {
                host.check().map_err(Error::InvariantViolation)?;
                for (&h, &n) in &host_refs {
                    match host.refcount(h) {
                        Some(rc) if rc == n => {}
                        rc => {
                            return fail(format!(
                                "host block {h}: refcount {rc:?} but {n} references"
                            ))
                        }
                    }
                }
                if host_refs.len() != host.num_in_use() {
                    return fail(format!(
                        "{} host blocks referenced but {} in use",
                        host_refs.len(),
                        host.num_in_use()
                    ));
                }
            }
            None if !host_refs.is_empty() => {
                return fail("swapped sequences without a host tier".into())
            }
            None => {}
        }
        for &(src, dst) in &self.pending_copies {
            if src == dst {
                return fail(format!("copy op ({src}, {dst}) copies a block onto itself"));
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ transitions

    /// `allocate_fresh`: takes `num_blocks` blocks for new content (refcount 0 -> 1),
    /// appending them to `out`; truly free pool blocks first, then the least recently used
    /// cached blocks (evicted: they lose their hash). All or nothing.
    fn allocate_fresh(&mut self, num_blocks: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if num_blocks == 0 {
            return Ok(());
        }
        match self.prefix.as_mut() {
            None => self.pool.allocate_into(num_blocks, out)?,
            Some(prefix) => {
                let cached = prefix.num_cached();
                let shortage = |pool_free: usize| Error::OutOfBlocks {
                    tier: Tier::Device,
                    needed_blocks: num_blocks,
                    available_blocks: pool_free + cached,
                };
                if num_blocks > self.pool.num_free_blocks() + cached {
                    return Err(shortage(self.pool.num_free_blocks()));
                }
                let start = out.len();
                let got = self.pool.allocate_up_to(num_blocks, out);
                if num_blocks - got > cached {
                    for b in out.drain(start..).rev() {
                        let _ = self.pool.release(b);
                    }
                    return Err(shortage(self.pool.num_free_blocks()));
                }
                for _ in got..num_blocks {
                    out.push(prefix.evict_lru(&self.pool));
                }
            }
        }
        self.num_blocks_in_use += num_blocks;
        self.counters.allocations += num_blocks as u64;
        Ok(())
    }

    /// `share`: one more table references in-use block `b` (refcount +1).
    fn share(&mut self, b: BlockId) -> Result<()> {
        self.pool.retain(b).map(|_| ())
    }

    /// `copy_on_write`: a table's shared, partly filled last block `src` was replaced by the
    /// private copy `dst` (already refcount 1); records `(src, dst)` and drops one reference
    /// on `src`.
    fn copy_on_write(&mut self, src: BlockId, dst: BlockId) {
        self.pending_copies.push((src, dst));
        self.counters.cow_copies += 1;
        self.release(src);
    }

    /// `release`: one table stops referencing `b` (refcount -1). At 0 the block becomes
    /// cached-evictable (joining the LRU tail) if its content is indexed, else free.
    fn release(&mut self, b: BlockId) {
        let prefix = self.prefix.as_mut().filter(|p| p.is_indexed(b));
        let result = match &prefix {
            Some(_) => self.pool.release_to_cache(b),
            None => self.pool.release(b),
        };
        match result {
            Ok(true) => {
                if let Some(p) = prefix {
                    p.push_lru(b);
                }
                self.num_blocks_in_use -= 1;
                self.counters.frees += 1;
            }
            Ok(false) => {}
            // Our tables hold a reference to `b`, so the pool cannot refuse; if it does, the
            // refcount was corrupted elsewhere and check_invariants will report it.
            Err(e) => debug_assert!(false, "release of table block {b} failed: {e}"),
        }
    }

    // ------------------------------------------------------------------ helpers

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

    fn check_distinct(&self, seq_ids: &[SeqId]) -> Result<()> {
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
}

/// Feeds appended tokens to a sequence's hashing state, entering each block they fill in the
/// prefix index. Unknown tokens (`None`) end hashing for the sequence.
fn record_tokens(
    prefix: &mut PrefixCache,
    seq: &mut Sequence,
    block_size: usize,
    token_ids: Option<&[TokenId]>,
) {
    let Some(h) = seq.hashing.as_mut() else {
        return;
    };
    let Some(mut tokens) = token_ids else {
        seq.hashing = None;
        return;
    };
    while !tokens.is_empty() {
        let take = tokens.len().min(block_size - h.partial_tokens.len());
        h.partial_tokens.extend_from_slice(&tokens[..take]);
        tokens = &tokens[take..];
        if h.partial_tokens.len() == block_size {
            let i = h.block_hashes.len();
            let parent = h.block_hashes.last().copied();
            let hash = prefix
                .hasher
                .hash_block(parent, &h.partial_tokens, h.extra_key.as_deref());
            let b = seq.table.block_ids[i];
            if prefix.register(b, hash, parent, &h.partial_tokens, &h.extra_key) {
                prefix.push_event(KvEvent::BlockStored {
                    block_hashes: vec![hash],
                    parent_block_hash: parent,
                    token_ids: h.partial_tokens.clone(),
                    block_size,
                    extra_key: h.extra_key.as_deref().map(<[u8]>::to_vec),
                    medium: Tier::Device,
                });
            }
            h.block_hashes.push(hash);
            h.partial_tokens.clear();
        }
    }
}

/// Consecutive blocks entered in the index by one admission, reported as one event.
#[derive(Default)]
struct StoredRun {
    hashes: Vec<BlockHash>,
    parent: Option<BlockHash>,
    token_ids: Vec<TokenId>,
}

impl StoredRun {
    fn add(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) {
        if self.hashes.is_empty() {
            self.parent = parent;
        }
        self.hashes.push(hash);
        self.token_ids.extend_from_slice(tokens);
    }

    fn flush(&mut self, prefix: &mut PrefixCache, block_size: usize, extra: &Option<Arc<[u8]>>) {
        if self.hashes.is_empty() {
            return;
        }
        prefix.push_event(KvEvent::BlockStored {
            block_hashes: std::mem::take(&mut self.hashes),
            parent_block_hash: self.parent.take(),
            token_ids: std::mem::take(&mut self.token_ids),
            block_size,
            extra_key: extra.as_deref().map(<[u8]>::to_vec),
            medium: Tier::Device,
        });
    }
}

impl Drop for KvCacheManager {
    /// Returns every block this manager holds (in use or cached) to the pool, so a shared
    /// pool outlives it intact.
    fn drop(&mut self) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.free(id);
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.reset(&self.pool);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct GrowthPlan {
    needed_blocks: usize,
    copy_on_write: bool,
}

/// Buffers a batch call reuses across calls, so an engine step allocates nothing.
#[derive(Debug, Default)]
struct BatchScratch {
    /// Per batch member, in order: its slot in `KvCacheManager::seqs`.
    slots: Vec<usize>,
    /// Per batch member, in order: its validated growth plan.
    plans: Vec<GrowthPlan>,
    /// Shared last blocks -> references to them already given up (copied away from) by
    /// earlier members of the batch. Only blocks with refcount > 1 get an entry.
    cow_releases: FxHashMap<BlockId, u32>,
}

/// Validates growth of `table` by `num_tokens` tokens and counts the fresh blocks it needs.
/// `cow_releases` tracks references already dropped by earlier members of a batch.
#[inline]
fn growth_plan(
    table: &BlockTable,
    num_tokens: usize,
    pool: &BlockPool,
    cow_releases: Option<&mut FxHashMap<BlockId, u32>>,
) -> Result<GrowthPlan> {
    let free_slots = table.free_slots(pool.block_size());
    // Tokens that fit the last block need no new block (and cannot overflow: the table fits).
    let mut needed_blocks = if num_tokens <= free_slots {
        0
    } else {
        let new_len = table.num_tokens.checked_add(num_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!("appending {num_tokens} tokens overflows"))
        })?;
        blocks_fitting(new_len, pool)? - table.block_ids.len()
    };
    let mut copy_on_write = false;
    if num_tokens > 0 && free_slots > 0 {
        let last = *table
            .block_ids
            .last()
            .expect("free slots imply a last block");
        let mut refs = pool.refcount(last)?;
        // A refcount-1 block is referenced by this table alone: no other member can have
        // copied away from it, so only shared blocks need the bookkeeping.
        if refs > 1 {
            if let Some(released) = cow_releases {
                let r = released.entry(last).or_insert(0);
                refs -= *r;
                if refs > 1 {
                    *r += 1;
                }
            }
        }
        if refs > 1 {
            copy_on_write = true;
            needed_blocks += 1;
        }
    }
    Ok(GrowthPlan {
        needed_blocks,
        copy_on_write,
    })
}

/// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit `pool`.
#[inline]
fn blocks_fitting(num_tokens: usize, pool: &BlockPool) -> Result<usize> {
    let block_size = pool.block_size();
    let n = num_tokens / block_size + usize::from(num_tokens % block_size != 0);
    if n > pool.num_blocks() {
        return invalid(format!(
            "{num_tokens} tokens need {n} blocks, more than the pool's {} blocks of {block_size} tokens",
            pool.num_blocks(),
        ));
    }
    Ok(n)
}
