//! The conversions every CPU data-plane binding shares: NumPy arrays to checked slices, the
//! cache dtype, typed errors. A leaf: the call modules name it, it names none of them.

use half::slice::HalfBitsSliceExt;
use numpy::{
    Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pagedkv_cpu::{self as cpu, bf16, f16, CacheShape, KvElem};
use pyo3::prelude::*;

use crate::arrays::require_aligned;
use crate::errors::invalid_argument;

/// A NumPy element type and the cache element it stores.
pub(crate) trait Storage: Element + Copy + Send + Sync {
    type Elem: KvElem;
    fn view(s: &[Self]) -> &[Self::Elem];
    fn view_mut(s: &mut [Self]) -> &mut [Self::Elem];
}

impl Storage for f32 {
    type Elem = f32;
    fn view(s: &[Self]) -> &[f32] {
        s
    }
    fn view_mut(s: &mut [Self]) -> &mut [f32] {
        s
    }
}

impl Storage for f16 {
    type Elem = f16;
    fn view(s: &[Self]) -> &[f16] {
        s
    }
    fn view_mut(s: &mut [Self]) -> &mut [f16] {
        s
    }
}

/// bfloat16 as uint16 bit patterns.
impl Storage for u16 {
    type Elem = bf16;
    fn view(s: &[Self]) -> &[bf16] {
        s.reinterpret_cast()
    }
    fn view_mut(s: &mut [Self]) -> &mut [bf16] {
        s.reinterpret_cast_mut()
    }
}

pub(crate) fn err(py: Python<'_>, e: cpu::CpuError) -> PyErr {
    invalid_argument(py, e.to_string())
}

/// The dtype of a cache or query array: "f32" | "f16" | "bf16".
pub(crate) fn kind(py: Python<'_>, name: &str, x: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    let arr = x
        .cast::<PyUntypedArray>()
        .map_err(|_| invalid_argument(py, format!("{name} must be a NumPy array")))?;
    let dt = arr.dtype();
    if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Ok("f32")
    } else if dt.is_equiv_to(&numpy::dtype::<f16>(py)) {
        Ok("f16")
    } else if dt.is_equiv_to(&numpy::dtype::<u16>(py)) {
        Ok("bf16")
    } else {
        Err(invalid_argument(
            py,
            format!(
                "{name}: dtype {dt} is not supported by backend='cpu' (float32, float16, or \
                 bfloat16 as uint16 bit patterns)"
            ),
        ))
    }
}

/// How a checked array is borrowed: read-only, or exclusively for writing (NumPy's borrow
/// tracking then refuses one array passed twice, as two caches).
pub(crate) trait Borrow<'py, T: Element>: Sized {
    fn take(py: Python<'py>, name: &str, arr: &Bound<'py, PyArrayDyn<T>>) -> PyResult<Self>;
    /// The borrowed array's shape.
    fn dims(&self) -> &[usize];
}

impl<'py, T: Element> Borrow<'py, T> for PyReadonlyArrayDyn<'py, T> {
    fn take(py: Python<'py>, name: &str, arr: &Bound<'py, PyArrayDyn<T>>) -> PyResult<Self> {
        arr.try_readonly()
            .map_err(|e| invalid_argument(py, format!("{name}: {e}")))
    }
    fn dims(&self) -> &[usize] {
        self.shape()
    }
}

impl<'py, T: Element> Borrow<'py, T> for PyReadwriteArrayDyn<'py, T> {
    fn take(py: Python<'py>, name: &str, arr: &Bound<'py, PyArrayDyn<T>>) -> PyResult<Self> {
        arr.try_readwrite().map_err(|e| {
            invalid_argument(
                py,
                format!(
                    "{name} is read-only or borrowed twice (one array passed as two caches?): {e}"
                ),
            )
        })
    }
    fn dims(&self) -> &[usize] {
        self.shape()
    }
}

/// `x` as a C-contiguous, aligned `ndim`-D array of `T`, borrowed as `B`: the one conversion
/// every array argument goes through, its checks in this order. The refusals say `not_t()` for
/// another element type (or no array), and "{name} must be {dims}, got shape .." for another
/// number of dimensions (`dims` None: "{ndim}-D").
pub(crate) fn borrow<'py, T: Element, B: Borrow<'py, T>>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dims: Option<&str>,
    not_t: impl FnOnce() -> String,
) -> PyResult<B> {
    let arr = x
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| invalid_argument(py, not_t()))?;
    if arr.ndim() != ndim {
        let dims = dims.map_or_else(|| format!("{ndim}-D"), str::to_owned);
        return Err(invalid_argument(
            py,
            format!("{name} must be {dims}, got shape {:?}", arr.shape()),
        ));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(py, format!("{name} must be C-contiguous")));
    }
    require_aligned(py, name, arr.as_untyped())?;
    B::take(py, name, arr)
}

/// `x` as a read-only `ndim`-D array of `T` (see [`borrow`]). `dtype` names what a wrong element
/// type should have been.
pub(crate) fn array<'py, T: Element>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    borrow(py, name, x, ndim, None, || {
        format!("{name} must be {dtype}")
    })
}

/// A K/V tensor: its dtype must be the call's (the first tensor's, see [`kind`]).
pub(crate) fn read<'py, S: Storage>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
) -> PyResult<PyReadonlyArrayDyn<'py, S>> {
    array(py, name, x, ndim, "of the dtype of the other tensors")
}

/// Integer metadata (block tables, lengths, slots, copy ops).
pub(crate) fn ints<'py, T: Element>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    array(py, name, x, ndim, &format!("a {dtype} NumPy array"))
}

/// Block pairs (copy ops, swap mappings): an int32 `[N, 2]` array; `columns` names the two
/// columns in the refusal.
pub(crate) fn block_pairs<'py>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    columns: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, i32>> {
    let pairs = ints::<i32>(py, name, x, 2, "int32")?;
    if pairs.shape()[1] != 2 {
        return Err(invalid_argument(
            py,
            format!(
                "{name} must be [N, 2] {columns}, got shape {:?}",
                pairs.shape()
            ),
        ));
    }
    Ok(pairs)
}

pub(super) fn cache_shape(py: Python<'_>, k: &[usize], v: &[usize]) -> PyResult<CacheShape> {
    if k != v {
        return Err(invalid_argument(
            py,
            format!("v_cache shape {v:?} != k_cache shape {k:?}"),
        ));
    }
    Ok(CacheShape {
        num_blocks: k[0],
        block_size: k[1],
        num_kv_heads: k[2],
        head_dim: k[3],
    })
}

/// The slice of an array borrowed by [`array`], which checked it C-contiguous and aligned; a
/// typed error, never an empty slice, if it somehow is not (see `arrays.rs`).
pub(crate) fn slice<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|e| invalid_argument(a.py(), format!("array not readable in place: {e}")))
}

/// A new fp32 array of `shape` and the result of `fill` on its elements, computed with the GIL
/// released.
pub(crate) fn new_f32<'py>(
    py: Python<'py>,
    shape: &[usize],
    fill: impl FnOnce(&mut [f32]) -> cpu::Result<()> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    let out = PyArrayDyn::<f32>::zeros(py, shape, false);
    {
        let mut rw = out.readwrite();
        let s = rw
            .as_slice_mut()
            .map_err(|e| invalid_argument(py, format!("output: {e}")))?;
        py.detach(|| fill(s)).map_err(|e| err(py, e))?;
    }
    Ok(out.into_any())
}

pub(crate) fn mut_slice<'a, S: Element>(
    py: Python<'_>,
    a: &'a mut PyReadwriteArrayDyn<'_, S>,
) -> PyResult<&'a mut [S]> {
    a.as_slice_mut()
        .map_err(|e| invalid_argument(py, format!("cache: {e}")))
}
