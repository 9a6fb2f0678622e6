//! Batch growth, one engine step: `append_len_batch` / `append_tokens_batch`, all or nothing
//! over the batch, with each id resolved once and no allocation on the hot path.

use super::checks::check_distinct;
use super::growth::{grow_table, growth_plan};
use super::plans::BatchScratch;
use super::state::{KvCacheManager, Sequence};
use crate::error::{invalid, Error, Result};
use crate::pool::BlockPool;
use crate::prefix::PrefixCache;
use crate::seqmap::SeqMap;
use crate::{SeqId, TokenId};

impl KvCacheManager {
    /// Appends `num_tokens` tokens to each of `seq_ids` (one engine step), all or nothing.
    /// Duplicate ids are [`Error::InvalidArgument`]; a shortage reports the blocks the whole
    /// batch needed.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 3, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence_len(1, 2)?;
    /// kv.add_sequence_len(2, 2)?;
    /// let err = kv.append_len_batch(&[1, 2], 1).unwrap_err();   // needs 2, 1 free
    /// assert_eq!(err.blocks_short(), Some(1));
    /// assert_eq!((kv.num_tokens(1)?, kv.num_tokens(2)?), (2, 2)); // nothing changed
    /// kv.free(2)?;
    /// kv.append_len_batch(&[1], 1)?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn append_len_batch(&mut self, seq_ids: &[SeqId], num_tokens: usize) -> Result<()> {
        self.append_batch(seq_ids, num_tokens, None)
    }

    /// Appends row `i` of `token_ids` (`[B * num_tokens]`, row-major, `B = seq_ids.len()`) to
    /// `seq_ids[i]`, all or nothing.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 2, ..Default::default() })?;
    /// kv.add_sequence(1, &[1], None)?;
    /// kv.add_sequence(2, &[1], None)?;
    /// kv.append_tokens_batch(&[1, 2], &[10, 20], 1)?;
    /// assert!(kv.append_tokens_batch(&[1, 2], &[10, 20, 30], 1).is_err());   // wrong length
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn append_tokens_batch(
        &mut self,
        seq_ids: &[SeqId],
        token_ids: &[TokenId],
        num_tokens: usize,
    ) -> Result<()> {
        match seq_ids.len().checked_mul(num_tokens) {
            Some(n) if n == token_ids.len() => {}
            _ => {
                return invalid(format!(
                    "token_ids has {} entries, expected {} sequences x {num_tokens} tokens",
                    token_ids.len(),
                    seq_ids.len()
                ))
            }
        }
        self.append_batch(seq_ids, num_tokens, Some(token_ids))
    }

    fn append_batch(
        &mut self,
        seq_ids: &[SeqId],
        num_tokens: usize,
        token_ids: Option<&[TokenId]>,
    ) -> Result<()> {
        if !self.plain {
            return self.append_groups(seq_ids, num_tokens, token_ids);
        }
        if num_tokens == 0 {
            check_distinct(seq_ids)?;
            // Still validate the ids: a step naming an unknown sequence is a caller bug.
            for &id in seq_ids {
                Self::check_computed(id, self.resident(id)?)?;
            }
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.batch);
        let mut fresh = std::mem::take(&mut self.scratch);
        fresh.clear();
        let result = plan_batch(
            &mut self.seqs,
            &self.pool,
            self.prefix.as_ref(),
            seq_ids,
            num_tokens,
            &mut batch,
        )
        .and_then(|needed_blocks| self.allocate_fresh(needed_blocks, &mut fresh));
        if result.is_ok() {
            let mut supply = fresh.drain(..);
            if self.prefix.is_none() {
                // No index: token ids are not recorded, and a copy's release touches the pool
                // alone, so the copies are recorded after the loop, which then makes no call
                // and keeps what it reads in registers (callgrind, `append_batch_48`).
                let block_size = self.block_size;
                let seqs = &mut self.seqs;
                for (&row, &plan) in batch.rows.iter().zip(&batch.plans) {
                    if let Some(copy) =
                        grow_table(seqs.at_mut(row), block_size, num_tokens, plan, &mut supply)
                    {
                        batch.copies.push(copy);
                    }
                }
                for i in 0..batch.copies.len() {
                    let (src, dst) = batch.copies[i];
                    self.copy_on_write(src, dst);
                }
                batch.copies.clear();
            } else {
                for (member, (&row, &plan)) in batch.rows.iter().zip(&batch.plans).enumerate() {
                    let tokens =
                        token_ids.map(|t| &t[member * num_tokens..(member + 1) * num_tokens]);
                    self.apply_growth(row, num_tokens, tokens, plan, &mut supply);
                }
            }
            drop(supply);
            if self.new_blocks.is_some() {
                for (&row, &plan) in batch.rows.iter().zip(&batch.plans) {
                    self.note_growth(row, plan, num_tokens);
                }
            }
        }
        self.scratch = fresh;
        self.batch = batch;
        result
    }
}

/// Validates a batch append of `num_tokens > 0` tokens to each of `seq_ids` (distinct,
/// known, resident, fitting the pool); fills `batch` with each member's row and plan and
/// returns the fresh blocks the batch needs. Changes nothing observable. A function of its
/// own, of just the fields it reads, so the loop's live values fit the registers better
/// (callgrind, `append_batch_48`).
#[inline(never)]
fn plan_batch(
    seqs: &mut SeqMap<Sequence>,
    pool: &BlockPool,
    prefix: Option<&PrefixCache>,
    seq_ids: &[SeqId],
    num_tokens: usize,
    batch: &mut BatchScratch,
) -> Result<usize> {
    batch.rows.clear();
    batch.plans.clear();
    batch.cow_releases.clear();
    seqs.begin_batch();
    let mut needed_blocks = 0usize;
    for &id in seq_ids {
        let Some(row) = seqs.row(id) else {
            return Err(batch_error(seq_ids, Error::UnknownSequence(id)));
        };
        if !seqs.mark(row) {
            return invalid(format!("sequence id {id} appears twice in the batch"));
        }
        let seq = seqs.at(row);
        if seq.swapped {
            return Err(batch_error(seq_ids, Error::SequenceSwappedOut(id)));
        }
        if let Err(e) = KvCacheManager::check_computed(id, seq) {
            return Err(batch_error(seq_ids, e));
        }
        // Copy-on-write of a block shared by two batch members happens only for the first
        // one to append; afterwards the other holds the last reference and writes in place.
        let plan = match growth_plan(
            &seq.table,
            num_tokens,
            pool,
            prefix,
            Some(&mut batch.cow_releases),
        ) {
            Ok(plan) => plan,
            Err(e) => return Err(batch_error(seq_ids, e)),
        };
        needed_blocks += plan.needed_blocks;
        batch.rows.push(row);
        batch.plans.push(plan);
    }
    if needed_blocks > pool.num_blocks() {
        return invalid(format!(
            "the batch needs {needed_blocks} new blocks, more than the pool's {}",
            pool.num_blocks()
        ));
    }
    Ok(needed_blocks)
}

/// The error a batch reports when one member fails validation with `member_error`: a
/// duplicate id anywhere in the batch takes precedence (it is checked first by contract).
#[cold]
fn batch_error(seq_ids: &[SeqId], member_error: Error) -> Error {
    match check_distinct(seq_ids) {
        Err(duplicate) => duplicate,
        Ok(()) => member_error,
    }
}
