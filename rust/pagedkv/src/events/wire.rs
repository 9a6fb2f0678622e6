//! vLLM's KV-event wire format: the msgpack bytes that KV-aware routers decode.
//!
//! Routers that learn what each replica caches (llm-d's KV-cache indexer, NVIDIA Dynamo's KV
//! router, SGLang's router) subscribe to the ZMQ stream vLLM publishes and decode each payload
//! as vLLM's `KVEventBatch` (`vllm/distributed/kv_events.py`, vLLM v0.26.0; docs/events.md pins
//! the version and lists every byte-level choice). To be consumed unchanged, pagedkv writes the
//! same bytes vLLM's msgspec encoder writes:
//!
//! * the batch is a msgpack **array** `[ts, events, data_parallel_rank]` (vLLM's `EventBatch` is
//!   an `array_like` struct). vLLM's publisher always fills the rank; when the caller gives
//!   none it is written as nil so that decoders expecting three elements (Dynamo's) still work;
//! * each event is a msgpack **map** whose first key is `"type"` (msgspec's tagged union:
//!   `"BlockStored"`, `"BlockRemoved"`, `"AllBlocksCleared"`), then the fields in declaration
//!   order; fields without a default (`lora_id`, `medium`, `lora_name`) are always written
//!   (nil when unset), fields with a default (`extra_keys`, `group_idx`) only when set
//!   (`omit_defaults`): a hybrid manager's events carry their KV-cache group as `group_idx`
//!   (written, 0 included), the plain manager's have none (omitted, the bytes as before);
//! * integers take msgpack's shortest form and `ts` is a float64, as msgspec writes them;
//! * block hashes are unsigned 64-bit ints holding the low 64 bits of pagedkv's 128-bit
//!   hashes (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: the last 8 bytes of the
//!   hash read big-endian), or with [`HashFormat::Bytes`] the whole hash as 16 raw bytes
//!   (big-endian), vLLM's `bytes` form of `ExternalBlockHash`.
//!
//! Compiled only with the cargo feature `wire` (it adds the `rmp` dependency).
//!
//! ```
//! use pagedkv::wire::{encode_kv_events, HashFormat};
//! use pagedkv::{KvCacheManager, ManagerConfig};
//! let mut kv = KvCacheManager::new(ManagerConfig {
//!     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
//! })?;
//! kv.add_sequence(1, &[1, 2, 3], None)?;
//! let payload = encode_kv_events(&kv.take_events(), 1.5, Some(0), HashFormat::U64)?;
//! assert_eq!(payload[0], 0x93); // a 3-element array: [ts, events, data_parallel_rank]
//! # Ok::<(), pagedkv::Error>(())
//! ```

use rmp::encode;

use crate::error::{Error, Result, Tier};
use crate::prefix::events::{DrainedEvents, KvEvent, QueuedRef};
use crate::prefix::hash::BlockHash;
use crate::types::TokenId;

/// How block hashes go on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashFormat {
    /// The low 64 bits as an unsigned msgpack int (vLLM's default; what routers index by).
    #[default]
    U64,
    /// The whole 128-bit hash as 16 big-endian bytes (msgpack bin).
    Bytes,
}

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

/// Encodes one `EventBatch`: `[ts, events, data_parallel_rank]`, see the module docs.
///
/// Fails with [`Error::InvalidArgument`] only for inputs msgpack cannot represent (a list or
/// string longer than `u32::MAX` elements, a non-finite `ts` is allowed as msgspec allows it).
pub fn encode_event_batch(
    events: &[WireEvent],
    ts: f64,
    data_parallel_rank: Option<i64>,
    hashes: HashFormat,
) -> Result<Vec<u8>> {
    encode_batch_with(events.iter(), ts, data_parallel_rank, |out, event| {
        write_event(out, event, hashes)
    })
}

/// [`encode_event_batch`] for the core's events as `KvCacheManager::take_events` returns them.
///
/// A `BlockRemoved`, one per evicted block and so most of an eviction-heavy batch, is written
/// straight from the event; the others go through their [`WireEvent`] (which copies them).
pub fn encode_kv_events(
    events: &[KvEvent],
    ts: f64,
    data_parallel_rank: Option<i64>,
    hashes: HashFormat,
) -> Result<Vec<u8>> {
    encode_batch_with(events.iter(), ts, data_parallel_rank, |out, event| {
        write_kv_event(out, event, hashes)
    })
}

/// [`encode_kv_events`] for events as the queue held them
/// (`KvCacheManager::take_drained_events`): the same bytes, and a device block's removal,
/// queued as its hash alone, is written from the hash without building its `KvEvent`.
pub fn encode_drained_events(
    events: &DrainedEvents,
    ts: f64,
    data_parallel_rank: Option<i64>,
    hashes: HashFormat,
) -> Result<Vec<u8>> {
    encode_batch_with(
        events.views(),
        ts,
        data_parallel_rank,
        |out, event| match event {
            QueuedRef::DeviceRemoval(hash, group_idx) => write_removed(
                out,
                &[hash],
                Some(medium_name(Tier::Device)),
                group_idx.map(i64::from),
                hashes,
            ),
            QueuedRef::Event(event) => write_kv_event(out, event, hashes),
        },
    )
}

/// One core event: a `BlockRemoved` straight from the event, the others through their
/// [`WireEvent`] (which copies them).
fn write_kv_event(out: &mut Vec<u8>, event: &KvEvent, hashes: HashFormat) -> Result<()> {
    match event {
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => write_removed(
            out,
            block_hashes,
            Some(medium_name(*medium)),
            group_idx.map(i64::from),
            hashes,
        ),
        other => write_event(out, &WireEvent::from(other), hashes),
    }
}

/// The batch around `events`: `[ts, [each written by `write`], data_parallel_rank]`.
fn encode_batch_with<E>(
    events: impl ExactSizeIterator<Item = E>,
    ts: f64,
    data_parallel_rank: Option<i64>,
    mut write: impl FnMut(&mut Vec<u8>, E) -> Result<()>,
) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(16 + 64 * events.len());
    encode::write_array_len(&mut out, 3).map_err(io_error)?;
    encode::write_f64(&mut out, ts).map_err(io_error)?;
    encode::write_array_len(&mut out, len_u32(events.len(), "events")?).map_err(io_error)?;
    for event in events {
        write(&mut out, event)?;
    }
    match data_parallel_rank {
        Some(rank) => write_int(&mut out, rank)?,
        None => encode::write_nil(&mut out).map_err(io_error)?,
    }
    Ok(out)
}

fn write_event(out: &mut Vec<u8>, event: &WireEvent, hashes: HashFormat) -> Result<()> {
    match event {
        WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
        } => {
            let num_fields = 8 + u32::from(extra_keys.is_some()) + u32::from(group_idx.is_some());
            encode::write_map_len(out, num_fields).map_err(io_error)?;
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes, hashes)?;
            write_str(out, "parent_block_hash")?;
            match parent_block_hash {
                Some(hash) => write_hash(out, *hash, hashes)?,
                None => encode::write_nil(out).map_err(io_error)?,
            }
            write_str(out, "token_ids")?;
            encode::write_array_len(out, len_u32(token_ids.len(), "token_ids")?)
                .map_err(io_error)?;
            for &token in token_ids {
                encode::write_uint(out, u64::from(token)).map_err(io_error)?;
            }
            write_str(out, "block_size")?;
            encode::write_uint(out, *block_size).map_err(io_error)?;
            write_str(out, "lora_id")?;
            write_opt_int(out, *lora_id)?;
            write_str(out, "medium")?;
            write_opt_str(out, medium.as_deref())?;
            write_str(out, "lora_name")?;
            write_opt_str(out, lora_name.as_deref())?;
            if let Some(keys) = extra_keys {
                write_str(out, "extra_keys")?;
                encode::write_array_len(out, len_u32(keys.len(), "extra_keys")?)
                    .map_err(io_error)?;
                for block_keys in keys {
                    match block_keys {
                        None => encode::write_nil(out).map_err(io_error)?,
                        Some(items) => {
                            encode::write_array_len(out, len_u32(items.len(), "extra_keys")?)
                                .map_err(io_error)?;
                            for item in items {
                                write_extra_key_item(out, item)?;
                            }
                        }
                    }
                }
            }
            if let Some(group) = group_idx {
                write_str(out, "group_idx")?;
                write_int(out, *group)?;
            }
        }
        WireEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => write_removed(out, block_hashes, medium.as_deref(), *group_idx, hashes)?,
        WireEvent::AllBlocksCleared => {
            encode::write_map_len(out, 1).map_err(io_error)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn write_removed(
    out: &mut Vec<u8>,
    block_hashes: &[BlockHash],
    medium: Option<&str>,
    group_idx: Option<i64>,
    hashes: HashFormat,
) -> Result<()> {
    encode::write_map_len(out, 3 + u32::from(group_idx.is_some())).map_err(io_error)?;
    write_str(out, "type")?;
    write_str(out, "BlockRemoved")?;
    write_str(out, "block_hashes")?;
    write_hashes(out, block_hashes, hashes)?;
    write_str(out, "medium")?;
    write_opt_str(out, medium)?;
    if let Some(group) = group_idx {
        write_str(out, "group_idx")?;
        write_int(out, group)?;
    }
    Ok(())
}

fn write_hashes(out: &mut Vec<u8>, block_hashes: &[BlockHash], hashes: HashFormat) -> Result<()> {
    encode::write_array_len(out, len_u32(block_hashes.len(), "block_hashes")?).map_err(io_error)?;
    for &hash in block_hashes {
        write_hash(out, hash, hashes)?;
    }
    Ok(())
}

fn write_hash(out: &mut Vec<u8>, hash: BlockHash, hashes: HashFormat) -> Result<()> {
    match hashes {
        // Truncation is the point: the low 64 bits, as vLLM's int form keeps the last 8 bytes.
        HashFormat::U64 => {
            encode::write_uint(out, hash as u64).map_err(io_error)?;
        }
        HashFormat::Bytes => encode::write_bin(out, &hash.to_be_bytes()).map_err(io_error)?,
    }
    Ok(())
}

fn write_extra_key_item(out: &mut Vec<u8>, item: &ExtraKeyItem) -> Result<()> {
    match item {
        ExtraKeyItem::Nil => encode::write_nil(out).map_err(io_error)?,
        ExtraKeyItem::Bool(value) => encode::write_bool(out, *value).map_err(io_error)?,
        ExtraKeyItem::Int(value) => write_int(out, *value)?,
        ExtraKeyItem::Float(value) => encode::write_f64(out, *value).map_err(io_error)?,
        ExtraKeyItem::Str(value) => write_str(out, value)?,
        ExtraKeyItem::Bytes(value) => {
            len_u32(value.len(), "extra_keys")?;
            encode::write_bin(out, value).map_err(io_error)?;
        }
    }
    Ok(())
}

/// msgspec writes a non-negative int in its unsigned shortest form and a negative one in
/// its signed shortest form; `rmp`'s `write_sint` does the same.
fn write_int(out: &mut Vec<u8>, value: i64) -> Result<()> {
    if value >= 0 {
        encode::write_uint(out, value as u64).map_err(io_error)?;
    } else {
        encode::write_sint(out, value).map_err(io_error)?;
    }
    Ok(())
}

fn write_opt_int(out: &mut Vec<u8>, value: Option<i64>) -> Result<()> {
    match value {
        Some(value) => write_int(out, value),
        None => encode::write_nil(out).map_err(io_error),
    }
}

fn write_str(out: &mut Vec<u8>, value: &str) -> Result<()> {
    len_u32(value.len(), "string")?;
    encode::write_str(out, value).map_err(io_error)
}

fn write_opt_str(out: &mut Vec<u8>, value: Option<&str>) -> Result<()> {
    match value {
        Some(value) => write_str(out, value),
        None => encode::write_nil(out).map_err(io_error),
    }
}

fn len_u32(len: usize, what: &str) -> Result<u32> {
    u32::try_from(len).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} has {len} elements; msgpack holds at most {}",
            u32::MAX
        ))
    })
}

/// Writing into a `Vec<u8>` cannot fail; should `rmp` ever report an error, it surfaces as an
/// invariant violation rather than a panic.
fn io_error<E: std::fmt::Display>(error: E) -> Error {
    Error::InvariantViolation(format!("msgpack encoding into memory failed: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::events::EventQueue;

    #[test]
    fn core_events_encode_as_their_wire_events_do() {
        // `encode_kv_events` writes removals straight from the event: the same bytes as the
        // `WireEvent` path, for every kind, tier and hash format.
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![1 << 100, 7],
                parent_block_hash: Some(3),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                extra_key: Some(b"salt".to_vec()),
                medium: Tier::Device,
                group_idx: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![u128::MAX],
                medium: Tier::Device,
                group_idx: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![5, 6],
                medium: Tier::Host,
                group_idx: None,
            },
            KvEvent::AllBlocksCleared,
            // A hybrid manager's events, of groups 0 and 3.
            KvEvent::BlockStored {
                block_hashes: vec![8],
                parent_block_hash: None,
                token_ids: vec![5, 6],
                block_size: 2,
                extra_key: None,
                medium: Tier::Device,
                group_idx: Some(0),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![8],
                medium: Tier::Device,
                group_idx: Some(3),
            },
        ];
        let wire: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
        // The same events through the queue: the device removal is held as its hash alone.
        let mut queue = EventQueue::new(true, 16);
        for event in &events {
            queue.push(event.clone());
        }
        queue.push_removed(9);
        queue.push_removed_in_group(9, Some(1));
        let drained = queue.take_drained();
        assert_eq!(drained.len(), events.len() + 2);
        let mut all = events.clone();
        for group_idx in [None, Some(1)] {
            all.push(KvEvent::BlockRemoved {
                block_hashes: vec![9],
                medium: Tier::Device,
                group_idx,
            });
        }
        for hashes in [HashFormat::U64, HashFormat::Bytes] {
            for rank in [None, Some(-2)] {
                assert_eq!(
                    encode_kv_events(&events, 2.5, rank, hashes).unwrap(),
                    encode_event_batch(&wire, 2.5, rank, hashes).unwrap()
                );
                assert_eq!(
                    encode_drained_events(&drained, 2.5, rank, hashes).unwrap(),
                    encode_kv_events(&all, 2.5, rank, hashes).unwrap()
                );
            }
        }
        assert_eq!(drained.into_events(), all);
        assert!(
            encode_drained_events(&DrainedEvents::default(), 1.0, None, HashFormat::U64).is_ok_and(
                |bytes| bytes == encode_kv_events(&[], 1.0, None, HashFormat::U64).unwrap()
            )
        );
    }

    #[test]
    fn batch_of_cleared_is_the_exact_msgpack() {
        let bytes = encode_event_batch(
            &[WireEvent::AllBlocksCleared],
            0.5,
            Some(3),
            HashFormat::U64,
        )
        .unwrap();
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&0.5f64.to_be_bytes());
        expected.push(0x91); // one event
        expected.push(0x81); // a map of one entry
        expected.extend_from_slice(b"\xa4type\xb0AllBlocksCleared");
        expected.push(0x03);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn missing_rank_is_nil_and_hashes_are_low_64_bits_or_raw() {
        let hash: BlockHash = (7u128 << 64) | 0xFFFF_FFFF_FFFF_FFFF;
        let removed = WireEvent::BlockRemoved {
            block_hashes: vec![hash],
            medium: None,
            group_idx: None,
        };
        let ints =
            encode_event_batch(std::slice::from_ref(&removed), 0.0, None, HashFormat::U64).unwrap();
        assert_eq!(*ints.last().unwrap(), 0xc0); // rank nil
        let mut hash_u64 = vec![0xcf];
        hash_u64.extend_from_slice(&u64::MAX.to_be_bytes());
        assert!(ints.windows(9).any(|w| w == hash_u64.as_slice()));
        let raw = encode_event_batch(&[removed], 0.0, None, HashFormat::Bytes).unwrap();
        let mut hash_bin = vec![0xc4, 16];
        hash_bin.extend_from_slice(&hash.to_be_bytes());
        assert!(raw.windows(18).any(|w| w == hash_bin.as_slice()));
    }

    #[test]
    fn stored_event_writes_fields_in_vllm_order_and_omits_unset_extra_keys() {
        let event = KvEvent::BlockStored {
            block_hashes: vec![1],
            parent_block_hash: None,
            token_ids: vec![300],
            block_size: 1,
            extra_key: None,
            medium: Tier::Device,
            group_idx: None,
        };
        let bytes = encode_kv_events(&[event], 1.0, Some(0), HashFormat::U64).unwrap();
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.0f64.to_be_bytes());
        expected.extend_from_slice(&[0x91, 0x88]);
        expected.extend_from_slice(b"\xa4type\xabBlockStored");
        expected.extend_from_slice(b"\xacblock_hashes\x91\x01");
        expected.extend_from_slice(b"\xb1parent_block_hash\xc0");
        expected.extend_from_slice(b"\xa9token_ids\x91\xcd\x01\x2c");
        expected.extend_from_slice(b"\xaablock_size\x01");
        expected.extend_from_slice(b"\xa7lora_id\xc0");
        expected.extend_from_slice(b"\xa6medium\xa3GPU");
        expected.extend_from_slice(b"\xa9lora_name\xc0");
        expected.push(0x00);
        assert_eq!(bytes, expected);
    }

    /// A hybrid manager's events carry `group_idx` after the other fields (vLLM's
    /// declaration order), group 0 included: it is not vLLM's default (`None`).
    #[test]
    fn group_idx_is_written_last_when_set() {
        let stored = KvEvent::BlockStored {
            block_hashes: vec![1],
            parent_block_hash: None,
            token_ids: vec![2],
            block_size: 1,
            extra_key: Some(vec![7]),
            medium: Tier::Device,
            group_idx: Some(0),
        };
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium: Tier::Device,
            group_idx: Some(200),
        };
        let bytes = encode_kv_events(&[stored, removed], 1.0, Some(0), HashFormat::U64).unwrap();
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.0f64.to_be_bytes());
        expected.extend_from_slice(&[0x92, 0x8a]);
        expected.extend_from_slice(b"\xa4type\xabBlockStored");
        expected.extend_from_slice(b"\xacblock_hashes\x91\x01");
        expected.extend_from_slice(b"\xb1parent_block_hash\xc0");
        expected.extend_from_slice(b"\xa9token_ids\x91\x02");
        expected.extend_from_slice(b"\xaablock_size\x01");
        expected.extend_from_slice(b"\xa7lora_id\xc0");
        expected.extend_from_slice(b"\xa6medium\xa3GPU");
        expected.extend_from_slice(b"\xa9lora_name\xc0");
        expected.extend_from_slice(b"\xaaextra_keys\x91\x91\xc4\x01\x07");
        expected.extend_from_slice(b"\xa9group_idx\x00");
        expected.push(0x84);
        expected.extend_from_slice(b"\xa4type\xacBlockRemoved");
        expected.extend_from_slice(b"\xacblock_hashes\x91\x01");
        expected.extend_from_slice(b"\xa6medium\xa3GPU");
        expected.extend_from_slice(b"\xa9group_idx\xcc\xc8");
        expected.push(0x00);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn extra_key_goes_on_every_block_as_bytes() {
        let event = KvEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: Some(9),
            token_ids: vec![1, 2],
            block_size: 1,
            extra_key: Some(b"salt".to_vec()),
            medium: Tier::Device,
            group_idx: None,
        };
        let bytes = encode_kv_events(&[event], 1.0, Some(0), HashFormat::U64).unwrap();
        let tail = b"\xaaextra_keys\x92\x91\xc4\x04salt\x91\xc4\x04salt\x00";
        assert!(bytes.ends_with(tail));
        assert_eq!(bytes[11], 0x89); // nine map entries with extra_keys
    }

    #[test]
    fn negative_ints_take_the_signed_form() {
        let mut out = Vec::new();
        write_int(&mut out, -1).unwrap();
        write_int(&mut out, 200).unwrap();
        write_int(&mut out, -200).unwrap();
        assert_eq!(out, vec![0xff, 0xcc, 200, 0xd1, 0xff, 0x38]);
    }
}
