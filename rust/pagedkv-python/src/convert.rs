//! Argument conversion: Python values -> core types.
//!
//! Every malformed value (wrong type, float, bool, negative, out of range, 2-D array) becomes an
//! `InvalidArgumentError`, never a bare `TypeError`/`OverflowError`: the contract treats wrong
//! argument types as malformed input. PyO3 adds a note naming the argument.
//!
//! The single-token append path is the hot one, so integers are read with one C call on exact
//! `int`s and short token lists land in a stack buffer (no heap allocation per call).

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::invalid_argument;

fn type_name(obj: &Bound<'_, PyAny>) -> String {
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

/// An exact `int` in `[0, 2**63)` read with one C call that needs no error check on success
/// (`PyLong_AsLongAndOverflow` flags out-of-range values instead of raising); `None` for
/// anything else (negative, huge, or -1 with an error set), which the caller re-checks.
#[inline]
fn exact_int_as_u63(obj: &Bound<'_, PyAny>) -> Option<u64> {
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
    obj.extract::<u64>().map_err(|_| {
        invalid_argument(
            py,
            format!(
                "{what} must be an int in [0, 2**64), got {} {}",
                type_name(obj),
                repr(obj)
            ),
        )
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
    let value = extract_u64(obj, "token id")?;
    u32::try_from(value).map_err(|_| {
        invalid_argument(
            obj.py(),
            format!("token id must be in [0, 2**32), got {value}"),
        )
    })
}

/// Fast path for a list of exact `int`s: reads each item as a borrowed reference (no refcount
/// traffic, which costs a function call per item under the stable ABI) and hands `(index,
/// value)` to `sink`. Returns false as soon as an item is not an exact `int`, does not fit a C
/// long, or `sink` rejects it; the caller then takes the checked path, which reports the error.
#[inline]
fn read_exact_int_list(list: &Bound<'_, PyList>, mut sink: impl FnMut(usize, i64) -> bool) -> bool {
    let len = list.len();
    for index in 0..len {
        // SAFETY: `list` proves the GIL is held. Nothing in this loop runs Python code (only
        // exact ints are read, and their conversion cannot call back into Python), so no other
        // thread can mutate the list meanwhile: `index < len` stays in bounds and each borrowed
        // item stays alive, owned by the list. A failed conversion's error is cleared here.
        let value = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t);
            if item.is_null() {
                ffi::PyErr_Clear();
                return false;
            }
            if ffi::PyLong_CheckExact(item) == 0 {
                return false;
            }
            let mut overflow: std::os::raw::c_int = 0;
            let value = ffi::PyLong_AsLongAndOverflow(item, &mut overflow);
            if overflow != 0 {
                return false;
            }
            value
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

/// Token ids, from a list or tuple of ints or a 1-D NumPy integer array `[num_tokens]`.
/// Lazy iterables (`range`, generators) are refused: their length is unbounded by memory, so
/// materializing one could exhaust it before any validation.
pub enum TokenIds {
    Inline {
        len: usize,
        ids: [u32; INLINE_TOKENS],
    },
    Heap(Vec<u32>),
}

impl TokenIds {
    pub fn as_slice(&self) -> &[u32] {
        match self {
            TokenIds::Inline { len, ids } => &ids[..*len],
            TokenIds::Heap(ids) => ids,
        }
    }

    /// The fast path: a list of exact ints, each in `[0, 2**32)`.
    #[inline]
    fn from_exact_int_list(list: &Bound<'_, PyList>) -> Option<Self> {
        let len = list.len();
        let in_range = |value: i64| u32::try_from(value).ok();
        if len == 1 {
            // The decode step's `[token]`: skip the buffer loop and its closure.
            let mut single = None;
            let ok = read_exact_int_list(list, |_, value| {
                single = in_range(value);
                single.is_some()
            });
            let id = single.filter(|_| ok)?;
            let mut ids = [0_u32; INLINE_TOKENS];
            ids[0] = id;
            return Some(TokenIds::Inline { len: 1, ids });
        }
        if len <= INLINE_TOKENS {
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
            ok.then_some(TokenIds::Inline { len, ids })
        } else {
            let mut ids = Vec::with_capacity(len);
            let ok = read_exact_int_list(list, |_, value| match in_range(value) {
                Some(id) => {
                    ids.push(id);
                    true
                }
                None => false,
            });
            (ok && ids.len() == len).then_some(TokenIds::Heap(ids))
        }
    }

    fn from_items<'py>(
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
            let mut ids = Vec::with_capacity(len);
            for item in items {
                ids.push(extract_token(&item)?);
            }
            Ok(TokenIds::Heap(ids))
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for TokenIds {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = obj.cast::<PyList>() {
            if let Some(ids) = TokenIds::from_exact_int_list(&list) {
                return Ok(ids);
            }
            return TokenIds::from_items(list.len(), list.iter());
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            return TokenIds::from_items(tuple.len(), tuple.iter());
        }
        let py = obj.py();
        if obj.is_instance_of::<PyUntypedArray>() {
            return integer_array(&obj, "token_ids", |value, py| {
                u32::try_from(value).map_err(|_| {
                    invalid_argument(py, format!("token id must be in [0, 2**32), got {value}"))
                })
            })
            .map(TokenIds::Heap);
        }
        Err(invalid_argument(
            py,
            format!(
                "token_ids must be a list or tuple of ints or a 1-D integer NumPy array, got {}",
                type_name(&obj)
            ),
        ))
    }
}

/// Sequence ids, from a list or tuple of ints or a 1-D NumPy integer array `[B]`.
pub struct SeqIds(pub Vec<u64>);

fn seq_id_list(obj: &Bound<'_, PyAny>) -> Option<PyResult<Vec<u64>>> {
    let collect = |len: usize, items: &mut dyn Iterator<Item = Bound<'_, PyAny>>| {
        let mut ids = Vec::with_capacity(len);
        for item in items {
            ids.push(extract_u64(&item, "sequence id")?);
        }
        Ok(ids)
    };
    if let Ok(list) = obj.cast::<PyList>() {
        let mut ids = Vec::with_capacity(list.len());
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
        return Some(integer_array(obj, "seq_ids", |value, py| {
            u64::try_from(value).map_err(|_| {
                invalid_argument(
                    py,
                    format!("sequence id must be in [0, 2**64), got {value}"),
                )
            })
        }));
    }
    None
}

impl<'a, 'py> FromPyObject<'a, 'py> for SeqIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match seq_id_list(&obj) {
            Some(ids) => ids.map(SeqIds),
            None => Err(invalid_argument(
                obj.py(),
                format!(
                    "seq_ids must be a list or tuple of ints or a 1-D integer NumPy array, got {}",
                    type_name(&obj)
                ),
            )),
        }
    }
}

/// One sequence id or several (a fork group), as `swap_out` / `swap_in` accept.
pub struct OneOrManySeqIds(pub Vec<u64>);

impl<'a, 'py> FromPyObject<'a, 'py> for OneOrManySeqIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Some(ids) = seq_id_list(&obj) {
            return ids.map(OneOrManySeqIds);
        }
        extract_u64(&obj, "sequence id").map(|id| OneOrManySeqIds(vec![id]))
    }
}

/// The namespace key mixed into block hashes: `str` (hashed as UTF-8), `bytes`, or `int`
/// (hashed as its decimal text, so `5` and `"5"` name the same namespace).
pub struct ExtraKey(pub Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for ExtraKey {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // Both conversions below can fail on values of the right type (a str holding a lone
        // surrogate is not UTF-8; an int beyond `sys.get_int_max_str_digits()` has no decimal
        // text): that is malformed input too, not a UnicodeEncodeError / bare ValueError.
        if let Ok(text) = obj.cast::<PyString>() {
            return text
                .to_str()
                .map(|s| ExtraKey(s.as_bytes().to_vec()))
                .map_err(|e| {
                    invalid_argument(obj.py(), format!("extra_key str is not valid UTF-8: {e}"))
                });
        }
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            return Ok(ExtraKey(bytes.as_bytes().to_vec()));
        }
        if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
            return obj
                .str()
                .map(|text| ExtraKey(text.to_string().into_bytes()))
                .map_err(|e| {
                    invalid_argument(obj.py(), format!("extra_key int has no decimal text: {e}"))
                });
        }
        Err(invalid_argument(
            obj.py(),
            format!(
                "extra_key must be str, bytes or int, got {}",
                type_name(&obj)
            ),
        ))
    }
}

/// Reads a 1-D NumPy integer array (any integer dtype, any strides) through `convert`.
fn integer_array<T>(
    obj: &Bound<'_, PyAny>,
    name: &str,
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
    let kind = array.dtype().kind();
    if kind != b'i' && kind != b'u' {
        return Err(invalid_argument(
            py,
            format!("{name} must have an integer dtype, got {}", array.dtype()),
        ));
    }
    macro_rules! try_dtype {
        ($($ty:ty),*) => {$(
            if let Ok(typed) = obj.cast::<PyArray1<$ty>>() {
                let readonly = typed
                    .try_readonly()
                    .map_err(|e| invalid_argument(py, format!("{name}: {e}")))?;
                let view = readonly.as_array();
                let mut out = Vec::with_capacity(view.len());
                for &value in view.iter() {
                    out.push(convert(i128::from(value), py)?);
                }
                return Ok(out);
            }
        )*};
    }
    try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
    Err(invalid_argument(
        py,
        format!("{name}: unsupported integer dtype {}", array.dtype()),
    ))
}
