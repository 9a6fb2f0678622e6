//! The wire bytes, checked against msgpack written by hand and against vLLM's field order.

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
        encode_drained_events(&DrainedEvents::default(), 1.0, None, HashFormat::U64)
            .is_ok_and(|bytes| bytes == encode_kv_events(&[], 1.0, None, HashFormat::U64).unwrap())
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
