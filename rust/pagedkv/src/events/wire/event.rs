//! The events as they go on the wire: every field of vLLM's schema, and the conversion from the
//! core's [`KvEvent`].

use crate::error::Tier;
use crate::prefix::events::KvEvent;
use crate::prefix::hash::BlockHash;
use crate::types::TokenId;

/// One element of a block's `extra_keys` tuple (vLLM: multimodal hashes, LoRA name, cache salt;
/// pagedkv: the sequence's extra key as bytes).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKeyItem {
    /// msgpack nil.
    Nil,
    /// msgpack bool.
    Bool(bool),
    /// msgpack int.
    Int(i64),
    /// msgpack float64.
    Float(f64),
    /// msgpack str.
    Str(String),
    /// msgpack bin.
    Bytes(Vec<u8>),
}

/// An event with every field of vLLM's schema, as it goes on the wire. [`KvEvent`] converts
/// into it; the Python bindings build it from `pagedkv.events` objects, whose optional vLLM
/// fields (`lora_id`, `lora_name`, `extra_keys`) a caller may set.
#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    /// vLLM's `BlockStored`.
    BlockStored {
        /// Hashes of the stored blocks, in chain order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first stored one.
        parent_block_hash: Option<BlockHash>,
        /// The stored blocks' token ids, concatenated.
        token_ids: Vec<TokenId>,
        /// Tokens per block.
        block_size: u64,
        /// vLLM's deprecated adapter id (written, nil when unset).
        lora_id: Option<i64>,
        /// `"GPU"` / `"CPU"` (written, nil when unset).
        medium: Option<String>,
        /// Adapter name (written, nil when unset).
        lora_name: Option<String>,
        /// One entry per stored block; omitted from the map when `None`.
        extra_keys: Option<Vec<Option<Vec<ExtraKeyItem>>>>,
        /// KV-cache group (vLLM's `group_idx`); omitted from the map when `None`.
        group_idx: Option<i64>,
    },
    /// vLLM's `BlockRemoved`.
    BlockRemoved {
        /// Hashes of the removed blocks.
        block_hashes: Vec<BlockHash>,
        /// `"GPU"` / `"CPU"` (written, nil when unset).
        medium: Option<String>,
        /// KV-cache group (vLLM's `group_idx`); omitted from the map when `None`.
        group_idx: Option<i64>,
    },
    /// vLLM's `AllBlocksCleared`.
    AllBlocksCleared,
}

/// vLLM's `medium` names: "GPU" for the device tier, "CPU" for the host tier.
pub fn medium_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
    }
}

impl From<&KvEvent> for WireEvent {
    fn from(event: &KvEvent) -> Self {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_key,
                medium,
                group_idx,
            } => WireEvent::BlockStored {
                block_hashes: block_hashes.clone(),
                parent_block_hash: *parent_block_hash,
                token_ids: token_ids.clone(),
                block_size: *block_size as u64,
                lora_id: None,
                medium: Some(medium_name(*medium).to_owned()),
                lora_name: None,
                // Every block of a sequence carries the sequence's key, as vLLM's per-block
                // extra keys would for a cache salt.
                extra_keys: extra_key.as_ref().map(|key| {
                    vec![Some(vec![ExtraKeyItem::Bytes(key.clone())]); block_hashes.len()]
                }),
                group_idx: group_idx.map(i64::from),
            },
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => WireEvent::BlockRemoved {
                block_hashes: block_hashes.clone(),
                medium: Some(medium_name(*medium).to_owned()),
                group_idx: group_idx.map(i64::from),
            },
            KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared,
        }
    }
}
