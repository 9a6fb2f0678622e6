//! Writes into paged caches and copies of their blocks (copy-on-write, swap), and the argument
//! checks the quantized caches' writes and swaps share with them (`cpu_quant_ops.rs`).

use numpy::{Element, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pagedkv_cpu as cpu;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::convert::{
    block_pairs, borrow, cache_shape, err, ints, kind, mut_slice, read, slice, Storage,
};
use crate::errors::invalid_argument;

/// The new tokens of a cache write: `k` and `v` `[num_tokens, num_kv_heads, head_dim]` and
/// their int64 `slot_mapping`, read in this order.
pub(crate) struct NewKv<'py, S: Storage> {
    k: PyReadonlyArrayDyn<'py, S>,
    v: PyReadonlyArrayDyn<'py, S>,
    slots: PyReadonlyArrayDyn<'py, i64>,
}

/// `(k, v, slot_mapping)` as the kernels read them.
pub(crate) type NewKvSlices<'a, E> = (&'a [E], &'a [E], &'a [i64]);

impl<'py, S: Storage> NewKv<'py, S> {
    pub(crate) fn read(
        py: Python<'py>,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        slot_mapping: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        Ok(NewKv {
            k: read::<S>(py, "k", k, 3)?,
            v: read::<S>(py, "v", v, 3)?,
            slots: ints::<i64>(py, "slot_mapping", slot_mapping, 1, "int64")?,
        })
    }

    /// `(k, v, slot_mapping)` as slices, once `k` and `v` are checked against the cache's
    /// `num_kv_heads` and `head_dim`.
    pub(crate) fn slices(
        &self,
        py: Python<'_>,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> PyResult<NewKvSlices<'_, S::Elem>> {
        let (k, v) = (self.k.shape(), self.v.shape());
        if k != v || k[1..] != [num_kv_heads, head_dim] {
            return Err(invalid_argument(
                py,
                format!("k {k:?} and v {v:?} must be [num_tokens, {num_kv_heads}, {head_dim}]"),
            ));
        }
        Ok((
            S::view(slice(&self.k)?),
            S::view(slice(&self.v)?),
            slice(&self.slots)?,
        ))
    }
}

fn write_kv_t<'py, S: Storage>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let new = NewKv::<S>::read(py, k, v, slot_mapping)?;
    let mut kc = write::<S>(py, "k_cache", k_cache)?;
    let mut vc = write::<S>(py, "v_cache", v_cache)?;
    let cache = cache_shape(py, kc.shape(), vc.shape())?;
    let (ks, vs, ss) = new.slices(py, cache.num_kv_heads, cache.head_dim)?;
    let kcs = S::view_mut(mut_slice(py, &mut kc)?);
    let vcs = S::view_mut(mut_slice(py, &mut vc)?);
    py.detach(|| cpu::write_kv(ks, vs, kcs, vcs, cache, ss))
        .map_err(|e| err(py, e))
}

/// A writable C-contiguous 4-D cache, borrowed exclusively (the same array passed twice is
/// refused by NumPy's borrow tracking).
fn write<'py, S: Storage>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<PyReadwriteArrayDyn<'py, S>> {
    borrow(
        py,
        name,
        x,
        4,
        Some("[num_blocks, block_size, num_kv_heads, head_dim]"),
        || format!("{name} must share the dtype of the other tensors"),
    )
}

/// Writes new tokens' K/V into their slots (see `pagedkv.attention.write_kv`).
#[pyfunction]
pub(super) fn cpu_write_kv<'py>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let kd = kind(py, "k_cache", k_cache)?;
    dispatch!(py, kd, write_kv_t(py, k, v, k_cache, v_cache, slot_mapping))
}

fn copy_blocks_t<'py, S: Storage>(
    py: Python<'py>,
    k_caches: &Bound<'py, PyList>,
    v_caches: &Bound<'py, PyList>,
    copy_ops: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let ops = block_pairs(py, "copy_ops", copy_ops, "(src, dst)")?;
    if k_caches.len() == 0 || k_caches.len() != v_caches.len() {
        return Err(invalid_argument(
            py,
            format!(
                "k_caches ({}) and v_caches ({}) must list the same layers, at least one",
                k_caches.len(),
                v_caches.len()
            ),
        ));
    }
    let items: Vec<Bound<'py, PyAny>> = k_caches.iter().chain(v_caches.iter()).collect();
    let mut borrows = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        borrows.push(write::<S>(py, &format!("caches[{i}]"), x)?);
    }
    let shape = borrows[0].shape().to_vec();
    for (i, b) in borrows.iter().enumerate() {
        if b.shape() != shape.as_slice() {
            return Err(invalid_argument(
                py,
                format!(
                    "cache {i} has shape {:?}, layer 0's is {shape:?}",
                    b.shape()
                ),
            ));
        }
    }
    let cache = cache_shape(py, &shape, &shape)?;
    let mut slices: Vec<&mut [S::Elem]> = Vec::with_capacity(borrows.len());
    for b in borrows.iter_mut() {
        slices.push(S::view_mut(mut_slice(py, b)?));
    }
    let ops_s = slice(&ops)?;
    py.detach(|| cpu::copy_blocks(&mut slices, cache, ops_s))
        .map_err(|e| err(py, e))
}

/// Copy-on-write block copies in every layer (see `pagedkv.attention.copy_blocks`).
#[pyfunction]
pub(super) fn cpu_copy_blocks<'py>(
    py: Python<'py>,
    k_caches: &Bound<'py, PyList>,
    v_caches: &Bound<'py, PyList>,
    copy_ops: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let first = k_caches
        .get_item(0)
        .map_err(|_| invalid_argument(py, "k_caches must list at least one layer".into()))?;
    let kd = kind(py, "k_caches[0]", &first)?;
    dispatch!(py, kd, copy_blocks_t(py, k_caches, v_caches, copy_ops))
}

/// Copies `mapping`'s blocks (an array's rows past its first dimension) from `src` into `dst`;
/// returns the number of copies. Both swap bindings end here, their arrays read; `block` names
/// what the two must share in the refusal ("block shape", "row length"). A swap moves elements
/// as they are, so the element is the NumPy one (uint16 for bfloat16).
pub(crate) fn swap<'py, T: Element + Copy + Send + Sync>(
    py: Python<'py>,
    src: &PyReadonlyArrayDyn<'py, T>,
    dst: &mut PyReadwriteArrayDyn<'py, T>,
    mapping: &PyReadonlyArrayDyn<'py, i32>,
    block: &str,
) -> PyResult<usize> {
    if src.shape()[1..] != dst.shape()[1..] {
        return Err(invalid_argument(
            py,
            format!(
                "src_cache {:?} and dst_cache {:?} must have one {block}",
                src.shape(),
                dst.shape()
            ),
        ));
    }
    let block_elems: usize = src.shape()[1..].iter().product();
    let (ss, ms) = (slice(src)?, slice(mapping)?);
    let ds = mut_slice(py, dst)?;
    py.detach(|| cpu::swap_blocks(ss, ds, block_elems, ms))
        .map_err(|e| err(py, e))
}

fn swap_blocks_t<'py, S: Storage>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let m = block_pairs(py, "mapping", mapping, "(src_block, dst_block)")?;
    let s = read::<S>(py, "src_cache", src, 4)?;
    let mut d = write::<S>(py, "dst_cache", dst)?;
    swap(py, &s, &mut d, &m, "block shape")
}

/// Copies blocks between two caches of one block shape (see `pagedkv.attention.swap_blocks`).
#[pyfunction]
pub(super) fn cpu_swap_blocks<'py>(
    py: Python<'py>,
    src_cache: &Bound<'py, PyAny>,
    dst_cache: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let kd = kind(py, "src_cache", src_cache)?;
    dispatch!(py, kd, swap_blocks_t(py, src_cache, dst_cache, mapping))
}
