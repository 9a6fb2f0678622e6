//! Block pool hot path: one allocate + release pair, lock-free pool vs a `Mutex<Vec<u32>>`
//! free list (the in-run baseline), at 1 and 2 threads. Compare the `lockfree` and `mutex`
//! lines of each group for the ratio.

use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedkv::BlockPool;

const NUM_BLOCKS: usize = 4096;

/// The textbook free list: a vector of free block ids behind a mutex.
struct MutexFreeList {
    free: Mutex<Vec<u32>>,
}

impl MutexFreeList {
    fn new(n: u32) -> Self {
        MutexFreeList {
            free: Mutex::new((0..n).rev().collect()),
        }
    }
    #[inline]
    fn allocate(&self) -> Option<u32> {
        self.free.lock().unwrap().pop()
    }
    #[inline]
    fn release(&self, b: u32) {
        self.free.lock().unwrap().push(b);
    }
}

fn lockfree_pair(pool: &BlockPool, buf: &mut Vec<u32>) {
    buf.clear();
    pool.allocate_into(1, buf).unwrap();
    let handle = pool.handle(black_box(buf[0])).unwrap();
    pool.release(handle).unwrap();
}

fn mutex_pair(list: &MutexFreeList) {
    let b = list.allocate().unwrap();
    list.release(black_box(b));
}

/// Runs `per_thread(iters)` on `threads` threads at once and returns the wall time, so the
/// reported time is per pair per thread under contention.
fn on_threads(
    threads: usize,
    iters: u64,
    per_thread: impl Fn(u64) + Send + Sync + 'static,
) -> Duration {
    let per_thread = Arc::new(per_thread);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (f, b) = (per_thread.clone(), barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                f(iters);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    start.elapsed()
}

fn alloc_free_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_pair_1t");
    let pool = BlockPool::new(NUM_BLOCKS, 16).unwrap();
    let mut buf = Vec::with_capacity(4);
    g.bench_function("lockfree", |b| b.iter(|| lockfree_pair(&pool, &mut buf)));
    let list = MutexFreeList::new(NUM_BLOCKS as u32);
    g.bench_function("mutex", |b| b.iter(|| mutex_pair(&list)));
    g.finish();

    let mut g = c.benchmark_group("alloc_free_pair_2t");
    let pool = Arc::new(BlockPool::new(NUM_BLOCKS, 16).unwrap());
    g.bench_function("lockfree", |b| {
        b.iter_custom(|iters| {
            let pool = pool.clone();
            on_threads(2, iters, move |n| {
                let mut buf = Vec::with_capacity(4);
                for _ in 0..n {
                    lockfree_pair(&pool, &mut buf);
                }
            })
        })
    });
    let list = Arc::new(MutexFreeList::new(NUM_BLOCKS as u32));
    g.bench_function("mutex", |b| {
        b.iter_custom(|iters| {
            let list = list.clone();
            on_threads(2, iters, move |n| {
                for _ in 0..n {
                    mutex_pair(&list);
                }
            })
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = alloc_free_pair
}
criterion_main!(benches);
