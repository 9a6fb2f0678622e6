//! Growth of one sequence: `append_tokens` / `append_len` / `can_append`, and the growth plan
//! (fresh blocks needed, copy-on-write of a shared last block) that batch appends share.

use rustc_hash::FxHashMap;

use super::checks::blocks_fitting;
use super::plans::GrowthPlan;
use super::prefix::record_tokens;
use super::state::{KvCacheManager, Sequence};
use crate::error::{Error, Result};
use crate::pool::BlockPool;
use crate::prefix::PrefixCache;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

impl KvCacheManager {
    /// Appends tokens to a sequence, taking new blocks as needed and copying a shared partial
    /// last block first (copy-on-write). With prefix caching, each block these tokens fill
    /// becomes hittable.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence(1, &[5], None)?;
    /// kv.append_tokens(1, &[6, 7])?;
    /// assert_eq!(kv.block_table(1)?, &[0, 1]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn append_tokens(&mut self, seq_id: SeqId, token_ids: &[TokenId]) -> Result<()> {
        if !self.plain {
            return self.append_groups(&[seq_id], token_ids.len(), Some(token_ids));
        }
        self.append(seq_id, token_ids.len(), Some(token_ids))
    }

    /// Appends `num_tokens` tokens whose ids are unknown (the sequence's later blocks are then
    /// never prefix-cached).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 2, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 1)?;
    /// kv.append_len(1, 3)?;
    /// assert!(matches!(kv.append_len(1, 1), Err(Error::InvalidArgument(_))));  // can never fit
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    #[inline]
    pub fn append_len(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<()> {
        if !self.plain {
            return self.append_groups(&[seq_id], num_tokens, None);
        }
        self.append(seq_id, num_tokens, None)
    }

    #[inline]
    fn append(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        let block_size = self.block_size;
        let row = self
            .seqs
            .row(seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        let seq = self.seqs.at_mut(row);
        if seq.swapped {
            return Err(Error::SequenceSwappedOut(seq_id));
        }
        Self::check_computed(seq_id, seq)?;
        // Hot path: room in a private last block (not indexed: only a truncate leaves a
        // partial block indexed, and its next write copies it). With lookahead slots the
        // partial block is private by invariant (see `growth_plan`).
        if num_tokens <= seq.table.free_slots(block_size) {
            if num_tokens == 0 {
                return Ok(());
            }
            let last = *seq
                .table
                .block_ids
                .last()
                .expect("free slots imply a last block");
            let indexed = self.prefix.as_ref().is_some_and(|p| p.is_indexed(last));
            if self.pool.refcount(last)? == 1 && !indexed {
                seq.table.num_tokens += num_tokens;
                seq.num_computed = seq.table.num_tokens;
                if let Some(prefix) = self.prefix.as_mut() {
                    record_tokens(prefix, &self.pool, seq, block_size, token_ids);
                }
                return Ok(());
            }
        }
        let plan = growth_plan(
            &self.seqs.at(row).table,
            num_tokens,
            &self.pool,
            self.prefix.as_ref(),
            None,
        )?;
        self.scratch.clear();
        let mut fresh = std::mem::take(&mut self.scratch);
        let result = self.allocate_fresh(plan.needed_blocks, &mut fresh);
        if result.is_ok() {
            self.apply_growth(row, num_tokens, token_ids, plan, &mut fresh.drain(..));
            if self.new_blocks.is_some() {
                self.note_growth(row, plan, num_tokens);
            }
        }
        self.scratch = fresh;
        result
    }

    /// Whether `num_tokens` more tokens could be appended to the sequence right now.
    /// A count that can never fit the pool, or a sequence still prefilling, answers `false`.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 2, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 3)?;
    /// assert!(kv.can_append(1, 5)?);
    /// assert!(!kv.can_append(1, 6)?);
    /// assert!(!kv.can_append(1, usize::MAX)?);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn can_append(&self, seq_id: SeqId, num_tokens: usize) -> Result<bool> {
        if !self.plain {
            return self.can_append_groups(seq_id, num_tokens);
        }
        match self.plan_growth(seq_id, num_tokens) {
            Ok(plan) => Ok(plan.needed_blocks <= self.num_available_blocks()),
            Err(Error::InvalidArgument(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Validates growth of `seq_id` by `num_tokens` and counts the fresh blocks it needs.
    fn plan_growth(&self, seq_id: SeqId, num_tokens: usize) -> Result<GrowthPlan> {
        let seq = self.resident(seq_id)?;
        Self::check_computed(seq_id, seq)?;
        growth_plan(
            &seq.table,
            num_tokens,
            &self.pool,
            self.prefix.as_ref(),
            None,
        )
    }

    /// Applies a validated plan to the sequence in `row` of `seqs` with blocks drawn from `supply`
    /// (cannot fail).
    #[inline]
    pub(super) fn apply_growth(
        &mut self,
        row: usize,
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
        plan: GrowthPlan,
        supply: &mut impl Iterator<Item = BlockId>,
    ) {
        let block_size = self.block_size;
        let seq = self.seqs.at_mut(row);
        let copied = grow_table(seq, block_size, num_tokens, plan, supply);
        if let Some(prefix) = self.prefix.as_mut() {
            record_tokens(prefix, &self.pool, seq, block_size, token_ids);
        }
        if let Some((src, dst)) = copied {
            self.copy_on_write(src, dst);
        }
    }
}

/// The table side of a validated growth of `seq` by `num_tokens` (with blocks from `supply`):
/// the copy-on-write swap, new blocks, length and watermark (the caller records token ids).
/// Returns the copy `(src, dst)` the caller records with `copy_on_write`. A free function of
/// the fields it needs, so a batch loop keeps them in registers.
#[inline(always)]
pub(super) fn grow_table(
    seq: &mut Sequence,
    block_size: usize,
    num_tokens: usize,
    plan: GrowthPlan,
    supply: &mut impl Iterator<Item = BlockId>,
) -> Option<(BlockId, BlockId)> {
    let mut copied = None;
    if plan.copy_on_write {
        let dst = supply.next().expect("planned block");
        let last = seq
            .table
            .block_ids
            .last_mut()
            .expect("copy-on-write of an empty table");
        copied = Some((std::mem::replace(last, dst), dst));
    }
    let new_len = seq.table.num_tokens + num_tokens;
    // `len * block_size < new_len` is `len < ceil(new_len / block_size)` without a division.
    while seq.table.block_ids.len() * block_size < new_len {
        seq.table
            .block_ids
            .push(supply.next().expect("planned block"));
    }
    seq.table.num_tokens = new_len;
    seq.num_computed = new_len;
    copied
}

/// Validates growth of `table` by `num_tokens` tokens and counts the fresh blocks it needs.
/// `cow_releases` tracks references already dropped by earlier members of a batch. A partial
/// last block is copied before it is written when it is shared, or when it is indexed (a
/// truncate cut into a block others held: its content stays hittable).
#[inline]
pub(super) fn growth_plan(
    table: &BlockTable,
    num_tokens: usize,
    pool: &BlockPool,
    prefix: Option<&PrefixCache>,
    cow_releases: Option<&mut FxHashMap<BlockId, u32>>,
) -> Result<GrowthPlan> {
    let free_slots = table.free_slots(pool.block_size());
    // Tokens that fit the last block need no new block (and cannot overflow: the table fits).
    let mut needed_blocks = if num_tokens <= free_slots {
        0
    } else {
        let new_len = table.num_tokens.checked_add(num_tokens).ok_or_else(|| {
            Error::InvalidArgument(format!("appending {num_tokens} tokens overflows"))
        })?;
        blocks_fitting(new_len, pool)? - table.block_ids.len()
    };
    let mut copy_on_write = false;
    if num_tokens > 0 && free_slots > 0 {
        // With slots past its tokens (`allocate_slots`) the last block is an empty one of
        // this table alone, and so is every block the write touches (docs/design.md,
        // Invariants 4), so checking the last block decides rightly either way.
        let last = *table
            .block_ids
            .last()
            .expect("free slots imply a last block");
        let mut refs = pool.refcount(last)?;
        // A refcount-1 block is referenced by this table alone: no other member can have
        // copied away from it, so only shared blocks need the bookkeeping.
        if refs > 1 {
            if let Some(released) = cow_releases {
                let r = released.entry(last).or_insert(0);
                refs -= *r;
                if refs > 1 {
                    *r += 1;
                }
            }
        }
        if refs > 1 || prefix.is_some_and(|p| p.is_indexed(last)) {
            copy_on_write = true;
            needed_blocks += 1;
        }
    }
    Ok(GrowthPlan {
        needed_blocks,
        copy_on_write,
    })
}

impl KvCacheManager {
    /// Logs a single-group growth by `num_tokens` of the sequence in `row` that `plan`
    /// described, after it: the copy-on-write destination at the position the write started
    /// in, and the new positions.
    #[cold]
    #[inline(never)]
    pub(super) fn note_growth(&mut self, row: usize, plan: GrowthPlan, num_tokens: usize) {
        let bs = self.block_size;
        let table = &self.seqs.at(row).table;
        let len = table.block_ids.len();
        let added = plan.needed_blocks - usize::from(plan.copy_on_write);
        if plan.copy_on_write {
            let at = (table.num_tokens - num_tokens) / bs;
            self.note_placed_row(row, at..at + 1);
        }
        self.note_placed_row(row, len - added..len);
    }
}
