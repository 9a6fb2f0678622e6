//! KV events as a router indexes them: each stored block's token ids folded into one 64-bit
//! digest in Rust, so a router written in Python never materialises the token lists.
//!
//! A KV-aware router (Dynamo's, llm-d's) never uses the engine's block hashes to match a new
//! request: it hashes each block's *tokens* with its own function and links blocks through the
//! events' parent hashes. `take_event_digests` is `take_events` with that first step done here:
//! the same events, in the same order, with `token_ids` replaced by one digest per block.
//! `token_block_digests` is the same function on a request's prompt, so both sides agree.
//!
//! The digest is XXH3-64 (the `xxhash-rust` crate; Dynamo's router uses the same function) of
//! the block's token ids as little-endian u32 bytes, seeded with 0, or, for a sequence with an
//! `extra_key`, with XXH3-64 of the key's bytes (salted prompts never match unsalted ones).

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyList;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use pagedkv::KvEvent;

use crate::errors::invalid_argument;
use crate::id_batches::TokenIds;
use crate::scalars::ExtraKey;

/// The most tokens `token_block_digests` reads (256 MiB of ids): refused unread beyond it.
const MAX_DIGEST_TOKENS: usize = 1 << 26;

fn seed_of(extra_key: Option<&[u8]>) -> u64 {
    extra_key.map_or(0, xxh3_64)
}

/// One digest per full block of `tokens` (a trailing partial block is skipped).
pub fn block_digests(tokens: &[u32], block_size: usize, extra_key: Option<&[u8]>) -> Vec<u64> {
    let seed = seed_of(extra_key);
    tokens
        .chunks_exact(block_size)
        .map(|block| xxh3_64_with_seed(&le_bytes(block), seed))
        .collect()
}

/// The block's ids as little-endian bytes: the ids' own memory on a little-endian host.
#[cfg(target_endian = "little")]
fn le_bytes(block: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(block))
}

#[cfg(not(target_endian = "little"))]
fn le_bytes(block: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(block.iter().flat_map(|id| id.to_le_bytes()).collect())
}

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
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_key,
                ..
            } => {
                let digests = block_digests(&token_ids, block_size, extra_key.as_deref());
                (
                    "BlockStored",
                    PyList::new(py, block_hashes)?,
                    parent_block_hash,
                    PyList::new(py, digests)?,
                )
            }
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
    if block_size == 0 {
        return Err(invalid_argument(py, "block_size must be >= 1".to_owned()));
    }
    let tokens = TokenIds::extract_bounded(&token_ids, MAX_DIGEST_TOKENS)?;
    let key = extra_key.as_ref().map(|key| key.0.as_slice());
    // The GIL stays held: `tokens` may borrow the caller's NumPy array, which Python code on
    // another thread could write while it was released.
    let digests = block_digests(tokens.as_slice(), block_size, key);
    Ok(PyArray1::from_vec(py, digests))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(token_block_digests, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_cover_full_blocks_and_depend_on_content_and_key() {
        let tokens: Vec<u32> = (0..10).collect();
        let plain = block_digests(&tokens, 4, None);
        assert_eq!(plain.len(), 2);
        assert_ne!(plain[0], plain[1]);
        assert_eq!(plain, block_digests(&tokens[..8], 4, None));
        let salted = block_digests(&tokens, 4, Some(b"salt"));
        assert_ne!(plain[0], salted[0]);
        // Little-endian u32 bytes, seed 0: independent of the host's byte order.
        let bytes: Vec<u8> = (0u32..4).flat_map(u32::to_le_bytes).collect();
        assert_eq!(plain[0], xxh3_64_with_seed(&bytes, 0));
    }
}
