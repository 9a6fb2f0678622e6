//! A hybrid sequence allocated per chunk runs past `num_blocks / groups` table positions: its
//! sliding-window group releases what its window passed, so the "can never fit" bound of
//! `allocate_slots` and of a per-chunk admission counts the positions each group keeps, not
//! the table's length times the group count (docs/design.md, Per-chunk allocation).

use pagedkv::{AdmitOptions, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt};

fn hybrid(num_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: 2,
        kv_groups: vec![
            KvGroupSpec::FullAttention,
            KvGroupSpec::SlidingWindow { window: 2 },
        ],
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn a_window_group_past_the_pool_over_groups_still_grows() {
    let mut kv = hybrid(8);
    let o = AdmitOptions {
        num_scheduled: 2,
        reserve_prompt: false,
        ..Default::default()
    };
    kv.add_sequence_with(1, Prompt::Len(2), &o).unwrap();
    // 12 tokens: 6 positions in each group, 12 > 8 blocks by table length; the window group
    // keeps 2 of them, so 8 blocks at most.
    for _ in 0..5 {
        assert!(kv.allocate_slots(1, 2, 0).unwrap());
        kv.check_invariants().unwrap();
    }
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 12);
    // Past what even the window's release leaves: never fits.
    assert!(kv.allocate_slots(1, 4, 0).is_err());
}

#[test]
fn a_per_chunk_admission_after_a_long_hit_counts_the_window_groups_live_blocks() {
    // Prefix caching: a 12-token prompt computed once, then admitted again with its hit (10
    // tokens). vLLM's admission check: 6 full blocks + the window's cap of 3 (2 tokens in
    // flight) = 9; the hit and the chunk span 6 positions per group, of which the window group
    // keeps 2: 8 blocks, not 12.
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 9,
        block_size: 2,
        enable_prefix_caching: true,
        max_in_flight_tokens: Some(2),
        kv_groups: vec![
            KvGroupSpec::FullAttention,
            KvGroupSpec::SlidingWindow { window: 2 },
        ],
        ..Default::default()
    })
    .unwrap();
    let prompt: Vec<u32> = (1..=12).collect();
    let o = AdmitOptions {
        num_scheduled: 2,
        reserve_prompt: false,
        ..Default::default()
    };
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o)
        .unwrap();
    for _ in 0..5 {
        assert!(kv.allocate_slots(1, 2, 0).unwrap());
    }
    kv.free(1).unwrap();
    let hit = kv
        .add_sequence_with(2, Prompt::Tokens(&prompt), &o)
        .unwrap();
    assert_eq!(hit, 10);
    kv.check_invariants().unwrap();
}
