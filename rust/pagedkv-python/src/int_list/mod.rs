//! The one reader of Python ints the bindings have: lists of token ids and sequence ids, and
//! single id arguments. Anything that is not an exact non-negative `int` stops the read; the
//! caller's checked path then reports the error. Two paths, the same answers:
//!
//! - [`api`], in every build: the C API (`PyList_GetItem` and `PyLong_AsLongAndOverflow`), item
//!   by item;
//! - [`direct`], only with the cargo feature `direct-int-reader` (on by default, so in the
//!   wheel): small exact `int`s read from CPython's object memory once the layout was proved at
//!   import, every other item through [`api`] in the same loop.
//!
//! Why the direct path: through the stable ABI every list item costs two C calls (the second
//! dearer for ids above 2**30, which take two 30-bit digits, as the ids near 2e9 of the peer
//! harness's system prompts do); for a long prompt those calls cost more than the whole Rust
//! prefix admission, while read in place an item costs a few loads. On the peer harness's W2
//! the C-API path costs several times the direct one per request
//! (benches/results/2026-12-02-prefix-admission.md, "Follow-up: direct list reader", and
//! benches/results/2026-12-06-int-list-reader.md).
//!
//! Why behind a feature: the object layouts it reads are not part of the limited API. A build
//! without it (`maturin build --no-default-features`) has no such read: every list goes through
//! [`api`], and `_core._int_list_reader()` says `'api'`. CI builds and tests both
//! (scripts/test.sh). docs/security.md states the guarantee.

use std::mem::MaybeUninit;

use pyo3::prelude::*;
use pyo3::types::PyList;

mod api;
#[cfg(feature = "direct-int-reader")]
mod direct;

/// The proved layout's loop over `list`'s items ([`direct`]), or the C API's ([`api`]) when
/// the direct reader is not built or not proved.
#[inline(always)]
fn fill_uninit<T>(
    list: &Bound<'_, PyList>,
    out: &mut [MaybeUninit<T>],
    convert: impl Fn(u64) -> Option<T>,
) -> bool {
    let len = list.len();
    if len != out.len() {
        return false;
    }
    if len == 0 {
        return true;
    }
    #[cfg(feature = "direct-int-reader")]
    // SAFETY: `out.len()` is the list's length, and at least 1 (both checked above).
    if let Some(filled) = unsafe { direct::fill(list, out, &convert) } {
        return filled;
    }
    api::fill(list, out, convert)
}

/// Fills `out` (exactly `list`'s length) with `convert` of each item when every item is an
/// exact `int` in `[0, 2**63)` that `convert` accepts. False otherwise
/// (`out` then holds a prefix of the values): the caller reads the whole list again on its
/// checked path, which reports the error.
#[inline]
pub fn fill_from_list<T: Copy>(
    list: &Bound<'_, PyList>,
    out: &mut [T],
    convert: impl Fn(u64) -> Option<T>,
) -> bool {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, and the loop only ever writes initialized
    // values (`T: Copy`: nothing is dropped by overwriting), so `out` stays initialized.
    let out = unsafe { &mut *(std::ptr::from_mut::<[T]>(out) as *mut [MaybeUninit<T>]) };
    fill_uninit(list, out, convert)
}

/// Appends `convert` of each item of `list` to the empty `out` (its capacity at least the
/// list's length), as [`fill_from_list`] does, without zeroing the buffer first (zeroing was a
/// measurable share of a call: benches/results/2026-12-02-prefix-admission.md, "Follow-up:
/// direct list reader"). False (and `out` still empty) when an item does not qualify.
#[inline]
pub fn extend_from_list<T>(
    list: &Bound<'_, PyList>,
    out: &mut Vec<T>,
    convert: impl Fn(u64) -> Option<T>,
) -> bool {
    let len = list.len();
    if !out.is_empty() || out.capacity() < len {
        return false;
    }
    if !fill_uninit(list, &mut out.spare_capacity_mut()[..len], convert) {
        return false;
    }
    // SAFETY: `fill_uninit` returned true: it wrote every one of the first `len` slots.
    unsafe { out.set_len(len) };
    true
}

/// The value of `obj` when it is an exact `int` in `[0, 2**63)` (one id argument:
/// `free(seq_id)`, `append_tokens(seq_id, ...)`), read as a list item is; `None` otherwise,
/// and the caller's checked path converts or refuses it.
#[inline]
pub fn exact_int_value(obj: &Bound<'_, PyAny>) -> Option<u64> {
    #[cfg(feature = "direct-int-reader")]
    if let Some(value) = direct::exact_int_value(obj) {
        return Some(value);
    }
    // SAFETY: `obj` is live and the GIL held (`Bound` proves both).
    unsafe { api::int_value(obj.as_ptr()) }
}

/// The name of the list reader in use: `'cpython-3.10'`, `'cpython-3.12'` or `'api'` (the
/// direct reader off, unproved or not built). Private: tests assert the fast reader did not
/// silently turn off.
#[pyfunction]
fn _int_list_reader() -> &'static str {
    #[cfg(feature = "direct-int-reader")]
    let name = direct::layout_name();
    #[cfg(not(feature = "direct-int-reader"))]
    let name = "api";
    name
}

/// Proves the direct reader's layout (once per process, when it is built) and registers
/// `_int_list_reader` (set as an attribute: `add_function` would also list the private name in
/// `__all__`).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    #[cfg(feature = "direct-int-reader")]
    direct::prove_layout(m.py());
    m.setattr("_int_list_reader", wrap_pyfunction!(_int_list_reader, m)?)
}
