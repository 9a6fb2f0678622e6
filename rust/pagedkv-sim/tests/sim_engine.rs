//! Exact small scenarios of the simulator's step loop, plus seeded randomized runs that check
//! the allocators' invariants after every step.

use pagedkv::Error;
use pagedkv_sim::{
    record_frames, simulate, AllocatorKind, Arrival, GroupKind, Placement, Preemption, RequestSpec,
    SimConfig, SimResult, SplitMix64, Workload,
};

fn plain(requests: &[(usize, usize)]) -> Workload {
    let specs = requests
        .iter()
        .map(|&(p, o)| RequestSpec {
            prompt_tokens: p,
            output_tokens: o,
            arrival_s: 0.0,
            group_size: 1,
            prefix: None,
        })
        .collect();
    Workload::new(specs, GroupKind::None).unwrap()
}

fn shares_sum(r: &SimResult) -> f64 {
    r.token_states + r.reserved + r.internal_fragmentation + r.external_fragmentation + r.free
}

#[test]
fn paged_single_request_accounts_every_slot() {
    // 20-token prompt, 3 output tokens, blocks of 8 in a pool of 64 slots (8 blocks).
    let w = plain(&[(20, 3)]);
    let config = SimConfig {
        block_size: 8,
        num_slots: 64,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 100).unwrap();
    assert_eq!(r.steps, 3);
    assert_eq!(frames.len(), 3);
    // Final length 23 in 3 blocks (24 slots): 1 slot never used.
    let expect = [(21, 2, 1), (22, 1, 1), (23, 0, 1)];
    for (frame, &(tokens, reserved, internal)) in frames.iter().zip(&expect) {
        assert_eq!(frame.used_blocks, 3);
        assert_eq!(frame.shares.token_slots, tokens);
        assert_eq!(frame.shares.reserved_slots, reserved);
        assert_eq!(frame.shares.internal_slots, internal);
        assert_eq!(frame.shares.external_slots, 0);
        assert_eq!(frame.shares.free_slots, 40);
        assert_eq!(frame.pool.cells.len(), 8);
        assert_eq!(frame.pool.tables.len(), 1);
        assert_eq!(frame.pool.tables[0].1[0].num_tokens, tokens);
    }
    assert!((r.token_states - 66.0 / 192.0).abs() < 1e-12);
    assert!((r.internal_fragmentation - 3.0 / 192.0).abs() < 1e-12);
    assert_eq!(r.waste_per_request_tokens, vec![1.0]);
    assert_eq!(r.block_table_len, vec![3]);
    assert_eq!(r.generated_tokens, 3);
    assert_eq!(r.prefill_tokens, 20);
    assert!((shares_sum(&r) - 1.0).abs() < 1e-12);
    assert!((r.simulated_seconds - 0.06).abs() < 1e-12);
}

#[test]
fn paged_preempts_the_most_recent_request_and_recomputes_it() {
    // 4 blocks of 4 slots; two requests of prompt 4 + output 6 (final 10 = 3 blocks each).
    let w = plain(&[(4, 6), (4, 6)]);
    let config = SimConfig {
        block_size: 4,
        num_slots: 16,
        watermark: 0.0,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 100).unwrap();
    // Steps 0-3: both run (2 blocks each). Step 4: both need a 3rd block, none is free: B (last
    // admitted) is preempted; A goes on and finishes at step 5. B (now an 8-token prompt) is
    // re-admitted at step 6 and finishes at step 7.
    assert_eq!(r.steps, 8);
    assert_eq!(r.preemptions, 1);
    assert_eq!(r.recompute_preemptions, 1);
    assert_eq!(r.recomputed_tokens, 8);
    assert_eq!(r.prefill_tokens, 4 + 4 + 8);
    assert_eq!(r.generated_tokens, 12);
    assert_eq!(r.finished_request_ids, vec![0, 1]);
    let running: Vec<usize> = frames.iter().map(|f| f.running).collect();
    assert_eq!(running, vec![2, 2, 2, 2, 1, 1, 1, 1]);
    let waiting: Vec<usize> = frames.iter().map(|f| f.waiting).collect();
    assert_eq!(waiting, vec![0, 0, 0, 0, 1, 1, 0, 0]);
    assert_eq!(frames[3].used_blocks, 4);
    assert_eq!(frames[4].used_blocks, 3);
    assert_eq!(frames[4].preemptions, 1);
    assert_eq!(frames[6].pool.tables[0].0, 1);
    assert_eq!(frames[6].pool.tables[0].1[0].num_tokens, 9);
    assert_eq!(r.peak_resident_requests, 2);
    assert!((shares_sum(&r) - 1.0).abs() < 1e-12);
}

#[test]
fn parallel_samples_share_their_prompt_blocks() {
    // 4 samples of a 1000-token prompt (the demo's copy-on-write case), blocks of 16.
    let spec = RequestSpec {
        prompt_tokens: 1000,
        output_tokens: 1,
        arrival_s: 0.0,
        group_size: 4,
        prefix: None,
    };
    let w = Workload::new(vec![spec], GroupKind::Parallel).unwrap();
    let config = SimConfig {
        block_size: 16,
        num_slots: 16 * 128,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 10).unwrap();
    assert_eq!(r.steps, 1);
    let f = &frames[0];
    // 62 full prompt blocks shared by all four; each sample holds its own copy of the partial
    // block (8 prompt tokens + its first output token): 66 blocks, not 4 * 63 = 252.
    assert_eq!(f.used_blocks, 66);
    assert_eq!(f.shares.token_slots, 62 * 16 + 4 * 9);
    assert_eq!(f.pool.shared.len(), 62);
    assert!(f.pool.shared.iter().all(|&(_, refcount)| refcount == 4));
    assert_eq!(f.pool.tables[0].1.len(), 4);
    assert_eq!(r.generated_tokens, 4);
    assert_eq!(r.prefill_tokens, 1000);
    // Contiguous reservations cannot share: four copies of the prompt.
    let oracle = SimConfig {
        allocator: AllocatorKind::ContiguousOracle,
        num_slots: 4096,
        ..config.clone()
    };
    let (_, frames) = record_frames(&w, &oracle, 10).unwrap();
    assert_eq!(frames[0].shares.token_slots, 4 * 1001);
}

#[test]
fn beam_groups_keep_width_and_invariants() {
    let specs: Vec<RequestSpec> = (0..6)
        .map(|i| RequestSpec {
            prompt_tokens: 50 + 7 * i,
            output_tokens: 40 + 3 * i,
            arrival_s: 0.0,
            group_size: 4,
            prefix: None,
        })
        .collect();
    let w = Workload::new(specs, GroupKind::Beam).unwrap();
    let config = SimConfig {
        block_size: 8,
        num_slots: 8 * 80,
        watermark: 0.0,
        check_invariants: true,
        ..Default::default()
    };
    let r = simulate(&w, &config).unwrap();
    assert_eq!(r.finished_requests, 6);
    assert_eq!(
        r.generated_tokens,
        (0..6).map(|i| 4 * (40 + 3 * i)).sum::<usize>()
    );
    assert!((shares_sum(&r) - 1.0).abs() < 1e-12);
    // Beams share more than parallel samples (common ancestry), so hold fewer blocks.
    let parallel = Workload::new(w.requests().to_vec(), GroupKind::Parallel).unwrap();
    assert_eq!(simulate(&parallel, &config).unwrap().finished_requests, 6);
    let big = SimConfig {
        num_slots: 8 * 4000,
        ..config.clone()
    };
    let (rb, rp) = (
        simulate(&w, &big).unwrap(),
        simulate(&parallel, &big).unwrap(),
    );
    assert!(
        rb.mean_used_blocks < rp.mean_used_blocks,
        "{} vs {}",
        rb.mean_used_blocks,
        rp.mean_used_blocks
    );
}

#[test]
fn first_fit_external_fragmentation_blocks_the_head_of_the_queue() {
    // Pool of 12 slots, oracle reservations placed first-fit:
    // A [0,4) and C [8,12) finish at step 0, B [4,8) runs to step 2, D needs 6 contiguous slots.
    let w = plain(&[(3, 1), (1, 3), (3, 1), (4, 2)]);
    let config = SimConfig {
        allocator: AllocatorKind::ContiguousOracle,
        block_size: 4,
        num_slots: 12,
        max_model_len: 64,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 100).unwrap();
    assert_eq!(frames[0].running, 3);
    assert_eq!(
        frames[0].shares.free_slots + frames[0].shares.external_slots,
        0
    );
    // Steps 1-2: 8 free slots in two runs of 4, none of which holds D's 6: external fragmentation.
    for f in &frames[1..3] {
        assert_eq!(f.running, 1);
        assert_eq!(f.waiting, 1);
        assert_eq!(f.shares.external_slots, 8);
        assert_eq!(f.shares.free_slots, 0);
    }
    // Step 3: B is gone, the runs merged, D placed at slot 0.
    assert_eq!(frames[3].running, 1);
    assert_eq!(frames[3].pool.tables[0].0, 3);
    assert_eq!(frames[3].pool.tables[0].1[0].blocks, vec![0, 1]);
    assert_eq!(frames[3].shares.external_slots, 0);
    assert_eq!(r.finished_request_ids, vec![0, 2, 1, 3]);
    assert_eq!(r.preemptions, 0);
    assert!((shares_sum(&r) - 1.0).abs() < 1e-12);
}

#[test]
fn buddy_rounds_reservations_up_to_powers_of_two() {
    // Final length 5 -> extent 8 -> 3 slots internal fragmentation for the whole run.
    let w = plain(&[(4, 1)]);
    let config = SimConfig {
        allocator: AllocatorKind::ContiguousOracle,
        placement: Placement::Buddy,
        block_size: 4,
        num_slots: 16,
        max_model_len: 64,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 10).unwrap();
    assert_eq!(frames[0].shares.token_slots, 5);
    assert_eq!(frames[0].shares.internal_slots, 3);
    assert_eq!(r.waste_per_request_tokens, vec![3.0]);
    assert_eq!(frames[0].pool.tables[0].1[0].blocks, vec![0, 1]);
    // pow2 reserves prompt 4 + output 1 rounded to 1 = 5 as well; max reserves 64 (no fit).
    let max = SimConfig {
        allocator: AllocatorKind::ContiguousMax,
        ..config.clone()
    };
    let err = simulate(&w, &max).unwrap_err();
    assert!(
        err.to_string()
            .contains("request 0 needs a contiguous reservation of 64 slots"),
        "{err}"
    );
}

#[test]
fn reservation_rules_order_token_states() {
    let mut rng = SplitMix64::new(5);
    let specs: Vec<RequestSpec> = (0..300)
        .map(|_| RequestSpec {
            prompt_tokens: 1 + rng.next_below(200) as usize,
            output_tokens: if rng.next_below(10) == 0 {
                300 + rng.next_below(400) as usize
            } else {
                1 + rng.next_below(60) as usize
            },
            arrival_s: 0.0,
            group_size: 1,
            prefix: None,
        })
        .collect();
    let w = Workload::new(specs, GroupKind::None).unwrap();
    let base = SimConfig {
        num_slots: 8192,
        max_model_len: 1024,
        ..Default::default()
    };
    let run = |allocator, placement| {
        simulate(
            &w,
            &SimConfig {
                allocator,
                placement,
                ..base.clone()
            },
        )
        .unwrap()
    };
    let paged = run(AllocatorKind::Paged, Placement::FirstFit);
    let oracle = run(AllocatorKind::ContiguousOracle, Placement::FirstFit);
    let pow2 = run(AllocatorKind::ContiguousPow2, Placement::FirstFit);
    let max = run(AllocatorKind::ContiguousMax, Placement::FirstFit);
    let max_buddy = run(AllocatorKind::ContiguousMax, Placement::Buddy);
    for r in [&paged, &oracle, &pow2, &max, &max_buddy] {
        assert_eq!(r.finished_requests, 300);
        assert!((shares_sum(r) - 1.0).abs() < 1e-9);
    }
    assert!(paged.token_states > oracle.token_states);
    assert!(oracle.token_states > pow2.token_states);
    assert!(pow2.token_states > max.token_states);
    assert!(paged.mean_resident_requests > 2.0 * max.mean_resident_requests);
    assert!(paged.steps < max.steps);
    assert!(max.internal_fragmentation > 0.5);
    assert!(oracle.internal_fragmentation == 0.0);
    assert!(
        oracle.external_fragmentation > 0.0,
        "first-fit leaves unusable holes"
    );
    // Paged waste per request averages about half a block.
    let mean_waste = paged.waste_per_request_tokens.iter().sum::<f64>() / 300.0;
    assert!(mean_waste > 4.0 && mean_waste < 12.0, "{mean_waste}");
}

#[test]
fn randomized_runs_keep_invariants_under_every_allocator() {
    for seed in 0..12u64 {
        let mut rng = SplitMix64::new(seed);
        let kind = [GroupKind::None, GroupKind::Parallel, GroupKind::Beam][seed as usize % 3];
        let specs: Vec<RequestSpec> = (0..40)
            .map(|i| RequestSpec {
                prompt_tokens: 1 + rng.next_below(90) as usize,
                output_tokens: 1 + rng.next_below(60) as usize,
                arrival_s: i as f64 * 0.01,
                group_size: if kind == GroupKind::None {
                    1
                } else {
                    1 + rng.next_below(4) as usize
                },
                prefix: None,
            })
            .collect();
        let w = Workload::new(specs, kind).unwrap();
        let expected_tokens: usize = w
            .requests()
            .iter()
            .map(|r| r.group_size * r.output_tokens)
            .sum();
        for allocator in [
            AllocatorKind::Paged,
            AllocatorKind::ContiguousMax,
            AllocatorKind::ContiguousPow2,
            AllocatorKind::ContiguousOracle,
        ] {
            for placement in [Placement::FirstFit, Placement::Buddy] {
                let config = SimConfig {
                    allocator,
                    placement,
                    block_size: 1 + rng.next_below(16) as usize,
                    num_slots: 1024 + rng.next_below(1024) as usize,
                    max_model_len: 256,
                    arrival: if seed % 2 == 0 {
                        Arrival::Saturated
                    } else {
                        Arrival::Trace
                    },
                    max_num_seqs: 4 + rng.next_below(40) as usize,
                    watermark: 0.0,
                    check_invariants: true,
                    seed,
                    ..Default::default()
                };
                let r = simulate(&w, &config)
                    .unwrap_or_else(|e| panic!("seed {seed} {allocator} {placement}: {e}"));
                assert_eq!(r.finished_requests, 40);
                assert_eq!(r.generated_tokens, expected_tokens);
                assert!((shares_sum(&r) - 1.0).abs() < 1e-9);
                if allocator != AllocatorKind::Paged {
                    assert_eq!(r.preemptions, 0);
                }
            }
        }
    }
}

#[test]
fn bad_input_is_rejected_with_a_clear_message() {
    let err = |w: &Workload, c: &SimConfig| match simulate(w, c) {
        Err(Error::InvalidArgument(msg)) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    let w = plain(&[(10, 10), (1500, 1000), (5, 5)]);
    let small = SimConfig {
        num_slots: 1024,
        max_model_len: 4096,
        ..Default::default()
    };
    let msg = err(&w, &small);
    assert!(msg.contains("request 1 needs 157 blocks"), "{msg}");
    assert!(msg.contains("only 64 blocks"), "{msg}");
    let msg = err(&w, &SimConfig::default());
    assert!(
        msg.contains(
            "request 1: prompt 1500 + output 1000 = 2500 tokens exceeds max_model_len 2048"
        ),
        "{msg}"
    );
    let ok = plain(&[(10, 10)]);
    assert!(err(
        &ok,
        &SimConfig {
            block_size: 0,
            ..Default::default()
        }
    )
    .contains("block_size"));
    assert!(err(
        &ok,
        &SimConfig {
            step_time_s: -1.0,
            ..Default::default()
        }
    )
    .contains("step_time_s"));
    assert!(err(
        &ok,
        &SimConfig {
            arrival: Arrival::Poisson,
            poisson_rate: 0.0,
            ..Default::default()
        }
    )
    .contains("poisson_rate"));
    assert!(err(
        &ok,
        &SimConfig {
            num_slots: 8,
            block_size: 16,
            ..Default::default()
        }
    )
    .contains("holds no block"));
    let group = Workload::new(
        vec![RequestSpec {
            prompt_tokens: 10,
            output_tokens: 1,
            arrival_s: 0.0,
            group_size: 8,
            prefix: None,
        }],
        GroupKind::Parallel,
    )
    .unwrap();
    assert!(err(
        &group,
        &SimConfig {
            max_num_seqs: 4,
            ..Default::default()
        }
    )
    .contains("exceeds max_num_seqs 4"));
}

#[test]
fn arrivals_follow_the_trace_or_a_seeded_poisson_process() {
    let specs: Vec<RequestSpec> = (0..20)
        .map(|i| RequestSpec {
            prompt_tokens: 10,
            output_tokens: 5,
            arrival_s: 100.0 + i as f64,
            group_size: 1,
            prefix: None,
        })
        .collect();
    let w = Workload::new(specs, GroupKind::None).unwrap();
    let trace = simulate(
        &w,
        &SimConfig {
            arrival: Arrival::Trace,
            ..Default::default()
        },
    )
    .unwrap();
    // One request per second, each done in 5 steps of 20 ms: the last ends at 19 s + 0.1 s.
    assert_eq!(trace.steps, 100);
    assert!(
        (trace.simulated_seconds - 19.1).abs() < 1e-9,
        "{}",
        trace.simulated_seconds
    );
    assert_eq!(trace.peak_resident_requests, 1);
    assert!(trace.latency_s.iter().all(|&l| (l - 0.1).abs() < 1e-9));
    let poisson = |seed| {
        simulate(
            &w,
            &SimConfig {
                arrival: Arrival::Poisson,
                poisson_rate: 50.0,
                seed,
                ..Default::default()
            },
        )
        .unwrap()
    };
    assert_eq!(poisson(1), poisson(1));
    assert_ne!(poisson(1).simulated_seconds, poisson(2).simulated_seconds);
    let saturated = simulate(&w, &SimConfig::default()).unwrap();
    assert_eq!(saturated.steps, 5);
    assert_eq!(saturated.peak_resident_requests, 20);
}

#[test]
fn batch_cap_limits_running_sequences() {
    let w = plain(&[(10, 4); 10]);
    let r = simulate(
        &w,
        &SimConfig {
            max_num_seqs: 3,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.peak_resident_requests, 3);
    assert_eq!(r.steps, 16); // 4 waves of at most 3, 4 steps each
}

#[test]
fn max_steps_stops_early() {
    let w = plain(&[(10, 100)]);
    let r = simulate(
        &w,
        &SimConfig {
            max_steps: Some(7),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.steps, 7);
    assert_eq!(r.finished_requests, 0);
    assert_eq!(r.generated_tokens, 7);
}

#[test]
fn swap_preemption_moves_the_victim_to_the_host_and_back() {
    // The recompute scenario above, with a host tier: B is swapped out at step 4 (2 blocks),
    // cannot come back at step 5 (needs its 2 blocks + 1 for its token, 1 free), returns at
    // step 6 and finishes at step 7 without recomputing anything.
    let w = plain(&[(4, 6), (4, 6)]);
    let config = SimConfig {
        block_size: 4,
        num_slots: 16,
        watermark: 0.0,
        preemption: Preemption::Swap,
        num_host_slots: 16,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 100).unwrap();
    assert_eq!(r.steps, 8);
    assert_eq!(
        (r.preemptions, r.swap_preemptions, r.recompute_preemptions),
        (1, 1, 0)
    );
    assert_eq!((r.swapped_out_blocks, r.swapped_in_blocks), (2, 2));
    assert_eq!(r.recomputed_tokens, 0);
    assert_eq!(r.prefill_tokens, 8);
    assert_eq!(r.generated_tokens, 12);
    let waiting: Vec<usize> = frames.iter().map(|f| f.waiting).collect();
    assert_eq!(waiting, vec![0, 0, 0, 0, 1, 1, 0, 0]);
    assert_eq!(frames[6].pool.tables[0].1[0].num_tokens, 9);
    // A host tier too small for the victim falls back to recompute.
    let tiny_host = SimConfig {
        num_host_slots: 4,
        ..config.clone()
    };
    let r = simulate(&w, &tiny_host).unwrap();
    assert_eq!((r.swap_preemptions, r.recompute_preemptions), (0, 1));
}

#[test]
fn swap_and_recompute_agree_on_the_work_done() {
    let mut rng = SplitMix64::new(9);
    let specs: Vec<RequestSpec> = (0..120)
        .map(|_| RequestSpec {
            prompt_tokens: 1 + rng.next_below(300) as usize,
            output_tokens: 1 + rng.next_below(300) as usize,
            arrival_s: 0.0,
            group_size: 1 + rng.next_below(3) as usize,
            prefix: None,
        })
        .collect();
    let w = Workload::new(specs, GroupKind::Parallel).unwrap();
    let base = SimConfig {
        num_slots: 4096,
        max_model_len: 1024,
        check_invariants: true,
        ..Default::default()
    };
    let recompute = simulate(&w, &base).unwrap();
    let swap = simulate(
        &w,
        &SimConfig {
            preemption: Preemption::Swap,
            num_host_slots: 8192,
            ..base.clone()
        },
    )
    .unwrap();
    assert!(recompute.preemptions > 0 && swap.preemptions > 0);
    assert_eq!(swap.recompute_preemptions, 0);
    assert!(swap.swapped_out_blocks > 0);
    assert_eq!(swap.swapped_out_blocks, swap.swapped_in_blocks);
    assert_eq!(swap.recomputed_tokens, 0);
    assert!(recompute.recomputed_tokens > 0);
    let expected: usize = w
        .requests()
        .iter()
        .map(|r| r.group_size * r.output_tokens)
        .sum();
    assert_eq!(
        (swap.generated_tokens, recompute.generated_tokens),
        (expected, expected)
    );
    assert_eq!(swap.finished_requests, 120);
}

#[test]
fn requests_with_a_common_prefix_share_its_cached_blocks() {
    // Blocks of 4; two 10-token prompts whose first 8 tokens are the same system prompt.
    let spec = |prefix| RequestSpec {
        prompt_tokens: 10,
        output_tokens: 2,
        arrival_s: 0.0,
        group_size: 1,
        prefix,
    };
    let w = Workload::new(
        vec![spec(Some((7, 8))), spec(Some((7, 8)))],
        GroupKind::None,
    )
    .unwrap();
    let config = SimConfig {
        block_size: 4,
        num_slots: 64,
        enable_prefix_caching: true,
        check_invariants: true,
        ..Default::default()
    };
    let (r, frames) = record_frames(&w, &config, 100).unwrap();
    // B reuses A's two full prefix blocks: 3 + 1 blocks in use, not 6.
    assert_eq!(frames[0].used_blocks, 4);
    assert_eq!(frames[0].shares.token_slots, 8 + 3 + 3);
    assert_eq!(frames[0].pool.shared.len(), 2);
    assert_eq!(r.prefix_query_tokens, 20);
    assert_eq!(r.prefix_hit_tokens, 8);
    assert_eq!(r.prefill_tokens, 12);
    // Different prefix ids share nothing; caching off shares nothing.
    let other = Workload::new(
        vec![spec(Some((7, 8))), spec(Some((8, 8)))],
        GroupKind::None,
    )
    .unwrap();
    assert_eq!(simulate(&other, &config).unwrap().prefix_hit_tokens, 0);
    let off = simulate(
        &w,
        &SimConfig {
            enable_prefix_caching: false,
            ..config.clone()
        },
    )
    .unwrap();
    assert_eq!(
        (
            off.prefix_query_tokens,
            off.prefix_hit_tokens,
            off.prefill_tokens
        ),
        (0, 0, 20)
    );
    // A later request hits blocks cached by a finished one (refcount 0, still indexed).
    let mut late = spec(Some((7, 8)));
    late.arrival_s = 5.0;
    let w = Workload::new(vec![spec(Some((7, 8))), late], GroupKind::None).unwrap();
    let r = simulate(
        &w,
        &SimConfig {
            arrival: Arrival::Trace,
            ..config.clone()
        },
    )
    .unwrap();
    assert_eq!(r.prefix_hit_tokens, 8);
}

#[test]
fn recomputed_requests_hit_their_own_cached_blocks() {
    // The recompute scenario with prefix caching: B's 8 tokens filled 2 blocks, hashed as they
    // filled and left cached when B was preempted. A's next block evicts B's tail block first
    // (tails ahead of heads), and the last prompt token is always computed, so the re-admission
    // hits B's first block: 4 tokens.
    let w = plain(&[(4, 6), (4, 6)]);
    let config = SimConfig {
        block_size: 4,
        num_slots: 16,
        watermark: 0.0,
        enable_prefix_caching: true,
        check_invariants: true,
        ..Default::default()
    };
    let r = simulate(&w, &config).unwrap();
    assert_eq!(r.preemptions, 1);
    assert_eq!(r.prefix_hit_tokens, 4);
    assert_eq!(r.prefill_tokens, 4 + 4 + 8 - 4);
}

#[test]
fn prefix_caching_with_groups_and_pressure_keeps_invariants() {
    let mut rng = SplitMix64::new(21);
    for kind in [GroupKind::None, GroupKind::Parallel, GroupKind::Beam] {
        let specs: Vec<RequestSpec> = (0..60)
            .map(|_| {
                let prefix_len = 16 * rng.next_below(5) as usize;
                RequestSpec {
                    prompt_tokens: prefix_len + 1 + rng.next_below(60) as usize,
                    output_tokens: 1 + rng.next_below(80) as usize,
                    arrival_s: 0.0,
                    group_size: if kind == GroupKind::None {
                        1
                    } else {
                        1 + rng.next_below(3) as usize
                    },
                    prefix: (prefix_len > 0).then(|| (rng.next_below(3), prefix_len)),
                }
            })
            .collect();
        let w = Workload::new(specs, kind).unwrap();
        for preemption in [Preemption::Recompute, Preemption::Swap] {
            let config = SimConfig {
                block_size: 8,
                num_slots: 1024,
                max_model_len: 512,
                enable_prefix_caching: true,
                preemption,
                num_host_slots: 512,
                check_invariants: true,
                ..Default::default()
            };
            let r = simulate(&w, &config).unwrap_or_else(|e| panic!("{kind} {preemption}: {e}"));
            assert_eq!(r.finished_requests, 60);
            assert!(r.prefix_hit_tokens > 0);
            assert!((shares_sum(&r) - 1.0).abs() < 1e-9);
        }
    }
}

#[test]
fn huge_values_are_rejected_not_overflowed() {
    let w = plain(&[(10, 10)]);
    let huge = SimConfig {
        num_slots: usize::MAX,
        ..Default::default()
    };
    assert!(
        matches!(simulate(&w, &huge), Err(Error::InvalidArgument(m)) if m.contains("num_slots"))
    );
    let wide = SimConfig {
        allocator: AllocatorKind::ContiguousOracle,
        block_size: 1,
        num_slots: 1 << 30,
        ..Default::default()
    };
    assert!(simulate(&w, &wide).is_ok());
    assert!(
        matches!(record_frames(&w, &wide, 5), Err(Error::InvalidArgument(m)) if m.contains("cells"))
    );
    let big_len = SimConfig {
        max_model_len: usize::MAX,
        allocator: AllocatorKind::ContiguousMax,
        ..Default::default()
    };
    assert!(
        matches!(simulate(&w, &big_len), Err(Error::InvalidArgument(m)) if m.contains("request 0"))
    );
    let empty = Workload::new(Vec::new(), GroupKind::None).unwrap();
    let r = simulate(&empty, &SimConfig::default()).unwrap();
    assert_eq!((r.steps, r.finished_requests, r.free), (0, 0, 1.0));
}
