//! `pagedkv.BlockPool`: the thread-safe physical block pool, shareable by several managers.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::errors::{invalid_argument, to_pyerr};
use crate::scalars::{BlockIdArg, CountArg};

/// Block ids leave the bindings as NumPy int32, so a pool (device or host) may hold at most
/// `i32::MAX` blocks.
pub fn check_int32_block_count(py: Python<'_>, name: &str, num_blocks: usize) -> PyResult<()> {
    if num_blocks > i32::MAX as usize {
        return Err(invalid_argument(
            py,
            format!("{name} = {num_blocks} is too large: block ids must fit in int32"),
        ));
    }
    Ok(())
}

/// A pool of `num_blocks` physical blocks of `block_size` token slots with atomic refcounts.
/// Lock-free and thread-safe: pass one pool to several `KvCacheManager`s (one per thread).
#[pyclass(module = "pagedkv._core", name = "BlockPool", frozen)]
pub struct PyBlockPool {
    pub inner: Arc<pagedkv::BlockPool>,
    /// The managers built on this pool, which reclaim each other's cached blocks.
    pub peers: Arc<pagedkv::PoolPeers>,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(
        signature = (num_blocks=CountArg(1024), block_size=CountArg(16)),
        text_signature = "(num_blocks=1024, block_size=16)"
    )]
    fn new(py: Python<'_>, num_blocks: CountArg, block_size: CountArg) -> PyResult<Self> {
        check_int32_block_count(py, "num_blocks", num_blocks.0)?;
        let pool =
            pagedkv::BlockPool::new(num_blocks.0, block_size.0).map_err(|e| to_pyerr(py, e))?;
        Ok(Self {
            inner: Arc::new(pool),
            peers: Arc::default(),
        })
    }

    /// Total physical blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Token slots per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// Blocks on the pool's free list now (cached-evictable blocks of managers not included).
    #[getter]
    fn num_free_list_blocks(&self) -> usize {
        self.inner.num_free_list_blocks()
    }

    /// `num_free_list_blocks` under the name the contract (DESIGN) fixes for the pool.
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_list_blocks()
    }

    /// Takes `num_blocks` blocks off the free list for the caller's own use (managers' cached
    /// blocks are not reclaimed for it) and returns one `BlockHandle` per block, each holding
    /// one reference. Give each back with `release`; a manager never sees these blocks.
    fn allocate(&self, py: Python<'_>, num_blocks: CountArg) -> PyResult<Vec<PyBlockHandle>> {
        let blocks = self
            .inner
            .allocate(num_blocks.0)
            .map_err(|e| to_pyerr(py, e))?;
        blocks
            .into_iter()
            .map(|block_id| {
                // Cannot fail: the caller holds the reference `allocate` just took.
                let handle = self.inner.handle(block_id).map_err(|e| to_pyerr(py, e))?;
                Ok(PyBlockHandle {
                    pool: Arc::clone(&self.inner),
                    handle,
                })
            })
            .collect()
    }

    /// Adds one reference to the block `handle` names; returns the new refcount. A handle whose
    /// block was freed since: `StaleHandleError`, and nothing changes.
    fn retain(&self, py: Python<'_>, handle: &PyBlockHandle) -> PyResult<u32> {
        let handle = self.own_handle(py, handle)?;
        self.inner.retain(handle).map_err(|e| to_pyerr(py, e))
    }

    /// Drops one reference to the block `handle` names; `True` when the block went back on the
    /// free list. Already free: `DoubleFreeError`; freed and handed out again since the handle
    /// was taken: `StaleHandleError`. Either way nothing changes.
    fn release(&self, py: Python<'_>, handle: &PyBlockHandle) -> PyResult<bool> {
        let handle = self.own_handle(py, handle)?;
        self.inner.release(handle).map_err(|e| to_pyerr(py, e))
    }

    /// The refcount of one physical block (0 when free or cached-evictable).
    fn refcount(&self, py: Python<'_>, block_id: BlockIdArg) -> PyResult<u32> {
        self.inner.refcount(block_id.0).map_err(|e| to_pyerr(py, e))
    }

    /// Checks the pool's free-list consistency, and its cached-block count against the caches
    /// of the managers built on it (each locked in turn); raises `InvariantViolation`.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let pool = Arc::clone(&self.inner);
        let peers = Arc::clone(&self.peers);
        py.detach(move || {
            pool.check_invariants()?;
            peers.check_cached_count()
        })
        .map_err(|e| to_pyerr(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockPool(num_blocks={}, block_size={}, num_free_list_blocks={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.num_free_list_blocks()
        )
    }
}

impl PyBlockPool {
    /// The core handle of `handle`, which must come from this pool: a handle of another pool
    /// would name a block here that its holder never owned.
    fn own_handle(&self, py: Python<'_>, handle: &PyBlockHandle) -> PyResult<pagedkv::BlockHandle> {
        if !Arc::ptr_eq(&self.inner, &handle.pool) {
            return Err(invalid_argument(
                py,
                format!("{} belongs to another BlockPool", handle.__repr__()),
            ));
        }
        Ok(handle.handle)
    }
}

/// A reference to one tenancy of a block of a `BlockPool`, returned by `BlockPool.allocate`:
/// the block id and the generation the block had then. Not constructible from Python, so a
/// handle only ever names a block its holder allocated.
#[pyclass(module = "pagedkv._core", name = "BlockHandle", frozen)]
pub struct PyBlockHandle {
    /// The pool the handle was taken from (checked on every use).
    pool: Arc<pagedkv::BlockPool>,
    handle: pagedkv::BlockHandle,
}

#[pymethods]
impl PyBlockHandle {
    /// The block id (the index into the KV cache tensors).
    #[getter]
    fn block_id(&self) -> u32 {
        self.handle.id()
    }

    /// The block's generation when the handle was taken.
    #[getter]
    fn generation(&self) -> u32 {
        self.handle.generation()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyBlockHandle>().is_ok_and(|other| {
            let other = other.get();
            Arc::ptr_eq(&self.pool, &other.pool) && self.handle == other.handle
        })
    }

    fn __hash__(&self) -> u64 {
        (u64::from(self.handle.generation()) << 32) | u64::from(self.handle.id())
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHandle(block_id={}, generation={})",
            self.handle.id(),
            self.handle.generation()
        )
    }
}
