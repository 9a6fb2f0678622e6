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
//! Compiled only with the cargo feature `wire` (it adds the `rmp` dependency). The events as
//! they go on the wire ([`WireEvent`], from the core's `KvEvent`) are `wire/event.rs`; this file
//! writes their bytes.
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

mod event;
#[cfg(test)]
mod tests;

pub use event::{medium_name, ExtraKeyItem, WireEvent};

/// How block hashes go on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashFormat {
    /// The low 64 bits as an unsigned msgpack int (vLLM's default; what routers index by).
    #[default]
    U64,
    /// The whole 128-bit hash as 16 big-endian bytes (msgpack bin).
    Bytes,
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
