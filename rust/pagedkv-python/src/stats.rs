//! `stats()` as a Python dict: one key per field of the core `Stats` snapshot, under the field's
//! name, plus the three aliases the contract fixes.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Converts a stats snapshot into a dict keyed by the core field names (docs/design.md, Python
/// API). `allocations`, `frees` and `evictions`, the keys DESIGN names, are kept as aliases of
/// `blocks_allocated`, `blocks_freed` and `blocks_evicted`.
pub fn stats_to_dict<'py>(py: Python<'py>, stats: &pagedkv::Stats) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    // Destructured exhaustively (no `..`): a field the core adds fails this build until it is
    // exported here.
    let pagedkv::Stats {
        num_blocks,
        block_size,
        num_blocks_in_use,
        num_cached_blocks,
        num_free_list_blocks,
        num_available_blocks,
        num_sequences,
        blocks_allocated,
        blocks_freed,
        cow_copies,
        forks,
        prefix_query_tokens,
        prefix_hit_tokens,
        prefix_hit_rate,
        blocks_evicted,
        num_pinned_blocks,
        events_dropped,
        event_queue_bytes,
        copy_ops_elided,
        num_host_blocks,
        num_host_blocks_in_use,
        num_swapped_sequences,
        blocks_swapped_out,
        blocks_swapped_in,
        num_offload_blocks,
        num_offloaded_blocks,
        blocks_offloaded,
        blocks_loaded,
        offload_blocks_dropped,
        num_reserved_blocks,
        offload_ops_elided,
    } = stats;
    dict.set_item("num_blocks", num_blocks)?;
    dict.set_item("block_size", block_size)?;
    dict.set_item("num_blocks_in_use", num_blocks_in_use)?;
    dict.set_item("num_cached_blocks", num_cached_blocks)?;
    dict.set_item("num_free_list_blocks", num_free_list_blocks)?;
    dict.set_item("num_available_blocks", num_available_blocks)?;
    dict.set_item("num_sequences", num_sequences)?;
    dict.set_item("blocks_allocated", blocks_allocated)?;
    dict.set_item("blocks_freed", blocks_freed)?;
    dict.set_item("cow_copies", cow_copies)?;
    dict.set_item("forks", forks)?;
    dict.set_item("prefix_query_tokens", prefix_query_tokens)?;
    dict.set_item("prefix_hit_tokens", prefix_hit_tokens)?;
    dict.set_item("prefix_hit_rate", prefix_hit_rate)?;
    dict.set_item("blocks_evicted", blocks_evicted)?;
    dict.set_item("num_pinned_blocks", num_pinned_blocks)?;
    dict.set_item("events_dropped", events_dropped)?;
    dict.set_item("event_queue_bytes", event_queue_bytes)?;
    dict.set_item("copy_ops_elided", copy_ops_elided)?;
    dict.set_item("num_host_blocks", num_host_blocks)?;
    dict.set_item("num_host_blocks_in_use", num_host_blocks_in_use)?;
    dict.set_item("num_swapped_sequences", num_swapped_sequences)?;
    dict.set_item("blocks_swapped_out", blocks_swapped_out)?;
    dict.set_item("blocks_swapped_in", blocks_swapped_in)?;
    dict.set_item("num_offload_blocks", num_offload_blocks)?;
    dict.set_item("num_offloaded_blocks", num_offloaded_blocks)?;
    dict.set_item("blocks_offloaded", blocks_offloaded)?;
    dict.set_item("blocks_loaded", blocks_loaded)?;
    dict.set_item("offload_blocks_dropped", offload_blocks_dropped)?;
    dict.set_item("num_reserved_blocks", num_reserved_blocks)?;
    dict.set_item("offload_ops_elided", offload_ops_elided)?;
    // The contract's (docs/design.md) names for three of the counters.
    dict.set_item("allocations", blocks_allocated)?;
    dict.set_item("frees", blocks_freed)?;
    dict.set_item("evictions", blocks_evicted)?;
    Ok(dict)
}
