//! The index's invariants, the one place they are stated (docs/design.md, Invariants 5), and
//! the exact rebuild of the orphan parents that keeps that set bounded.

use rustc_hash::{FxHashMap, FxHashSet};

use super::{BlockIndex, NO_BLOCK};
use crate::prefix::hash::{content_hash, group_key, BlockHash, BlockHasher};
use crate::BlockId;

impl BlockIndex {
    /// Indexed blocks and the hash each is indexed under.
    fn indexed_blocks(&self) -> impl Iterator<Item = (BlockId, BlockHash)> + '_ {
        self.indexed
            .iter()
            .enumerate()
            .filter(|(_, &i)| i)
            .map(|(b, _)| (b as BlockId, self.stored[b].hash))
    }

    /// Recomputes the orphan parents exactly (module docs of `index.rs`): the parent hash of
    /// every indexed block whose parent content is not indexed; a block holding the parent
    /// content that does not have the child as its hint is flagged as having many children.
    /// O(indexed blocks), run once the set has grown past twice the pool's size, so amortized
    /// O(1) per entry added.
    #[cold]
    pub(super) fn rebuild_orphan_parents(&mut self) {
        let by_hash: FxHashMap<BlockHash, BlockId> =
            self.indexed_blocks().map(|(b, h)| (h, b)).collect();
        let mut orphans = FxHashSet::default();
        for c in 0..self.stored.len() {
            let s = &self.stored[c];
            if !self.indexed[c] || !s.has_parent {
                continue;
            }
            match by_hash.get(&s.parent) {
                Some(&q) if self.stored[q as usize].child != c as BlockId => {
                    self.stored[q as usize].many_children = true;
                }
                Some(_) => {}
                None => {
                    orphans.insert(s.parent);
                }
            }
        }
        self.orphan_parents = orphans;
    }

    /// The index's invariants; called from the manager's `check_invariants` through
    /// `PrefixCache::check`:
    ///
    /// 1. The map's slots are consistent, and each names an indexed, unchained block under the
    ///    slot's hash.
    /// 2. Each indexed block's hash is the hash of what it was stored with (parent hash,
    ///    tokens, extra key).
    /// 3. A chained block `c` is indexed, and its `chained_to` block `p` is indexed with
    ///    `p.child == c` and `p`'s hash as `c`'s parent hash (the rule the module docs argue
    ///    from).
    /// 4. No block outside the index is flagged chained, and every indexed block is reached by
    ///    1 or 3 (`len` counts the map's entries and the chained blocks).
    /// 5. One copy per content: no two indexed blocks share a hash (both would be visible to
    ///    walks, and the events report the content once).
    /// 6. Every indexed block with a parent is tracked: the block holding its parent content
    ///    has it as its hint or is flagged with many children, or its parent hash is among the
    ///    orphan parents (what makes chaining without a look-up sound).
    pub(crate) fn check_invariants(&self, hasher: &BlockHasher) -> Result<(), String> {
        let stored = &self.stored;
        // A corrupted slot may name a block out of range: its "hash" is then 0, which its tag
        // contradicts, so the check reports it instead of indexing out of bounds.
        let hash_of = |b: BlockId| stored.get(b as usize).map_or(0, |s| s.hash);
        self.map.check(hash_of)?;
        let mut mapped = 0usize;
        for b in self.map.blocks() {
            let s = self
                .stored
                .get(b as usize)
                .ok_or(format!("index names block {b} out of range"))?;
            if !self.is_indexed(b) {
                return Err(format!("the map names block {b}, which is not indexed"));
            }
            if s.is_chained() {
                return Err(format!("chained block {b} has a map entry"));
            }
            mapped += 1;
        }
        let stray =
            (0..self.stored.len()).find(|&b| !self.indexed[b] && self.stored[b].is_chained());
        if let Some(b) = stray {
            return Err(format!("block {b} is flagged chained but not indexed"));
        }
        if self.by_hash && self.num_chained != 0 {
            return Err(format!(
                "{} chained blocks while content is looked up by hash",
                self.num_chained
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
            let reachable = self.stored.get(p as usize).is_some_and(|ps| {
                self.is_indexed(p) && ps.child == c && s.parent() == Some(ps.hash)
            });
            if !reachable {
                return Err(format!("chained block {c} is not reachable from block {p}"));
            }
        }
        if chained != self.num_chained {
            return Err(format!(
                "{chained} blocks chained, counted {}",
                self.num_chained
            ));
        }
        let mut by_hash: FxHashMap<BlockHash, BlockId> = FxHashMap::default();
        for (b, h) in self.indexed_blocks() {
            self.check_hash(hasher, b)?;
            if let Some(other) = by_hash.insert(h, b) {
                return Err(format!(
                    "two indexed copies of content {h:#x}: blocks {other} and {b}"
                ));
            }
        }
        if by_hash.len() != mapped + chained {
            return Err(format!(
                "{} blocks carry a hash but the index reaches {}",
                by_hash.len(),
                mapped + chained
            ));
        }
        for (&c, s) in by_hash.values().map(|b| (b, &self.stored[*b as usize])) {
            if !s.has_parent || self.orphan_parents.contains(&s.parent) {
                continue;
            }
            let tracked = by_hash.get(&s.parent).is_some_and(|&q| {
                let qs = &self.stored[q as usize];
                qs.child == c || qs.many_children
            });
            if !tracked {
                return Err(format!(
                    "block {c} is an untracked child of content {:#x} (no block holding it \
                     tracks it, and it is not among the orphan parents)",
                    s.parent
                ));
            }
        }
        debug_assert!(by_hash.values().all(|&b| b != NO_BLOCK));
        Ok(())
    }

    /// Invariant 2 for block `b`: its key is its group's key of the hash of what it was stored
    /// with, unless the caller supplied the hash.
    fn check_hash(&self, hasher: &BlockHasher, b: BlockId) -> Result<(), String> {
        let s = &self.stored[b as usize];
        if s.caller_hash {
            return Ok(());
        }
        // A group's blocks are stored under its keys, their parents' included.
        let g = u32::from(s.group);
        let parent = s.parent().map(|p| content_hash(g, p));
        let recomputed = hasher.hash_block(parent, self.tokens_of(b), s.extra_key.as_deref());
        if group_key(g, recomputed) != s.hash {
            return Err(format!("indexed block {b}: hash does not match its tokens"));
        }
        Ok(())
    }
}
