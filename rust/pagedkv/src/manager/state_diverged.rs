//! The diverged hit (`AdmitOptions::diverged_hit`; docs/design.md, KV groups, "State
//! groups"): an admission whose hit is the full-attention groups' own run of cached blocks
//! where a state group's own hit lags it, backed by a KV connector's external tokens.
//!
//! vLLM 0.33 reaches it through `get_computed_blocks_for_connector` (a connector with
//! `supports_divergent_local_hybrid_hits`): the scheduler admits full attention's `k` hit
//! blocks plus the connector's `e > 0` tokens, and hands every group its own hit list. What
//! its `allocate_slots` then does (read from `MambaManager` in `"align"` mode):
//!
//! * full attention takes its `k` hit blocks, then blocks for the external and new tokens, as
//!   on any hit with external tokens;
//! * the state group's hit positions are all skipped (`get_num_skipped_tokens(k*bs + e)` is
//!   `k*bs + e - 1`): nulls up to `(k*bs + e - 1) / bs`, one block at the external tokens'
//!   last block (the state the connector restores), one at the chunk's last position when it
//!   ends in a later block (state_external.rs: the same allocation as on the reconciled hit);
//! * its count for the state group is `min(cdiv(n, bs) - len(own hit list), 1)` (positive:
//!   its own hit lags `k`) plus 1 when its own hit block (the rightmost cached one, below
//!   `k`) is cached-evictable: a block the admission never takes;
//! * its same-step refusal (`cached_blocks_this_step`) looks at that own hit block.
//!
//! So the admission differs from the reconciled hit's with external tokens only in the hit's
//! length (full attention's run) and in which state block is counted and checked (the
//! group's own, not the one at the hit's end). Where vLLM's count passes and the pool is
//! short of the blocks taken (the state group's two, counted as one), vLLM's `get_new_blocks`
//! raises in the middle of its allocation; the core refuses with `OutOfBlocks`, nothing
//! changed (admit_groups.rs, the last check of the plan).

use super::config::AdmitOptions;
use super::group_spec::KvGroupSpec;
use super::policy::state_hit;
use crate::error::{invalid, Result};

/// InvalidArgument unless the diverged-hit option may be taken: per chunk, with external
/// tokens, token ids (`has_tokens`), prefix caching (`caching`), and groups that are full
/// attention and state groups only, at least one of each (a window group's hit positions
/// are not all released at the hit plus the external tokens, so its rows would need their
/// own rule). Checked before anything changes.
pub(super) fn check_option(
    specs: &[KvGroupSpec],
    caching: bool,
    has_tokens: bool,
    o: &AdmitOptions<'_>,
) -> Result<()> {
    let why = if o.reserve_prompt {
        "is per chunk only (reserve_prompt=false)"
    } else if o.num_external_computed_tokens == 0 {
        "needs external computed tokens (a connector's tokens back the lagging state)"
    } else if !caching || !has_tokens {
        "needs prefix caching and token ids"
    } else if !specs
        .iter()
        .all(|s| *s == KvGroupSpec::FullAttention || s.is_state())
        || !specs.contains(&KvGroupSpec::FullAttention)
        || !specs.iter().any(KvGroupSpec::is_state)
    {
        "needs full-attention and MambaState groups only, at least one of each"
    } else {
        return Ok(());
    };
    invalid(format!("the diverged hit {why}"))
}

/// The diverged hit over `specs`, at most `max_blocks` blocks: the full-attention groups'
/// own leading run of cached blocks (every full-attention group holds each of its blocks,
/// as vLLM looks one spec's groups up together), and per group its own state hit in blocks
/// below it (the rightmost cached block, vLLM's Mamba finder; 0 for the other groups).
/// `cached(group, i)` says whether the group's block `i` is cached.
pub(crate) fn diverged_hit(
    specs: &[KvGroupSpec],
    max_blocks: usize,
    block_size: usize,
    mut cached: impl FnMut(usize, usize) -> bool,
) -> (usize, Vec<usize>) {
    let mut hit = max_blocks;
    for (g, spec) in specs.iter().enumerate() {
        if *spec == KvGroupSpec::FullAttention {
            hit = spec.longest_hit(hit, block_size, |i| cached(g, i));
        }
    }
    let own = specs
        .iter()
        .enumerate()
        .map(|(g, spec)| match spec.is_state() {
            true => state_hit(hit, |i| cached(g, i)),
            false => 0,
        })
        .collect();
    (hit, own)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: KvGroupSpec = KvGroupSpec::FullAttention;
    const STATE: KvGroupSpec = KvGroupSpec::MambaState;

    /// vLLM's `test_hybrid_fa_deeper_hit_respects_connector_lookup_policy` layout: full
    /// attention holds 4 blocks, the state group block 0 only: the hit is 4 blocks, the state
    /// group's own 1; every group's joint run bounds the full-attention hit.
    #[test]
    fn the_hit_is_full_attentions_run_and_the_state_groups_own_lags_it() {
        let specs = [FULL, STATE];
        let cached = |g: usize, i: usize| if g == 0 { i < 4 } else { i == 0 };
        assert_eq!(diverged_hit(&specs, 5, 16, cached), (4, vec![0, 1]));
        assert_eq!(diverged_hit(&specs, 2, 16, cached), (2, vec![0, 1]));
        // A state block at or past full attention's run is not the group's hit below it.
        let deep = |g: usize, i: usize| if g == 0 { i < 2 } else { i == 3 };
        assert_eq!(diverged_hit(&specs, 5, 16, deep), (2, vec![0, 0]));
        // Two full-attention groups: the run both hold.
        let two = [FULL, STATE, FULL];
        let cached = |g: usize, i: usize| match g {
            0 => i < 4,
            1 => i == 1,
            _ => i < 3,
        };
        assert_eq!(diverged_hit(&two, 5, 16, cached), (3, vec![0, 2, 0]));
    }

    #[test]
    fn the_option_is_refused_outside_its_configs() {
        let ok = AdmitOptions {
            reserve_prompt: false,
            num_external_computed_tokens: 1,
            diverged_hit: true,
            ..Default::default()
        };
        assert!(check_option(&[FULL, STATE], true, true, &ok).is_ok());
        assert!(check_option(&[STATE, FULL, STATE], true, true, &ok).is_ok());
        for specs in [
            &[FULL][..],
            &[STATE],
            &[FULL, STATE, KvGroupSpec::SlidingWindow { window: 4 }],
        ] {
            assert!(check_option(specs, true, true, &ok).is_err(), "{specs:?}");
        }
        assert!(check_option(&[FULL, STATE], false, true, &ok).is_err());
        assert!(check_option(&[FULL, STATE], true, false, &ok).is_err());
        let reserve = AdmitOptions {
            reserve_prompt: true,
            ..ok
        };
        assert!(check_option(&[FULL, STATE], true, true, &reserve).is_err());
        let none = AdmitOptions {
            num_external_computed_tokens: 0,
            ..ok
        };
        assert!(check_option(&[FULL, STATE], true, true, &none).is_err());
    }
}
