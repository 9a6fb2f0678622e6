//! Per-chunk admission with and without vLLM's whole-prompt check (`AdmitOptions::
//! require_full_prompt`, vLLM's `allocate_slots(..., full_sequence_must_fit=...)`; docs/design.md,
//! Per-chunk allocation): without it only the scheduled chunk (plus lookahead) and the
//! watermark must fit, and a refusal still changes nothing.

use pagedkv::{AdmitOptions, BlockId, Error, KvCacheManager, ManagerConfig, Prompt, Stats};

fn manager(num_blocks: usize, watermark_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: 4,
        enable_prefix_caching: true,
        watermark_blocks,
        ..Default::default()
    })
    .unwrap()
}

fn per_chunk(num_scheduled: usize, require_full_prompt: bool) -> AdmitOptions<'static> {
    AdmitOptions {
        num_scheduled,
        reserve_prompt: false,
        require_full_prompt,
        ..Default::default()
    }
}

/// The state a refusal must leave as it was.
fn snapshot(kv: &KvCacheManager) -> (Stats, Vec<(u64, Vec<BlockId>, usize)>) {
    let mut seqs: Vec<_> = kv
        .seq_ids()
        .map(|s| {
            let t = kv.block_table(s).unwrap().to_vec();
            (s, t, kv.num_computed_tokens(s).unwrap())
        })
        .collect();
    seqs.sort_unstable();
    (kv.stats(), seqs)
}

#[test]
fn a_prompt_longer_than_the_pool_is_admitted_chunk_by_chunk_without_the_whole_prompt_check() {
    let mut kv = manager(8, 0);
    let prompt: Vec<u32> = (0..40).collect(); // 10 blocks > 8
    let before = snapshot(&kv);
    let whole = kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(6, true));
    assert!(matches!(whole, Err(Error::InvalidArgument(_))), "{whole:?}");
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();

    assert_eq!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(6, false))
            .unwrap(),
        0
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.block_table(1).unwrap().len(), 2);
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 6);
    // Another sequence takes a block; the first grows while the pool lasts (7 blocks), then
    // is refused (vLLM preempts).
    kv.add_sequence(2, &[7, 7, 7, 7], None).unwrap();
    for _ in 0..5 {
        assert!(kv.allocate_slots(1, 4, 0).unwrap());
        kv.check_invariants().unwrap();
    }
    assert_eq!(kv.block_table(1).unwrap().len(), 7);
    assert_eq!(kv.num_available_blocks(), 0);
    let before = snapshot(&kv);
    assert!(!kv.allocate_slots(1, 4, 0).unwrap());
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
}

#[test]
fn without_the_whole_prompt_check_only_the_chunk_and_the_watermark_must_fit_now() {
    // 10 blocks, watermark 1; sequence 1 holds 6: 4 available.
    let mut kv = manager(10, 1);
    kv.add_sequence(1, &(100..124).collect::<Vec<u32>>(), None)
        .unwrap();
    assert_eq!(kv.num_available_blocks(), 4);
    let prompt: Vec<u32> = (0..32).collect(); // 8 blocks: the whole prompt does not fit now
    let before = snapshot(&kv);
    let whole = kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(8, true));
    assert!(matches!(whole, Err(Error::OutOfBlocks { .. })), "{whole:?}");
    assert_eq!(snapshot(&kv), before);
    // A 3-block chunk and the watermark (4) fit; a 4-block one (5) does not.
    let chunk = kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(13, false));
    assert!(matches!(chunk, Err(Error::OutOfBlocks { .. })), "{chunk:?}");
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(12, false))
            .unwrap(),
        0
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.block_table(2).unwrap().len(), 3);
    assert_eq!(kv.num_available_blocks(), 1);
}

#[test]
fn a_chunk_that_can_never_fit_is_still_an_invalid_argument() {
    let mut kv = manager(8, 0);
    let prompt: Vec<u32> = (0..40).collect();
    let before = snapshot(&kv);
    let r = kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(36, false));
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
}

#[test]
fn the_flag_is_ignored_under_the_reserve_contract() {
    let mut kv = manager(8, 0);
    let prompt: Vec<u32> = (0..40).collect();
    let o = AdmitOptions {
        require_full_prompt: false,
        ..Default::default()
    };
    let r = kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    kv.check_invariants().unwrap();
}

#[test]
fn reserved_blocks_stay_available_besides_the_watermark_and_a_refusal_changes_nothing() {
    // 8 blocks, watermark 1.
    let mut kv = manager(8, 1);
    let prompt: Vec<u32> = (0..12).collect(); // 3 blocks
    let reserved = |n| AdmitOptions {
        reserved_blocks: n,
        ..per_chunk(12, true)
    };
    let available = kv.num_available_blocks();
    // 3 blocks + watermark 1 + reserved r must be available: r = available - 4 fits, one more
    // does not (vLLM: `required > free - reserved_blocks` refuses).
    let before = snapshot(&kv);
    let refused = kv.add_sequence_with(1, Prompt::Tokens(&prompt), &reserved(available - 3));
    assert!(
        matches!(refused, Err(Error::OutOfBlocks { .. })),
        "{refused:?}"
    );
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
    assert_eq!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &reserved(available - 4))
            .unwrap(),
        0
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_available_blocks(), available - 3);
}

#[test]
fn hashes_held_back_at_a_per_chunk_admission_can_be_given_before_the_slots_reach_them() {
    // A prompt of 4 blocks admitted with its first block's hash only and 2 blocks of slots
    // (an async KV load's admission): the other hashes come later, with no new ids, while the
    // known ids (the whole prompt) pass the slots.
    let mut kv = manager(16, 0);
    let prompt: Vec<u32> = (0..16).collect();
    let hashes: Vec<u128> = (1..=4).map(|h| h * 1_000_003).collect();
    let o = AdmitOptions {
        block_hashes: Some(&hashes[..1]),
        ..per_chunk(8, true)
    };
    assert_eq!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o)
            .unwrap(),
        0
    );
    assert_eq!(kv.block_table(1).unwrap().len(), 2);
    kv.check_invariants().unwrap();
    // Before: "0 more token ids after 16 known pass its 8 slots".
    kv.provide_token_ids(1, &[], None, None, Some(&hashes[1..]))
        .unwrap();
    kv.check_invariants().unwrap();
    // Both computed blocks are indexed now, the others once computed.
    let q = AdmitOptions {
        block_hashes: Some(&hashes),
        ..Default::default()
    };
    assert_eq!(kv.match_prefix_with(&prompt, &q).unwrap(), 8);
    assert!(kv.allocate_slots(1, 8, 0).unwrap());
    kv.check_invariants().unwrap();
    assert_eq!(kv.match_prefix_with(&prompt, &q).unwrap(), 12);
}
