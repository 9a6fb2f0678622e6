//! The diverged hit (`AdmitOptions::diverged_hit`, manager/state_diverged.rs; docs/design.md,
//! KV groups, "State groups"): full attention's own run admitted with a connector's tokens
//! where the state group's own hit lags it. vLLM's tables (the state group's hit positions
//! null, one block at the last external token, one at the chunk's end), vLLM's count (its own
//! lagging hit block counted when cached-evictable, never taken), its same-step refusal on
//! that block, and the configs the option refuses. The same cases run against vLLM's own
//! manager in tests/vllm/test_vllm_mamba_diverged.py.

use pagedkv::{
    AdmitOptions, BlockId, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt, NULL_BLOCK,
};

const BS: usize = 2;

/// A manager of 16 blocks on which `[1..=8]` was computed one block per step and freed,
/// then the state blocks of blocks 1..4 evicted: full attention holds 4 cached blocks, the
/// state group block 0's state only (cached-evictable, or evicted too with `evict_first`);
/// a sequence without token ids holds free blocks so that `available` are left (the cached
/// ones among them). Returns it and full attention's blocks.
fn seeded(available: usize, evict_first: bool) -> (KvCacheManager, Vec<BlockId>) {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 16,
        block_size: BS,
        enable_prefix_caching: true,
        kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
        ..Default::default()
    })
    .unwrap();
    kv.new_step();
    let first = AdmitOptions {
        reserve_prompt: false,
        num_scheduled: BS,
        ..Default::default()
    };
    let prompt: Vec<u32> = (1..=8).collect();
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &first)
        .unwrap();
    let mut states = vec![kv.block_table_group(1, 1).unwrap()[0]];
    for i in 1..4 {
        kv.new_step();
        assert!(kv.allocate_slots(1, BS, 0).unwrap());
        states.push(kv.block_table_group(1, 1).unwrap()[i]);
    }
    let full = kv.block_table_group(1, 0).unwrap().to_vec();
    kv.free(1).unwrap();
    kv.new_step();
    let from = usize::from(!evict_first);
    kv.evict_blocks(&states[from..]).unwrap();
    // The holder's full-attention blocks and its one state block.
    let held = 16 - available;
    if held > 0 {
        kv.add_sequence_len(99, (held - 1) * BS).unwrap();
    }
    assert_eq!(kv.num_available_blocks(), available);
    kv.check_invariants().unwrap();
    (kv, full)
}

/// The replay: the seeded 8 tokens and 4 more.
const REPLAY: [u32; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

fn diverged(num_scheduled: usize, external: usize) -> AdmitOptions<'static> {
    AdmitOptions {
        reserve_prompt: false,
        require_full_prompt: false,
        num_scheduled,
        num_external_computed_tokens: external,
        diverged_hit: true,
        ..Default::default()
    }
}

/// Full attention's 4 blocks are the hit (the reconciled one is 1 block); the state group's
/// hit positions and the one the external tokens end in hold the null block up to
/// `(k*bs + e - 1) / bs`, then one block there and one at the chunk's end; the own hit
/// block stays cached, not taken. Freed and admitted again, the same.
#[test]
fn the_hit_is_full_attentions_run_and_the_state_group_restarts_past_it() {
    let (mut kv, full) = seeded(12, false);
    let reconciled = AdmitOptions {
        diverged_hit: false,
        ..diverged(4, 2)
    };
    assert_eq!(kv.match_prefix_with(&REPLAY, &reconciled).unwrap(), BS);
    // Readmitted, full attention's run and the state group's own hit are 5 blocks (block 4
    // entered by the first admission): not diverged any more, the same rule.
    for (round, k) in [(0, 4), (1, 5)] {
        let hit = kv
            .add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2))
            .unwrap();
        assert_eq!(hit, k * BS, "round {round}");
        assert_eq!(kv.block_table_group(2, 0).unwrap()[..4], full[..]);
        let state = kv.block_table_group(2, 1).unwrap();
        assert_eq!(state.len(), 6);
        let live: Vec<usize> = (0..6).filter(|&i| state[i] != NULL_BLOCK).collect();
        // Nulls up to (k*bs + e - 1) / bs, one block there and one at the chunk's end.
        assert_eq!(
            live,
            [(k * BS + 1) / BS, 5]
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
        );
        assert_eq!(kv.num_computed_tokens(2).unwrap(), 12);
        kv.check_invariants().unwrap();
        kv.free(2).unwrap();
        kv.new_step();
        kv.check_invariants().unwrap();
    }
}

/// A chunk ending in the external tokens' block: the state group takes one block, vLLM
/// counts it plus its own cached-evictable hit block, so with 6 available (the allocation's
/// 1 + 1 + the 4 revived) the admission is refused as vLLM refuses it (7 needed); with 7 it
/// is admitted. Without the lagging block cached (evicted too), the count is 6: admitted
/// on 6.
#[test]
fn the_own_lagging_state_block_is_counted_when_evictable() {
    let (mut kv, _) = seeded(6, false);
    assert_eq!(kv.num_available_blocks(), 6);
    match kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(2, 1)) {
        Err(Error::OutOfBlocks {
            needed_blocks: 7,
            available_blocks: 6,
            ..
        }) => {}
        other => panic!("expected vLLM's refusal, got {other:?}"),
    }
    assert_eq!(kv.num_available_blocks(), 6);
    kv.check_invariants().unwrap();
    let (mut kv, _) = seeded(7, false);
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(2, 1))
            .unwrap(),
        4 * BS
    );
    let state = kv.block_table_group(2, 1).unwrap();
    assert_eq!((state.len(), state[4] != NULL_BLOCK), (5, true));
    kv.check_invariants().unwrap();
    let (mut kv, _) = seeded(6, true);
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(2, 1))
            .unwrap(),
        4 * BS
    );
    kv.check_invariants().unwrap();
}

/// Two state blocks taken, one counted (no lagging block cached): vLLM's count passes 7
/// available (2 + 4 + 1) where its `get_new_blocks` would raise for the 8th block; the core
/// refuses with `OutOfBlocks` and changes nothing. On 8 it is admitted.
#[test]
fn a_pool_short_of_the_blocks_taken_is_out_of_blocks_unchanged() {
    let (mut kv, _) = seeded(7, true);
    let before = kv.num_available_blocks();
    assert!(matches!(
        kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2)),
        Err(Error::OutOfBlocks {
            needed_blocks: 8,
            available_blocks: 7,
            ..
        })
    ));
    assert_eq!(kv.num_available_blocks(), before);
    assert!(kv.block_table(2).is_err());
    kv.check_invariants().unwrap();
    let (mut kv, _) = seeded(8, true);
    kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2))
        .unwrap();
    kv.check_invariants().unwrap();
}

/// vLLM's same-step refusal looks at the state group's own hit block: cached in this step
/// (another sequence just computed it), the admission is `OutOfBlocks` with the pool's
/// blocks plus one; in the next step it is admitted.
#[test]
fn a_lagging_state_cached_this_step_waits_for_the_next() {
    let (mut kv, _) = seeded(16, true);
    let usable = kv.num_available_blocks();
    let whole = AdmitOptions {
        reserve_prompt: false,
        ..Default::default()
    };
    kv.add_sequence_with(3, Prompt::Tokens(&[1, 2]), &whole)
        .unwrap();
    match kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2)) {
        Err(Error::OutOfBlocks { needed_blocks, .. }) => assert_eq!(needed_blocks, usable + 1),
        other => panic!("expected the same-step refusal, got {other:?}"),
    }
    kv.check_invariants().unwrap();
    kv.new_step();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2))
            .unwrap(),
        4 * BS
    );
    kv.check_invariants().unwrap();
}

/// The option outside its configs is `InvalidArgument`, nothing changed: without external
/// tokens, under the reserve contract, without token ids, beside a window group, on full
/// attention alone, without prefix caching.
#[test]
fn the_option_is_refused_outside_its_configs() {
    let (mut kv, _) = seeded(12, false);
    let available = kv.num_available_blocks();
    let cases = [
        (Prompt::Tokens(&REPLAY), diverged(4, 0)),
        (
            Prompt::Tokens(&REPLAY),
            AdmitOptions {
                reserve_prompt: true,
                ..diverged(4, 2)
            },
        ),
        (Prompt::Len(12), diverged(4, 2)),
    ];
    for (prompt, o) in cases {
        assert!(matches!(
            kv.add_sequence_with(2, prompt, &o),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(kv.num_available_blocks(), available);
        kv.check_invariants().unwrap();
    }
    for (groups, caching) in [
        (vec![KvGroupSpec::FullAttention], true),
        (
            vec![
                KvGroupSpec::FullAttention,
                KvGroupSpec::MambaState,
                KvGroupSpec::SlidingWindow { window: 4 },
            ],
            true,
        ),
        (
            vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
            false,
        ),
    ] {
        let mut kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 16,
            block_size: BS,
            enable_prefix_caching: caching,
            kv_groups: groups,
            ..Default::default()
        })
        .unwrap();
        assert!(matches!(
            kv.add_sequence_with(2, Prompt::Tokens(&REPLAY), &diverged(4, 2)),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(kv.num_available_blocks(), 16);
        kv.check_invariants().unwrap();
    }
}
