//! Unit tests of the lock-free pool (the loom models are in tests/loom_pool.rs).

use super::*;
use crate::error::Error;

#[test]
fn fresh_pool_hands_out_ascending_ids() {
    let pool = BlockPool::new(4, 8).unwrap();
    assert_eq!(pool.allocate(4).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(pool.num_free_list_blocks(), 0);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn lifo_reuse() {
    let pool = BlockPool::new(4, 8).unwrap();
    let b = pool.allocate(2).unwrap();
    pool.release_id(b[0]).unwrap();
    assert_eq!(pool.allocate(1).unwrap(), vec![b[0]]);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let pool = BlockPool::new(3, 8).unwrap();
    pool.allocate(2).unwrap();
    let err = pool.allocate(2).unwrap_err();
    assert_eq!(err.blocks_short(), Some(1));
    assert_eq!(pool.num_free_list_blocks(), 1);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn refcount_underflow_is_double_free() {
    let pool = BlockPool::new(2, 8).unwrap();
    assert_eq!(pool.release_id(0), Err(Error::DoubleFree(0)));
    let b = pool.allocate(1).unwrap()[0];
    pool.retain_id(b).unwrap();
    assert!(!pool.release_id(b).unwrap());
    assert!(pool.release_id(b).unwrap());
    assert_eq!(pool.release_id(b), Err(Error::DoubleFree(b)));
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn bad_ids_and_geometry() {
    let pool = BlockPool::new(2, 8).unwrap();
    assert!(matches!(pool.release_id(2), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        pool.retain_id(u32::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pool.allocate(usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert!(BlockPool::new(MAX_NUM_BLOCKS + 1, 1).is_err());
    assert!(BlockPool::new(1 << 20, 1 << 12).is_err());
    assert!(BlockPool::new(1, usize::MAX).is_err());
}

#[test]
fn cached_transitions_keep_counts() {
    let pool = BlockPool::new(3, 8).unwrap();
    let b = pool.allocate(2).unwrap();
    assert!(pool.release_to_cache(b[0]).unwrap());
    assert_eq!(pool.num_cached_blocks(), 1);
    assert_eq!(pool.num_free_list_blocks(), 1);
    pool.check_invariants_quiescent().unwrap();
    pool.claim_cached(b[0]);
    assert_eq!(pool.refcount(b[0]).unwrap(), 1);
    pool.release_to_cache(b[0]).unwrap();
    pool.free_cached(b[0]);
    assert_eq!(pool.num_free_list_blocks(), 2);
    let mut out = Vec::new();
    assert_eq!(pool.allocate_between(0, 5, &mut out).unwrap(), 2);
    assert_eq!(pool.num_free_list_blocks(), 0);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn allocate_between_takes_what_is_free_within_bounds() {
    let pool = BlockPool::new(5, 8).unwrap();
    let mut out = Vec::new();
    assert_eq!(pool.allocate_between(2, 3, &mut out).unwrap(), 3);
    let err = pool.allocate_between(3, 4, &mut out).unwrap_err();
    assert!(matches!(
        err,
        Error::OutOfBlocks {
            needed_blocks: 3,
            available_blocks: 2,
            ..
        }
    ));
    assert_eq!(out, vec![0, 1, 2], "a refusal takes nothing");
    assert_eq!(pool.allocate_between(0, 0, &mut out).unwrap(), 0);
    assert!(matches!(
        pool.allocate_between(2, 1, &mut out),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pool.allocate_between(6, 9, &mut out),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(pool.allocate_between(1, 9, &mut out).unwrap(), 2);
    assert_eq!(pool.num_free_list_blocks(), 0);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn multi_block_pop_under_churn_is_exact() {
    // Real threads: a 64-block allocation racing single-block churn keeps every block
    // held or free exactly once, whatever chunking the contended pops fell back to.
    let pool = std::sync::Arc::new(BlockPool::new(80, 1).unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let b = pool.allocate(1).unwrap();
                pool.release_id(b[0]).unwrap();
            }
        })
    };
    for _ in 0..200 {
        let got = pool.allocate(64).unwrap();
        let mut sorted = got.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 64);
        let handles = got.iter().map(|&b| pool.handle(b).unwrap());
        assert_eq!(pool.release_all(handles).unwrap(), 64);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().unwrap();
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn every_tenancy_gets_a_new_generation() {
    let pool = BlockPool::new(2, 8).unwrap();
    // Single pop, multi-block pop, and a revival from a prefix cache each start a tenancy.
    let first = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
    assert!(pool.release(first).unwrap());
    let second = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
    assert_eq!(second.id(), first.id());
    assert_eq!(second.generation(), first.generation().wrapping_add(1));
    assert!(pool.release(second).unwrap());
    let both = pool.allocate(2).unwrap();
    let third = pool.handle(first.id()).unwrap();
    assert_eq!(third.generation(), second.generation().wrapping_add(1));
    assert!(pool.release_to_cache(third.id()).unwrap());
    pool.claim_cached(third.id());
    let fourth = pool.handle(third.id()).unwrap();
    assert_eq!(fourth.generation(), third.generation().wrapping_add(1));
    // Retain and a non-final release keep the tenancy.
    pool.retain(fourth).unwrap();
    assert!(!pool.release(fourth).unwrap());
    assert_eq!(pool.handle(fourth.id()).unwrap(), fourth);
    for h in [first, second, third] {
        assert_eq!(pool.retain(h), Err(Error::StaleHandle(h)));
        assert_eq!(pool.release(h), Err(Error::StaleHandle(h)));
    }
    assert_eq!(pool.refcount(fourth.id()).unwrap(), 1);
    pool.release_id(both[1]).unwrap();
    pool.release(fourth).unwrap();
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn the_generation_wraps_without_disturbing_the_refcount() {
    let pool = BlockPool::new(1, 8).unwrap();
    pool.refs[0].store(u64::from(u32::MAX) << 32, Ordering::Relaxed);
    let h = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
    assert_eq!((h.generation(), pool.refcount(0).unwrap()), (0, 1));
    assert!(pool.release(h).unwrap());
    pool.refs[0].store(u64::from(u32::MAX) << 32, Ordering::Relaxed);
    assert!(pool.release_to_cache(pool.allocate(1).unwrap()[0]).is_ok());
    pool.refs[0].store(u64::from(u32::MAX) << 32, Ordering::Relaxed);
    pool.claim_cached(0);
    assert_eq!(pool.handle(0).unwrap().generation(), 0);
    assert_eq!(pool.refcount(0).unwrap(), 1);
}

#[test]
fn release_all_stops_at_a_stale_handle_after_releasing_the_ones_before() {
    let pool = BlockPool::new(3, 8).unwrap();
    let ids = pool.allocate(2).unwrap();
    let (a, b) = (pool.handle(ids[0]).unwrap(), pool.handle(ids[1]).unwrap());
    assert!(pool.release(b).unwrap());
    let b_again = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
    assert_eq!(b_again.id(), b.id());
    assert_eq!(
        pool.release_all([a, b, b_again]),
        Err(Error::StaleHandle(b))
    );
    assert_eq!(
        pool.refcount(a.id()).unwrap(),
        0,
        "released before the stale one"
    );
    assert_eq!(
        pool.refcount(b.id()).unwrap(),
        1,
        "the new tenant's reference is intact"
    );
    assert_eq!(pool.num_free_list_blocks(), 2);
    pool.check_invariants_quiescent().unwrap();
}
