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
//!
//! `schedule_<chooser>_<prompts>[_<waiting>]` (chooser `fcfs`, `lpm`, `dfs`, `rematch`, or one
//! of the floors `floor`, `feed`, `match`;
//! prompts `shared` or `unique`; 1,000 waiting unless given) runs the cache-aware queue's steady
//! state; `callgrind_annotate --inclusive=yes` on its output splits each step into the `policy_*`
//! and `allocator_*` parts (docs/scheduling.md, Cost):
//!
//! ```text
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*scenario_*' \
//!     --callgrind-out-file=out.cg target/release/deps/instructions-<hash> schedule_lpm_shared 2000
//! callgrind_annotate --inclusive=yes out.cg | grep -E 'policy_|allocator_'
//! ```

use std::time::Instant;

use pagedkv_sim::{simulate, AllocatorKind, Scheduling, SimConfig, Workload};

mod common;
mod schedule_common;
use common::synthetic_workload;
use schedule_common::{Chooser, Prompts, Steady};

/// The simulator on a seeded 2,000-request workload (paged allocator). Units: generated tokens.
#[inline(never)]
fn scenario_sim_replay(workload: &Workload, config: &SimConfig, iters: u64) -> u64 {
    let mut tokens = 0;
    for _ in 0..iters {
        tokens += simulate(workload, config).unwrap().generated_tokens as u64;
    }
    tokens
}

/// Steps of the cache-aware queue's steady state. Units: scheduled requests.
#[inline(never)]
fn scenario_schedule(steady: &mut Steady, iters: u64) -> u64 {
    for _ in 0..iters {
        steady.step();
    }
    iters
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
        name if name.starts_with("schedule_") => {
            let mut parts = name.split('_').skip(1);
            let chooser = match parts.next() {
                Some("fcfs") => Chooser::Fcfs,
                Some("rematch") => Chooser::Rematch,
                Some("floor") => Chooser::Floor,
                Some("feed") => Chooser::Feed,
                Some("match") => Chooser::Match,
                Some(p) => Chooser::Queue(
                    p.parse::<Scheduling>()
                        .expect("fcfs, lpm, dfs, rematch, floor, feed or match"),
                ),
                None => panic!("schedule_<chooser>_<prompts>[_<waiting>]"),
            };
            let kind = match parts.next() {
                Some("unique") => Prompts::Unique,
                _ => Prompts::Shared,
            };
            let waiting = parts
                .next()
                .map_or(1000, |w| w.parse().expect("waiting count"));
            let mut steady = Steady::new(chooser, waiting, kind);
            scenario_schedule(&mut steady, iters)
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
