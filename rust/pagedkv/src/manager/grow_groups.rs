//! The plain path's growth under the reserve contract: appends (every group grows together)
//! and `can_append` for every group list but the single full-attention group, whose tuned
//! paths are `growth.rs` and `batch.rs` (docs/design.md, KV groups).
//!
//! Window release: when an append schedules more tokens, each window group first releases
//! what the watermark *before* the append puts out of every later query's window (those
//! tokens are processed; the pass being scheduled reads nothing before them). The blocks the
//! release frees count as available, and an append that runs short all the same fails before
//! releasing anything (all or nothing).

use rustc_hash::FxHashMap;

use super::checks::check_distinct;
use super::group_spec::NULL_BLOCK;
use super::policy::{fresh_for_positions, grow_table, state_table_bound};
use super::state::KvCacheManager;
use crate::error::{invalid, Error, Result};
use crate::{BlockId, SeqId, TokenId};

/// What one sequence's growth needs, validated before anything changes.
struct GroupGrowth {
    seq_id: SeqId,
    /// Fresh blocks over all groups: new positions and copies.
    fresh: usize,
    /// Per group, whether the partial block the write starts in is copied first (shared with
    /// another table, or indexed).
    copies: Vec<bool>,
    /// Per group, `(first, end)`: positions the window release drops first.
    release: Vec<(usize, usize)>,
}

impl KvCacheManager {
    /// Validates growth of `seq_id` by `num_tokens` and counts what it needs; `cow_releases`
    /// tracks references to shared blocks that earlier members of a batch copy away from.
    fn plan_group_growth(
        &self,
        seq_id: SeqId,
        num_tokens: usize,
        cow_releases: &mut FxHashMap<BlockId, u32>,
    ) -> Result<GroupGrowth> {
        let seq = self.resident(seq_id)?;
        Self::check_computed(seq_id, seq)?;
        let t = seq.table.num_tokens;
        let new_len = t.checked_add(num_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "sequence {seq_id}: {t} + {num_tokens} tokens overflow"
            ))
        })?;
        let bs = self.block_size;
        let ng = self.num_groups();
        let positions = new_len.div_ceil(bs).max(seq.num_positions());
        // A state group holds one block per allocation, the others every position.
        let held = self.config.kv_groups.iter().try_fold(0usize, |n, spec| {
            n.checked_add(spec.fresh_cap().map_or(positions, |c| c.min(positions)))
        });
        let held = held.map(|n| n.max(state_table_bound(&self.config.kv_groups, positions)));
        if held.map_or(true, |n| n > self.num_usable_blocks()) {
            return invalid(format!(
                "{new_len} tokens need {positions} blocks in each of {ng} kv_groups, more than the \
                 pool's {} blocks",
                self.num_usable_blocks()
            ));
        }
        let copies: Vec<bool> = (0..ng)
            .map(|g| {
                if num_tokens == 0 || t % bs == 0 {
                    return false;
                }
                let b = seq.group_table(g)[t / bs];
                b != NULL_BLOCK && self.copy_needed(b, cow_releases)
            })
            .collect();
        let fresh = fresh_for_positions(&self.config.kv_groups, seq.num_positions(), positions)
            + copies.iter().filter(|&&c| c).count();
        Ok(GroupGrowth {
            seq_id,
            fresh,
            copies,
            release: self.release_plan(seq_id, seq.num_computed),
        })
    }

    /// Whether a write into partial block `b` must copy it first: it is shared (counting the
    /// references earlier batch members copied away from, `cow_releases`), or indexed (its
    /// content is still served to hits; docs/design.md, Truncate).
    pub(super) fn copy_needed(
        &self,
        b: BlockId,
        cow_releases: &mut FxHashMap<BlockId, u32>,
    ) -> bool {
        let mut refs = self.pool.refcount(b).unwrap_or(1);
        if refs > 1 {
            let r = cow_releases.entry(b).or_insert(0);
            refs -= *r;
            if refs > 1 {
                *r += 1;
                return true;
            }
        }
        self.prefix.as_ref().is_some_and(|p| p.is_indexed(b))
    }

    /// Blocks that the planned releases bring to refcount 0 (they become allocatable).
    fn blocks_freed_by(&self, plans: &[GroupGrowth]) -> usize {
        let mut drops: FxHashMap<BlockId, u32> = FxHashMap::default();
        for plan in plans {
            let seq = &self.seqs[&plan.seq_id];
            for (g, &(first, end)) in plan.release.iter().enumerate() {
                for &b in seq.group_table(g)[first..end]
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK)
                {
                    *drops.entry(b).or_default() += 1;
                }
            }
        }
        drops
            .into_iter()
            .filter(|&(b, n)| self.pool.refcount(b).is_ok_and(|rc| rc == n))
            .count()
    }

    /// [`Self::can_append`] of a manager of several groups.
    #[cold]
    pub(super) fn can_append_groups(&self, seq_id: SeqId, num_tokens: usize) -> Result<bool> {
        match self.plan_group_growth(seq_id, num_tokens, &mut FxHashMap::default()) {
            Ok(plan) => {
                let plans = [plan];
                let freed = self.blocks_freed_by(&plans);
                Ok(plans[0].fresh <= self.num_available_blocks() + freed)
            }
            Err(Error::InvalidArgument(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Appends `num_tokens` tokens to each of `seq_ids` (row `i` of `token_ids` to
    /// `seq_ids[i]` when given), all or nothing over the batch and the groups; only the window
    /// releases due at the current watermarks happen even when blocks run short.
    #[cold]
    #[inline(never)]
    pub(super) fn append_groups(
        &mut self,
        seq_ids: &[SeqId],
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        check_distinct(seq_ids)?;
        let mut cow_releases = FxHashMap::default();
        let mut plans = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            plans.push(self.plan_group_growth(id, num_tokens, &mut cow_releases)?);
        }
        let fresh: usize = plans.iter().map(|p| p.fresh).sum();
        if fresh > self.num_usable_blocks() {
            return invalid(format!(
                "the batch needs {fresh} new blocks, more than the pool's {}",
                self.num_usable_blocks()
            ));
        }
        if num_tokens == 0 {
            return Ok(());
        }
        // The window releases come first, since they may be what makes room; an append that
        // would still run short fails before them, changing nothing (docs/design.md,
        // Invariants 6; `allocate_slots`, vLLM's contract, keeps its release on a refusal).
        let available = self.num_available_blocks() + self.blocks_freed_by(&plans);
        if fresh > available {
            return Err(Error::OutOfBlocks {
                tier: crate::error::Tier::Device,
                needed_blocks: fresh,
                available_blocks: available,
            });
        }
        for plan in &plans {
            self.apply_release(plan.seq_id, &plan.release);
        }
        let mut blocks = Vec::with_capacity(fresh);
        self.allocate_fresh(fresh, &mut blocks)?;
        let mut supply = blocks.into_iter();
        for (row, plan) in plans.iter().enumerate() {
            let tokens = token_ids.map(|t| &t[row * num_tokens..(row + 1) * num_tokens]);
            self.grow_groups(plan.seq_id, num_tokens, &plan.copies, tokens, &mut supply);
        }
        debug_assert!(supply.next().is_none());
        Ok(())
    }

    /// Applies a planned growth of every group: copy-on-write of the partial block the write
    /// starts in, fresh positions, token ids, watermark, indexing.
    fn grow_groups(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        copies: &[bool],
        token_ids: Option<&[TokenId]>,
        supply: &mut impl Iterator<Item = BlockId>,
    ) {
        let bs = self.block_size;
        let row = self.seqs.row(seq_id).expect("validated");
        let t = self.seqs.at(row).table.num_tokens;
        let old_positions = self.seqs.at(row).num_positions();
        let positions = (t + num_tokens).div_ceil(bs).max(old_positions);
        let mut copied = Vec::new();
        for (g, &copy) in copies.iter().enumerate() {
            if copy {
                let dst = supply.next().expect("planned block");
                let src =
                    std::mem::replace(&mut self.seqs.at_mut(row).group_table_mut(g)[t / bs], dst);
                copied.push((src, dst));
                self.note_placed(seq_id, g, t / bs..t / bs + 1, true);
            }
            let spec = self.config.kv_groups[g];
            let table = self.seqs.at_mut(row).group_table_mut(g);
            grow_table(&spec, table, positions, None, supply);
        }
        self.note_placed_all(seq_id, old_positions..positions, true);
        let seq = self.seqs.at_mut(row);
        seq.table.num_tokens = t + num_tokens;
        seq.num_computed = t + num_tokens;
        if let Some(h) = seq.hashing.as_mut() {
            match token_ids {
                Some(new) if h.num_known(bs) == t => h.pending_tokens.extend_from_slice(new),
                // Unknown ids (or ids still to come before these) end indexing for it.
                _ => seq.hashing = None,
            }
        }
        self.index_ready(seq_id);
        // The copied blocks are released after the copies are indexed, as on the single
        // group's path: a copy of content its source holds stays private (one copy per
        // content) and the source keeps its place.
        for (src, dst) in copied {
            self.copy_on_write(src, dst);
        }
    }
}
