//! Queue-aware eviction in the step loop (`SimConfig::queue_aware_eviction`,
//! docs/scheduling.md): runs that check the allocator's and the scheduling index's invariants
//! every step (and every admission's predicted hit), with the blocks a waiting request will hit
//! evicted after every other cached block.

use pagedkv_sim::{simulate, Arrival, Scheduling, SimConfig, SimResult, Workload};

mod common;

/// `n` requests cycling through `prompts` system prompts, not in turn (`common::system_prompts`).
fn system_prompts(n: usize, prompts: i64) -> Workload {
    let prefix_ids: Vec<i64> = (0..n as i64).map(|i| (i * 7 + i / 5) % prompts).collect();
    common::system_prompts(&prefix_ids)
}

fn run(w: &Workload, scheduling: Scheduling, queue_aware: bool) -> SimResult {
    let c = SimConfig {
        block_size: 16,
        num_slots: 16 * 120,
        max_model_len: 4096,
        max_num_seqs: 4,
        enable_prefix_caching: true,
        scheduling,
        queue_aware_eviction: queue_aware,
        arrival: Arrival::Poisson,
        poisson_rate: 40.0,
        watermark: 0.0,
        check_invariants: true,
        ..Default::default()
    };
    simulate(w, &c).unwrap()
}

/// With requests arriving while others run (Poisson, 40 per second; a pool of 120 blocks holds
/// the 4 running requests and a few of the 8 system prompts), plain LRU evicts prefixes that
/// queued requests were about to hit (128 blocks under `lpm`); the queue-aware order keeps them
/// while anything else can go. Every step is checked (allocator invariants with both eviction
/// lists, the index against each hit).
#[test]
fn queue_aware_eviction_keeps_what_waiting_requests_hit() {
    let w = system_prompts(300, 8);
    for scheduling in [Scheduling::Lpm, Scheduling::Dfs] {
        let lru = run(&w, scheduling, false);
        let aware = run(&w, scheduling, true);
        assert!(
            lru.evicted_wanted_blocks > 0,
            "{scheduling}: the workload must evict wanted blocks under LRU"
        );
        assert!(
            aware.evicted_wanted_blocks < lru.evicted_wanted_blocks,
            "{scheduling}: {} wanted blocks evicted, LRU {}",
            aware.evicted_wanted_blocks,
            lru.evicted_wanted_blocks
        );
        assert!(
            aware.token_hit_rate() >= lru.token_hit_rate(),
            "{scheduling}: hit rate {} against LRU's {}",
            aware.token_hit_rate(),
            lru.token_hit_rate()
        );
    }
}

#[test]
fn queue_aware_eviction_needs_a_cache_aware_queue() {
    let w = system_prompts(4, 2);
    let c = SimConfig {
        enable_prefix_caching: true,
        queue_aware_eviction: true,
        ..Default::default()
    };
    let err = simulate(&w, &c).unwrap_err().to_string();
    assert!(err.contains("queue_aware_eviction"), "{err}");
}
