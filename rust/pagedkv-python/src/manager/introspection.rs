//! Read-only questions, counters, `stats()`, `check_invariants()`, the KV-event queue and
//! `reset_prefix_cache`, `evict_blocks`.
//! Argument conversion and error mapping only, as in `manager/mod.rs`.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use pagedkv::wire::encode_drained_events;

use crate::block_keys::extract_block_hash;
use crate::errors::{invalid_argument, to_pyerr};
use crate::event_digests::events_to_digests;
use crate::events::events_to_python;
use crate::prompt_hashes::PyPromptHashes;
use crate::scalars::{BlockIdArg, ExtraKey, FlagArg, SeqIdArg};
use crate::stats::stats_to_dict;
use crate::wire::{batch_args, hash_format};

use super::{PyKvCacheManager, DETACH_MIN_PROMPT_TOKENS};

#[pymethods]
impl PyKvCacheManager {
    /// Tokens of the sequence whose K/V exist by the end of the pass that scheduled them.
    fn num_computed_tokens(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<usize> {
        self.run(py, false, |kv| kv.num_computed_tokens(seq_id.0))
    }

    /// Tokens the sequence holds.
    fn num_tokens(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<usize> {
        self.run(py, false, |kv| kv.num_tokens(seq_id.0))
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

    /// `prefix_block_hashes(tokens, extra_key=...)` kept in Rust (a `PromptHashes`): hashed
    /// once at a request's arrival, handed to `CacheAwareQueue.push` and to the admission
    /// (`add_sequence(..., prompt_hashes=...)`) without becoming Python ints.
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn prompt_hashes(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<PyPromptHashes> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        let hashes = self.run(py, heavy, |kv| Ok(kv.prefix_block_hashes(ids, key)))?;
        Ok(PyPromptHashes { hashes })
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

    /// The block of KV-cache group `group` whose content the prefix cache holds under
    /// `block_hash` (in use or cached-evictable), or None: a look-up by that one hash, as vLLM's
    /// `BlockPool.get_cached_block` answers it. `block_hash` as in `block_hashes` (bytes,
    /// reduced as `reduce_block_hash` does, or an int: pagedkv's own hash). The first call
    /// stops chaining index entries (later admissions enter each block's map entry).
    #[pyo3(signature = (block_hash, *, group=0))]
    fn cached_block(
        &self,
        py: Python<'_>,
        block_hash: Bound<'_, PyAny>,
        group: usize,
    ) -> PyResult<Option<u32>> {
        let hash = extract_block_hash(&block_hash)?;
        self.run(py, false, |kv| kv.cached_block(hash, group))
    }

    /// A state group's hit (vLLM's `MambaManager.find_longest_cache_hit`, align mode): the
    /// rightmost `i < min(max_blocks, len(block_hashes))` whose hash group `group` holds a block
    /// under, as `(i + 1, block)`, or None; searched from the right, one block, not a chain.
    /// `block_hashes` as in `cached_block`.
    #[pyo3(signature = (block_hashes, max_blocks, *, group=0))]
    fn longest_cached_block(
        &self,
        py: Python<'_>,
        block_hashes: Vec<Bound<'_, PyAny>>,
        max_blocks: usize,
        group: usize,
    ) -> PyResult<Option<(usize, u32)>> {
        // Only the hashes the scan may read are converted (a prompt's list can be long).
        let n = max_blocks.min(block_hashes.len());
        let hashes = block_hashes[..n]
            .iter()
            .map(extract_block_hash)
            .collect::<PyResult<Vec<_>>>()?;
        self.run(py, false, |kv| kv.longest_cached_block(&hashes, n, group))
    }

    /// Each group's own hit, in tokens, of a prompt whose block hashes are `block_hashes`, at
    /// most `max_tokens` tokens: each group on its own, not reconciled (vLLM's
    /// `find_longest_cache_hit_per_group`): full attention's leading run of cached hashes, a
    /// window group's run before the hit point, a state group's rightmost cached block.
    /// `block_hashes` as in `cached_block`.
    fn group_hits(
        &self,
        py: Python<'_>,
        block_hashes: Vec<Bound<'_, PyAny>>,
        max_tokens: usize,
    ) -> PyResult<Vec<usize>> {
        let bs = self.read(py, |kv| kv.block_size())?;
        // Only the hashes a hit of `max_tokens` may read are converted.
        let n = (max_tokens / bs).min(block_hashes.len());
        let hashes = block_hashes[..n]
            .iter()
            .map(extract_block_hash)
            .collect::<PyResult<Vec<_>>>()?;
        self.run(py, false, |kv| Ok(kv.group_hits(&hashes, max_tokens)))
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`): from the first call on, an
    /// admission whose hit ends at a state block cached since the last call is refused
    /// (`OutOfBlocksError`: that state's pass has not run yet).
    fn new_step(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, false, |kv| {
            kv.new_step();
            Ok(())
        })
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

    /// Counters and gauges as a dict (see docs/design.md, Python API).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.read(py, |kv| kv.stats())?;
        stats_to_dict(py, &stats)
    }

    /// Verifies every allocator invariant; raises `InvariantViolation`. On a shared pool it
    /// then locks every manager of the pool in turn to check the pool's cached-block count
    /// against their caches (`PoolPeers::check_cached_count`).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, true, |kv| kv.check_invariants())?;
        py.detach(|| self.peers.check_cached_count())
            .map_err(|e| to_pyerr(py, e))
    }

    /// Empties the prefix index; False (and nothing changes) while any block is in use.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        self.read(py, |kv| kv.reset_prefix_cache())
    }

    /// Drops the prefix-index entries of `block_ids` (any iterable of ids, taken in its
    /// order): a held block stays with its holders as a private block, a cached one goes back
    /// to the free list, each removal a `BlockRemoved` event; blocks without an entry are left
    /// alone. Returns how many entries it removed. An id past the pool or a pinned block is
    /// `InvalidArgumentError`, changing nothing.
    fn evict_blocks(&self, py: Python<'_>, block_ids: Bound<'_, PyAny>) -> PyResult<usize> {
        // A str or bytes iterates, a non-iterable raises TypeError: both are malformed ids.
        let not_ids = || invalid_argument(py, "block_ids must be an iterable of block ids".into());
        if block_ids.is_instance_of::<PyString>() || block_ids.is_instance_of::<PyBytes>() {
            return Err(not_ids());
        }
        let mut ids = Vec::new();
        for item in block_ids.try_iter().map_err(|_| not_ids())? {
            ids.push(item?.extract::<BlockIdArg>()?.0);
        }
        self.run(py, false, |kv| kv.evict_blocks(&ids))
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
}
