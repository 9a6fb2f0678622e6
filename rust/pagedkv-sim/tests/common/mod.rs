//! Workload builders shared by the simulator's integration tests.

use pagedkv_sim::{GroupKind, Workload};

/// Requests of 300 prompt tokens (a shared system prompt of 256, then 44 of their own) and 8
/// output tokens, all arriving at time 0; request `i` starts with system prompt
/// `prefix_ids[i]`.
pub fn system_prompts(prefix_ids: &[i64]) -> Workload {
    let n = prefix_ids.len();
    Workload::from_arrays(
        &vec![300; n],
        &vec![8; n],
        &vec![0.0; n],
        None,
        GroupKind::None,
        Some(prefix_ids),
        Some(&vec![256; n]),
    )
    .expect("a valid system-prompt workload")
}
