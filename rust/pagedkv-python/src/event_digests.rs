//! KV events as a router indexes them: each stored block's token ids folded into one 64-bit
//! digest in Rust, so a router written in Python never materialises the token lists.
//!
//! `take_event_digests` is `take_events` with each stored block's tokens replaced by its
//! digest; `token_block_digests` is the same function on a request's prompt, so both sides
//! agree. The digest itself is the core's (`pagedkv::router_digest`); this file converts.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyList;

use pagedkv::router_digest::{block_digests, stored_block_digests};
use pagedkv::KvEvent;

use crate::errors::to_pyerr;
use crate::id_batches::TokenIds;
use crate::scalars::ExtraKey;

/// The most tokens `token_block_digests` reads (256 MiB of ids): refused unread beyond it.
const MAX_DIGEST_TOKENS: usize = 1 << 26;

/// Drained core events as `(kind, block_hashes, parent_block_hash, block_digests)` tuples:
/// kind is the event class name (`"BlockStored"`, `"BlockRemoved"`, `"AllBlocksCleared"`);
/// block hashes are the same Python ints `take_events` gives; `block_digests` is one digest
/// per stored block (empty for the other kinds), `parent_block_hash` None except for stores.
pub fn events_to_digests<'py>(
    py: Python<'py>,
    events: Vec<KvEvent>,
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for event in events {
        let entry = match event {
            KvEvent::BlockStored {
                ref block_hashes,
                parent_block_hash,
                ..
            } => (
                "BlockStored",
                PyList::new(py, block_hashes)?,
                parent_block_hash,
                PyList::new(py, stored_block_digests(&event))?,
            ),
            KvEvent::BlockRemoved { block_hashes, .. } => (
                "BlockRemoved",
                PyList::new(py, block_hashes)?,
                None,
                PyList::empty(py),
            ),
            KvEvent::AllBlocksCleared => (
                "AllBlocksCleared",
                PyList::empty(py),
                None,
                PyList::empty(py),
            ),
        };
        list.append(entry)?;
    }
    Ok(list)
}

/// `token_block_digests(token_ids, block_size, *, extra_key=None)`: uint64 `[len // block_size]`,
/// the digest `take_event_digests` reports for each full block of `token_ids`.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, *, extra_key=None))]
fn token_block_digests<'py>(
    py: Python<'py>,
    token_ids: Bound<'py, PyAny>,
    block_size: usize,
    extra_key: Option<ExtraKey>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let tokens = TokenIds::extract_bounded(&token_ids, MAX_DIGEST_TOKENS)?;
    let key = extra_key.as_ref().map(|key| key.0.as_slice());
    // The GIL stays held: `tokens` may borrow the caller's NumPy array, which Python code on
    // another thread could write while it was released.
    let digests =
        block_digests(tokens.as_slice()?, block_size, key).map_err(|e| to_pyerr(py, e))?;
    Ok(PyArray1::from_vec(py, digests))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(token_block_digests, m)?)
}
