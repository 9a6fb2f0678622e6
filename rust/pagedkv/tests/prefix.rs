//! Prefix caching, one exact scenario per behaviour in docs/design.md, Prefix cache (block ids,
//! refcounts, eviction order and events asserted).

use pagedkv::{BlockHasher, BlockId, Error, KvCacheManager, KvEvent, ManagerConfig, Tier};

const SEED: u64 = 1234;

fn cached_manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
        hash_seed: SEED,
        enable_kv_events: true,
        ..Default::default()
    })
    .unwrap()
}

fn refcounts(kv: &KvCacheManager) -> Vec<u32> {
    (0..kv.num_blocks() as BlockId)
        .map(|b| kv.refcount(b).unwrap())
        .collect()
}

/// The hasher is XXH3-128 of the documented message, seeded (golden values from an
/// independent implementation are in src/prefix/hash.rs).
#[test]
fn block_hash_is_xxh3_128_of_the_documented_message() {
    let hasher = BlockHasher::new(SEED);
    assert_eq!(hasher.seed(), SEED);
    type Case<'a> = (Option<u128>, &'a [u32], Option<&'a [u8]>);
    let cases: [Case; 5] = [
        (None, &[], None),
        (None, &[1, 2, 3, 4], None),
        (Some(u128::MAX - 5), &[7; 16], Some(b"salt")),
        (Some(3), &[9, 8, 7], Some(b"")),
        (None, &[1], Some(b"exactly8")),
    ];
    for (parent, tokens, extra) in cases {
        let message = BlockHasher::message_bytes(parent, tokens, extra);
        assert_eq!(
            hasher.hash_block(parent, tokens, extra),
            xxhash_rust::xxh3::xxh3_128_with_seed(&message, SEED)
        );
    }
}

#[test]
fn miss_then_hit_three_full_blocks_plus_partial() {
    let mut kv = cached_manager(8, 4);
    let prompt: Vec<u32> = (100..114).collect(); // 14 tokens: 3 full blocks + 2
    assert_eq!(kv.add_sequence(1, &prompt, None).unwrap(), 0);
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1, 2, 3]);
    kv.free(1).unwrap();
    // Full blocks stay cached (tail first); the partial block went back to the pool.
    assert_eq!(kv.cached_blocks(), vec![2, 1, 0]);
    assert_eq!(kv.num_available_blocks(), 8);
    assert_eq!(kv.add_sequence(2, &prompt, None).unwrap(), 12);
    assert_eq!(kv.block_table(2).unwrap(), &[0, 1, 2, 3]);
    assert_eq!(refcounts(&kv)[..4], [1, 1, 1, 1]);
    assert!(kv.cached_blocks().is_empty());
    let s = kv.stats();
    assert_eq!((s.prefix_query_tokens, s.prefix_hit_tokens), (28, 12));
    assert!((s.prefix_hit_rate - 12.0 / 28.0).abs() < 1e-12);
    kv.check_invariants().unwrap();
}

#[test]
fn never_the_whole_prompt() {
    let mut kv = cached_manager(8, 4);
    let prompt: Vec<u32> = (0..8).collect(); // exactly 2 full blocks
    kv.add_sequence(1, &prompt, None).unwrap();
    assert_eq!(kv.add_sequence(2, &prompt, None).unwrap(), 4); // last block recomputed
    assert_eq!(kv.block_table(2).unwrap(), &[0, 2]);
    assert_eq!(refcounts(&kv)[..3], [2, 1, 1]);
    kv.check_invariants().unwrap();
}

#[test]
fn two_requests_share_prefix_blocks() {
    let mut kv = cached_manager(8, 4);
    let a: Vec<u32> = (0..14).collect();
    let mut b: Vec<u32> = (0..8).collect();
    b.extend([50, 51, 52, 53, 54]);
    kv.add_sequence(1, &a, None).unwrap();
    assert_eq!(kv.add_sequence(2, &b, None).unwrap(), 8);
    assert_eq!(kv.block_table(2).unwrap(), &[0, 1, 4, 5]);
    assert_eq!(refcounts(&kv)[..6], [2, 2, 1, 1, 1, 1]);
    assert_eq!(kv.stats().num_blocks_in_use, 6);
    kv.check_invariants().unwrap();
}

#[test]
fn hit_after_both_freed_lazy_eviction() {
    let mut kv = cached_manager(8, 4);
    let a: Vec<u32> = (0..14).collect();
    kv.add_sequence(1, &a, None).unwrap();
    kv.add_sequence(2, &a, None).unwrap();
    kv.free(1).unwrap();
    kv.free(2).unwrap();
    assert_eq!(kv.cached_blocks(), vec![2, 1, 0]);
    assert_eq!(kv.stats().num_blocks_in_use, 0);
    assert_eq!(kv.add_sequence(3, &a, None).unwrap(), 12);
    assert_eq!(kv.block_table(3).unwrap()[..3], [0, 1, 2]);
    kv.check_invariants().unwrap();
}

#[test]
fn exact_eviction_order_under_pressure() {
    let mut kv = cached_manager(4, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap(); // blocks 0, 1
    kv.free(1).unwrap();
    kv.add_sequence(2, &[5, 6, 7, 8], None).unwrap(); // blocks 2, 3
    kv.free(2).unwrap();
    assert_eq!(kv.cached_blocks(), vec![1, 0, 3, 2]);
    assert_eq!(kv.num_available_blocks(), 4);
    kv.add_sequence(3, &[9, 10], None).unwrap();
    assert_eq!(kv.block_table(3).unwrap(), &[1]);
    kv.add_sequence(4, &[11, 12, 13], None).unwrap();
    assert_eq!(kv.block_table(4).unwrap(), &[0, 3]);
    assert_eq!(kv.cached_blocks(), vec![2]);
    assert_eq!(kv.stats().blocks_evicted, 3);
    kv.check_invariants().unwrap();
}

#[test]
fn hit_blocks_not_evicted_while_other_blocks_are_free() {
    let mut kv = cached_manager(4, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap(); // blocks 0, 1
    kv.free(1).unwrap();
    kv.add_sequence(2, &[8, 8, 9, 9], None).unwrap(); // blocks 2, 3
    kv.free(2).unwrap();
    // LRU front is the hit chain itself; the new block must come from behind it.
    assert_eq!(kv.cached_blocks(), vec![1, 0, 3, 2]);
    assert_eq!(kv.add_sequence(3, &[1, 2, 3, 4, 5], None).unwrap(), 4);
    assert_eq!(kv.block_table(3).unwrap(), &[0, 1, 3]);
    assert_eq!(kv.cached_blocks(), vec![2]);
    // With a truly free block available, cached blocks are not touched at all.
    kv.free(3).unwrap();
    let mut kv = cached_manager(4, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap();
    kv.free(1).unwrap();
    kv.add_sequence(2, &[7, 7], None).unwrap();
    assert_eq!(kv.block_table(2).unwrap(), &[2]);
    assert_eq!(kv.cached_blocks(), vec![1, 0]);
    assert_eq!(kv.stats().blocks_evicted, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn reused_block_loses_stale_hash() {
    let mut kv = cached_manager(2, 2);
    kv.add_sequence(1, &[1, 2, 3], None).unwrap(); // block 0 full+indexed, block 1 partial
    kv.free(1).unwrap();
    assert_eq!(kv.cached_blocks(), vec![0]);
    kv.add_sequence(2, &[5, 6, 7, 8], None).unwrap(); // pool block 1, then evicts 0
    assert_eq!(kv.block_table(2).unwrap(), &[1, 0]);
    kv.free(2).unwrap();
    assert_eq!(
        kv.add_sequence(3, &[1, 2, 3], None).unwrap(),
        0,
        "stale hash served"
    );
    kv.check_invariants().unwrap();
}

#[test]
fn caching_disabled_gives_no_hits() {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 8,
        block_size: 4,
        ..Default::default()
    })
    .unwrap();
    let a: Vec<u32> = (0..14).collect();
    assert_eq!(kv.add_sequence(1, &a, None).unwrap(), 0);
    assert_eq!(kv.add_sequence(2, &a, None).unwrap(), 0);
    kv.free(1).unwrap();
    assert_eq!(kv.add_sequence(3, &a, None).unwrap(), 0);
    assert!(kv.take_events().is_empty());
    assert_eq!(kv.stats().num_cached_blocks, 0);
    assert_eq!(kv.stats().prefix_query_tokens, 0);
}

#[test]
fn salt_isolation() {
    let mut kv = cached_manager(16, 4);
    let a: Vec<u32> = (0..9).collect();
    kv.add_sequence(1, &a, Some(b"tenant-a")).unwrap();
    assert_eq!(kv.add_sequence(2, &a, Some(b"tenant-b")).unwrap(), 0);
    assert_eq!(kv.add_sequence(3, &a, None).unwrap(), 0);
    assert_eq!(kv.add_sequence(4, &a, Some(b"tenant-a")).unwrap(), 8);
    assert_eq!(
        kv.block_table(4).unwrap()[..2],
        kv.block_table(1).unwrap()[..2]
    );
    kv.check_invariants().unwrap();
}

#[test]
fn failed_allocation_changes_nothing() {
    let mut kv = cached_manager(4, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap(); // 0, 1
    kv.free(1).unwrap();
    kv.add_sequence(9, &[9, 9], None).unwrap(); // block 2; block 3 stays free
    kv.take_events();
    let (rc, lru, stats) = (refcounts(&kv), kv.cached_blocks(), kv.stats());
    // Hits 0 and 1 (revived) + 2 new blocks; only block 3 is spare: 4 needed, 3 available.
    let err = kv
        .add_sequence(2, &[1, 2, 3, 4, 5, 6, 7], None)
        .unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: 4,
            available_blocks: 3
        }
    );
    assert_eq!(refcounts(&kv), rc);
    assert_eq!(kv.cached_blocks(), lru);
    assert_eq!(kv.stats(), stats);
    assert!(kv.take_events().is_empty());
    assert!(!kv.contains(2));
    // The hit chain is intact afterwards.
    assert_eq!(kv.add_sequence(2, &[1, 2, 3, 4, 5], None).unwrap(), 4);
    kv.check_invariants().unwrap();
}

#[test]
fn decode_filled_blocks_become_hittable() {
    let mut kv = cached_manager(8, 2);
    kv.add_sequence(1, &[1, 2, 3], None).unwrap();
    kv.append_tokens(1, &[4]).unwrap(); // fills block 1
    kv.append_tokens(1, &[5, 6, 7]).unwrap(); // fills block 2, starts block 3
    kv.free(1).unwrap();
    assert_eq!(kv.cached_blocks(), vec![2, 1, 0]);
    assert_eq!(kv.add_sequence(2, &[1, 2, 3, 4, 5, 6, 7], None).unwrap(), 6);
    assert_eq!(kv.block_table(2).unwrap()[..3], [0, 1, 2]);
    // Tokens appended without ids end hashing for that sequence.
    kv.append_len(2, 1).unwrap();
    kv.append_tokens(2, &[9, 9]).unwrap();
    kv.free(2).unwrap();
    assert_eq!(kv.cached_blocks(), vec![2, 1, 0]);
    kv.check_invariants().unwrap();
}

#[test]
fn event_sequence_store_evict_store_reset() {
    let mut kv = cached_manager(2, 2);
    let h = BlockHasher::new(SEED);
    let h1 = h.hash_block(None, &[1, 2], None);
    let h2 = h.hash_block(Some(h1), &[3, 4], None);
    let h3 = h.hash_block(None, &[5, 6], None);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap();
    kv.free(1).unwrap();
    kv.add_sequence(2, &[5, 6, 7], None).unwrap(); // evicts 1 then 0
    kv.free(2).unwrap();
    assert!(kv.reset_prefix_cache());
    let stored = |hashes: Vec<u128>, parent, tokens: Vec<u32>| KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: 2,
        extra_key: None,
        medium: Tier::Device,
        group_idx: None,
    };
    let removed = |hash| KvEvent::BlockRemoved {
        block_hashes: vec![hash],
        medium: Tier::Device,
        group_idx: None,
    };
    assert_eq!(
        kv.take_events(),
        vec![
            stored(vec![h1, h2], None, vec![1, 2, 3, 4]),
            removed(h2),
            removed(h1),
            stored(vec![h3], None, vec![5, 6]),
            KvEvent::AllBlocksCleared,
        ]
    );
    assert_eq!(kv.num_available_blocks(), 2);
    assert_eq!(kv.stats().num_cached_blocks, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn bounded_event_queue_drops_oldest() {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 8,
        block_size: 1,
        enable_prefix_caching: true,
        max_events: 2,
        enable_kv_events: true,
        ..Default::default()
    })
    .unwrap();
    kv.add_sequence(1, &[1], None).unwrap();
    kv.append_tokens(1, &[2]).unwrap();
    kv.append_tokens(1, &[3]).unwrap();
    let events = kv.take_events();
    assert_eq!(events.len(), 2);
    assert!(matches!(&events[0], KvEvent::BlockStored { token_ids, .. } if token_ids == &[2]));
    assert_eq!(kv.stats().events_dropped, 1);
}

#[test]
fn reset_refuses_while_blocks_in_use() {
    let mut kv = cached_manager(4, 2);
    kv.add_sequence(1, &[1, 2, 3], None).unwrap();
    assert!(!kv.reset_prefix_cache());
    assert!(kv
        .take_events()
        .iter()
        .all(|e| !matches!(e, KvEvent::AllBlocksCleared)));
    kv.free(1).unwrap();
    assert!(kv.reset_prefix_cache());
    assert_eq!(kv.add_sequence(2, &[1, 2, 3], None).unwrap(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn fork_children_fill_blocks_independently() {
    let mut kv = cached_manager(8, 2);
    kv.add_sequence(1, &[1, 2, 3], None).unwrap();
    kv.fork(1, 2).unwrap();
    kv.append_tokens(2, &[4]).unwrap(); // CoW copy of block 1, then full -> indexed
    kv.append_tokens(1, &[4]).unwrap(); // same content, indexed on block 2 (in use): private
    assert_eq!(kv.take_copy_ops(), vec![(1, 2)]);
    let stored = kv.take_events();
    assert_eq!(stored.len(), 2, "one BlockStored per content: {stored:?}");
    kv.free(1).unwrap(); // block 1, private, goes back to the pool
    kv.free(2).unwrap();
    assert_eq!(kv.cached_blocks(), vec![2, 0]);
    assert_eq!(kv.pool().num_free_list_blocks(), 6);
    assert_eq!(kv.add_sequence(3, &[1, 2, 3, 4, 5], None).unwrap(), 4);
    // The hit takes the one indexed copy.
    assert_eq!(kv.block_table(3).unwrap()[..2], [0, 2]);
    assert!(kv.cached_blocks().is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn a_recomputed_block_replaces_its_cached_copy_in_the_index() {
    // A prompt of two full blocks: its last full block is always recomputed, so the second
    // admission computes [3, 4] again while the first's copy is cached. The index keeps the
    // copy in use; the cached one goes back to the pool, with no event (the content stays
    // stored).
    let mut kv = cached_manager(8, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap();
    kv.free(1).unwrap();
    kv.take_events();
    assert_eq!(kv.cached_blocks(), vec![1, 0]);
    assert_eq!(kv.add_sequence(2, &[1, 2, 3, 4], None).unwrap(), 2);
    assert_eq!(kv.block_table(2).unwrap(), &[0, 2]);
    assert!(kv.take_events().is_empty());
    assert!(kv.cached_blocks().is_empty());
    assert_eq!(kv.pool().num_free_list_blocks(), 6); // block 1 is free again
    kv.free(2).unwrap();
    assert_eq!(kv.add_sequence(3, &[1, 2, 3, 4, 5], None).unwrap(), 4);
    assert_eq!(kv.block_table(3).unwrap()[..2], [0, 2]);
    kv.check_invariants().unwrap();
}

#[test]
fn truncate_in_the_middle_of_a_chain_loses_no_hit() {
    // Block size 1; sequence 1 holds P[:4] + [9], sequence 2 computes P's blocks 4..6
    // after sharing the first four, is freed (they stay cached), then sequence 1 drops its
    // blocks 2..4. Sequence 3 recomputes blocks 2..4: its block 4 replaces the cached copy,
    // whose cached successors stay reachable. A hit was 5 where the events said 6 tokens are
    // stored.
    let mut kv = cached_manager(32, 1);
    let p: Vec<u32> = (1..=7).collect();
    let mut first = p[..4].to_vec();
    first.push(9);
    kv.add_sequence(1, &first, None).unwrap();
    kv.add_sequence_scheduled(2, &p, None, 3).unwrap();
    kv.free(2).unwrap();
    kv.truncate(1, 2).unwrap();
    kv.add_sequence_scheduled(3, &p, None, 3).unwrap();
    assert_eq!(kv.match_prefix(&p, None), Ok(6));
    kv.check_invariants().unwrap();
    // What the events say is stored: P's six blocks.
    let mut stored = std::collections::HashSet::new();
    for event in kv.take_events() {
        match event {
            KvEvent::BlockStored { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(stored.insert(h), "stored twice");
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(stored.remove(&h), "removed but not stored");
                }
            }
            KvEvent::AllBlocksCleared => stored.clear(),
        }
    }
    let hashes = kv.prefix_block_hashes(&p, None);
    assert!(hashes[..6].iter().all(|h| stored.contains(h)));
}

/// Admission revives its cached hits before it evicts for its new blocks: a hit at the front of
/// the LRU is never the block evicted, and a shortage counts the pinned hits on both sides.
#[test]
fn admission_never_evicts_its_own_cached_hits() {
    let mut kv = cached_manager(6, 2);
    kv.add_sequence(1, &[1, 2, 3, 4], None).unwrap(); // blocks 0, 1
    kv.add_sequence(2, &[5, 6], None).unwrap(); // block 2
    kv.add_sequence_len(3, 1).unwrap(); // block 3
    kv.free(1).unwrap();
    kv.free(2).unwrap();
    assert_eq!(kv.cached_blocks(), vec![1, 0, 2]); // the hits lead the eviction order
    kv.take_events();

    // 5 blocks: hits 0 and 1, then the pool's 4 and 5, then one eviction (block 2, not 1).
    let prompt = [1, 2, 3, 4, 7, 7, 8, 8, 9];
    let mut small = cached_manager(6, 2);
    small.add_sequence(1, &[1, 2, 3, 4], None).unwrap();
    small.add_sequence_len(2, 3).unwrap(); // blocks 2, 3: only 4, 5 stay free
    small.free(1).unwrap();
    assert_eq!(
        small.add_sequence(4, &prompt, None),
        Err(Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: 5,
            available_blocks: 4,
        })
    );
    assert_eq!(small.cached_blocks(), vec![1, 0]); // nothing moved
    small.check_invariants().unwrap();

    assert_eq!(kv.add_sequence(4, &prompt, None).unwrap(), 4);
    assert_eq!(kv.block_table(4).unwrap(), &[0, 1, 4, 5, 2]);
    assert!(kv.cached_blocks().is_empty());
    assert_eq!(refcounts(&kv), vec![1, 1, 1, 1, 1, 1]);
    let events = kv.take_events();
    assert!(
        matches!(&events[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1)
    );
    assert!(matches!(
        &events[1],
        KvEvent::BlockStored { token_ids, .. } if token_ids == &[7, 7, 8, 8]
    ));
    assert_eq!(events.len(), 2);
    assert_eq!(kv.stats().blocks_evicted, 1);
    kv.check_invariants().unwrap();
}
