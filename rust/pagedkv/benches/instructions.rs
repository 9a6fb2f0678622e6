//! Fixed-work scenarios for instruction counting, load-independent (unlike wall time on a
//! shared machine). Each scenario runs inside an `#[inline(never)]` function named
//! `scenario_*`, so callgrind can count exactly it:
//!
//! ```text
//! cargo bench -p pagedkv --bench instructions --no-run
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*scenario_*' \
//!     --callgrind-out-file=/dev/null target/release/deps/instructions-<hash> append_batch_48 1000
//! ```
//!
//! `Collected` (Ir) divided by the printed unit count is instructions per unit. Without
//! valgrind the binary prints wall time per unit (a sanity check only).

use std::hint::black_box;
use std::time::Instant;

use pagedkv::{splitmix64, BlockPool, KvCacheManager, ManagerConfig};

/// A seeded stream of bounded integers (multiply-shift over SplitMix64).
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: u64) -> u64 {
        ((splitmix64::next(&mut self.0) as u128 * bound as u128) >> 64) as u64
    }
}

fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        ..Default::default()
    })
    .unwrap()
}

/// One single-block allocate + release pair on the pool, through the public API an embedder
/// uses (allocate, take the block's handle, release the handle). Units: pairs.
#[inline(never)]
fn scenario_alloc_free_pair(pool: &BlockPool, iters: u64) -> u64 {
    let mut buf = Vec::with_capacity(4);
    for _ in 0..iters {
        buf.clear();
        pool.allocate_into(1, &mut buf).unwrap();
        let handle = pool.handle(black_box(buf[0])).unwrap();
        pool.release(handle).unwrap();
    }
    iters
}

/// One decode step over 48 sequences (block size 16, so one in 16 appends takes a block).
/// Units: sequence-appends.
#[inline(never)]
fn scenario_append_batch(kv: &mut KvCacheManager, seq_ids: &[u64], iters: u64) -> u64 {
    for _ in 0..iters {
        kv.append_len_batch(black_box(seq_ids), 1).unwrap();
    }
    iters * seq_ids.len() as u64
}

/// Admit a 200-token sequence, then free it. Units: add+free pairs.
#[inline(never)]
fn scenario_add_free(kv: &mut KvCacheManager, iters: u64) -> u64 {
    for i in 0..iters {
        kv.add_sequence_len(black_box(i), 200).unwrap();
        kv.free(black_box(i)).unwrap();
    }
    iters
}

/// Prefix-cached admission: a 512-token prompt (a 256-token prefix shared by every request,
/// then 256 tokens unique to the request; block size 16) admitted and freed. Each admission
/// hashes 32 full blocks, hits 16, registers 16 new ones (one `BlockStored` event) and, once
/// the cache is full, evicts 16. Units: admissions.
#[inline(never)]
fn scenario_prefix_admit(kv: &mut KvCacheManager, iters: u64) -> u64 {
    let mut prompt: Vec<u32> = (0..512).collect();
    for i in 0..iters {
        for (j, t) in prompt[256..].iter_mut().enumerate() {
            *t = (i as u32).wrapping_mul(7919).wrapping_add(j as u32) | 1 << 31;
        }
        kv.add_sequence(black_box(i), black_box(&prompt), None)
            .unwrap();
        kv.free(black_box(i)).unwrap();
        kv.take_events();
    }
    iters
}

/// The hit walk alone: a 1,025-token prompt whose 64 full blocks (a 1,024-token system
/// prompt) are cached, looked up with `match_prefix` (`lookup_only`) or admitted and freed
/// (one new block for the last token). Units: look-ups or admissions.
#[inline(never)]
fn scenario_prefix_hit(kv: &mut KvCacheManager, iters: u64, lookup_only: bool) -> u64 {
    let mut prompt: Vec<u32> = (0..1025).map(|j| 1_000_000 + j).collect();
    kv.add_sequence(u64::MAX, &prompt, None).unwrap();
    kv.free(u64::MAX).unwrap();
    for i in 0..iters {
        prompt[1024] = i as u32;
        if lookup_only {
            black_box(kv.match_prefix(black_box(&prompt), None).unwrap());
        } else {
            kv.add_sequence(black_box(i), black_box(&prompt), None)
                .unwrap();
            kv.free(black_box(i)).unwrap();
        }
    }
    iters
}

/// The peer benchmark's W2 prefix-sharing workload in Rust (one admission = one request):
/// 16 system prompts of 1,024 tokens (64 full blocks each), a unique suffix of 100..=500
/// tokens, admission batches of 8, at most 256 requests resident (the oldest freed first),
/// 65,536 blocks of 16. Units: requests (admit + free).
#[inline(never)]
fn scenario_prefix_w2(kv: &mut KvCacheManager, iters: u64) -> u64 {
    let mut rng = Rng(0x5EED_0002);
    let mut resident = std::collections::VecDeque::new();
    let mut prompt: Vec<u32> = Vec::with_capacity(1524);
    for i in 0..iters {
        if i % 8 == 0 {
            while resident.len() + 8 > 256 {
                kv.free(black_box(resident.pop_front().unwrap())).unwrap();
            }
        }
        let system = rng.below(16) as u32;
        let suffix = 100 + rng.below(401) as u32;
        prompt.clear();
        prompt.extend((0..1024).map(|j| 2_000_000_000 + system * 1024 + j));
        prompt.extend((0..suffix).map(|j| (i as u32).wrapping_mul(512).wrapping_add(j)));
        kv.add_sequence(black_box(i), black_box(&prompt), None)
            .unwrap();
        resident.push_back(i);
    }
    for id in resident {
        kv.free(id).unwrap();
    }
    iters
}

/// All-miss prefix admission: a unique 1,324-token prompt (82 full blocks) admitted and freed
/// on 65,536 blocks of 16; once the pool's free list is used up every new block evicts a cached
/// one. With `caching` off the same calls are the baseline the all-miss target is a ratio of.
/// With events on, they are drained every 64 admissions, as a consumer publishing them in
/// batches would (building each drained event is counted; an undrained queue measured its own
/// growth instead). Units: admissions.
#[inline(never)]
fn scenario_prefix_miss(kv: &mut KvCacheManager, iters: u64) -> u64 {
    let mut prompt: Vec<u32> = vec![0; 1324];
    for i in 0..iters {
        for (j, t) in prompt.iter_mut().enumerate() {
            *t = (i as u32).wrapping_mul(4096).wrapping_add(j as u32);
        }
        kv.add_sequence(black_box(i), black_box(&prompt), None)
            .unwrap();
        kv.free(black_box(i)).unwrap();
        if i % 64 == 63 {
            black_box(kv.take_events());
        }
    }
    iters
}

/// The Python op-mix schedule (benches/python/test_manager_bench.py, counts only) in Rust:
/// 48 running sequences; each step appends one token to all (one batch call), finishes two,
/// admits two, and forks one in four steps. Units: sequence-operations.
#[inline(never)]
fn scenario_op_mix(iters: u64) -> u64 {
    let mut ops = 0u64;
    for round in 0..iters {
        let mut rng = Rng(round);
        let mut kv = manager(8192, 16);
        let mut running: Vec<u64> = Vec::new();
        let mut next_id = 0u64;
        for _ in 0..48 {
            kv.add_sequence_len(next_id, 50 + rng.below(350) as usize)
                .unwrap();
            running.push(next_id);
            next_id += 1;
            ops += 1;
        }
        for _ in 0..60 {
            kv.append_len_batch(&running, 1).unwrap();
            ops += running.len() as u64;
            for _ in 0..2 {
                let victim = running.swap_remove(rng.below(running.len() as u64) as usize);
                kv.free(victim).unwrap();
                kv.add_sequence_len(next_id, 50 + rng.below(350) as usize)
                    .unwrap();
                running.push(next_id);
                next_id += 1;
                ops += 2;
            }
            if rng.below(4) == 0 {
                let parent = running[rng.below(running.len() as u64) as usize];
                kv.fork(parent, next_id).unwrap();
                running.push(next_id);
                next_id += 1;
                ops += 1;
            }
        }
        kv.free_batch(&running).unwrap();
        ops += running.len() as u64;
    }
    ops
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let scenario = args.first().map_or("op_mix", String::as_str);
    let iters: u64 = args
        .get(1)
        .map_or(100, |n| n.parse().expect("iteration count"));
    let start = Instant::now();
    let units = match scenario {
        "alloc_free_pair" => {
            let pool = BlockPool::new(4096, 16).unwrap();
            scenario_alloc_free_pair(&pool, iters)
        }
        "append_batch_48" => {
            let mut kv = manager(1 << 16, 16);
            let ids: Vec<u64> = (0..48).collect();
            for &id in &ids {
                kv.add_sequence_len(id, 100 + id as usize).unwrap();
            }
            scenario_append_batch(&mut kv, &ids, iters)
        }
        "add_free" => {
            let mut kv = manager(4096, 16);
            scenario_add_free(&mut kv, iters)
        }
        "prefix_admit" => {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 1024,
                block_size: 16,
                enable_prefix_caching: true,
                enable_kv_events: true,
                ..Default::default()
            })
            .unwrap();
            scenario_prefix_admit(&mut kv, iters)
        }
        "prefix_w2" | "prefix_w2_events" => {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 65_536,
                block_size: 16,
                enable_prefix_caching: true,
                enable_kv_events: scenario == "prefix_w2_events",
                ..Default::default()
            })
            .unwrap();
            let units = scenario_prefix_w2(&mut kv, iters);
            black_box(kv.take_events());
            units
        }
        "prefix_miss" | "prefix_miss_events" | "plain_miss" => {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 65_536,
                block_size: 16,
                enable_prefix_caching: scenario != "plain_miss",
                enable_kv_events: scenario == "prefix_miss_events",
                max_events: 1 << 20,
                ..Default::default()
            })
            .unwrap();
            let units = scenario_prefix_miss(&mut kv, iters);
            black_box(kv.take_events());
            units
        }
        "prefix_match" | "prefix_hit_admit" => {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 4096,
                block_size: 16,
                enable_prefix_caching: true,
                ..Default::default()
            })
            .unwrap();
            scenario_prefix_hit(&mut kv, iters, scenario == "prefix_match")
        }
        "op_mix" => scenario_op_mix(iters),
        other => {
            // `cargo bench` without `--bench` runs every target with its own arguments.
            eprintln!("instructions: unknown scenario {other:?}; nothing run");
            0
        }
    };
    if units > 0 {
        let ns = start.elapsed().as_nanos() as f64 / units as f64;
        println!("{scenario}: {units} units, {ns:.1} ns/unit (wall, includes setup)");
    }
}
