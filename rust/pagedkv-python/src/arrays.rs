//! The layout checks every NumPy array the bindings read goes through.
//!
//! NumPy allows arrays that rust-numpy cannot hand out as slices: data not aligned to the dtype
//! (an `int32` array over a `bytearray` at an odd offset), strides that are not multiples of the
//! item size, or the other byte order. `as_slice()` refuses such an array, and an ndarray view of
//! one would read misaligned or from the wrong offsets, so no read may assume a layout it did not
//! check: an array is either read in place once [`is_behaved`] holds, read from a copy NumPy
//! makes ([`native_copy`]: aligned, C-contiguous, native byte order), or refused with an
//! `InvalidArgumentError` (a cache used in place). A read never falls back to an empty slice.

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::invalid_argument;

/// Whether `arr` can be read in place as what it claims to be: aligned to its dtype, every
/// stride a multiple of the item size (NumPy's `ALIGNED` flag implies this only where a dtype's
/// alignment equals its size), native byte order, and C-contiguous when `c_contiguous`.
pub(crate) fn is_behaved(arr: &Bound<'_, PyUntypedArray>, c_contiguous: bool) -> bool {
    let dtype = arr.dtype();
    let item = dtype.itemsize() as isize;
    // A stride over an axis of length 0 or 1 is never used (NumPy may leave any value there).
    let strides_fit = arr
        .shape()
        .iter()
        .zip(arr.strides())
        .all(|(&n, &s)| n <= 1 || (item != 0 && s % item == 0));
    arr.is_aligned()
        && dtype.is_native_byteorder() != Some(false)
        && strides_fit
        && (!c_contiguous || arr.is_c_contiguous())
}

/// A copy of `arr` that [`is_behaved`] accepts: `arr.astype(<its dtype in native byte order>,
/// order="C")`, which always allocates a fresh (aligned) array. Its size is the array's own,
/// so callers bound the array's length first.
pub(crate) fn native_copy<'py>(arr: &Bound<'py, PyUntypedArray>) -> PyResult<Bound<'py, PyAny>> {
    let py = arr.py();
    let native = arr
        .dtype()
        .call_method1(intern!(py, "newbyteorder"), ("=",))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item(intern!(py, "order"), "C")?;
    arr.call_method(intern!(py, "astype"), (native,), Some(&kwargs))
}

/// `arr` itself when [`is_behaved`] holds (C-contiguous as asked), else its [`native_copy`].
pub(crate) fn behaved<'py>(
    arr: &Bound<'py, PyUntypedArray>,
    c_contiguous: bool,
) -> PyResult<Bound<'py, PyAny>> {
    if is_behaved(arr, c_contiguous) {
        Ok(arr.clone().into_any())
    } else {
        native_copy(arr)
    }
}

/// `InvalidArgumentError` unless `arr` is aligned to its dtype: for arrays used in place (the
/// caches of the CPU data plane, and every `_core.cpu_*` argument, which the Python launchers
/// align first), where a copy would either be wrong (writes) or silently slow.
pub(crate) fn require_aligned(
    py: Python<'_>,
    name: &str,
    arr: &Bound<'_, PyUntypedArray>,
) -> PyResult<()> {
    if arr.is_aligned() {
        return Ok(());
    }
    Err(invalid_argument(
        py,
        format!(
            "{name} is not aligned to its dtype (an array over a buffer at an odd offset?): \
             pass an aligned array, e.g. numpy.require(x, requirements='CA')"
        ),
    ))
}
