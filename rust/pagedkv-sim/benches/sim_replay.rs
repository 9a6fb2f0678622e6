//! Simulator speed: replays the Azure conversation trace (19,366 requests) under each allocator,
//! reporting simulated (generated) tokens per second of wall time. The paged run drives the real
//! KvCacheManager; the contiguous-oracle run (placement only, no manager) is the baseline
//! measured in the same run. Without the trace folder (PAGEDKV_TRACES or ../shared/traces
//! relative to the repository root) a seeded synthetic workload of the same size is used.

use std::path::PathBuf;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv_sim::{simulate, AllocatorKind, GroupKind, RequestSpec, SimConfig, Workload};

mod common;
use common::synthetic_workload;

fn traces_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("PAGEDKV_TRACES").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces")),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.join("azure_llm_2023_conv.csv").is_file())
}

/// Minimal reader of the Azure format `TIMESTAMP,ContextTokens,GeneratedTokens` (the
/// timestamps' seconds-of-day are enough for one-hour traces).
fn read_azure(path: &PathBuf) -> Workload {
    let text = std::fs::read_to_string(path).expect("trace readable");
    let mut specs = Vec::new();
    let mut origin = None;
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let mut cols = line.split(',');
        let stamp = cols.next().expect("timestamp");
        let time = stamp.split(' ').nth(1).expect("time of day");
        let mut hms = time.split(':').map(|x| x.parse::<f64>().expect("number"));
        let secs = hms.next().unwrap() * 3600.0 + hms.next().unwrap() * 60.0 + hms.next().unwrap();
        let origin = *origin.get_or_insert(secs);
        let prompt: usize = cols.next().expect("context").trim().parse().expect("int");
        let output: usize = cols.next().expect("generated").trim().parse().expect("int");
        specs.push(RequestSpec {
            prompt_tokens: prompt.max(1),
            output_tokens: output.max(1),
            arrival_s: (secs - origin).max(specs.last().map_or(0.0, |r: &RequestSpec| r.arrival_s)),
            group_size: 1,
            prefix: None,
        });
    }
    Workload::new(specs, GroupKind::None).expect("valid trace")
}

fn bench(c: &mut Criterion) {
    let (name, workload) = match traces_dir() {
        Some(dir) => (
            "azure_conv",
            read_azure(&dir.join("azure_llm_2023_conv.csv")),
        ),
        None => ("synthetic_19366", synthetic_workload(19_366)),
    };
    let max_len = workload
        .requests()
        .iter()
        .map(|r| r.final_len())
        .max()
        .unwrap_or(1);
    let mut group = c.benchmark_group(format!("sim_replay/{name}"));
    group.sample_size(10);
    let mut tokens_per_s = Vec::new();
    for allocator in [AllocatorKind::Paged, AllocatorKind::ContiguousOracle] {
        // The paper's pool (about 15.7K slots) cannot hold the trace's longest request (14,089
        // tokens) next to anything else; use a 40K-slot pool so batching happens.
        let config = SimConfig {
            allocator,
            num_slots: 40_000,
            max_model_len: max_len,
            ..Default::default()
        };
        let probe = simulate(&workload, &config).unwrap();
        group.throughput(Throughput::Elements(probe.generated_tokens as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(allocator),
            &config,
            |b, config| b.iter(|| simulate(&workload, config).unwrap()),
        );
        let start = Instant::now();
        let r = simulate(&workload, &config).unwrap();
        let secs = start.elapsed().as_secs_f64();
        tokens_per_s.push((allocator, r.generated_tokens as f64 / secs, r.steps, secs));
    }
    group.finish();
    let baseline = tokens_per_s[1].1;
    for (allocator, tps, steps, secs) in tokens_per_s {
        println!(
            "{name} {allocator}: {steps} steps in {secs:.3} s, {:.2} M simulated tokens/s ({:.2}x contiguous-oracle)",
            tps / 1e6,
            tps / baseline
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
