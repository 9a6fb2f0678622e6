//! The offload tier: host blocks that keep the content of prefix blocks the device pool
//! evicted, keyed by their chained hash, so that a later prompt with the same tokens loads them
//! back instead of recomputing them (docs/offload.md, "The host offload tier").
//!
//! The tier holds no K/V itself: it decides which host block holds which content and records
//! the copies the caller's data plane runs, `(device_block, host_block)` offload ops and
//! `(host_block, device_block)` load ops. Its memory is separate from the swap tier's
//! ([`crate::host::HostTier`]): swapped-out sequences must always find room, a cache may not.
//!
//! Every host block is in exactly one of three states:
//!
//! * **free** (on the free stack);
//! * **indexed**: holds the content of one hash (`entries[h]` is `Some`, `map[hash] == h`);
//!   it is in the LRU unless a pending load reads it (`pins[h] > 0`): a pinned block is never
//!   reused, so a load always reads what it was planned to read;
//! * **pinned, unindexed**: `reset` dropped its content while a load still reads it; it goes
//!   back to the free stack when that load is handed to the caller.
//!
//! Ops are executed in the order they were recorded, offloads before loads (the caller drains
//! both at the same point, `take_offload_ops` first): an offload reads a device block before
//! anything overwrites it, and a load reads a host block that no later offload may reuse
//! (pinned). A hash already held is never offloaded twice, so a device block that is the
//! destination of a pending load, evicted again, records no op.
//!
//! **Bounded queues.** A caller that never drains the ops must not grow them without bound
//! (docs/security.md, guarantee 6), so, as the copy-on-write queue does
//! (`manager/copy_queue.rs`), each queue is compacted by dead-op elimination once it passes
//! twice its bound plus a slack, the threshold doubling past what survived, so compaction costs
//! amortized O(1) per op. Walking newest first, an op is dead when its destination's content can
//! no longer be observed: an offload `(d, h)` when a later offload writes `h` or `h` holds no
//! entry and no pending load reads it; a load `(h, d)` when a later load writes `d` or the
//! manager no longer holds `d` (no resident table and no index entry names it). Executing the
//! compacted queues leaves every host block of the tier and every device block the manager holds
//! exactly as the full queues would, so at most one offload per host block and one load per
//! device block survive. A dropped load unpins its host block as draining it would.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::{Result, Tier};
use crate::pool::validate_geometry;
use crate::prefix::events::{EventQueue, KvEvent};
use crate::prefix::eviction::{Content, EvictionSink};
use crate::prefix::hash::BlockHash;
use crate::prefix::lru::Lru;
use crate::types::{BlockId, TokenId};

/// The content one host block holds: what a device block was indexed with.
#[derive(Debug, Clone)]
struct Entry {
    /// The device index's key (`prefix::hash::group_key` of the content hash).
    hash: BlockHash,
    parent: Option<BlockHash>,
    token_ids: Box<[TokenId]>,
    extra_key: Option<Arc<[u8]>>,
    /// The KV-cache group of a manager of several groups (events carry it), `None` otherwise.
    group_idx: Option<u32>,
}

impl Entry {
    /// The content hash (what events carry): the key less its group's mix.
    fn content_hash(&self) -> BlockHash {
        crate::prefix::hash::content_hash(self.group_idx.unwrap_or(0), self.hash)
    }

    /// The parent's content hash (what events carry): a group's parents are keyed too.
    fn content_parent(&self) -> Option<BlockHash> {
        let g = self.group_idx.unwrap_or(0);
        self.parent.map(|p| crate::prefix::hash::content_hash(g, p))
    }
}

/// Lifetime counters of the tier, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct OffloadCounters {
    /// Offload ops recorded (device block content kept in a host block).
    pub(crate) blocks_offloaded: u64,
    /// Load ops recorded (host hits loaded back into device blocks).
    pub(crate) blocks_loaded: u64,
    /// Host entries dropped to make room (least recently used first).
    pub(crate) blocks_dropped: u64,
    /// Evicted device blocks not kept because every host block was pinned by a pending load.
    pub(crate) offloads_skipped: u64,
    /// Pending offload and load ops dropped by dead-op elimination (see the module docs).
    pub(crate) ops_elided: u64,
}

/// Compaction starts once a queue holds this many ops beyond twice its bound.
const COMPACT_SLACK: usize = 64;

/// The queue length at which a queue whose live ops are at most `bound` is next compacted,
/// `survivors` ops having survived the last compaction.
fn compact_threshold(bound: usize, survivors: usize) -> usize {
    bound
        .saturating_mul(2)
        .max(survivors.saturating_mul(2))
        .saturating_add(COMPACT_SLACK)
}

/// Which of `ops` (run in order, each writing block `dst(op)`) to keep so that every block
/// marked in `live` ends as the full list leaves it: the last write to each live block. No op
/// of one queue reads another's destination (offloads read device blocks and write host blocks,
/// loads the reverse), so no earlier write needs keeping for a later op to read. `live` is
/// consumed as scratch.
fn last_writes<T>(ops: &[T], dst: impl Fn(&T) -> BlockId, mut live: Vec<bool>) -> Vec<bool> {
    let mut keep = vec![false; ops.len()];
    for (i, op) in ops.iter().enumerate().rev() {
        keep[i] = std::mem::replace(&mut live[dst(op) as usize], false);
    }
    keep
}

/// The host offload tier of one manager (see the module docs).
#[derive(Debug)]
pub(crate) struct OffloadTier {
    block_size: usize,
    /// Per host block: the content it holds, if indexed.
    entries: Vec<Option<Entry>>,
    /// Hash -> the host block holding it.
    map: FxHashMap<BlockHash, BlockId>,
    /// Indexed, unpinned host blocks, least recently used first.
    lru: Lru,
    /// Per host block: pending loads reading it.
    pins: Vec<u32>,
    /// Free host blocks (a stack).
    free: Vec<BlockId>,
    /// Recorded `(device_block, host_block)` copies, oldest first. At most
    /// `offloads_compact_at` long (see the module docs).
    pending_offloads: Vec<(BlockId, BlockId)>,
    /// `pending_offloads.len()` at which it is next compacted.
    offloads_compact_at: usize,
    /// Recorded `(host_block, device_block)` copies, oldest first. Compacted by the manager
    /// ([`Self::compact_loads`]) once `loads_compact_at` long: only it knows which device blocks
    /// it still holds.
    pending_loads: Vec<(BlockId, BlockId)>,
    /// `pending_loads.len()` at which it is next compacted.
    loads_compact_at: usize,
    /// The device pool's size: the most loads that can be live at once (one per device block).
    num_device_blocks: usize,
    pub(crate) counters: OffloadCounters,
}

impl OffloadTier {
    /// A tier of `num_blocks` host blocks of `block_size` tokens (the device pool's block
    /// size) under a device pool of `num_device_blocks` blocks.
    pub(crate) fn new(
        num_blocks: usize,
        block_size: usize,
        num_device_blocks: usize,
    ) -> Result<Self> {
        validate_geometry(num_blocks, block_size, "num_offload_blocks")?;
        Ok(OffloadTier {
            block_size,
            entries: vec![None; num_blocks],
            map: FxHashMap::default(),
            lru: Lru::new(num_blocks),
            pins: vec![0; num_blocks],
            // Reversed so host block 0 is handed out first.
            free: (0..num_blocks as BlockId).rev().collect(),
            pending_offloads: Vec::new(),
            offloads_compact_at: compact_threshold(num_blocks, 0),
            pending_loads: Vec::new(),
            loads_compact_at: compact_threshold(num_device_blocks, 0),
            num_device_blocks,
            counters: OffloadCounters::default(),
        })
    }

    /// Host blocks in the tier.
    pub(crate) fn num_blocks(&self) -> usize {
        self.entries.len()
    }

    /// Host blocks holding content.
    pub(crate) fn num_indexed(&self) -> usize {
        self.map.len()
    }

    /// The hash host block `h` holds content for, if any (`None` also when out of range).
    pub(crate) fn hash_of(&self, h: BlockId) -> Option<BlockHash> {
        self.entries.get(h as usize)?.as_ref().map(|e| e.hash)
    }

    /// The host block holding exactly this content (hash, parent, token ids and extra key:
    /// verified like a device hit, so a hash collision is a miss, never wrong K/V).
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        let &h = self.map.get(&hash)?;
        let e = self.entries[h as usize].as_ref()?;
        (e.parent == parent && &*e.token_ids == token_ids && e.extra_key.as_deref() == extra_key)
            .then_some(h)
    }

    /// [`Self::lookup`] of a block of KV-cache group `group` under its group key `key`: the
    /// entry's group must match too.
    pub(crate) fn lookup_in_group(
        &self,
        key: BlockHash,
        group: u32,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        let h = self.lookup(key, parent, token_ids, extra_key)?;
        let entry = self.entries[h as usize].as_ref()?;
        (entry.group_idx.unwrap_or(0) == group).then_some(h)
    }

    /// Keeps the content of evicted device block `device_block` (indexed as `content`): a host
    /// block takes it (a free one, else the least recently used entry is dropped) and an
    /// offload op is recorded. Content already held is only marked recently used; when every
    /// host block is pinned by a pending load the content is not kept (counted).
    pub(crate) fn offload(
        &mut self,
        device_block: BlockId,
        content: Content<'_>,
        events: &mut EventQueue,
    ) {
        if let Some(&h) = self.map.get(&content.hash) {
            if self.lru.contains(h) {
                self.lru.remove(h);
                self.lru.push_back(h);
            }
            return;
        }
        let h = match self.free.pop() {
            Some(h) => h,
            None => match self.lru.pop_front() {
                Some(h) => {
                    self.unindex(h, events);
                    self.counters.blocks_dropped += 1;
                    h
                }
                None => {
                    self.counters.offloads_skipped += 1;
                    return;
                }
            },
        };
        let entry = Entry {
            hash: content.hash,
            parent: content.parent,
            token_ids: content.token_ids.into(),
            extra_key: content.extra_key.cloned(),
            group_idx: content.group_idx,
        };
        if events.enabled() {
            events.push(KvEvent::BlockStored {
                block_hashes: vec![entry.content_hash()],
                parent_block_hash: entry.content_parent(),
                token_ids: entry.token_ids.to_vec(),
                block_size: self.block_size,
                extra_key: entry.extra_key.as_deref().map(<[u8]>::to_vec),
                medium: Tier::Host,
                group_idx: entry.group_idx,
            });
        }
        self.map.insert(entry.hash, h);
        self.entries[h as usize] = Some(entry);
        self.lru.push_back(h);
        self.pending_offloads.push((device_block, h));
        self.counters.blocks_offloaded += 1;
        if self.pending_offloads.len() >= self.offloads_compact_at {
            self.compact_offloads();
        }
    }

    /// Dead-op elimination on the pending offloads (see the module docs): an offload into host
    /// block `h` is kept only when it is the last to write `h` and `h` holds an entry or is read
    /// by a pending load.
    fn compact_offloads(&mut self) {
        let live: Vec<bool> = (0..self.entries.len())
            .map(|h| self.entries[h].is_some() || self.pins[h] > 0)
            .collect();
        let ops = std::mem::take(&mut self.pending_offloads);
        let keep = last_writes(&ops, |&(_, h)| h, live);
        let kept: Vec<(BlockId, BlockId)> = ops
            .iter()
            .zip(keep)
            .filter_map(|(&op, keep)| keep.then_some(op))
            .collect();
        self.counters.ops_elided += (ops.len() - kept.len()) as u64;
        self.offloads_compact_at = compact_threshold(self.entries.len(), kept.len());
        self.pending_offloads = kept;
    }

    /// Takes indexed host block `h` out of the index (a `BlockRemoved` on the host tier).
    fn unindex(&mut self, h: BlockId, events: &mut EventQueue) {
        if let Some(e) = self.entries[h as usize].take() {
            self.map.remove(&e.hash);
            if events.enabled() {
                events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![e.content_hash()],
                    medium: Tier::Host,
                    group_idx: e.group_idx,
                });
            }
        }
    }

    /// Pins host hit `h` for the load about to be recorded, so that no offload reuses it
    /// before the caller has run that load.
    pub(crate) fn pin(&mut self, h: BlockId) {
        if self.pins[h as usize] == 0 && self.lru.contains(h) {
            self.lru.remove(h);
        }
        self.pins[h as usize] += 1;
    }

    /// Records the load of pinned host block `h` into fresh device block `device_block`.
    pub(crate) fn record_load(&mut self, h: BlockId, device_block: BlockId) {
        debug_assert!(self.pins[h as usize] > 0);
        self.pending_loads.push((h, device_block));
        self.counters.blocks_loaded += 1;
    }

    /// Whether the pending loads have reached their compaction threshold: the manager then
    /// calls [`Self::compact_loads`].
    #[inline]
    pub(crate) fn loads_need_compaction(&self) -> bool {
        self.pending_loads.len() >= self.loads_compact_at
    }

    /// Dead-op elimination on the pending loads (see the module docs): a load into device
    /// block `d` is kept only when it is the last to write `d` and `held[d]` (the manager still
    /// holds `d`). Each dropped load unpins its host block, oldest first, as
    /// [`Self::take_load_ops`] would.
    pub(crate) fn compact_loads(&mut self, held: Vec<bool>) {
        let ops = std::mem::take(&mut self.pending_loads);
        let keep = last_writes(&ops, |&(_, d)| d, held);
        let mut kept = Vec::with_capacity(ops.len());
        for (&(h, d), keep) in ops.iter().zip(keep) {
            if keep {
                kept.push((h, d));
            } else {
                self.unpin(h);
                self.counters.ops_elided += 1;
            }
        }
        self.loads_compact_at = compact_threshold(self.num_device_blocks, kept.len());
        self.pending_loads = kept;
    }

    /// Drains the recorded offload ops, oldest first.
    pub(crate) fn take_offload_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        self.offloads_compact_at = compact_threshold(self.entries.len(), 0);
        std::mem::take(&mut self.pending_offloads)
    }

    /// Drains the recorded load ops, oldest first, unpinning their host blocks (each becomes
    /// the most recently used; one whose content `reset` dropped is free again).
    pub(crate) fn take_load_ops(&mut self) -> Vec<(BlockId, BlockId)> {
        let ops = std::mem::take(&mut self.pending_loads);
        for &(h, _) in &ops {
            self.unpin(h);
        }
        self.loads_compact_at = compact_threshold(self.num_device_blocks, 0);
        ops
    }

    /// Drops one pin of host block `h` (a load handed over or found dead); at none it becomes
    /// the most recently used entry, or free when `reset` dropped its content.
    fn unpin(&mut self, h: BlockId) {
        let pins = &mut self.pins[h as usize];
        *pins -= 1;
        if *pins == 0 {
            if self.entries[h as usize].is_some() {
                self.lru.push_back(h);
            } else {
                self.free.push(h);
            }
        }
    }

    /// Drops every entry (`reset_prefix_cache`; the caller records `AllBlocksCleared`). Pinned
    /// blocks stay out of the free stack until their loads are drained.
    pub(crate) fn clear(&mut self) {
        while let Some(h) = self.lru.pop_front() {
            self.entries[h as usize] = None;
            self.free.push(h);
        }
        for e in &mut self.entries {
            *e = None;
        }
        self.map.clear();
    }

    /// Verifies the three states of every host block (see the module docs) and that the
    /// recorded ops name existing blocks.
    pub(crate) fn check(&self, num_device_blocks: usize) -> std::result::Result<(), String> {
        let n = self.entries.len();
        self.lru.check()?;
        let mut on_free = vec![false; n];
        for &h in &self.free {
            let i = h as usize;
            if i >= n || std::mem::replace(&mut on_free[i], true) {
                return Err(format!(
                    "host offload block {h} is on the free stack twice or out of range"
                ));
            }
            if self.entries[i].is_some() || self.pins[i] > 0 || self.lru.contains(h) {
                return Err(format!(
                    "host offload block {h} is both free and indexed or pinned"
                ));
            }
        }
        let mut pinned_by_loads = vec![0u32; n];
        for &(h, d) in &self.pending_loads {
            if h as usize >= n || d as usize >= num_device_blocks {
                return Err(format!("load op ({h}, {d}) names a block out of range"));
            }
            pinned_by_loads[h as usize] += 1;
        }
        for &(d, h) in &self.pending_offloads {
            if h as usize >= n || d as usize >= num_device_blocks {
                return Err(format!("offload op ({d}, {h}) names a block out of range"));
            }
        }
        if self.pending_offloads.len() >= self.offloads_compact_at
            || self.pending_loads.len() >= self.loads_compact_at
        {
            return Err(format!(
                "{} offload and {} load ops pending, past their compaction thresholds {} and {}",
                self.pending_offloads.len(),
                self.pending_loads.len(),
                self.offloads_compact_at,
                self.loads_compact_at
            ));
        }
        for h in 0..n {
            let id = h as BlockId;
            if self.pins[h] != pinned_by_loads[h] {
                return Err(format!(
                    "host offload block {h}: {} pins but {} pending loads",
                    self.pins[h], pinned_by_loads[h]
                ));
            }
            match &self.entries[h] {
                Some(e) => {
                    if self.map.get(&e.hash) != Some(&id) {
                        return Err(format!("host offload block {h} is not mapped by its hash"));
                    }
                    if e.token_ids.len() != self.block_size {
                        return Err(format!("host offload block {h} holds a partial block"));
                    }
                    if self.lru.contains(id) == (self.pins[h] > 0) {
                        return Err(format!(
                            "host offload block {h}: in the LRU {} with {} pins",
                            self.lru.contains(id),
                            self.pins[h]
                        ));
                    }
                }
                None => {
                    if self.lru.contains(id) {
                        return Err(format!("host offload block {h} is in the LRU unindexed"));
                    }
                    if !on_free[h] && self.pins[h] == 0 {
                        return Err(format!(
                            "host offload block {h} is lost (not free, not indexed, not pinned)"
                        ));
                    }
                }
            }
        }
        if self.map.len() != self.entries.iter().filter(|e| e.is_some()).count() {
            return Err("the host offload map names blocks that hold no entry".to_owned());
        }
        Ok(())
    }
}

/// The prefix cache's evictions land here: each victim's content is kept on the host.
impl EvictionSink for OffloadTier {
    #[inline]
    fn evicted(&mut self, device_block: BlockId, content: Content<'_>, events: &mut EventQueue) {
        self.offload(device_block, content, events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splitmix64;

    #[test]
    fn last_writes_leave_every_live_block_as_the_full_list_does() {
        let mut state = 39_u64;
        let mut rng = |n: usize| (splitmix64::next(&mut state) % n as u64) as usize;
        for _ in 0..2_000 {
            let (num_src, num_dst) = (1 + rng(8), 1 + rng(8));
            let ops: Vec<(BlockId, BlockId)> = (0..rng(24))
                .map(|_| (rng(num_src) as BlockId, rng(num_dst) as BlockId))
                .collect();
            let live: Vec<bool> = (0..num_dst).map(|_| rng(2) == 0).collect();
            let keep = last_writes(&ops, |&(_, d)| d, live.clone());
            // Run on symbolic contents: destination d starts holding None, each op writes its
            // source's id.
            let run = |kept: &dyn Fn(usize) -> bool| {
                let mut dst: Vec<Option<BlockId>> = vec![None; num_dst];
                for (i, &(s, d)) in ops.iter().enumerate() {
                    if kept(i) {
                        dst[d as usize] = Some(s);
                    }
                }
                dst
            };
            let (full, short) = (run(&|_| true), run(&|i| keep[i]));
            for d in 0..num_dst {
                if live[d] {
                    assert_eq!(full[d], short[d], "block {d}: ops {ops:?} keep {keep:?}");
                }
            }
            // At most one write per live block survives.
            assert!(keep.iter().filter(|&&k| k).count() <= live.iter().filter(|&&l| l).count());
        }
    }

    #[test]
    fn undrained_offloads_stay_bounded_and_keep_each_entry_s_last_write() {
        let mut tier = OffloadTier::new(4, 2, 16).unwrap();
        let mut events = EventQueue::new(false, 0);
        for i in 0..100_000_u32 {
            let tokens = [i, i + 1];
            let content = Content {
                hash: u128::from(i) + 1,
                parent: None,
                token_ids: &tokens,
                extra_key: None,
                group_idx: None,
            };
            tier.offload(i % 16, content, &mut events);
            assert!(tier.pending_offloads.len() < compact_threshold(4, 0));
        }
        assert!(tier.counters.ops_elided > 0);
        tier.check(16).unwrap();
        // The last surviving write to each host block is the offload of its entry.
        let ops = tier.take_offload_ops();
        for h in 0..4 {
            let last = ops.iter().rev().find(|op| op.1 == h).map(|op| op.0);
            let hash = tier.hash_of(h).unwrap();
            assert_eq!(last, Some(((hash - 1) % 16) as BlockId), "host block {h}");
        }
    }
}
