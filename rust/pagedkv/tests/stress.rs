//! Thread stress: 8 threads, each with its own manager on one shared pool, 1,000,000 operations
//! in total. A global ownership bitmap proves no block is ever owned by two managers (or handed
//! out twice): a manager sets a block's bit when it gets the block and clears it just before
//! the block can return to the pool, asserting the previous value each time. At the end the
//! pool is exactly full again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use pagedkv::{BlockId, BlockPool, Error, KvCacheManager, ManagerConfig};

const THREADS: usize = 8;
const TOTAL_OPS: usize = 1_000_000;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn claim(owned: &[AtomicBool], b: BlockId) {
    assert!(
        !owned[b as usize].swap(true, Ordering::AcqRel),
        "block {b} owned twice"
    );
}

fn unclaim(owned: &[AtomicBool], b: BlockId) {
    assert!(
        owned[b as usize].swap(false, Ordering::AcqRel),
        "block {b} freed while not owned"
    );
}

fn worker(pool: Arc<BlockPool>, owned: Arc<Vec<AtomicBool>>, seed: u64, ops: usize) -> u64 {
    let mut kv = KvCacheManager::with_pool(pool, ManagerConfig::default()).unwrap();
    let mut rng = Rng(seed);
    let mut live: Vec<u64> = Vec::new();
    let mut next_id = 0u64;
    let mut shortages = 0u64;
    for step in 0..ops {
        let r = rng.below(100);
        if live.is_empty() || (r < 20 && live.len() < 8) {
            let n = 1 + rng.below(40) as usize;
            match kv.add_sequence_len(next_id, n) {
                Ok(_) => {
                    for &b in kv.block_table(next_id).unwrap() {
                        claim(&owned, b);
                    }
                    live.push(next_id);
                    next_id += 1;
                }
                Err(Error::OutOfBlocks { .. }) => shortages += 1,
                Err(e) => panic!("{e}"),
            }
        } else if r < 70 {
            let id = live[rng.below(live.len() as u64) as usize];
            let before = kv.block_table(id).unwrap().to_vec();
            match kv.append_len(id, 1 + rng.below(6) as usize) {
                Ok(()) => {
                    let after = kv.block_table(id).unwrap();
                    for (i, &b) in after.iter().enumerate() {
                        if before.get(i) != Some(&b) {
                            claim(&owned, b); // a fresh block or a copy-on-write destination
                        }
                    }
                }
                Err(Error::OutOfBlocks { .. }) => shortages += 1,
                Err(e) => panic!("{e}"),
            }
        } else if r < 80 && live.len() < 8 {
            let parent = live[rng.below(live.len() as u64) as usize];
            kv.fork(parent, next_id).unwrap();
            live.push(next_id);
            next_id += 1;
        } else {
            let id = live.swap_remove(rng.below(live.len() as u64) as usize);
            for &b in kv.block_table(id).unwrap() {
                if kv.refcount(b).unwrap() == 1 {
                    unclaim(&owned, b);
                }
            }
            kv.free(id).unwrap();
        }
        if step % 4096 == 0 {
            kv.check_invariants().unwrap();
        }
    }
    kv.check_invariants().unwrap();
    for id in live {
        for &b in kv.block_table(id).unwrap() {
            if kv.refcount(b).unwrap() == 1 {
                unclaim(&owned, b);
            }
        }
        kv.free(id).unwrap();
    }
    assert_eq!(kv.stats().num_blocks_in_use, 0);
    shortages
}

#[test]
fn eight_managers_one_pool_a_million_ops() {
    let num_blocks = 64;
    let pool = Arc::new(BlockPool::new(num_blocks, 4).unwrap());
    let owned: Arc<Vec<AtomicBool>> =
        Arc::new((0..num_blocks).map(|_| AtomicBool::new(false)).collect());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, owned) = (pool.clone(), owned.clone());
            std::thread::spawn(move || {
                worker(pool, owned, 0x9E37_79B9 + t as u64, TOTAL_OPS / THREADS)
            })
        })
        .collect();
    let shortages: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    // The pool is small enough that managers compete for it (otherwise this tests little).
    assert!(
        shortages > 0,
        "no manager ever ran short: the pool was not contended"
    );
    assert_eq!(pool.num_free_list_blocks(), num_blocks);
    assert!(owned.iter().all(|o| !o.load(Ordering::Acquire)));
    pool.check_invariants_quiescent().unwrap();
}

#[test]
fn eight_threads_raw_pool_a_million_ops() {
    let num_blocks = 64;
    let pool = Arc::new(BlockPool::new(num_blocks, 1).unwrap());
    let owned: Arc<Vec<AtomicBool>> =
        Arc::new((0..num_blocks).map(|_| AtomicBool::new(false)).collect());
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, owned, start) = (pool.clone(), owned.clone(), start.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0xDEAD_BEEF + t as u64);
                let mut held: Vec<BlockId> = Vec::new();
                start.wait();
                for step in 0..TOTAL_OPS / THREADS {
                    if held.is_empty() || rng.below(2) == 0 {
                        match pool.allocate(1 + rng.below(4) as usize) {
                            Ok(bs) => {
                                for &b in &bs {
                                    claim(&owned, b);
                                }
                                held.extend(bs);
                            }
                            Err(Error::OutOfBlocks { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    } else {
                        let b = held.swap_remove(rng.below(held.len() as u64) as usize);
                        unclaim(&owned, b);
                        assert!(pool.release(pool.handle(b).unwrap()).unwrap());
                    }
                    if step % 8192 == 0 {
                        pool.check_invariants().unwrap();
                    }
                }
                for b in held {
                    unclaim(&owned, b);
                    pool.release(pool.handle(b).unwrap()).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(pool.num_free_list_blocks(), num_blocks);
    pool.check_invariants_quiescent().unwrap();
}
