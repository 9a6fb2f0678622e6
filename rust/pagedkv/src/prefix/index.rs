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
//! its ids there and allocates nothing (a buffer per block cost an allocation per indexed
//! block).
//!
//! The same content may sit on several physical blocks (two requests computed it
//! independently, or a prompt's last full block, which is always recomputed). Every copy is
//! indexed, as vLLM's `BlockHashToBlockMap` does: the map names one copy and each copy links
//! to the next (`next_copy`), so evicting one copy keeps the others hittable.
//!
//! **Chained blocks.** Admission walks a prompt's blocks from its first: the first by hash,
//! each later one through the block found for its parent (that block's child hint,
//! [`BlockIndex::lookup_child`]), by hash only when the hint does not match. The new blocks an
//! admission enters after its first new one are *chained* ([`BlockIndex::insert_chained`]):
//! no map entry, reachable through their parent block's hint alone, so an all-miss prompt
//! touches the map (a random line of a large table) once instead of once per block (measured
//! in benches/results/2026-12-02-prefix-admission.md, "chained runs").
//!
//! The rule that keeps this equivalent to a map entry per block: a chained block `c` stays
//! chained only while its parent block `p` is indexed and visible (walks reach `p` for its
//! content) and `p.child == c`. Each event that could end that promotes `c` to a map entry
//! first ([`BlockIndex::promote`]): `p` leaving the index, a newer copy of `p`'s content
//! hiding `p`, and a copy of `c`'s content entered after `p`. [`BlockIndex::check_invariants`]
//! states the rule in code, and the model test in this file compares every answer of the
//! index with a plain map that indexes every block.

use std::sync::Arc;

use super::hash::{group_key, BlockHash, BlockHasher};
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
    /// Whether walks reach this block for its content: the map names it (the first of its
    /// content's copies), or it is chained.
    visible: bool,
    /// The block whose child hint alone reaches this block, while it is chained (no map
    /// entry; see the module docs); `NO_BLOCK` otherwise.
    chained_to: BlockId,
    /// The KV-cache group the block belongs to: `hash` is its content hash keyed by the group
    /// (`prefix::hash::group_key`; 0 for a single-group manager). Set by
    /// [`BlockIndex::set_origin`] after the block is entered, reset to 0 by every entry.
    group: u8,
    /// Whether `hash` is the caller's (`block_hashes` of an admission): not recomputed from
    /// the tokens by [`BlockIndex::check_invariants`].
    caller_hash: bool,
}

// The record fits the one cache line it is aligned to.
const _: () = assert!(std::mem::size_of::<Stored>() == 64);

impl Stored {
    /// The parent hash the block was stored with.
    #[inline]
    fn parent(&self) -> Option<BlockHash> {
        self.has_parent.then_some(self.parent)
    }

    /// Whether the block is chained (reachable only through `chained_to`'s child hint).
    #[inline]
    fn is_chained(&self) -> bool {
        self.chained_to != NO_BLOCK
    }
}

/// The end of a list of copies (no block has this id: pools hold fewer than 2^24 blocks).
const NO_BLOCK: BlockId = BlockId::MAX;

/// What [`BlockIndex::insert`] did with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entered {
    /// Not entered: the block holds indexed content already, or its hash names other content.
    Refused,
    /// Entered as content indexed nowhere else.
    New,
    /// Entered as one more copy of content other blocks hold.
    Copy,
}

impl Entered {
    /// Whether the block was entered (the caller reports it as `BlockStored`).
    #[inline]
    pub(crate) fn is_entered(self) -> bool {
        self != Entered::Refused
    }
}

impl Default for Stored {
    fn default() -> Self {
        Stored {
            hash: 0,
            parent: 0,
            extra_key: None,
            next_copy: NO_BLOCK,
            child: NO_BLOCK,
            has_parent: false,
            visible: false,
            chained_to: NO_BLOCK,
            group: 0,
            caller_hash: false,
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
    /// Per block id: whether the block is indexed (on a map entry's copies, or chained). Apart
    /// from the records so that freeing a sequence, which asks this of every block, reads one
    /// byte per block (64 KB for 65,536 blocks, stays in L2) instead of each block's cold
    /// record line.
    indexed: Vec<bool>,
    /// The token ids each indexed block was stored with: block `b`'s are
    /// `tokens[b * block_size..][..block_size]` (stale once it leaves the index).
    tokens: Vec<TokenId>,
    /// Chained blocks (indexed without a map entry).
    num_chained: usize,
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
            num_chained: 0,
        }
    }

    /// Token ids per block.
    #[inline]
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
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
        self.record_stored_with(&self.stored[b as usize], b, parent, token_ids, extra_key)
    }

    /// [`Self::stored_with`] on block `b`'s record `s`, already in hand. The token ids are
    /// compared last: their slice is formed only when the rest matches.
    #[inline]
    fn record_stored_with(
        &self,
        s: &Stored,
        b: BlockId,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> bool {
        s.parent() == parent
            && s.extra_key.as_deref() == extra_key
            && self.tokens_of(b) == token_ids
    }

    /// Indexed contents: map entries (each may sit on several blocks) and chained blocks.
    pub(crate) fn len(&self) -> usize {
        self.map.len() + self.num_chained
    }

    /// The chained child of `p`, if `p`'s hint names one (see the module docs). A block that
    /// leaves the index clears its `chained_to`, so no indexed check is needed.
    #[inline]
    fn chained_child(&self, p: BlockId) -> Option<BlockId> {
        let c = self.stored[p as usize].child;
        let s = self.stored.get(c as usize)?;
        (s.chained_to == p).then_some(c)
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

    /// Records, for block `b` just entered, the KV-cache group its key belongs to and whether
    /// the key is a caller's hash (docs/design.md, KV groups). Entries start at group 0 with a
    /// computed hash, so a single-group manager never calls this.
    #[inline]
    pub(crate) fn set_origin(&mut self, b: BlockId, group: u32, caller_hash: bool) {
        debug_assert!(self.is_indexed(b) && group < 256);
        let s = &mut self.stored[b as usize];
        s.group = group as u8;
        s.caller_hash = caller_hash;
    }

    /// The KV-cache group of indexed block `b` (meaningful while it is indexed).
    #[inline]
    pub(crate) fn group_of(&self, b: BlockId) -> u32 {
        u32::from(self.stored[b as usize].group)
    }

    /// What block `b` is indexed with (hash, parent, token ids, extra key), if it is: what the
    /// offload tier keeps when the block is evicted.
    pub(crate) fn content(&self, b: BlockId) -> Option<crate::offload_tier::Content<'_>> {
        let hash = self.hash_of(b)?;
        let s = &self.stored[b as usize];
        Some(crate::offload_tier::Content {
            hash,
            parent: s.has_parent.then_some(s.parent),
            token_ids: self.tokens_of(b),
            extra_key: s.extra_key.as_ref(),
            group_idx: None,
        })
    }

    /// The token ids block `b` holds, if it is indexed under exactly `hash`.
    pub(crate) fn tokens_if_holds(&self, b: BlockId, hash: BlockHash) -> Option<&[TokenId]> {
        self.holds(b, hash).then(|| self.tokens_of(b))
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
    /// Always inlined (see `PrefixCache::lookup_child`).
    #[inline(always)]
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
        // `record_stored_with` spelled out: as a call, even inlined, every hint of a hit walk
        // cost more instructions (`prefix_w2`). The model test below checks this against
        // `lookup`, which calls it.
        let same = self.is_indexed(c)
            && s.parent() == Some(parent)
            && s.extra_key.as_deref() == extra_key
            && self.tokens_of(c) == token_ids;
        if !same {
            return None;
        }
        if s.visible {
            return Some((c, s.hash));
        }
        // A hidden copy has a map entry (`check_invariants`), and every copy under one hash
        // holds the same content (`insert` refuses a collision), so the first copy is the
        // block `lookup` returns for this content.
        let first = self.map.get(s.hash, |b| stored[b as usize].hash);
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

    /// Loads the records of `blocks`, about to be removed, and the home slots of those with a
    /// map entry, in one pass (a slot's address comes from its record; chained blocks, the
    /// common case, have none, and the branch predicts them, so the loads still overlap).
    pub(crate) fn prefetch_removals(&self, blocks: &[BlockId]) {
        let stored = &self.stored;
        touch_all(blocks.iter().map(|&b| {
            let s = &stored[b as usize];
            if s.is_chained() {
                u64::from(s.next_copy)
            } else {
                self.map.home_word(s.hash)
            }
        }));
    }

    /// Enters full block `b` under `hash` in the map, as the first of its content's copies (the
    /// most recently written; the others follow). Refuses when `b` already holds indexed
    /// content, or when the map's entry for `hash` holds different content (a collision: the
    /// first content keeps it). `parent_block` (the block before `b` in its table, if known)
    /// gets `b` as its child hint unless a chained child holds that hint. Blocks after one
    /// entered [`Entered::New`] by the same admission go in with
    /// [`BlockIndex::insert_chained`] instead.
    #[inline]
    pub(crate) fn insert(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_block: Option<BlockId>,
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) -> Entered {
        debug_assert_eq!(token_ids.len(), self.block_size);
        if self.is_indexed(b) {
            return Entered::Refused;
        }
        // The chained child holding `parent_block`'s hint, if any: it keeps the hint.
        let mut held = parent_block.and_then(|p| self.chained_child(p));
        if let Some(c) = held.filter(|&c| self.stored[c as usize].hash == hash) {
            // A copy of a chained block: the chained one first gets a map entry, so that `b`
            // becomes its content's first copy as any new copy does (and takes the hint).
            self.promote(c);
            held = None;
        }
        let stored = &self.stored;
        let (next_copy, entered) = match self.map.probe(hash, |b| stored[b as usize].hash) {
            Probe::Vacant { slot } => {
                self.map.fill(slot, hash, b);
                (NO_BLOCK, Entered::New)
            }
            Probe::Found {
                slot,
                block: first_id,
            } => {
                if !self.stored_with(first_id, parent, token_ids, extra_key.as_deref()) {
                    return Entered::Refused;
                }
                // The new copy goes first: it is the most recently written.
                self.map.replace(slot, b);
                self.hide_and_promote_child(first_id);
                (first_id, Entered::Copy)
            }
        };
        self.write_record(b, hash, parent, extra_key, next_copy, None, token_ids);
        if let Some(p) = parent_block {
            if held.is_none() {
                self.stored[p as usize].child = b;
            }
        }
        entered
    }

    /// Enters block `b` chained to block `p` (see the module docs): `p`, indexed under
    /// `parent`, is the block entered just before in the same admission, as new content (by
    /// [`BlockIndex::insert`], [`Entered::New`]) or chained, and `b` is that admission's fresh
    /// block after it. Nothing anywhere holds `b`'s content then, so it is new content, and
    /// `p` is visible with a free hint. None of `insert`'s checks: a prompt that misses the
    /// cache enters all but its first new block here.
    #[inline(always)]
    pub(crate) fn insert_chained(
        &mut self,
        p: BlockId,
        b: BlockId,
        parent: BlockHash,
        hash: BlockHash,
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
    ) {
        debug_assert!(
            self.holds(p, parent)
                && self.stored[p as usize].visible
                && self.stored[p as usize].child == NO_BLOCK,
            "block {p} was not just entered as new content"
        );
        debug_assert!(!self.is_indexed(b), "fresh block {b} is indexed");
        self.write_record(
            b,
            hash,
            Some(parent),
            extra_key,
            NO_BLOCK,
            Some(p),
            token_ids,
        );
        self.stored[p as usize].child = b;
        self.num_chained += 1;
    }

    /// Indexes block `b` as the visible copy of its content (chained to `chained_to`, or
    /// with a map entry whose next copy is `next_copy`) and copies its token ids.
    ///
    /// The fields are stored one by one, in place. A whole `Stored` assigned at once was built
    /// on the stack and copied in 16-byte loads spanning two of its 8-byte stores, which
    /// cannot be forwarded: each such load waited until every older store had reached the
    /// cache, the previous blocks' cold record and token lines included (measured in
    /// benches/results/2026-12-02-prefix-admission.md, "records written in place").
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn write_record(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        extra_key: &Option<Arc<[u8]>>,
        next_copy: BlockId,
        chained_to: Option<BlockId>,
        token_ids: &[TokenId],
    ) {
        self.indexed[b as usize] = true;
        let s = &mut self.stored[b as usize];
        s.hash = hash;
        s.parent = parent.unwrap_or(0);
        s.has_parent = parent.is_some();
        s.extra_key.clone_from(extra_key);
        s.next_copy = next_copy;
        // New content: hints to the children of the block's previous content are void.
        s.child = NO_BLOCK;
        s.visible = true;
        s.chained_to = chained_to.unwrap_or(NO_BLOCK);
        s.group = 0;
        s.caller_hash = false;
        let at = b as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(token_ids);
    }

    /// Takes block `b` out of the index (its other copies stay); returns the hash it was
    /// indexed under, if any. A chained block leaves without touching the map.
    #[inline(always)]
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let h = self.hash_of(b)?;
        // Its chained child would be cut off: it gets a map entry (see the module docs).
        let orphan = self.chained_child(b);
        self.indexed[b as usize] = false;
        let s = &mut self.stored[b as usize];
        let next = std::mem::replace(&mut s.next_copy, NO_BLOCK);
        s.has_parent = false;
        s.visible = false;
        s.extra_key = None;
        if std::mem::replace(&mut s.chained_to, NO_BLOCK) != NO_BLOCK {
            self.num_chained -= 1;
        } else {
            self.unmap(b, h, next);
        }
        if let Some(c) = orphan {
            self.promote(c);
        }
        Some(h)
    }

    /// Takes `b` (with a map entry under `h`, followed by copy `next`) out of the map's copies.
    #[inline(never)]
    fn unmap(&mut self, b: BlockId, h: BlockHash, next: BlockId) {
        let stored = &self.stored;
        // A block with a map entry has its hash in the map (`check_invariants`).
        let Probe::Found { slot, block: first } = self.map.probe(h, |b| stored[b as usize].hash)
        else {
            return;
        };
        if first == b {
            if next == NO_BLOCK {
                self.map.remove_at(slot);
            } else {
                self.map.replace(slot, next);
                self.stored[next as usize].visible = true;
            }
        } else {
            // Unlink `b` from the copies (lists are short: one per independent computation).
            let mut at = first;
            while self.stored[at as usize].next_copy != b {
                at = self.stored[at as usize].next_copy;
            }
            self.stored[at as usize].next_copy = next;
        }
    }

    /// Map-entered block `f` stops being its content's first copy (a newer copy went in front
    /// of it): walks no longer reach it, so its chained child, if any, gets a map entry.
    #[inline]
    fn hide_and_promote_child(&mut self, f: BlockId) {
        if let Some(c) = self.hide_detaching_child(f) {
            self.promote(c);
        }
    }

    /// Hides `f` (clears its `visible` flag) and returns its chained child, which that cuts
    /// off: the caller promotes it.
    #[inline]
    fn hide_detaching_child(&mut self, f: BlockId) -> Option<BlockId> {
        let orphan = self.chained_child(f);
        self.stored[f as usize].visible = false;
        orphan
    }

    /// Gives chained block `c` a map entry, as its content's first copy (it is the most
    /// recently written: a copy entered since would have promoted it first). A copy already in
    /// the map (entered where `c`'s chain was not visible) goes behind it, and its own chained
    /// child, if any, is promoted in turn: a loop, not recursion, since such a run of hidden
    /// copies can be as long as a sequence.
    #[cold]
    fn promote(&mut self, mut c: BlockId) {
        loop {
            debug_assert!(
                self.stored[c as usize].is_chained(),
                "block {c} is not chained"
            );
            self.num_chained -= 1;
            let s = &mut self.stored[c as usize];
            s.chained_to = NO_BLOCK;
            let h = s.hash;
            let stored = &self.stored;
            match self.map.probe(h, |b| stored[b as usize].hash) {
                Probe::Vacant { slot } => {
                    self.map.fill(slot, h, c);
                    return;
                }
                Probe::Found { slot, block: first } => {
                    self.map.replace(slot, c);
                    self.stored[c as usize].next_copy = first;
                    match self.hide_detaching_child(first) {
                        Some(orphan) => c = orphan,
                        None => return,
                    }
                }
            }
        }
    }

    /// The index's invariants, the one place they are stated (docs/design.md, Invariants 5);
    /// called from the manager's `check_invariants` through `PrefixCache::check`:
    ///
    /// 1. The map's slots are consistent, and each entry's copies (`next_copy` from the
    ///    entry's block) are distinct indexed blocks under the entry's hash, none chained;
    ///    exactly the first of them is visible.
    /// 2. Each indexed block's hash is the hash of what it was stored with (parent hash,
    ///    tokens, extra key).
    /// 3. A chained block `c` is indexed and visible, has no next copy, and its `chained_to`
    ///    block `p` is indexed and visible with `p.child == c` and `p`'s hash as `c`'s parent
    ///    hash (the rule the module docs argue from).
    /// 4. No block outside the index is flagged visible or chained, and every indexed block is
    ///    reached by 1 or 3 (`len` counts the map's entries and the chained blocks).
    pub(crate) fn check_invariants(&self, hasher: &BlockHasher) -> Result<(), String> {
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
                if s.visible != (b == first) {
                    return Err(format!("block {b}: visible flag disagrees with the map"));
                }
                if s.is_chained() {
                    return Err(format!("chained block {b} is in the map's copies"));
                }
                self.check_hash(hasher, b, "indexed")?;
                b = s.next_copy;
            }
        }
        let stray = self
            .stored
            .iter()
            .zip(&self.indexed)
            .position(|(s, &indexed)| !indexed && (s.visible || s.is_chained()));
        if let Some(b) = stray {
            return Err(format!(
                "block {b} is flagged visible or chained but not indexed"
            ));
        }
        let mut chained = 0usize;
        for (c, s) in self.stored.iter().enumerate() {
            if !s.is_chained() {
                continue;
            }
            chained += 1;
            let c = c as BlockId;
            let p = s.chained_to;
            let reachable = self.is_indexed(c)
                && s.visible
                && s.next_copy == NO_BLOCK
                && self.stored.get(p as usize).is_some_and(|ps| {
                    self.is_indexed(p) && ps.visible && ps.child == c && s.parent() == Some(ps.hash)
                });
            if !reachable {
                return Err(format!("chained block {c} is not reachable from block {p}"));
            }
            self.check_hash(hasher, c, "chained")?;
        }
        if chained != self.num_chained {
            return Err(format!(
                "{chained} blocks chained, counted {}",
                self.num_chained
            ));
        }
        let indexed = self.indexed.iter().filter(|&&i| i).count();
        if indexed != copies + chained {
            return Err(format!(
                "{indexed} blocks carry a hash but the index reaches {}",
                copies + chained
            ));
        }
        Ok(())
    }

    /// Invariant 2 for block `b` (`what` names its kind in the error): its key is its group's
    /// key of the hash of what it was stored with, unless the caller supplied the hash.
    fn check_hash(&self, hasher: &BlockHasher, b: BlockId, what: &str) -> Result<(), String> {
        let s = &self.stored[b as usize];
        if s.caller_hash {
            return Ok(());
        }
        let recomputed = hasher.hash_block(s.parent(), self.tokens_of(b), s.extra_key.as_deref());
        if group_key(u32::from(s.group), recomputed) != s.hash {
            return Err(format!("{what} block {b}: hash does not match its tokens"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 2;

    /// An index of 8 blocks of 2 tokens and the hasher its hashes come from; each method
    /// enters one block, checks the invariants and returns the block's hash.
    struct Fixture {
        idx: BlockIndex,
        hasher: BlockHasher,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                idx: BlockIndex::new(8, BS),
                hasher: BlockHasher::new(7),
            }
        }

        /// Enters `b` holding `tokens` after `parent` (its hash and, if any, its block).
        fn enter(
            &mut self,
            b: BlockId,
            parent: Option<(BlockHash, Option<BlockId>)>,
            tokens: &[TokenId],
        ) -> (BlockHash, Entered) {
            let parent_hash = parent.map(|(h, _)| h);
            let parent_block = parent.and_then(|(_, p)| p);
            let h = self.hasher.hash_block(parent_hash, tokens, None);
            let entered = self
                .idx
                .insert(b, h, parent_hash, parent_block, tokens, &None);
            self.idx.check_invariants(&self.hasher).unwrap();
            (h, entered)
        }

        /// A first block (no parent), new content.
        fn root(&mut self, b: BlockId, tokens: &[TokenId]) -> BlockHash {
            let (h, entered) = self.enter(b, None, tokens);
            assert_eq!(entered, Entered::New, "block {b}");
            h
        }

        /// `b` chained after block `p` (indexed under `parent`, just entered as new content):
        /// new content.
        fn chained(
            &mut self,
            b: BlockId,
            parent: BlockHash,
            p: BlockId,
            tokens: &[TokenId],
        ) -> BlockHash {
            let h = self.hasher.hash_block(Some(parent), tokens, None);
            self.idx.insert_chained(p, b, parent, h, tokens, &None);
            self.idx.check_invariants(&self.hasher).unwrap();
            h
        }

        fn is_chained(&self, b: BlockId) -> bool {
            self.idx.stored[b as usize].is_chained()
        }
    }

    #[test]
    fn chained_blocks_are_found_through_their_parent_only() {
        let mut f = Fixture::new();
        let h0 = f.root(0, &[1, 2]);
        let h1 = f.chained(1, h0, 0, &[3, 4]);
        assert!(f.is_chained(1) && !f.is_chained(0));
        assert_eq!(f.idx.len(), 2);
        assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((1, h1)));
        // No map entry: a lookup by hash alone does not find it.
        assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), None);
        // A second child of block 0 (entered by a later admission) gets a map entry and leaves
        // the hint with the chained one.
        let (h2, entered) = f.enter(2, Some((h0, Some(0))), &[5, 6]);
        assert_eq!(entered, Entered::New);
        assert!(!f.is_chained(2));
        assert_eq!(f.idx.lookup(h2, Some(h0), &[5, 6], None), Some(2));
        assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((1, h1)));
        // Leaving the index, a chained block touches no map entry.
        assert_eq!(f.idx.remove(1), Some(h1));
        assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), None);
        f.idx.check_invariants(&f.hasher).unwrap();
        assert_eq!(f.idx.len(), 2);
    }

    #[test]
    fn removing_a_parent_promotes_its_chained_child() {
        let mut f = Fixture::new();
        let h0 = f.root(0, &[1, 2]);
        let h1 = f.chained(1, h0, 0, &[3, 4]);
        let h2 = f.chained(2, h1, 1, &[5, 6]);
        assert!(f.is_chained(1) && f.is_chained(2));
        // Out of least-recently-used order: the head first. Its child gets a map entry and keeps
        // its own chained child (it is visible: the map's first copy).
        assert_eq!(f.idx.remove(0), Some(h0));
        f.idx.check_invariants(&f.hasher).unwrap();
        assert!(!f.is_chained(1) && f.is_chained(2));
        assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(1));
        assert_eq!(f.idx.lookup_child(1, h1, &[5, 6], None), Some((2, h2)));
    }

    #[test]
    fn a_copy_of_a_chained_block_promotes_it_then_goes_first() {
        let mut f = Fixture::new();
        let h0 = f.root(0, &[1, 2]);
        let h1 = f.chained(1, h0, 0, &[3, 4]);
        // The same content recomputed after the same parent block (a prompt's last full block):
        // block 1 gets a map entry first, and block 2, the newest copy, goes in front of it.
        assert_eq!(
            f.enter(2, Some((h0, Some(0))), &[3, 4]),
            (h1, Entered::Copy)
        );
        assert!(!f.is_chained(1));
        assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(2));
        assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((2, h1)));
        assert_eq!(f.idx.remove(2), Some(h1));
        assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(1));
        f.idx.check_invariants(&f.hasher).unwrap();
    }

    #[test]
    fn a_newer_copy_of_the_parent_promotes_the_chained_child() {
        let mut f = Fixture::new();
        let h0 = f.root(0, &[1, 2]);
        let h1 = f.chained(1, h0, 0, &[3, 4]);
        // Block 3 holds block 0's content and goes in front of it: walks now reach block 3,
        // whose hint does not name block 1, so block 1 needs its map entry.
        assert_eq!(f.enter(3, None, &[1, 2]), (h0, Entered::Copy));
        assert!(!f.is_chained(1));
        assert_eq!(f.idx.lookup_child(3, h0, &[3, 4], None), None);
        assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(1));
    }

    #[test]
    fn a_promoted_block_goes_in_front_of_a_mapped_copy() {
        // A copy of content K entered where its chain was not visible (after a parent block
        // that is not indexed, as a swapped-in sequence's blocks are not) has a map entry; a
        // chained copy entered later is newer, so promoting it puts it first, and the mapped
        // copy, now hidden, promotes its own chained child.
        let mut f = Fixture::new();
        let h0 = f.root(0, &[1, 2]);
        let (hk, entered) = f.enter(5, Some((h0, None)), &[3, 4]);
        assert_eq!(entered, Entered::New);
        let hl = f.chained(6, hk, 5, &[5, 6]);
        assert!(f.is_chained(6));
        assert_eq!(f.chained(1, h0, 0, &[3, 4]), hk);
        assert!(f.is_chained(1));
        // A newer copy of block 0's content hides block 0: block 1 is promoted in front of
        // block 5, which promotes block 6.
        assert_eq!(f.enter(3, None, &[1, 2]), (h0, Entered::Copy));
        assert!(!f.is_chained(1) && !f.is_chained(6));
        assert_eq!(f.idx.lookup(hk, Some(h0), &[3, 4], None), Some(1));
        assert_eq!(f.idx.lookup(hl, Some(hk), &[5, 6], None), Some(6));
        assert_eq!(f.idx.remove(1), Some(hk));
        assert_eq!(f.idx.lookup(hk, Some(h0), &[3, 4], None), Some(5));
        f.idx.check_invariants(&f.hasher).unwrap();
    }
}

/// The model test: random sequences of admissions (a walk, then the new blocks entered as the
/// manager enters them, the run after a new one chained), decode-time registrations (after a
/// visible, hidden or unindexed parent block), removals and walks, each answer compared with a
/// plain map that indexes every block, newest copy first, and `check_invariants` after every
/// step.
#[cfg(test)]
mod model;
