//! Admission: `add_sequence` / `add_sequence_len`, with and without prefix caching.

use std::ops::Range;
use std::sync::Arc;

use super::config::{AdmitOptions, Prompt};
use super::keys::{given_prompt_hashes, BlockKeys, PromptHashes};
use super::state::{GroupTables, KvCacheManager, SeqHashing, Sequence};
use crate::error::{invalid, Error, Result};
use crate::pool::BlockPool;
use crate::prefix::events::{block_stored, KvEvent};
use crate::prefix::hash::{BlockHash, ChainHasher};
use crate::prefix::PrefixCache;
use crate::table::BlockTable;
use crate::{BlockId, SeqId, TokenId};

impl KvCacheManager {
    /// Admits a sequence with prompt `token_ids`. Returns the number of prompt tokens served
    /// from the prefix cache (0 without prefix caching): the longest chain of cached full
    /// blocks, never the whole prompt (its last token is always left to compute). `extra_key`
    /// (cache salt, adapter id, multimodal hash) isolates prefix-cache namespaces.
    ///
    /// ```
    /// use pagedkv::{Error, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// assert_eq!(kv.add_sequence(7, &[1, 2, 3, 4, 5], None)?, 0);
    /// assert_eq!(kv.num_tokens(7)?, 5);
    /// assert_eq!(kv.add_sequence(7, &[1], None), Err(Error::SequenceExists(7)));
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        self.add_sequence_scheduled(seq_id, token_ids, extra_key, usize::MAX)
    }

    /// [`Self::add_sequence`] for chunked prefill: of the prompt's tokens the cache does not
    /// serve, the caller computes only the first `num_scheduled` in its next pass (a budget:
    /// more than there are schedules them all). The sequence's computed watermark
    /// ([`Self::num_computed_tokens`]) is the hit plus those; its later blocks enter the prefix
    /// index only as [`Self::advance_computed`] covers them, so no admission ever hits a block
    /// whose K/V are not written yet. `add_sequence` is this with every token scheduled.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// let prompt = [1, 2, 3, 4, 5, 6, 7];
    /// assert_eq!(kv.add_sequence_scheduled(1, &prompt, None, 3)?, 0);   // chunk 1: 3 tokens
    /// assert_eq!(kv.num_computed_tokens(1)?, 3);
    /// assert_eq!(kv.match_prefix(&prompt, None)?, 2);     // only block 0 is computed
    /// kv.advance_computed(&[1], 4)?;                      // chunk 2: the rest
    /// assert_eq!(kv.match_prefix(&prompt, None)?, 6);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence_scheduled(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
        num_scheduled: usize,
    ) -> Result<usize> {
        if !self.tuned {
            let options = AdmitOptions {
                extra_key,
                num_scheduled,
                ..AdmitOptions::default()
            };
            return self.admit_groups(seq_id, Prompt::Tokens(token_ids), &options);
        }
        if self.prefix.is_some() {
            self.admit_cached::<false>(seq_id, token_ids, extra_key, num_scheduled, &[])
        } else {
            self.admit(seq_id, token_ids.len(), num_scheduled)
        }
    }

    /// The hit [`Self::add_sequence`] would return for this prompt now, with no side effect:
    /// no stats, no eviction-order change, no events, no block taken. (When the admission
    /// itself would fail, e.g. for want of blocks, this is the hit it would have had.) Walks
    /// the same chain of cached blocks as admission, read-only. 0 without prefix caching.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3, 4, 5], None)?;
    /// let before = kv.stats();
    /// assert_eq!(kv.match_prefix(&[1, 2, 3, 4, 9], None)?, 4);
    /// assert_eq!(kv.match_prefix(&[1, 2, 3, 4], None)?, 2);   // the last token is computed
    /// assert_eq!(kv.stats(), before);
    /// assert_eq!(kv.add_sequence(2, &[1, 2, 3, 4, 9], None)?, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn match_prefix(&self, token_ids: &[TokenId], extra_key: Option<&[u8]>) -> Result<usize> {
        if !self.plain {
            let options = AdmitOptions {
                extra_key,
                ..AdmitOptions::default()
            };
            return self.match_prefix_with(token_ids, &options);
        }
        let Some(prefix) = self.prefix.as_ref() else {
            return Ok(0);
        };
        let bs = self.block_size;
        let max_hits = token_ids.len().saturating_sub(1) / bs;
        let mut block_hashes = Vec::with_capacity(max_hits + 1);
        let mut block_ids = Vec::with_capacity(max_hits);
        let mut chain = prefix.hasher.chain(bs, extra_key);
        let walk = HitWalk {
            prefix,
            pool: &self.pool,
            block_size: bs,
            token_ids,
            extra_key,
            max_blocks: max_hits,
            given: &[],
        };
        walk.run::<false>(&mut chain, &mut block_hashes, &mut block_ids)?;
        let num_device = block_ids.len();
        let mut host_hits = Vec::new();
        self.host_hits(
            &walk,
            &mut chain,
            &mut block_hashes,
            num_device,
            &mut host_hits,
        );
        Ok((num_device + host_hits.len()) * bs)
    }

    /// Admits a sequence of `num_tokens` tokens whose ids are unknown (never prefix-cached).
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 4, block_size: 4, ..Default::default() })?;
    /// kv.add_sequence_len(1, 9)?;
    /// assert_eq!(kv.block_table(1)?.len(), 3);
    /// assert!(kv.add_sequence_len(2, usize::MAX).is_err());   // InvalidArgument, not a panic
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence_len(&mut self, seq_id: SeqId, num_tokens: usize) -> Result<usize> {
        if !self.tuned {
            return self.admit_groups(seq_id, Prompt::Len(num_tokens), &AdmitOptions::default());
        }
        self.admit(seq_id, num_tokens, usize::MAX)
    }

    /// [`Self::add_sequence_len`] with only the first `num_scheduled` tokens computed in the
    /// caller's next pass (see [`Self::add_sequence_scheduled`]).
    pub fn add_sequence_len_scheduled(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        num_scheduled: usize,
    ) -> Result<usize> {
        if !self.tuned {
            let options = AdmitOptions {
                num_scheduled,
                ..AdmitOptions::default()
            };
            return self.admit_groups(seq_id, Prompt::Len(num_tokens), &options);
        }
        self.admit(seq_id, num_tokens, num_scheduled)
    }

    /// [`Self::match_prefix`] of a prompt with caller-supplied per-block keys or hashes
    /// (`extra_key`, `block_extra_keys`, `block_hashes`, `prompt_hashes` of `options`; the rest
    /// is ignored): the
    /// hit [`Self::add_sequence_with`] would take now, with no side effect.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// let hashes = [11, 12];
    /// let o = AdmitOptions { block_hashes: Some(&hashes), ..Default::default() };
    /// kv.add_sequence_with(1, pagedkv::Prompt::Tokens(&[1, 2, 3, 4, 5]), &o)?;
    /// assert_eq!(kv.match_prefix_with(&[1, 2, 3, 4, 9], &o)?, 4);
    /// assert_eq!(kv.match_prefix(&[1, 2, 3, 4, 9], None)?, 0);   // pagedkv's own hashes differ
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn match_prefix_with(
        &self,
        token_ids: &[TokenId],
        options: &AdmitOptions<'_>,
    ) -> Result<usize> {
        let Some(prefix) = self.prefix.as_ref() else {
            return Ok(0);
        };
        let bs = self.block_size;
        let keys = BlockKeys::from_admission(
            options.extra_key,
            options.block_extra_keys,
            options.block_hashes,
            token_ids.len(),
            true,
            bs,
        )?;
        let seq_key: Option<Arc<[u8]>> = options.extra_key.map(Arc::from);
        let given = given_prompt_hashes(options, token_ids.len(), true, bs)?;
        let mut hashes = PromptHashes::new(prefix.hasher, bs, token_ids, &seq_key, keys.as_deref())
            .with_given(given);
        let hit = self.find_group_hit(&mut hashes, token_ids.len().saturating_sub(1) / bs);
        Ok(hit.num_blocks * bs)
    }

    /// Admission without token ids or without prefix caching: fresh blocks only.
    pub(super) fn admit(
        &mut self,
        seq_id: SeqId,
        num_tokens: usize,
        num_scheduled: usize,
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        let num_blocks = self.blocks_fitting_pool(num_tokens)?;
        let mut block_ids = Vec::with_capacity(num_blocks);
        self.allocate_fresh(num_blocks, &mut block_ids)?;
        let table = BlockTable {
            block_ids,
            num_tokens,
        };
        self.seqs.insert(
            seq_id,
            Sequence {
                table,
                groups: GroupTables::default(),
                swapped: false,
                per_chunk: false,
                hashing: None,
                num_computed: num_scheduled.min(num_tokens),
            },
        );
        self.note_placed(seq_id, 0, 0..num_blocks, true);
        Ok(0)
    }

    /// Admission with prefix caching: reuse the longest verified chain of cached blocks,
    /// allocate the rest, index the new full blocks. Nothing changes unless all of it succeeds.
    ///
    /// `GIVEN`: whether `given` may hold hashes (`AdmitOptions::prompt_hashes`); the plain admission
    /// is compiled without the look-ups into it (callgrind_gate.sh).
    pub(super) fn admit_cached<const GIVEN: bool>(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
        num_scheduled: usize,
        given: &[BlockHash],
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        let num_tokens = token_ids.len();
        let total_blocks = self.blocks_fitting_pool(num_tokens)?;
        let bs = self.block_size;
        let num_full = num_tokens / bs;
        let max_hits = num_tokens.saturating_sub(1) / bs; // never the whole prompt
        let prefix = self.prefix.as_ref().expect("prefix caching on");

        // 1. Collect the verified hit chain (no mutation yet). A block whose parent is a hit is
        // first looked for through the parent block's child hint, which needs no hashing (on a
        // shared system prompt, all but the first block); otherwise it is hashed and looked up.
        // The hits go straight into the table (`block_ids[..num_hits]`): no separate list.
        let mut block_hashes = Vec::with_capacity(num_full);
        let mut block_ids: Vec<BlockId> = Vec::with_capacity(total_blocks);
        let mut chain = prefix.hasher.chain(bs, extra_key);
        let walk = HitWalk {
            prefix,
            pool: &self.pool,
            block_size: bs,
            token_ids,
            extra_key,
            max_blocks: max_hits,
            given,
        };
        let num_revive = walk.run::<GIVEN>(&mut chain, &mut block_hashes, &mut block_ids)?;
        let num_hits = block_ids.len();
        // Hits in the offload tier continue the device chain: fresh blocks loaded from the
        // host (`take_load_ops`), computed as soon as the caller has run the loads.
        let mut host_hits = Vec::new();
        self.host_hits(
            &walk,
            &mut chain,
            &mut block_hashes,
            num_hits,
            &mut host_hits,
        );
        let num_served = num_hits + host_hits.len();
        // Of the new blocks, only those the caller computes in its next pass are indexed now
        // (the computed watermark); `advance_computed` indexes the rest.
        let num_computed = num_served * bs + num_scheduled.min(num_tokens - num_served * bs);
        let num_indexed = num_computed / bs;
        // Only the first new block can need a map entry: each later one is chained to the
        // block before it (prefix/index.rs, "Chained blocks"). Its hash is known when a lookup
        // missed it; the other new blocks are hashed as they are entered (step 3).
        if num_indexed > num_hits {
            prefix.prefetch_register_slots(block_hashes.get(num_hits..num_hits + 1).unwrap_or(&[]));
        }

        // 2. Reserve the new blocks; the cached hits are pinned so no eviction can take them.
        let fresh = self.reserve_fresh(total_blocks - num_hits, num_revive, &mut block_ids)?;

        // 3. Commit (infallible from here): hits first, then evictions for the new blocks.
        // `revive_cached` and `share` on borrowed fields, with the revivals counted once: the
        // loop then keeps what it reads in registers (callgrind, `prefix_hit_admit`).
        let prefix = self
            .prefix
            .as_mut()
            .expect("admit_cached has a prefix cache");
        let pool = &*self.pool;
        let mut revived = 0;
        for &b in &block_ids[..num_hits] {
            if prefix.is_cached(b) {
                prefix.revive_cached(b, pool);
                revived += 1;
            } else {
                // Cannot fail: `b` is in use and its refcount was checked above.
                let shared = pool.retain_id(b);
                debug_assert!(shared.is_ok(), "share of a hit block failed: {shared:?}");
            }
        }
        self.num_blocks_in_use += revived;
        // Host hits are pinned before the eviction below offloads into the tier, so that no
        // offload reuses a host block this admission loads from.
        self.pin_host_hits(&host_hits);
        self.complete_fresh(fresh, &mut block_ids);
        self.record_loads(&host_hits, &block_ids[num_hits..num_served]);
        let prefix = self.prefix.as_mut().expect("prefix caching on");
        prefix.query_tokens += num_tokens as u64;
        prefix.hit_tokens += (num_served * bs) as u64;

        let extra: Option<Arc<[u8]>> = extra_key.map(Arc::from);
        prefix.prefetch_register_records(&block_ids[num_hits..num_indexed]);
        // The blocks after one the index takes as new content are chained to it, in one run
        // (prefix/index.rs, "Chained blocks"), which stops only before a block whose content
        // an orphan may hold; every other block is entered one at a time (one copy per
        // content: a block whose content is indexed already replaces a cached copy or stays
        // private). Each new block is hashed here, as it is entered, unless the lookup above
        // hashed it. One `BlockStored` per run of consecutive blocks entered as new content,
        // built from the run's slices at its end; with events off, registering is the index
        // alone.
        let events_on = prefix.events.enabled();
        let mut run_start = num_hits;
        let mut i = num_hits;
        while i < num_indexed {
            let parent = i.checked_sub(1).map(|p| block_hashes[p]);
            let chunk = &token_ids[i * bs..(i + 1) * bs];
            if block_hashes.len() == i {
                let h = if GIVEN { given.get(i).copied() } else { None };
                block_hashes.push(h.unwrap_or_else(|| chain.hash(parent, chunk)));
            }
            let entered = prefix.register(
                block_ids[i],
                block_hashes[i],
                parent,
                i.checked_sub(1).map(|p| block_ids[p]),
                &block_hashes[..i],
                chunk,
                &extra,
                &self.pool,
            );
            if entered.is_new() {
                // Host hits hashed the blocks after this one already: the run rehashes them.
                block_hashes.truncate(i + 1);
                let chained = prefix.register_chained_run::<GIVEN>(
                    &block_ids[i..num_indexed],
                    &mut chain,
                    &mut block_hashes,
                    &token_ids[(i + 1) * bs..num_indexed * bs],
                    given.get(i + 1..).unwrap_or(&[]),
                    &extra,
                );
                i += 1 + chained;
                continue;
            }
            if events_on && run_start < i {
                let event = stored_run(&block_hashes, run_start..i, token_ids, bs, extra_key);
                prefix.events.push(event);
            }
            run_start = i + 1;
            i += 1;
        }
        // Blocks entered under the caller's hashes (`AdmitOptions::prompt_hashes`) are marked as such,
        // so that `check_invariants` does not recompute them: a wrong hash misnames a block,
        // it never serves wrong content (every hit compares token ids).
        if GIVEN && !given.is_empty() {
            for &b in &block_ids[num_hits..num_indexed.min(given.len()).max(num_hits)] {
                if prefix.is_indexed(b) {
                    prefix.set_origin(b, 0, true);
                }
            }
        }
        // A lookup that missed hashed the first new block, which may lie past the watermark.
        block_hashes.truncate(num_indexed);
        debug_assert_eq!(block_hashes.len(), num_indexed);
        if events_on && run_start < num_indexed {
            let event = stored_run(
                &block_hashes,
                run_start..num_indexed,
                token_ids,
                bs,
                extra_key,
            );
            prefix.events.push(event);
        }

        let hashing = SeqHashing {
            extra_key: extra,
            block_hashes,
            pending_tokens: token_ids[num_indexed * bs..].to_vec(),
            // The given hashes of blocks the later chunks index (`index_computed`).
            keys: (GIVEN && given.len() > num_indexed).then(|| BlockKeys::given(given)),
        };
        let table = BlockTable {
            block_ids,
            num_tokens,
        };
        self.seqs.insert(
            seq_id,
            Sequence {
                table,
                groups: GroupTables::default(),
                swapped: false,
                per_chunk: false,
                hashing: Some(hashing),
                num_computed,
            },
        );
        if self.new_blocks.is_some() {
            self.note_placed(seq_id, 0, 0..num_served, false);
            self.note_placed(seq_id, 0, num_served..total_blocks, true);
        }
        if !host_hits.is_empty() {
            self.bound_pending_loads();
        }
        Ok(num_served * bs)
    }
}

/// The read-only walk of a prompt's hit chain, shared by admission, `match_prefix` and
/// `pin_prefix` so that all three see the same hit.
pub(super) struct HitWalk<'a> {
    pub(super) prefix: &'a PrefixCache,
    pub(super) pool: &'a BlockPool,
    pub(super) block_size: usize,
    pub(super) token_ids: &'a [TokenId],
    pub(super) extra_key: Option<&'a [u8]>,
    /// Blocks the hit may cover at most.
    pub(super) max_blocks: usize,
    /// The caller's chained hashes of the prompt's first full blocks (`prefix_block_hashes`,
    /// computed earlier), used instead of hashing those blocks again; empty: hash them all.
    pub(super) given: &'a [BlockHash],
}

impl HitWalk<'_> {
    /// Collects the verified hit chain (no mutation) into `block_ids`, and the hashes of its
    /// blocks into `block_hashes` (plus the hash of the block a lookup missed, which starts
    /// the rest). A block whose parent is a hit is first looked for through the parent
    /// block's child hint, which needs no hashing (on a shared system prompt, all but the
    /// first block); otherwise it is hashed and looked up. Returns how many hits are
    /// cached-evictable (refcount 0); InvalidArgument when an in-use hit's refcount would
    /// overflow.
    ///
    /// One out-of-line copy for all three callers: inlined into each, the hint and hash
    /// look-ups inside were inlined differently in admission depending on the other callers
    /// (callgrind: benches/results/2026-12-03-scheduler-contract.md).
    ///
    /// `GIVEN`: whether `given` may hold hashes (`AdmitOptions::prompt_hashes`). The plain walks are
    /// compiled without it: the slice kept live across the loop cost `prefix_match` about four
    /// instructions a block in spills around the token comparison (scripts/callgrind_gate.sh;
    /// benches/results/2026-12-06-prefix-match-callgrind.md).
    #[inline(never)]
    pub(super) fn run<const GIVEN: bool>(
        &self,
        chain: &mut ChainHasher,
        block_hashes: &mut Vec<BlockHash>,
        block_ids: &mut Vec<BlockId>,
    ) -> Result<usize> {
        debug_assert!(
            block_hashes.is_empty(),
            "the walk starts at the prompt's first block"
        );
        debug_assert!(
            GIVEN || self.given.is_empty(),
            "a plain walk was given hashes"
        );
        let (prefix, extra_key) = (self.prefix, self.extra_key);
        let given: &[BlockHash] = if GIVEN { self.given } else { &[] };
        let mut num_revive = 0usize;
        for chunk in self
            .token_ids
            .chunks_exact(self.block_size)
            .take(self.max_blocks)
        {
            let parent = block_hashes.last().copied();
            let hinted = match (block_ids.last(), parent) {
                (Some(&pb), Some(ph)) => prefix.lookup_child(pb, ph, chunk, extra_key),
                _ => None,
            };
            let (b, h) = match hinted {
                Some(found) => found,
                None => {
                    // Every block before this one pushed its hash: this is block `len`.
                    let h = match given.get(block_hashes.len()) {
                        Some(&h) => h,
                        None => chain.hash(parent, chunk),
                    };
                    let Some(b) = prefix.lookup(h, parent, chunk, extra_key) else {
                        block_hashes.push(h); // the missed block's hash starts the rest
                        break;
                    };
                    (b, h)
                }
            };
            if prefix.is_cached(b) {
                num_revive += 1;
            } else if self.pool.refcount(b)? == u32::MAX {
                return invalid(format!("block {b} refcount would overflow"));
            }
            block_ids.push(b);
            block_hashes.push(h);
        }
        Ok(num_revive)
    }
}

/// The `BlockStored` event of the prompt's blocks `run` (`block_hashes` are the prompt's, from
/// its first block).
fn stored_run(
    block_hashes: &[BlockHash],
    run: Range<usize>,
    token_ids: &[TokenId],
    block_size: usize,
    extra_key: Option<&[u8]>,
) -> KvEvent {
    block_stored(
        &block_hashes[run.clone()],
        run.start.checked_sub(1).map(|p| block_hashes[p]),
        &token_ids[run.start * block_size..run.end * block_size],
        block_size,
        extra_key,
    )
}
