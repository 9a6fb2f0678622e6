//! Per-chunk allocation (docs/design.md, Per-chunk allocation): `allocate_slots`, vLLM's
//! contract of blocks for the tokens scheduled this step, and `provide_token_ids`, token ids
//! that arrive after their slots (vLLM's async scheduling).

use rustc_hash::FxHashMap;

use super::config::SlotOptions;
use super::group_spec::{has_state_group, NULL_BLOCK};
use super::keys::BlockKeys;
use super::policy::{
    checkpoint_blocks, fresh_for_positions, grow_table, prefill_checkpoint, state_table_bound,
    validate_checkpoint,
};
use super::state::KvCacheManager;
use crate::error::{invalid, Error, Result};
use crate::prefix::hash::BlockHash;
use crate::{BlockId, SeqId, TokenId};

/// What one `allocate_slots` call takes, validated before anything changes.
struct SlotPlan {
    /// The caller's watermark `c`.
    computed: usize,
    /// Positions every group's table has after the call.
    positions: usize,
    /// Per group, the positions of the write `[c, c + new)` that hold a block another table
    /// shares (or that is indexed): each is replaced by a private copy first.
    copies: Vec<Vec<usize>>,
    /// Fresh blocks over every group: new positions and copies.
    fresh: usize,
    /// The declared tokens after the call: at least `c + new`; after a rollback (`c` below the
    /// manager's watermark) `max(c + new, known ids)`, the rejected positions no longer declared.
    num_tokens: usize,
    /// The state groups' prefill check-point position, when the chunk takes one.
    checkpoint: Option<usize>,
}

impl KvCacheManager {
    /// Allocates slots for the `num_new_tokens` tokens the caller schedules now, plus
    /// `num_lookahead_tokens` speculative slots (vLLM's `allocate_slots`; see
    /// [`Self::allocate_slots_with`]). `Ok(false)` is the refusal (vLLM's `None`, the signal
    /// to preempt): nothing changed but the window release.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;          // 2 blocks, 5 computed
    /// assert!(kv.allocate_slots(1, 1, 3)?);                 // one token and 3 lookahead slots
    /// assert_eq!((kv.num_computed_tokens(1)?, kv.num_slots(1)?), (6, 12));
    /// kv.add_sequence_len(2, 4)?;                           // takes the last block
    /// assert!(!kv.allocate_slots(1, 7, 0)?);                // 13 tokens need a 4th block
    /// assert_eq!(kv.num_computed_tokens(1)?, 6);            // refused: nothing changed
    /// assert!(kv.allocate_slots(1, 6, 0)?);                 // 12 fit the slots it holds
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn allocate_slots(
        &mut self,
        seq_id: SeqId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<bool> {
        let options = SlotOptions {
            num_lookahead_tokens,
            ..SlotOptions::default()
        };
        self.allocate_slots_with(seq_id, num_new_tokens, &options)
    }

    /// vLLM's per-chunk `allocate_slots` (docs/design.md, Per-chunk allocation):
    ///
    /// 1. `c` is `options.num_computed_tokens` (a scheduler that moves the watermark itself;
    ///    lower than the manager's after rejected drafts, never higher, never below the tokens
    ///    whose blocks are indexed, and never where a window released a position its window at
    ///    `c` reads: InvalidArgument), or the manager's watermark;
    /// 2. every window group releases what the processed watermark `max(0, c -
    ///    num_in_flight_tokens)` puts out of its window (this stands even when step 3 refuses);
    /// 3. every group's table grows to cover `min(c + num_new_tokens + num_lookahead_tokens,
    ///    max_model_len)` slots (never shrinks), a block of the write `[c, c + num_new_tokens)`
    ///    shared with another table is copied first; too few available blocks returns
    ///    `Ok(false)`, nothing else changed;
    /// 4. the watermark becomes `c + num_new_tokens`, and the declared tokens at least that;
    /// 5. every full block now computed and known is indexed (with its `BlockStored`).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig, SlotOptions};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// // A decode step with 2 draft tokens: 1 + 2 new tokens, the drafts' ids unknown.
    /// assert!(kv.allocate_slots(1, 3, 0)?);
    /// assert_eq!(kv.num_computed_tokens(1)?, 6);
    /// // One draft was rejected: the next step passes the lower watermark.
    /// let o = SlotOptions { num_computed_tokens: Some(5), ..Default::default() };
    /// assert!(kv.allocate_slots_with(1, 1, &o)?);
    /// assert_eq!(kv.num_computed_tokens(1)?, 6);
    /// kv.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn allocate_slots_with(
        &mut self,
        seq_id: SeqId,
        num_new_tokens: usize,
        options: &SlotOptions,
    ) -> Result<bool> {
        let plan = self.plan_slots(seq_id, num_new_tokens, options)?;
        let c = plan.computed;
        // 2. The window release at the processed watermark stands whatever follows.
        self.release_out_of_window(seq_id, c.saturating_sub(options.num_in_flight_tokens));
        // 3. All or nothing from here.
        if plan.fresh > self.num_available_blocks() {
            return Ok(false);
        }
        let mut blocks = Vec::with_capacity(plan.fresh);
        match self.allocate_fresh(plan.fresh, &mut blocks) {
            Ok(()) => {}
            // Another manager on a shared pool took blocks meanwhile: a refusal all the same.
            Err(Error::OutOfBlocks { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        // Commit (infallible from here).
        let mut supply = blocks.into_iter();
        let row = self.seqs.row(seq_id).expect("validated");
        let old_positions = self.seqs.at(row).num_positions();
        for (g, copies) in plan.copies.iter().enumerate() {
            for &at in copies {
                let dst = supply.next().expect("planned block");
                let src = std::mem::replace(&mut self.seqs.at_mut(row).group_table_mut(g)[at], dst);
                self.copy_on_write(src, dst);
                self.note_placed(seq_id, g, at..at + 1, true);
            }
            let spec = self.config.kv_groups[g];
            let table = self.seqs.at_mut(row).group_table_mut(g);
            grow_table(&spec, table, plan.positions, plan.checkpoint, &mut supply);
        }
        debug_assert!(supply.next().is_none());
        self.note_placed_all(
            seq_id,
            old_positions..plan.positions.max(old_positions),
            true,
        );
        // 4. The watermark, and the declared tokens.
        let seq = self.seqs.at_mut(row);
        seq.table.num_tokens = plan.num_tokens;
        seq.num_computed = c + num_new_tokens;
        // 5. What is now computed and known enters the index.
        self.index_ready_at(row);
        Ok(true)
    }

    /// The blocks a sequence with `positions` table positions holds at most over every group
    /// once the window groups have released what `processed` tokens put out of their windows
    /// (full attention: every position). The "can never fit" bound of a per-chunk allocation:
    /// counting every group at its table length would refuse a long context a hybrid pool
    /// holds (docs/design.md, Per-chunk allocation).
    pub(super) fn live_positions(&self, positions: usize, processed: usize) -> usize {
        let bs = self.block_size;
        self.config
            .kv_groups
            .iter()
            .map(|spec| {
                let live = positions - spec.skipped_blocks(processed, bs).min(positions);
                // A state group's new block at least (a lower bound: "never fits" only).
                spec.fresh_cap().map_or(live, |c| c.min(live))
            })
            .fold(0usize, usize::saturating_add)
    }

    /// Validates an `allocate_slots` call and counts what it takes (changes nothing).
    fn plan_slots(
        &self,
        seq_id: SeqId,
        num_new_tokens: usize,
        o: &SlotOptions,
    ) -> Result<SlotPlan> {
        let seq = self.resident(seq_id)?;
        let bs = self.block_size;
        let ng = self.num_groups();
        validate_checkpoint(o.prefill_checkpoint.as_ref())?;
        let ours = seq.num_computed;
        let c = o.num_computed_tokens.unwrap_or(ours);
        if has_state_group(&self.config.kv_groups) && (c < ours || o.num_lookahead_tokens > 0) {
            // A state block holds the state at one token: there is no earlier one to roll back
            // to, and a lookahead slot would put the chunk's state block past its last token.
            return invalid(format!(
                "sequence {seq_id}: a MambaState group takes no lookahead slots and no rollback                  of the computed watermark ({c} given, {ours} computed, {} lookahead)",
                o.num_lookahead_tokens
            ));
        }
        self.check_watermark(seq_id, c)?;
        let len = seq.num_positions();
        let end = c
            .checked_add(num_new_tokens)
            .filter(|&e| e <= self.config.max_model_len);
        let Some(end) = end else {
            return invalid(format!(
                "{c} + {num_new_tokens} tokens pass max_model_len={}",
                self.config.max_model_len
            ));
        };
        let target = end
            .saturating_add(o.num_lookahead_tokens)
            .min(self.config.max_model_len);
        let positions = target.div_ceil(bs).max(len);
        // Could it ever fit, with nothing else in the pool: a window group holds only the
        // positions its release at the processed watermark leaves, not its table's length.
        let live = self
            .live_positions(positions, c.saturating_sub(o.num_in_flight_tokens))
            .max(state_table_bound(&self.config.kv_groups, positions));
        if live > self.num_usable_blocks() {
            return invalid(format!(
                "{target} slots need {live} blocks over {ng} kv_groups, more than the pool's {}",
                self.num_usable_blocks()
            ));
        }
        // Blocks of the write [c, end) in existing positions that another table shares (or
        // that are indexed), and, when slots will follow the declared tokens, every block the
        // next appends write (docs/design.md, Invariants 4: a sequence holding slots past its
        // tokens never shares or indexes them).
        let num_tokens = if c < ours {
            end.max(seq.hashing.as_ref().map_or(0, |h| h.num_known(bs)))
        } else {
            seq.table.num_tokens.max(end)
        };
        // With slots past its tokens, every block from the one holding its last token on is
        // written by later appends that check only the last block: they must be private.
        let tail = if num_tokens.div_ceil(bs) < positions {
            num_tokens / bs..len
        } else {
            0..0
        };
        let mut cow_releases: FxHashMap<BlockId, u32> = FxHashMap::default();
        let copies: Vec<Vec<usize>> = (0..ng)
            .map(|g| {
                let table = seq.group_table(g);
                let written = if num_new_tokens == 0 {
                    0..0
                } else {
                    c / bs..end.div_ceil(bs).min(len)
                };
                let w = written.clone();
                let extra = tail.clone().filter(move |i| !w.contains(i));
                written
                    .chain(extra)
                    .filter(|&i| {
                        let b = table[i];
                        b != NULL_BLOCK && self.copy_needed(b, &mut cow_releases)
                    })
                    .collect()
            })
            .collect();
        let checkpoint = o
            .prefill_checkpoint
            .and_then(|p| prefill_checkpoint(&p, bs, c, end));
        let fresh = fresh_for_positions(&self.config.kv_groups, len, positions)
            + checkpoint_blocks(&self.config.kv_groups, checkpoint, len, positions)
            + copies.iter().map(Vec::len).sum::<usize>();
        Ok(SlotPlan {
            computed: c,
            positions,
            copies,
            fresh,
            num_tokens,
            checkpoint,
        })
    }

    /// Checks a caller's watermark `c` for sequence `seq_id` (resident): never past the
    /// manager's, never below the tokens whose blocks are indexed, and never where a window
    /// released a position its window at `c` reads (InvalidArgument).
    fn check_watermark(&self, seq_id: SeqId, c: usize) -> Result<()> {
        let seq = &self.seqs[&seq_id];
        let bs = self.block_size;
        let ours = seq.num_computed;
        if c > ours {
            return invalid(format!(
                "num_computed_tokens={c} is past sequence {seq_id}'s {ours} computed tokens"
            ));
        }
        if c == ours {
            return Ok(());
        }
        // The blocks its hashing state covers, and any indexed block of its tables (a fork
        // shares blocks its parent indexes later).
        let hashed = seq
            .hashing
            .as_ref()
            .map_or(0, |h| h.block_hashes.len() * bs);
        let indexed = hashed.max(self.indexed_prefix(seq_id));
        if c < indexed {
            return invalid(format!(
                "num_computed_tokens={c} rolls sequence {seq_id} back into its {indexed} tokens \
                 whose blocks are in the prefix index"
            ));
        }
        let len = seq.num_positions();
        for (g, spec) in self.config.kv_groups.iter().enumerate() {
            let from = spec.skipped_blocks(c, bs).min(len);
            if seq.group_table(g)[from..].contains(&NULL_BLOCK) {
                return invalid(format!(
                    "num_computed_tokens={c} rolls sequence {seq_id} back past what \
                     kv_groups[{g}] released"
                ));
            }
        }
        Ok(())
    }

    /// Tokens of sequence `seq_id` below the first block past them that is indexed (every
    /// group): how far its watermark may roll back, whatever its hashing state says.
    fn indexed_prefix(&self, seq_id: SeqId) -> usize {
        let (Some(p), seq) = (self.prefix.as_ref(), &self.seqs[&seq_id]) else {
            return 0;
        };
        let mut end = 0;
        for g in 0..self.num_groups() {
            for (i, &b) in seq.group_table(g).iter().enumerate() {
                if b != NULL_BLOCK && p.is_indexed(b) {
                    end = end.max((i + 1) * self.block_size);
                }
            }
        }
        end.min(seq.num_computed)
    }

    /// Records the ids of the tokens after the known ones (vLLM's async scheduling: slots
    /// were allocated before the ids were sampled), with, optionally, the caller's block keys
    /// and hashes continuing those it gave (docs/design.md, Per-chunk allocation). Blocks then
    /// full, computed and known enter the prefix index (with their events) now. New ids must
    /// lie within the allocated slots (InvalidArgument past them, nothing changed); the
    /// declared tokens grow to cover them. Without prefix caching, or once unknown tokens
    /// ended the sequence's hashing, the ids are not kept and nothing is checked.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, KvCacheManager, ManagerConfig, Prompt};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// assert!(kv.allocate_slots(1, 1, 0)?);                  // token 4's id is not known yet
    /// assert_eq!(kv.match_prefix(&[1, 2, 3, 4, 5], None)?, 2);
    /// kv.provide_token_ids(1, &[4], None, None, None)?;      // now it is: block 1 is indexed
    /// assert_eq!(kv.match_prefix(&[1, 2, 3, 4, 5], None)?, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn provide_token_ids(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        num_computed_tokens: Option<usize>,
        block_extra_keys: Option<&[Option<&[u8]>]>,
        block_hashes: Option<&[BlockHash]>,
    ) -> Result<()> {
        if block_hashes.is_some() {
            if let Some(prefix) = self.prefix.as_mut() {
                prefix.expect_caller_names();
            }
        }
        let bs = self.block_size;
        let seq = self.resident(seq_id)?;
        let ours = seq.num_computed;
        let c = num_computed_tokens.unwrap_or(ours);
        self.check_watermark(seq_id, c)?;
        let seq = &self.seqs[&seq_id];
        let slots = seq.num_positions() * bs;
        let Some(known) = seq.hashing.as_ref().map(|h| h.num_known(bs)) else {
            // Nothing is indexed for this sequence: the ids are not kept.
            self.seqs.get_mut(&seq_id).expect("validated").num_computed = c;
            return Ok(());
        };
        // No new ids: nothing to fit in the slots (a per-chunk admission knows its whole
        // prompt's ids, more than its slots, and may give held-back hashes later).
        let new_known = if token_ids.is_empty() {
            Some(known)
        } else {
            known.checked_add(token_ids.len()).filter(|&k| k <= slots)
        };
        let Some(new_known) = new_known else {
            return invalid(format!(
                "sequence {seq_id}: {} more token ids after {known} known pass its {slots} slots",
                token_ids.len()
            ));
        };
        let block_hashes = block_hashes.filter(|h| !h.is_empty());
        let block_extra_keys = block_extra_keys.filter(|k| k.iter().any(Option::is_some));
        if let Some(h) = &seq.hashing {
            let caller = h.keys.as_ref().and_then(|k| k.hashes.as_ref());
            // Block keys continue after those given so far; a block already hashed keeps its.
            let first_key = h.keys.as_ref().map_or(0, |k| k.own.len());
            let late = block_extra_keys
                .and_then(|k| k.iter().position(Option::is_some))
                .is_some_and(|i| first_key + i < h.block_hashes.len());
            if late {
                return invalid(format!(
                    "sequence {seq_id}: block_extra_keys (from block {first_key}) name a block \
                     already hashed ({} are)",
                    h.block_hashes.len()
                ));
            }
            if block_hashes.is_some() && caller.is_none() {
                return invalid(
                    "block_hashes for a sequence whose blocks pagedkv hashes itself (none at admission)",
                );
            }
            let given = caller.map_or(0, Vec::len) + block_hashes.map_or(0, <[_]>::len);
            if caller.is_some() && given > new_known / bs {
                return invalid(format!(
                    "sequence {seq_id}: {given} block hashes for {} full blocks of known tokens",
                    new_known / bs
                ));
            }
        }
        // Commit (infallible from here).
        let row = self.seqs.row(seq_id).expect("validated");
        let seq = self.seqs.at_mut(row);
        // The rolled-back positions (rejected drafts) are no longer computed; they stay
        // declared until the next `allocate_slots` (which copies what its appends would write).
        seq.num_computed = c;
        seq.table.num_tokens = seq.table.num_tokens.max(new_known);
        let Some(h) = seq.hashing.as_mut() else {
            return Ok(());
        };
        h.pending_tokens.extend_from_slice(token_ids);
        if block_extra_keys.is_some() || block_hashes.is_some() {
            let seq_key = h.extra_key.clone();
            h.keys
                .get_or_insert_with(|| Box::new(BlockKeys::default()))
                .extend(seq_key.as_deref(), block_extra_keys, block_hashes);
        }
        self.index_ready_at(row);
        Ok(())
    }

    /// The sequence's capacity in token slots: its table length times the block size
    /// (docs/design.md, Per-chunk allocation, "Sequence counters").
    pub fn num_slots(&self, seq_id: SeqId) -> Result<usize> {
        self.seqs
            .get(&seq_id)
            .map(|s| s.num_positions() * self.block_size)
            .ok_or(Error::UnknownSequence(seq_id))
    }
}
