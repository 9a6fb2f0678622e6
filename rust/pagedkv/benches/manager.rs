//! Manager hot paths: append one token into a non-full private block, fork a 1,000-token
//! sequence, and free a forked group.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use pagedkv::{KvCacheManager, ManagerConfig};

fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        ..Default::default()
    })
    .unwrap()
}

/// Times `iters` appends to sequence 1, in chunks of at most `chunk_len` appends so that the
/// sequence never outgrows the pool: each chunk admits the sequence (`admit`, untimed), times
/// `append(kv, i)` for i in 0..chunk, and frees it (untimed).
fn time_appends(
    kv: &mut KvCacheManager,
    iters: u64,
    chunk_len: u64,
    admit: impl Fn(&mut KvCacheManager),
    mut append: impl FnMut(&mut KvCacheManager, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let chunk = left.min(chunk_len);
        admit(kv);
        let start = Instant::now();
        for i in 0..chunk {
            append(kv, i);
        }
        total += start.elapsed();
        kv.free(1).unwrap();
        left -= chunk;
    }
    total
}

fn append_one_token(c: &mut Criterion) {
    let mut g = c.benchmark_group("append_one_token");
    // Huge blocks so every timed append lands in the private, non-full last block.
    let block_size = 1 << 20;
    g.bench_function("append_len", |b| {
        b.iter_custom(|iters| {
            time_appends(
                &mut manager(64, block_size),
                iters,
                block_size as u64 - 2,
                |kv| {
                    kv.add_sequence_len(1, 1).unwrap();
                },
                |kv, _| kv.append_len(black_box(1), 1).unwrap(),
            )
        })
    });
    g.bench_function("append_tokens", |b| {
        b.iter_custom(|iters| {
            time_appends(
                &mut manager(64, block_size),
                iters,
                block_size as u64 - 2,
                |kv| {
                    kv.add_sequence(1, &[7], None).unwrap();
                },
                |kv, i| kv.append_tokens(black_box(1), &[i as u32]).unwrap(),
            )
        })
    });
    // Realistic block size: the block boundary costs one pool allocation every 16 tokens.
    g.bench_function("append_len_bs16_amortized", |b| {
        b.iter_custom(|iters| {
            time_appends(
                &mut manager(1 << 16, 16),
                iters,
                (1u64 << 16) * 16 - 32,
                |kv| {
                    kv.add_sequence_len(1, 1).unwrap();
                },
                |kv, _| kv.append_len(black_box(1), 1).unwrap(),
            )
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

fn prefix_admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_admit_2000_tokens_1024_cached");
    g.throughput(criterion::Throughput::Elements(2000));
    for caching in [true, false] {
        let name = if caching { "caching_on" } else { "caching_off" };
        g.bench_function(name, |b| {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 4096,
                block_size: 16,
                enable_prefix_caching: caching,
                ..Default::default()
            })
            .unwrap();
            let prefix: Vec<u32> = (0..1024).collect();
            kv.add_sequence(0, &prefix, None).unwrap(); // keeps the 64 prefix blocks cached
            let mut prompt = prefix.clone();
            prompt.resize(2000, 0);
            let mut round = 0u32;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // A fresh suffix each time, so only the 1,024-token prefix hits.
                    round += 1;
                    for (i, t) in prompt[1024..].iter_mut().enumerate() {
                        *t = 1_000_000 + round * 1000 + i as u32;
                    }
                    let start = Instant::now();
                    let hit = kv.add_sequence(1, black_box(&prompt), None).unwrap();
                    total += start.elapsed();
                    assert_eq!(hit, if caching { 1024 } else { 0 });
                    kv.free(1).unwrap();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = append_one_token, fork_and_free, prefix_admission
}
criterion_main!(benches);
