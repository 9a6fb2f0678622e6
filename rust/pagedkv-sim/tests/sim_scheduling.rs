//! Cache-aware scheduling in the step loop: runs that check the scheduling index every step
//! (and every admission's predicted hit), the offline optimum against every admission order of
//! tiny traces and against every policy on small ones, the aging bound, and the equivalence of a
//! zero bound with first come, first served.

use pagedkv_sim::{
    optimal_hits, simulate, Arrival, GroupKind, PrefixBlocks, RequestSpec, Scheduling, SimConfig,
    SimResult, SplitMix64, Workload,
};
use proptest::prelude::*;

mod common;

/// Tokens per trace block in these tests.
const TRACE_BLOCK: usize = 8;

/// A trace of conversations: each starts from one of `tenants` shared system prompts (1-2
/// blocks) and adds 1-2 blocks per turn; every turn is a request whose prompt is the whole
/// history (its last block cut at a random length). Requests are interleaved across
/// conversations, one per second.
fn conversations(seed: u64, num_requests: usize, tenants: u64) -> Workload {
    let mut rng = SplitMix64::new(seed);
    let mut histories: Vec<Vec<i64>> = Vec::new();
    let mut next_id = 1000i64;
    let (mut prompts, mut outputs, mut arrivals) = (Vec::new(), Vec::new(), Vec::new());
    let (mut offsets, mut ids) = (vec![0i64], Vec::new());
    for i in 0..num_requests {
        let k = rng.next_below(histories.len() as u64 + 2) as usize;
        if k >= histories.len() {
            let tenant = rng.next_below(tenants) as i64;
            let system = 1 + rng.next_below(2) as i64;
            histories.push((0..system).map(|b| tenant * 10 + b).collect());
        }
        let k = k.min(histories.len() - 1);
        for _ in 0..1 + rng.next_below(2) {
            histories[k].push(next_id);
            next_id += 1;
        }
        let blocks = &histories[k];
        let cut = 1 + rng.next_below(TRACE_BLOCK as u64) as usize;
        prompts.push(((blocks.len() - 1) * TRACE_BLOCK + cut) as i64);
        outputs.push(1 + rng.next_below(12) as i64);
        arrivals.push(i as f64);
        ids.extend_from_slice(blocks);
        offsets.push(ids.len() as i64);
    }
    Workload::from_arrays(
        &prompts,
        &outputs,
        &arrivals,
        None,
        GroupKind::None,
        None,
        None,
    )
    .unwrap()
    .with_prefix_blocks(PrefixBlocks::new(TRACE_BLOCK, &offsets, &ids).unwrap())
    .unwrap()
}

fn config(scheduling: Scheduling, num_slots: usize, block_size: usize) -> SimConfig {
    SimConfig {
        block_size,
        num_slots,
        max_model_len: 4096,
        enable_prefix_caching: true,
        scheduling,
        watermark: 0.0,
        check_invariants: true,
        ..Default::default()
    }
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for rest in permutations(n - 1) {
        for at in 0..=rest.len() {
            let mut p = rest.clone();
            p.insert(at, n - 1);
            out.push(p);
        }
    }
    out
}

/// `w`'s requests in the order `order`, all arriving at once.
fn reordered(w: &Workload, order: &[usize]) -> Workload {
    let blocks = w.prefix_blocks().unwrap();
    let specs: Vec<RequestSpec> = order
        .iter()
        .map(|&i| RequestSpec {
            arrival_s: 0.0,
            ..w.requests()[i]
        })
        .collect();
    let mut offsets = vec![0i64];
    let mut ids = Vec::new();
    for &i in order {
        ids.extend(blocks.of(i).iter().map(|&h| i64::from(h)));
        offsets.push(ids.len() as i64);
    }
    Workload::new(specs, GroupKind::None)
        .unwrap()
        .with_prefix_blocks(PrefixBlocks::new(blocks.block_tokens(), &offsets, &ids).unwrap())
        .unwrap()
}

fn hit_tokens(r: &SimResult) -> usize {
    r.prompt_hit_tokens
}

#[test]
fn the_optimum_is_the_best_admission_order_of_tiny_traces() {
    for seed in 0..12 {
        let w = conversations(seed, 5, 2);
        let best = optimal_hits(&w, 4, 0).unwrap();
        let longest = w.requests().iter().map(|r| r.final_len()).max().unwrap();
        // A pool holding everything, and one that holds only the largest request.
        for num_slots in [4096, longest.div_ceil(4) * 4] {
            let mut found = 0;
            for order in permutations(w.requests().len()) {
                let c = SimConfig {
                    max_num_seqs: 1,
                    arrival: Arrival::Saturated,
                    scheduling: Scheduling::Fcfs,
                    ..config(Scheduling::Fcfs, num_slots, 4)
                };
                let r = simulate(&reordered(&w, &order), &c).unwrap();
                assert_eq!(r.optimal_hit_tokens, best.hit_tokens);
                assert!(
                    hit_tokens(&r) <= best.hit_tokens,
                    "seed {seed}: order {order:?} beat the optimum"
                );
                found = found.max(hit_tokens(&r));
            }
            assert_eq!(
                found, best.hit_tokens,
                "seed {seed}, {num_slots} slots: no order reaches the optimum"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every policy, with batching and small pools, stays at or under the optimum, and the
    /// index checks itself every step (`check_invariants`) and every admission's hit.
    #[test]
    fn every_policy_stays_under_the_optimum(
        seed in 0u64..1000,
        num_requests in 4usize..40,
        tenants in 1u64..5,
        slots in 160usize..600,
        bound in 0usize..12,
        saturated in any::<bool>(),
    ) {
        let w = conversations(seed, num_requests, tenants);
        let longest = w.requests().iter().map(|r| r.final_len()).max().unwrap();
        let num_slots = slots.max(longest.div_ceil(4) * 4);
        for scheduling in [Scheduling::Fcfs, Scheduling::Lpm, Scheduling::Dfs] {
            let c = SimConfig {
                arrival: if saturated { Arrival::Saturated } else { Arrival::Trace },
                step_time_s: 0.25,
                max_num_seqs: 4,
                aging_bound: bound,
                ..config(scheduling, num_slots, 4)
            };
            let r = simulate(&w, &c).unwrap();
            prop_assert_eq!(r.finished_requests, num_requests);
            prop_assert!(r.prompt_hit_tokens <= r.optimal_hit_tokens);
            prop_assert!(r.token_hit_rate() <= r.optimal_token_hit_rate() + 1e-12);
            prop_assert!(r.max_passed_over <= bound, "{} > {}", r.max_passed_over, bound);
            prop_assert_eq!(r.wait_s.len(), num_requests);
            prop_assert!(r.wait_s.iter().all(|&w| w >= 0.0));
        }
    }
}

#[test]
fn a_zero_aging_bound_is_first_come_first_served() {
    let mut preemptions = 0;
    for seed in 0..6 {
        let w = conversations(seed, 60, 3);
        let fcfs = simulate(&w, &config(Scheduling::Fcfs, 400, 4)).unwrap();
        preemptions += fcfs.preemptions;
        for scheduling in [Scheduling::Lpm, Scheduling::Dfs] {
            let c = SimConfig {
                aging_bound: 0,
                ..config(scheduling, 400, 4)
            };
            let r = simulate(&w, &c).unwrap();
            assert_eq!(r.finished_request_ids, fcfs.finished_request_ids);
            assert_eq!(r.prompt_hit_tokens, fcfs.prompt_hit_tokens);
            assert_eq!(r.prefill_tokens, fcfs.prefill_tokens);
            assert_eq!(r.steps, fcfs.steps);
            assert_eq!(r.latency_s, fcfs.latency_s);
            assert_eq!(r.max_passed_over, 0);
            assert_eq!(r.preemptions, fcfs.preemptions);
        }
    }
    // Recomputed requests come back ahead of the waiting ones in both.
    assert!(preemptions > 0, "the runs should include preemptions");
}

/// Eight system prompts, requests cycling through them, a pool that holds about two of them
/// besides the running requests: first come, first served recomputes a prompt almost every
/// time; the cache-aware policies group each prompt's requests and compute it about once.
#[test]
fn cache_aware_policies_group_requests_that_share_a_prompt() {
    let prefix_ids: Vec<i64> = (0..400).map(|i| i % 8).collect();
    let w = common::system_prompts(&prefix_ids);
    let run = |scheduling| {
        let c = SimConfig {
            max_num_seqs: 8,
            check_invariants: false,
            ..config(scheduling, 16 * 64, 16)
        };
        simulate(&w, &c).unwrap()
    };
    let fcfs = run(Scheduling::Fcfs);
    let best = fcfs.optimal_token_hit_rate();
    assert!(
        fcfs.token_hit_rate() < 0.5 * best,
        "fcfs {} vs optimum {best}",
        fcfs.token_hit_rate()
    );
    for scheduling in [Scheduling::Lpm, Scheduling::Dfs] {
        let r = run(scheduling);
        assert!(
            r.hit_rate_of_optimum() >= 0.96,
            "{scheduling}: {} of the optimum",
            r.hit_rate_of_optimum()
        );
        assert!(r.max_passed_over <= r.aging_bound);
    }
}

#[test]
fn scheduling_needs_a_prefix_cache() {
    let w = conversations(1, 5, 1);
    for (caching, host) in [(false, 0), (true, 64)] {
        let c = SimConfig {
            enable_prefix_caching: caching,
            num_host_slots: host,
            ..config(Scheduling::Lpm, 1024, 4)
        };
        let err = simulate(&w, &c).unwrap_err().to_string();
        assert!(err.contains("scheduling 'lpm'"), "{err}");
    }
}
