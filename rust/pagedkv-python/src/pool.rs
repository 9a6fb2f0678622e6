//! `pagedkv.BlockPool`: the thread-safe physical block pool, shareable by several managers.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::convert::{BlockIdArg, CountArg};
use crate::errors::{invalid_argument, to_pyerr};

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
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    /// The refcount of one physical block (0 when free or cached-evictable).
    fn refcount(&self, py: Python<'_>, block_id: BlockIdArg) -> PyResult<u32> {
        self.inner.refcount(block_id.0).map_err(|e| to_pyerr(py, e))
    }

    /// Checks the pool's free-list consistency; raises `InvariantViolation`.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let pool = Arc::clone(&self.inner);
        py.detach(move || pool.check_invariants())
            .map_err(|e| to_pyerr(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockPool(num_blocks={}, block_size={}, num_free_blocks={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.num_free_blocks()
        )
    }
}
