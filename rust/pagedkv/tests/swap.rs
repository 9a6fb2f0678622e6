//! Host swap tier, exact scenarios (docs/design.md, Swap tier): mappings, refcounts on both
//! tiers, partial groups, all-or-nothing failures and the operations a swapped-out sequence
//! refuses.

use pagedkv::{BlockId, Error, KvCacheManager, ManagerConfig, Tier};

fn manager(num_blocks: usize, num_host_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: 4,
        num_host_blocks,
        ..Default::default()
    })
    .unwrap()
}

fn host_refcounts(kv: &KvCacheManager) -> Vec<u32> {
    (0..kv.num_host_blocks() as BlockId)
        .map(|h| kv.host_refcount(h).unwrap())
        .collect()
}

#[test]
fn single_sequence_round_trip() {
    let mut kv = manager(8, 8);
    kv.add_sequence_len(1, 10).unwrap(); // [0, 1, 2]
    assert_eq!(kv.swap_out(&[1]).unwrap(), vec![(0, 0), (1, 1), (2, 2)]);
    assert!(kv.is_swapped_out(1).unwrap());
    assert_eq!(kv.host_block_table(1).unwrap(), &[0, 1, 2]);
    assert_eq!(kv.num_available_blocks(), 8);
    assert_eq!(kv.num_free_host_blocks(), 5);
    assert_eq!(kv.num_tokens(1).unwrap(), 10);
    kv.check_invariants().unwrap();
    kv.add_sequence_len(2, 4).unwrap(); // takes device block 0 (LIFO: 0 was released last)
    assert_eq!(kv.block_table(2).unwrap(), &[0]);
    assert_eq!(kv.swap_in(&[1]).unwrap(), vec![(0, 1), (1, 2), (2, 3)]);
    assert_eq!(kv.block_table(1).unwrap(), &[1, 2, 3]);
    assert_eq!(kv.num_free_host_blocks(), 8);
    let s = kv.stats();
    assert_eq!(
        (
            s.blocks_swapped_out,
            s.blocks_swapped_in,
            s.num_swapped_sequences
        ),
        (3, 3, 0)
    );
    kv.append_len(1, 3).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn fork_group_shared_blocks_copied_once_and_stay_shared() {
    let mut kv = manager(16, 16);
    kv.add_sequence_len(0, 10).unwrap(); // [0, 1, 2], block 2 partial
    for c in 1..=3 {
        kv.fork(0, c).unwrap();
        kv.append_len(c, 1).unwrap(); // copy-on-write of block 2 for each child
    }
    kv.take_copy_ops();
    // Distinct blocks: 0, 1 (shared by 4), 2 (parent's), 3, 4, 5 (children's copies).
    let copies = kv.swap_out(&[0, 1, 2, 3]).unwrap();
    assert_eq!(copies, vec![(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]);
    assert_eq!(host_refcounts(&kv)[..6], [4, 4, 1, 1, 1, 1]);
    assert_eq!(kv.stats().num_host_blocks_in_use, 6);
    assert_eq!(kv.num_available_blocks(), 16);
    kv.check_invariants().unwrap();
    let back = kv.swap_in(&[3, 2, 1, 0]).unwrap();
    assert_eq!(back.len(), 6);
    let shared = kv.block_table(0).unwrap()[..2].to_vec();
    for c in 1..=3 {
        assert_eq!(kv.block_table(c).unwrap()[..2], shared[..]);
    }
    assert_eq!(
        (
            kv.refcount(shared[0]).unwrap(),
            kv.refcount(shared[1]).unwrap()
        ),
        (4, 4)
    );
    assert_eq!(kv.stats().num_blocks_in_use, 6);
    kv.check_invariants().unwrap();
}

#[test]
fn partial_group_keeps_device_copy_for_members_left_behind() {
    let mut kv = manager(8, 8);
    kv.add_sequence_len(1, 8).unwrap(); // [0, 1]
    kv.fork(1, 2).unwrap();
    assert_eq!(kv.swap_out(&[2]).unwrap(), vec![(0, 0), (1, 1)]);
    assert_eq!((kv.refcount(0).unwrap(), kv.refcount(1).unwrap()), (1, 1));
    assert_eq!(host_refcounts(&kv)[..2], [1, 1]);
    kv.append_len(1, 1).unwrap(); // parent unaffected
    kv.check_invariants().unwrap();
    // Swapping the rest later gives each its own host copy; swap-in of one member alone
    // also works (the host copy stays for the other).
    kv.swap_out(&[1]).unwrap();
    assert_eq!(kv.num_free_host_blocks(), 3);
    kv.swap_in(&[2]).unwrap();
    assert_eq!(kv.num_free_host_blocks(), 5);
    kv.check_invariants().unwrap();
}

#[test]
fn host_exhaustion_moves_nothing() {
    let mut kv = manager(8, 4);
    kv.add_sequence_len(2, 8).unwrap(); // [0, 1]
    kv.swap_out(&[2]).unwrap(); // host 0, 1
    kv.add_sequence_len(1, 12).unwrap();
    let err = kv.swap_out(&[1]).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            tier: Tier::Host,
            needed_blocks: 3,
            available_blocks: 2
        }
    );
    assert!(!kv.is_swapped_out(1).unwrap());
    assert_eq!(kv.block_table(1).unwrap(), &[0, 1, 2]);
    assert_eq!(kv.num_free_host_blocks(), 2);
    kv.check_invariants().unwrap();
    // A group larger than the whole host tier can never fit.
    let mut kv = manager(8, 2);
    kv.add_sequence_len(1, 5).unwrap();
    kv.add_sequence_len(2, 5).unwrap();
    assert!(matches!(
        kv.swap_out(&[1, 2]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn device_exhaustion_on_swap_in_moves_nothing() {
    let mut kv = manager(3, 4);
    kv.add_sequence_len(1, 8).unwrap();
    kv.swap_out(&[1]).unwrap();
    kv.add_sequence_len(2, 8).unwrap();
    let err = kv.swap_in(&[1]).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: 2,
            available_blocks: 1
        }
    );
    assert!(kv.is_swapped_out(1).unwrap());
    assert_eq!(kv.host_block_table(1).unwrap(), &[0, 1]);
    kv.check_invariants().unwrap();
}

#[test]
fn swapped_out_sequences_refuse_device_operations() {
    let mut kv = manager(8, 8);
    kv.add_sequence_len(1, 5).unwrap();
    kv.add_sequence_len(3, 5).unwrap();
    kv.swap_out(&[1]).unwrap();
    let swapped = Error::SequenceSwappedOut(1);
    assert_eq!(kv.append_len(1, 1), Err(swapped.clone()));
    assert_eq!(kv.append_tokens(1, &[1]), Err(swapped.clone()));
    assert_eq!(kv.append_len_batch(&[3, 1], 1), Err(swapped.clone()));
    assert_eq!(kv.num_tokens(3).unwrap(), 5, "batch was all-or-nothing");
    assert_eq!(kv.can_append(1, 1), Err(swapped.clone()));
    assert_eq!(kv.fork(1, 2), Err(swapped.clone()));
    assert_eq!(kv.block_table(1), Err(swapped.clone()));
    assert_eq!(kv.slot_mapping(&[1], 1).map(|_| ()), Err(swapped.clone()));
    assert_eq!(
        kv.batch_block_tables(&[1]).map(|_| ()),
        Err(swapped.clone())
    );
    assert_eq!(kv.swap_out(&[1]), Err(swapped));
    assert!(matches!(kv.swap_in(&[3]), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        kv.swap_out(&[3, 3]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(kv.swap_out(&[9]), Err(Error::UnknownSequence(9)));
    kv.check_invariants().unwrap();
    kv.free(1).unwrap(); // frees its host blocks
    assert_eq!(kv.num_free_host_blocks(), 8);
    kv.check_invariants().unwrap();
}

#[test]
fn no_host_tier_is_invalid() {
    let mut kv = manager(8, 0);
    kv.add_sequence_len(1, 5).unwrap();
    assert!(matches!(kv.swap_out(&[1]), Err(Error::InvalidArgument(_))));
    assert_eq!(kv.num_free_host_blocks(), 0);
}

#[test]
fn swap_with_prefix_caching_keeps_hashing() {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 8,
        block_size: 2,
        num_host_blocks: 8,
        enable_prefix_caching: true,
        ..Default::default()
    })
    .unwrap();
    kv.add_sequence(1, &[1, 2, 3, 4, 5], None).unwrap(); // [0, 1, 2]
    kv.swap_out(&[1]).unwrap();
    // The full blocks' device copies stay cached (still valid content) after swap-out.
    assert_eq!(kv.cached_blocks(), vec![1, 0]);
    assert_eq!(kv.add_sequence(2, &[1, 2, 3, 4, 9], None).unwrap(), 4);
    kv.swap_in(&[1]).unwrap();
    kv.append_tokens(1, &[6]).unwrap(); // fills block 2 of seq 1 -> indexed
    kv.free(1).unwrap();
    kv.free(2).unwrap();
    assert_eq!(kv.add_sequence(3, &[1, 2, 3, 4, 5, 6, 7], None).unwrap(), 6);
    kv.check_invariants().unwrap();
}
