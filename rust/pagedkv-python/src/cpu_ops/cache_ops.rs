//! Writes into paged caches and copies of their blocks (copy-on-write, swap).

use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pagedkv_cpu::{self as cpu, f16};
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::convert::{cache_shape, err, ints, kind, mut_slice, read, slice, Storage};
use crate::arrays::require_aligned;
use crate::errors::invalid_argument;

fn write_kv_t<'py, S: Storage>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let k = read::<S>(py, "k", k, 3)?;
    let v = read::<S>(py, "v", v, 3)?;
    let slots = ints::<i64>(py, "slot_mapping", slot_mapping, 1, "int64")?;
    let mut kc = write::<S>(py, "k_cache", k_cache)?;
    let mut vc = write::<S>(py, "v_cache", v_cache)?;
    let cache = cache_shape(py, kc.shape(), vc.shape())?;
    if k.shape() != v.shape() || k.shape()[1..] != kc.shape()[2..] {
        return Err(invalid_argument(
            py,
            format!(
                "k {:?} and v {:?} must be [num_tokens, {}, {}]",
                k.shape(),
                v.shape(),
                cache.num_kv_heads,
                cache.head_dim
            ),
        ));
    }
    let (ks, vs, ss) = (S::view(slice(&k)?), S::view(slice(&v)?), slice(&slots)?);
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
) -> PyResult<numpy::PyReadwriteArrayDyn<'py, S>> {
    let arr = x.cast::<PyArrayDyn<S>>().map_err(|_| {
        invalid_argument(
            py,
            format!("{name} must share the dtype of the other tensors"),
        )
    })?;
    if arr.ndim() != 4 {
        return Err(invalid_argument(
            py,
            format!(
                "{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {:?}",
                arr.shape()
            ),
        ));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(py, format!("{name} must be C-contiguous")));
    }
    require_aligned(py, name, arr.as_untyped())?;
    arr.try_readwrite().map_err(|e| {
        invalid_argument(
            py,
            format!("{name} is read-only or borrowed twice (one array passed as two caches?): {e}"),
        )
    })
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
    let ops = ints::<i32>(py, "copy_ops", copy_ops, 2, "int32")?;
    if ops.shape()[1] != 2 {
        return Err(invalid_argument(
            py,
            format!(
                "copy_ops must be [N, 2] (src, dst), got shape {:?}",
                ops.shape()
            ),
        ));
    }
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

fn swap_blocks_t<'py, S: Storage>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let m = ints::<i32>(py, "mapping", mapping, 2, "int32")?;
    if m.shape()[1] != 2 {
        return Err(invalid_argument(
            py,
            format!(
                "mapping must be [N, 2] (src_block, dst_block), got shape {:?}",
                m.shape()
            ),
        ));
    }
    let s = read::<S>(py, "src_cache", src, 4)?;
    let mut d = write::<S>(py, "dst_cache", dst)?;
    if s.shape()[1..] != d.shape()[1..] {
        return Err(invalid_argument(
            py,
            format!(
                "src_cache {:?} and dst_cache {:?} must have one block shape",
                s.shape(),
                d.shape()
            ),
        ));
    }
    let block_elems: usize = s.shape()[1..].iter().product();
    let (ss, ms) = (S::view(slice(&s)?), slice(&m)?);
    let ds = S::view_mut(mut_slice(py, &mut d)?);
    py.detach(|| cpu::swap_blocks(ss, ds, block_elems, ms))
        .map_err(|e| err(py, e))
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
