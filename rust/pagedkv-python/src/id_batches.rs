//! Batches of ids: token ids (`[num_tokens]`) and sequence ids (`[B]`) from a list, a tuple or
//! a 1-D NumPy integer array.
//!
//! Lists are read by the one int reader ([`int_list`]), short token lists into a stack buffer
//! (no heap allocation per decode step); contiguous, aligned, native `uint32`/`int32` arrays are
//! borrowed in place, any other integer array is read from a copy when it cannot be read in
//! place (`arrays.rs`). A batch longer than could ever succeed is refused before anything is read or
//! allocated; anything malformed is an `InvalidArgumentError`.

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::type_object::PyTypeInfo;
use pyo3::types::{PyList, PyTuple};

use crate::alloc_guard::try_vec;
use crate::arrays::{is_behaved, native_copy};
use crate::errors::invalid_argument;
use crate::int_list;
use crate::scalars::{extract_token, extract_u64, type_name};

/// `obj` (already known to be exactly `numpy.ndarray`) borrowed read-only as a C-contiguous 1-D
/// array of `T` that can be read in place (aligned, native byte order: `arrays::is_behaved`),
/// after its length is checked against `max_len`; `None` when its dtype is not `T` or it cannot
/// be read in place (the general path then reads a copy or refuses it).
fn contiguous_tokens<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    max_len: usize,
    why: &str,
) -> PyResult<Option<PyReadonlyArray1<'py, T>>> {
    let py = obj.py();
    let Ok(array) = obj.cast::<PyArray1<T>>() else {
        return Ok(None);
    };
    if !is_behaved(array.as_untyped(), true) {
        return Ok(None);
    }
    check_len(py, "token_ids", array.len(), max_len, why)?;
    let readonly = array
        .try_readonly()
        .map_err(|e| invalid_argument(py, format!("token_ids: {e}")))?;
    Ok(Some(readonly))
}

/// The slice of an array [`contiguous_tokens`] borrowed (see [`TokenIds::as_slice`]).
fn borrowed<'a, T: numpy::Element>(array: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    array
        .as_slice()
        .map_err(|e| invalid_argument(array.py(), format!("token_ids: {e}")))
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
    /// The ids. A borrowed array was checked readable in place when it was borrowed, and its
    /// layout cannot change while the borrow is held (the GIL is held and no Python code runs);
    /// were it not readable after all, this is an `InvalidArgumentError`, never an empty read.
    pub fn as_slice(&self) -> PyResult<&[u32]> {
        match self {
            TokenIds::Inline { len, ids } => Ok(&ids[..*len]),
            TokenIds::Heap(ids) => Ok(ids),
            TokenIds::U32(array) => borrowed(array),
            TokenIds::I32(array) => {
                let values = borrowed(array)?;
                // SAFETY: `i32` and `u32` have the same size and alignment, every bit pattern
                // is valid for both, and the values were checked non-negative, so each reads
                // as the same number. The slice borrows `array`, which outlives it.
                Ok(unsafe {
                    std::slice::from_raw_parts(values.as_ptr().cast::<u32>(), values.len())
                })
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
            if let Some(&bad) = borrowed(&ids)?.iter().find(|&&v| v < 0) {
                return Err(out_of_range(i64::from(bad)));
            }
            return Ok(Some(TokenIds::I32(ids)));
        }
        if let Some(values) = contiguous_tokens::<i64>(obj, max_len, why)? {
            let values = borrowed(&values)?;
            let mut ids = try_vec(py, values.len(), "token_ids")?;
            for &v in values {
                ids.push(u32::try_from(v).map_err(|_| out_of_range(v))?);
            }
            return Ok(Some(TokenIds::Heap(ids)));
        }
        Ok(None)
    }

    /// The fast path: a list of exact ints, each in `[0, 2**32)`, read by the one list reader
    /// ([`int_list`]); `None` when an item does not qualify (the caller's checked path then
    /// reads the list again and reports the error).
    #[inline]
    fn from_exact_int_list(list: &Bound<'_, PyList>) -> PyResult<Option<Self>> {
        let len = list.len();
        let token = |value: u64| u32::try_from(value).ok();
        if len <= INLINE_TOKENS {
            let mut ids = [0_u32; INLINE_TOKENS];
            let ok = int_list::fill_from_list(list, &mut ids[..len], token);
            return Ok(ok.then_some(TokenIds::Inline { len, ids }));
        }
        let mut ids = try_vec(list.py(), len, "token_ids")?;
        let ok = int_list::extend_from_list(list, &mut ids, token);
        Ok(ok.then_some(TokenIds::Heap(ids)))
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
    if !is_behaved(array, false) {
        // Misaligned, strides that are not whole items, or the other byte order: read a native
        // copy, whose size the check above bounds (a view of the array itself would read
        // misaligned or from the wrong offsets; see `arrays.rs`).
        let copy = native_copy(array)?;
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
