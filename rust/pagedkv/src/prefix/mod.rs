//! Prefix caching: chained block hashes ([`hash`]), the cached-block index ([`index`]) with
//! its eviction order ([`lru`]), KV events ([`events`]), and what eviction hands on
//! ([`eviction`]: the offload tier is the sink).
//!
//! A full block whose content hash is indexed stays indexed after its refcount drops to 0: it
//! becomes *cached-evictable*, owned by its manager (not on the pool's free list) and queued in
//! the LRU. Allocation takes truly free pool blocks first and evicts from the LRU front only
//! when the pool has none; an evicted block loses its hash (a `BlockRemoved` event) before it
//! is reused. The states and their invariants are in docs/design.md, Invariants.
//!
//! [`PrefixCache`] composes the four parts; each keeps its own invariants and
//! [`PrefixCache::check`] verifies them against each other.

pub(crate) mod events;
pub(crate) mod eviction;
pub(crate) mod eviction_order;
pub(crate) mod hash;
pub(crate) mod hash_slots;
pub(crate) mod index;
pub(crate) mod lru;
pub(crate) mod pins;
pub(crate) mod states_this_step;

use std::sync::Arc;

use self::events::{DrainedEvents, EventQueue, KvEvent};
use self::eviction::EvictionSink;
use self::eviction_order::EvictionOrder;
use self::hash::{content_hash, BlockHash, BlockHasher, ChainHasher};
use self::index::{BlockIndex, Entered};
use self::pins::Pins;
use self::states_this_step::StatesThisStep;
use crate::pool::BlockPool;
use crate::{BlockId, TokenId};

/// The prefix cache of one manager: hasher, index, LRU of cached-evictable blocks, events and
/// counters.
///
/// Invariants: every block in the LRU is indexed and has refcount 0 (cached-evictable);
/// every indexed block outside the LRU is in use by this manager's tables.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    pub(crate) hasher: BlockHasher,
    index: BlockIndex,
    /// The cached-evictable blocks in eviction order: least recently used first, or
    /// queue-aware (`eviction_order.rs`).
    lru: EvictionOrder,
    pub(crate) events: EventQueue,
    /// Prompt tokens looked up, lifetime.
    pub(crate) query_tokens: u64,
    /// Prompt tokens served from the cache, lifetime.
    pub(crate) hit_tokens: u64,
    /// Cached blocks evicted for reuse, lifetime.
    pub(crate) blocks_evicted: u64,
    /// Pinned prefixes (each pinned block holds a reference per pin).
    pub(crate) pins: Pins,
    /// Whether the manager has several KV-cache groups: its events then carry each block's
    /// group (`group_idx`), and a single-group manager's keep `None` (docs/design.md, KV groups).
    pub(crate) grouped: bool,
    /// The state blocks cached in the current step (`states_this_step.rs`).
    pub(crate) states_this_step: StatesThisStep,
}

impl PrefixCache {
    /// `events` enables KV events (bounded by `max_events`).
    pub(crate) fn new(
        num_blocks: usize,
        block_size: usize,
        seed: u64,
        events: bool,
        max_events: usize,
    ) -> Self {
        PrefixCache {
            hasher: BlockHasher::new(seed),
            index: BlockIndex::new(num_blocks, block_size),
            lru: EvictionOrder::new(num_blocks),
            events: EventQueue::new(events, max_events),
            query_tokens: 0,
            hit_tokens: 0,
            blocks_evicted: 0,
            pins: Pins::default(),
            grouped: false,
            states_this_step: StatesThisStep::default(),
        }
    }

    /// The block of KV-cache group `group` holding exactly this content, entered under
    /// `key` (`hash::group_key(group, content hash)`); the record's group is compared too, so a
    /// caller's hashes can never serve another group's block.
    #[inline]
    pub(crate) fn lookup_in_group(
        &self,
        group: u32,
        key: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        self.index
            .lookup(key, parent, token_ids, extra_key)
            .filter(|&b| self.index.group_of(b) == group)
    }

    /// The block of KV-cache group `group` indexed under content hash `hash` (the caller's
    /// block hash, or pagedkv's own), looked up by that hash alone (see
    /// `index/by_hash.rs`: the first call stops chaining).
    pub(crate) fn cached_block(&mut self, group: u32, hash: BlockHash) -> Option<BlockId> {
        let b = self.index.get_by_hash(hash::group_key(group, hash))?;
        (self.index.group_of(b) == group).then_some(b)
    }

    /// Called before blocks named by the caller are entered (`AdmitOptions::block_hashes` or
    /// `prompt_hashes`, `provide_token_ids`' hashes): a caller may name different contents
    /// alike (a wrong or hostile hash), which the index must refuse rather than index twice
    /// (one copy per name, `check_invariants`); it finds every name once no block is chained
    /// (`index/by_hash.rs`). pagedkv's own hashes name each content once: its admissions
    /// keep chaining until a caller names a block.
    pub(crate) fn expect_caller_names(&mut self) {
        self.index.enter_by_hash();
    }

    /// Records the group and hash origin of block `b` just entered (see
    /// [`BlockIndex::set_origin`]).
    #[inline]
    pub(crate) fn set_origin(&mut self, b: BlockId, group: u32, caller_hash: bool) {
        self.index.set_origin(b, group, caller_hash);
    }

    /// The KV-cache group of indexed block `b`.
    #[inline]
    pub(crate) fn group_of(&self, b: BlockId) -> u32 {
        self.index.group_of(b)
    }

    /// `group_idx` of the events of a block of `group` (`None` for a single-group manager).
    #[inline]
    pub(crate) fn event_group(&self, group: u32) -> Option<u32> {
        self.grouped.then_some(group)
    }

    /// Cached-evictable blocks.
    #[inline]
    pub(crate) fn num_cached(&self) -> usize {
        self.lru.len()
    }

    #[inline]
    pub(crate) fn is_indexed(&self, b: BlockId) -> bool {
        self.index.is_indexed(b)
    }

    /// Whether block `b` is indexed under exactly `hash`.
    #[inline]
    pub(crate) fn holds(&self, b: BlockId, hash: BlockHash) -> bool {
        self.index.holds(b, hash)
    }

    /// Whether block `b` is cached-evictable.
    #[inline]
    pub(crate) fn is_cached(&self, b: BlockId) -> bool {
        self.lru.contains(b)
    }

    /// The block holding exactly this content (same hash, parent, extra key and tokens).
    #[inline]
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        self.index.lookup(hash, parent, token_ids, extra_key)
    }

    /// The block holding this content found through its parent's block without hashing, with
    /// its hash; `None` when that shortcut does not apply (see [`BlockIndex::lookup_child`]).
    /// Always inlined: the admission walk's hint look-up must stay inlined in it whatever else
    /// calls this (the groups' hit finder does; callgrind: `prefix_match` was +17 % without).
    #[inline(always)]
    pub(crate) fn lookup_child(
        &self,
        parent_block: BlockId,
        parent: BlockHash,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<(BlockId, BlockHash)> {
        self.index
            .lookup_child(parent_block, parent, token_ids, extra_key)
    }

    /// Enters full block `b` under `hash` (see [`BlockIndex::insert`]). `parent_block` is the
    /// block before `b` in its table (`None` for the first); `chain` the hashes of the blocks
    /// before `b` in its chain. When a cached-evictable block held the content, `b` replaces it
    /// in the index and that block goes back to `pool`'s free list (one copy per content: the
    /// one in use); when a block in use holds it, `b` stays private.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_block: Option<BlockId>,
        chain: &[BlockHash],
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
        pool: &BlockPool,
    ) -> Entered {
        let lru = &self.lru;
        let entered = self.index.insert(
            b,
            hash,
            parent,
            parent_block,
            chain,
            token_ids,
            extra_key,
            |x| !lru.contains(x),
        );
        if let Entered::Replaced(x) = entered {
            self.lru.remove(x);
            pool.free_cached(x);
        }
        entered
    }

    /// Enters `blocks[1..]` chained, each to the block before it in `blocks`: `blocks[0]` is
    /// the block [`Self::register`] has just entered as new content in the same admission,
    /// under `hashes.last()`, and the rest are that admission's fresh blocks after it, holding
    /// `token_ids` (see [`BlockIndex::insert_chained`]). Hashes each block with `chain` as it
    /// enters it (the `k`-th with `given[k]` instead where `GIVEN` and the caller hashed it
    /// already) and
    /// appends the hash to `hashes`. Stops before a block whose parent content
    /// may have orphan children (one may hold that block's content: the caller enters it with
    /// [`Self::register`]); returns how many blocks it entered, all new content.
    pub(crate) fn register_chained_run<const GIVEN: bool>(
        &mut self,
        blocks: &[BlockId],
        chain: &mut ChainHasher,
        hashes: &mut Vec<BlockHash>,
        token_ids: &[TokenId],
        given: &[BlockHash],
        extra_key: &Option<Arc<[u8]>>,
    ) -> usize {
        let (Some((&head, rest)), Some(&head_hash)) = (blocks.split_first(), hashes.last()) else {
            return 0;
        };
        if self.index.by_hash() {
            // Content is looked up by hash alone: every block gets a map entry (`register`).
            return 0;
        }
        debug_assert_eq!(token_ids.len(), rest.len() * self.index.block_size());
        let chunks = token_ids.chunks_exact(self.index.block_size());
        let (mut p, mut parent) = (head, head_hash);
        if !self.index.may_have_orphans() {
            // The common case, no orphan anywhere: no block is looked up.
            for (k, (&b, chunk)) in rest.iter().zip(chunks).enumerate() {
                let h = match given.get(k).filter(|_| GIVEN) {
                    Some(&h) => h,
                    None => chain.hash(Some(parent), chunk),
                };
                hashes.push(h);
                self.index.insert_chained(p, b, parent, h, chunk, extra_key);
                (p, parent) = (b, h);
            }
            return rest.len();
        }
        for (k, (&b, chunk)) in rest.iter().zip(chunks).enumerate() {
            if self.index.may_have_orphans_of(parent) {
                return k;
            }
            let h = match given.get(k).filter(|_| GIVEN) {
                Some(&h) => h,
                None => chain.hash(Some(parent), chunk),
            };
            hashes.push(h);
            self.index.insert_chained(p, b, parent, h, chunk, extra_key);
            (p, parent) = (b, h);
        }
        rest.len()
    }

    /// A released indexed block whose refcount reached 0 becomes cached-evictable, the most
    /// recently used.
    pub(crate) fn push_lru(&mut self, b: BlockId) {
        debug_assert!(self.is_indexed(b));
        self.lru.push_back(b);
    }

    /// The pool side of `revive_cached`: a prefix hit on a cached-evictable block makes it in
    /// use (refcount 0 -> 1), keeping its hash.
    pub(crate) fn revive_cached(&mut self, b: BlockId, pool: &BlockPool) {
        self.lru.remove(b);
        pool.claim_cached(b);
    }

    /// Evicts the `n` least recently used cached blocks for reuse as fresh blocks (refcount
    /// 0 -> 1), appending them to `out` in eviction order; each loses its hash
    /// (`BlockRemoved`). The caller checked the LRU holds at least `n`.
    ///
    /// The victims leave the LRU in one walk; their records, and the hash-table slots of those
    /// with a map entry, are loaded in one pass before any is removed (`crate::prefetch`): the
    /// least recently used blocks are the coldest memory of the cache, and one at a time each
    /// removal waited on its own misses.
    ///
    /// With a sink (the offload tier), each victim's content is handed to it first (an
    /// offload op).
    pub(crate) fn evict_lru_into<S: EvictionSink>(
        &mut self,
        n: usize,
        pool: &BlockPool,
        out: &mut Vec<BlockId>,
        mut sink: Option<&mut S>,
    ) {
        let start = out.len();
        let index = &self.index;
        self.lru.pop_front_into(n, out, |b| index.hash_of(b));
        self.index.prefetch_removals(&out[start..]);
        for &b in &out[start..] {
            // The sink first: without one, the victim's content is not even looked at.
            if let Some(sink) = sink.as_deref_mut() {
                if let Some(mut content) = self.index.content(b) {
                    content.group_idx = self.grouped.then(|| self.index.group_of(b));
                    sink.evicted(b, content, &mut self.events);
                }
            }
            self.unindex(b);
        }
        pool.claim_cached_all(&out[start..]);
    }

    /// Loads the hash-table slots that registering blocks under `hashes` will probe, all at
    /// once. Called as soon as the hashes are known, before the eviction that supplies the
    /// blocks, so that these misses overlap the eviction's own.
    #[inline]
    pub(crate) fn prefetch_register_slots(&self, hashes: &[BlockHash]) {
        self.index.prefetch_slots(hashes);
    }

    /// Loads the records that registering `blocks` will write, all at once (blocks evicted
    /// for this admission have theirs loaded already; truly free ones do not).
    #[inline]
    pub(crate) fn prefetch_register_records(&self, blocks: &[BlockId]) {
        self.index.prefetch_records(blocks);
    }

    /// Returns the least recently used cached block to the pool's free list (it loses its hash:
    /// `BlockRemoved`), so any manager on the pool can allocate it. `None` when nothing is
    /// cached.
    pub(crate) fn release_lru(&mut self, pool: &BlockPool) -> Option<BlockId> {
        let b = self.unindex_lru()?;
        pool.free_cached(b);
        Some(b)
    }

    /// Returns cached-evictable block `b` to the pool's free list out of LRU order (it loses its
    /// hash: `BlockRemoved`): `KvCacheManager::evict_blocks`, and vLLM's tests popping a chosen
    /// block from its cache.
    pub(crate) fn release_cached(&mut self, b: BlockId, pool: &BlockPool) {
        self.lru.remove(b);
        self.unindex(b);
        pool.free_cached(b);
    }

    /// Takes the least recently used cached block out of the LRU and the index (recording its
    /// `BlockRemoved`), leaving its pool state to the caller. `None` when nothing is cached.
    fn unindex_lru(&mut self) -> Option<BlockId> {
        let index = &self.index;
        let b = self.lru.pop_front(|b| index.hash_of(b))?;
        self.unindex(b);
        Some(b)
    }

    /// Takes block `b`, just out of the LRU, out of the index, recording its `BlockRemoved` and
    /// counting the eviction.
    #[inline(always)]
    fn unindex(&mut self, b: BlockId) {
        self.unindex_in_use(b);
        self.blocks_evicted += 1;
    }

    /// Takes in-use block `b` out of the index (a `BlockRemoved` if it was indexed): its
    /// content is about to be overwritten or was rolled back (`truncate`). Not an eviction.
    #[inline(always)]
    pub(crate) fn unindex_in_use(&mut self, b: BlockId) {
        if self.grouped {
            self.unindex_grouped(b);
        } else if let Some(h) = self.index.remove(b) {
            self.events.push_removed(h);
        }
    }

    /// [`Self::unindex_in_use`] of a manager of several groups: the event carries the content
    /// hash and the block's group.
    #[cold]
    fn unindex_grouped(&mut self, b: BlockId) {
        let group = self.index.group_of(b);
        if let Some(key) = self.index.remove(b) {
            self.events
                .push_removed_in_group(content_hash(group, key), Some(group));
        }
    }

    /// The token ids block `b` holds, if it is indexed under exactly `hash`.
    pub(crate) fn tokens_if_holds(&self, b: BlockId, hash: BlockHash) -> Option<&[TokenId]> {
        self.index.tokens_if_holds(b, hash)
    }

    /// Returns every cached block to the pool and empties the index (`AllBlocksCleared`). The
    /// caller guarantees no indexed block is in use.
    pub(crate) fn reset(&mut self, pool: &BlockPool) {
        while let Some(b) = self.lru.pop_front(|_| None) {
            self.index.remove(b);
            pool.free_cached(b);
        }
        // Every indexed block was cached (none in use), so nothing is left.
        debug_assert_eq!(self.index.len(), 0);
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// Drains the recorded events as the queue holds them, oldest first.
    pub(crate) fn take_drained_events(&mut self) -> DrainedEvents {
        self.events.take_drained()
    }

    /// Marks `hash` wanted by a waiting request, or not (queue-aware eviction,
    /// `eviction_order.rs`): a cached block under a wanted hash is evicted only after every
    /// other cached block. The first call turns the queue-aware order on.
    pub(crate) fn set_wanted(&mut self, hash: BlockHash, wanted: bool) {
        self.lru.set_wanted(hash, wanted);
    }

    /// The hash block `b` is indexed under (tests).
    #[cfg(test)]
    pub(crate) fn hash_of(&self, b: BlockId) -> Option<BlockHash> {
        self.index.hash_of(b)
    }

    /// Whether queue-aware eviction is on, and the hashes marked wanted.
    pub(crate) fn wanted_hashes(&self) -> Option<usize> {
        self.lru
            .is_queue_aware()
            .then(|| self.lru.num_wanted_hashes())
    }

    /// Cached-evictable blocks, least recently used first (queue-aware: those set aside last).
    pub(crate) fn lru_order(&self) -> Vec<BlockId> {
        self.lru.order()
    }

    /// Verifies the index, the LRU and their agreement (docs/design.md, Invariants 2 and 5).
    /// `refcount(b)` reads the pool.
    pub(crate) fn check(&self, refcount: impl Fn(BlockId) -> u32) -> Result<(), String> {
        self.index.check_invariants(&self.hasher)?;
        self.lru.check(|b| self.index.hash_of(b))?;
        self.pins.check()?;
        for (b, n) in self.pins.iter() {
            if !self.index.is_indexed(b) {
                return Err(format!("pinned block {b} is not indexed"));
            }
            if self.lru.contains(b) {
                return Err(format!("pinned block {b} is cached-evictable"));
            }
            let rc = refcount(b);
            if rc < n {
                return Err(format!("block {b}: {n} pins but refcount {rc}"));
            }
        }
        for b in self.lru.order() {
            if !self.index.is_indexed(b) {
                return Err(format!("cached block {b} is not indexed"));
            }
            let rc = refcount(b);
            if rc != 0 {
                return Err(format!("cached-evictable block {b} has refcount {rc}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_links() {
        let pool = BlockPool::new(4, 2).unwrap();
        let mut c = PrefixCache::new(4, 2, 0, true, 8);
        let bs = pool.allocate(3).unwrap();
        let mut parent = None;
        for &b in &bs {
            let h = c.hasher.hash_block(parent, &[b, b], None);
            let chain: Vec<BlockHash> = parent.into_iter().collect();
            let prev = b.checked_sub(1);
            let entered = c.register(b, h, parent, prev, &chain, &[b, b], &None, &pool);
            assert!(entered.is_new());
            parent = Some(h);
            pool.release_to_cache(b).unwrap();
            c.push_lru(b);
        }
        assert_eq!(c.lru_order(), vec![0, 1, 2]);
        c.revive_cached(1, &pool);
        assert_eq!(c.lru_order(), vec![0, 2]);
        let mut out = vec![];
        c.evict_lru_into(
            1,
            &pool,
            &mut out,
            None::<&mut crate::offload_tier::OffloadTier>,
        );
        assert_eq!(out, vec![0]);
        assert_eq!(c.lru_order(), vec![2]);
        assert!(!c.is_indexed(0) && c.is_indexed(1));
        c.check(|b| pool.refcount(b).unwrap()).unwrap();
    }
}
