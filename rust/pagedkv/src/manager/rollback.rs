//! Rollback: `truncate` keeps a sequence's first tokens and drops the rest (rejected draft
//! tokens of speculative decoding, pruned beams), in O(dropped blocks)
//! (docs/design.md, Truncate).

use super::group_spec::{has_state_group, NULL_BLOCK};
use super::state::KvCacheManager;
use crate::error::{invalid, Error, Result};
use crate::prefix::hash::group_key;
use crate::SeqId;

impl KvCacheManager {
    /// Keeps the first `num_tokens` tokens of a resident sequence (0 keeps none; more than it
    /// holds is [`Error::InvalidArgument`]; a swapped-out one is
    /// [`Error::SequenceSwappedOut`]), changing nothing on error. The dropped tokens count as
    /// rejected:
    ///
    /// * each block past the new length loses this table's reference (tail first); one this
    ///   table alone held that is indexed leaves the index first (`BlockRemoved`) and goes back
    ///   to the pool, while one another table or a pin also holds keeps its content and its
    ///   place in the index, unmodified;
    /// * a kept, now partial last block that this table alone holds leaves the index (it will
    ///   be written in place); one shared, or still indexed, is copied before the next write
    ///   (copy-on-write, as for a fork);
    /// * the computed watermark drops to at most `num_tokens`.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 4, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;
    /// kv.append_tokens(1, &[6, 7, 8, 9, 10])?;   // 3 drafts accepted, 2 rejected...
    /// kv.truncate(1, 8)?;                       // ...are dropped
    /// assert_eq!((kv.num_tokens(1)?, kv.block_table(1)?.len()), (8, 2));
    /// assert_eq!(kv.num_available_blocks(), 6);
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn truncate(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<()> {
        let bs = self.block_size;
        let row = self
            .seqs
            .row(seq_id)
            .ok_or(Error::UnknownSequence(seq_id))?;
        let seq = self.seqs.at(row);
        if seq.swapped {
            return Err(Error::SequenceSwappedOut(seq_id));
        }
        let old_len = seq.table.num_tokens;
        if num_tokens > old_len {
            return invalid(format!(
                "cannot truncate sequence {seq_id} of {old_len} tokens to {num_tokens}"
            ));
        }
        if num_tokens == old_len {
            return Ok(());
        }
        if has_state_group(&self.config.kv_groups) {
            return invalid(format!(
                "cannot truncate sequence {seq_id}: a MambaState group's state block holds the \
                 state at its last token, with no earlier one to go back to"
            ));
        }
        let keep_blocks = num_tokens.div_ceil(bs);
        if !self.plain {
            self.check_window_truncate(seq_id, num_tokens, keep_blocks)?;
        }
        // Commit (infallible from here).
        let seq = self.seqs.at_mut(row);
        let num_computed = seq.num_computed.min(num_tokens);
        if let Some(h) = seq.hashing.as_mut() {
            let new_known = h.num_known(bs).min(num_tokens);
            let num_hashed = num_computed.min(new_known) / bs;
            if num_hashed >= h.block_hashes.len() {
                let hashed_tokens = h.block_hashes.len() * bs;
                h.pending_tokens.truncate(new_known - hashed_tokens);
            } else {
                // The cut falls inside the hashed blocks: the kept partial block's ids come
                // from the index record of the block itself in any group (before it may leave
                // the index). Without one (a block swapped back in is not indexed), hashing
                // ends here.
                let partial = num_tokens - num_hashed * bs;
                let recovered = if partial == 0 {
                    Some(Vec::new())
                } else {
                    let hash = h.block_hashes[num_hashed];
                    let table = &seq.table;
                    let groups = &seq.groups;
                    self.prefix.as_ref().and_then(|p| {
                        (0..groups.len() + 1).find_map(|g| {
                            let b = super::indexing::group_slice(table, groups, g)[num_hashed];
                            (b != NULL_BLOCK)
                                .then(|| p.tokens_if_holds(b, group_key(g as u32, hash)))
                                .flatten()
                                .map(|t| t[..partial].to_vec())
                        })
                    })
                };
                h.block_hashes.truncate(num_hashed);
                match recovered {
                    Some(t) => h.pending_tokens = t,
                    None => seq.hashing = None,
                }
            }
            if let Some(k) = seq.hashing.as_mut().and_then(|h| h.keys.as_mut()) {
                k.truncate(num_tokens, bs);
            }
        }
        seq.num_computed = num_computed;
        seq.table.num_tokens = num_tokens;
        let num_groups = seq.groups.len() + 1;
        for g in 0..num_groups {
            let seq = self.seqs.at_mut(row);
            let table = seq.group_table_mut(g);
            let tail = table.split_off(keep_blocks.min(table.len()));
            let kept_partial = (num_tokens % bs != 0 && keep_blocks <= table.len())
                .then(|| table[keep_blocks - 1])
                .filter(|&b| b != NULL_BLOCK);
            if let Some(prefix) = self.prefix.as_mut() {
                for &b in tail.iter().rev().chain(kept_partial.iter()) {
                    if b != NULL_BLOCK && prefix.is_indexed(b) && self.pool.refcount(b) == Ok(1) {
                        prefix.unindex_in_use(b);
                    }
                }
            }
            self.release_table(&tail);
        }
        Ok(())
    }

    /// InvalidArgument when a window group released a position the window at `num_tokens`
    /// tokens reads (those K/V are gone), so truncating there is refused, changing nothing.
    fn check_window_truncate(&self, seq_id: SeqId, num_tokens: usize, keep: usize) -> Result<()> {
        let seq = &self.seqs[&seq_id];
        for (g, spec) in self.config.kv_groups.iter().enumerate() {
            // Positions the next query (at `num_tokens`) may read.
            let needed_from = spec.skipped_blocks(num_tokens, self.block_size);
            let table = seq.group_table(g);
            let end = keep.min(table.len());
            if table[needed_from.min(end)..end].contains(&NULL_BLOCK) {
                return invalid(format!(
                    "cannot truncate sequence {seq_id} to {num_tokens} tokens: kv_groups[{g}] \
                     released blocks its window at that length reads"
                ));
            }
        }
        Ok(())
    }
}
