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

use crate::error::{invalid, Error, Result};
use crate::pool::BlockPool;
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
    /// Its blocks and token count (invariant: len == ceil(num_tokens / block_size)).
    table: BlockTable,
}

#[derive(Debug, Clone, Default)]
struct Counters {
    allocations: u64,
    frees: u64,
    cow_copies: u64,
    forks: u64,
}

/// The KV-cache manager: sequences, their copy-on-write block tables, and the transitions
/// between block states. `Send`; mutating calls take `&mut self`, so use one manager per
/// thread (several may share one [`BlockPool`] through `Arc`).
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
    /// Live sequences by caller id.
    seqs: FxHashMap<SeqId, Sequence>,
    /// Distinct device blocks referenced by `seqs` tables; each has refcount > 0 equal to its
    /// number of table references (inv. 1).
    num_blocks_in_use: usize,
    /// Pending copy-on-write copies `(src, dst)` for the data plane, oldest first.
    pending_copies: Vec<(BlockId, BlockId)>,
    /// Lifetime counters.
    counters: Counters,
    /// Reused buffer for freshly allocated block ids (keeps allocation off the hot path).
    scratch: Vec<BlockId>,
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
        if config.enable_prefix_caching {
            return invalid("prefix caching is not available in this build yet");
        }
        if config.num_host_blocks != 0 {
            return invalid("the host swap tier is not available in this build yet");
        }
        Ok(KvCacheManager {
            block_size: pool.block_size(),
            pool,
            config,
            seqs: FxHashMap::default(),
            num_blocks_in_use: 0,
            pending_copies: Vec::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
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
    /// from the prefix cache (0 without prefix caching). `extra_key` (cache salt, adapter id)
    /// isolates prefix-cache namespaces.
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
        let _ = extra_key; // only prefix caching reads the extra key
        self.admit(seq_id, token_ids.len())
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
        self.seqs.insert(seq_id, Sequence { table: BlockTable { block_ids, num_tokens } });
        Ok(0)
    }

    // ------------------------------------------------------------------ growth

    /// Appends tokens to a sequence, taking new blocks as needed and copying a shared partial
    /// last block first (copy-on-write).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence(1, &[5], None)?;
    /// kv.append_tokens(1, &[6, 7])?;
    /// assert_eq!(kv.block_table(1)?, &[0, 1]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn append_tokens(&mut self, seq_id: SeqId, token_ids: &[TokenId]) -> Result<()> {
        self.append_len(seq_id, token_ids.len())
    }

    /// Appends `num_tokens` tokens whose ids are unknown.
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
        let block_size = self.block_size;
        let seq = self.seqs.get_mut(&seq_id).ok_or(Error::UnknownSequence(seq_id))?;
        let table = &mut seq.table;
        // Hot path: room in a private last block.
        if num_tokens <= table.free_slots(block_size) {
            if num_tokens == 0 {
                return Ok(());
            }
            let last = *table.block_ids.last().expect("free slots imply a last block");
            if self.pool.refcount(last)? == 1 {
                table.num_tokens += num_tokens;
                return Ok(());
            }
        }
        let plan = self.plan_growth(seq_id, num_tokens, None)?;
        self.scratch.clear();
        let mut fresh = std::mem::take(&mut self.scratch);
        let result = self.allocate_fresh(plan.needed_blocks, &mut fresh);
        if result.is_ok() {
            self.apply_growth(seq_id, num_tokens, plan, &mut fresh.drain(..));
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
        match self.plan_growth(seq_id, num_tokens, None) {
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
        self.append_batch(seq_ids, num_tokens)
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
        self.append_batch(seq_ids, num_tokens)
    }

    fn append_batch(&mut self, seq_ids: &[SeqId], num_tokens: usize) -> Result<()> {
        self.check_distinct(seq_ids)?;
        if num_tokens == 0 {
            // Still validate the ids: a step naming an unknown sequence is a caller bug.
            for &id in seq_ids {
                self.resident(id)?;
            }
            return Ok(());
        }
        // Copy-on-write of a block shared by two batch members happens only for the first one
        // to append; afterwards the other holds the last reference and writes in place.
        let mut cow_releases: FxHashMap<BlockId, u32> = FxHashMap::default();
        let mut plans = Vec::with_capacity(seq_ids.len());
        let mut needed_blocks = 0usize;
        for &id in seq_ids {
            let plan = self.plan_growth(id, num_tokens, Some(&mut cow_releases))?;
            needed_blocks += plan.needed_blocks;
            plans.push(plan);
        }
        if needed_blocks > self.pool.num_blocks() {
            return invalid(format!(
                "the batch needs {needed_blocks} new blocks, more than the pool's {}",
                self.pool.num_blocks()
            ));
        }
        self.scratch.clear();
        let mut fresh = std::mem::take(&mut self.scratch);
        let result = self.allocate_fresh(needed_blocks, &mut fresh);
        if result.is_ok() {
            let mut supply = fresh.drain(..);
            for (&id, plan) in seq_ids.iter().zip(plans) {
                self.apply_growth(id, num_tokens, plan, &mut supply);
            }
        }
        self.scratch = fresh;
        result
    }

    /// Validates growth of `seq_id` by `num_tokens` and counts the fresh blocks it needs.
    /// `cow_releases` tracks references already dropped by earlier members of a batch.
    fn plan_growth(
        &self,
        seq_id: SeqId,
        num_tokens: usize,
        cow_releases: Option<&mut FxHashMap<BlockId, u32>>,
    ) -> Result<GrowthPlan> {
        let table = &self.resident(seq_id)?.table;
        let new_len = table.num_tokens.checked_add(num_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!("appending {num_tokens} tokens overflows"))
        })?;
        let new_num_blocks = self.blocks_fitting_pool(new_len)?;
        let mut needed_blocks = new_num_blocks - table.block_ids.len();
        let mut copy_on_write = false;
        if num_tokens > 0 && table.free_slots(self.block_size) > 0 {
            let last = *table.block_ids.last().expect("free slots imply a last block");
            let mut refs = self.pool.refcount(last)?;
            if let Some(released) = cow_releases {
                let r = released.entry(last).or_insert(0);
                refs -= *r;
                if refs > 1 {
                    *r += 1;
                }
            }
            if refs > 1 {
                copy_on_write = true;
                needed_blocks += 1;
            }
        }
        Ok(GrowthPlan { needed_blocks, copy_on_write })
    }

    /// Applies a validated plan with blocks drawn from `supply` (cannot fail).
    fn apply_growth(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        plan: GrowthPlan,
        supply: &mut impl Iterator<Item = BlockId>,
    ) {
        let block_size = self.block_size;
        let mut seq = self.seqs.remove(&seq_id).expect("validated sequence");
        if plan.copy_on_write {
            let dst = supply.next().expect("planned block");
            self.copy_on_write(&mut seq.table, dst);
        }
        let new_len = seq.table.num_tokens + num_tokens;
        let target = new_len.div_ceil(block_size);
        while seq.table.block_ids.len() < target {
            seq.table.block_ids.push(supply.next().expect("planned block"));
        }
        seq.table.num_tokens = new_len;
        self.seqs.insert(seq_id, seq);
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

    /// Frees a sequence: every block loses one reference; blocks reaching 0 become free.
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
        let seq = self.seqs.remove(&seq_id).ok_or(Error::UnknownSequence(seq_id))?;
        // Tail first: with prefix caching the tail blocks then sit ahead of the head blocks in
        // the eviction order (a shared prefix is likelier to be hit again than a tail).
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

    // ------------------------------------------------------------------ queries

    /// Whether a sequence with this id is live.
    pub fn contains(&self, seq_id: SeqId) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Live sequences.
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
        Ok(self.seqs.get(&seq_id).ok_or(Error::UnknownSequence(seq_id))?.table.num_tokens)
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
        self.pool.num_free_blocks()
    }

    /// This manager's in-use blocks / `num_blocks`, in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.num_blocks_in_use as f64 / self.pool.num_blocks() as f64
    }

    /// A snapshot of counters and occupancy.
    pub fn stats(&self) -> Stats {
        Stats {
            num_blocks: self.pool.num_blocks(),
            block_size: self.block_size,
            num_blocks_in_use: self.num_blocks_in_use,
            num_cached_blocks: 0,
            num_free_blocks: self.pool.num_free_blocks(),
            num_sequences: self.seqs.len(),
            allocations: self.counters.allocations,
            frees: self.counters.frees,
            cow_copies: self.counters.cow_copies,
            forks: self.counters.forks,
            ..Stats::default()
        }
    }

    /// Verifies DESIGN.md §2 for this manager's blocks and the pool's consistency; safe to call
    /// while other managers use the same pool. Returns [`Error::InvariantViolation`] naming the
    /// first broken invariant.
    pub fn check_invariants(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::InvariantViolation(msg));
        let exclusive_pool = Arc::strong_count(&self.pool) == 1;
        if exclusive_pool {
            self.pool.check_invariants_quiescent()?;
        } else {
            self.pool.check_invariants()?;
        }
        let block_size = self.block_size;
        let mut refs: FxHashMap<BlockId, u32> = FxHashMap::default();
        for (&id, seq) in &self.seqs {
            let t = &seq.table;
            let expect = t.num_tokens.div_ceil(block_size);
            if t.block_ids.len() != expect {
                return fail(format!(
                    "sequence {id}: {} blocks for {} tokens (expected {expect})",
                    t.block_ids.len(),
                    t.num_tokens
                ));
            }
            let mut distinct = FxHashSet::default();
            for &b in &t.block_ids {
                if b as usize >= self.pool.num_blocks() {
                    return fail(format!("sequence {id}: block id {b} out of range"));
                }
                if !distinct.insert(b) {
                    return fail(format!("sequence {id}: block {b} appears twice in its table"));
                }
                *refs.entry(b).or_insert(0) += 1;
            }
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
        let free = self.pool.num_free_blocks();
        let total = self.num_blocks_in_use + free;
        if (exclusive_pool && total != self.pool.num_blocks()) || total > self.pool.num_blocks() {
            return fail(format!(
                "in use {} + free {free} vs num_blocks {}",
                self.num_blocks_in_use,
                self.pool.num_blocks()
            ));
        }
        for &(src, dst) in &self.pending_copies {
            if src == dst {
                return fail(format!("copy op ({src}, {dst}) copies a block onto itself"));
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ transitions

    /// Takes `num_blocks` fresh blocks (refcount 0 -> 1), appending them to `out`; all or
    /// nothing.
    fn allocate_fresh(&mut self, num_blocks: usize, out: &mut Vec<BlockId>) -> Result<()> {
        if num_blocks == 0 {
            return Ok(());
        }
        self.pool.allocate_into(num_blocks, out)?;
        self.num_blocks_in_use += num_blocks;
        self.counters.allocations += num_blocks as u64;
        Ok(())
    }

    /// One more table references in-use block `b` (refcount +1).
    fn share(&mut self, b: BlockId) -> Result<()> {
        self.pool.retain(b).map(|_| ())
    }

    /// The table's shared, partly filled last block is replaced by private copy `dst`
    /// (already refcount 1); records `(src, dst)` and drops one reference on `src`.
    fn copy_on_write(&mut self, table: &mut BlockTable, dst: BlockId) {
        let last = table.block_ids.last_mut().expect("copy-on-write of an empty table");
        let src = std::mem::replace(last, dst);
        self.pending_copies.push((src, dst));
        self.counters.cow_copies += 1;
        self.release(src);
    }

    /// One table stops referencing `b` (refcount -1); at 0 the block becomes free.
    fn release(&mut self, b: BlockId) {
        match self.pool.release(b) {
            Ok(true) => {
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

    fn resident(&self, seq_id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq_id).ok_or(Error::UnknownSequence(seq_id))
    }

    /// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit.
    fn blocks_fitting_pool(&self, num_tokens: usize) -> Result<usize> {
        let n = self.blocks_needed_for_prompt(num_tokens);
        if n > self.pool.num_blocks() {
            return invalid(format!(
                "{num_tokens} tokens need {n} blocks, more than the pool's {} blocks of {} tokens",
                self.pool.num_blocks(),
                self.block_size
            ));
        }
        Ok(n)
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

impl Drop for KvCacheManager {
    /// Returns every block this manager holds to the pool, so a shared pool outlives it intact.
    fn drop(&mut self) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let _ = self.free(id);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct GrowthPlan {
    needed_blocks: usize,
    copy_on_write: bool,
}
