//! `pagedkv._core.CacheAwareQueue`: the cache-aware waiting queue (`pagedkv_sim::CacheAwareQueue`,
//! docs/scheduling.md) for a Python engine. Argument conversion only.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use pagedkv::{BlockHash, KvEvent, Tier};
use pagedkv_sim::{CacheAwareQueue, Scheduling};

use crate::errors::{invalid_argument, or_invalid, to_pyerr};
use crate::manager::PyKvCacheManager;
use crate::prompt_hashes::hashes_arg;
use crate::scalars::{type_name, CountArg, SeqIdArg};

/// A waiting queue ordered by a scheduling policy over a `KvCacheManager`'s prefix cache.
///
/// `CacheAwareQueue(policy="lpm", aging_bound=2048)`: `policy` is `"fcfs"`, `"lpm"` or `"dfs"`;
/// no request is passed over by more than `aging_bound` admissions. Push each arriving request
/// with `kv.prefix_block_hashes(prompt)`, feed every `kv.take_events()` list to `apply_events`
/// (the manager needs `enable_kv_events=True`), admit `peek()`'s choice and report it with
/// `admitted`.
#[pyclass(module = "pagedkv._core", name = "CacheAwareQueue")]
pub struct PyCacheAwareQueue {
    inner: CacheAwareQueue,
}

/// `kv` as a `pagedkv.KvCacheManager`, else `InvalidArgumentError`.
fn manager<'a, 'py>(
    py: Python<'py>,
    kv: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyKvCacheManager>> {
    kv.cast::<PyKvCacheManager>().map_err(|_| {
        invalid_argument(
            py,
            format!("kv must be a pagedkv.KvCacheManager, got {}", type_name(kv)),
        )
    })
}

/// A list of 128-bit block hashes (Python ints).
fn block_hashes(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<BlockHash>> {
    let py = obj.py();
    let wrong = || {
        invalid_argument(
            py,
            format!(
                "{what} must be a list of block hashes (ints in [0, 2**128)), got {}",
                type_name(obj)
            ),
        )
    };
    let list = obj.cast::<PyList>().map_err(|_| wrong())?;
    list.iter()
        .map(|h| h.extract::<u128>().map_err(|e| or_invalid(py, e, wrong)))
        .collect()
}

/// One `pagedkv` KV event object (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) as the
/// core event the queue reads (device tier only; others are skipped: `None`).
fn event(obj: &Bound<'_, PyAny>) -> PyResult<Option<KvEvent>> {
    let py = obj.py();
    let kind = obj.get_type().name()?.to_string();
    let on_device = || -> PyResult<bool> {
        let medium = obj.getattr("medium")?;
        Ok(medium.extract::<String>().is_ok_and(|m| m == "GPU"))
    };
    match kind.as_str() {
        "AllBlocksCleared" => Ok(Some(KvEvent::AllBlocksCleared)),
        "BlockStored" | "BlockRemoved" if !on_device()? => Ok(None),
        "BlockStored" => {
            let parent = obj.getattr("parent_block_hash")?;
            let parent_block_hash = if parent.is_none() {
                None
            } else {
                Some(parent.extract::<u128>().map_err(|e| {
                    or_invalid(py, e, || invalid_argument(py, "parent_block_hash must be an int or None".into()))
                })?)
            };
            Ok(Some(KvEvent::BlockStored {
                block_hashes: block_hashes(&obj.getattr("block_hashes")?, "block_hashes")?,
                parent_block_hash,
                token_ids: Vec::new(),
                block_size: 0,
                extra_key: None,
                medium: Tier::Device,
                group_idx: None,
            }))
        }
        "BlockRemoved" => Ok(Some(KvEvent::BlockRemoved {
            block_hashes: block_hashes(&obj.getattr("block_hashes")?, "block_hashes")?,
            medium: Tier::Device,
            group_idx: None,
        })),
        _ => Err(invalid_argument(
            py,
            format!("expected pagedkv KV events (BlockStored, BlockRemoved, AllBlocksCleared), got {kind}"),
        )),
    }
}

#[pymethods]
impl PyCacheAwareQueue {
    #[new]
    #[pyo3(
        signature = (policy="lpm", aging_bound=CountArg(2048)),
        text_signature = "(policy='lpm', aging_bound=2048)"
    )]
    fn new(py: Python<'_>, policy: &str, aging_bound: CountArg) -> PyResult<Self> {
        let policy: Scheduling = policy.parse().map_err(|e| to_pyerr(py, e))?;
        Ok(PyCacheAwareQueue {
            inner: CacheAwareQueue::new(policy, aging_bound.0),
        })
    }

    /// The ordering policy's name.
    #[getter]
    fn policy(&self) -> String {
        self.inner.policy().to_string()
    }

    /// Most admissions that may pass over a waiting request.
    #[getter]
    fn aging_bound(&self) -> usize {
        self.inner.aging_bound()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Adds request `request_id` (not waiting) whose prompt's full blocks have the chained hashes
    /// `block_hashes` (a list of ints, or the `PromptHashes` of `kv.prompt_hashes(prompt)`,
    /// which the admission then takes too: `add_sequence(..., prompt_hashes=...)`) and which
    /// can hit at most `max_hit_blocks` of them (`(len(prompt) - 1) // block_size`); returns
    /// its arrival rank.
    fn push(
        &mut self,
        py: Python<'_>,
        request_id: SeqIdArg,
        block_hashes: &Bound<'_, PyAny>,
        max_hit_blocks: CountArg,
    ) -> PyResult<u64> {
        let hashes = hashes_arg(block_hashes, "block_hashes", usize::MAX)?;
        self.inner
            .push(request_id.0, hashes.as_slice(), max_hit_blocks.0)
            .map_err(|e| to_pyerr(py, e))
    }

    /// `push(request_id, kv.prefix_block_hashes(token_ids), (len(token_ids) - 1) //
    /// kv.block_size)` in one call, hashing in Rust: the prompt's hashes never become Python
    /// ints (80+ 128-bit ints per prompt were most of an engine's per-arrival cost,
    /// benches/results/2026-12-06-cache-aware-scheduling-v2.md). Returns the arrival rank.
    fn push_prompt(
        &mut self,
        py: Python<'_>,
        request_id: SeqIdArg,
        kv: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let kv = manager(py, kv)?;
        let kv = kv.get();
        let tokens = kv.token_ids(token_ids)?;
        let ids = tokens.as_slice()?;
        let (hashes, block_size) = kv.read(py, |kv| {
            (kv.prefix_block_hashes(ids, None), kv.block_size())
        })?;
        self.inner
            .push(
                request_id.0,
                &hashes,
                ids.len().saturating_sub(1) / block_size,
            )
            .map_err(|e| to_pyerr(py, e))
    }

    /// The request to admit next, or None when nothing waits.
    fn peek(&mut self) -> Option<u64> {
        self.inner.peek()
    }

    /// Request `request_id` was admitted: it leaves the queue (`InvalidArgumentError` if it was
    /// not waiting). Feed the admission's events before the next push or admission.
    fn admitted(&mut self, py: Python<'_>, request_id: SeqIdArg) -> PyResult<()> {
        self.inner
            .admitted(request_id.0)
            .map_err(|e| to_pyerr(py, e))
    }

    /// Whether a request of arrival rank `rank` coming back from preemption may be admitted now.
    fn may_admit_other(&mut self, rank: SeqIdArg) -> bool {
        self.inner.may_admit_other(rank.0)
    }

    /// A request of arrival rank `rank` came back from preemption.
    fn other_admitted(&mut self, rank: SeqIdArg) {
        self.inner.other_admitted(rank.0);
    }

    /// Drops waiting request `request_id` (an abort); False if it was not waiting.
    fn remove(&mut self, request_id: SeqIdArg) -> bool {
        self.inner.remove(request_id.0)
    }

    /// The blocks waiting request `request_id` would hit if admitted now, or None.
    fn hit_blocks(&self, request_id: SeqIdArg) -> Option<usize> {
        self.inner.hit_blocks(request_id.0)
    }

    /// The arrival rank of waiting request `request_id`, or None.
    fn rank(&self, request_id: SeqIdArg) -> Option<u64> {
        self.inner.rank(request_id.0)
    }

    /// Feeds the events of one `kv.take_events()` list, in order; a malformed event is an
    /// `InvalidArgumentError` (the events before it are applied).
    fn apply_events(&mut self, py: Python<'_>, events: &Bound<'_, PyAny>) -> PyResult<()> {
        let list = events.cast::<PyList>().map_err(|_| {
            invalid_argument(
                py,
                format!("events must be a list, got {}", type_name(events)),
            )
        })?;
        for item in list.iter() {
            if let Some(e) = event(&item)? {
                self.inner.apply(&e).map_err(|err| to_pyerr(py, err))?;
            }
        }
        Ok(())
    }

    /// Drains `kv`'s KV events straight into the queue, as `apply_events(kv.take_events())`
    /// does but without an event object per event (an engine's per-step path); returns how many
    /// were applied. A hybrid manager's events of group 0 only: each group stores and removes
    /// its own copies, and the queue follows one chain of blocks (group 0 holds full-attention
    /// layers, the one kind that keeps a whole prefix). `kv` needs `enable_kv_events=True`.
    fn apply_manager_events(&mut self, py: Python<'_>, kv: &Bound<'_, PyAny>) -> PyResult<usize> {
        let kv = manager(py, kv)?;
        let events = kv.get().read(py, |kv| kv.take_drained_events())?;
        self.inner
            .apply_drained(&events)
            .map_err(|err| to_pyerr(py, err))
    }

    /// `admissions`, `max_passed_over`, `forced_admissions`, `evicted_wanted_blocks`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("admissions", s.admissions)?;
        d.set_item("max_passed_over", s.max_passed_over)?;
        d.set_item("forced_admissions", s.forced_admissions)?;
        d.set_item("evicted_wanted_blocks", s.evicted_wanted_blocks)?;
        Ok(d)
    }

    /// Checks the index's invariants (slow; for tests): raises `pagedkv.InvariantViolation`.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check_invariants().map_err(|e| to_pyerr(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheAwareQueue(policy={:?}, aging_bound={}) with {} waiting",
            self.inner.policy().to_string(),
            self.inner.aging_bound(),
            self.inner.len()
        )
    }
}
