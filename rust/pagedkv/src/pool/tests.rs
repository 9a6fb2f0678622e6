//! Unit tests of the lock-free pool (the loom models are in tests/loom_pool.rs).

use super::*;

#[test]
fn fresh_pool_hands_out_ascending_ids() {
    let pool = BlockPool::new(4, 8).unwrap();
    assert_eq!(pool.allocate(4).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(pool.num_free_blocks(), 0);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn lifo_reuse() {
    let pool = BlockPool::new(4, 8).unwrap();
    let b = pool.allocate(2).unwrap();
    pool.release(b[0]).unwrap();
    assert_eq!(pool.allocate(1).unwrap(), vec![b[0]]);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let pool = BlockPool::new(3, 8).unwrap();
    pool.allocate(2).unwrap();
    let err = pool.allocate(2).unwrap_err();
    assert_eq!(err.blocks_short(), Some(1));
    assert_eq!(pool.num_free_blocks(), 1);
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn refcount_underflow_is_double_free() {
    let pool = BlockPool::new(2, 8).unwrap();
    assert_eq!(pool.release(0), Err(Error::DoubleFree(0)));
    let b = pool.allocate(1).unwrap()[0];
    pool.retain(b).unwrap();
    assert!(!pool.release(b).unwrap());
    assert!(pool.release(b).unwrap());
    assert_eq!(pool.release(b), Err(Error::DoubleFree(b)));
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn bad_ids_and_geometry() {
    let pool = BlockPool::new(2, 8).unwrap();
    assert!(matches!(pool.release(2), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        pool.retain(u32::MAX),
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
    assert_eq!(pool.num_free_blocks(), 1);
    pool.check_invariants_quiescent().unwrap();
    pool.claim_cached(b[0]);
    assert_eq!(pool.refcount(b[0]).unwrap(), 1);
    pool.release_to_cache(b[0]).unwrap();
    pool.free_cached(b[0]);
    assert_eq!(pool.num_free_blocks(), 2);
    let mut out = Vec::new();
    assert_eq!(pool.allocate_between(0, 5, &mut out).unwrap(), 2);
    assert_eq!(pool.num_free_blocks(), 0);
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
    assert_eq!(pool.num_free_blocks(), 0);
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
                pool.release(b[0]).unwrap();
            }
        })
    };
    for _ in 0..200 {
        let got = pool.allocate(64).unwrap();
        let mut sorted = got.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 64);
        assert_eq!(pool.release_all(got).unwrap(), 64);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().unwrap();
    pool.check_invariants_quiescent().unwrap();
}
