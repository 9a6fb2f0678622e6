//! The data moves the manager asks the caller to make: copy-on-write copies, host-cache offloads
//! and loads, and swaps to and from the host tier, each as `[N, 2]` int32 (source, destination).
//! Argument conversion and error mapping only, as in `manager/mod.rs`.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use pagedkv::{BlockId, KvCacheManager, SeqId};

use crate::scalars::SeqIdArg;

use super::{block_id_to_i32, PyKvCacheManager, DETACH_MIN_BATCH};

/// `KvCacheManager::swap_out` or `swap_in`: (source, destination) block pairs to copy.
type SwapDirection = fn(&mut KvCacheManager, &[SeqId]) -> pagedkv::Result<Vec<(BlockId, BlockId)>>;

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

impl PyKvCacheManager {
    /// One swap direction over one sequence or a fork group: the ids read, the core call (GIL
    /// released for large groups), its (source, destination) pairs as `[N, 2]` int32.
    fn swap<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        direction: SwapDirection,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seq_ids = self.one_or_many_seq_ids(py, seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let pairs = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| direction(kv, seqs))?;
        pairs_to_array(py, &pairs)
    }
}

#[pymethods]
impl PyKvCacheManager {
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

    /// Moves one sequence or a fork group to the host tier; int32 `[N, 2]`
    /// (device_block, host_block) copies to run before the device blocks are reused.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.swap(py, &seq_ids, KvCacheManager::swap_out)
    }

    /// Brings swapped-out sequences back; int32 `[N, 2]` (host_block, device_block) copies.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.swap(py, &seq_ids, KvCacheManager::swap_in)
    }

    /// Whether the sequence is swapped out to the host tier.
    fn is_swapped_out(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<bool> {
        self.run(py, false, |kv| kv.is_swapped_out(seq_id.0))
    }
}
