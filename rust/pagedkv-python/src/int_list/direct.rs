//! The direct path of the int reader (cargo feature `direct-int-reader`; `mod.rs` says why):
//! small exact `int`s read from CPython's object memory once the layout was proved at import,
//! every other exact `int` below 2**63 through the C API ([`api`]) in the same loop.
//!
//! The layouts read here are not part of the limited API, so none is assumed: at module import
//! [`prove_layout`] picks a candidate from the running interpreter (CPython 3.10–3.14, GIL
//! build, 30-bit digits in 4 bytes, `int`/`list` basic sizes as the layout says) and then PROVES
//! it on a list of probe values (every digit-count boundary, negatives, huge ints, bools,
//! floats): the list's item array must hold exactly the items `PyList_GetItem` returns, and
//! every item must decode exactly as `PyLong_AsLongLong` reads it, or be reported "not fast"
//! where it must be. Any failed check leaves the reader off ([`IntLayout::Api`]) and every list
//! takes the C-API path; `_core._int_list_reader()` names the layout in use so that tests
//! notice. Setting `PAGEDKV_INT_LIST_READER=api` before import turns the direct reads off (the
//! tests run the list-versus-tuple comparisons that way too, so the C-API path is checked on
//! every platform).
//!
//! Why the reads are sound once the layout is proved: the GIL is held for the whole read
//! (`Bound` proves it) and no Python code runs during it (only exact `int`s are decoded, and
//! the per-item conversion is plain Rust), so no other thread can resize the list or free an
//! item; the items are borrowed from the list, which the caller holds. Only memory inside
//! objects of known size is read: the list's first `len` item slots, each int's header, and its
//! digits only as far as its own digit count says they exist (at most 2). Anything else (a
//! subclass, a bool, a negative, a 3-digit int, a value the caller refuses) stops the read and
//! the caller repeats the whole call on the checked path, so errors and their messages are the
//! checked path's.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::api;

/// The object layout the direct reader decodes, or `Api` when it is off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IntLayout {
    /// Direct reads are off: items are read through the C API.
    Api,
    /// CPython 3.10 and 3.11: `PyVarObject` whose `ob_size` is the signed digit count.
    SignedCount,
    /// CPython 3.12 to 3.14: `PyObject` then `lv_tag` (sign in bits 0-1, a flag in bit 2,
    /// the digit count from bit 3 up).
    Tagged,
}

impl IntLayout {
    /// The name `_core._int_list_reader()` reports.
    fn name(self) -> &'static str {
        match self {
            IntLayout::Api => "api",
            IntLayout::SignedCount => "cpython-3.10",
            IntLayout::Tagged => "cpython-3.12",
        }
    }
}

/// The layout proved at import (`Api` until then, or when the proof failed).
static LAYOUT: OnceLock<IntLayout> = OnceLock::new();

fn layout() -> IntLayout {
    LAYOUT.get().copied().unwrap_or(IntLayout::Api)
}

/// The header every object of a default (GIL) CPython build starts with, followed by the one
/// word that `list` (`ob_size`) and `int` (`ob_size` or `lv_tag`) both have next.
#[repr(C)]
struct VarHeader {
    ob_refcnt: isize,
    ob_type: *mut ffi::PyTypeObject,
    size_or_tag: isize,
}

/// `PyListObject`'s leading fields (`allocated` follows `ob_item`).
#[repr(C)]
struct ListHeader {
    head: VarHeader,
    ob_item: *mut *mut ffi::PyObject,
}

/// Where an int's digits start: right after the header word.
const DIGITS_OFFSET: usize = std::mem::size_of::<VarHeader>();
/// `sizeof(PyListObject)`: the header, `ob_item`, then `Py_ssize_t allocated`.
const LIST_BASIC_SIZE: usize = std::mem::size_of::<ListHeader>() + std::mem::size_of::<isize>();
/// Bits per CPython digit (`sys.int_info.bits_per_digit`), each stored in a `u32`.
const DIGIT_BITS: u32 = 30;
/// The largest value read directly, exclusive: two digits.
const FAST_LIMIT: u64 = 1 << (2 * DIGIT_BITS);

/// Decodes a non-negative int of at most two digits from its object memory.
trait Digits {
    /// The value of the exact `int` at `int`, when it is in `[0, 2**60)`; `None` otherwise.
    ///
    /// # Safety
    /// `int` is a live exact `int` under the layout this decoder was proved for, and the GIL is
    /// held.
    unsafe fn small_value(int: *const ffi::PyObject) -> Option<u64>;
}

/// The digits of an int with `count` (1 or 2) digits at `int`.
///
/// # Safety
/// `int` is a live int whose object holds at least `count` digits after its header.
#[inline(always)]
unsafe fn two_digit_value(int: *const ffi::PyObject, count: usize) -> u64 {
    // SAFETY: the digits start `DIGITS_OFFSET` bytes into the object (its basic size, proved
    // at import), inside the allocation, 4-byte aligned as the object is.
    let digits = unsafe { int.cast::<u8>().add(DIGITS_OFFSET) }.cast::<u32>();
    // SAFETY: the object holds at least one digit (the caller's contract).
    let low = u64::from(unsafe { digits.read() });
    if count == 2 {
        // SAFETY: it holds two when `count == 2`.
        low | u64::from(unsafe { digits.add(1).read() }) << DIGIT_BITS
    } else {
        low
    }
}

/// CPython 3.10 / 3.11: `ob_size` is the digit count, negative for negative values, 0 for 0.
struct SignedCount;

impl Digits for SignedCount {
    #[inline(always)]
    unsafe fn small_value(int: *const ffi::PyObject) -> Option<u64> {
        // SAFETY: `int` is a live int under this layout (the caller's contract): its header is
        // a `VarHeader`.
        let count = unsafe { (*int.cast::<VarHeader>()).size_or_tag };
        match count {
            0 => Some(0),
            // SAFETY: the object holds `count` digits.
            1 | 2 => Some(unsafe { two_digit_value(int, count as usize) }),
            _ => None,
        }
    }
}

/// CPython 3.12+: `lv_tag` holds the sign in bits 0-1 (0 positive, 1 zero, 2 negative), a
/// reserved flag in bit 2 and the digit count above.
struct Tagged;

impl Tagged {
    const SIGN_MASK: usize = 3;
    const SIGN_ZERO: usize = 1;
    const NON_SIZE_BITS: u32 = 3;
}

impl Digits for Tagged {
    #[inline(always)]
    unsafe fn small_value(int: *const ffi::PyObject) -> Option<u64> {
        // SAFETY: `int` is a live int under this layout (the caller's contract): its header is
        // a `VarHeader`.
        let tag = unsafe { (*int.cast::<VarHeader>()).size_or_tag } as usize;
        let sign = tag & Tagged::SIGN_MASK;
        if sign != 0 {
            return (sign == Tagged::SIGN_ZERO).then_some(0);
        }
        match tag >> Tagged::NON_SIZE_BITS {
            // SAFETY: the object holds `count` digits.
            count @ (1 | 2) => Some(unsafe { two_digit_value(int, count) }),
            _ => None,
        }
    }
}

/// The value of `item` when it is an exact `int` in `[0, 2**60)`.
///
/// # Safety
/// `item` is a live object and `D` was proved for the running interpreter (or is being probed
/// on objects whose expected values are known); the GIL is held.
#[inline(always)]
unsafe fn small_int<D: Digits>(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: every live object of a GIL build starts with the refcount and type words.
    if unsafe { (*item.cast::<VarHeader>()).ob_type } != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
        return None;
    }
    // SAFETY: `item` is a live exact `int` (its type was just checked) under layout `D`.
    unsafe { D::small_value(item) }
}

/// The first `len` item pointers of `list`, borrowed.
///
/// # Safety
/// The list layout was proved (or is being probed), `len` is the list's length and at least 1
/// (an empty list may have no item array), and the slice is dropped before any Python code
/// runs.
#[inline(always)]
unsafe fn list_items<'a>(list: &'a Bound<'_, PyList>, len: usize) -> &'a [*mut ffi::PyObject] {
    // SAFETY: the list layout was proved: a list object starts with a `ListHeader`.
    let items = unsafe { (*list.as_ptr().cast::<ListHeader>()).ob_item };
    // SAFETY: `ob_item` points at the list's `len` (>= 1) item slots, all initialized, which
    // no one changes while the GIL is held and no Python code runs (the caller's contract).
    unsafe { std::slice::from_raw_parts(items, len) }
}

/// A C-API reader in place of a direct one, for items the direct read refuses.
type Fallback = unsafe fn(*mut ffi::PyObject) -> Option<u64>;

/// No fallback: the direct read alone (what the layout proof checks).
///
/// # Safety
/// None needed; `unsafe` only to match [`Fallback`].
unsafe fn no_fallback(_: *mut ffi::PyObject) -> Option<u64> {
    None
}

/// The read loop for one layout: `out[i] = convert(items[i])` while every item qualifies,
/// each read directly or, when the direct read refuses it, by `fallback`. True when every slot
/// of `out` was written.
#[inline(always)]
fn fill_with<D: Digits, T>(
    items: &[*mut ffi::PyObject],
    out: &mut [MaybeUninit<T>],
    convert: impl Fn(u64) -> Option<T>,
    fallback: Fallback,
) -> bool {
    if items.len() != out.len() {
        return false;
    }
    for (slot, &item) in out.iter_mut().zip(items) {
        // SAFETY: `item` is a live item of a list the caller holds, under the GIL, and `D` is
        // the proved layout (or the one being probed); `fallback` needs no more than that.
        let value = unsafe { small_int::<D>(item).or_else(|| fallback(item)) };
        let Some(value) = value.and_then(&convert) else {
            return false;
        };
        slot.write(value);
    }
    true
}

/// [`fill_with`] over `list`'s items for the proved layout, the C API reading the items the
/// direct read refuses; `None` when no layout was proved (the caller reads through the C API).
///
/// # Safety
/// `out.len()` is `list.len()` and at least 1.
#[inline(always)]
pub(super) unsafe fn fill<T>(
    list: &Bound<'_, PyList>,
    out: &mut [MaybeUninit<T>],
    convert: impl Fn(u64) -> Option<T>,
) -> Option<bool> {
    let layout = layout();
    if layout == IntLayout::Api {
        return None;
    }
    let len = out.len();
    debug_assert!(len >= 1 && len == list.len());
    // SAFETY: the layout was proved at import, `len` is the list's length (>= 1: the caller's
    // contract), and the slice lives only through the loop, which runs no Python code.
    let items = unsafe { list_items(list, len) };
    Some(match layout {
        IntLayout::SignedCount => fill_with::<SignedCount, T>(items, out, convert, api::int_value),
        IntLayout::Tagged => fill_with::<Tagged, T>(items, out, convert, api::int_value),
        IntLayout::Api => false,
    })
}

/// The value of `obj` read in place when it is an exact `int` in `[0, 2**60)` and a layout was
/// proved; `None` otherwise (the caller asks the C API).
#[inline(always)]
pub(super) fn exact_int_value(obj: &Bound<'_, PyAny>) -> Option<u64> {
    let item = obj.as_ptr();
    // SAFETY: `obj` is live and the GIL held (`Bound` proves both); the layout was proved.
    unsafe {
        match layout() {
            IntLayout::SignedCount => small_int::<SignedCount>(item),
            IntLayout::Tagged => small_int::<Tagged>(item),
            IntLayout::Api => None,
        }
    }
}

/// The probe values: every digit-count boundary on both sides, negatives, values past 2**60
/// and 2**64, ints made by parsing and by arithmetic, and non-ints with int-like layouts.
const PROBE: &std::ffi::CStr = c"[0, 1, 7, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**32 - 1, 2**32, \
2**32 + 5, 2**59, 2**60 - 1, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, \
int('2000000000'), 2000000000 + 1323, (2**30 - 1) * (2**30 + 1), 255, 256, 1000003, \
-1, -7, -(2**30), -(2**30) + 1, -(2**60), -(2**62), -(10**30), True, False, 1.0, None, 'x']";

/// The layout the running interpreter should have, before any probe; `Err(why)` when none is
/// known to fit (the reader then stays off; `why` documents each refusal).
fn candidate(py: Python<'_>) -> PyResult<Result<IntLayout, &'static str>> {
    let sys = py.import("sys")?;
    let name: String = sys.getattr("implementation")?.getattr("name")?.extract()?;
    if name != "cpython" {
        return Ok(Err("not CPython"));
    }
    let version = sys.getattr("version_info")?;
    let major: u32 = version.getattr("major")?.extract()?;
    let minor: u32 = version.getattr("minor")?.extract()?;
    let layout = match (major, minor) {
        (3, 10 | 11) => IntLayout::SignedCount,
        (3, 12..=14) => IntLayout::Tagged,
        _ => return Ok(Err("unknown CPython version")),
    };
    if sys.hasattr("_is_gil_enabled")? && !sys.call_method0("_is_gil_enabled")?.extract::<bool>()? {
        return Ok(Err("free-threaded interpreter"));
    }
    let int_info = sys.getattr("int_info")?;
    let bits: u32 = int_info.getattr("bits_per_digit")?.extract()?;
    let digit_size: usize = int_info.getattr("sizeof_digit")?.extract()?;
    if bits != DIGIT_BITS || digit_size != std::mem::size_of::<u32>() {
        return Ok(Err("not 30-bit digits in 4 bytes"));
    }
    let builtins = py.import("builtins")?;
    let basic_size = |name: &str| -> PyResult<usize> {
        builtins.getattr(name)?.getattr("__basicsize__")?.extract()
    };
    let int_item_size: usize = builtins
        .getattr("int")?
        .getattr("__itemsize__")?
        .extract()?;
    if basic_size("int")? != DIGITS_OFFSET || int_item_size != std::mem::size_of::<u32>() {
        return Ok(Err("int object size differs"));
    }
    if basic_size("list")? != LIST_BASIC_SIZE {
        return Ok(Err("list object size differs"));
    }
    Ok(Ok(layout))
}

/// What `PyLong_AsLongLong` reads from `item`, kept only where the direct reader must read it
/// (an exact `int` in `[0, 2**60)`); `None` where it must say "not fast".
fn expected_value(item: &Bound<'_, PyAny>) -> Option<u64> {
    if !item.is_exact_instance_of::<pyo3::types::PyInt>() {
        return None;
    }
    // SAFETY: GIL held; an exact int's conversion runs no Python code; an overflow error is
    // cleared right away.
    let value = unsafe { ffi::PyLong_AsLongLong(item.as_ptr()) };
    // SAFETY: GIL held; reading the error indicator has no other precondition.
    if value == -1 && unsafe { !ffi::PyErr_Occurred().is_null() } {
        // SAFETY: GIL held; clears the overflow error just raised.
        unsafe { ffi::PyErr_Clear() };
        return None;
    }
    u64::try_from(value).ok().filter(|&v| v < FAST_LIMIT)
}

/// Proves `D` on the probe list: the item array is the list's items, each item decodes to its
/// expected value, and the production loop reads the fast items' list exactly.
fn prove<D: Digits>(py: Python<'_>) -> PyResult<Result<(), &'static str>> {
    let probe = py.eval(PROBE, None, None)?;
    let list = probe.cast::<PyList>()?;
    let len = list.len();
    // SAFETY: the list header is only read here and compared with the C API's answers; the
    // item pointers are not dereferenced until every one is known to be the list's own item.
    if unsafe { (*list.as_ptr().cast::<VarHeader>()).size_or_tag } != len as isize {
        return Ok(Err("list ob_size differs"));
    }
    // SAFETY: as above: `len >= 1`, no Python code runs while `items` lives.
    let items = unsafe { list_items(list, len) }.to_vec();
    let mut fast = Vec::new();
    for (index, &item) in items.iter().enumerate() {
        // SAFETY: GIL held, `index < len`; a borrowed reference, compared only.
        let api_item = unsafe { ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t) };
        if api_item.is_null() || api_item != item {
            return Ok(Err("list item array differs"));
        }
        let expected = expected_value(&list.get_item(index)?);
        // SAFETY: `item` is the list's own live item (checked above), GIL held.
        if unsafe { small_int::<D>(item) } != expected {
            return Ok(Err("an int decodes differently"));
        }
        fast.extend(expected);
    }
    // The production loop, over a list of the fast values only and over the whole probe list
    // (which it must refuse).
    let fast_list = PyList::new(py, &fast)?;
    let mut read = vec![MaybeUninit::new(u64::MAX); fast.len()];
    // SAFETY: as above, for `fast_list` (not empty: the probe has fast values).
    let fast_items = unsafe { list_items(&fast_list, fast.len()) };
    let read_ok = fill_with::<D, u64>(fast_items, &mut read, Some, no_fallback);
    // SAFETY: every slot was initialized (to `u64::MAX`) before the loop overwrote some.
    if !read_ok
        || read
            .iter()
            // SAFETY: every slot was initialized (to `u64::MAX`) before the loop.
            .map(|v| unsafe { v.assume_init() })
            .ne(fast.iter().copied())
    {
        return Ok(Err("the list loop reads differently"));
    }
    let mut all = vec![MaybeUninit::new(0_u64); len];
    if fill_with::<D, u64>(&items, &mut all, Some, no_fallback) {
        return Ok(Err("the list loop accepts a value it must refuse"));
    }
    Ok(Ok(()))
}

/// Picks and proves the layout for the running interpreter; `Api` when anything fails (a
/// Python error during the probe included: it is dropped, the reader simply stays off).
fn select(py: Python<'_>) -> IntLayout {
    if std::env::var_os("PAGEDKV_INT_LIST_READER").is_some_and(|v| v == "api") {
        return IntLayout::Api;
    }
    let proved = candidate(py).and_then(|candidate| {
        let Ok(layout) = candidate else {
            return Ok(IntLayout::Api);
        };
        let proof = match layout {
            IntLayout::SignedCount => prove::<SignedCount>(py)?,
            IntLayout::Tagged => prove::<Tagged>(py)?,
            IntLayout::Api => Err("off"),
        };
        Ok(if proof.is_ok() {
            layout
        } else {
            IntLayout::Api
        })
    });
    proved.unwrap_or(IntLayout::Api)
}

/// Proves the layout for the running interpreter, once per process (the module's import).
pub(super) fn prove_layout(py: Python<'_>) {
    LAYOUT.get_or_init(|| select(py));
}

/// The name of the layout in use: `'cpython-3.10'`, `'cpython-3.12'`, or `'api'` when none was
/// proved or the reader was turned off.
pub(super) fn layout_name() -> &'static str {
    layout().name()
}
