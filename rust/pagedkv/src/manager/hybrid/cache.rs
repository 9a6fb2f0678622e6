//! The prefix cache of a hybrid manager: one index keyed by (group, chained block hash), one
//! LRU of cached-evictable blocks shared by every group (vLLM's `BlockHashWithGroupId` over
//! one free queue), KV events and pins (docs/design.md, Hybrid groups).
//!
//! Simpler than the single-group index (`prefix/index.rs`): a hash map and one boxed record
//! per indexed block. Each record keeps the parent hash, extra key and token ids, compared on
//! every hit, so a hash collision cannot serve wrong content.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::pool::BlockPool;
use crate::prefix::events::{block_stored, EventQueue, KvEvent};
use crate::prefix::hash::{BlockHash, BlockHasher};
use crate::prefix::lru::Lru;
use crate::{BlockId, TokenId};

/// What an indexed block holds.
#[derive(Debug, Clone)]
pub(super) struct Record {
    /// The group whose table the block belongs to.
    pub(super) group: u32,
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    pub(super) tokens: Box<[TokenId]>,
    pub(super) extra_key: Option<Arc<[u8]>>,
}

/// One pin: the blocks it holds a reference on, under the chain hash of the pinned prompt.
#[derive(Debug, Clone)]
pub(super) struct Pin {
    pub(super) key: (Option<BlockHash>, usize),
    pub(super) blocks: Vec<BlockId>,
}

/// Index, LRU, events, pins and prefix counters of one hybrid manager.
///
/// Invariants: `map[(g, h)]` holds `b` iff `records[b]` is `Some` with group `g` and hash `h`;
/// every block in the LRU is indexed and has refcount 0; every indexed block outside the LRU
/// is referenced by a table or a pin.
#[derive(Debug)]
pub(super) struct GroupCache {
    pub(super) hasher: BlockHasher,
    /// Every indexed copy of a content, oldest first: the oldest serves hits, and a newer
    /// copy takes over when it leaves (vLLM's `cached_block_hash_to_block`).
    map: FxHashMap<(u32, BlockHash), Vec<BlockId>>,
    records: Vec<Option<Box<Record>>>,
    num_indexed: usize,
    pub(super) lru: Lru,
    pub(super) events: EventQueue,
    pub(super) query_tokens: u64,
    pub(super) hit_tokens: u64,
    pub(super) blocks_evicted: u64,
    /// Pins, oldest first.
    pub(super) pins: Vec<Pin>,
}

impl GroupCache {
    pub(super) fn new(num_blocks: usize, seed: u64, events: bool, max_events: usize) -> Self {
        GroupCache {
            hasher: BlockHasher::new(seed),
            map: FxHashMap::default(),
            records: vec![None; num_blocks],
            num_indexed: 0,
            lru: Lru::new(num_blocks),
            events: EventQueue::new(events, max_events),
            query_tokens: 0,
            hit_tokens: 0,
            blocks_evicted: 0,
            pins: Vec::new(),
        }
    }

    #[inline]
    pub(super) fn is_indexed(&self, b: BlockId) -> bool {
        self.records[b as usize].is_some()
    }

    /// The group whose index holds block `b`, if indexed.
    pub(super) fn group_of(&self, b: BlockId) -> Option<u32> {
        self.records[b as usize].as_ref().map(|r| r.group)
    }

    /// The oldest indexed block of group `group` holding exactly this content.
    pub(super) fn lookup(
        &self,
        group: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        self.map.get(&(group, hash))?.iter().copied().find(|&b| {
            self.records[b as usize].as_deref().is_some_and(|r| {
                r.parent == parent && &*r.tokens == tokens && r.extra_key.as_deref() == extra_key
            })
        })
    }

    /// Enters block `b` of `group` under `hash`; `false` (nothing changes) when `b` is
    /// already indexed. A copy of content already indexed is entered behind the older copies.
    pub(super) fn insert(
        &mut self,
        group: u32,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) -> bool {
        if self.is_indexed(b) {
            return false;
        }
        self.map.entry((group, hash)).or_default().push(b);
        self.records[b as usize] = Some(Box::new(Record {
            group,
            hash,
            parent,
            tokens: tokens.into(),
            extra_key: extra_key.clone(),
        }));
        self.num_indexed += 1;
        true
    }

    /// Drops `b` from the copies of its content.
    fn unmap(&mut self, r: &Record, b: BlockId) {
        if let Some(copies) = self.map.get_mut(&(r.group, r.hash)) {
            copies.retain(|&c| c != b);
            if copies.is_empty() {
                self.map.remove(&(r.group, r.hash));
            }
        }
    }

    /// Takes `b` out of the index (a `BlockRemoved` of its hash); `None` if not indexed.
    pub(super) fn remove(&mut self, b: BlockId) -> Option<Box<Record>> {
        let r = self.records[b as usize].take()?;
        self.unmap(&r, b);
        self.num_indexed -= 1;
        self.events.push_removed_in_group(r.hash, Some(r.group));
        Some(r)
    }

    /// Takes `b` out of the index without an event (a reset records `AllBlocksCleared`).
    pub(super) fn remove_silently(&mut self, b: BlockId) {
        if let Some(r) = self.records[b as usize].take() {
            self.unmap(&r, b);
            self.num_indexed -= 1;
        }
    }

    /// Records one `BlockStored` for a run of blocks of `group` entered in chain order.
    pub(super) fn stored(
        &mut self,
        group: u32,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[TokenId],
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) {
        if self.events.enabled() && !hashes.is_empty() {
            let mut event = block_stored(hashes, parent, tokens, block_size, extra_key);
            if let KvEvent::BlockStored { group_idx, .. } = &mut event {
                *group_idx = Some(group);
            }
            self.events.push(event);
        }
    }

    /// Evicts the least recently used cached block for reuse (refcount 0 -> 1): it loses its
    /// hash. The caller checked the LRU is not empty.
    pub(super) fn evict_one(&mut self, pool: &BlockPool) -> BlockId {
        let b = self.lru.pop_front().expect("caller checked the LRU");
        self.remove(b);
        self.blocks_evicted += 1;
        pool.claim_cached(b);
        b
    }

    /// Every indexed block with its record (for `check_invariants`).
    pub(super) fn indexed(&self) -> impl Iterator<Item = (BlockId, &Record)> + '_ {
        self.records
            .iter()
            .enumerate()
            .filter_map(|(b, r)| r.as_deref().map(|r| (b as BlockId, r)))
    }

    /// Whether the map and the records agree (invariant of the struct).
    pub(super) fn check_map(&self) -> Result<(), String> {
        let mapped: usize = self.map.values().map(Vec::len).sum();
        if mapped != self.num_indexed {
            return Err(format!(
                "hybrid index: {mapped} mapped blocks for {} indexed blocks",
                self.num_indexed
            ));
        }
        for (&(g, h), copies) in &self.map {
            for &b in copies {
                match self.records[b as usize].as_deref() {
                    Some(r) if r.group == g && r.hash == h => {}
                    _ => {
                        return Err(format!(
                            "hybrid index: map entry ({g}, {h:#x}) names block {b}, whose record differs"
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}
