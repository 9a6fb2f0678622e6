//! One exact scenario per manager transition and per kind of bad input: block ids, refcounts
//! and copy ops are asserted, and every failure is checked to leave the state unchanged.

use pagedkv::{BlockId, Error, KvCacheManager, ManagerConfig, Tier};

fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        ..Default::default()
    })
    .unwrap()
}

/// Everything observable about a manager, to assert that a failed call changed nothing.
type Snapshot = (Vec<(u64, usize, Vec<BlockId>)>, Vec<u32>, usize);

fn snapshot(kv: &KvCacheManager) -> Snapshot {
    let mut ids: Vec<u64> = kv.seq_ids().collect();
    ids.sort_unstable();
    let seqs = ids
        .into_iter()
        .map(|id| {
            (
                id,
                kv.num_tokens(id).unwrap(),
                kv.block_table(id).unwrap().to_vec(),
            )
        })
        .collect();
    let refs = (0..kv.num_blocks() as u32)
        .map(|b| kv.refcount(b).unwrap())
        .collect();
    (seqs, refs, kv.num_available_blocks())
}

#[test]
fn allocate_fresh_on_add_and_growth() {
    let mut kv = manager(8, 4);
    kv.add_sequence(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1]);
    kv.append_tokens(1, &[7, 8]).unwrap(); // fills block 1, no new block
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1]);
    kv.append_tokens(1, &[9]).unwrap(); // starts block 2
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1, 2]);
    assert_eq!(kv.num_tokens(1).unwrap(), 9);
    assert_eq!(kv.stats().blocks_allocated, 3);
    kv.check_invariants().unwrap();
}

#[test]
fn share_on_fork() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 8).unwrap();
    kv.fork(1, 2).unwrap();
    kv.fork(2, 3).unwrap();
    assert_eq!(kv.block_table(3).unwrap(), &[0, 1]);
    assert_eq!((kv.refcount(0).unwrap(), kv.refcount(1).unwrap()), (3, 3));
    assert_eq!(kv.stats().num_blocks_in_use, 2);
    kv.check_invariants().unwrap();
}

#[test]
fn copy_on_write_of_shared_partial_block() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 6).unwrap(); // [0, 1], block 1 half full
    kv.fork(1, 2).unwrap();
    kv.append_len(2, 1).unwrap();
    assert_eq!(kv.block_table(2).unwrap(), &[0, 2]);
    assert_eq!(kv.take_copy_ops(), vec![(1, 2)]);
    assert!(kv.take_copy_ops().is_empty());
    assert_eq!((kv.refcount(1).unwrap(), kv.refcount(2).unwrap()), (1, 1));
    // The parent now holds the only reference to block 1: it writes in place.
    kv.append_len(1, 2).unwrap();
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1]);
    assert!(kv.take_copy_ops().is_empty());
    assert_eq!(kv.stats().cow_copies, 1);
    kv.check_invariants().unwrap();
}

#[test]
fn full_shared_last_block_needs_no_copy() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 8).unwrap();
    kv.fork(1, 2).unwrap();
    kv.append_len(2, 1).unwrap();
    assert_eq!(kv.block_table(2).unwrap(), &[0, 1, 2]);
    assert!(kv.take_copy_ops().is_empty());
    assert_eq!(kv.refcount(1).unwrap(), 2);
    kv.check_invariants().unwrap();
}

#[test]
fn copy_on_write_and_growth_in_one_append() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 3).unwrap(); // [0]
    kv.fork(1, 2).unwrap();
    kv.append_len(2, 6).unwrap(); // copy of 0 -> 1, then block 2
    assert_eq!(kv.block_table(2).unwrap(), &[1, 2, 3]);
    assert_eq!(kv.take_copy_ops(), vec![(0, 1)]);
    kv.check_invariants().unwrap();
}

#[test]
fn release_on_free() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 6).unwrap();
    kv.fork(1, 2).unwrap();
    kv.free(1).unwrap();
    assert_eq!((kv.refcount(0).unwrap(), kv.refcount(1).unwrap()), (1, 1));
    assert_eq!(kv.num_available_blocks(), 6);
    kv.free(2).unwrap();
    assert_eq!(kv.num_available_blocks(), 8);
    assert_eq!(kv.stats().blocks_freed, 2);
    assert_eq!(kv.usage(), 0.0);
    kv.check_invariants().unwrap();
}

#[test]
fn parallel_sampling_textbook_case() {
    // 4 samples forked from a 1,000-token prompt, each generating 200 tokens, block_size 16:
    // 62 shared full prompt blocks + 4 x (copy of the partial block + 12 more) = 114.
    let mut kv = manager(400, 16);
    kv.add_sequence_len(0, 1000).unwrap();
    for child in 1..4 {
        kv.fork(0, child).unwrap();
    }
    for _ in 0..200 {
        kv.append_len_batch(&[0, 1, 2, 3], 1).unwrap();
    }
    assert_eq!(kv.stats().num_blocks_in_use, 114);
    // The last sample to write keeps the original partial block: 3 copies, not 4.
    assert_eq!(kv.take_copy_ops().len(), 3);
    kv.check_invariants().unwrap();
}

#[test]
fn batch_copy_on_write_counts_each_shared_block_once() {
    let mut kv = manager(4, 4);
    kv.add_sequence_len(1, 2).unwrap(); // [0]
    kv.fork(1, 2).unwrap();
    kv.add_sequence_len(3, 8).unwrap(); // [1, 2]
                                        // 1 needs a copy; 2 then owns block 0 alone; 3 needs a new block: 2 blocks, 1 free.
    let before = snapshot(&kv);
    let err = kv.append_len_batch(&[1, 2, 3], 1).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: 2,
            available_blocks: 1
        }
    );
    assert_eq!(snapshot(&kv), before);
    kv.free(3).unwrap();
    kv.append_len_batch(&[1, 2], 1).unwrap();
    assert_eq!(kv.take_copy_ops(), vec![(0, 1)]);
    assert_eq!(kv.block_table(2).unwrap(), &[0]);
    kv.check_invariants().unwrap();
}

#[test]
fn batch_queries() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(1, 5).unwrap();
    kv.add_sequence_len(2, 1).unwrap();
    let (tables, max_blocks, lens) = kv.batch_block_tables(&[2, 1]).unwrap();
    assert_eq!(
        (tables, max_blocks, lens),
        (vec![2, -1, 0, 1], 2, vec![1, 5])
    );
    assert_eq!(kv.slot_mapping(&[1, 2], 1).unwrap(), vec![4, 8]);
    assert_eq!(kv.slot_mapping(&[1], 2).unwrap(), vec![3, 4]);
    assert_eq!(kv.batch_block_tables(&[]).unwrap(), (vec![], 0, vec![]));
    assert_eq!(
        kv.batch_block_tables(&[1, 9]),
        Err(Error::UnknownSequence(9))
    );
}

#[test]
fn bad_input_is_typed_and_changes_nothing() {
    let mut kv = manager(4, 4);
    kv.add_sequence_len(1, 5).unwrap();
    kv.add_sequence_len(2, 4).unwrap();
    let before = snapshot(&kv);
    let cases: Vec<(&str, Result<(), Error>)> = vec![
        ("add existing", kv.add_sequence_len(1, 1).map(|_| ())),
        ("add absurd", kv.add_sequence_len(3, usize::MAX).map(|_| ())),
        ("add never fits", kv.add_sequence_len(3, 17).map(|_| ())),
        ("add too many now", kv.add_sequence_len(3, 9).map(|_| ())),
        ("append unknown", kv.append_len(3, 1)),
        ("append absurd", kv.append_len(1, usize::MAX)),
        ("append overflow", kv.append_len(1, usize::MAX - 2)),
        ("append never fits", kv.append_len(1, 12)),
        ("append too many now", kv.append_len(1, 8)),
        ("fork unknown", kv.fork(3, 4)),
        ("fork onto existing", kv.fork(1, 2)),
        ("fork onto itself", kv.fork(1, 1)),
        ("free unknown", kv.free(3)),
        ("free_batch partly unknown", kv.free_batch(&[1, 3])),
        ("free_batch duplicate", kv.free_batch(&[1, 1])),
        ("batch duplicate", kv.append_len_batch(&[1, 1], 1)),
        ("batch unknown", kv.append_len_batch(&[1, 3], 1)),
        ("batch never fits", kv.append_len_batch(&[1, 2], 9)),
        (
            "tokens batch wrong length",
            kv.append_tokens_batch(&[1, 2], &[1, 2, 3], 1),
        ),
        (
            "tokens batch overflow",
            kv.append_tokens_batch(&[1, 2], &[], usize::MAX),
        ),
        (
            "slot mapping too long",
            kv.slot_mapping(&[1], 6).map(|_| ()),
        ),
        ("slot mapping unknown", kv.slot_mapping(&[3], 0).map(|_| ())),
        ("refcount out of range", kv.refcount(4).map(|_| ())),
    ];
    for (what, result) in cases {
        let err = result.expect_err(what);
        let expected_kind = match what {
            "add existing" | "fork onto existing" | "fork onto itself" => "exists",
            "append unknown"
            | "fork unknown"
            | "free unknown"
            | "free_batch partly unknown"
            | "batch unknown"
            | "slot mapping unknown" => "unknown",
            "add too many now" | "append too many now" => "oob",
            _ => "invalid",
        };
        let kind = match err {
            Error::SequenceExists(_) => "exists",
            Error::UnknownSequence(_) => "unknown",
            Error::OutOfBlocks { .. } => "oob",
            Error::InvalidArgument(_) => "invalid",
            _ => "other",
        };
        assert_eq!(kind, expected_kind, "{what}: {err}");
        assert_eq!(snapshot(&kv), before, "{what} changed the state");
        kv.check_invariants().unwrap();
    }
    assert!(!kv.can_append(1, usize::MAX).unwrap());
    assert_eq!(kv.can_append(3, 1), Err(Error::UnknownSequence(3)));
}

#[test]
fn bad_geometry() {
    for (num_blocks, block_size) in [
        (0, 16),
        (16, 0),
        (usize::MAX, 16),
        (1 << 25, 1),
        (1 << 20, 1 << 20),
    ] {
        let err = KvCacheManager::new(ManagerConfig {
            num_blocks,
            block_size,
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_)),
            "{num_blocks} x {block_size}: {err}"
        );
    }
}

#[test]
fn zero_token_sequences_and_appends() {
    let mut kv = manager(2, 4);
    kv.add_sequence_len(1, 0).unwrap();
    assert_eq!(kv.block_table(1).unwrap(), &[] as &[BlockId]);
    kv.fork(1, 2).unwrap();
    kv.append_len(1, 0).unwrap();
    kv.append_len(1, 1).unwrap();
    assert_eq!(kv.block_table(1).unwrap(), &[0]);
    kv.append_len_batch(&[], 3).unwrap();
    kv.append_len_batch(&[1, 2], 0).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn raw_pool_errors() {
    let mut kv = manager(2, 4);
    let pool = kv.pool().clone();
    // No handle to a free block, and a handle outlives its tenancy: refused, nothing changes.
    assert!(matches!(pool.handle(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(pool.handle(2), Err(Error::InvalidArgument(_))));
    let h = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
    assert!(pool.release(h).unwrap());
    assert_eq!(pool.release(h), Err(Error::DoubleFree(h.id())));
    assert_eq!(pool.retain(h), Err(Error::StaleHandle(h)));
    kv.add_sequence_len(1, 4).unwrap(); // the manager's block reuses the id, next tenancy
    assert_eq!(kv.block_table(1).unwrap(), &[h.id()]);
    assert_eq!(pool.release(h), Err(Error::StaleHandle(h)));
    assert_eq!(pool.retain(h), Err(Error::StaleHandle(h)));
    assert_eq!(pool.refcount(h.id()), Ok(1));
    kv.check_invariants().unwrap();
}

#[test]
fn dropping_a_manager_returns_its_blocks_to_a_shared_pool() {
    let pool = std::sync::Arc::new(pagedkv::BlockPool::new(8, 4).unwrap());
    {
        let mut kv = KvCacheManager::with_pool(pool.clone(), ManagerConfig::default()).unwrap();
        kv.add_sequence_len(1, 20).unwrap();
        kv.fork(1, 2).unwrap();
        assert_eq!(pool.num_free_list_blocks(), 3);
    }
    assert_eq!(pool.num_free_list_blocks(), 8);
    pool.check_invariants_quiescent().unwrap();
}
