//! KV events -> `pagedkv.events` objects (vLLM's field names), classes imported once.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use pagedkv::{KvEvent, Tier};

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// vLLM's `medium` names: "GPU" for the device tier, "CPU" for the host tier.
fn medium(tier: &Tier) -> String {
    match tier {
        Tier::Device => "GPU".to_owned(),
        Tier::Host => "CPU".to_owned(),
        other => other.to_string().to_uppercase(),
    }
}

/// Converts drained core events, oldest first, into a list of Python event objects.
/// Block hashes (128-bit) become Python ints; `extra_keys` holds `(extra_key_bytes,)` per
/// stored block when the sequence had an extra key, else None.
pub fn events_to_python<'py>(py: Python<'py>, events: Vec<KvEvent>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    if events.is_empty() {
        return Ok(list);
    }
    let stored = BLOCK_STORED.import(py, "pagedkv.events", "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, "pagedkv.events", "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, "pagedkv.events", "AllBlocksCleared")?;
    for event in events {
        let object = match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_key,
                medium: tier,
            } => {
                let kwargs = PyDict::new(py);
                let num_stored = block_hashes.len();
                kwargs.set_item("block_hashes", block_hashes)?;
                kwargs.set_item("parent_block_hash", parent_block_hash)?;
                kwargs.set_item("token_ids", token_ids)?;
                kwargs.set_item("block_size", block_size)?;
                kwargs.set_item("medium", medium(&tier))?;
                if let Some(key) = extra_key {
                    let entry = PyTuple::new(py, [PyBytes::new(py, &key)])?;
                    let keys = PyList::new(py, std::iter::repeat_n(entry, num_stored))?;
                    kwargs.set_item("extra_keys", keys)?;
                }
                stored.call((), Some(&kwargs))?
            }
            KvEvent::BlockRemoved { block_hashes, medium: tier } => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("block_hashes", block_hashes)?;
                kwargs.set_item("medium", medium(&tier))?;
                removed.call((), Some(&kwargs))?
            }
            KvEvent::AllBlocksCleared => cleared.call0()?,
        };
        list.append(object)?;
    }
    Ok(list)
}
