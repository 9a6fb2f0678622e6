//! Growth of a hybrid manager's sequences: appends (every group grows together), the computed
//! watermark, the window release it drives, and the indexing of newly computed blocks.
//!
//! Window release (vLLM's `remove_skipped_blocks`): when an operation schedules more tokens of
//! a sequence (an append, `advance_computed`), each window group first releases the blocks the
//! watermark *before* that operation puts out of every later query's window. Those tokens are
//! processed; the pass being scheduled reads nothing before them, so no block a pass still
//! reads is ever released. Admission with a hit does the same with the hit as the watermark.

use rustc_hash::FxHashMap;

use super::window::{caches_blocks, skipped_blocks};
use super::Hybrid;
use crate::error::{invalid, Error, Result};
use crate::manager::groups::NULL_BLOCK;
use crate::manager::{check_distinct, prefilling_error};
use crate::{BlockId, SeqId, TokenId};

/// The blocks one growth needs: fresh blocks over all groups and the table entries the window
/// release drops first.
struct GrowthPlan {
    fresh: usize,
    /// Per group, whether the partial last block is copied before the write (decided once, at
    /// planning: a batch that holds both sides of a fork copies for each, as planned).
    copies: Vec<bool>,
    /// Per group, `(first, end)`: positions `first..end` are released (`first` is the first
    /// still-live position).
    release: Vec<(usize, usize)>,
}

impl Hybrid {
    /// See [`crate::KvCacheManager::num_computed_tokens`].
    #[cold]
    pub(crate) fn num_computed_tokens(&self, seq_id: SeqId) -> Result<usize> {
        self.seqs
            .get(&seq_id)
            .map(|s| s.num_computed)
            .ok_or(Error::UnknownSequence(seq_id))
    }

    /// Per window group, the positions the sequence's current watermark releases.
    fn release_plan(&self, seq_id: SeqId) -> Vec<(usize, usize)> {
        let seq = &self.seqs[&seq_id];
        self.specs
            .iter()
            .zip(&seq.tables)
            .map(|(&spec, t)| {
                let end =
                    skipped_blocks(spec, seq.num_computed, self.block_size).min(t.block_ids.len());
                let first = t.block_ids[..end]
                    .iter()
                    .rposition(|&b| b == NULL_BLOCK)
                    .map_or(0, |p| p + 1);
                (first, end)
            })
            .collect()
    }

    /// Releases the planned positions of each group, last first (vLLM walks back from the
    /// window start, so the later block goes first into the eviction order).
    fn apply_release(&mut self, seq_id: SeqId, plan: &[(usize, usize)]) {
        for (g, &(first, end)) in plan.iter().enumerate() {
            for i in (first..end).rev() {
                let seq = self.seqs.get_mut(&seq_id).expect("live");
                let b = std::mem::replace(&mut seq.tables[g].block_ids[i], NULL_BLOCK);
                self.release(b);
            }
        }
    }

    /// The window release of a sequence at its current watermark (infallible).
    pub(super) fn release_out_of_window(&mut self, seq_id: SeqId) {
        let plan = self.release_plan(seq_id);
        self.apply_release(seq_id, &plan);
    }

    /// Enters the sequence's newly computed full blocks in the index, group by group (one
    /// `BlockStored` per run of blocks entered in a group).
    pub(super) fn index_computed(&mut self, seq_id: SeqId) {
        let bs = self.block_size;
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        let seq = self.seqs.get_mut(&seq_id).expect("live");
        let Some(tokens) = seq.tokens.as_deref() else {
            return;
        };
        let full = seq.num_computed / bs;
        let start = seq.hashes.len();
        if start >= full {
            return;
        }
        let mut chain = cache.hasher.chain(bs, seq.extra_key.as_deref());
        for i in start..full {
            let parent = seq.hashes.last().copied();
            seq.hashes
                .push(chain.hash(parent, &tokens[i * bs..(i + 1) * bs]));
        }
        for (g, table) in seq.tables.iter().enumerate() {
            if !caches_blocks(self.specs[g], bs) {
                continue;
            }
            let mut run_start = None;
            for i in start..=full {
                let entered = i < full && {
                    let b = table.block_ids[i];
                    let parent = i.checked_sub(1).map(|p| seq.hashes[p]);
                    let chunk = &tokens[i * bs..(i + 1) * bs];
                    b != NULL_BLOCK
                        && cache.insert(g as u32, b, seq.hashes[i], parent, chunk, &seq.extra_key)
                };
                match (entered, run_start) {
                    (true, None) => run_start = Some(i),
                    (false, Some(s)) => {
                        let parent = s.checked_sub(1).map(|p| seq.hashes[p]);
                        cache.stored(
                            g as u32,
                            &seq.hashes[s..i],
                            parent,
                            &tokens[s * bs..i * bs],
                            bs,
                            seq.extra_key.as_deref(),
                        );
                        run_start = None;
                    }
                    _ => {}
                }
            }
        }
    }

    /// Validates growth of `seq_id` by `num_tokens` and counts what it needs.
    fn plan_growth(&self, seq_id: SeqId, num_tokens: usize) -> Result<GrowthPlan> {
        let seq = self.resident(seq_id)?;
        if seq.num_computed < seq.num_tokens() {
            return Err(prefilling_error(seq_id, seq.num_computed, seq.num_tokens()));
        }
        let t = seq.num_tokens();
        let new_len = t.checked_add(num_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "sequence {seq_id}: {t} + {num_tokens} tokens overflow"
            ))
        })?;
        let bs = self.block_size;
        let per_group = new_len.div_ceil(bs);
        if per_group
            .checked_mul(self.num_groups())
            .map_or(true, |n| n > self.pool.num_blocks())
        {
            return invalid(format!(
                "{new_len} tokens need {per_group} blocks in each of {} kv_groups, more than the \
                 pool's {} blocks",
                self.num_groups(),
                self.pool.num_blocks()
            ));
        }
        let copies: Vec<bool> = seq
            .tables
            .iter()
            .map(|table| {
                num_tokens > 0
                    && t % bs != 0
                    && self.needs_copy(*table.block_ids.last().expect("a partial block exists"))
            })
            .collect();
        let fresh = (per_group - t.div_ceil(bs)) * self.num_groups()
            + copies.iter().filter(|&&c| c).count();
        Ok(GrowthPlan {
            fresh,
            copies,
            release: self.release_plan(seq_id),
        })
    }

    /// Whether a write into partial last block `b` must copy it first: it is shared, or
    /// indexed (its content is still served to hits; see docs/design.md, Truncate).
    fn needs_copy(&self, b: BlockId) -> bool {
        self.pool.refcount(b).is_ok_and(|rc| rc > 1)
            || self.cache.as_ref().is_some_and(|c| c.is_indexed(b))
    }

    /// Blocks that the planned releases bring to refcount 0 (they become allocatable).
    fn blocks_freed_by(&self, plans: &[(SeqId, GrowthPlan)]) -> usize {
        let mut drops: FxHashMap<BlockId, u32> = FxHashMap::default();
        for (id, plan) in plans {
            let seq = &self.seqs[id];
            for (g, &(first, end)) in plan.release.iter().enumerate() {
                for &b in &seq.tables[g].block_ids[first..end] {
                    *drops.entry(b).or_default() += 1;
                }
            }
        }
        drops
            .into_iter()
            .filter(|&(b, n)| self.pool.refcount(b).is_ok_and(|rc| rc == n))
            .count()
    }

    /// See [`crate::KvCacheManager::can_append`].
    #[cold]
    pub(crate) fn can_append(&self, seq_id: SeqId, num_tokens: usize) -> Result<bool> {
        match self.plan_growth(seq_id, num_tokens) {
            Ok(plan) => {
                let plans = [(seq_id, plan)];
                let freed = self.blocks_freed_by(&plans);
                Ok(plans[0].1.fresh <= self.num_available_blocks() + freed)
            }
            Err(Error::InvalidArgument(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Appends `num_tokens` tokens to each of `seq_ids` (row `i` of `token_ids` to
    /// `seq_ids[i]` when given), all or nothing over the batch and over the groups; only the
    /// window releases due at the current watermarks happen even when blocks run short.
    #[cold]
    pub(crate) fn append_batch(
        &mut self,
        seq_ids: &[SeqId],
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        check_distinct(seq_ids)?;
        let mut plans = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            plans.push((id, self.plan_growth(id, num_tokens)?));
        }
        let fresh: usize = plans.iter().map(|(_, p)| p.fresh).sum();
        // The window releases come first, and stand even when the blocks then run short (as
        // in vLLM, which frees out-of-window blocks before sizing an allocation): the
        // released blocks are dead at this watermark whatever the append's outcome, and may
        // be what makes room. Every id is validated by now.
        for (id, plan) in &plans {
            self.apply_release(*id, &plan.release);
        }
        let mut blocks = Vec::with_capacity(fresh);
        self.allocate_fresh(fresh, &mut blocks)?;
        let mut blocks = blocks.into_iter();
        for (row, (id, plan)) in plans.iter().enumerate() {
            let row_tokens = token_ids.map(|t| &t[row * num_tokens..(row + 1) * num_tokens]);
            self.grow(*id, num_tokens, &plan.copies, row_tokens, &mut blocks);
        }
        debug_assert!(blocks.next().is_none());
        Ok(())
    }

    /// Applies a planned growth: copy-on-write of shared partial last blocks, fresh blocks,
    /// token ids, watermark, indexing.
    fn grow(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        copies: &[bool],
        token_ids: Option<&[TokenId]>,
        blocks: &mut impl Iterator<Item = BlockId>,
    ) {
        if num_tokens == 0 {
            return;
        }
        let bs = self.block_size;
        let t = self.seqs[&seq_id].num_tokens();
        let new_blocks = (t + num_tokens).div_ceil(bs) - t.div_ceil(bs);
        for (g, &copy) in copies.iter().enumerate() {
            if copy {
                let last = *self.seqs[&seq_id].tables[g]
                    .block_ids
                    .last()
                    .expect("partial");
                {
                    let dst = blocks.next().expect("planned");
                    *self.seqs.get_mut(&seq_id).expect("live").tables[g]
                        .block_ids
                        .last_mut()
                        .expect("partial") = dst;
                    self.record_copy(last, dst);
                    self.release(last);
                }
            }
            let seq = self.seqs.get_mut(&seq_id).expect("live");
            seq.tables[g]
                .block_ids
                .extend(blocks.by_ref().take(new_blocks));
            seq.tables[g].num_tokens = t + num_tokens;
        }
        let seq = self.seqs.get_mut(&seq_id).expect("live");
        match (seq.tokens.as_mut(), token_ids) {
            (Some(all), Some(new)) => all.extend_from_slice(new),
            // Unknown token ids end indexing for this sequence.
            _ => seq.tokens = None,
        }
        seq.num_computed = t + num_tokens;
        self.index_computed(seq_id);
    }

    /// See [`crate::KvCacheManager::advance_computed`]; each sequence's window groups first
    /// release what its current watermark puts out of the window.
    #[cold]
    pub(crate) fn advance_computed(&mut self, seq_ids: &[SeqId], num_tokens: usize) -> Result<()> {
        check_distinct(seq_ids)?;
        for &id in seq_ids {
            let s = self.resident(id)?;
            let left = s.num_tokens() - s.num_computed;
            if num_tokens > left {
                return invalid(format!(
                    "sequence {id} has {left} tokens not yet computed, fewer than {num_tokens}"
                ));
            }
        }
        if num_tokens == 0 {
            return Ok(());
        }
        for &id in seq_ids {
            self.release_out_of_window(id);
            self.seqs.get_mut(&id).expect("validated").num_computed += num_tokens;
            self.index_computed(id);
        }
        Ok(())
    }
}
