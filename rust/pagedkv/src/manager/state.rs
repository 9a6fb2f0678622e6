//! The manager's state: [`KvCacheManager`]'s fields and the types they hold (a live
//! [`Sequence`], its [`GroupTables`] and [`SeqHashing`], the lifetime [`Counters`]), with the
//! accessors every operation shares.
//!
//! Below every operation file of `manager/`: the operation files (`admission.rs`,
//! `growth.rs`, `batch.rs`, ...) each implement part of [`KvCacheManager`] on this state and
//! name it here, while this file names only the leaves its fields are made of (`config.rs`,
//! `group_spec.rs`, `keys.rs`, `new_block_log.rs`, `plans.rs`) and `checks.rs`, so no
//! operation file is both above and below the state.

use std::sync::Arc;

use super::checks::{blocks_fitting, cannot_fit, prefilling_error};
use super::config::ManagerConfig;
use super::keys::BlockKeys;
use super::new_block_log::NewBlockLog;
use super::plans::BatchScratch;
use crate::error::{Error, Result};
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
pub(super) struct Sequence {
    /// Group 0's blocks, and the tokens the sequence declared (`table.num_tokens`: the prompt
    /// plus appended or scheduled tokens). Device block ids while resident, host block ids
    /// while swapped out. Every group's table has this table's length `L`; the capacity
    /// `L * block_size` covers `num_computed`, and `num_tokens` too unless `per_chunk`
    /// (docs/design.md, Invariants 3).
    pub(super) table: BlockTable,
    /// The tables of groups 1.. (`groups[g - 1]` is group `g`'s), each `L` entries,
    /// [`NULL_BLOCK`](crate::NULL_BLOCK) at a window group's released positions (a leading
    /// run) and at a state group's null ones (released, or never allocated). Empty for a single-group manager: no allocation, and the hot paths test it once.
    pub(super) groups: GroupTables,
    /// Whether the sequence is swapped out to the host tier.
    pub(super) swapped: bool,
    /// Admitted per chunk (`reserve_prompt == false`): it may declare more tokens than its
    /// capacity while its prompt is being scheduled.
    pub(super) per_chunk: bool,
    /// Prefix-cache hashing state; `None` when caching is off or some token ids are unknown.
    pub(super) hashing: Option<SeqHashing>,
    /// Tokens whose K/V are written by the end of the pass that schedules them (vLLM's
    /// `num_computed_tokens`; `<= L * block_size`, and `<= table.num_tokens` unless
    /// `allocate_slots` scheduled tokens past the declared ones). Only blocks wholly below it
    /// are indexed (docs/design.md, Computed watermark).
    pub(super) num_computed: usize,
}

impl Sequence {
    /// Group `g`'s table (`g < 1 + groups.len()`).
    #[inline]
    pub(super) fn group_table(&self, g: usize) -> &[BlockId] {
        match g {
            0 => &self.table.block_ids,
            _ => &self.groups[g - 1],
        }
    }

    /// Group `g`'s table, mutable.
    #[inline]
    pub(super) fn group_table_mut(&mut self, g: usize) -> &mut Vec<BlockId> {
        match g {
            0 => &mut self.table.block_ids,
            _ => &mut self.groups[g - 1],
        }
    }

    /// Table positions (every group's table has this many).
    #[inline]
    pub(super) fn num_positions(&self) -> usize {
        self.table.block_ids.len()
    }

    /// Drops the sequence: group 0's table inline, the other groups' tables and the hashing
    /// state (absent without prefix caching) out of line, and only when present. The whole
    /// row's drop glue is an out-of-line call even when they are absent (callgrind,
    /// `add_free`).
    #[inline(always)]
    pub(super) fn dispose(self) {
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
/// the batch loop's register allocation; scripts/callgrind_gate.sh guards it).
#[derive(Debug, Clone, Default)]
// A thin pointer is the point (a `Vec` is three words): `box_collection` does not apply.
#[allow(clippy::box_collection)]
pub(super) struct GroupTables(Option<Box<Vec<Vec<BlockId>>>>);

impl GroupTables {
    /// Tables of groups 1.. (empty: none).
    pub(super) fn new(tables: Vec<Vec<BlockId>>) -> Self {
        GroupTables((!tables.is_empty()).then(|| Box::new(tables)))
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |t| t.len())
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub(super) fn iter(&self) -> std::slice::Iter<'_, Vec<BlockId>> {
        self.0.as_deref().map_or(&[][..], |t| &t[..]).iter()
    }

    pub(super) fn iter_mut(&mut self) -> std::slice::IterMut<'_, Vec<BlockId>> {
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
pub(super) struct SeqHashing {
    /// Salt / adapter id / multimodal hash mixed into every block hash.
    pub(super) extra_key: Option<Arc<[u8]>>,
    /// Content hash of each block handed to the index, in order (`len == min(num_computed,
    /// known tokens) / block_size`, and no more than the caller's hashes when it gave them).
    pub(super) block_hashes: Vec<BlockHash>,
    /// Known token ids after the hashed blocks (the partial last block, the scheduled but not
    /// computed blocks of a sequence still prefilling; fewer than the declared tokens while
    /// ids are to come, docs/design.md, Per-chunk allocation).
    pub(super) pending_tokens: Vec<TokenId>,
    /// The caller's per-block extra keys and block hashes (`None`: neither was given; the
    /// fast paths then apply).
    pub(super) keys: Option<Box<BlockKeys>>,
}

impl SeqHashing {
    /// Token ids known from position 0 on.
    #[inline]
    pub(super) fn num_known(&self, block_size: usize) -> usize {
        self.block_hashes.len() * block_size + self.pending_tokens.len()
    }

    /// pagedkv's own hash of block `i` given at admission (`BlockKeys::given`), if any.
    #[inline]
    pub(super) fn given_hash(&self, i: usize) -> Option<BlockHash> {
        self.keys.as_ref().and_then(|k| k.given.get(i).copied())
    }

    /// Blocks from the first that have a given hash (`BlockKeys::given`; 0 once used).
    #[inline]
    pub(super) fn num_given(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.given.len())
    }

    /// Drops the given hashes once every one of them names a hashed block, and the keys with
    /// them when nothing else was given (the fast paths then apply again).
    #[inline]
    pub(super) fn release_used_given(&mut self) {
        if let Some(k) = self.keys.as_mut() {
            if !k.given.is_empty() && self.block_hashes.len() >= k.given.len() {
                k.given = Vec::new();
                if !k.is_keyed() {
                    self.keys = None;
                }
            }
        }
    }
}

/// Lifetime counters; each name says its unit.
#[derive(Debug, Clone, Default)]
pub(super) struct Counters {
    /// Blocks handed out as fresh blocks (from the pool or evicted from the cache).
    pub(super) blocks_allocated: u64,
    /// Blocks whose refcount dropped to 0 (to the free list or the cache).
    pub(super) blocks_freed: u64,
    /// Copy-on-write copies recorded (one block each).
    pub(super) cow_copies: u64,
    /// Successful forks (sequences created by `fork`).
    pub(super) forks: u64,
    /// Device blocks copied to the host tier.
    pub(super) blocks_swapped_out: u64,
    /// Host blocks copied back to the device.
    pub(super) blocks_swapped_in: u64,
    /// Pending copies dropped by dead-copy elimination (`copy_queue`).
    pub(super) copy_ops_elided: u64,
}

impl Counters {
    /// Copies the counters into their [`Stats`] fields (one set for every group count).
    pub(super) fn write_to(&self, s: &mut Stats) {
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
    pub(super) pool: Arc<BlockPool>,
    /// `pool.block_size()`, cached for the hot path.
    pub(super) block_size: usize,
    /// The configuration (num_blocks/block_size always equal to the pool's).
    pub(super) config: ManagerConfig,
    /// Live sequences by caller id (dense rows: batch calls resolve each id once).
    pub(super) seqs: SeqMap<Sequence>,
    /// Distinct device blocks referenced by resident tables; each has refcount > 0 equal to its
    /// number of table references (inv. 1).
    pub(super) num_blocks_in_use: usize,
    /// Sequences with `swapped == true`.
    pub(super) num_swapped: usize,
    /// Pending copy-on-write copies `(src, dst)` for the data plane, oldest first.
    pub(super) pending_copies: Vec<(BlockId, BlockId)>,
    /// `pending_copies.len()` at which it is next compacted (`copy_queue`), so that a caller
    /// who never drains it keeps bounded memory.
    pub(super) copies_compact_at: usize,
    /// Lifetime counters.
    pub(super) counters: Counters,
    /// Reused buffer for freshly allocated block ids (keeps allocation off the hot path).
    pub(super) scratch: Vec<BlockId>,
    /// Reused buffers of batch calls (cleared at the start of each use).
    pub(super) batch: BatchScratch,
    /// The prefix cache (`enable_prefix_caching`): index, cached-evictable blocks, events.
    pub(super) prefix: Option<PrefixCache>,
    /// The host swap tier (`num_host_blocks > 0`).
    pub(super) host: Option<HostTier>,
    /// The host offload tier of evicted prefix blocks (`num_offload_blocks > 0`).
    pub(super) offload: Option<OffloadTier>,
    /// Whether the groups are the single full-attention group, whose tuned paths apply
    /// (every other group list takes the plain group loop; docs/design.md, KV groups).
    pub(super) plain: bool,
    /// `plain` with no admission limit configured (`max_model_len`, `watermark_blocks`): the
    /// tuned admission applies to the default admissions.
    pub(super) tuned: bool,
    /// Whether block 0 of the pool is reserved as vLLM's null block (`reserve_null_block`):
    /// held at refcount 1 by the manager, never in a table, not counted in use.
    pub(super) null_reserved: bool,
    /// The log of table entries placed since the last `take_new_block_ids`
    /// (`record_new_block_ids`).
    pub(super) new_blocks: Option<Box<NewBlockLog>>,
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
    /// The pool this manager allocates from.
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The configuration in effect.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// The host tier.
    pub(super) fn host_tier(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// KV-cache groups of this manager.
    #[inline]
    pub(super) fn num_groups(&self) -> usize {
        self.config.kv_groups.len()
    }

    /// Blocks sequences can use: the pool's, less the null block when reserved.
    #[inline]
    pub(super) fn num_usable_blocks(&self) -> usize {
        self.pool.num_blocks() - usize::from(self.null_reserved)
    }

    /// The sequence, if it exists and is device-resident.
    pub(super) fn resident(&self, seq_id: SeqId) -> Result<&Sequence> {
        match self.seqs.get(&seq_id) {
            None => Err(Error::UnknownSequence(seq_id)),
            Some(s) if s.swapped => Err(Error::SequenceSwappedOut(seq_id)),
            Some(s) => Ok(s),
        }
    }

    /// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit.
    #[inline]
    pub(super) fn blocks_fitting_pool(&self, num_tokens: usize) -> Result<usize> {
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
    pub(super) fn check_computed(seq_id: SeqId, seq: &Sequence) -> Result<()> {
        if seq.num_computed < seq.table.num_tokens {
            return Err(still_prefilling(seq_id, seq));
        }
        Ok(())
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
