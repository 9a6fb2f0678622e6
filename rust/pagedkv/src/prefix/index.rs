//! The cached-block index: content hash -> the block holding that content, with what each
//! indexed block was stored with (parent hash, extra key, token ids).
//!
//! On a hit the stored parent hash, extra key and token ids of the block are compared too, so
//! a colliding hash can never serve another request's keys for that block; earlier blocks are
//! covered by the 128-bit keyed chain. (The comparison is a memcmp of `block_size` ids, cheap
//! next to the hash itself, so it is always on.)
//!
//! The token ids live in one flat array, `block_size` per block id, allocated zeroed with the
//! index (the OS backs its pages only as blocks are first indexed): indexing a block copies
//! its ids there and allocates nothing. Per-block buffers cost a heap allocation the first
//! time each block was indexed, measured at ~8 K instructions per all-miss admission.
//!
//! The same content may sit on several physical blocks (two requests computed it
//! independently, or a prompt's last full block, which is always recomputed). Every copy is
//! indexed, as vLLM's `BlockHashToBlockMap` does: the map names one copy and each copy links
//! to the next (`next_copy`), so evicting one copy keeps the others hittable.

use std::sync::Arc;

use super::hash::{BlockHash, BlockHasher};
use super::hash_slots::{HashSlots, Probe};
use crate::prefetch::touch_all;
use crate::{BlockId, TokenId};

/// What one block was stored with (indexed by block id). One cache line per block: admitting
/// a prompt that misses evicts and re-indexes a block per 16 tokens, each a cold record
/// (`Option<u128>` fields made it 96 bytes, two or three lines).
#[derive(Debug, Clone)]
#[repr(align(64))]
struct Stored {
    /// The hash the block is indexed under (meaningful while it is indexed).
    hash: BlockHash,
    /// Parent hash the block was stored with (meaningful when `has_parent`).
    parent: BlockHash,
    /// Extra key the block was stored with.
    extra_key: Option<Arc<[u8]>>,
    /// The next block holding the same content (`NO_BLOCK` at the end of the copies).
    next_copy: BlockId,
    /// The block most recently indexed as this block's child (`NO_BLOCK`: none). A hint only:
    /// it may since have been evicted or reused, so [`BlockIndex::lookup_child`] verifies it.
    child: BlockId,
    /// Whether the block was stored with a parent (it is not the first of its chain).
    has_parent: bool,
    /// Whether the map names this block (the first of its content's copies).
    first_copy: bool,
}

// The record fits the one cache line it is aligned to.
const _: () = assert!(std::mem::size_of::<Stored>() == 64);

impl Stored {
    /// The parent hash the block was stored with.
    #[inline]
    fn parent(&self) -> Option<BlockHash> {
        self.has_parent.then_some(self.parent)
    }
}

/// The end of a list of copies (no block has this id: pools hold fewer than 2^24 blocks).
const NO_BLOCK: BlockId = BlockId::MAX;

impl Default for Stored {
    fn default() -> Self {
        Stored {
            hash: 0,
            parent: 0,
            extra_key: None,
            next_copy: NO_BLOCK,
            child: NO_BLOCK,
            has_parent: false,
            first_copy: false,
        }
    }
}

/// Block `b`'s slice of the flat token array.
#[inline]
fn block_tokens(tokens: &[TokenId], block_size: usize, b: BlockId) -> &[TokenId] {
    &tokens[b as usize * block_size..][..block_size]
}

/// Content hash -> block, for in-use and cached-evictable blocks alike. Only full blocks are
/// indexed (docs/design.md, Invariants 5).
#[derive(Debug)]
pub(crate) struct BlockIndex {
    block_size: usize,
    /// Content hash -> the first block holding that content (the others follow `next_copy`).
    map: HashSlots,
    /// Per block id of the pool.
    stored: Vec<Stored>,
    /// Per block id: whether `map` reaches the block (it is indexed). Apart from the records
    /// so that freeing a sequence, which asks this of every block, reads one byte per block
    /// (64 KB for 65,536 blocks, stays in L2) instead of each block's cold record line.
    indexed: Vec<bool>,
    /// The token ids each indexed block was stored with: block `b`'s are
    /// `tokens[b * block_size..][..block_size]` (stale once it leaves the index).
    tokens: Vec<TokenId>,
}

impl BlockIndex {
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockIndex {
            block_size,
            // Every block may be indexed at once: sized up front, the map never grows.
            map: HashSlots::new(num_blocks),
            stored: vec![Stored::default(); num_blocks],
            indexed: vec![false; num_blocks],
            tokens: vec![0; num_blocks * block_size],
        }
    }

    /// The token ids block `b` was stored with (meaningful while it is indexed).
    #[inline]
    fn tokens_of(&self, b: BlockId) -> &[TokenId] {
        block_tokens(&self.tokens, self.block_size, b)
    }

    /// Whether block `b`'s record holds exactly this parent hash, extra key and token ids (what
    /// its hash was computed from; whether it is still indexed is the caller's to check).
    #[inline]
    fn stored_with(
        &self,
        b: BlockId,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> bool {
        let s = &self.stored[b as usize];
        s.parent() == parent
            && s.extra_key.as_deref() == extra_key
            && self.tokens_of(b) == token_ids
    }

    /// Distinct indexed contents (each may sit on several blocks).
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub(crate) fn is_indexed(&self, b: BlockId) -> bool {
        self.indexed[b as usize]
    }

    /// The hash block `b` is indexed under, if it is.
    #[inline]
    fn hash_of(&self, b: BlockId) -> Option<BlockHash> {
        self.is_indexed(b).then(|| self.stored[b as usize].hash)
    }

    /// Whether block `b` is indexed under exactly `hash`.
    #[inline]
    pub(crate) fn holds(&self, b: BlockId, hash: BlockHash) -> bool {
        self.hash_of(b) == Some(hash)
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
        let stored = &self.stored;
        let b = self.map.get(hash, |b| stored[b as usize].hash)?;
        self.stored_with(b, parent, token_ids, extra_key)
            .then_some(b)
    }

    /// The block holding this content, found from the block holding its parent
    /// (`parent_block`, indexed under `parent`) without hashing: `parent_block`'s child hint,
    /// accepted only when that block is indexed with exactly this parent hash, extra key and
    /// token ids, which determine its hash (so the hash is known without computing it).
    /// Returns the first copy of that content, as [`BlockIndex::lookup`] would, and its hash.
    /// `None` when the hint is missing or stale (the caller then hashes and looks up).
    #[inline]
    pub(crate) fn lookup_child(
        &self,
        parent_block: BlockId,
        parent: BlockHash,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Option<(BlockId, BlockHash)> {
        let stored = &self.stored;
        let c = stored[parent_block as usize].child;
        let s = stored.get(c as usize)?;
        // `stored_with`, spelled out on the record already in hand: the call measured +1.6 K
        // instructions per W2 admission (64 hints).
        let same = self.is_indexed(c)
            && s.parent() == Some(parent)
            && s.extra_key.as_deref() == extra_key
            && self.tokens_of(c) == token_ids;
        if !same {
            return None;
        }
        if s.first_copy {
            return Some((c, s.hash));
        }
        // Every copy under one hash holds the same content (`insert` refuses a collision), so
        // the first copy is the block `lookup` returns for this content.
        let first = self.map.get(s.hash, |b| stored[b as usize].hash);
        debug_assert!(
            first.is_some(),
            "indexed block {c}: its hash is not in the map"
        );
        first.map(|b| (b, s.hash))
    }

    /// Loads the home slots of `hashes`, about to be entered, all at once
    /// (`crate::prefetch`).
    pub(crate) fn prefetch_slots(&self, hashes: &[BlockHash]) {
        touch_all(hashes.iter().map(|&h| self.map.home_word(h)));
    }

    /// Loads the records of `blocks`, about to be removed or (re)written, all at once (the
    /// token ids are only written).
    pub(crate) fn prefetch_records(&self, blocks: &[BlockId]) {
        let stored = &self.stored;
        touch_all(
            blocks
                .iter()
                .map(|&b| u64::from(stored[b as usize].next_copy)),
        );
    }

    /// Loads the home slots of indexed `blocks`' hashes, all at once (their records were
    /// loaded first: each slot's address comes from its block's record).
    pub(crate) fn prefetch_slots_of(&self, blocks: &[BlockId]) {
        let stored = &self.stored;
        touch_all(
            blocks
                .iter()
                .map(|&b| self.map.home_word(stored[b as usize].hash)),
        );
    }

    /// Enters full block `b` under `hash`, as one more copy when that content is already
    /// indexed on other blocks. Refuses (returns false) when `b` already holds indexed content,
    /// or when `hash` names different content (a collision: the first content keeps it).
    /// `parent_block` (the block before `b` in its table) gets `b` as its child hint.
    #[inline]
    pub(crate) fn insert(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_block: Option<BlockId>,
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) -> bool {
        debug_assert_eq!(token_ids.len(), self.block_size);
        if self.is_indexed(b) {
            return false;
        }
        let stored = &self.stored;
        let next_copy = match self.map.probe(hash, |b| stored[b as usize].hash) {
            Probe::Vacant { slot } => {
                self.map.fill(slot, hash, b);
                NO_BLOCK
            }
            Probe::Found {
                slot,
                block: first_id,
            } => {
                if !self.stored_with(first_id, parent, token_ids, extra_key.as_deref()) {
                    return false;
                }
                // The new copy goes first: it is the most recently written.
                self.map.replace(slot, b);
                self.stored[first_id as usize].first_copy = false;
                first_id
            }
        };
        self.indexed[b as usize] = true;
        let s = &mut self.stored[b as usize];
        s.hash = hash;
        s.parent = parent.unwrap_or(0);
        s.has_parent = parent.is_some();
        s.extra_key.clone_from(extra_key);
        s.next_copy = next_copy;
        s.first_copy = true;
        // New content: hints to the children of the block's previous content are void.
        s.child = NO_BLOCK;
        if let Some(p) = parent_block {
            self.stored[p as usize].child = b;
        }
        let at = b as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(token_ids);
        true
    }

    /// Takes block `b` out of the index (its other copies stay); returns the hash it was
    /// indexed under, if any.
    #[inline]
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let h = self.hash_of(b)?;
        self.indexed[b as usize] = false;
        let s = &mut self.stored[b as usize];
        let next = std::mem::replace(&mut s.next_copy, NO_BLOCK);
        s.has_parent = false;
        s.first_copy = false;
        s.extra_key = None;
        let stored = &self.stored;
        let Probe::Found { slot, block: first } = self.map.probe(h, |b| stored[b as usize].hash)
        else {
            debug_assert!(false, "indexed block {b}: its hash is not in the map");
            return Some(h);
        };
        if first == b {
            if next == NO_BLOCK {
                self.map.remove_at(slot);
            } else {
                self.map.replace(slot, next);
                self.stored[next as usize].first_copy = true;
            }
        } else {
            // Unlink `b` from the copies (lists are short: one per independent computation).
            let mut at = first;
            while self.stored[at as usize].next_copy != b {
                at = self.stored[at as usize].next_copy;
            }
            self.stored[at as usize].next_copy = next;
        }
        Some(h)
    }

    /// Verifies the map against the per-block records, and each indexed block's hash against
    /// its stored content (docs/design.md, Invariants 5).
    pub(crate) fn check(&self, hasher: &BlockHasher) -> Result<(), String> {
        let stored = &self.stored;
        // A corrupted slot may name a block out of range: its "hash" is then 0, which its tag
        // contradicts, so the check reports it instead of indexing out of bounds.
        let hash_of = |b: BlockId| stored.get(b as usize).map_or(0, |s| s.hash);
        self.map.check(hash_of)?;
        let mut copies = 0usize;
        for first in self.map.blocks() {
            let h = hash_of(first);
            let mut b = first;
            while b != NO_BLOCK {
                let s = self
                    .stored
                    .get(b as usize)
                    .ok_or(format!("index names block {b} out of range"))?;
                copies += 1;
                if copies > self.stored.len() {
                    return Err("the copies of an indexed content form a cycle".into());
                }
                if self.hash_of(b) != Some(h) {
                    return Err(format!("index maps a hash to block {b} whose hash differs"));
                }
                if s.first_copy != (b == first) {
                    return Err(format!("block {b}: first-copy flag disagrees with the map"));
                }
                let recomputed =
                    hasher.hash_block(s.parent(), self.tokens_of(b), s.extra_key.as_deref());
                if recomputed != h {
                    return Err(format!("indexed block {b}: hash does not match its tokens"));
                }
                b = s.next_copy;
            }
        }
        let first_unindexed = self
            .stored
            .iter()
            .zip(&self.indexed)
            .position(|(s, &indexed)| s.first_copy && !indexed);
        if let Some(b) = first_unindexed {
            return Err(format!("block {b} is flagged a first copy but not indexed"));
        }
        let indexed = self.indexed.iter().filter(|&&i| i).count();
        if indexed != copies {
            return Err(format!(
                "{indexed} blocks carry a hash but the index reaches {copies}"
            ));
        }
        Ok(())
    }
}
