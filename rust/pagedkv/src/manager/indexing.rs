//! The plain path's indexing: every block of a sequence that is full, computed and known
//! (its token ids, and its hash when the caller supplies hashes) enters the prefix index, in
//! every group that caches blocks (docs/design.md, KV groups and Per-chunk allocation).
//!
//! The single full-attention group's tuned paths do the same for sequences without
//! caller-supplied keys (`admission.rs`, `computed.rs`, `prefix.rs`); this one serves every
//! group list, caller keys and hashes, ids given later and `allocate_slots`.

use std::ops::Range;
use std::sync::Arc;

use super::group_spec::KvGroupSpec;
use super::group_spec::NULL_BLOCK;
use super::keys::{effective_key, BlockKeys};
use super::state::{GroupTables, KvCacheManager, SeqHashing, Sequence};
use crate::pool::BlockPool;
use crate::prefix::events::{block_stored, KvEvent};
use crate::prefix::hash::{group_key, BlockHash};
use crate::prefix::index::Entered;
use crate::prefix::PrefixCache;
use crate::table::BlockTable;
use crate::{BlockId, SeqId};

/// Group `g`'s table from a sequence's fields (group 0 inline, the others beside it).
#[inline]
pub(super) fn group_slice<'a>(
    table: &'a BlockTable,
    groups: &'a GroupTables,
    g: usize,
) -> &'a [BlockId] {
    match g {
        0 => &table.block_ids,
        _ => &groups[g - 1],
    }
}

impl KvCacheManager {
    /// Indexes every block of resident sequence `seq_id` that has become full, computed and
    /// known since the last call (see the module docs), with one `BlockStored` per run of
    /// consecutive blocks a group entered under one extra key. Nothing without prefix caching
    /// or hashing state.
    pub(super) fn index_ready(&mut self, seq_id: SeqId) {
        if let Some(row) = self.seqs.row(seq_id) {
            self.index_ready_at(row);
        }
    }

    /// [`Self::index_ready`] of the sequence in row `row` of `seqs`.
    pub(super) fn index_ready_at(&mut self, row: usize) {
        if let Some(prefix) = self.prefix.as_mut() {
            let seq = self.seqs.at_mut(row);
            index_ready_in(
                prefix,
                &self.pool,
                seq,
                &self.config.kv_groups,
                self.block_size,
            );
        }
    }
}

/// [`KvCacheManager::index_ready`] of `seq`, a sequence of a manager with groups `specs`.
pub(super) fn index_ready_in(
    prefix: &mut PrefixCache,
    pool: &BlockPool,
    seq: &mut Sequence,
    specs: &[KvGroupSpec],
    bs: usize,
) {
    {
        let (table, groups, num_computed) = (&seq.table, &seq.groups, seq.num_computed);
        let Some(h) = seq.hashing.as_mut() else {
            return;
        };
        let start = h.block_hashes.len();
        let mut end = num_computed.min(h.num_known(bs)) / bs;
        let caller = h.keys.as_ref().and_then(|k| k.hashes.as_ref()).is_some();
        if let Some(caller_hashes) = h.keys.as_ref().and_then(|k| k.hashes.as_ref()) {
            end = end.min(caller_hashes.len());
        }
        if end <= start {
            return;
        }
        hash_blocks(prefix, h, start..end, bs);
        for (g, spec) in specs.iter().enumerate() {
            if spec.caches_blocks(bs) {
                let table = group_slice(table, groups, g);
                enter_group(prefix, pool, h, table, g as u32, start..end, bs, caller);
                if spec.is_state() {
                    // Cached in this step, whichever block the index keeps for the content.
                    for i in (start..end).filter(|&i| table[i] != NULL_BLOCK) {
                        let key = group_key(g as u32, h.block_hashes[i]);
                        prefix.states_this_step.note(key);
                    }
                }
            }
        }
        h.pending_tokens.drain(..(end - start) * bs);
        h.release_used_given();
    }
}

/// Appends the content hashes of blocks `range` (the next ones after `h.block_hashes`) to
/// `h.block_hashes`: the caller's, pagedkv's own given at admission, or chained over `h.pending_tokens` with each block's
/// effective key.
fn hash_blocks(prefix: &PrefixCache, h: &mut SeqHashing, range: Range<usize>, bs: usize) {
    debug_assert_eq!(range.start, h.block_hashes.len());
    let start = range.start;
    for i in range {
        let hash = match (
            h.keys.as_ref().and_then(|k| k.hashes.as_ref()),
            h.given_hash(i),
        ) {
            (Some(caller), _) => caller[i],
            (None, Some(given)) => given,
            (None, None) => {
                let key = effective_key(&h.extra_key, h.keys.as_deref(), i);
                prefix.hasher.hash_block(
                    h.block_hashes.last().copied(),
                    &h.pending_tokens[(i - start) * bs..(i - start + 1) * bs],
                    key.as_deref(),
                )
            }
        };
        h.block_hashes.push(hash);
    }
}

/// Enters group `group`'s blocks `range` of one sequence (hashed by now), each under its
/// group key with its parent's group key (one copy per content and group: a block whose
/// content a block in use holds stays private, one whose content a cached block holds takes
/// its place); one `BlockStored` per run the group entered as new content under one
/// effective key.
#[allow(clippy::too_many_arguments)]
fn enter_group(
    prefix: &mut PrefixCache,
    pool: &BlockPool,
    h: &SeqHashing,
    table: &[BlockId],
    group: u32,
    range: Range<usize>,
    bs: usize,
    caller: bool,
) {
    let start = range.start;
    let keys: Option<&BlockKeys> = h.keys.as_deref();
    let mut run: Option<usize> = None;
    let flush = |prefix: &mut PrefixCache, run: Range<usize>| {
        if !prefix.events.enabled() || run.is_empty() {
            return;
        }
        let key = effective_key(&h.extra_key, keys, run.start);
        let mut event = block_stored(
            &h.block_hashes[run.clone()],
            run.start.checked_sub(1).map(|p| h.block_hashes[p]),
            &h.pending_tokens[(run.start - start) * bs..(run.end - start) * bs],
            bs,
            key.as_deref(),
        );
        if let KvEvent::BlockStored { group_idx, .. } = &mut event {
            *group_idx = prefix.event_group(group);
        }
        prefix.events.push(event);
    };
    for i in range.clone() {
        let b = table[i];
        let key: &Option<Arc<[u8]>> = effective_key(&h.extra_key, keys, i);
        let entered = b != NULL_BLOCK && {
            let parent: Option<BlockHash> = i
                .checked_sub(1)
                .map(|p| group_key(group, h.block_hashes[p]));
            let parent_block = i
                .checked_sub(1)
                .map(|p| table[p])
                .filter(|&p| p != NULL_BLOCK);
            // The chain of keys before block i, read by the index only when the table's
            // previous block is not the indexed holder of the parent content.
            let (keyed, chain_keys): ([BlockHash; 1], Vec<BlockHash>);
            let chain: &[BlockHash] = match (group, parent, parent_block) {
                (0, _, _) => &h.block_hashes[..i],
                (_, Some(ph), Some(pb)) if prefix.holds(pb, ph) => {
                    keyed = [ph];
                    &keyed
                }
                _ => {
                    chain_keys = h.block_hashes[..i]
                        .iter()
                        .map(|&x| group_key(group, x))
                        .collect();
                    &chain_keys
                }
            };
            let tokens = &h.pending_tokens[(i - start) * bs..(i - start + 1) * bs];
            let entered = prefix.register(
                b,
                group_key(group, h.block_hashes[i]),
                parent,
                parent_block,
                chain,
                tokens,
                key,
                pool,
            );
            // Blocks named by pagedkv's own hashes given at admission are marked as the
            // caller's too: `check_invariants` does not recompute them.
            let caller = caller || i < h.num_given();
            if matches!(entered, Entered::New | Entered::Replaced(_)) && (group != 0 || caller) {
                prefix.set_origin(b, group, caller);
            }
            entered.is_new()
        };
        match run {
            Some(s) if entered && effective_key(&h.extra_key, keys, s) == key => {}
            Some(s) => {
                flush(prefix, s..i);
                run = entered.then_some(i);
            }
            None => run = entered.then_some(i),
        }
    }
    if let Some(s) = run {
        flush(prefix, s..range.end);
    }
}
