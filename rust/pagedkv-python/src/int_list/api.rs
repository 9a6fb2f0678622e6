//! The C-API path of the int reader: the limited API's `PyList_GetItem` and
//! `PyLong_AsLongAndOverflow`, item by item. Every build has it: it reads every list when the
//! direct reader is not built (cargo feature `direct-int-reader` off) or not proved, and the
//! items the direct reader refuses. A leaf: the direct reader falls back to it, `mod.rs`
//! dispatches to both.

use std::mem::MaybeUninit;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// The C-API read of `item`: its value when it is an exact `int` in `[0, 2**63)` (`c_long`'s
/// range where that is narrower), else `None`.
///
/// # Safety
/// `item` is a live object and the GIL is held. Only an exact `int` is converted, which runs
/// no Python code; the error a failed conversion may leave is cleared here.
#[cold]
pub(super) unsafe fn int_value(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: the caller's contract: `item` is live and the GIL held.
    if unsafe { ffi::PyLong_CheckExact(item) } == 0 {
        return None;
    }
    let mut overflow: std::os::raw::c_int = 0;
    // SAFETY: as above; an exact `int`'s conversion runs no Python code.
    let value = unsafe { ffi::PyLong_AsLongAndOverflow(item, &mut overflow) };
    if value == -1 {
        // SAFETY: GIL held; clearing a pending error (or none) is always allowed.
        unsafe { ffi::PyErr_Clear() };
    }
    if overflow != 0 {
        return None;
    }
    // `c_long` is 32-bit on Windows: widen explicitly.
    #[allow(clippy::useless_conversion)]
    u64::try_from(i64::from(value)).ok()
}

/// The C-API read loop: `out[i] = convert(list[i])` while every item qualifies, each item
/// through `PyList_GetItem` and [`int_value`]. True when every slot of `out` (the list's length)
/// was written.
pub(super) fn fill<T>(
    list: &Bound<'_, PyList>,
    out: &mut [MaybeUninit<T>],
    convert: impl Fn(u64) -> Option<T>,
) -> bool {
    for (index, slot) in out.iter_mut().enumerate() {
        // SAFETY: GIL held (`list` proves it), `index < len` (the caller checked `out`'s
        // length), and no Python code runs in this loop, so the borrowed item stays alive.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t) };
        if item.is_null() {
            // SAFETY: GIL held; clears the IndexError.
            unsafe { ffi::PyErr_Clear() };
            return false;
        }
        // SAFETY: `item` is live, borrowed from the list; GIL held.
        let Some(value) = (unsafe { int_value(item) }).and_then(&convert) else {
            return false;
        };
        slot.write(value);
    }
    true
}
