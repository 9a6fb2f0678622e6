//! Wall time of one scheduled request with 1,000 requests waiting: the cache-aware queue (hash
//! the arrival's prompt, push, choose, admit, free, apply the KV events) against first come,
//! first served with KV events off and against asking the allocator for every waiting request's
//! cached prefix at every admission (`rematch`), measured in the same run; the ratios are the
//! scheduler's whole overhead on the allocator's admission path and what the index saves, and the floors (`floor`, `feed`, `match`: the operations an exact
//! index cannot avoid, schedule_common's `Chooser`). The instruction counts of each part are in the
//! `instructions` bench (`schedule_*` scenarios) and docs/scheduling.md, Cost.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pagedkv_sim::Scheduling;

mod schedule_common;
use schedule_common::{Chooser, Prompts, Steady};

fn overhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_step_1000_waiting");
    group.sample_size(20);
    for (label, kind) in [("shared", Prompts::Shared), ("unique", Prompts::Unique)] {
        for chooser in [
            Chooser::Fcfs,
            Chooser::Queue(Scheduling::Lpm),
            Chooser::Queue(Scheduling::Dfs),
            Chooser::Rematch,
            Chooser::Floor,
            Chooser::Feed,
            Chooser::Match,
        ] {
            let name = match chooser {
                Chooser::Queue(p) => p.to_string(),
                Chooser::Rematch => "rematch".to_string(),
                Chooser::Fcfs => "fcfs".to_string(),
                Chooser::Floor => "floor".to_string(),
                Chooser::Feed => "feed".to_string(),
                Chooser::Match => "match".to_string(),
            };
            let mut steady = Steady::new(chooser, 1000, kind);
            group.bench_function(BenchmarkId::new(name, label), |b| b.iter(|| steady.step()));
        }
    }
    group.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);
