//! The caller-supplied per-block keys and hashes of an admission or `provide_token_ids`
//! (docs/design.md, Per-chunk allocation, "Caller-supplied keys and hashes"), the null-block
//! option, and `reduce_block_hash`.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt};

use crate::errors::{invalid_argument, with_arg_note};
use crate::scalars::{repr, type_name, ExtraKey};

/// `block_extra_keys` (one `None | str | bytes | int` per block) and `block_hashes` (one
/// 128-bit `int`, or `bytes` reduced by `reduce_block_hash`, per full block), read and checked
/// before the manager is locked.
pub(crate) struct BlockKeyArgs {
    pub(crate) extra_keys: Option<Vec<Option<Vec<u8>>>>,
    pub(crate) hashes: Option<Vec<u128>>,
}

impl BlockKeyArgs {
    /// Reads both lists; each may name at most `max_len` blocks (the pool's, a bound on any
    /// prompt, or `max_model_len`'s for one admitted without the whole-prompt check), checked
    /// before an element is read.
    pub(crate) fn extract(
        py: Python<'_>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        max_len: usize,
    ) -> PyResult<Self> {
        let extra_keys = extra_keys
            .map(|obj| {
                read_list(py, obj, "block_extra_keys", max_len, |item| {
                    if item.is_none() {
                        Ok(None)
                    } else {
                        Ok(Some(item.extract::<ExtraKey>()?.0))
                    }
                })
            })
            .transpose()?;
        let hashes = hashes
            .map(|obj| read_list(py, obj, "block_hashes", max_len, extract_block_hash))
            .transpose()?;
        Ok(BlockKeyArgs { extra_keys, hashes })
    }

    /// The extra keys as the core takes them (borrowed slices).
    pub(crate) fn extra_keys(&self) -> Option<Vec<Option<&[u8]>>> {
        self.extra_keys
            .as_ref()
            .map(|keys| keys.iter().map(|k| k.as_deref()).collect())
    }
}

/// The items of a list or tuple `obj` (at most `max_len`) through `item`.
fn read_list<T>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
    max_len: usize,
    mut item: impl FnMut(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid_argument(
            py,
            format!("{what} must be a list, got {}", type_name(obj)),
        ));
    }
    let len = obj.len().map_err(|_| {
        invalid_argument(py, format!("{what} must be a list, got {}", type_name(obj)))
    })?;
    if len > max_len {
        return Err(invalid_argument(
            py,
            format!("{what} has {len} entries, more than the {max_len} blocks a prompt may have"),
        ));
    }
    let mut out = Vec::with_capacity(len);
    for element in obj.try_iter()? {
        out.push(item(&element?).map_err(|e| with_arg_note(py, what, e))?);
    }
    if out.len() != len {
        return Err(invalid_argument(
            py,
            format!("{what} changed length while read"),
        ));
    }
    Ok(out)
}

/// One block hash: an `int` in `[0, 2**128)`, or `bytes` (reduced to 128 bits).
pub(crate) fn extract_block_hash(obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    let py = obj.py();
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        return Ok(pagedkv::reduce_block_hash(bytes.as_bytes()));
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        return obj.extract::<u128>().map_err(|_| {
            invalid_argument(
                py,
                format!(
                    "a block hash must be an int in [0, 2**128), got {}",
                    repr(obj)
                ),
            )
        });
    }
    Err(invalid_argument(
        py,
        format!(
            "a block hash must be an int or bytes, got {}",
            type_name(obj)
        ),
    ))
}

/// `null_block=`: `-1` (the default, released positions show -1) or `0` (block 0 is reserved
/// as vLLM's null block and released positions show 0).
pub(crate) fn parse_null_block(py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let Some(obj) = obj else {
        return Ok(false);
    };
    let value = if obj.is_instance_of::<PyBool>() {
        None
    } else {
        obj.extract::<i64>().ok()
    };
    match value {
        Some(-1) => Ok(false),
        Some(0) => Ok(true),
        _ => Err(invalid_argument(
            py,
            format!("null_block must be -1 or 0, got {}", repr(obj)),
        )),
    }
}

/// `reduce_block_hash(block_hash: bytes) -> int`: a caller's block hash reduced to the 128
/// bits the index keys blocks by (its first 16 bytes, little-endian, zero-padded).
#[pyfunction]
pub(crate) fn reduce_block_hash(block_hash: &Bound<'_, PyAny>) -> PyResult<u128> {
    let py = block_hash.py();
    let bytes = block_hash.cast::<PyBytes>().map_err(|_| {
        invalid_argument(
            py,
            format!("block_hash must be bytes, got {}", type_name(block_hash)),
        )
    })?;
    Ok(pagedkv::reduce_block_hash(bytes.as_bytes()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(reduce_block_hash, m)?)
}
