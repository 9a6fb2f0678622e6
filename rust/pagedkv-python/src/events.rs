//! KV events -> `pagedkv.events` objects (vLLM's field names), classes imported once.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use pagedkv::KvEvent;

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Converts drained core events, oldest first, into a list of Python event objects.
/// Hashes become Python ints; `extra_keys` holds `(extra_key_bytes,)` per block, or is None.
pub fn events_to_python<'py>(
    py: Python<'py>,
    events: Vec<KvEvent>,
    _block_size: usize,
) -> PyResult<Bound<'py, PyList>> {
    let stored = BLOCK_STORED.import(py, "pagedkv.events", "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, "pagedkv.events", "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, "pagedkv.events", "AllBlocksCleared")?;
    let list = PyList::empty(py);
    for event in events {
        let object = match event {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, extra_key } => {
                let kwargs = PyDict::new(py);
                let num_blocks = block_hashes.len();
                kwargs.set_item("block_hashes", block_hashes)?;
                kwargs.set_item("parent_block_hash", parent_block_hash)?;
                kwargs.set_item("token_ids", token_ids)?;
                kwargs.set_item("block_size", block_size)?;
                match extra_key {
                    Some(key) => {
                        let entry = PyTuple::new(py, [PyBytes::new(py, &key)])?;
                        let keys = PyList::new(py, std::iter::repeat_n(entry, num_blocks))?;
                        kwargs.set_item("extra_keys", keys)?;
                    }
                    None => kwargs.set_item("extra_keys", py.None())?,
                }
                stored.call((), Some(&kwargs))?
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("block_hashes", block_hashes)?;
                removed.call((), Some(&kwargs))?
            }
            KvEvent::AllBlocksCleared => cleared.call0()?,
        };
        list.append(object)?;
    }
    Ok(list)
}
