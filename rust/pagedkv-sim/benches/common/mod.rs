//! Code shared by the bench targets (each includes it with `mod common;`).

use pagedkv_sim::{GroupKind, RequestSpec, SplitMix64, Workload};

/// A seeded synthetic workload with the Azure conversation trace's shape: prompts of 1-2,000
/// tokens, outputs of 1-400 tokens, one arrival every 0.18 s, no sharing.
pub fn synthetic_workload(num_requests: usize) -> Workload {
    let mut rng = SplitMix64::new(1);
    let specs = (0..num_requests)
        .map(|i| RequestSpec {
            prompt_tokens: 1 + rng.next_below(2000) as usize,
            output_tokens: 1 + rng.next_below(400) as usize,
            arrival_s: i as f64 * 0.18,
            group_size: 1,
            prefix: None,
        })
        .collect();
    Workload::new(specs, GroupKind::None).unwrap()
}
