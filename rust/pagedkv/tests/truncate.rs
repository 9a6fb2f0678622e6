//! `truncate` (speculative-decoding rollback, beam pruning), one exact scenario per rule:
//! which blocks are released, which leave the index, copy-on-write of a kept shared block, the
//! watermark, and the typed errors that change nothing.

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

fn removed(events: &[KvEvent]) -> usize {
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn rejected_drafts_leave_the_index_and_the_table() {
    let mut kv = cached(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
    // Four drafts: they fill block 1 (indexed) and start block 2.
    kv.append_tokens(1, &[7, 8, 9, 10]).unwrap();
    assert_eq!(kv.block_table(1).unwrap().len(), 3);
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 0], None).unwrap(),
        8
    );
    kv.take_events();
    // One draft accepted: keep 7 tokens. Block 2 goes back to the pool; block 1, now partial
    // and held by this table alone, leaves the index.
    kv.truncate(1, 7).unwrap();
    assert_eq!(
        (
            kv.num_tokens(1).unwrap(),
            kv.num_computed_tokens(1).unwrap()
        ),
        (7, 7)
    );
    assert_eq!(kv.block_table(1).unwrap().len(), 2);
    assert_eq!(removed(&kv.take_events()), 1);
    assert_eq!(kv.num_available_blocks(), 6);
    assert_eq!(kv.stats().num_cached_blocks, 0);
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 0], None).unwrap(),
        4
    );
    // The next write goes in place (no copy) and the block is indexed again once full.
    kv.append_tokens(1, &[11]).unwrap();
    assert!(kv.take_copy_ops().is_empty());
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 11, 0], None)
            .unwrap(),
        8
    );
    kv.check_invariants().unwrap();
}

#[test]
fn blocks_others_hold_keep_their_content_and_are_copied_before_a_write() {
    let mut kv = cached(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], None)
        .unwrap();
    kv.fork(1, 2).unwrap(); // a beam: every block shared
    let table = kv.block_table(1).unwrap().to_vec();
    kv.take_events();
    kv.truncate(1, 6).unwrap();
    assert!(kv.take_events().is_empty()); // shared: nothing leaves the index
    assert_eq!(kv.refcount(table[2]).unwrap(), 1); // the fork keeps block 2
    assert_eq!(kv.refcount(table[1]).unwrap(), 2);
    kv.free(2).unwrap();
    // Block 1 is now this table's alone but still indexed with the fork's full content: the
    // next write copies it, and the original stays hittable.
    kv.append_tokens(1, &[0]).unwrap();
    let copies = kv.take_copy_ops();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].0, table[1]);
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None).unwrap(),
        8
    );
    kv.check_invariants().unwrap();
}

#[test]
fn truncate_clamps_the_watermark_of_a_prefilling_sequence() {
    let mut kv = cached(8, 4);
    kv.add_sequence_scheduled(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None, 6)
        .unwrap();
    kv.truncate(1, 8).unwrap(); // above the watermark: it stays
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 6);
    kv.truncate(1, 5).unwrap(); // below: it clamps
    assert_eq!(kv.num_computed_tokens(1).unwrap(), 5);
    kv.append_tokens(1, &[0]).unwrap(); // fully computed again: it may grow
    kv.check_invariants().unwrap();
}

#[test]
fn bad_truncates_are_typed_and_change_nothing() {
    let mut kv = cached(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5], None).unwrap();
    kv.add_sequence(2, &[1, 2, 3], None).unwrap();
    kv.swap_out(&[2]).unwrap();
    let before = (kv.block_table(1).unwrap().to_vec(), kv.stats());
    assert!(matches!(kv.truncate(1, 6), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        kv.truncate(1, usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(kv.truncate(9, 0), Err(Error::UnknownSequence(9)));
    assert_eq!(kv.truncate(2, 1), Err(Error::SequenceSwappedOut(2)));
    assert_eq!((kv.block_table(1).unwrap().to_vec(), kv.stats()), before);
    kv.truncate(1, 5).unwrap(); // same length: a no-op
    kv.truncate(1, 0).unwrap(); // empty: the sequence lives on with no blocks
    assert!(kv.block_table(1).unwrap().is_empty());
    kv.append_tokens(1, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(kv.block_table(1).unwrap().len(), 2);
    kv.check_invariants().unwrap();
}

#[test]
fn a_batch_append_copies_an_indexed_partial_block_too() {
    let mut kv = cached(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], None)
        .unwrap();
    kv.fork(1, 2).unwrap();
    kv.add_sequence(3, &[7], None).unwrap();
    let kept = kv.block_table(1).unwrap()[1];
    kv.truncate(1, 6).unwrap();
    kv.free(2).unwrap(); // block `kept` is sequence 1's alone now, and still indexed
    assert_eq!(kv.refcount(kept).unwrap(), 1);
    kv.append_tokens_batch(&[1, 3], &[0, 0], 1).unwrap();
    assert_eq!(kv.take_copy_ops().len(), 1);
    assert_ne!(kv.block_table(1).unwrap()[1], kept);
    assert_eq!(
        kv.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None).unwrap(),
        8
    );
    kv.check_invariants().unwrap();
}
