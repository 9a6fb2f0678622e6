//! `pagedkv.events` objects -> vLLM's KV-event wire bytes (the core's `pagedkv::wire`).
//!
//! Reads each event's vLLM fields by attribute, so the objects `take_events()` returns, and
//! ones a caller built with `lora_id` / `lora_name` / `extra_keys` set, both encode.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyString, PyTuple, PyType};

use pagedkv::wire::{encode_event_batch, ExtraKeyItem, HashFormat, WireEvent};
use pagedkv::BlockHash;

use crate::errors::or_invalid;
use crate::errors::{invalid_argument, to_pyerr};
use crate::scalars::type_name;

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Encodes `events` (a sequence of `pagedkv.events` objects) as one vLLM `EventBatch`.
#[pyfunction]
#[pyo3(name = "encode_event_batch", signature = (events, ts, data_parallel_rank=None, raw_hashes=false))]
pub fn encode_event_batch_py<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    ts: f64,
    data_parallel_rank: Option<i64>,
    raw_hashes: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let stored = BLOCK_STORED.import(py, "pagedkv.events", "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, "pagedkv.events", "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, "pagedkv.events", "AllBlocksCleared")?;
    let mut wire = Vec::new();
    for (index, event) in events.try_iter()?.enumerate() {
        let event = event?;
        let converted = if event.is_instance(stored)? {
            stored_event(&event)
        } else if event.is_instance(removed)? {
            removed_event(&event)
        } else if event.is_instance(cleared)? {
            Ok(WireEvent::AllBlocksCleared)
        } else {
            Err(PyTypeError::new_err(format!(
                "events[{index}] is a {}, not a pagedkv.events BlockStored / BlockRemoved / \
                 AllBlocksCleared",
                event.get_type().name()?
            )))
        };
        // Same exception type (TypeError, OverflowError, ...), message prefixed with where.
        wire.push(converted.map_err(|err| {
            let message = format!("events[{index}]: {}", err.value(py));
            PyErr::from_type(err.get_type(py), message)
        })?);
    }
    let hashes = hash_format(raw_hashes);
    let bytes = py
        .detach(|| encode_event_batch(&wire, ts, data_parallel_rank, hashes))
        .map_err(|err| to_pyerr(py, err))?;
    Ok(PyBytes::new(py, &bytes))
}

/// How block hashes go on the wire: the whole 128-bit hash as 16 bytes (`raw_hashes`) or its
/// low 64 bits as an int (vLLM's default).
pub fn hash_format(raw_hashes: bool) -> HashFormat {
    if raw_hashes {
        HashFormat::Bytes
    } else {
        HashFormat::U64
    }
}

/// `KvCacheManager.take_event_batch`'s `ts` and `data_parallel_rank`, checked as a manager
/// method checks its arguments (an `InvalidArgumentError` naming the argument, never a bare
/// `TypeError`): `ts` a real number (not a bool), the rank None or an int (not a bool) that
/// fits 64 bits.
pub fn batch_args(
    py: Python<'_>,
    ts: &Bound<'_, PyAny>,
    data_parallel_rank: Option<&Bound<'_, PyAny>>,
) -> PyResult<(f64, Option<i64>)> {
    let refuse = |name: &str, want: &str, got: &Bound<'_, PyAny>| {
        invalid_argument(py, format!("{name} must be {want}, not {}", type_name(got)))
    };
    let real = ts.is_instance_of::<PyFloat>() || ts.is_instance_of::<PyInt>();
    if ts.is_instance_of::<PyBool>() || !real {
        return Err(refuse("ts", "a float (seconds)", ts));
    }
    let ts = ts.extract::<f64>().map_err(|err| {
        or_invalid(py, err, || {
            invalid_argument(py, "ts does not fit a float".to_owned())
        })
    })?;
    let rank = match data_parallel_rank {
        None => None,
        Some(r) if r.is_none() => None,
        Some(r) if r.is_instance_of::<PyBool>() || !r.is_instance_of::<PyInt>() => {
            return Err(refuse("data_parallel_rank", "an int or None", r));
        }
        Some(r) => Some(r.extract::<i64>().map_err(|err| {
            or_invalid(py, err, || {
                invalid_argument(py, "data_parallel_rank does not fit 64 bits".to_owned())
            })
        })?),
    };
    Ok((ts, rank))
}

fn hashes(event: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    event.getattr("block_hashes")?.extract()
}

fn opt_str(event: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<String>> {
    event.getattr(name)?.extract()
}

fn stored_event(event: &Bound<'_, PyAny>) -> PyResult<WireEvent> {
    let extra_keys: Option<Vec<Option<Bound<'_, PyTuple>>>> =
        event.getattr("extra_keys")?.extract()?;
    let extra_keys = extra_keys
        .map(|keys| {
            keys.into_iter()
                .map(|block| {
                    block
                        .map(|items| items.iter().map(|item| extra_item(&item)).collect())
                        .transpose()
                })
                .collect::<PyResult<Vec<_>>>()
        })
        .transpose()?;
    Ok(WireEvent::BlockStored {
        block_hashes: hashes(event)?,
        parent_block_hash: event.getattr("parent_block_hash")?.extract()?,
        token_ids: event.getattr("token_ids")?.extract()?,
        block_size: event.getattr("block_size")?.extract()?,
        lora_id: event.getattr("lora_id")?.extract()?,
        medium: opt_str(event, "medium")?,
        lora_name: opt_str(event, "lora_name")?,
        extra_keys,
        group_idx: event.getattr("group_idx")?.extract()?,
    })
}

fn removed_event(event: &Bound<'_, PyAny>) -> PyResult<WireEvent> {
    Ok(WireEvent::BlockRemoved {
        block_hashes: hashes(event)?,
        medium: opt_str(event, "medium")?,
        group_idx: event.getattr("group_idx")?.extract()?,
    })
}

/// One element of an `extra_keys` tuple: None, bool, int, float, str or bytes.
fn extra_item(item: &Bound<'_, PyAny>) -> PyResult<ExtraKeyItem> {
    // bool before int: a Python bool is an int.
    if item.is_none() {
        Ok(ExtraKeyItem::Nil)
    } else if item.is_instance_of::<PyBool>() {
        Ok(ExtraKeyItem::Bool(item.extract()?))
    } else if item.is_instance_of::<PyInt>() {
        Ok(ExtraKeyItem::Int(item.extract()?))
    } else if item.is_instance_of::<PyFloat>() {
        Ok(ExtraKeyItem::Float(item.extract()?))
    } else if item.is_instance_of::<PyString>() {
        Ok(ExtraKeyItem::Str(item.extract()?))
    } else if item.is_instance_of::<PyBytes>() {
        Ok(ExtraKeyItem::Bytes(item.extract()?))
    } else {
        Err(PyTypeError::new_err(format!(
            "an extra_keys item must be None, bool, int, float, str or bytes, not {}",
            item.get_type().name()?
        )))
    }
}

/// Registers `encode_event_batch` on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_event_batch_py, m)?)
}
