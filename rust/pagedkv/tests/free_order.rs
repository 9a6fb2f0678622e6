//! The eviction order a freed hybrid sequence leaves: `free` queues its cached blocks group
//! after group (each table tail first, as vLLM's plain free), `free_last_group_first` the last
//! group's first (as vLLM's scheduler returns a deferred free's blocks: the popped list,
//! group after group, reversed in one call). Later admissions evict in that order.

use pagedkv::{AdmitOptions, BlockId, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt};

const BLOCK_SIZE: usize = 2;

/// Full attention beside a window wider than every sequence (no release): 6 blocks, all of
/// them taken by one 6-token sequence (3 per group), every block computed and indexed.
fn one_full_pool() -> (KvCacheManager, [Vec<BlockId>; 2]) {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 6,
        block_size: BLOCK_SIZE,
        enable_prefix_caching: true,
        kv_groups: vec![
            KvGroupSpec::FullAttention,
            KvGroupSpec::SlidingWindow { window: 100 },
        ],
        ..Default::default()
    })
    .unwrap();
    let prompt: Vec<u32> = (1..=6).collect();
    let o = AdmitOptions {
        num_scheduled: 6,
        reserve_prompt: false,
        ..Default::default()
    };
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o)
        .unwrap();
    let tables = [0, 1].map(|g| kv.block_table_group(1, g).unwrap().to_vec());
    assert_eq!(kv.pool().num_free_list_blocks(), 0);
    (kv, tables)
}

/// The blocks each of three one-block admissions of new content takes (both groups: two
/// blocks, evicted from the head of the eviction order).
fn evicted_pairs(kv: &mut KvCacheManager) -> Vec<Vec<BlockId>> {
    let o = AdmitOptions {
        num_scheduled: 2,
        reserve_prompt: false,
        ..Default::default()
    };
    (0..3u32)
        .map(|i| {
            let seq = 10 + u64::from(i);
            let tokens = [100 + 2 * i, 101 + 2 * i];
            kv.add_sequence_with(seq, Prompt::Tokens(&tokens), &o)
                .unwrap();
            kv.check_invariants().unwrap();
            let mut taken: Vec<BlockId> = (0..2)
                .flat_map(|g| kv.block_table_group(seq, g).unwrap().to_vec())
                .collect();
            taken.sort_unstable();
            taken
        })
        .collect()
}

fn sorted(mut pair: Vec<BlockId>) -> Vec<BlockId> {
    pair.sort_unstable();
    pair
}

#[test]
fn free_queues_the_first_groups_cached_blocks_first() {
    let (mut kv, [full, window]) = one_full_pool();
    kv.free(1).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(
        evicted_pairs(&mut kv),
        vec![
            sorted(vec![full[2], full[1]]),
            sorted(vec![full[0], window[2]]),
            sorted(vec![window[1], window[0]]),
        ]
    );
}

#[test]
fn free_last_group_first_queues_the_last_groups_cached_blocks_first() {
    let (mut kv, [full, window]) = one_full_pool();
    kv.free_last_group_first(1).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_sequences(), 0);
    assert_eq!(
        evicted_pairs(&mut kv),
        vec![
            sorted(vec![window[2], window[1]]),
            sorted(vec![window[0], full[2]]),
            sorted(vec![full[1], full[0]]),
        ]
    );
}

#[test]
fn free_last_group_first_of_an_unknown_sequence_changes_nothing() {
    let (mut kv, _) = one_full_pool();
    assert_eq!(kv.free_last_group_first(9), Err(Error::UnknownSequence(9)));
    assert_eq!(kv.num_sequences(), 1);
    kv.check_invariants().unwrap();
    kv.free_last_group_first(1).unwrap();
    assert_eq!(kv.free_last_group_first(1), Err(Error::UnknownSequence(1)));
}
