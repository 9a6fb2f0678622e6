//! KV events -> `pagedkv.events` objects (vLLM's field names), classes imported once.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use pagedkv::{KvEvent, Tier};

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `object.__new__`, to build event objects without running their `__init__`.
static OBJECT_NEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// vLLM's `medium` names ("GPU" for the device tier, "CPU" for the host tier), interned.
fn medium<'py>(py: Python<'py>, tier: Tier) -> Bound<'py, PyString> {
    match tier {
        Tier::Device => intern!(py, "GPU").clone(),
        other => PyString::intern(py, pagedkv::wire::medium_name(other)),
    }
}

/// An instance of the event class `cls` whose fields are `fields`, built as `copy.copy`
/// builds one: `object.__new__(cls)`, then the fields stored in its `__dict__`.
///
/// Why not `cls(**fields)`: the event classes are frozen dataclasses, whose generated
/// `__init__` sets each field through `object.__setattr__` in a Python frame; with the keyword
/// dict, draining took about twice as long per event
/// (benches/results/2026-12-02-prefix-admission.md, "Follow-up: events, eviction, the
/// benchmark itself"), and an admission that misses the cache evicts (one `BlockRemoved`) per
/// 16 tokens. `fields` must
/// name every field of the class, in order, so the instance is the one `__init__` would build
/// (tests/events compare them, `__dict__` and all).
fn instance<'py>(
    py: Python<'py>,
    cls: &Bound<'py, PyType>,
    fields: &[(&Bound<'py, PyString>, Bound<'py, PyAny>)],
) -> PyResult<Bound<'py, PyAny>> {
    let new = OBJECT_NEW.get_or_try_init(py, || {
        py.get_type::<PyAny>().getattr("__new__").map(Bound::unbind)
    })?;
    let object = new.bind(py).call1((cls,))?;
    let dict = object
        .getattr(intern!(py, "__dict__"))?
        .cast_into::<PyDict>()?;
    for (name, value) in fields {
        dict.set_item(name, value)?;
    }
    Ok(object)
}

/// Converts drained core events, oldest first, into a list of Python event objects.
/// Block hashes (128-bit) become Python ints; `extra_keys` holds `(extra_key_bytes,)` per
/// stored block when the sequence had an extra key, else None.
pub fn events_to_python<'py>(
    py: Python<'py>,
    events: Vec<KvEvent>,
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    if events.is_empty() {
        return Ok(list);
    }
    let stored = BLOCK_STORED.import(py, "pagedkv.events", "BlockStored")?;
    let removed = BLOCK_REMOVED.import(py, "pagedkv.events", "BlockRemoved")?;
    let cleared = ALL_BLOCKS_CLEARED.import(py, "pagedkv.events", "AllBlocksCleared")?;
    let none = py.None().into_bound(py);
    for event in events {
        let object = match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_key,
                medium: tier,
                group_idx,
            } => {
                let num_stored = block_hashes.len();
                let extra_keys = match extra_key {
                    Some(key) => {
                        let entry = PyTuple::new(py, [PyBytes::new(py, &key)])?;
                        PyList::new(py, std::iter::repeat_n(entry, num_stored))?.into_any()
                    }
                    None => none.clone(),
                };
                let fields = [
                    (
                        intern!(py, "block_hashes"),
                        block_hashes.into_pyobject(py)?.into_any(),
                    ),
                    (
                        intern!(py, "parent_block_hash"),
                        parent_block_hash.into_pyobject(py)?.into_any(),
                    ),
                    (
                        intern!(py, "token_ids"),
                        token_ids.into_pyobject(py)?.into_any(),
                    ),
                    (
                        intern!(py, "block_size"),
                        block_size.into_pyobject(py)?.into_any(),
                    ),
                    (intern!(py, "lora_id"), none.clone()),
                    (intern!(py, "medium"), medium(py, tier).into_any()),
                    (intern!(py, "lora_name"), none.clone()),
                    (intern!(py, "extra_keys"), extra_keys),
                    (
                        intern!(py, "group_idx"),
                        group_idx.into_pyobject(py)?.into_any(),
                    ),
                ];
                instance(py, stored, &fields)?
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium: tier,
                group_idx,
            } => {
                let fields = [
                    (
                        intern!(py, "block_hashes"),
                        block_hashes.into_pyobject(py)?.into_any(),
                    ),
                    (intern!(py, "medium"), medium(py, tier).into_any()),
                    (
                        intern!(py, "group_idx"),
                        group_idx.into_pyobject(py)?.into_any(),
                    ),
                ];
                instance(py, removed, &fields)?
            }
            KvEvent::AllBlocksCleared => cleared.call0()?,
        };
        list.append(object)?;
    }
    Ok(list)
}
