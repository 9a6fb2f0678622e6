//! Router digests: each stored block's token ids folded into one 64-bit digest, as a KV-aware
//! router indexes them.
//!
//! A KV-aware router (Dynamo's, llm-d's) never uses the engine's block hashes to match a new
//! request: it hashes each block's *tokens* with its own function and links blocks through the
//! events' parent hashes. [`block_digests`] is that function, for a request's prompt and for the
//! blocks of a [`KvEvent::BlockStored`] ([`stored_block_digests`]), so both sides agree. An
//! embedder in Rust calls these directly; the Python bindings only convert.
//!
//! The digest is XXH3-64 (Dynamo's router uses the same function) of the block's token ids as
//! little-endian u32 bytes, seeded with 0, or, for a sequence with an `extra_key`, with XXH3-64
//! of the key's bytes (salted prompts never match unsalted ones).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::error::{invalid, Result};
use crate::prefix::events::KvEvent;

/// One digest per full block of `tokens` (a trailing partial block is skipped). A
/// `block_size` of 0: [`crate::Error::InvalidArgument`].
///
/// ```
/// use pagedkv::router_digest::block_digests;
/// let tokens: Vec<u32> = (0..10).collect();
/// let plain = block_digests(&tokens, 4, None)?;
/// assert_eq!(plain.len(), 2);                                  // the partial block is skipped
/// assert_ne!(plain, block_digests(&tokens, 4, Some(b"salt"))?); // salted never matches
/// assert!(block_digests(&tokens, 0, None).is_err());
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub fn block_digests(
    tokens: &[u32],
    block_size: usize,
    extra_key: Option<&[u8]>,
) -> Result<Vec<u64>> {
    if block_size == 0 {
        return invalid("block_size must be >= 1");
    }
    let seed = extra_key.map_or(0, xxh3_64);
    Ok(tokens
        .chunks_exact(block_size)
        .map(|block| xxh3_64_with_seed(&le_bytes(block), seed))
        .collect())
}

/// The digests of the blocks a [`KvEvent::BlockStored`] stored, one per block hash, in order;
/// empty for the other events.
///
/// ```
/// use pagedkv::router_digest::{block_digests, stored_block_digests};
/// use pagedkv::{KvCacheManager, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig {
///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
///     ..Default::default()
/// })?;
/// kv.add_sequence(1, &[1, 2, 3], None)?;
/// let events = kv.take_events();
/// assert_eq!(stored_block_digests(&events[0]), block_digests(&[1, 2, 3], 2, None)?);
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub fn stored_block_digests(event: &KvEvent) -> Vec<u64> {
    match event {
        KvEvent::BlockStored {
            token_ids,
            block_size,
            extra_key,
            ..
        } => block_digests(token_ids, *block_size, extra_key.as_deref()).unwrap_or_default(),
        KvEvent::BlockRemoved { .. } | KvEvent::AllBlocksCleared => Vec::new(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_cover_full_blocks_and_depend_on_content_and_key() {
        let tokens: Vec<u32> = (0..10).collect();
        let plain = block_digests(&tokens, 4, None).unwrap();
        assert_eq!(plain.len(), 2);
        assert_ne!(plain[0], plain[1]);
        assert_eq!(plain, block_digests(&tokens[..8], 4, None).unwrap());
        let salted = block_digests(&tokens, 4, Some(b"salt")).unwrap();
        assert_ne!(plain[0], salted[0]);
        // Little-endian u32 bytes, seed 0: independent of the host's byte order.
        let bytes: Vec<u8> = (0u32..4).flat_map(u32::to_le_bytes).collect();
        assert_eq!(plain[0], xxh3_64_with_seed(&bytes, 0));
    }
}
