//! Exhaustive interleavings of the lock-free pool with 2-3 racing threads (loom).
//!
//! Run with: `RUSTFLAGS="--cfg loom -C debug-assertions=on" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv
//! --release --test loom_pool`. Without `--cfg loom` this file compiles to nothing.
//!
//! # Mutations these tests catch
//!
//! docs/pool.md, "Mutations the tests catch", lists each mutation of `src/pool.rs` that was
//! applied by hand (no ABA tag, `Relaxed` head loads, free counter bumped before the push,
//! `Relaxed` refcount decrement, no generation bump, a manager handing blocks back) and the
//! tests here that fail on it. A test that no mutation fails would be a test that cannot fail.
//!
//! Racing work goes on spawned threads: `concurrent_check_sees_no_false_violation`, with its
//! checker on the model's main thread, completed in a single iteration (`LOOM_LOG=info` prints
//! the count) and explored nothing.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use pagedkv::{BlockPool, Error};

/// Two threads allocate and release one block each from a pool of 2: both succeed, never get
/// the same block, and the pool ends full and consistent.
#[test]
fn two_threads_alloc_release() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(2, 1).unwrap());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    let b = pool.allocate(1).unwrap()[0];
                    assert_eq!(pool.refcount(b).unwrap(), 1);
                    b
                })
            })
            .collect();
        let got: Vec<u32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_ne!(got[0], got[1], "one block handed out twice");
        for b in got {
            assert!(pool.release(pool.handle(b).unwrap()).unwrap());
        }
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// The ABA scenario: while one thread pops, another pops two blocks and pushes them back in a
/// different order. The tag must make the first thread's stale CAS fail.
#[test]
fn aba_pop_against_pop_pop_push() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(3, 1).unwrap());
        let p1 = pool.clone();
        let t1 = thread::spawn(move || p1.allocate(1).unwrap()[0]);
        let p2 = pool.clone();
        let t2 = thread::spawn(move || {
            let bs = p2.allocate(2).unwrap();
            let hs = [p2.handle(bs[0]).unwrap(), p2.handle(bs[1]).unwrap()];
            p2.release(hs[0]).unwrap();
            p2.release(hs[1]).unwrap();
        });
        t2.join().unwrap();
        let b = t1.join().unwrap();
        assert_eq!(pool.num_free_list_blocks(), 2);
        let rest = pool.allocate(2).unwrap();
        assert!(!rest.contains(&b), "block {b} both held and free");
        pool.check_invariants_quiescent().unwrap();
    });
}

/// Multi-block allocation is all-or-nothing under a race: of a 2-block and a 1-block request
/// against a pool of 2, either both succeed sequentially (after a release) or exactly the
/// failing one reports OutOfBlocks with nothing taken.
#[test]
fn all_or_nothing_under_contention() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(2, 1).unwrap());
        let p1 = pool.clone();
        let t1 = thread::spawn(move || match p1.allocate(2) {
            Ok(bs) => {
                for b in &bs {
                    p1.release(p1.handle(*b).unwrap()).unwrap();
                }
                true
            }
            Err(Error::OutOfBlocks { .. }) => false,
            Err(e) => panic!("{e}"),
        });
        let p2 = pool.clone();
        let t2 = thread::spawn(move || match p2.allocate(1) {
            Ok(bs) => {
                p2.release(p2.handle(bs[0]).unwrap()).unwrap();
                true
            }
            Err(Error::OutOfBlocks { .. }) => false,
            Err(e) => panic!("{e}"),
        });
        let (a, b) = (t1.join().unwrap(), t2.join().unwrap());
        assert!(a || b, "at least one request must win");
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// Concurrent retain/release on a shared block never loses or invents a reference, and only
/// the last release frees it.
#[test]
fn shared_block_refcount() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1, 1).unwrap());
        let b = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
        pool.retain(b).unwrap();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || pool.release(b).unwrap())
            })
            .collect();
        let freed: Vec<bool> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(freed.iter().filter(|&&f| f).count(), 1);
        assert_eq!(pool.release(b), Err(Error::DoubleFree(b.id())));
        assert_eq!(pool.num_free_list_blocks(), 1);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// A checker walking the free list while another thread pops and pushes blocks never reports
/// a torn snapshot as a violation (this caught two missing Release orderings). The checker runs
/// on a spawned thread: with the check on the model's main thread, loom completed the model in
/// a single iteration (no interleaving explored). Bounded preemptions keep it short.
#[test]
fn concurrent_check_sees_no_false_violation() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(2, 1).unwrap());
        let p = pool.clone();
        let worker = thread::spawn(move || {
            let a = p.handle(p.allocate(1).unwrap()[0]).unwrap();
            let b = p.handle(p.allocate(1).unwrap()[0]).unwrap();
            p.release(a).unwrap();
            p.release(b).unwrap();
        });
        let p = pool.clone();
        let checker = thread::spawn(move || p.check_invariants().unwrap());
        worker.join().unwrap();
        checker.join().unwrap();
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// Three threads, each allocating then releasing, on a pool of 2 (bounded preemptions to keep
/// the run short); the concurrent checker never reports a false violation.
#[test]
fn three_threads_with_concurrent_check() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(1);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(2, 1).unwrap());
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    if let Ok(bs) = pool.allocate(1) {
                        pool.release(pool.handle(bs[0]).unwrap()).unwrap();
                    }
                })
            })
            .collect();
        let p = pool.clone();
        let checker = thread::spawn(move || p.check_invariants().unwrap());
        for w in workers {
            w.join().unwrap();
        }
        checker.join().unwrap();
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// A chained release of two blocks (one free-list update) races a two-block allocation (one
/// walk of two links): neither sees a torn stack, every block is held or free exactly once, and
/// the released pair comes back in the order single releases would leave it.
#[test]
fn release_all_against_multi_block_allocate() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(4, 1).unwrap());
        let held = pool.allocate(2).unwrap(); // [0, 1]; 2 and 3 stay free
        let held: Vec<_> = held.iter().map(|&b| pool.handle(b).unwrap()).collect();
        let p1 = pool.clone();
        let t1 = thread::spawn(move || {
            assert_eq!(p1.release_all(held.iter().rev().copied()).unwrap(), 2);
        });
        let p2 = pool.clone();
        let t2 = thread::spawn(move || p2.allocate(2).unwrap());
        t1.join().unwrap();
        let got = t2.join().unwrap();
        assert_ne!(got[0], got[1]);
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
        let rest = pool.allocate(2).unwrap();
        assert!(
            rest.iter().all(|b| !got.contains(b)),
            "a block both held and free"
        );
        pool.check_invariants_quiescent().unwrap();
    });
}

/// A prefix-caching manager needing 2 blocks with nothing evictable, racing two single-block
/// allocations on a pool of 2. In every serial order, if the manager is refused then both
/// single allocations succeed (it is refused only because one of them holds a block, and it
/// never holds one itself). A manager that takes what is free and hands it back when short
/// makes a single allocation fail in the window while the block is out.
#[test]
fn no_spurious_refusal_between_managers() {
    use pagedkv::{KvCacheManager, ManagerConfig};
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = std::sync::Arc::new(BlockPool::new(2, 1).unwrap());
        let config = ManagerConfig {
            enable_prefix_caching: true,
            ..Default::default()
        };
        let mut kv = KvCacheManager::with_pool(pool.clone(), config).unwrap();
        let manager = thread::spawn(move || kv.add_sequence_len(1, 2).is_ok());
        let singles: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || pool.allocate(1).is_ok())
            })
            .collect();
        let manager_ok = manager.join().unwrap();
        let singles_ok: Vec<bool> = singles.into_iter().map(|h| h.join().unwrap()).collect();
        if !manager_ok {
            assert_eq!(
                singles_ok,
                vec![true, true],
                "a refusal no serial order explains"
            );
        }
    });
}

/// Two tables share a block and each reads its payload before dropping its reference; the
/// next owner of the block (after both releases) overwrites the payload. Every read must
/// happen-before that write: the non-last decrement must publish with Release and the last
/// one acquire it (as in `Arc`'s drop), or loom reports the race on the payload cell.
#[test]
fn payload_handed_from_all_sharers_to_next_owner() {
    use loom::cell::UnsafeCell;
    // Causality is tracked on every schedule, so one preemption is enough to see the race
    // and keeps the spinning next owner from multiplying the explored schedules.
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(1);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(1, 1).unwrap());
        let payload = Arc::new(UnsafeCell::new(7u64));
        let b = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
        pool.retain(b).unwrap();
        let sharers: Vec<_> = (0..2)
            .map(|_| {
                let (pool, payload) = (pool.clone(), payload.clone());
                thread::spawn(move || {
                    // SAFETY: readers only, until both references are dropped below.
                    let v = payload.with(|p| unsafe { *p });
                    assert_eq!(v, 7);
                    pool.release(b).unwrap();
                })
            })
            .collect();
        let (pool2, payload2) = (pool.clone(), payload.clone());
        let next_owner = thread::spawn(move || {
            // Spin until the block is free again, then own it exclusively and write.
            loop {
                if let Ok(got) = pool2.allocate(1) {
                    // SAFETY: we hold the only reference; the pool orders the sharers' reads
                    // before our allocation.
                    payload2.with_mut(|p| unsafe { *p = got[0] as u64 + 100 });
                    return;
                }
                thread::yield_now();
            }
        });
        for s in sharers {
            s.join().unwrap();
        }
        next_owner.join().unwrap();
    });
}

/// A holder's `retain` races another holder's last `release` of the same tenancy while a third
/// thread allocates. The retain either lands first (then the block is never freed, so the
/// allocation on this one-block pool must fail) or is refused as stale; it never revives the
/// freed block nor adds a reference to the next tenant's.
#[test]
fn stale_retain_racing_the_last_release_is_refused() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(1, 1).unwrap());
        let h = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
        let p1 = pool.clone();
        let last = thread::spawn(move || p1.release(h).unwrap());
        let p2 = pool.clone();
        let retainer = thread::spawn(move || match p2.retain(h) {
            Ok(n) => {
                assert_eq!(n, 2);
                true
            }
            Err(Error::StaleHandle(s)) => {
                assert_eq!(s, h);
                false
            }
            Err(e) => panic!("{e}"),
        });
        let p3 = pool.clone();
        let next = thread::spawn(move || p3.allocate(1).ok().map(|b| p3.handle(b[0]).unwrap()));
        let freed = last.join().unwrap();
        let retained = retainer.join().unwrap();
        let next = next.join().unwrap();
        assert_eq!(
            freed, !retained,
            "the last release frees unless the retain came first"
        );
        if retained {
            assert!(
                next.is_none(),
                "a retained block was handed to another holder"
            );
            assert!(pool.release(h).unwrap());
        }
        if let Some(n) = next {
            assert_ne!(
                n.generation(),
                h.generation(),
                "a new tenancy, a new generation"
            );
            assert_eq!(
                pool.refcount(n.id()).unwrap(),
                1,
                "the new tenant's count moved"
            );
            assert_eq!(pool.retain(h), Err(Error::StaleHandle(h)));
            assert!(pool.release(n).unwrap());
        }
        assert_eq!(pool.num_free_list_blocks(), 1);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// A holder releases its handle twice (a caller bug) while the block's other holder releases
/// and a third thread allocates it: of the three releases of one two-reference tenancy,
/// exactly two succeed; the extra one is refused (`DoubleFree` before the block is handed out
/// again, `StaleHandle` after) and never drops the next tenant's reference.
#[test]
fn handle_generation_race_refuses_the_extra_release() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(1, 1).unwrap());
        let h = pool.handle(pool.allocate(1).unwrap()[0]).unwrap();
        pool.retain(h).unwrap();
        let p1 = pool.clone();
        let buggy = thread::spawn(move || [p1.release(h), p1.release(h)]);
        let p2 = pool.clone();
        let other = thread::spawn(move || p2.release(h));
        let p3 = pool.clone();
        let next = thread::spawn(move || p3.allocate(1).ok().map(|b| p3.handle(b[0]).unwrap()));
        let mut results = buggy.join().unwrap().to_vec();
        results.push(other.join().unwrap());
        let next = next.join().unwrap();
        assert_eq!(
            results.iter().filter(|r| r.is_ok()).count(),
            2,
            "{results:?}"
        );
        for r in results.iter().filter(|r| r.is_err()) {
            match r {
                Err(Error::DoubleFree(b)) => assert_eq!(*b, h.id()),
                Err(Error::StaleHandle(s)) => {
                    assert_eq!(*s, h);
                    assert!(
                        next.is_some(),
                        "stale only once the block was handed out again"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        if let Some(n) = next {
            assert_eq!(
                pool.refcount(n.id()).unwrap(),
                1,
                "the new tenant's count moved"
            );
            assert!(pool.release(n).unwrap());
        }
        assert_eq!(pool.num_free_list_blocks(), 1);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// The chunked multi-block pop against the ABA pattern: while one thread takes two blocks (one
/// walk of two links, or single pops after a failed CAS), another pops two and pushes them back
/// in the other order, which leaves the same head index with a different link below it. The
/// tag must fail the stale walk's CAS; no block is handed out twice.
#[test]
fn chunked_multi_pop_against_pop_pop_push() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(4, 1).unwrap());
        let p1 = pool.clone();
        let taker = thread::spawn(move || p1.allocate(2).unwrap());
        let p2 = pool.clone();
        let churn = thread::spawn(move || {
            let bs = p2.allocate(2).unwrap();
            let hs = [p2.handle(bs[0]).unwrap(), p2.handle(bs[1]).unwrap()];
            p2.release(hs[0]).unwrap();
            p2.release(hs[1]).unwrap();
        });
        churn.join().unwrap();
        let got = taker.join().unwrap();
        assert_ne!(got[0], got[1], "one block handed out twice");
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
        let rest = pool.allocate(2).unwrap();
        assert!(
            rest.iter().all(|b| !got.contains(b)),
            "a block both held and free"
        );
    });
}

/// Two chained releases (each one CAS pushing two linked blocks) race a three-block
/// allocation: every block ends held or free exactly once, whatever the interleaving of the
/// pushes with the multi-pop's walk.
#[test]
fn two_chain_pushes_against_a_multi_pop() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(BlockPool::new(5, 1).unwrap());
        let ids = pool.allocate(4).unwrap(); // block 4 stays free
        let hs: Vec<_> = ids.iter().map(|&b| pool.handle(b).unwrap()).collect();
        let (a, b) = (hs[..2].to_vec(), hs[2..].to_vec());
        let p1 = pool.clone();
        let t1 = thread::spawn(move || assert_eq!(p1.release_all(a).unwrap(), 2));
        let p2 = pool.clone();
        let t2 = thread::spawn(move || assert_eq!(p2.release_all(b).unwrap(), 2));
        let p3 = pool.clone();
        let t3 = thread::spawn(move || p3.allocate(3).ok());
        t1.join().unwrap();
        t2.join().unwrap();
        let got = t3.join().unwrap();
        let held = got.as_ref().map_or(0, Vec::len);
        assert_eq!(pool.num_free_list_blocks(), 5 - held);
        pool.check_invariants_quiescent().unwrap();
        let rest = pool.allocate(5 - held).unwrap();
        if let Some(got) = got {
            let mut all: Vec<u32> = got.iter().chain(&rest).copied().collect();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), 5, "a block both held and free");
        }
    });
}

/// A prefix-caching manager on a pool of 2 blocks of 1 token: one block free, the other cached
/// (sequence 1, `[1]`, admitted and freed; its block id is returned, with a handle to that
/// tenancy).
fn manager_with_one_cached_block() -> (
    std::sync::Arc<BlockPool>,
    pagedkv::KvCacheManager,
    pagedkv::BlockHandle,
) {
    use pagedkv::{KvCacheManager, ManagerConfig};
    let pool = std::sync::Arc::new(BlockPool::new(2, 1).unwrap());
    let config = ManagerConfig {
        enable_prefix_caching: true,
        ..Default::default()
    };
    let mut kv = KvCacheManager::with_pool(pool.clone(), config).unwrap();
    kv.add_sequence(1, &[1], None).unwrap();
    let handle = pool.handle(kv.block_table(1).unwrap()[0]).unwrap();
    kv.free(1).unwrap(); // its block is now cached-evictable
    assert_eq!(
        (pool.num_free_list_blocks(), pool.num_cached_blocks()),
        (1, 1)
    );
    (pool, kv, handle)
}

/// The prefix-caching manager's allocation when part of what it needs comes from evicting its
/// own cache: it reserves `(needed - evictable, needed)` from the pool in one step and evicts
/// for the rest, racing a single-block allocation on a pool of 2 (one block free, one cached).
/// Exactly one of them succeeds, whatever the order, and the manager's invariants hold after.
#[test]
fn prefix_manager_allocation_with_eviction_against_a_single_allocation() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let (pool, mut kv, _) = manager_with_one_cached_block();
        let manager = thread::spawn(move || {
            let ok = kv.add_sequence(2, &[5, 6], None).is_ok();
            (kv, ok)
        });
        let p = pool.clone();
        let single = thread::spawn(move || p.allocate(1).ok().map(|b| p.handle(b[0]).unwrap()));
        let (mut kv, manager_ok) = manager.join().unwrap();
        let single = single.join().unwrap();
        assert_ne!(manager_ok, single.is_some(), "exactly one fits a pool of 2");
        kv.check_invariants().unwrap();
        if let Some(h) = single {
            assert!(pool.release(h).unwrap());
        }
        drop(kv);
        assert_eq!(pool.num_free_list_blocks(), 2);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// An eviction claims its cached block (refcount 0 -> 1, next generation) with a load and a
/// store, not a read-modify-write, racing a retain and a release through a handle to the
/// block's previous tenancy. Whatever the interleaving both are refused (a refcount-0 word is
/// only ever read by others), and the claim leaves the next tenancy at refcount 1.
#[test]
fn eviction_claim_against_the_previous_tenancys_handle() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let (pool, mut kv, old) = manager_with_one_cached_block();
        let cached = old.id(); // refcount 0, still indexed
        let manager = thread::spawn(move || {
            // Two blocks: the free one and the cached one, evicted and claimed.
            kv.add_sequence(2, &[5, 6], None).unwrap();
            kv
        });
        let p = pool.clone();
        let stale = thread::spawn(move || (p.retain(old), p.release(old)));
        let mut kv = manager.join().unwrap();
        let (retained, released) = stale.join().unwrap();
        assert_eq!(retained, Err(Error::StaleHandle(old)));
        // Before the claim the handle's tenancy is over (DoubleFree), after it stale.
        assert!(
            matches!(released, Err(Error::DoubleFree(b)) if b == cached)
                || released == Err(Error::StaleHandle(old)),
            "{released:?}"
        );
        let now = pool.handle(cached).unwrap();
        assert_ne!(now.generation(), old.generation());
        assert_eq!(pool.refcount(cached).unwrap(), 1);
        kv.check_invariants().unwrap();
        drop(kv);
        pool.check_invariants_quiescent().unwrap();
    });
}

/// A manager alone on its pool checks the pool's cached-block count exactly (docs/pool.md):
/// while it checks, a second manager is built on the same pool, caches a block of its own and
/// is dropped. Whatever the interleaving the check raises no false violation: it compares only
/// when the pool's attach word read before and after the count is the same, with one manager.
/// (Reading the word only before, or only after, lets the count include the second manager's
/// block; both mutations fail here.)
#[test]
fn sole_manager_count_check_against_a_manager_attaching_and_dropping() {
    use pagedkv::{KvCacheManager, ManagerConfig};
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let (pool, mut kv, _) = manager_with_one_cached_block();
        let p = pool.clone();
        let other = thread::spawn(move || {
            let config = ManagerConfig {
                enable_prefix_caching: true,
                ..Default::default()
            };
            let mut other = KvCacheManager::with_pool(p, config).unwrap();
            other.add_sequence(1, &[9], None).unwrap(); // the free block
            other.free(1).unwrap(); // now cached by `other`
        });
        let checker = thread::spawn(move || {
            kv.check_invariants().unwrap();
            kv
        });
        other.join().unwrap();
        let mut kv = checker.join().unwrap();
        kv.check_invariants().unwrap();
        assert_eq!(pool.num_cached_blocks(), 1);
    });
}
