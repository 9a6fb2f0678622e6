//! What the prefix cache hands on when it evicts a block: the block's indexed [`Content`], given
//! to an [`EvictionSink`] before the block loses its hash.
//!
//! The offload tier (`offload_tier.rs`) is the sink: it keeps an evicted block's content on the
//! host (docs/offload.md, "The host offload tier"). The type and the trait live here, below
//! both, so the cache names only this leaf and the tier names the cache's parts (this file,
//! `events`, `hash`, `lru`): the dependency runs one way, tier -> prefix.

use std::sync::Arc;

use super::events::EventQueue;
use super::hash::BlockHash;
use crate::types::{BlockId, TokenId};

/// What an evicted device block was indexed with (borrowed from the prefix index).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Content<'a> {
    pub(crate) hash: BlockHash,
    pub(crate) parent: Option<BlockHash>,
    pub(crate) token_ids: &'a [TokenId],
    pub(crate) extra_key: Option<&'a Arc<[u8]>>,
    /// The block's KV-cache group in a manager of several groups, `None` otherwise.
    pub(crate) group_idx: Option<u32>,
}

/// Where [`PrefixCache::evict_lru_into`](super::PrefixCache::evict_lru_into) hands each victim's
/// content, in eviction order, before the victim is unindexed (so events the sink records come
/// before the victim's `BlockRemoved`).
pub(crate) trait EvictionSink {
    /// Takes the content of evicted device block `device_block`; events go to `events`.
    fn evicted(&mut self, device_block: BlockId, content: Content<'_>, events: &mut EventQueue);
}
