//! Bounded waits under contention: the latency of one large (512-block) allocation, alone and
//! against a thread churning single-block allocate/release pairs on the same pool.
//!
//! A plain harness (not criterion): the question is the *distribution* (median and p99 of one
//! operation), and the baseline is the uncontended run of the same operation in the same
//! process, so the ratio is what carries across machines.
//!
//! ```sh
//! cargo bench -p pagedkv --bench pool_contention            # 2,000 samples per scenario
//! cargo bench -p pagedkv --bench pool_contention -- 500     # fewer samples
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use pagedkv::BlockPool;

const NUM_BLOCKS: usize = 4096;
const LARGE_BLOCKS: usize = 512;

/// Median and 99th percentile of the samples, in microseconds.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    (at(0.5), at(0.99))
}

/// Times `samples` allocations of `LARGE_BLOCKS` blocks (each released again, untimed).
fn time_large_allocations(pool: &BlockPool, samples: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(LARGE_BLOCKS);
    (0..samples)
        .map(|_| {
            out.clear();
            let start = Instant::now();
            pool.allocate_into(LARGE_BLOCKS, &mut out).unwrap();
            let took = start.elapsed();
            let handles = out.iter().rev().map(|&b| pool.handle(b).unwrap());
            pool.release_all(handles).unwrap();
            took
        })
        .collect()
}

/// Times the same allocations while another thread allocates and releases one block at a
/// time as fast as it can; returns the samples and the churner's pair count.
fn time_against_churn(pool: &Arc<BlockPool>, samples: usize) -> (Vec<Duration>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let churner = {
        let (pool, stop) = (pool.clone(), stop.clone());
        thread::spawn(move || {
            let mut pairs = 0u64;
            let mut buf = Vec::with_capacity(1);
            while !stop.load(Ordering::Relaxed) {
                buf.clear();
                pool.allocate_into(1, &mut buf).unwrap();
                let handle = pool.handle(black_box(buf[0])).unwrap();
                pool.release(handle).unwrap();
                pairs += 1;
            }
            pairs
        })
    };
    // Let the churner get going before the first sample.
    thread::sleep(Duration::from_millis(5));
    let got = time_large_allocations(pool, samples);
    stop.store(true, Ordering::Relaxed);
    (got, churner.join().unwrap())
}

fn main() {
    // `cargo bench` passes `--bench`; the first numeric argument is the sample count.
    let samples = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(2000);
    let pool = Arc::new(BlockPool::new(NUM_BLOCKS, 16).unwrap());
    // Warm up caches and the page tables of the metadata arrays.
    time_large_allocations(&pool, samples / 10 + 1);

    let (alone_med, alone_p99) = percentiles(&mut time_large_allocations(&pool, samples));
    let (mut contended, pairs) = time_against_churn(&pool, samples);
    let (cont_med, cont_p99) = percentiles(&mut contended);
    pool.check_invariants_quiescent().unwrap();

    println!("{LARGE_BLOCKS}-block allocation, pool of {NUM_BLOCKS}, {samples} samples each");
    println!("  alone:          median {alone_med:9.2} us   p99 {alone_p99:9.2} us");
    println!("  against churn:  median {cont_med:9.2} us   p99 {cont_p99:9.2} us   ({pairs} churner pairs)");
    println!(
        "  contended / alone: median {:.1}x   p99 {:.1}x   (targets: median <= 10x, p99 < 100 us)",
        cont_med / alone_med,
        cont_p99 / alone_p99
    );
}
