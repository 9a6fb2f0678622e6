//! Manager hot paths: append one token into a non-full private block, fork a 1,000-token
//! sequence, and free a forked group.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use pagedkv::{KvCacheManager, ManagerConfig};

fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig { num_blocks, block_size, ..Default::default() }).unwrap()
}

fn append_one_token(c: &mut Criterion) {
    let mut g = c.benchmark_group("append_one_token");
    // Huge blocks so every timed append lands in the private, non-full last block.
    let block_size = 1 << 20;
    g.bench_function("append_len", |b| {
        b.iter_custom(|iters| {
            let mut kv = manager(64, block_size);
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let chunk = left.min(block_size as u64 - 2);
                kv.add_sequence_len(1, 1).unwrap();
                let start = Instant::now();
                for _ in 0..chunk {
                    kv.append_len(black_box(1), 1).unwrap();
                }
                total += start.elapsed();
                kv.free(1).unwrap();
                left -= chunk;
            }
            total
        })
    });
    g.bench_function("append_tokens", |b| {
        b.iter_custom(|iters| {
            let mut kv = manager(64, block_size);
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let chunk = left.min(block_size as u64 - 2);
                kv.add_sequence(1, &[7], None).unwrap();
                let start = Instant::now();
                for i in 0..chunk {
                    kv.append_tokens(black_box(1), &[i as u32]).unwrap();
                }
                total += start.elapsed();
                kv.free(1).unwrap();
                left -= chunk;
            }
            total
        })
    });
    // Realistic block size: the block boundary costs one pool allocation every 16 tokens.
    g.bench_function("append_len_bs16_amortized", |b| {
        b.iter_custom(|iters| {
            let mut kv = manager(1 << 16, 16);
            let mut total = Duration::ZERO;
            let mut left = iters;
            let cap = (1u64 << 16) * 16 - 32;
            while left > 0 {
                let chunk = left.min(cap);
                kv.add_sequence_len(1, 1).unwrap();
                let start = Instant::now();
                for _ in 0..chunk {
                    kv.append_len(black_box(1), 1).unwrap();
                }
                total += start.elapsed();
                kv.free(1).unwrap();
                left -= chunk;
            }
            total
        })
    });
    g.finish();
}

fn fork_and_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("fork");
    g.bench_function("fork_1000_tokens_63_blocks", |b| {
        let mut kv = manager(4096, 16);
        kv.add_sequence_len(0, 1000).unwrap();
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                kv.fork(0, 1).unwrap();
                total += start.elapsed();
                kv.free(1).unwrap();
            }
            total
        })
    });
    g.bench_function("free_forked_group_1_plus_4", |b| {
        b.iter_batched(
            || {
                // Parent 1,000 tokens + 4 samples that each wrote 200 tokens (114 blocks).
                let mut kv = manager(4096, 16);
                kv.add_sequence_len(0, 1000).unwrap();
                for child in 1..=4 {
                    kv.fork(0, child).unwrap();
                    kv.append_len(child, 200).unwrap();
                }
                kv
            },
            |mut kv| {
                kv.free_batch(black_box(&[0, 1, 2, 3, 4])).unwrap();
                kv
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = append_one_token, fork_and_free
}
criterion_main!(benches);
