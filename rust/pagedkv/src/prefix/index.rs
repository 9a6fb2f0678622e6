//! The cached-block index: content hash -> the one block holding that content, with what each
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
//! **One indexed copy per content.** The same content may be computed on two physical blocks
//! (a prompt's last full block, which is always recomputed; a prompt whose chain the index lost
//! in the middle, as `truncate` does; a block filled after a swap-in). The index keeps one:
//! [`BlockIndex::insert`] finds the block holding the content already and keeps the copy that is
//! in use, so that it is shared: the other copy's holder, if cached-evictable, is replaced by
//! the new block (it leaves the index and goes back to the pool; no event, the content stays
//! stored), and if in use, the new block stays a private, unindexed block. So every content the
//! KV events report as stored sits on exactly one block that a walk reaches, and a hit is never
//! shorter than the events say (docs/design.md, One copy per content). vLLM's `BlockPool`
//! indexes every copy instead (`cached_block_hash_to_block`), and reports each as stored.
//!
//! **Chained blocks.** Admission walks a prompt's blocks from its first: the first by hash,
//! each later one through the block found for its parent (that block's child hint,
//! [`BlockIndex::lookup_child`]), by hash only when the hint does not match. The new blocks an
//! admission enters after its first new one are *chained* ([`BlockIndex::insert_chained`]):
//! no map entry, reachable through their parent block's hint alone, so an all-miss prompt
//! touches the map (a random line of a large table) once instead of once per block (measured
//! in benches/results/2026-12-02-prefix-admission.md, "chained runs"). A chained block `c` stays
//! chained only while its parent block `p` is indexed and `p.child == c`; `p` leaving the index
//! promotes `c` to a map entry first ([`BlockIndex::promote`]).
//!
//! Chaining block `c` after `p` without a lookup is sound only when no block holds `c`'s
//! content already. `p` was just entered as new content, so a block holding `c`'s content would
//! be an *orphan*: a child of `p`'s content indexed while that content was not (its parent left
//! the index, or it was entered after a block that is not the indexed copy of its parent).
//! Every orphan's parent hash is in [`BlockIndex::orphan_parents`]: each indexed block tracks
//! its children (its child hint, and a flag once it has had more than one), and a block leaving
//! the index with children, or a child entered under no tracking block, puts the parent hash
//! there. A chained run looks a block up by hash only when its parent hash is there (the set is
//! empty unless the index lost a chain in its middle); [`BlockIndex::check_invariants`] checks
//! the tracking (`index/check.rs`), and the model test (`index/model.rs`) compares every answer
//! with a plain map of one block per content.

use std::sync::Arc;

use rustc_hash::FxHashSet;

use super::hash::BlockHash;
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
    /// The block most recently indexed as this block's child (`NO_BLOCK`: none since it was
    /// indexed). A hint for walks, verified on use (it may since have left the index or been
    /// reused), and the child this block tracks (see the module docs). A chained child keeps it.
    child: BlockId,
    /// The block whose child hint alone reaches this block, while it is chained (no map
    /// entry; see the module docs); `NO_BLOCK` otherwise.
    chained_to: BlockId,
    /// Whether the block was stored with a parent (it is not the first of its chain).
    has_parent: bool,
    /// Whether children of this block's content other than `child` may be indexed (a second
    /// child was entered, or a copy it replaced had some): when it leaves the index, its hash
    /// joins the orphan parents. False while the block is not indexed.
    many_children: bool,
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

/// No block (no block has this id: pools hold fewer than 2^24 blocks).
const NO_BLOCK: BlockId = BlockId::MAX;

/// What [`BlockIndex::insert`] did with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entered {
    /// Not entered: the block holds indexed content already, or its hash names other content
    /// (a collision: the first content keeps it).
    Refused,
    /// Entered as content indexed nowhere else (the caller reports it as `BlockStored`).
    New,
    /// The content is indexed on another block that is in use: this block stays a private,
    /// unindexed block (no event: the content is stored already).
    Duplicate,
    /// The content was indexed on this cached-evictable block: the new block took its place in
    /// the index (no event: the content stays stored), and the caller returns the old one,
    /// which left the index, to the pool.
    Replaced(BlockId),
}

impl Entered {
    /// Whether the block entered the index as new content (the caller reports it as
    /// `BlockStored`).
    #[inline]
    pub(crate) fn is_new(self) -> bool {
        self == Entered::New
    }
}

impl Default for Stored {
    fn default() -> Self {
        Stored {
            hash: 0,
            parent: 0,
            extra_key: None,
            child: NO_BLOCK,
            chained_to: NO_BLOCK,
            has_parent: false,
            many_children: false,
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
/// indexed (docs/design.md, Invariants 5), each content on one block.
#[derive(Debug)]
pub(crate) struct BlockIndex {
    block_size: usize,
    /// Content hash -> the block holding that content, for every indexed block that is not
    /// chained.
    map: HashSlots,
    /// Per block id of the pool.
    stored: Vec<Stored>,
    /// Per block id: whether the block is indexed (on the map, or chained). Apart from the
    /// records so that freeing a sequence, which asks this of every block, reads one byte per
    /// block (64 KB for 65,536 blocks, stays in L2) instead of each block's cold record line.
    indexed: Vec<bool>,
    /// The token ids each indexed block was stored with: block `b`'s are
    /// `tokens[b * block_size..][..block_size]` (stale once it leaves the index).
    tokens: Vec<TokenId>,
    /// Chained blocks (indexed without a map entry).
    num_chained: usize,
    /// Parent hashes whose children may be orphans (see the module docs): a superset of the
    /// parent hash of every indexed block that no indexed block holding its parent content
    /// tracks. Rebuilt exactly once it holds more entries than the pool has blocks.
    orphan_parents: FxHashSet<BlockHash>,
    /// Whether content is looked up by its hash alone (`index/by_hash.rs`): then no block is
    /// chained, every indexed block has a map entry.
    by_hash: bool,
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
            orphan_parents: FxHashSet::default(),
            by_hash: false,
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
    /// its hash was computed from; whether it is still indexed is the caller's to check). The
    /// token ids are compared last: their slice is formed only when the rest matches.
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

    /// Indexed blocks (one per content): map entries and chained blocks.
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

    /// Whether `p`'s child hint names an indexed child of `p`'s content (`p` indexed under
    /// `hash`).
    #[inline]
    fn has_hinted_child(&self, p: BlockId, hash: BlockHash) -> bool {
        let c = self.stored[p as usize].child;
        self.stored
            .get(c as usize)
            .is_some_and(|s| self.indexed[c as usize] && s.has_parent && s.parent == hash)
    }

    #[inline]
    pub(crate) fn is_indexed(&self, b: BlockId) -> bool {
        self.indexed[b as usize]
    }

    /// The hash block `b` is indexed under, if it is.
    #[inline]
    pub(crate) fn hash_of(&self, b: BlockId) -> Option<BlockHash> {
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
    pub(crate) fn content(&self, b: BlockId) -> Option<super::eviction::Content<'_>> {
        let hash = self.hash_of(b)?;
        let s = &self.stored[b as usize];
        Some(super::eviction::Content {
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

    /// Whether the index may hold orphans at all (see the module docs): while it does not, a
    /// chained run needs no look-up.
    #[inline]
    pub(crate) fn may_have_orphans(&self) -> bool {
        !self.orphan_parents.is_empty()
    }

    /// Whether children of content `parent` may be indexed that no block holding `parent`
    /// tracks: a block chained after one just entered as `parent` must be entered with
    /// [`Self::insert`] instead, which looks its content up.
    #[inline]
    pub(crate) fn may_have_orphans_of(&self, parent: BlockHash) -> bool {
        self.orphan_parents.contains(&parent)
    }

    /// The block holding exactly this content (same hash, parent, extra key and tokens), if it
    /// has a map entry (a chained block is found through its parent, [`Self::lookup_child`]).
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
    /// Returns the block and its hash; `None` when the hint is missing or stale (the caller
    /// then hashes and looks up). Always inlined (see `PrefixCache::lookup_child`).
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
        // `stored_with` spelled out: as a call, even inlined, every hint of a hit walk cost
        // more instructions (`prefix_w2`). The model test checks this against `lookup`.
        let same = self.is_indexed(c)
            && s.parent() == Some(parent)
            && s.extra_key.as_deref() == extra_key
            && self.tokens_of(c) == token_ids;
        same.then_some((c, s.hash))
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
        touch_all(blocks.iter().map(|&b| u64::from(stored[b as usize].child)));
    }

    /// Loads the records of `blocks`, about to be removed, and the home slots of those with a
    /// map entry, in one pass (a slot's address comes from its record; chained blocks, the
    /// common case, have none, and the branch predicts them, so the loads still overlap).
    #[inline]
    pub(crate) fn prefetch_removals(&self, blocks: &[BlockId]) {
        let stored = &self.stored;
        touch_all(blocks.iter().map(|&b| {
            let s = &stored[b as usize];
            if s.is_chained() {
                u64::from(s.child)
            } else {
                self.map.home_word(s.hash)
            }
        }));
    }

    /// The indexed block holding the content whose chain of hashes is `chain` (its own hash
    /// last), reached as a walk would: the deepest of them with a map entry, then the chained
    /// children below it. `None` when the content is not indexed. Reads at most one map slot
    /// per hash; used only for a block entered after one that is not the indexed copy of its
    /// parent.
    fn holder(&self, chain: &[BlockHash]) -> Option<BlockId> {
        let stored = &self.stored;
        let (k, mut q) = chain
            .iter()
            .enumerate()
            .rev()
            .find_map(|(k, &h)| self.map.get(h, |b| stored[b as usize].hash).map(|b| (k, b)))?;
        for &h in &chain[k + 1..] {
            q = self
                .chained_child(q)
                .filter(|&c| stored[c as usize].hash == h)?;
        }
        Some(q)
    }

    /// Enters full block `b` under `hash` (see the module docs). `parent_block` is the block
    /// before `b` in its table (`None` for the first); `chain` the hashes of the blocks before
    /// it in its chain (`chain.last() == parent`), read only when `parent_block` is not the
    /// indexed copy of its parent. When another block holds the content, `in_use(x)` says
    /// whether that block `x` is in use (else it is cached-evictable): see [`Entered`].
    /// Blocks after one entered [`Entered::New`] by the same admission go in with
    /// [`BlockIndex::insert_chained`] instead, unless their parent hash may have orphans.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_block: Option<BlockId>,
        chain: &[BlockHash],
        token_ids: &[TokenId],
        extra_key: &Option<Arc<[u8]>>,
        in_use: impl Fn(BlockId) -> bool,
    ) -> Entered {
        debug_assert_eq!(token_ids.len(), self.block_size);
        if self.is_indexed(b) {
            return Entered::Refused;
        }
        // The indexed block holding the parent content: the table's block before, unless that
        // is a private or unindexed copy (then looked up through the chain's hashes).
        let holder = match (parent, parent_block) {
            (None, _) => None,
            (Some(ph), Some(pb)) if self.holds(pb, ph) => Some(pb),
            (Some(_), _) => self.holder(chain),
        };
        // The block holding this content already, if any: the holder's chained child, else
        // the map's entry (else the empty slot it would take).
        let chained = holder
            .and_then(|q| self.chained_child(q))
            .filter(|&c| self.stored[c as usize].hash == hash);
        let stored = &self.stored;
        let existing = match chained {
            Some(c) => Ok(c),
            None => match self.map.probe(hash, |b| stored[b as usize].hash) {
                Probe::Found { block, .. } => Ok(block),
                Probe::Vacant { slot } => Err(slot),
            },
        };
        match existing {
            Ok(x) => {
                if !self.stored_with(x, parent, token_ids, extra_key.as_deref()) {
                    return Entered::Refused;
                }
                if in_use(x) {
                    // Walks after `b`'s private copy find `x` by hash in one probe.
                    if self.stored[x as usize].is_chained() {
                        self.promote(x);
                    }
                    return Entered::Duplicate;
                }
                self.replace(x, b, holder, token_ids);
                Entered::Replaced(x)
            }
            Err(slot) => {
                self.map.fill(slot, hash, b);
                self.write_record(b, hash, parent, extra_key, None, token_ids);
                match (parent, holder) {
                    (Some(_), Some(q)) => self.track_child(q, b),
                    (Some(ph), None) => self.add_orphan_parent(ph),
                    (None, _) => {}
                }
                Entered::New
            }
        }
    }

    /// Indexed block `q` gets `c`, just entered after it, as a tracked child: the hint, unless
    /// a chained child holds it or another indexed child had it (then `q` has many children).
    #[inline]
    fn track_child(&mut self, q: BlockId, c: BlockId) {
        let h = self.stored[q as usize].hash;
        if self.chained_child(q).is_some() {
            self.stored[q as usize].many_children = true;
            return;
        }
        if self.stored[q as usize].child != c && self.has_hinted_child(q, h) {
            self.stored[q as usize].many_children = true;
        }
        self.stored[q as usize].child = c;
    }

    /// `b` takes cached-evictable `x`'s place in the index (same content, `token_ids`): its
    /// map entry or its place in its parent's chain (`holder`: the block holding the parent
    /// content), and the children `x` tracked. `x` leaves the index; nothing else changes.
    fn replace(&mut self, x: BlockId, b: BlockId, holder: Option<BlockId>, token_ids: &[TokenId]) {
        let s = &self.stored[x as usize];
        let (hash, parent, child, many) = (s.hash, s.parent(), s.child, s.many_children);
        let chained_to = s.is_chained().then_some(s.chained_to);
        if chained_to.is_none() {
            let stored = &self.stored;
            if let Probe::Found { slot, .. } = self.map.probe(hash, |b| stored[b as usize].hash) {
                self.map.replace(slot, b);
            }
        }
        let extra_key = std::mem::take(&mut self.stored[x as usize]).extra_key;
        self.indexed[x as usize] = false;
        self.write_record(b, hash, parent, &extra_key, chained_to, token_ids);
        let s = &mut self.stored[b as usize];
        s.child = child;
        s.many_children = many;
        if let Some(c) = self.stored.get_mut(child as usize) {
            if c.chained_to == x {
                c.chained_to = b;
            }
        }
        if let Some(q) = chained_to.or(holder) {
            if self.stored[q as usize].child == x {
                self.stored[q as usize].child = b;
            }
        }
    }

    /// Enters block `b` chained to block `p` (see the module docs): `p`, indexed under
    /// `parent`, is the block entered just before in the same admission as new content (by
    /// [`BlockIndex::insert`], [`Entered::New`], or chained), `b` is that admission's fresh
    /// block after it, and `parent` has no orphans ([`Self::may_have_orphans_of`]). Nothing
    /// anywhere holds `b`'s content then, so it is new content, and `p`'s hint is free. None
    /// of `insert`'s checks: a prompt that misses the cache enters all but its first new block
    /// here.
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
            self.holds(p, parent) && self.stored[p as usize].child == NO_BLOCK,
            "block {p} was not just entered as new content"
        );
        debug_assert!(!self.is_indexed(b), "fresh block {b} is indexed");
        debug_assert!(
            !self.may_have_orphans_of(parent),
            "content after block {p} may be indexed"
        );
        self.write_record(b, hash, Some(parent), extra_key, Some(p), token_ids);
        self.stored[p as usize].child = b;
        self.num_chained += 1;
    }

    /// Indexes block `b` (chained to `chained_to`, or with a map entry the caller made) and
    /// copies its token ids.
    ///
    /// The fields are stored one by one, in place. A whole `Stored` assigned at once was built
    /// on the stack and copied in 16-byte loads spanning two of its 8-byte stores, which
    /// cannot be forwarded: each such load waited until every older store had reached the
    /// cache, the previous blocks' cold record and token lines included (measured in
    /// benches/results/2026-12-02-prefix-admission.md, "records written in place").
    #[inline(always)]
    fn write_record(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        extra_key: &Option<Arc<[u8]>>,
        chained_to: Option<BlockId>,
        token_ids: &[TokenId],
    ) {
        self.indexed[b as usize] = true;
        let s = &mut self.stored[b as usize];
        s.hash = hash;
        s.parent = parent.unwrap_or(0);
        s.has_parent = parent.is_some();
        s.extra_key.clone_from(extra_key);
        // New content: hints to the children of the block's previous content are void. (Its
        // `many_children` is false already: `remove` and `replace` clear it as a block leaves.)
        s.child = NO_BLOCK;
        debug_assert!(
            !s.many_children,
            "block {b} left the index with many children set"
        );
        s.chained_to = chained_to.unwrap_or(NO_BLOCK);
        s.group = 0;
        s.caller_hash = false;
        let at = b as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(token_ids);
    }

    /// Takes `b` out of the index; returns the hash it was indexed under, if any. A chained
    /// block leaves without touching the map; a block with children leaves its hash among the
    /// orphan parents (see the module docs).
    #[inline(always)]
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let h = self.hash_of(b)?;
        // Its chained child would be cut off: it gets a map entry (see the module docs).
        let orphan = self.chained_child(b);
        let children = self.stored[b as usize].many_children || self.has_hinted_child(b, h);
        self.indexed[b as usize] = false;
        let s = &mut self.stored[b as usize];
        s.has_parent = false;
        s.many_children = false;
        s.extra_key = None;
        if std::mem::replace(&mut s.chained_to, NO_BLOCK) != NO_BLOCK {
            self.num_chained -= 1;
        } else {
            self.unmap(h);
        }
        if let Some(c) = orphan {
            self.promote(c);
        }
        if children {
            self.add_orphan_parent(h);
        }
        if self.len() == 0 {
            // Nothing indexed: nothing can be an orphan.
            self.orphan_parents.clear();
        }
        Some(h)
    }

    /// Takes the map entry of `h` out (its block is leaving the index).
    #[inline(never)]
    fn unmap(&mut self, h: BlockHash) {
        let stored = &self.stored;
        // A block with a map entry has its hash in the map (`check_invariants`).
        if let Probe::Found { slot, .. } = self.map.probe(h, |b| stored[b as usize].hash) {
            self.map.remove_at(slot);
        }
    }

    /// Gives chained block `c` a map entry: its way in through its parent's hint is ending
    /// (or another copy of its content is being looked up by hash). Its content has no other
    /// block, so its hash has no entry.
    #[cold]
    fn promote(&mut self, c: BlockId) {
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
            Probe::Vacant { slot } => self.map.fill(slot, h, c),
            Probe::Found { .. } => debug_assert!(false, "content of block {c} indexed twice"),
        }
    }

    /// Records that children of content `parent` may be orphans; past twice as many entries
    /// as the pool has blocks (plus 64), the set is rebuilt exactly from the index
    /// (`index/check.rs`), which leaves at most one per indexed block: bounded, at amortized
    /// O(1) per entry.
    #[cold]
    fn add_orphan_parent(&mut self, parent: BlockHash) {
        self.orphan_parents.insert(parent);
        if self.orphan_parents.len() > 2 * self.stored.len() + 64 {
            self.rebuild_orphan_parents();
        }
    }
}

/// Look-ups of indexed content by its hash alone (no chained blocks from the first one on).
mod by_hash;

/// The index's invariants and the exact rebuild of the orphan parents.
mod check;

/// Unit tests of each rule of the index.
#[cfg(test)]
mod tests;

/// The model test: random sequences of admissions (a walk, then the new blocks entered as the
/// manager enters them, the run after a new one chained where no orphan forbids it),
/// decode-time registrations (after the indexed parent, a private or unindexed block, or none),
/// removals and walks, each answer compared with a plain map of one block per content, with
/// random in-use flags, and `check_invariants` after every step.
#[cfg(test)]
mod model;
