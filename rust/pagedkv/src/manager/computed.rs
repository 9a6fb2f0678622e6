//! The computed watermark: `advance_computed` / `num_computed_tokens` (chunked prefill), and
//! the indexing of blocks as the watermark passes them (docs/design.md, Computed watermark).

use std::ops::Range;

use super::checks::check_distinct;
use super::state::{KvCacheManager, Sequence};
use crate::error::{invalid, Error, Result};
use crate::pool::BlockPool;
use crate::prefix::events::block_stored;
use crate::prefix::index::Entered;
use crate::prefix::PrefixCache;
use crate::SeqId;

impl KvCacheManager {
    /// Tokens of the sequence whose K/V are written by the end of the pass that schedules them
    /// (vLLM's `num_computed_tokens`): the prefix hit plus the tokens scheduled so far.
    /// Appended tokens are computed when appended.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len_scheduled(1, 10, 4)?;
    /// assert_eq!(kv.num_computed_tokens(1)?, 4);
    /// assert_eq!(kv.num_computed_tokens(2), Err(Error::UnknownSequence(2)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn num_computed_tokens(&self, seq_id: SeqId) -> Result<usize> {
        self.seqs
            .get(&seq_id)
            .map(|s| s.num_computed)
            .ok_or(Error::UnknownSequence(seq_id))
    }

    /// Schedules the next `num_tokens` tokens of each of `seq_ids` (one chunked-prefill step):
    /// their watermarks move up, and each block now wholly computed enters the prefix index
    /// (a `BlockStored` per run of blocks entered). All or nothing: every id is validated
    /// first (distinct, known, resident, and `num_tokens` at most its tokens not yet computed:
    /// more is [`Error::InvalidArgument`]).
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 8, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len_scheduled(1, 10, 4)?;
    /// kv.add_sequence_len_scheduled(2, 6, 4)?;
    /// assert!(matches!(kv.advance_computed(&[1, 2], 3), Err(Error::InvalidArgument(_))));
    /// assert_eq!(kv.num_computed_tokens(1)?, 4);                 // nothing moved
    /// kv.advance_computed(&[1, 2], 2)?;
    /// assert_eq!((kv.num_computed_tokens(1)?, kv.num_computed_tokens(2)?), (6, 6));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn advance_computed(&mut self, seq_ids: &[SeqId], num_tokens: usize) -> Result<()> {
        check_distinct(seq_ids)?;
        let bs = self.block_size;
        for &id in seq_ids {
            let s = self.resident(id)?;
            let left = s.table.num_tokens.saturating_sub(s.num_computed);
            if num_tokens > left {
                return invalid(format!(
                    "sequence {id} has {left} tokens not yet computed, fewer than {num_tokens}"
                ));
            }
            let room = s.num_positions() * bs - s.num_computed;
            if num_tokens > room {
                return invalid(format!(
                    "sequence {id} has slots for {room} more tokens, fewer than {num_tokens} \
                     (allocate_slots first)"
                ));
            }
        }
        if num_tokens == 0 {
            return Ok(());
        }
        for &id in seq_ids {
            let row = self.seqs.row(id).expect("validated");
            if !self.plain {
                let processed = self.seqs.at(row).num_computed;
                self.release_out_of_window(id, processed);
            }
            let seq = self.seqs.at_mut(row);
            seq.num_computed += num_tokens;
            let keyed = seq
                .hashing
                .as_ref()
                .is_some_and(|h| h.keys.as_ref().is_some_and(|k| k.is_keyed()));
            match self.prefix.as_mut() {
                Some(prefix) if self.plain && !keyed => index_computed(prefix, &self.pool, seq, bs),
                Some(_) => self.index_ready_at(row),
                None => {}
            }
        }
        Ok(())
    }
}

/// Enters the sequence's full blocks that its watermark now covers and that are not hashed yet
/// in the prefix index (one at a time, never chained: their content may be indexed elsewhere
/// already), with one `BlockStored` per run of consecutive blocks the index took.
pub(super) fn index_computed(
    prefix: &mut PrefixCache,
    pool: &BlockPool,
    seq: &mut Sequence,
    block_size: usize,
) {
    let Some(h) = seq.hashing.as_mut() else {
        return;
    };
    let start = h.block_hashes.len();
    let end = seq.num_computed.min(h.num_known(block_size)) / block_size;
    if end <= start {
        return;
    }
    let events_on = prefix.events.enabled();
    let tokens = |i: usize| (i - start) * block_size;
    let mut run_start = start;
    let flush = |prefix: &mut PrefixCache, h: &super::state::SeqHashing, run: Range<usize>| {
        if events_on && !run.is_empty() {
            let event = block_stored(
                &h.block_hashes[run.clone()],
                run.start.checked_sub(1).map(|p| h.block_hashes[p]),
                &h.pending_tokens[tokens(run.start)..tokens(run.end)],
                block_size,
                h.extra_key.as_deref(),
            );
            prefix.events.push(event);
        }
    };
    for i in start..end {
        let chunk = &h.pending_tokens[tokens(i)..tokens(i + 1)];
        let parent = h.block_hashes.last().copied();
        // pagedkv's own hash given at admission (`AdmitOptions::prompt_hashes`), else hashed.
        let given = h.given_hash(i);
        let hash = given.unwrap_or_else(|| {
            prefix
                .hasher
                .hash_block(parent, chunk, h.extra_key.as_deref())
        });
        let b = seq.table.block_ids[i];
        let entered = prefix.register(
            b,
            hash,
            parent,
            i.checked_sub(1).map(|p| seq.table.block_ids[p]),
            &h.block_hashes,
            chunk,
            &h.extra_key,
            pool,
        );
        // Marked as the caller's, so that `check_invariants` does not recompute it (a wrong
        // hash misnames a block, it never serves wrong content).
        if given.is_some() && matches!(entered, Entered::New | Entered::Replaced(_)) {
            prefix.set_origin(b, 0, true);
        }
        let entered = entered.is_new();
        h.block_hashes.push(hash);
        if !entered {
            flush(prefix, h, run_start..i);
            run_start = i + 1;
        }
    }
    flush(prefix, h, run_start..end);
    h.pending_tokens.drain(..tokens(end));
    h.release_used_given();
}
