//! `pagedkv.KvCacheManager`: argument conversion and error mapping around the core manager.
//!
//! Thread safety: the core manager is `Send` but mutated through `&mut self`, so the Python
//! object holds it in a `Mutex`; concurrent Python threads see each call as atomic.
//! Lock discipline (so that a lock holder never waits for the GIL): arguments are converted
//! before locking, results are copied into plain Rust values before unlocking, and Python
//! objects are only built after the guard is dropped. Heavy calls lock inside `py.detach`, so
//! other Python threads run meanwhile.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;

use pagedkv::{Error, KvCacheManager, ManagerConfig, PoolPeers};

use crate::block_keys::parse_null_block;
use crate::errors::{
    invalid_argument, invariant_violation, must_propagate, to_pyerr, with_arg_note,
};
use crate::groups::{groups_to_python, parse_kv_groups};
use crate::id_batches::{batch_len, SeqIds, TokenIds};
use crate::pool::{check_int32_block_count, PyBlockPool};
use crate::scalars::{CountArg, FlagArg, SeedArg, SeqIdArg};

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

mod admission;
mod chunks;
mod data_ops;
mod growth;
mod introspection;
mod tables;

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
/// The managers of one pool (its own, `kv.pool`, included) reclaim each other's cached blocks.
/// `hash_seed` keys the 128-bit block hashes; `max_events` bounds the KV-event queue (when
/// full, the oldest event is dropped and counted in `stats()["events_dropped"]`);
/// `enable_kv_events` turns event recording on (off by default, as in vLLM).
/// Every method is safe to call from several Python threads; batch calls release the GIL.
#[pyclass(module = "pagedkv._core", name = "KvCacheManager", frozen)]
pub struct PyKvCacheManager {
    inner: Arc<Mutex<KvCacheManager>>,
    /// The managers on this manager's pool, itself included (its own pool's or the one given
    /// as `pool=`): a call short of device blocks reclaims the others' cached blocks and runs
    /// once more (`pagedkv::PoolPeers`).
    peers: Arc<PoolPeers>,
    pool: Py<PyBlockPool>,
    num_blocks: usize,
    block_size: usize,
    /// `ManagerConfig::max_model_len` (`usize::MAX`: none given).
    max_model_len: usize,
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
            if self.inner.is_poisoned() {
                return Err(Failure::Poisoned);
            }
            Ok(self.peers.run(&self.inner, &mut op)?)
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

    /// The most tokens a prompt may have: what the pool could ever hold, or, admitted per chunk
    /// without the whole-prompt check (`require_full_prompt=False`, only its chunks must fit
    /// the pool), `max(pool tokens, max_model_len)` when a `max_model_len` is given.
    #[inline]
    pub(crate) fn max_prompt_tokens(&self, chunked: bool) -> usize {
        let pool_tokens = self.num_blocks.saturating_mul(self.block_size);
        match self.max_model_len {
            len if chunked && len != usize::MAX => len.max(pool_tokens),
            _ => pool_tokens,
        }
    }

    /// Token ids from `obj`, refused unread past `max_len` tokens.
    #[inline]
    pub(crate) fn token_ids_bounded<'py>(
        &self,
        obj: &Bound<'py, PyAny>,
        max_len: usize,
    ) -> PyResult<TokenIds<'py>> {
        TokenIds::extract_bounded(obj, max_len)
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
                (manager, pool.unbind(), peers)
            }
            None => {
                check_int32_block_count(py, "num_blocks", config.num_blocks)?;
                let manager = KvCacheManager::new(config).map_err(|e| to_pyerr(py, e))?;
                // The pool it makes is shareable (`pool=kv.pool`): this manager is the first of
                // the pool's peers, so that later ones and it reclaim each other's cached blocks.
                let peers = Arc::new(PoolPeers::default());
                let pool_object = Py::new(
                    py,
                    PyBlockPool {
                        inner: Arc::clone(manager.pool()),
                        peers: Arc::clone(&peers),
                    },
                )?;
                (manager, pool_object, peers)
            }
        };
        let num_blocks = manager.num_blocks();
        let block_size = manager.block_size();
        let max_model_len = manager.config().max_model_len;
        let inner = Arc::new(Mutex::new(manager));
        peers.join(&inner);
        Ok(Self {
            num_blocks,
            block_size,
            max_model_len,
            num_host_blocks: num_host_blocks.0,
            enable_prefix_caching: enable_prefix_caching.0,
            inner,
            peers,
            pool: pool_object,
        })
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

    /// `free`, with the blocks that become cached-evictable joining the eviction order from
    /// the last group's (vLLM's return of a deferred free's blocks).
    fn free_last_group_first(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<()> {
        self.run(py, false, |kv| kv.free_last_group_first(seq_id.0))
    }

    /// vLLM's `remove_skipped_blocks`: every window group releases what a processed watermark
    /// of `processed_tokens` puts out of its window (at most the computed tokens).
    fn release_skipped_blocks(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        processed_tokens: CountArg,
    ) -> PyResult<()> {
        self.run(py, false, |kv| {
            kv.release_skipped_blocks(seq_id.0, processed_tokens.0)
        })
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
