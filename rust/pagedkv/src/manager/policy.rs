//! The per-kind policy layer of the manager (docs/design.md, KV groups): what differs between
//! a full-attention group and a sliding-window group, as a small method set on
//! [`KvGroupSpec`], and the coordinator's fixed point over the groups' hit finders
//! ([`hybrid_hit`], vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`). Nothing else in
//! the manager branches on a group's kind.

use super::config::PrefillCheckpoint;
use super::group_spec::{KvGroupSpec, NULL_BLOCK};
use crate::error::{invalid, Result};
use crate::BlockId;

impl KvGroupSpec {
    /// Leading blocks of a sequence with `processed` processed tokens that no later query of
    /// the group reads: every token of them lies before `processed - window + 1`, the first
    /// position the next query reads (vLLM's `get_num_skipped_tokens` / `remove_skipped_blocks`).
    /// 0 for full attention.
    #[inline]
    pub(crate) fn skipped_blocks(&self, processed: usize, block_size: usize) -> usize {
        match *self {
            KvGroupSpec::FullAttention => 0,
            // window >= 1 (validated), so window - 1 cannot underflow.
            KvGroupSpec::SlidingWindow { window } => {
                processed.saturating_sub(window - 1) / block_size
            }
            // Only the state after the last processed token is read next: a window of 2
            // tokens' rule (vLLM's `get_num_skipped_tokens` is `num_computed - 1`).
            KvGroupSpec::MambaState => processed.saturating_sub(1) / block_size,
        }
    }

    /// The positions of an allocation's new positions `first..end` that take a fresh block:
    /// all of them, but for a state group only the last (the chunk's last token's; vLLM's
    /// align-mode `allocate_new_blocks` pads the others with the null block).
    #[inline]
    pub(crate) fn fresh_positions(&self, first: usize, end: usize) -> std::ops::Range<usize> {
        match *self {
            KvGroupSpec::MambaState if end > first => end - 1..end,
            _ => first..end.max(first),
        }
    }

    /// Whether a prefill check-point at table position `p` takes a block when the group's
    /// table grows from `first` to `end` positions: a state group's, at a new position below
    /// the chunk's last.
    #[inline]
    pub(crate) fn takes_checkpoint(&self, p: usize, first: usize, end: usize) -> bool {
        self.is_state() && first <= p && p + 1 < end
    }

    /// The most fresh blocks one allocation gives the group: `Some(1)` for a state group
    /// (vLLM's align-mode `get_num_blocks_to_allocate` caps its count at one block), `None`
    /// for the others.
    #[inline]
    pub(crate) fn fresh_cap(&self) -> Option<usize> {
        match *self {
            KvGroupSpec::MambaState => Some(1),
            _ => None,
        }
    }

    /// Whether the group's full blocks enter the prefix index: not for a window of one token,
    /// whose hit needs no cached block (`contiguous_blocks_for_hit` is 0). vLLM's
    /// `SlidingWindowManager.reachable_block_mask` keeps only the blocks that end a hit's
    /// window, none when that is 0, so such a group caches nothing (and records no events).
    #[inline]
    pub(crate) fn caches_blocks(&self, block_size: usize) -> bool {
        match *self {
            KvGroupSpec::FullAttention => true,
            KvGroupSpec::SlidingWindow { window } => {
                contiguous_blocks_for_hit(window, block_size) > 0
            }
            KvGroupSpec::MambaState => true,
        }
    }

    /// The most blocks one request of the group holds at once when allocated chunk by chunk,
    /// its admission cap (vLLM's `SlidingWindowSpec.max_admission_blocks_per_request`): the
    /// last `window - 1` processed tokens plus what may be in flight, and one block more since
    /// the window need not start at a block boundary. `None` (no cap) for full attention,
    /// which holds every block until the request ends.
    #[inline]
    pub(crate) fn admission_cap_blocks(
        &self,
        block_size: usize,
        max_in_flight_tokens: usize,
        max_model_len: usize,
    ) -> Option<usize> {
        match *self {
            KvGroupSpec::FullAttention | KvGroupSpec::MambaState => None,
            KvGroupSpec::SlidingWindow { window } => {
                let tokens = (window - 1)
                    .saturating_add(max_in_flight_tokens)
                    .min(max_model_len);
                Some(tokens.div_ceil(block_size).saturating_add(1))
            }
        }
    }

    /// The group's own hit finder: the longest hit, in blocks, `<= max_blocks`, the group can
    /// serve when `cached(i)` says whether its block `i` is cached. Full attention: the leading
    /// run of cached blocks. A window: see [`window_hit`]; a state group: [`state_hit`].
    #[inline]
    pub(crate) fn longest_hit(
        &self,
        max_blocks: usize,
        block_size: usize,
        mut cached: impl FnMut(usize) -> bool,
    ) -> usize {
        match *self {
            KvGroupSpec::FullAttention => {
                (0..max_blocks).find(|&i| !cached(i)).unwrap_or(max_blocks)
            }
            KvGroupSpec::SlidingWindow { window } => window_hit(
                max_blocks,
                contiguous_blocks_for_hit(window, block_size),
                cached,
            ),
            KvGroupSpec::MambaState => state_hit(max_blocks, cached),
        }
    }
}

/// Extends group table `table` (of kind `spec`) to `end` positions for one allocation: the
/// positions [`KvGroupSpec::fresh_positions`] names take blocks from `supply`, the others the
/// null entry. Nothing when the table reaches `end` already.
pub(crate) fn grow_table(
    spec: &KvGroupSpec,
    table: &mut Vec<BlockId>,
    end: usize,
    checkpoint: Option<usize>,
    supply: &mut impl Iterator<Item = BlockId>,
) {
    if let Some(p) = checkpoint.filter(|&p| spec.takes_checkpoint(p, table.len(), end)) {
        table.resize(p, NULL_BLOCK);
        table.extend(supply.take(1));
    }
    let fresh = spec.fresh_positions(table.len(), end);
    table.resize(fresh.start, NULL_BLOCK);
    table.extend(supply.take(fresh.len()));
}

/// Check-point blocks over every group of `specs` when their tables grow from `first` to
/// `end` positions with a prefill check-point at position `checkpoint` (one per state group).
pub(crate) fn checkpoint_blocks(
    specs: &[KvGroupSpec],
    checkpoint: Option<usize>,
    first: usize,
    end: usize,
) -> usize {
    checkpoint.map_or(0, |p| {
        specs
            .iter()
            .filter(|s| s.takes_checkpoint(p, first, end))
            .count()
    })
}

/// The table position of the prefill check-point of the chunk `[start, end)` (tokens), or
/// None (vLLM's `get_mamba_prefill_checkpoint_position` and `is_mamba_prefill_checkpoint_valid`
/// with the hash block size equal to the block size, no EAGLE drop, no lookahead hashes): the
/// chunk reaches the prefill's end and starts on a block boundary, and the last boundary below
/// its end, `cp`, is at least a block past its start and an `alignment` multiple from it; the
/// position is the block ending at `cp` (vLLM's column `cdiv(end, block_size) - 2`).
pub(crate) fn prefill_checkpoint(
    c: &PrefillCheckpoint,
    block_size: usize,
    start: usize,
    end: usize,
) -> Option<usize> {
    if end == 0 || end < c.prefill_end || start % block_size != 0 {
        return None;
    }
    let cp = (end - 1) / block_size * block_size;
    if start + block_size > cp || (cp - start) % c.alignment != 0 {
        return None;
    }
    Some(cp / block_size - 1)
}

/// InvalidArgument unless `c` is usable: an alignment of at least one token.
pub(crate) fn validate_checkpoint(c: Option<&PrefillCheckpoint>) -> Result<()> {
    match c {
        Some(c) if c.alignment == 0 => invalid("a prefill check-point alignment of 0 tokens"),
        _ => Ok(()),
    }
}

/// Fresh blocks over every group of `specs` when their tables grow from `first` to `end`
/// positions in one allocation.
pub(crate) fn fresh_for_positions(specs: &[KvGroupSpec], first: usize, end: usize) -> usize {
    specs
        .iter()
        .map(|s| s.fresh_positions(first, end).len())
        .fold(0usize, usize::saturating_add)
}

/// The least a sequence of `positions` table positions must be able to hold for a manager with
/// groups `specs`, whatever its groups release: its positions when a state group is among
/// them (its table is that long, null but for its state blocks, so a prompt the pool could
/// never hold block for block is refused as a full-attention group's is), else 0.
pub(crate) fn state_table_bound(specs: &[KvGroupSpec], positions: usize) -> usize {
    if specs.iter().any(KvGroupSpec::is_state) {
        positions
    } else {
        0
    }
}

/// Blocks a window group needs cached right before a hit point: those covering the last
/// `window - 1` tokens (the query at the hit point sees itself and those), `cdiv(window - 1,
/// block_size)`.
#[inline]
pub(crate) fn contiguous_blocks_for_hit(window: usize, block_size: usize) -> usize {
    (window - 1).div_ceil(block_size)
}

/// The longest hit, in blocks, `<= max_blocks`, that a window group can serve when
/// `cached(i)` says whether its block `i` is cached: the end of the rightmost run of
/// `contiguous` cached blocks, or a shorter run that starts at block 0. Scans right to left
/// and stops at the first qualifying run, as vLLM does.
///
/// A hit is only ever found at a cached block, as in vLLM's scan: with `contiguous` 0 (a
/// window of one token) it is the end of the rightmost cached block, and since such a group
/// caches none ([`KvGroupSpec::caches_blocks`]) its hit, and so the hybrid hit, is 0, as
/// vLLM's is.
pub(crate) fn window_hit(
    max_blocks: usize,
    contiguous: usize,
    mut cached: impl FnMut(usize) -> bool,
) -> usize {
    let mut run = 0;
    for i in (0..max_blocks).rev() {
        if cached(i) {
            run += 1;
            if run >= contiguous {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// The hit finder of a state group (vLLM's `MambaManager.find_longest_cache_hit` in its
/// `"align"` mode, block size equal to the hash block size): the end, in blocks, of the
/// rightmost cached block below `max_blocks`, searched from the right and stopping at the
/// first, 0 when none is cached. One block only, not a run: a state block holds everything
/// before its boundary, so it is a hit even when the blocks before it are not cached. This is
/// [`window_hit`] with no contiguous blocks needed (a window of one token's scan).
#[inline]
pub(crate) fn state_hit(max_blocks: usize, cached: impl FnMut(usize) -> bool) -> usize {
    window_hit(max_blocks, 0, cached)
}

/// The longest hit, in blocks, every group can serve: each group's finder
/// ([`KvGroupSpec::longest_hit`]) may only shorten the candidate, and the groups are asked
/// again until none shortens it (a fixed point; each pass only shrinks it, so this ends, and
/// since each finder maps a length to the greatest length `<=` it that the group serves, the
/// fixed point is the greatest length every group serves, whatever the order). Full-attention
/// groups go first: their leading run bounds the rest cheaply. `cached(group, i)` says whether
/// the group's block `i` is cached.
pub(crate) fn hybrid_hit(
    specs: &[KvGroupSpec],
    max_blocks: usize,
    block_size: usize,
    mut cached: impl FnMut(usize, usize) -> bool,
) -> usize {
    let mut hit = max_blocks;
    for (g, spec) in specs.iter().enumerate() {
        if *spec == KvGroupSpec::FullAttention {
            hit = spec.longest_hit(hit, block_size, |i| cached(g, i));
        }
    }
    loop {
        let before = hit;
        for (g, spec) in specs.iter().enumerate() {
            if *spec != KvGroupSpec::FullAttention {
                hit = spec.longest_hit(hit, block_size, |i| cached(g, i));
            }
        }
        if hit == before {
            return hit;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's `test_sliding_window_remove_skipped_blocks` (block size 2, window 4): blocks
    /// nulled after 0, 4, 5, 6, 7 and 11 computed tokens.
    #[test]
    fn skipped_blocks_match_vllm() {
        let w = KvGroupSpec::SlidingWindow { window: 4 };
        let got: Vec<usize> = [0, 4, 5, 6, 7, 11]
            .iter()
            .map(|&n| w.skipped_blocks(n, 2))
            .collect();
        assert_eq!(got, vec![0, 0, 1, 1, 2, 4]);
        assert_eq!(KvGroupSpec::FullAttention.skipped_blocks(1000, 2), 0);
        assert_eq!(
            KvGroupSpec::SlidingWindow { window: 1 }.skipped_blocks(4, 2),
            2
        );
        assert_eq!(
            KvGroupSpec::SlidingWindow { window: usize::MAX }.skipped_blocks(1 << 40, 2),
            0
        );
    }

    /// vLLM's `test_sliding_window_possible_cached_prefix` (block size 2, window 4: two
    /// contiguous blocks needed).
    #[test]
    fn window_hit_matches_vllm_cases() {
        let (t, f) = (true, false);
        let cases: &[(&[bool], usize)] = &[
            (&[f], 0),
            (&[t], 1),
            (&[t, f], 1),
            (&[t, t], 2),
            (&[t, t, f], 2),
            (&[t, t, t], 3),
            (&[t, t, t, f], 3),
            (&[t, t, f, t, f, f, t, t, f, t, t, t], 12),
            (&[t, t, f, t, f, f, t, t, f, f, f], 8),
            (&[t, t, f, t, f, f, t, t, f, t, f], 8),
        ];
        let need = contiguous_blocks_for_hit(4, 2);
        assert_eq!(need, 2);
        for &(cached, want) in cases {
            assert_eq!(
                window_hit(cached.len(), need, |i| cached[i]),
                want,
                "{cached:?}"
            );
        }
    }

    /// A window of one token (`need` 0): vLLM's scan still finds a hit only at a cached
    /// block, so the group serves the end of its rightmost cached block, and its blocks are
    /// never cached, so it serves 0 and bounds the hybrid hit to 0.
    #[test]
    fn one_token_window_hits_only_at_a_cached_block() {
        let w1 = KvGroupSpec::SlidingWindow { window: 1 };
        assert_eq!(contiguous_blocks_for_hit(1, 4), 0);
        assert!(!w1.caches_blocks(4));
        assert!(KvGroupSpec::SlidingWindow { window: 2 }.caches_blocks(4));
        assert!(KvGroupSpec::FullAttention.caches_blocks(4));
        assert_eq!(window_hit(5, 0, |_| false), 0);
        assert_eq!(window_hit(5, 0, |i| i == 2), 3);
        assert_eq!(window_hit(5, 0, |_| true), 5);
        // Only windows of one token, nothing cached: no hit (pagedkv served 5 before).
        assert_eq!(hybrid_hit(&[w1, w1], 5, 4, |_, _| false), 0);
        // A full group with every block cached and a window of one token: no hit.
        let specs = [KvGroupSpec::FullAttention, w1];
        assert_eq!(hybrid_hit(&specs, 5, 4, |g, _| g == 0), 0);
    }

    /// vLLM's `test_prefill_hybrid_model`: one full group and two window groups of two blocks
    /// (block size 16, window 32), a 3-block hit, then blocks taken out of the cache.
    #[test]
    fn hybrid_hit_matches_vllm_prefill_hybrid_model() {
        let specs = [
            KvGroupSpec::FullAttention,
            KvGroupSpec::SlidingWindow { window: 32 },
            KvGroupSpec::SlidingWindow { window: 32 },
        ];
        let hit = |missing: &[(usize, usize)]| {
            hybrid_hit(&specs, 3, 16, |g, i| !missing.contains(&(g, i)))
        };
        assert_eq!(hit(&[]), 3);
        assert_eq!(hit(&[(1, 0)]), 3, "window block 0 is not needed");
        assert_eq!(hit(&[(0, 0)]), 0, "full block 0 is");
        for g in 0..3 {
            assert_eq!(hit(&[(g, 2)]), 2, "any group's last block");
        }
        assert_eq!(hit(&[(0, 2), (1, 0)]), 0);
    }

    /// vLLM's `MambaManager.find_longest_cache_hit` (align mode): the rightmost cached block
    /// below the bound, even with nothing cached before it; a cached block at or past the
    /// bound is not a hit.
    #[test]
    fn state_hit_is_the_rightmost_cached_block() {
        let (t, f) = (true, false);
        let cases: &[(&[bool], usize, usize)] = &[
            (&[], 0, 0),
            (&[f, f, f], 3, 0),
            (&[t, f, f], 3, 1),
            (&[t, f, f, t], 4, 4),
            (&[t, f, f, t], 3, 1),
            (&[f, f, t, f], 4, 3),
            (&[t, t, t, t], 2, 2),
            (&[f, t, f, t, t], 0, 0),
        ];
        for &(cached, max_blocks, want) in cases {
            assert_eq!(
                state_hit(max_blocks, |i| cached[i]),
                want,
                "{cached:?} {max_blocks}"
            );
        }
        // It stops at the first cached block from the right: nothing left of it is asked.
        let mut asked = Vec::new();
        let hit = state_hit(6, |i| {
            asked.push(i);
            i == 3
        });
        assert_eq!((hit, asked), (4, vec![5, 4, 3]));
    }

    /// vLLM's `SlidingWindowSpec.max_admission_blocks_per_request`: the window's last
    /// `window - 1` tokens plus the in-flight ones, capped by the model length, plus one block.
    #[test]
    fn admission_caps_match_vllm() {
        let w = KvGroupSpec::SlidingWindow { window: 64 };
        assert_eq!(
            w.admission_cap_blocks(16, 1 << 20, 4096),
            Some(4096 / 16 + 1)
        );
        assert_eq!(
            w.admission_cap_blocks(16, 512, 1 << 20),
            Some((63 + 512usize).div_ceil(16) + 1)
        );
        assert_eq!(
            KvGroupSpec::FullAttention.admission_cap_blocks(16, 512, 4096),
            None
        );
        let huge = KvGroupSpec::SlidingWindow { window: usize::MAX };
        assert_eq!(
            huge.admission_cap_blocks(1, usize::MAX, usize::MAX),
            Some(usize::MAX)
        );
    }
}
