//! `pagedkv.KvCacheManager`: argument conversion and error mapping around the core manager.
//!
//! Thread safety: the core manager is `Send` but mutated through `&mut self`, so the Python
//! object holds it in a `Mutex`; concurrent Python threads see each call as atomic.
//! Lock discipline (so that a lock holder never waits for the GIL): arguments are converted
//! before locking, results are copied into plain Rust values before unlocking, and Python
//! objects are only built after the guard is dropped. Heavy calls lock inside `py.detach`, so
//! other Python threads run meanwhile.

use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use pagedkv::wire::encode_drained_events;
use pagedkv::{AdmitOptions, Error, KvCacheManager, ManagerConfig, PoolPeers, Prompt};

use crate::block_keys::{parse_null_block, BlockKeyArgs};
use crate::errors::{
    invalid_argument, invariant_violation, must_propagate, to_pyerr, with_arg_note,
};
use crate::event_digests::events_to_digests;
use crate::events::events_to_python;
use crate::groups::{groups_to_python, parse_kv_groups};
use crate::id_batches::{batch_len, SeqIds, TokenIds};
use crate::pool::{check_int32_block_count, PyBlockPool};
use crate::scalars::{BlockIdArg, CountArg, ExtraKey, FlagArg, SeedArg, SeqIdArg};
use crate::stats::stats_to_dict;
use crate::wire::{batch_args, hash_format};

/// Prompts at least this long are admitted with the GIL released (hashing dominates).
pub(crate) const DETACH_MIN_PROMPT_TOKENS: usize = 512;
/// Batch calls over at least this many sequences run with the GIL released; below it the
/// release and re-acquire cost more than the call itself.
const DETACH_MIN_BATCH: usize = 8;
/// Sequence-id batches up to this long are always read, so that a bad one reports the exact
/// unknown or duplicate id. A longer one must not name more ids than there are live sequences
/// (each batch call names a live sequence at most once), checked before any id is read: a
/// zero-stride NumPy view can claim `1 << 40` ids without owning the memory for them.
const SEQ_BATCH_ALWAYS_READ: usize = 1 << 16;

/// Why a locked call failed: a core error, or a poisoned lock (a panic while it was held).
enum Failure {
    Core(Error),
    Poisoned,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure::Core(error)
    }
}

fn failure_to_pyerr(py: Python<'_>, failure: Failure) -> PyErr {
    match failure {
        Failure::Core(error) => to_pyerr(py, error),
        Failure::Poisoned => invariant_violation(
            py,
            "KvCacheManager is unusable: an earlier call panicked while holding its lock"
                .to_owned(),
        ),
    }
}

/// The paged KV-cache manager: a copy-on-write block table per sequence over a physical
/// block pool, with optional prefix caching and a host swap tier.
///
/// `KvCacheManager(num_blocks=1024, block_size=16, enable_prefix_caching=False,
/// num_host_blocks=0, *, pool=None, hash_seed=0, max_events=65536, enable_kv_events=False,
/// num_host_cache_blocks=0)`. `num_host_cache_blocks` > 0 adds the host cache (the core's
/// offload tier: evicted prefix blocks come back as hits; needs prefix caching);
/// `num_offload_blocks` is its deprecated alias.
/// With `pool` (a
/// `BlockPool`), `num_blocks` and `block_size` come from the pool (given ones must agree).
/// `hash_seed` keys the 128-bit block hashes; `max_events` bounds the KV-event queue (when
/// full, the oldest event is dropped and counted in `stats()["events_dropped"]`);
/// `enable_kv_events` turns event recording on (off by default, as in vLLM).
/// Every method is safe to call from several Python threads; batch calls release the GIL.
#[pyclass(module = "pagedkv._core", name = "KvCacheManager", frozen)]
pub struct PyKvCacheManager {
    inner: Arc<Mutex<KvCacheManager>>,
    /// The other managers on a shared pool (`pool=` given): a call short of device blocks
    /// reclaims their cached blocks and runs once more (`pagedkv::PoolPeers`).
    peers: Option<Arc<PoolPeers>>,
    pool: Py<PyBlockPool>,
    num_blocks: usize,
    block_size: usize,
    num_host_blocks: usize,
    enable_prefix_caching: bool,
}

impl PyKvCacheManager {
    #[inline]
    fn lock(&self) -> Result<MutexGuard<'_, KvCacheManager>, Failure> {
        self.inner.lock().map_err(|_| Failure::Poisoned)
    }

    /// Runs `op` on the locked manager, with the GIL released when `heavy`. On a shared pool a
    /// device shortage first reclaims the peers' cached blocks (`PoolPeers::run`).
    #[inline]
    pub(crate) fn run<T, F>(&self, py: Python<'_>, heavy: bool, mut op: F) -> PyResult<T>
    where
        F: FnMut(&mut KvCacheManager) -> Result<T, Error> + Send,
        T: Send,
    {
        let mut call = || -> Result<T, Failure> {
            match &self.peers {
                None => Ok(op(&mut *self.lock()?)?),
                Some(peers) => {
                    if self.inner.is_poisoned() {
                        return Err(Failure::Poisoned);
                    }
                    Ok(peers.run(&self.inner, &mut op)?)
                }
            }
        };
        let result = if heavy { py.detach(call) } else { call() };
        result.map_err(|failure| failure_to_pyerr(py, failure))
    }

    /// Token ids from `obj`, refused unread when longer than the pool could ever hold (every
    /// token a call adds occupies its own slot of the pool).
    #[inline]
    pub(crate) fn token_ids<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<TokenIds<'py>> {
        TokenIds::extract_bounded(obj, self.num_blocks.saturating_mul(self.block_size))
            .map_err(|err| with_arg_note(obj.py(), "token_ids", err))
    }

    /// The most sequence ids a batch of `len` may name (see [`SEQ_BATCH_ALWAYS_READ`]).
    fn max_batch_len(&self, py: Python<'_>, len: usize) -> PyResult<usize> {
        if len <= SEQ_BATCH_ALWAYS_READ {
            return Ok(SEQ_BATCH_ALWAYS_READ);
        }
        Ok(self
            .read(py, |kv| kv.num_sequences())?
            .max(SEQ_BATCH_ALWAYS_READ))
    }

    /// A batch of sequence ids from `obj`, bounded before anything is read.
    #[inline]
    fn seq_ids(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<SeqIds> {
        SeqIds::extract_bounded(obj, self.max_batch_len(py, batch_len(obj))?)
            .map_err(|err| with_arg_note(py, "seq_ids", err))
    }

    /// One sequence id or a batch (swap calls), bounded like [`Self::seq_ids`].
    fn one_or_many_seq_ids(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<SeqIds> {
        SeqIds::extract_one_or_many(obj, self.max_batch_len(py, batch_len(obj))?)
            .map_err(|err| with_arg_note(py, "seq_ids", err))
    }

    /// Runs an infallible read on the locked manager.
    #[inline]
    pub(crate) fn read<T>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&mut KvCacheManager) -> T,
    ) -> PyResult<T> {
        let mut guard = self
            .lock()
            .map_err(|failure| failure_to_pyerr(py, failure))?;
        Ok(op(&mut guard))
    }
}

/// (int32 `[B, max_blocks]` block tables, int32 `[B]` sequence lengths).
pub(crate) type TablesAndLens<'py> = (Bound<'py, PyArray2<i32>>, Bound<'py, PyArray1<i32>>);
/// (kv_indptr, kv_indices, kv_last_page_len), all int32.
type CsrArrays<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
);

/// `[N, 2]` int32 pairs (shape `(0, 2)` when empty).
fn pairs_to_array<'py>(
    py: Python<'py>,
    pairs: &[(u32, u32)],
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let mut flat = Vec::with_capacity(pairs.len() * 2);
    for &(first, second) in pairs {
        flat.push(block_id_to_i32(first));
        flat.push(block_id_to_i32(second));
    }
    PyArray1::from_vec(py, flat).reshape([pairs.len(), 2])
}

/// Block ids are below `num_blocks <= i32::MAX` (checked at construction), so this is exact.
#[inline]
pub(crate) fn block_id_to_i32(block_id: u32) -> i32 {
    if block_id == pagedkv::NULL_BLOCK {
        return -1; // a position a sliding-window group released
    }
    debug_assert!(block_id <= i32::MAX as u32);
    block_id as i32
}

/// The host cache's size from `num_host_cache_blocks`, or from its deprecated alias
/// `num_offload_blocks` (a `DeprecationWarning`); both given must agree.
fn host_cache_blocks(
    py: Python<'_>,
    num_host_cache_blocks: Option<CountArg>,
    num_offload_blocks: Option<CountArg>,
) -> PyResult<usize> {
    let Some(alias) = num_offload_blocks else {
        return Ok(num_host_cache_blocks.map_or(0, |n| n.0));
    };
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyDeprecationWarning>(),
        c"KvCacheManager(num_offload_blocks=...) is deprecated: use num_host_cache_blocks",
        1,
    )?;
    match num_host_cache_blocks {
        Some(n) if n.0 != alias.0 => Err(invalid_argument(
            py,
            format!(
                "num_host_cache_blocks={} disagrees with num_offload_blocks={} (its deprecated alias)",
                n.0, alias.0
            ),
        )),
        _ => Ok(alias.0),
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (
        num_blocks=None, block_size=None, enable_prefix_caching=FlagArg(false),
        num_host_blocks=CountArg(0), *, pool=None, hash_seed=SeedArg(0), max_events=None,
        enable_kv_events=FlagArg(false), num_host_cache_blocks=None, kv_groups=None,
        num_offload_blocks=None, max_model_len=None, max_in_flight_tokens=None,
        watermark_blocks=CountArg(0), null_block=None, record_new_block_ids=FlagArg(false)
    ))]
    #[pyo3(
        text_signature = "(num_blocks=None, block_size=None, enable_prefix_caching=False, \
        num_host_blocks=0, *, pool=None, hash_seed=0, max_events=None, enable_kv_events=False, \
        num_host_cache_blocks=0, kv_groups=None, num_offload_blocks=None, max_model_len=None, \
        max_in_flight_tokens=None, watermark_blocks=0, null_block=-1, record_new_block_ids=False)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: Option<CountArg>,
        block_size: Option<CountArg>,
        enable_prefix_caching: FlagArg,
        num_host_blocks: CountArg,
        pool: Option<Bound<'_, PyAny>>,
        hash_seed: SeedArg,
        max_events: Option<CountArg>,
        enable_kv_events: FlagArg,
        num_host_cache_blocks: Option<CountArg>,
        kv_groups: Option<Bound<'_, PyAny>>,
        num_offload_blocks: Option<CountArg>,
        max_model_len: Option<CountArg>,
        max_in_flight_tokens: Option<CountArg>,
        watermark_blocks: CountArg,
        null_block: Option<Bound<'_, PyAny>>,
        record_new_block_ids: FlagArg,
    ) -> PyResult<Self> {
        let num_host_cache_blocks =
            host_cache_blocks(py, num_host_cache_blocks, num_offload_blocks)?;
        let defaults = ManagerConfig::default();
        let kv_groups = parse_kv_groups(py, kv_groups.as_ref())?;
        let mut config = ManagerConfig {
            num_blocks: num_blocks.map_or(defaults.num_blocks, |n| n.0),
            block_size: block_size.map_or(defaults.block_size, |n| n.0),
            enable_prefix_caching: enable_prefix_caching.0,
            num_host_blocks: num_host_blocks.0,
            num_offload_blocks: num_host_cache_blocks,
            hash_seed: hash_seed.0,
            enable_kv_events: enable_kv_events.0,
            max_model_len: max_model_len.map_or(usize::MAX, |n| n.0),
            max_in_flight_tokens: max_in_flight_tokens.map(|n| n.0),
            watermark_blocks: watermark_blocks.0,
            reserve_null_block: parse_null_block(py, null_block.as_ref())?,
            record_new_block_ids: record_new_block_ids.0,
            ..defaults.clone()
        };
        if let Some(max_events) = max_events {
            config.max_events = max_events.0;
        }
        if let Some(kv_groups) = kv_groups {
            config.kv_groups = kv_groups;
        }
        check_int32_block_count(py, "num_host_blocks", config.num_host_blocks)?;
        check_int32_block_count(py, "num_host_cache_blocks", config.num_offload_blocks)?;
        let (manager, pool_object, peers) = match pool {
            Some(pool) => {
                let pool = pool.cast_into::<PyBlockPool>().map_err(|e| {
                    invalid_argument(py, format!("pool must be a pagedkv.BlockPool: {e}"))
                })?;
                let shared = Arc::clone(&pool.get().inner);
                for (name, given, actual) in [
                    ("num_blocks", num_blocks, shared.num_blocks()),
                    ("block_size", block_size, shared.block_size()),
                ] {
                    if let Some(given) = given {
                        if given.0 != actual {
                            return Err(invalid_argument(
                                py,
                                format!(
                                    "{name}={} disagrees with the pool's {name}={actual}",
                                    given.0
                                ),
                            ));
                        }
                    }
                }
                config.num_blocks = shared.num_blocks();
                config.block_size = shared.block_size();
                let manager =
                    KvCacheManager::with_pool(shared, config).map_err(|e| to_pyerr(py, e))?;
                let peers = Arc::clone(&pool.get().peers);
                (manager, pool.unbind(), Some(peers))
            }
            None => {
                check_int32_block_count(py, "num_blocks", config.num_blocks)?;
                let manager = KvCacheManager::new(config).map_err(|e| to_pyerr(py, e))?;
                let pool_object = Py::new(
                    py,
                    PyBlockPool {
                        inner: Arc::clone(manager.pool()),
                        peers: Arc::default(),
                    },
                )?;
                (manager, pool_object, None)
            }
        };
        let num_blocks = manager.num_blocks();
        let block_size = manager.block_size();
        let inner = Arc::new(Mutex::new(manager));
        if let Some(peers) = &peers {
            peers.join(&inner);
        }
        Ok(Self {
            num_blocks,
            block_size,
            num_host_blocks: num_host_blocks.0,
            enable_prefix_caching: enable_prefix_caching.0,
            inner,
            peers,
            pool: pool_object,
        })
    }

    /// Admits a prompt; returns the number of its tokens served from the prefix cache.
    ///
    /// `token_ids`: `[num_tokens]` ints (list/tuple/range or 1-D integer array), or pass only
    /// `num_tokens` (such a prompt is never hashed). `extra_key` (str | bytes | int) isolates
    /// prefix-cache namespaces (cache salt, adapter id). `num_scheduled`: how many of the new
    /// (non-hit) tokens the next pass computes (chunked prefill; `None` = all).
    /// `reserve_prompt=False` takes blocks for the hit and the scheduled tokens only (vLLM's
    /// per-chunk contract: `allocate_slots` each later step); `num_lookahead_tokens` adds
    /// speculative slots; `block_extra_keys` / `block_hashes` are the caller's per-block keys
    /// and chained hashes; `apply_watermark` applies `watermark_blocks`.
    #[pyo3(signature = (
        seq_id, token_ids=None, *, num_tokens=None, extra_key=None, num_scheduled=None,
        reserve_prompt=FlagArg(true), num_lookahead_tokens=CountArg(0), block_extra_keys=None,
        block_hashes=None, apply_watermark=FlagArg(true)
    ))]
    #[pyo3(
        text_signature = "(self, seq_id, token_ids=None, *, num_tokens=None, extra_key=None, \
        num_scheduled=None, reserve_prompt=True, num_lookahead_tokens=0, block_extra_keys=None, \
        block_hashes=None, apply_watermark=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn add_sequence(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: Option<CountArg>,
        extra_key: Option<ExtraKey>,
        num_scheduled: Option<CountArg>,
        reserve_prompt: FlagArg,
        num_lookahead_tokens: CountArg,
        block_extra_keys: Option<Bound<'_, PyAny>>,
        block_hashes: Option<Bound<'_, PyAny>>,
        apply_watermark: FlagArg,
    ) -> PyResult<usize> {
        let scheduled = num_scheduled.map_or(usize::MAX, |n| n.0);
        let plain = reserve_prompt.0
            && num_lookahead_tokens.0 == 0
            && block_extra_keys.is_none()
            && block_hashes.is_none()
            && apply_watermark.0;
        if !plain {
            let keys = BlockKeyArgs::extract(
                py,
                block_extra_keys.as_ref(),
                block_hashes.as_ref(),
                self.num_blocks,
            )?;
            let token_ids = token_ids.map(|t| self.token_ids(&t)).transpose()?;
            let prompt = match &token_ids {
                Some(t) => {
                    let t = t.as_slice()?;
                    check_token_count(py, t.len(), num_tokens)?;
                    Prompt::Tokens(t)
                }
                None if extra_key.is_some() => return Err(invalid_argument(
                    py,
                    "extra_key needs token_ids: a prompt given only as num_tokens is never hashed"
                        .to_owned(),
                )),
                None => Prompt::Len(num_tokens.map_or(0, |n| n.0)),
            };
            let key = extra_key.as_ref().map(|key| key.0.as_slice());
            let extra_keys = keys.extra_keys();
            let heavy = prompt.len() >= DETACH_MIN_PROMPT_TOKENS;
            return self.run(py, heavy, |kv| {
                let options = AdmitOptions {
                    extra_key: key,
                    num_scheduled: scheduled,
                    reserve_prompt: reserve_prompt.0,
                    num_lookahead_tokens: num_lookahead_tokens.0,
                    block_extra_keys: extra_keys.as_deref(),
                    block_hashes: keys.hashes.as_deref(),
                    apply_watermark: apply_watermark.0,
                };
                kv.add_sequence_with(seq_id.0, prompt, &options)
            });
        }
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                check_token_count(py, ids.len(), num_tokens)?;
                let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
                let key = extra_key.as_ref().map(|key| key.0.as_slice());
                self.run(py, heavy, |kv| {
                    kv.add_sequence_scheduled(seq_id.0, ids, key, scheduled)
                })
            }
            None => {
                if extra_key.is_some() {
                    return Err(invalid_argument(
                        py,
                        "extra_key needs token_ids: a prompt given only as num_tokens is never hashed"
                            .to_owned(),
                    ));
                }
                let count = num_tokens.map_or(0, |n| n.0);
                self.run(py, false, |kv| {
                    kv.add_sequence_len_scheduled(seq_id.0, count, scheduled)
                })
            }
        }
    }

    /// Grows a sequence by `token_ids` (`[n]`) or by `num_tokens` (default 1) id-less tokens;
    /// copies a shared, partly filled last block first (see `take_copy_ops`).
    #[pyo3(signature = (seq_id, token_ids=None, *, num_tokens=None))]
    fn append_tokens(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: Option<CountArg>,
    ) -> PyResult<()> {
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                check_token_count(py, ids.len(), num_tokens)?;
                let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
                self.run(py, heavy, |kv| kv.append_tokens(seq_id.0, ids))
            }
            None => {
                let count = num_tokens.map_or(1, |n| n.0);
                self.run(py, false, |kv| kv.append_len(seq_id.0, count))
            }
        }
    }

    /// Whether `num_tokens` more tokens fit now (False when short of blocks, when they could
    /// never fit, or while the sequence is still prefilling; a swapped-out sequence raises
    /// `SequenceSwappedOutError`).
    #[pyo3(signature = (seq_id, num_tokens=CountArg(1)), text_signature = "(self, seq_id, num_tokens=1)")]
    fn can_append(&self, py: Python<'_>, seq_id: SeqIdArg, num_tokens: CountArg) -> PyResult<bool> {
        self.run(py, false, |kv| kv.can_append(seq_id.0, num_tokens.0))
    }

    /// One engine step: appends `num_tokens` tokens to each of `seq_ids` (`[B]`), all or none.
    /// `token_ids`, if given, is `[B * num_tokens]` row-major (sequence 0's tokens first).
    #[pyo3(
        signature = (seq_ids, token_ids=None, *, num_tokens=CountArg(1)),
        text_signature = "(self, seq_ids, token_ids=None, *, num_tokens=1)"
    )]
    fn append_tokens_batch(
        &self,
        py: Python<'_>,
        seq_ids: Bound<'_, PyAny>,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: CountArg,
    ) -> PyResult<()> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let heavy = seqs.len() >= DETACH_MIN_BATCH;
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                let expected = seqs.len().checked_mul(num_tokens.0);
                if expected != Some(ids.len()) {
                    return Err(invalid_argument(
                        py,
                        format!(
                            "token_ids has {} ids, expected len(seq_ids) * num_tokens = {} * {}",
                            ids.len(),
                            seqs.len(),
                            num_tokens.0
                        ),
                    ));
                }
                self.run(py, heavy, |kv| {
                    kv.append_tokens_batch(seqs, ids, num_tokens.0)
                })
            }
            None => self.run(py, heavy, |kv| kv.append_len_batch(seqs, num_tokens.0)),
        }
    }

    /// Frees every sequence of `seq_ids` (`[B]`); validates all ids first (all or none).
    fn free_batch(&self, py: Python<'_>, seq_ids: Bound<'_, PyAny>) -> PyResult<()> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| kv.free_batch(seqs))
    }

    /// `child_id` starts as a copy of `parent_id` sharing every block (refcounts + 1).
    fn fork(&self, py: Python<'_>, parent_id: SeqIdArg, child_id: SeqIdArg) -> PyResult<()> {
        self.run(py, false, |kv| kv.fork(parent_id.0, child_id.0))
    }

    /// Releases the sequence's blocks (full blocks stay cached-evictable with prefix caching).
    fn free(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<()> {
        self.run(py, false, |kv| kv.free(seq_id.0))
    }

    /// int32 `[num_blocks_of_seq]`: logical block i -> physical block id (a fresh array) of
    /// KV-cache group `group`; -1 at a position a sliding-window group released.
    #[pyo3(signature = (seq_id, *, group=CountArg(0)), text_signature = "(self, seq_id, *, group=0)")]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqIdArg,
        group: CountArg,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let table: Vec<i32> = self.run(py, false, |kv| {
            Ok(kv
                .block_table_group(seq_id.0, group.0)?
                .iter()
                .map(|&b| kv.entry_i32(b))
                .collect())
        })?;
        Ok(PyArray1::from_vec(py, table))
    }

    /// Schedules the next `num_tokens` tokens of each of `seq_ids` (`[B]`): their blocks
    /// enter the prefix index once wholly computed. All or none.
    fn advance_computed(
        &self,
        py: Python<'_>,
        seq_ids: Bound<'_, PyAny>,
        num_tokens: CountArg,
    ) -> PyResult<()> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.advance_computed(seqs, num_tokens.0)
        })
    }

    /// Tokens of the sequence whose K/V exist by the end of the pass that scheduled them.
    fn num_computed_tokens(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<usize> {
        self.run(py, false, |kv| kv.num_computed_tokens(seq_id.0))
    }

    /// The hit `add_sequence` would return for `tokens` now (with the same `extra_key`,
    /// `block_extra_keys` and `block_hashes`); changes nothing.
    #[pyo3(signature = (tokens, *, extra_key=None, block_extra_keys=None, block_hashes=None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
        block_extra_keys: Option<Bound<'_, PyAny>>,
        block_hashes: Option<Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        if block_extra_keys.is_none() && block_hashes.is_none() {
            return self.run(py, heavy, |kv| kv.match_prefix(ids, key));
        }
        let keys = BlockKeyArgs::extract(
            py,
            block_extra_keys.as_ref(),
            block_hashes.as_ref(),
            self.num_blocks,
        )?;
        let extra_keys = keys.extra_keys();
        self.run(py, heavy, |kv| {
            let options = AdmitOptions {
                extra_key: key,
                block_extra_keys: extra_keys.as_deref(),
                block_hashes: keys.hashes.as_deref(),
                ..AdmitOptions::default()
            };
            kv.match_prefix_with(ids, &options)
        })
    }

    /// Keeps the first `num_tokens` tokens of the sequence (rollback of rejected drafts).
    fn truncate(&self, py: Python<'_>, seq_id: SeqIdArg, num_tokens: CountArg) -> PyResult<()> {
        self.run(py, false, |kv| kv.truncate(seq_id.0, num_tokens.0))
    }

    /// Pins the cached blocks of the longest cached prefix of `tokens`; returns the tokens
    /// pinned (0: nothing pinned, no pin recorded).
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn pin_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<usize> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| kv.pin_prefix(ids, key))
    }

    /// Releases the most recent pin of `tokens`; `InvalidArgumentError` when there is none.
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn unpin_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<()> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| kv.unpin_prefix(ids, key))
    }

    /// Tokens the sequence holds.
    fn num_tokens(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<usize> {
        self.run(py, false, |kv| kv.num_tokens(seq_id.0))
    }

    /// (int32 `[B, max_blocks]` tables padded with -1, int32 `[B]` sequence lengths in tokens).
    #[pyo3(signature = (seq_ids, *, group=CountArg(0)), text_signature = "(self, seq_ids, *, group=0)")]
    fn batch_block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        group: CountArg,
    ) -> PyResult<TablesAndLens<'py>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let (tables, max_blocks, seq_lens) =
            self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
                kv.batch_block_tables_group(seqs, group.0)
            })?;
        let tables = PyArray1::from_vec(py, tables).reshape([seqs.len(), max_blocks])?;
        Ok((tables, PyArray1::from_vec(py, seq_lens)))
    }

    /// FlashInfer's CSR page table of `seq_ids`: (int32 `[B + 1]` kv_indptr, int32 `[nnz]`
    /// kv_indices, int32 `[B]` kv_last_page_len).
    #[pyo3(signature = (seq_ids, *, group=CountArg(0)), text_signature = "(self, seq_ids, *, group=0)")]
    fn csr_page_table<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        group: CountArg,
    ) -> PyResult<CsrArrays<'py>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let csr = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.csr_page_table_group(seqs, group.0)
        })?;
        Ok((
            PyArray1::from_vec(py, csr.kv_indptr),
            PyArray1::from_vec(py, csr.kv_indices),
            PyArray1::from_vec(py, csr.kv_last_page_len),
        ))
    }

    /// int64 `[B * num_new_tokens]`: KV slots (`block_id * block_size + offset`) of each
    /// sequence's last `num_new_tokens` tokens, sequence by sequence.
    #[pyo3(signature = (seq_ids, num_new_tokens, *, group=CountArg(0)), text_signature = "(self, seq_ids, num_new_tokens, *, group=0)")]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        num_new_tokens: CountArg,
        group: CountArg,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let slots = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.slot_mapping_group(seqs, num_new_tokens.0, group.0)
        })?;
        Ok(PyArray1::from_vec(py, slots))
    }

    /// int32 `[N, 2]` pending copy-on-write copies (src_block, dst_block); cleared by the call.
    fn take_copy_ops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ops = self.read(py, |kv| kv.take_copy_ops())?;
        pairs_to_array(py, &ops)
    }

    /// int32 `[N, 2]` pending offload ops (device_block, host_block) of the offload tier:
    /// evicted prefix blocks to keep; run them first, before copies, swaps, loads and the
    /// forward pass. Cleared by the call.
    fn take_offload_ops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ops = self.read(py, |kv| kv.take_offload_ops())?;
        pairs_to_array(py, &ops)
    }

    /// int32 `[N, 2]` pending load ops (host_block, device_block): offload-tier hits to copy
    /// into their fresh device blocks after the offload ops and before the forward pass.
    /// Cleared by the call.
    fn take_load_ops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ops = self.read(py, |kv| kv.take_load_ops())?;
        pairs_to_array(py, &ops)
    }

    /// The chained 128-bit hash (a Python int) of each full block of `tokens`, as the prefix
    /// index and KV events key them (`extra_key` mixed in); changes nothing.
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn prefix_block_hashes(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<Vec<u128>> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| Ok(kv.prefix_block_hashes(ids, key)))
    }

    /// The chained hash (an int) of the content offload-tier host block `host_block` holds,
    /// or None; `InvalidArgumentError` when it is not a block of the tier.
    fn offload_block_hash(&self, py: Python<'_>, host_block: BlockIdArg) -> PyResult<Option<u128>> {
        self.run(py, false, |kv| kv.offload_block_hash(host_block.0))
    }

    /// Blocks of the host cache (the core's offload tier; 0: none).
    #[getter]
    fn num_host_cache_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_offload_blocks())
    }

    /// The deprecated alias of `num_host_cache_blocks`.
    #[getter]
    fn num_offload_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_offload_blocks())
    }

    /// Refcount of one physical block (0 when free or cached-evictable).
    fn refcount(&self, py: Python<'_>, block_id: BlockIdArg) -> PyResult<u32> {
        self.run(py, false, |kv| kv.refcount(block_id.0))
    }

    /// Physical blocks in the pool.
    #[getter]
    pub(crate) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Token slots per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Host-tier blocks (0: no swap tier).
    #[getter]
    fn num_host_blocks(&self) -> usize {
        self.num_host_blocks
    }

    /// The KV-cache groups (`FullAttention` / `SlidingWindow` objects).
    #[getter]
    fn kv_groups(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let groups = self.read(py, |kv| kv.kv_groups().to_vec())?;
        groups_to_python(py, &groups)
    }

    /// Whether full blocks are hashed and reused across requests.
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }

    /// The (possibly shared) physical block pool.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyBlockPool> {
        self.pool.clone_ref(py)
    }

    /// In-use blocks / num_blocks, in [0, 1].
    #[getter]
    fn usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.read(py, |kv| kv.usage())
    }

    /// Blocks this manager can allocate now: the pool's free list + its own cached-evictable
    /// blocks.
    #[getter]
    fn num_available_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_available_blocks())
    }

    /// Blocks on the pool's free list (shared with the other managers on the pool).
    #[getter]
    fn num_free_list_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.pool().num_free_list_blocks())
    }

    /// `num_available_blocks` under the name the contract (DESIGN) fixes for the manager; not
    /// the pool's `num_free_blocks`, which is its free list only.
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_available_blocks())
    }

    /// Free host-tier blocks.
    #[getter]
    fn num_free_host_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_free_host_blocks())
    }

    /// Live sequences (device-resident or swapped out).
    #[getter]
    fn num_sequences(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_sequences())
    }

    /// Blocks a prompt of `num_tokens` tokens needs, ignoring prefix-cache hits.
    fn blocks_needed_for_prompt(&self, py: Python<'_>, num_tokens: CountArg) -> PyResult<usize> {
        self.read(py, |kv| kv.blocks_needed_for_prompt(num_tokens.0))
    }

    /// Whether the sequence is swapped out to the host tier.
    fn is_swapped_out(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<bool> {
        self.run(py, false, |kv| kv.is_swapped_out(seq_id.0))
    }

    /// Counters and gauges as a dict (see docs/design.md, Python API).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.read(py, |kv| kv.stats())?;
        stats_to_dict(py, &stats)
    }

    /// Verifies every allocator invariant; raises `InvariantViolation`.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, true, |kv| kv.check_invariants())
    }

    /// Moves one sequence or a fork group to the host tier; int32 `[N, 2]`
    /// (device_block, host_block) copies to run before the device blocks are reused.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seq_ids = self.one_or_many_seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let pairs = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| kv.swap_out(seqs))?;
        pairs_to_array(py, &pairs)
    }

    /// Brings swapped-out sequences back; int32 `[N, 2]` (host_block, device_block) copies.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seq_ids = self.one_or_many_seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let pairs = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| kv.swap_in(seqs))?;
        pairs_to_array(py, &pairs)
    }

    /// Empties the prefix index; False (and nothing changes) while any block is in use.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        self.read(py, |kv| kv.reset_prefix_cache())
    }

    /// Drains the KV events recorded while prefix caching is on, oldest first:
    /// `pagedkv.BlockStored`, `pagedkv.BlockRemoved`, `pagedkv.AllBlocksCleared`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.read(py, |kv| kv.take_events())?;
        events_to_python(py, events)
    }

    /// Drains the same KV events as `take_events` straight into one vLLM `EventBatch`: the
    /// bytes `pagedkv.events.encode_batch(kv.take_events(), ts, data_parallel_rank,
    /// raw_hashes=raw_hashes)` returns, without an event object per event (a publisher's hot
    /// path: building the objects and reading them back costs many times this path per event,
    /// benches/results/2026-12-02-prefix-admission.md, "Follow-up: events, eviction, the
    /// benchmark itself"). Returns `(number of events, payload)`.
    #[pyo3(signature = (ts, data_parallel_rank=None, raw_hashes=FlagArg(false)))]
    #[pyo3(text_signature = "($self, ts, data_parallel_rank=None, raw_hashes=False)")]
    fn take_event_batch<'py>(
        &self,
        py: Python<'py>,
        ts: &Bound<'py, PyAny>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        raw_hashes: FlagArg,
    ) -> PyResult<(usize, Bound<'py, PyBytes>)> {
        // Checked before anything is drained.
        let (ts, rank) = batch_args(py, ts, data_parallel_rank)?;
        let hashes = hash_format(raw_hashes.0);
        // Drained as the queue holds them: a removal stays its hash until it is written.
        let events = self.read(py, |kv| kv.take_drained_events())?;
        // Fails only for a list longer than u32::MAX items, which the bounded queue never holds.
        let payload = py
            .detach(|| encode_drained_events(&events, ts, rank, hashes))
            .map_err(|err| to_pyerr(py, err))?;
        Ok((events.len(), PyBytes::new(py, &payload)))
    }

    /// Drains the same KV events as `take_events` (the two share one queue), each as a
    /// `(kind, block_hashes, parent_block_hash, block_digests)` tuple: a stored block's token ids
    /// become one 64-bit digest (`pagedkv._core.token_block_digests`), what a router indexes.
    fn take_event_digests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.read(py, |kv| kv.take_events())?;
        events_to_digests(py, events)
    }

    fn __contains__(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match seq_id.extract::<SeqIdArg>() {
            Ok(seq_id) => self.read(py, |kv| kv.contains(seq_id.0)),
            // Ctrl-C inside the caller's `__index__` is not "no such sequence".
            Err(err) if must_propagate(py, &err) => Err(err),
            Err(_) => Ok(false),
        }
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |kv| kv.num_sequences())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (num_sequences, num_available_blocks) =
            self.read(py, |kv| (kv.num_sequences(), kv.num_available_blocks()))?;
        Ok(format!(
            "KvCacheManager(num_blocks={}, block_size={}, enable_prefix_caching={}, \
             num_host_blocks={}, num_sequences={num_sequences}, num_available_blocks={num_available_blocks})",
            self.num_blocks,
            self.block_size,
            if self.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            self.num_host_blocks,
        ))
    }
}

/// When both `token_ids` and `num_tokens` are given they must agree.
fn check_token_count(py: Python<'_>, len: usize, num_tokens: Option<CountArg>) -> PyResult<()> {
    match num_tokens {
        Some(CountArg(count)) if count != len => Err(invalid_argument(
            py,
            format!("num_tokens={count} disagrees with len(token_ids)={len}"),
        )),
        _ => Ok(()),
    }
}
