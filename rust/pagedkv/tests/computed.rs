//! The computed watermark (chunked prefill) and `match_prefix`, one exact scenario each: which
//! blocks are indexed when, the events, the hits, and the typed errors that change nothing.

use pagedkv::{Error, KvCacheManager, KvEvent, ManagerConfig};

fn cached(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
        enable_kv_events: true,
        num_host_blocks: 8,
        ..Default::default()
    })
    .unwrap()
}

/// How many blocks each `BlockStored` event carries, in order (other events skipped).
fn stored(events: &[KvEvent]) -> Vec<usize> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.len()),
            _ => None,
        })
        .collect()
}

const PROMPT: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

#[test]
fn blocks_enter_the_index_only_once_computed() {
    let mut kv = cached(8, 4);
    assert_eq!(kv.add_sequence_scheduled(1, &PROMPT, None, 3).unwrap(), 0);
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 3);
    assert!(stored(&kv.take_events()).is_empty());
    assert_eq!(kv.match_prefix(&PROMPT, None).unwrap(), 0);
    kv.check_invariants().unwrap();

    kv.advance_computed(&[1], 2).unwrap(); // 5 computed: block 0 full and computed
    assert_eq!(stored(&kv.take_events()), vec![1]);
    assert_eq!(kv.match_prefix(&PROMPT, None).unwrap(), 4);
    kv.advance_computed(&[1], 5).unwrap(); // all 10: block 1 too (block 2 is partial)
    assert_eq!(stored(&kv.take_events()), vec![1]);
    assert_eq!(kv.match_prefix(&PROMPT, None).unwrap(), 8);
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 10);
    kv.check_invariants().unwrap();
}

#[test]
fn a_request_admitted_during_prefill_hits_only_computed_blocks() {
    let mut kv = cached(16, 4);
    kv.add_sequence_scheduled(1, &PROMPT, None, 4).unwrap();
    // The second request shares the prompt: only block 0 is computed, so only it is a hit.
    assert_eq!(kv.add_sequence(2, &PROMPT, None).unwrap(), 4);
    assert_eq!(kv.block_table(2).unwrap()[0], kv.block_table(1).unwrap()[0]);
    assert_ne!(kv.block_table(2).unwrap()[1], kv.block_table(1).unwrap()[1]);
    // Request 2 computed block 1 itself (a copy is indexed); request 1 then computes its own.
    kv.advance_computed(&[1], 6).unwrap();
    assert_eq!(kv.add_sequence(3, &PROMPT, None).unwrap(), 8);
    kv.check_invariants().unwrap();
}

#[test]
fn num_scheduled_is_a_budget_after_the_hit() {
    let mut kv = cached(16, 4);
    kv.add_sequence(1, &PROMPT, None).unwrap();
    // Hit 8; of the 2 new tokens a budget of 100 schedules both, a budget of 0 none.
    assert_eq!(kv.add_sequence_scheduled(2, &PROMPT, None, 100).unwrap(), 8);
    assert_eq!(kv.num_computed_tokens(2).unwrap(), 10);
    assert_eq!(kv.add_sequence_scheduled(3, &PROMPT, None, 0).unwrap(), 8);
    assert_eq!(kv.num_computed_tokens(3).unwrap(), 8);
    // Without token ids (never cached) the watermark works the same.
    kv.add_sequence_len_scheduled(4, 7, 2).unwrap();
    assert_eq!(kv.num_computed_tokens(4).unwrap(), 2);
    kv.check_invariants().unwrap();
}

#[test]
fn advance_computed_is_all_or_nothing() {
    let mut kv = cached(16, 4);
    kv.add_sequence_scheduled(1, &PROMPT, None, 2).unwrap();
    kv.add_sequence_scheduled(2, &PROMPT[..6], Some(b"x"), 2)
        .unwrap();
    kv.take_events();
    // Sequence 2 has only 4 left: the whole batch fails, nothing moves.
    let err = kv.advance_computed(&[1, 2], 5).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(matches!(
        kv.advance_computed(&[1, 1], 1),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        kv.advance_computed(&[1, 9], 1),
        Err(Error::UnknownSequence(9))
    );
    assert!(matches!(
        kv.advance_computed(&[1], usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        (
            kv.num_computed_tokens(1).unwrap(),
            kv.num_computed_tokens(2).unwrap()
        ),
        (2, 2)
    );
    assert!(kv.take_events().is_empty());
    kv.advance_computed(&[1, 2], 4).unwrap();
    assert_eq!(stored(&kv.take_events()), vec![1, 1]);
    kv.advance_computed(&[], 3).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn prefilling_sequences_cannot_grow_or_fork() {
    let mut kv = cached(16, 4);
    kv.add_sequence_scheduled(1, &PROMPT, None, 4).unwrap();
    for err in [
        kv.append_tokens(1, &[11]).unwrap_err(),
        kv.append_len(1, 1).unwrap_err(),
        kv.append_len_batch(&[1], 1).unwrap_err(),
        kv.append_len_batch(&[1], 0).unwrap_err(),
        kv.fork(1, 2).unwrap_err(),
    ] {
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    }
    assert!(!kv.can_append(1, 1).unwrap());
    assert_eq!(kv.num_tokens(1).unwrap(), 10);
    assert!(!kv.contains(2));
    kv.advance_computed(&[1], 6).unwrap();
    kv.append_tokens(1, &[11]).unwrap(); // appended tokens are computed when appended
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 11);
    kv.fork(1, 2).unwrap(); // the child copies the watermark
    assert_eq!(kv.num_computed_tokens(2).unwrap(), 11);
    kv.check_invariants().unwrap();
}

#[test]
fn swap_keeps_the_watermark() {
    let mut kv = cached(16, 4);
    kv.add_sequence_scheduled(1, &PROMPT, None, 3).unwrap();
    kv.swap_out(&[1]).unwrap();
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 3);
    assert_eq!(
        kv.advance_computed(&[1], 1),
        Err(Error::SequenceSwappedOut(1))
    );
    kv.swap_in(&[1]).unwrap();
    kv.take_events();
    kv.advance_computed(&[1], 7).unwrap();
    assert_eq!(stored(&kv.take_events()), vec![2]);
    assert_eq!(kv.match_prefix(&PROMPT, None).unwrap(), 8);
    kv.check_invariants().unwrap();
}

#[test]
fn match_prefix_is_the_admission_hit_without_side_effects() {
    let mut kv = cached(6, 4);
    kv.add_sequence(1, &PROMPT, None).unwrap();
    kv.add_sequence(2, &[9, 9, 9, 9, 9], None).unwrap();
    kv.free(1).unwrap(); // blocks of 1 are cached-evictable now
    kv.free(2).unwrap();
    kv.take_events();
    let (stats, lru) = (kv.stats(), kv.cached_blocks());
    let mut longer = PROMPT.to_vec();
    longer.push(11);
    assert_eq!(kv.match_prefix(&longer, None).unwrap(), 8);
    assert_eq!(kv.match_prefix(&PROMPT[..8], None).unwrap(), 4); // last token recomputed
    assert_eq!(kv.match_prefix(&longer, Some(b"salt")).unwrap(), 0);
    assert_eq!(kv.match_prefix(&[], None).unwrap(), 0);
    assert_eq!((kv.stats(), kv.cached_blocks()), (stats, lru));
    assert!(kv.take_events().is_empty());
    // The admission takes exactly that hit (reviving the cached blocks).
    assert_eq!(kv.add_sequence(3, &longer, None).unwrap(), 8);
    let off = KvCacheManager::new(ManagerConfig::default()).unwrap();
    assert_eq!(off.match_prefix(&PROMPT, None).unwrap(), 0);
}
