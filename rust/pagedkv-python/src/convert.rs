//! Argument conversion: Python values -> core types.
//!
//! Every malformed value (wrong type, float, bool, negative, out of range, 2-D array) becomes an
//! `InvalidArgumentError`, never a bare `TypeError`/`OverflowError`: the contract treats wrong
//! argument types as malformed input. PyO3 adds a note naming the argument.
//!
//! The single-token append path is the hot one, so exact `int`s below 2**60 are read in place
//! (`int_list`, layout proved at import), others with one C call, and short token lists land in
//! a stack buffer (no heap allocation per call). Lists of ids take the same in-place reader.

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::type_object::PyTypeInfo;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::sync::OnceLock;

use crate::errors::invalid_argument;
use crate::int_list;

/// Whether an error raised by the caller's own code (an `__index__`, `__bool__` or `__str__`)
/// must reach the caller unchanged instead of becoming an `InvalidArgumentError`: a
/// `BaseException` that is not an `Exception` (`KeyboardInterrupt`, `SystemExit`,
/// `GeneratorExit`) or a `MemoryError`. Turning Ctrl-C into "malformed input" would swallow it.
pub fn must_propagate(py: Python<'_>, err: &PyErr) -> bool {
    !err.is_instance_of::<PyException>(py) || err.is_instance_of::<PyMemoryError>(py)
}

/// `err` with the note PyO3 adds to a failed argument conversion ("while processing 'name'"),
/// for arguments converted inside the method (whose bounds depend on the manager).
pub fn with_arg_note(py: Python<'_>, name: &str, err: PyErr) -> PyErr {
    let _ = err
        .value(py)
        .call_method1("add_note", (format!("while processing '{name}'"),));
    err
}

/// `err` itself when it must propagate (see [`must_propagate`]), else `replacement()`.
pub fn or_invalid(py: Python<'_>, err: PyErr, replacement: impl FnOnce() -> PyErr) -> PyErr {
    if must_propagate(py, &err) {
        err
    } else {
        replacement()
    }
}

/// Bytes of physical memory (read once), where the platform says; `None` elsewhere.
fn physical_memory_bytes() -> Option<usize> {
    static BYTES: OnceLock<Option<usize>> = OnceLock::new();
    *BYTES.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: `sysconf` has no preconditions; it returns -1 for an unknown name.
            let (pages, page_bytes) = unsafe {
                (
                    libc::sysconf(libc::_SC_PHYS_PAGES),
                    libc::sysconf(libc::_SC_PAGESIZE),
                )
            };
            if pages > 0 && page_bytes > 0 {
                return usize::try_from(pages)
                    .ok()?
                    .checked_mul(usize::try_from(page_bytes).ok()?);
            }
        }
        None
    })
}

/// An empty vector with room for `len` items, or a `MemoryError` when that much memory cannot
/// be had (never an abort: `Vec::with_capacity` aborts the process on allocation failure).
/// More bytes than the machine's physical memory are refused before asking the allocator: an
/// allocator that reserves address space without committing it (mimalloc, or any under
/// `vm.overcommit_memory = 1`) would grant them, and filling them would end in the kernel's
/// OOM kill instead of an error. (`_py`: the GIL is held, so the error can be built right away.)
pub fn try_vec<T>(_py: Python<'_>, len: usize, what: &str) -> PyResult<Vec<T>> {
    let item_bytes = std::mem::size_of::<T>();
    let refuse = |why: String| {
        PyMemoryError::new_err(format!(
            "cannot allocate {what}: {len} items of {item_bytes} bytes{why}"
        ))
    };
    let bytes = len.checked_mul(item_bytes);
    if let (Some(bytes), Some(memory)) = (bytes, physical_memory_bytes()) {
        if bytes > memory {
            return Err(refuse(format!(
                " ({bytes} bytes, more than the machine's {memory} bytes of memory)"
            )));
        }
    }
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| refuse(String::new()))?;
    Ok(out)
}

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "object".to_owned())
}

/// Reads a non-negative integer that fits in `u64`. Accepts `int` and objects with `__index__`
/// (NumPy integer scalars); rejects `bool` and `float` explicitly.
#[inline]
fn extract_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Some(value) = exact_int_as_u63(obj) {
            return Ok(value);
        }
        if let Ok(value) = obj.extract::<u64>() {
            return Ok(value);
        }
        return Err(invalid_argument(
            obj.py(),
            format!("{what} must be an int in [0, 2**64), got {}", repr(obj)),
        ));
    }
    extract_u64_slow(obj, what)
}

/// An exact `int` in `[0, 2**63)`: read in place below 2**60 ([`int_list`]), else with one C
/// call that needs no error check on success
/// (`PyLong_AsLongAndOverflow` flags out-of-range values instead of raising); `None` for
/// anything else (negative, huge, or -1 with an error set), which the caller re-checks.
#[inline]
fn exact_int_as_u63(obj: &Bound<'_, PyAny>) -> Option<u64> {
    if let Some(value) = int_list::small_exact_int(obj) {
        return Some(value);
    }
    let mut overflow: std::os::raw::c_int = 0;
    // SAFETY: `obj` proves the GIL is held and is an exact `int`, so the conversion runs no
    // Python code. A -1 result may carry an error; it is left to the checked path, which
    // re-reads the value and either succeeds or replaces the error.
    let value = unsafe { ffi::PyLong_AsLongAndOverflow(obj.as_ptr(), &mut overflow) };
    if overflow != 0 || value < 0 {
        if value == -1 {
            // SAFETY: GIL held (see above); clearing a pending error is always allowed.
            unsafe { ffi::PyErr_Clear() };
        }
        return None;
    }
    // `c_long` is 32-bit on Windows: widen explicitly.
    #[allow(clippy::useless_conversion)]
    u64::try_from(i64::from(value)).ok()
}

#[cold]
fn extract_u64_slow(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(invalid_argument(
            py,
            format!("{what} must be an int, got {}", type_name(obj)),
        ));
    }
    obj.extract::<u64>().map_err(|err| {
        or_invalid(py, err, || {
            invalid_argument(
                py,
                format!(
                    "{what} must be an int in [0, 2**64), got {} {}",
                    type_name(obj),
                    repr(obj)
                ),
            )
        })
    })
}

fn repr(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".to_owned());
    if text.len() > 80 {
        format!(
            "{}...",
            &text[..text.char_indices().nth(77).map_or(text.len(), |(i, _)| i)]
        )
    } else {
        text
    }
}

/// Reads a token id: an int in `[0, 2**32)`.
#[inline]
fn extract_token(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Some(value) = exact_int_as_u63(obj).and_then(|v| u32::try_from(v).ok()) {
            return Ok(value);
        }
    }
    extract_token_slow(obj)
}

#[cold]
fn extract_token_slow(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let py = obj.py();
    let out_of_range = || {
        invalid_argument(
            py,
            format!(
                "token id must be an int in [0, 2**32), got {} {}",
                type_name(obj),
                repr(obj)
            ),
        )
    };
    match extract_u64(obj, "token id") {
        Ok(value) => u32::try_from(value).map_err(|_| out_of_range()),
        // Propagated errors and the bool/float refusal keep their own message.
        Err(err)
            if must_propagate(py, &err)
                || obj.is_instance_of::<PyBool>()
                || obj.is_instance_of::<PyFloat>() =>
        {
            Err(err)
        }
        Err(_) => Err(out_of_range()),
    }
}

/// `obj` (already known to be exactly `numpy.ndarray`) borrowed read-only as a C-contiguous 1-D
/// array of `T`, after its length is checked against `max_len`; `None` when its dtype is not
/// `T` or it is not contiguous (the general path then reads or refuses it).
fn contiguous_tokens<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    max_len: usize,
    why: &str,
) -> PyResult<Option<PyReadonlyArray1<'py, T>>> {
    let py = obj.py();
    let Ok(array) = obj.cast::<PyArray1<T>>() else {
        return Ok(None);
    };
    if !array.is_contiguous() {
        return Ok(None);
    }
    check_len(py, "token_ids", array.len(), max_len, why)?;
    let readonly = array
        .try_readonly()
        .map_err(|e| invalid_argument(py, format!("token_ids: {e}")))?;
    Ok(readonly.as_slice().is_ok().then_some(readonly))
}

/// Item `index` of `list` as a C long, when it is an exact `int` that fits one; `None`
/// otherwise (the caller then takes the checked path, which reports the error). Reads a
/// borrowed reference: no refcount traffic, which costs a function call per item under the
/// stable ABI.
///
/// # Safety
/// The GIL is held (`list` proves it), `index < list.len()`, and no Python code has run since
/// the length was read: nothing here runs any (only exact ints are read, and their conversion
/// cannot call back into Python), so the item stays alive, owned by the list. A failed
/// conversion's error is cleared here.
#[inline(always)]
unsafe fn exact_int_item(list: &Bound<'_, PyList>, index: usize) -> Option<std::os::raw::c_long> {
    let item = ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t);
    if item.is_null() {
        ffi::PyErr_Clear();
        return None;
    }
    if ffi::PyLong_CheckExact(item) == 0 {
        return None;
    }
    let mut overflow: std::os::raw::c_int = 0;
    let value = ffi::PyLong_AsLongAndOverflow(item, &mut overflow);
    (overflow == 0).then_some(value)
}

/// The prompt path of [`read_exact_int_list`]: fills `out` (exactly the list's length) with
/// the list's items, each an exact `int` in `[0, 2**32)`, storing into the pre-sized buffer
/// without a per-item callback or capacity check (callgrind, a 1,324-token list: 74 K -> 72 K
/// instructions per call; an appending loop measured 77 K). Returns false as soon as an item
/// does not qualify (the caller then takes the checked path, which reports the error).
fn read_token_list(list: &Bound<'_, PyList>, out: &mut [u32]) -> bool {
    if list.len() != out.len() {
        return false;
    }
    for (index, slot) in out.iter_mut().enumerate() {
        // SAFETY: `index < len` (checked above) and no Python code runs in this loop.
        let Some(value) = (unsafe { exact_int_item(list, index) }) else {
            return false;
        };
        // `c_long` is 32-bit on Windows: widen explicitly.
        #[allow(clippy::useless_conversion)]
        match u32::try_from(i64::from(value)) {
            Ok(id) => *slot = id,
            Err(_) => return false,
        }
    }
    true
}

/// Fast path for a list of exact `int`s: reads each item as a borrowed reference (no refcount
/// traffic, which costs a function call per item under the stable ABI) and hands `(index,
/// value)` to `sink`. Returns false as soon as an item is not an exact `int`, does not fit a C
/// long, or `sink` rejects it; the caller then takes the checked path, which reports the error.
#[inline]
fn read_exact_int_list(list: &Bound<'_, PyList>, mut sink: impl FnMut(usize, i64) -> bool) -> bool {
    let len = list.len();
    for index in 0..len {
        // SAFETY: `index < len`, and nothing in this loop runs Python code, so no other
        // thread can mutate the list meanwhile.
        let Some(value) = (unsafe { exact_int_item(list, index) }) else {
            return false;
        };
        // `c_long` is 32-bit on Windows: widen explicitly.
        #[allow(clippy::useless_conversion)]
        let value = i64::from(value);
        if !sink(index, value) {
            return false;
        }
    }
    true
}

/// A sequence id (`u64`).
#[derive(Clone, Copy, Debug)]
pub struct SeqIdArg(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for SeqIdArg {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        extract_u64(&obj, "sequence id").map(SeqIdArg)
    }
}

/// A count of tokens or blocks (`usize`, non-negative).
#[derive(Clone, Copy, Debug)]
pub struct CountArg(pub usize);

impl<'a, 'py> FromPyObject<'a, 'py> for CountArg {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let value = extract_u64(&obj, "count")?;
        usize::try_from(value)
            .map(CountArg)
            .map_err(|_| invalid_argument(obj.py(), format!("count {value} is too large")))
    }
}

/// A 64-bit hash seed.
#[derive(Clone, Copy, Debug)]
pub struct SeedArg(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for SeedArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        extract_u64(&obj, "hash_seed").map(SeedArg)
    }
}

/// A switch: `bool` (or a NumPy bool) only, so that `1` or `"yes"` are not silently taken.
#[derive(Clone, Copy, Debug)]
pub struct FlagArg(pub bool);

impl<'a, 'py> FromPyObject<'a, 'py> for FlagArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.extract::<bool>().map(FlagArg).map_err(|_| {
            invalid_argument(
                obj.py(),
                format!("expected a bool, got {}", type_name(&obj)),
            )
        })
    }
}

/// A physical block id (`u32`).
#[derive(Clone, Copy, Debug)]
pub struct BlockIdArg(pub u32);

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIdArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let value = extract_u64(&obj, "block id")?;
        u32::try_from(value)
            .map(BlockIdArg)
            .map_err(|_| invalid_argument(obj.py(), format!("block id {value} is out of range")))
    }
}

/// Token lists up to this length are read into a stack buffer. Kept small: the buffer is
/// zeroed and moved through PyO3's argument plumbing on every call, which for 32 slots cost
/// more than the single-token conversion itself.
const INLINE_TOKENS: usize = 8;

/// Refuses a batch of `len` items when more than `max_len` could never succeed, before
/// anything is read or allocated: a zero-stride NumPy view reports any length (`1 << 40`)
/// without owning memory for it.
fn check_len(py: Python<'_>, name: &str, len: usize, max_len: usize, why: &str) -> PyResult<()> {
    if len > max_len {
        return Err(invalid_argument(
            py,
            format!("{name} has {len} items, more than {max_len}: {why}"),
        ));
    }
    Ok(())
}

/// Token ids, from a list or tuple of ints or a 1-D NumPy integer array `[num_tokens]`.
/// Lazy iterables (`range`, generators) are refused: their length is unbounded by memory, so
/// materializing one could exhaust it before any validation. A contiguous native `uint32` or
/// `int32` array is read in place (no copy; a prompt's ids are hashed straight from it).
pub enum TokenIds<'py> {
    Inline {
        len: usize,
        ids: [u32; INLINE_TOKENS],
    },
    Heap(Vec<u32>),
    /// A C-contiguous native `uint32` array, borrowed read-only.
    U32(PyReadonlyArray1<'py, u32>),
    /// A C-contiguous native `int32` array whose values were all checked non-negative,
    /// borrowed read-only.
    I32(PyReadonlyArray1<'py, i32>),
}

impl TokenIds<'_> {
    pub fn as_slice(&self) -> &[u32] {
        match self {
            TokenIds::Inline { len, ids } => &ids[..*len],
            TokenIds::Heap(ids) => ids,
            // Contiguity was checked when the borrow was taken and cannot change while it is
            // held (the GIL is held and no Python code runs).
            TokenIds::U32(array) => array.as_slice().unwrap_or_default(),
            TokenIds::I32(array) => {
                let values = array.as_slice().unwrap_or_default();
                // SAFETY: `i32` and `u32` have the same size and alignment, every bit pattern
                // is valid for both, and the values were checked non-negative, so each reads
                // as the same number. The slice borrows `array`, which outlives it.
                unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u32>(), values.len()) }
            }
        }
    }

    /// The fast NumPy paths: exactly `numpy.ndarray`, 1-D, C-contiguous, native byte order;
    /// `uint32` and non-negative `int32` are borrowed, `int64` is narrowed in one checked pass.
    /// `None`: any other array (the general path reads or refuses it).
    fn from_native_array<'py>(
        obj: &Bound<'py, PyAny>,
        max_len: usize,
        why: &str,
    ) -> PyResult<Option<TokenIds<'py>>> {
        let py = obj.py();
        if obj.get_type().as_ptr() != PyUntypedArray::type_object_raw(py).cast::<ffi::PyObject>() {
            return Ok(None);
        }
        let out_of_range = |value: i64| {
            invalid_argument(
                py,
                format!("token id must be an int in [0, 2**32), got {value}"),
            )
        };
        if let Some(ids) = contiguous_tokens::<u32>(obj, max_len, why)? {
            return Ok(Some(TokenIds::U32(ids)));
        }
        if let Some(ids) = contiguous_tokens::<i32>(obj, max_len, why)? {
            if let Some(&bad) = ids.as_slice()?.iter().find(|&&v| v < 0) {
                return Err(out_of_range(i64::from(bad)));
            }
            return Ok(Some(TokenIds::I32(ids)));
        }
        if let Some(values) = contiguous_tokens::<i64>(obj, max_len, why)? {
            let values = values.as_slice()?;
            let mut ids = try_vec(py, values.len(), "token_ids")?;
            for &v in values {
                ids.push(u32::try_from(v).map_err(|_| out_of_range(v))?);
            }
            return Ok(Some(TokenIds::Heap(ids)));
        }
        Ok(None)
    }

    /// The fast path: a list of exact ints, each in `[0, 2**32)`, read directly from the
    /// objects' memory when the layout was proved ([`int_list`]), else through the C API.
    #[inline]
    fn from_exact_int_list(list: &Bound<'_, PyList>) -> PyResult<Option<Self>> {
        let len = list.len();
        let token = |value: u64| u32::try_from(value).ok();
        if len <= INLINE_TOKENS {
            let mut ids = [0_u32; INLINE_TOKENS];
            if int_list::fill_from_list(list, &mut ids[..len], token) {
                return Ok(Some(TokenIds::Inline { len, ids }));
            }
        } else {
            let mut ids = try_vec(list.py(), len, "token_ids")?;
            if int_list::extend_from_list(list, &mut ids, token) {
                return Ok(Some(TokenIds::Heap(ids)));
            }
            ids.resize(len, 0);
            return Ok(read_token_list(list, &mut ids).then_some(TokenIds::Heap(ids)));
        }
        let in_range = |value: i64| u32::try_from(value).ok();
        if len == 1 {
            // The decode step's `[token]`: skip the buffer loop and its closure.
            let mut single = None;
            let ok = read_exact_int_list(list, |_, value| {
                single = in_range(value);
                single.is_some()
            });
            let Some(id) = single.filter(|_| ok) else {
                return Ok(None);
            };
            let mut ids = [0_u32; INLINE_TOKENS];
            ids[0] = id;
            return Ok(Some(TokenIds::Inline { len: 1, ids }));
        }
        let mut ids = [0_u32; INLINE_TOKENS];
        let ok = read_exact_int_list(list, |index, value| {
            match (ids.get_mut(index), in_range(value)) {
                (Some(slot), Some(id)) => {
                    *slot = id;
                    true
                }
                _ => false,
            }
        });
        Ok(ok.then_some(TokenIds::Inline { len, ids }))
    }

    fn from_items<'py>(
        py: Python<'py>,
        len: usize,
        items: impl Iterator<Item = Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        if len <= INLINE_TOKENS {
            let mut ids = [0_u32; INLINE_TOKENS];
            let mut count = 0;
            for (slot, item) in ids.iter_mut().zip(items) {
                *slot = extract_token(&item)?;
                count += 1;
            }
            Ok(TokenIds::Inline { len: count, ids })
        } else {
            let mut ids = try_vec(py, len, "token_ids")?;
            for item in items {
                ids.push(extract_token(&item)?);
            }
            Ok(TokenIds::Heap(ids))
        }
    }

    /// Reads `obj` as token ids, refusing more than `max_len` (what the pool could ever hold)
    /// before reading or allocating anything.
    #[inline]
    pub fn extract_bounded<'py>(
        obj: &Bound<'py, PyAny>,
        max_len: usize,
    ) -> PyResult<TokenIds<'py>> {
        const WHY: &str = "more tokens than the pool could ever hold";
        let py = obj.py();
        if let Ok(list) = obj.cast::<PyList>() {
            check_len(py, "token_ids", list.len(), max_len, WHY)?;
            if let Some(ids) = TokenIds::from_exact_int_list(list)? {
                return Ok(ids);
            }
            return TokenIds::from_items(py, list.len(), list.iter());
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            check_len(py, "token_ids", tuple.len(), max_len, WHY)?;
            return TokenIds::from_items(py, tuple.len(), tuple.iter());
        }
        if obj.is_instance_of::<PyUntypedArray>() {
            if let Some(ids) = TokenIds::from_native_array(obj, max_len, WHY)? {
                return Ok(ids);
            }
            return integer_array(obj, "token_ids", max_len, WHY, |value, py| {
                u32::try_from(value).map_err(|_| {
                    invalid_argument(
                        py,
                        format!("token id must be an int in [0, 2**32), got {value}"),
                    )
                })
            })
            .map(TokenIds::Heap);
        }
        Err(invalid_argument(
            py,
            format!(
                "token_ids must be a list or tuple of ints or a 1-D integer NumPy array, got {}",
                type_name(obj)
            ),
        ))
    }
}

/// Why a sequence-id batch longer than the live sequences is refused unread.
const SEQ_BATCH_WHY: &str =
    "more ids than live sequences (a batch names each live sequence at most once)";

/// Sequence ids from a list or tuple of ints or a 1-D NumPy integer array `[B]`; `None` when
/// `obj` is none of these. `max_len` bounds the length before anything is read (a batch never
/// names more distinct live sequences than exist).
fn seq_id_list(obj: &Bound<'_, PyAny>, max_len: usize) -> Option<PyResult<Vec<u64>>> {
    let py = obj.py();
    let collect = |len: usize, items: &mut dyn Iterator<Item = Bound<'_, PyAny>>| {
        check_len(py, "seq_ids", len, max_len, SEQ_BATCH_WHY)?;
        let mut ids = try_vec(py, len, "seq_ids")?;
        for item in items {
            ids.push(extract_u64(&item, "sequence id")?);
        }
        Ok(ids)
    };
    if let Ok(list) = obj.cast::<PyList>() {
        if list.len() > max_len {
            return Some(collect(list.len(), &mut std::iter::empty()));
        }
        let mut ids = match try_vec(py, list.len(), "seq_ids") {
            Ok(ids) => ids,
            Err(err) => return Some(Err(err)),
        };
        if int_list::extend_from_list(list, &mut ids, Some) {
            return Some(Ok(ids));
        }
        let fast = read_exact_int_list(list, |_, value| match u64::try_from(value) {
            Ok(id) => {
                ids.push(id);
                true
            }
            Err(_) => false,
        });
        if fast {
            return Some(Ok(ids));
        }
        return Some(collect(list.len(), &mut list.iter()));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Some(collect(tuple.len(), &mut tuple.iter()));
    }
    if obj.is_instance_of::<PyUntypedArray>() {
        return Some(integer_array(
            obj,
            "seq_ids",
            max_len,
            SEQ_BATCH_WHY,
            |value, py| {
                u64::try_from(value).map_err(|_| {
                    invalid_argument(
                        py,
                        format!("sequence id must be in [0, 2**64), got {value}"),
                    )
                })
            },
        ));
    }
    None
}

/// The length of a list, tuple or NumPy array `obj` (0 for anything else, which is refused
/// later); reads no item.
pub fn batch_len(obj: &Bound<'_, PyAny>) -> usize {
    if let Ok(list) = obj.cast::<PyList>() {
        return list.len();
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.len();
    }
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return array.shape().first().copied().unwrap_or(0);
    }
    0
}

/// Sequence ids (`[B]`), read with [`SeqIds::extract_bounded`].
pub struct SeqIds(pub Vec<u64>);

impl SeqIds {
    /// Reads a batch of at most `max_len` ids (refused unread when longer).
    pub fn extract_bounded(obj: &Bound<'_, PyAny>, max_len: usize) -> PyResult<Self> {
        match seq_id_list(obj, max_len) {
            Some(ids) => ids.map(SeqIds),
            None => Err(invalid_argument(
                obj.py(),
                format!(
                    "seq_ids must be a list or tuple of ints or a 1-D integer NumPy array, got {}",
                    type_name(obj)
                ),
            )),
        }
    }

    /// One sequence id or several (a fork group), as `swap_out` / `swap_in` accept.
    pub fn extract_one_or_many(obj: &Bound<'_, PyAny>, max_len: usize) -> PyResult<Self> {
        if let Some(ids) = seq_id_list(obj, max_len) {
            return ids.map(SeqIds);
        }
        extract_u64(obj, "sequence id").map(|id| SeqIds(vec![id]))
    }
}

/// The namespace key mixed into block hashes: `str` (hashed as UTF-8), `bytes`, or an integer
/// (`int` or a NumPy integer scalar, hashed as its decimal text, so `5`, `np.int64(5)` and
/// `"5"` name the same namespace).
pub struct ExtraKey(pub Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for ExtraKey {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        // Both conversions below can fail on values of the right type (a str holding a lone
        // surrogate is not UTF-8; an int beyond `sys.get_int_max_str_digits()` has no decimal
        // text): that is malformed input too, not a UnicodeEncodeError / bare ValueError.
        if let Ok(text) = obj.cast::<PyString>() {
            return text
                .to_str()
                .map(|s| ExtraKey(s.as_bytes().to_vec()))
                .map_err(|e| {
                    invalid_argument(py, format!("extra_key str is not valid UTF-8: {e}"))
                });
        }
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            return Ok(ExtraKey(bytes.as_bytes().to_vec()));
        }
        let integer = if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
            Some(obj.to_owned())
        } else if is_numpy_integer(&obj)? {
            // `int(np.int64(5))`: the same decimal text as the Python int.
            Some(obj.call_method0("__index__").map_err(|e| {
                or_invalid(py, e, || {
                    invalid_argument(py, "extra_key: __index__ failed".into())
                })
            })?)
        } else {
            None
        };
        if let Some(integer) = integer {
            return integer
                .str()
                .map(|text| ExtraKey(text.to_string().into_bytes()))
                .map_err(|e| {
                    or_invalid(py, e, || {
                        invalid_argument(py, "extra_key int has no decimal text".to_owned())
                    })
                });
        }
        Err(invalid_argument(
            py,
            format!(
                "extra_key must be str, bytes or int, got {}",
                type_name(&obj)
            ),
        ))
    }
}

/// Refuses a `numpy.ma.MaskedArray`: its masked entries hold arbitrary data that the mask
/// says to ignore, and reading the raw buffer would use them silently. Other subclasses
/// (`memmap`, ...) are read through their base-class buffer.
fn refuse_masked(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<()> {
    let py = obj.py();
    if obj.get_type().as_ptr() == PyUntypedArray::type_object_raw(py).cast::<ffi::PyObject>() {
        return Ok(()); // exactly `numpy.ndarray`: the common case needs no import
    }
    let masked = py.import("numpy.ma")?.getattr("MaskedArray")?;
    if obj.is_instance(&masked)? {
        return Err(invalid_argument(
            py,
            format!("{name} is a masked array: pass a plain ndarray (masked entries have no defined value)"),
        ));
    }
    Ok(())
}

/// Whether `obj` is a NumPy integer scalar (`np.integer`; `np.bool_` is not one).
fn is_numpy_integer(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let numpy = py.import("numpy")?;
    obj.is_instance(&numpy.getattr("integer")?)
}

/// Reads a 1-D NumPy integer array (any integer dtype, either byte order, any strides) of at
/// most `max_len` items through `convert`; a longer one is refused before anything is read.
fn integer_array<T>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    max_len: usize,
    why: &str,
    convert: impl Fn(i128, Python<'_>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let py = obj.py();
    let array = obj
        .cast::<PyUntypedArray>()
        .map_err(|e| invalid_argument(py, e.to_string()))?;
    if array.ndim() != 1 {
        return Err(invalid_argument(
            py,
            format!("{name} must be a 1-D array, got shape {:?}", array.shape()),
        ));
    }
    refuse_masked(obj, name)?;
    let dtype = array.dtype();
    let kind = dtype.kind();
    if kind != b'i' && kind != b'u' {
        return Err(invalid_argument(
            py,
            format!("{name} must have an integer dtype, got {dtype}"),
        ));
    }
    check_len(py, name, array.len(), max_len, why)?;
    if !dtype.is_native_byteorder().unwrap_or(true) {
        // A big-endian array on a little-endian host (or the reverse): read a native copy,
        // whose size the check above bounds.
        let native = dtype.call_method1("newbyteorder", ("=",))?;
        let copy = obj.call_method1("astype", (native,))?;
        return integer_array(&copy, name, max_len, why, convert);
    }
    macro_rules! try_dtype {
        ($($ty:ty),*) => {$(
            if let Ok(typed) = obj.cast::<PyArray1<$ty>>() {
                let readonly = typed
                    .try_readonly()
                    .map_err(|e| invalid_argument(py, format!("{name}: {e}")))?;
                let view = readonly.as_array();
                let mut out = try_vec(py, view.len(), name)?;
                // A contiguous array (the usual case) reads as a plain slice: several times
                // faster than ndarray's strided iterator on long prompts.
                if let Some(slice) = view.as_slice() {
                    for &value in slice {
                        out.push(convert(i128::from(value), py)?);
                    }
                } else {
                    for &value in view.iter() {
                        out.push(convert(i128::from(value), py)?);
                    }
                }
                return Ok(out);
            }
        )*};
    }
    try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
    Err(invalid_argument(
        py,
        format!("{name}: unsupported integer dtype {dtype}"),
    ))
}
