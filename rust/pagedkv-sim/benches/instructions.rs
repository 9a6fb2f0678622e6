//! Fixed-work simulator scenario for instruction counting, load-independent (unlike wall time
//! on a shared machine); the allocator's scenarios are in `pagedkv`'s `instructions` bench.
//!
//! ```text
//! cargo bench -p pagedkv-sim --bench instructions --no-run
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*scenario_*' \
//!     --callgrind-out-file=/dev/null target/release/deps/instructions-<hash> sim_replay 1
//! ```
//!
//! `Collected` (Ir) divided by the printed unit count is instructions per unit.

use std::time::Instant;

use pagedkv_sim::{simulate, AllocatorKind, SimConfig, Workload};

mod common;
use common::synthetic_workload;

/// The simulator on a seeded 2,000-request workload (paged allocator). Units: generated tokens.
#[inline(never)]
fn scenario_sim_replay(workload: &Workload, config: &SimConfig, iters: u64) -> u64 {
    let mut tokens = 0;
    for _ in 0..iters {
        tokens += simulate(workload, config).unwrap().generated_tokens as u64;
    }
    tokens
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let scenario = args.first().map_or("sim_replay", String::as_str);
    let iters: u64 = args
        .get(1)
        .map_or(1, |n| n.parse().expect("iteration count"));
    let start = Instant::now();
    let units = match scenario {
        "sim_replay" => {
            let workload = synthetic_workload(2000);
            let config = SimConfig {
                allocator: AllocatorKind::Paged,
                num_slots: 40_000,
                max_model_len: 2400,
                ..Default::default()
            };
            scenario_sim_replay(&workload, &config, iters)
        }
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
