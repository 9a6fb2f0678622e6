//! Scalar arguments: ids, counts, seeds, flags and the prefix-cache namespace key.
//!
//! Every malformed value (wrong type, float, bool, negative, out of range) becomes an
//! `InvalidArgumentError`, never a bare `TypeError`/`OverflowError`: the contract treats wrong
//! argument types as malformed input. PyO3 adds a note naming the argument. Exact `int`s are
//! read by the one int reader ([`int_list`]); everything else takes the checked path here.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyString};

use crate::errors::{invalid_argument, must_propagate, or_invalid};
use crate::int_list;

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "object".to_owned())
}

/// Reads a non-negative integer that fits in `u64`. Accepts `int` and objects with `__index__`
/// (NumPy integer scalars); rejects `bool` and `float` explicitly.
#[inline]
pub(crate) fn extract_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Some(value) = int_list::exact_int_value(obj) {
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

pub(crate) fn repr(obj: &Bound<'_, PyAny>) -> String {
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
pub(crate) fn extract_token(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Some(value) = int_list::exact_int_value(obj).and_then(|v| u32::try_from(v).ok()) {
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

/// Whether `obj` is a NumPy integer scalar (`np.integer`; `np.bool_` is not one).
fn is_numpy_integer(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let numpy = py.import("numpy")?;
    obj.is_instance(&numpy.getattr("integer")?)
}
