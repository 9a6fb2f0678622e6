//! A state group's admission with a connector's external computed tokens (vLLM's
//! `MambaManager` in `"align"` mode under `allocate_slots(..., num_external_computed_tokens=e)`,
//! docs/design.md, KV groups, "State groups"). vLLM's admission treats the hit plus the `e`
//! tokens as computed: the state group's positions below `(hit + e - 1) / block_size` are
//! skipped (every hit position among them, the hit's state block included, is never taken),
//! `allocate_external_computed_blocks` gives one block at the position of the last external
//! token (the state the connector restores there), and `allocate_new_blocks` one more at the
//! chunk's last position when that lies in a later block, nulls between. Its free-block count
//! for the group is not that allocation: `get_num_blocks_to_allocate` counts one new block
//! (its align-mode cap) plus the hit's state block when cached-evictable, although the
//! admission takes two blocks or one and never the hit block. pagedkv counts as vLLM counts
//! (its refusals are vLLM's) and allocates as vLLM allocates; where vLLM's count passes and
//! the pool is short of the allocation (vLLM's `get_new_blocks` raises there), the
//! reservation refuses (`OutOfBlocks`, nothing changed).

use super::group_spec::KvGroupSpec;
use super::hits::Place;
use crate::BlockId;

/// The first fresh position and the end of the external positions of a state group admitted
/// with external tokens, whose hit plus those tokens end at `released_at` tokens (> 0): the
/// one block at the last external token's position.
#[inline]
pub(super) fn external_span(released_at: usize, block_size: usize) -> (usize, usize) {
    let p = released_at.div_ceil(block_size) - 1;
    (p, p + 1)
}

/// Fresh blocks a group takes at admission: from `first` to `external_end` (capped at
/// `num_positions`), then the rest as the group grows a table (`fresh_positions`: every
/// position, or a state group's last one only).
#[inline]
pub(super) fn group_fresh(
    spec: &KvGroupSpec,
    first: usize,
    external_end: usize,
    num_positions: usize,
) -> usize {
    let ext_end = external_end.min(num_positions).max(first);
    (ext_end - first) + spec.fresh_positions(ext_end, num_positions).len()
}

/// vLLM's count for a state group admitted with external tokens, in place of its allocation:
/// one new block, plus the hit's state block (`hit_state`: its place at the hit's last
/// position, before the release) when it is cached-evictable.
#[inline]
pub(super) fn counted_blocks(
    hit_state: Option<Place>,
    is_cached: impl Fn(BlockId) -> bool,
) -> usize {
    1 + usize::from(matches!(hit_state, Some(Place::Device(b)) if is_cached(b)))
}
