//! Live private duplicates keep their content's hits (docs/design.md, One copy per content;
//! src/prefix/index/duplicates.rs): when the indexed copy of a content leaves the index, a
//! running request's private copy of it takes the entry, with no event.
//!
//! The first test is the case traced in the vLLM integration (asynchronous KV loads): a load in
//! flight for one request while another computes the same prompt; the load finishes (its blocks
//! stay private copies), the other request finishes and pressure evicts its blocks. Under the
//! plain one-copy rule the hit fell to nothing although the loaded request still held every
//! block; vLLM, indexing both copies, kept it.

use pagedkv::{AdmitOptions, KvCacheManager, KvEvent, KvGroupSpec, ManagerConfig, Prompt};

const BS: usize = 16;

fn manager(num_blocks: usize, kv_groups: Vec<KvGroupSpec>) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: BS,
        enable_prefix_caching: true,
        enable_kv_events: true,
        kv_groups,
        ..Default::default()
    })
    .unwrap()
}

/// 7 full blocks and one token: a hit covers at most the 112 tokens of the full blocks.
fn prompt() -> Vec<u32> {
    (0..7 * BS as u32 + 1).map(|i| i * 3 + 1).collect()
}

/// The removals among `events` (hashes).
fn removed(events: &[KvEvent]) -> Vec<u128> {
    events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => vec![],
        })
        .collect()
}

/// Request 7's load in flight (admitted, nothing computed), request 9 computes the same prompt;
/// 7's load finishes: its blocks are private copies of 9's.
fn two_copies(kv: &mut KvCacheManager, tokens: &[u32]) {
    kv.add_sequence_scheduled(7, tokens, None, 0).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.add_sequence(9, tokens, None).unwrap(), 0);
    kv.check_invariants().unwrap();
    kv.advance_computed(&[7], tokens.len()).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.match_prefix(tokens, None).unwrap(), 7 * BS);
}

/// Takes every block the pool has left (evicting every cached one) with sequences without
/// tokens (ids from `id`; `groups` KV groups), then frees them.
fn pressure(kv: &mut KvCacheManager, id: u64, groups: usize) {
    let mut ids = vec![];
    while kv.stats().num_cached_blocks > 0 {
        let n = (kv.num_available_blocks() / groups).max(1);
        let next = id + ids.len() as u64;
        kv.add_sequence_len(next, n * BS).unwrap();
        kv.check_invariants().unwrap();
        ids.push(next);
        assert!(ids.len() < 10, "the cached blocks were not evicted");
    }
    for i in ids {
        kv.free(i).unwrap();
        kv.check_invariants().unwrap();
    }
}

#[test]
fn a_loaded_copy_keeps_the_hit_after_the_computed_copy_is_evicted() {
    let tokens = prompt();
    let mut kv = manager(20, vec![KvGroupSpec::FullAttention]);
    two_copies(&mut kv, &tokens);
    let hashes = kv.prefix_block_hashes(&tokens, None);
    kv.take_events();
    // Request 9 finishes: its blocks are cached-evictable. Pressure evicts every one.
    kv.free(9).unwrap();
    kv.check_invariants().unwrap();
    let evicted_before = kv.stats().blocks_evicted;
    pressure(&mut kv, 100, 1);
    assert!(kv.stats().blocks_evicted >= evicted_before + 7);
    // Request 7's copies took the entries: the whole prompt still hits, on request 7's blocks,
    // and no event says the content left.
    assert_eq!(kv.match_prefix(&tokens, None).unwrap(), 7 * BS);
    let events = kv.take_events();
    assert!(
        removed(&events).iter().all(|h| !hashes.contains(h)),
        "a moved content was reported removed"
    );
    let table7 = kv.block_table(7).unwrap().to_vec();
    assert_eq!(kv.add_sequence(11, &tokens, None).unwrap(), 7 * BS);
    assert_eq!(&kv.block_table(11).unwrap()[..7], &table7[..7]);
    kv.check_invariants().unwrap();
    // Request 7 finishes too: its blocks, now the indexed copies, are cached.
    kv.free(11).unwrap();
    kv.free(7).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().num_cached_blocks, 7);
    assert!(kv.reset_prefix_cache());
    kv.check_invariants().unwrap();
}

#[test]
fn a_copy_freed_first_moves_nothing() {
    let tokens = prompt();
    let mut kv = manager(20, vec![KvGroupSpec::FullAttention]);
    two_copies(&mut kv, &tokens);
    let hashes = kv.prefix_block_hashes(&tokens, None);
    // Request 7 (the private copies) finishes first: its blocks go back to the free list.
    kv.free(7).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().num_cached_blocks, 0);
    kv.free(9).unwrap();
    kv.take_events();
    pressure(&mut kv, 100, 1);
    assert_eq!(kv.match_prefix(&tokens, None).unwrap(), 0);
    let gone = removed(&kv.take_events());
    assert!(hashes[..7].iter().all(|h| gone.contains(h)));
}

#[test]
fn a_truncated_indexed_copy_hands_its_entry_to_the_copy_in_use() {
    let tokens = prompt();
    let mut kv = manager(20, vec![KvGroupSpec::FullAttention]);
    two_copies(&mut kv, &tokens);
    kv.take_events();
    // Request 9 drops its last 3 full blocks (and keeps block 3 partial): without the copies
    // their content would leave the index (`BlockRemoved`).
    kv.truncate(9, 3 * BS + 5).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.match_prefix(&tokens, None).unwrap(), 7 * BS);
    assert!(removed(&kv.take_events()).is_empty());
    // Request 7 now holds the indexed copies of blocks 3..7, still private copies of blocks
    // 0..3. Truncated into block 1, its copy there is untracked (it will be written), and the
    // dropped blocks' content leaves the index as truncate's always does (blocks 3..7: request
    // 9 holds the first three).
    kv.truncate(7, BS + 3).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.match_prefix(&tokens, None).unwrap(), 3 * BS);
    assert_eq!(removed(&kv.take_events()).len(), 4);
    kv.free(9).unwrap();
    kv.free(7).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn forked_and_swapped_copies_are_tracked_while_live() {
    let tokens = prompt();
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 24,
        block_size: BS,
        enable_prefix_caching: true,
        num_host_blocks: 16,
        ..Default::default()
    })
    .unwrap();
    two_copies(&mut kv, &tokens);
    // A fork shares request 7's copies (refcount 2); 7 itself swaps out: the fork keeps them
    // live, and tracked.
    kv.fork(7, 8).unwrap();
    kv.swap_out(&[7]).unwrap();
    kv.check_invariants().unwrap();
    kv.free(9).unwrap();
    pressure(&mut kv, 100, 1);
    assert_eq!(kv.match_prefix(&tokens, None).unwrap(), 7 * BS);
    kv.free(8).unwrap();
    kv.check_invariants().unwrap();
    kv.swap_in(&[7]).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn caller_hashes_and_window_groups_keep_copies_per_group() {
    let tokens = prompt();
    let groups = vec![
        KvGroupSpec::FullAttention,
        KvGroupSpec::SlidingWindow { window: 4 * BS },
    ];
    let mut kv = manager(48, groups);
    let hashes: Vec<u128> = (1..=7).map(|i| 1000 + i).collect();
    let o = |scheduled| AdmitOptions {
        num_scheduled: scheduled,
        reserve_prompt: true,
        block_hashes: Some(&hashes),
        ..Default::default()
    };
    kv.add_sequence_with(7, Prompt::Tokens(&tokens), &o(0))
        .unwrap();
    kv.add_sequence_with(9, Prompt::Tokens(&tokens), &o(usize::MAX))
        .unwrap();
    kv.advance_computed(&[7], tokens.len()).unwrap();
    kv.check_invariants().unwrap();
    kv.free(9).unwrap();
    pressure(&mut kv, 100, 2);
    // Both groups' entries moved to request 7's copies (the window group's for the blocks
    // its window keeps).
    let hit = kv.match_prefix_with(&tokens, &o(0)).unwrap();
    assert_eq!(hit, 7 * BS);
}
