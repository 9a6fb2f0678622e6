//! Prefix caching: chained block hashes, the cached-block index, LRU eviction and KV events.
//!
//! # Hash
//!
//! A full block's hash chains its parent's hash, its token ids and an optional extra key
//! (cache salt, adapter id, multimodal content hash): equal hashes mean equal whole prefixes,
//! not just equal blocks. The function is SipHash-2-4 with 128-bit output, keyed from a
//! configurable seed (`k0 = seed`, `k1 = splitmix64(seed)`), so runs are reproducible and a
//! deployment can pick a secret seed. It is fed this byte string (little-endian `u64`
//! words, zero-padded, every variable part length-prefixed so no two inputs share an encoding):
//!
//! ```text
//! parent (u128, 0 for the first block) | has_parent (0|1) | extra tag (0: none, len+1)
//! | extra bytes, padded to 8 | num_tokens | token ids as u32, padded to 8
//! ```
//!
//! On a hit the stored parent hash, extra key and token ids of the block are compared too,
//! so a colliding hash can never serve another request's keys for that block; earlier blocks
//! are covered by the 128-bit keyed chain. (The comparison is a memcmp of `block_size` ids,
//! cheap next to the hash itself, so it is always on.)
//!
//! # Cached-evictable blocks and the LRU
//!
//! A full block whose content hash is indexed stays indexed after its refcount drops to 0: it
//! becomes *cached-evictable*, owned by this manager (not on the pool's free list) and queued
//! in an intrusive doubly linked LRU list (O(1) insert, remove, evict). Allocation takes truly
//! free pool blocks first and evicts from the LRU front only when the pool has none; an evicted
//! block loses its hash (a `BlockRemoved` event) before it is reused.
//!
//! # Events
//!
//! While prefix caching is on, every index change is recorded as a [`KvEvent`] whose field names
//! follow vLLM's KV-event schema (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), so
//! KV-aware routers can consume them. The queue is bounded by `ManagerConfig::max_events`: when
//! it is full the **oldest** event is dropped and `Stats::events_dropped` counts it, so a
//! consumer that falls behind sees a gap it can detect (and can resync after an
//! `AllBlocksCleared`) rather than unbounded memory growth.

use std::collections::VecDeque;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::pool::BlockPool;
use crate::{BlockId, Tier, TokenId};

/// A 128-bit chained block hash.
pub type BlockHash = u128;

const NIL: u32 = u32::MAX;

/// The keyed, chained block hash (SipHash-2-4-128, see the module docs).
///
/// ```
/// use pagedkv::BlockHasher;
/// let h = BlockHasher::new(42);
/// let first = h.hash_block(None, &[1, 2, 3, 4], None);
/// let second = h.hash_block(Some(first), &[5, 6, 7, 8], None);
/// assert_ne!(first, second);
/// assert_eq!(first, BlockHasher::new(42).hash_block(None, &[1, 2, 3, 4], None)); // reproducible
/// assert_ne!(first, BlockHasher::new(43).hash_block(None, &[1, 2, 3, 4], None)); // keyed
/// assert_ne!(first, h.hash_block(None, &[1, 2, 3, 4], Some(b"tenant-a")));      // salted
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    k0: u64,
    k1: u64,
}

#[inline(always)]
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-2-4 with 128-bit output over a message of whole little-endian `u64` words.
struct Sip128 {
    v: [u64; 4],
    num_words: usize,
}

impl Sip128 {
    #[inline]
    fn new(k0: u64, k1: u64) -> Self {
        Sip128 {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d ^ 0xee,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            num_words: 0,
        }
    }

    #[inline(always)]
    fn word(&mut self, m: u64) {
        self.v[3] ^= m;
        sip_round(&mut self.v);
        sip_round(&mut self.v);
        self.v[0] ^= m;
        self.num_words += 1;
    }

    #[inline]
    fn finish(mut self) -> u128 {
        // Standard final block for a message of 8 * num_words bytes: no tail bytes.
        let b = ((self.num_words * 8) as u64 & 0xff) << 56;
        self.v[3] ^= b;
        sip_round(&mut self.v);
        sip_round(&mut self.v);
        self.v[0] ^= b;
        self.v[2] ^= 0xee;
        for _ in 0..4 {
            sip_round(&mut self.v);
        }
        let h1 = self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3];
        self.v[1] ^= 0xdd;
        for _ in 0..4 {
            sip_round(&mut self.v);
        }
        let h2 = self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3];
        h1 as u128 | (h2 as u128) << 64
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn le_word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(w)
}

impl BlockHasher {
    /// A hasher keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        BlockHasher {
            k0: seed,
            k1: splitmix64(seed),
        }
    }

    /// The two SipHash keys derived from the seed.
    pub fn keys(&self) -> (u64, u64) {
        (self.k0, self.k1)
    }

    /// Hash of one block given its parent's hash (`None` for the first block), its token ids
    /// and the sequence's extra key.
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> BlockHash {
        let mut s = Sip128::new(self.k0, self.k1);
        let p = parent.unwrap_or(0);
        s.word(p as u64);
        s.word((p >> 64) as u64);
        s.word(u64::from(parent.is_some()));
        match extra_key {
            None => s.word(0),
            Some(extra) => {
                s.word(extra.len() as u64 + 1);
                for chunk in extra.chunks(8) {
                    s.word(le_word(chunk));
                }
            }
        }
        s.word(token_ids.len() as u64);
        let mut pairs = token_ids.chunks_exact(2);
        for pair in &mut pairs {
            s.word(pair[0] as u64 | (pair[1] as u64) << 32);
        }
        if let [last] = pairs.remainder() {
            s.word(*last as u64);
        }
        s.finish()
    }

    /// The exact byte string [`BlockHasher::hash_block`] hashes (for cross-checking against
    /// any standard SipHash-2-4-128 implementation).
    pub fn message_bytes(
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
        m.extend_from_slice(&u64::from(parent.is_some()).to_le_bytes());
        match extra_key {
            None => m.extend_from_slice(&0u64.to_le_bytes()),
            Some(extra) => {
                m.extend_from_slice(&(extra.len() as u64 + 1).to_le_bytes());
                m.extend_from_slice(extra);
                m.resize(m.len().div_ceil(8) * 8, 0);
            }
        }
        m.extend_from_slice(&(token_ids.len() as u64).to_le_bytes());
        for t in token_ids {
            m.extend_from_slice(&t.to_le_bytes());
        }
        m.resize(m.len().div_ceil(8) * 8, 0);
        m
    }
}

/// A change to the prefix-cache index, named and shaped after vLLM's KV events
/// (`vllm.distributed.kv_events`), for KV-aware routers.
///
/// ```
/// use pagedkv::{KvCacheManager, KvEvent, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig {
///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, ..Default::default()
/// })?;
/// kv.add_sequence(1, &[1, 2, 3], None)?;
/// match &kv.take_events()[..] {
///     [KvEvent::BlockStored { block_hashes, parent_block_hash: None, token_ids, block_size: 2, .. }] => {
///         assert_eq!(block_hashes.len(), 1);
///         assert_eq!(token_ids, &[1, 2]);
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one prefix chain were entered in the index.
    BlockStored {
        /// Hashes of the stored blocks, in chain order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first stored one (`None`: the chain starts here).
        parent_block_hash: Option<BlockHash>,
        /// The stored blocks' token ids, concatenated (`block_hashes.len() * block_size`).
        token_ids: Vec<TokenId>,
        /// Tokens per block.
        block_size: usize,
        /// The sequence's extra key (salt / adapter / multimodal hash), if any.
        extra_key: Option<Vec<u8>>,
        /// Where the blocks live (vLLM's `medium`; always the device tier here).
        medium: Tier,
    },
    /// Blocks were evicted from the index (their content is gone).
    BlockRemoved {
        /// Hashes of the removed blocks.
        block_hashes: Vec<BlockHash>,
        /// Where the blocks lived.
        medium: Tier,
    },
    /// The whole index was cleared (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// Per-block prefix-cache state (indexed by block id).
#[derive(Debug, Clone)]
struct BlockMeta {
    /// `Some(h)` exactly when `index[h] == this block`.
    hash: Option<BlockHash>,
    /// Parent hash the block was stored with.
    parent: Option<BlockHash>,
    /// Extra key the block was stored with.
    extra_key: Option<Arc<[u8]>>,
    /// Token ids the block was stored with (`block_size` of them while indexed; the buffer is
    /// kept after eviction and reused).
    token_ids: Vec<TokenId>,
    /// LRU neighbours (`NIL` at the ends); meaningful while `in_lru`.
    prev: u32,
    next: u32,
    /// Whether the block is cached-evictable (refcount 0, in the LRU).
    in_lru: bool,
}

/// The prefix cache of one manager: index, per-block metadata, LRU, events and counters.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    pub(crate) hasher: BlockHasher,
    block_size: usize,
    /// Content hash -> the block holding that content (in use or cached-evictable).
    index: FxHashMap<BlockHash, BlockId>,
    /// Per block id of the pool.
    meta: Vec<BlockMeta>,
    /// Least recently used cached-evictable block (evicted first).
    lru_head: u32,
    /// Most recently released cached-evictable block.
    lru_tail: u32,
    /// Number of cached-evictable blocks (== blocks with `in_lru`).
    lru_len: usize,
    events: VecDeque<KvEvent>,
    max_events: usize,
    pub(crate) events_dropped: u64,
    pub(crate) query_tokens: u64,
    pub(crate) hit_tokens: u64,
    pub(crate) evictions: u64,
}

impl PrefixCache {
    pub(crate) fn new(num_blocks: usize, block_size: usize, seed: u64, max_events: usize) -> Self {
        let empty = BlockMeta {
            hash: None,
            parent: None,
            extra_key: None,
            token_ids: Vec::new(),
            prev: NIL,
            next: NIL,
            in_lru: false,
        };
        PrefixCache {
            hasher: BlockHasher::new(seed),
            block_size,
            index: FxHashMap::default(),
            meta: vec![empty; num_blocks],
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            events: VecDeque::new(),
            max_events,
            events_dropped: 0,
            query_tokens: 0,
            hit_tokens: 0,
            evictions: 0,
        }
    }

    #[inline]
    pub(crate) fn num_cached(&self) -> usize {
        self.lru_len
    }

    #[inline]
    pub(crate) fn is_indexed(&self, b: BlockId) -> bool {
        self.meta[b as usize].hash.is_some()
    }

    /// Whether block `b` is indexed under exactly `hash`.
    #[inline]
    pub(crate) fn holds(&self, b: BlockId, hash: BlockHash) -> bool {
        self.meta[b as usize].hash == Some(hash)
    }

    #[inline]
    pub(crate) fn is_cached(&self, b: BlockId) -> bool {
        self.meta[b as usize].in_lru
    }

    /// The block holding exactly this content (same hash, parent, extra key and tokens).
    pub(crate) fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<BlockId> {
        let &b = self.index.get(&hash)?;
        let m = &self.meta[b as usize];
        let same =
            m.parent == parent && m.extra_key.as_deref() == extra_key && m.token_ids == token_ids;
        same.then_some(b)
    }

    /// Enters full block `b` under `hash` unless that content is already indexed (by another
    /// block). Returns whether it was entered.
    pub(crate) fn register(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) -> bool {
        debug_assert_eq!(token_ids.len(), self.block_size);
        let m = &mut self.meta[b as usize];
        if m.hash.is_some() || self.index.contains_key(&hash) {
            return false;
        }
        self.index.insert(hash, b);
        m.hash = Some(hash);
        m.parent = parent;
        m.extra_key = extra_key.clone();
        m.token_ids.clear();
        m.token_ids.extend_from_slice(token_ids);
        true
    }

    /// A released indexed block with refcount 0 joins the LRU tail.
    pub(crate) fn push_lru(&mut self, b: BlockId) {
        debug_assert!(self.is_indexed(b) && !self.is_cached(b));
        let tail = self.lru_tail;
        let m = &mut self.meta[b as usize];
        m.in_lru = true;
        m.prev = tail;
        m.next = NIL;
        if tail == NIL {
            self.lru_head = b;
        } else {
            self.meta[tail as usize].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let (prev, next) = {
            let m = &mut self.meta[b as usize];
            debug_assert!(m.in_lru);
            m.in_lru = false;
            (
                std::mem::replace(&mut m.prev, NIL),
                std::mem::replace(&mut m.next, NIL),
            )
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }

    /// `revive_cached`: a prefix hit on a cached-evictable block makes it in use (0 -> 1),
    /// keeping its hash.
    pub(crate) fn revive_cached(&mut self, b: BlockId, pool: &BlockPool) {
        self.unlink(b);
        pool.claim_cached(b);
    }

    /// Evicts the least recently used cached block for reuse as a fresh block (0 -> 1); it
    /// loses its hash.
    pub(crate) fn evict_lru(&mut self, pool: &BlockPool) -> BlockId {
        let b = self.lru_head;
        debug_assert!(b != NIL, "evict from an empty LRU");
        self.unlink(b);
        self.unindex(b);
        self.evictions += 1;
        pool.claim_cached(b);
        b
    }

    fn unindex(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        if let Some(h) = m.hash.take() {
            self.index.remove(&h);
            m.parent = None;
            m.extra_key = None;
            self.push_event(KvEvent::BlockRemoved {
                block_hashes: vec![h],
                medium: Tier::Device,
            });
        }
    }

    /// Returns every cached block to the pool and empties the index. The caller guarantees
    /// no indexed block is in use.
    pub(crate) fn reset(&mut self, pool: &BlockPool) {
        while self.lru_head != NIL {
            let b = self.lru_head;
            self.unlink(b);
            let m = &mut self.meta[b as usize];
            if let Some(h) = m.hash.take() {
                self.index.remove(&h);
            }
            m.parent = None;
            m.extra_key = None;
            pool.free_cached(b);
        }
        // Every indexed block was cached (none in use), so nothing is left.
        debug_assert!(self.index.is_empty());
        self.index.clear();
        self.push_event(KvEvent::AllBlocksCleared);
    }

    pub(crate) fn push_event(&mut self, event: KvEvent) {
        if self.max_events == 0 {
            self.events_dropped += 1;
            return;
        }
        if self.events.len() == self.max_events {
            self.events.pop_front();
            self.events_dropped += 1;
        }
        self.events.push_back(event);
    }

    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.drain(..).collect()
    }

    /// LRU order, least recently used first (for tests and invariant checks).
    pub(crate) fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.lru_len);
        let mut b = self.lru_head;
        while b != NIL && out.len() <= self.meta.len() {
            out.push(b);
            b = self.meta[b as usize].next;
        }
        out
    }

    /// Verifies the index, metadata and LRU against each other (DESIGN.md §2 inv. 2 and 5).
    /// `refcount(b)` reads the pool.
    pub(crate) fn check(&self, refcount: impl Fn(BlockId) -> u32) -> Result<(), String> {
        for (&h, &b) in &self.index {
            let m = self
                .meta
                .get(b as usize)
                .ok_or(format!("index names block {b} out of range"))?;
            if m.hash != Some(h) {
                return Err(format!("index maps a hash to block {b} whose hash differs"));
            }
            if m.token_ids.len() != self.block_size {
                return Err(format!("indexed block {b} is not full"));
            }
            let recomputed = self
                .hasher
                .hash_block(m.parent, &m.token_ids, m.extra_key.as_deref());
            if recomputed != h {
                return Err(format!("indexed block {b}: hash does not match its tokens"));
            }
        }
        let indexed = self.meta.iter().filter(|m| m.hash.is_some()).count();
        if indexed != self.index.len() {
            return Err(format!(
                "{indexed} blocks carry a hash but the index has {}",
                self.index.len()
            ));
        }
        let order = self.lru_order();
        if order.len() != self.lru_len {
            return Err(format!(
                "LRU walk found {} blocks, lru_len {}",
                order.len(),
                self.lru_len
            ));
        }
        let flagged = self.meta.iter().filter(|m| m.in_lru).count();
        if flagged != self.lru_len {
            return Err(format!(
                "{flagged} blocks flagged cached, lru_len {}",
                self.lru_len
            ));
        }
        let mut prev = NIL;
        for &b in &order {
            let m = &self.meta[b as usize];
            if !m.in_lru || m.prev != prev {
                return Err(format!("LRU links broken at block {b}"));
            }
            if m.hash.is_none() {
                return Err(format!("cached block {b} is not indexed"));
            }
            let rc = refcount(b);
            if rc != 0 {
                return Err(format!("cached-evictable block {b} has refcount {rc}"));
            }
            prev = b;
        }
        if self.lru_tail != prev {
            return Err("LRU tail pointer is stale".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_encoding_is_unambiguous() {
        let a = BlockHasher::message_bytes(None, &[1, 2], Some(b""));
        let b = BlockHasher::message_bytes(None, &[1, 2], None);
        assert_ne!(a, b);
        let h = BlockHasher::new(7);
        assert_ne!(
            h.hash_block(None, &[1, 2], Some(b"")),
            h.hash_block(None, &[1, 2], None)
        );
        assert_ne!(
            h.hash_block(Some(0), &[1, 2], None),
            h.hash_block(None, &[1, 2], None)
        );
        assert_ne!(
            h.hash_block(None, &[1, 2, 0], None),
            h.hash_block(None, &[1, 2], None)
        );
    }

    #[test]
    fn lru_links() {
        let pool = BlockPool::new(4, 2).unwrap();
        let mut c = PrefixCache::new(4, 2, 0, 8);
        let bs = pool.allocate(3).unwrap();
        let mut parent = None;
        for &b in &bs {
            let h = c.hasher.hash_block(parent, &[b, b], None);
            assert!(c.register(b, h, parent, &[b, b], &None));
            parent = Some(h);
            pool.release_to_cache(b).unwrap();
            c.push_lru(b);
        }
        assert_eq!(c.lru_order(), vec![0, 1, 2]);
        c.revive_cached(1, &pool);
        assert_eq!(c.lru_order(), vec![0, 2]);
        assert_eq!(c.evict_lru(&pool), 0);
        assert_eq!(c.lru_order(), vec![2]);
        assert!(!c.is_indexed(0) && c.is_indexed(1));
        c.check(|b| pool.refcount(b).unwrap()).unwrap();
    }
}
