//! Live private duplicates of indexed content, and the hand-over of an index entry to one.
//!
//! One copy per content is indexed (module docs of `index.rs`): a block computing content that
//! a block in use holds stays private ([`super::Entered::Duplicate`]). Without more, that content
//! leaves the index once the indexed copy's last holder frees it and eviction reuses it, even
//! though a running request still holds the private copy: vLLM, which indexes every copy, keeps
//! the hit. So the index tracks such a block as a *duplicate* of the content while it is live,
//! and when the indexed copy leaves the index (evicted, reclaimed by a peer, or taken out in use
//! by `truncate`) [`BlockIndex::remove`] hands the entry to the oldest duplicate instead: the
//! duplicate takes the copy's map entry, its children and its place in the parent's hint, and
//! becomes the indexed, shared copy. The content stays stored, on one block: no event.
//!
//! **Why at eviction, not at release.** The move could happen as soon as the indexed copy's
//! refcount reaches 0 (it would go back to the free list at once). Done when the copy leaves the
//! index instead, every answer is vLLM's: until the copy is evicted, a hit revives it, as vLLM's
//! `get_cached_block` serves the first copy it indexed (a free block less, both sides), and the
//! copy is evicted in the same LRU position as vLLM's; after, the hit is on the duplicate, as
//! vLLM's is once it dropped the evicted copy. A release-time move would share the duplicate
//! where vLLM revives the cached copy, one free block more, which the scheduler differentials
//! see as a different admission. And the release path stays as it was: no flag is read when an
//! indexed block's refcount reaches 0; the eviction reads the victim's record anyway.
//!
//! **Cost.** The common path does not look at this file: a release reads the indexed byte per
//! block as before, and only a block that is not indexed and reaches refcount 0 reads its
//! duplicate byte (a freed sequence's partial last block, typically); only a duplicate takes the
//! cold untracking path. A removal reads the flag `flagged` of the record it writes
//! anyway. The map from content to duplicates is touched only when a duplicate is made,
//! untracked or handed the entry.
//!
//! The caller keeps the tracking exact: it untracks a duplicate whose refcount reaches 0 and one
//! whose content is about to change (a `truncate` into it), so every tracked duplicate is live,
//! private and holds the content it is tracked under (the manager's `check_invariants` checks
//! that against its tables, [`BlockIndex::check_duplicates`] the rest).

use super::{BlockIndex, Stored, NO_BLOCK};
use crate::prefix::hash::BlockHash;
use crate::BlockId;

impl BlockIndex {
    /// Tracks block `d`, just refused as a [`super::Entered::Duplicate`] of the content indexed on
    /// `x` (in use, with a map entry), with `holder` the block holding the parent content.
    #[cold]
    pub(super) fn track_duplicate(&mut self, x: BlockId, d: BlockId, holder: Option<BlockId>) {
        debug_assert!(self.is_indexed(x) && !self.stored[x as usize].is_chained());
        debug_assert!(!self.is_indexed(d) && !self.is_duplicate(d));
        let key = self.stored[x as usize].hash;
        self.dups.flagged[x as usize] = true;
        self.dups.duplicate[d as usize] = true;
        self.dups.by_key.entry(key).or_default().push(d);
        let hint = holder.unwrap_or(NO_BLOCK);
        self.dups.of_block.insert(d, (key, hint));
    }

    /// Stops tracking duplicate `d`: its refcount reached 0 or its content is about to change.
    /// The content's indexed block loses its flag with its last duplicate.
    #[cold]
    pub(crate) fn untrack_duplicate(&mut self, d: BlockId) {
        let Some((key, _)) = self.dups.of_block.remove(&d) else {
            debug_assert!(false, "block {d} is not a tracked duplicate");
            return;
        };
        self.dups.duplicate[d as usize] = false;
        let list = self
            .dups
            .by_key
            .get_mut(&key)
            .expect("a tracked duplicate's content has a list");
        list.retain(|&b| b != d);
        if list.is_empty() {
            self.dups.by_key.remove(&key);
            let stored = &self.stored;
            if let Some(x) = self.map.get(key, |b| stored[b as usize].hash) {
                self.dups.flagged[x as usize] = false;
            }
        }
    }

    /// Whether indexed block `b`'s content has tracked duplicates (it would hand its entry over
    /// rather than leave).
    #[inline]
    pub(crate) fn has_duplicates(&self, b: BlockId) -> bool {
        self.is_indexed(b) && self.dups.flagged[b as usize]
    }

    /// The content key duplicate `d` is tracked under, if it is one.
    pub(crate) fn duplicate_key(&self, d: BlockId) -> Option<BlockHash> {
        self.dups.of_block.get(&d).map(|&(key, _)| key)
    }

    /// Tracked duplicates, each once.
    pub(crate) fn duplicate_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.dups.of_block.keys().copied()
    }

    /// Indexed block `x`, flagged with duplicates, leaves the index: its oldest duplicate `d`
    /// takes its entry (map slot, record, children, the parent's hint); `x` is left unindexed
    /// with a cleared record, as [`BlockIndex::remove`] leaves a block.
    #[cold]
    pub(super) fn hand_over(&mut self, x: BlockId) {
        let key = self.stored[x as usize].hash;
        let list = self
            .dups
            .by_key
            .get_mut(&key)
            .expect("a block flagged with duplicates has a list");
        let d = list.remove(0);
        let more = !list.is_empty();
        if !more {
            self.dups.by_key.remove(&key);
        }
        let (_, hint) = self
            .dups
            .of_block
            .remove(&d)
            .expect("listed duplicates are tracked");
        debug_assert!(!self.stored[x as usize].is_chained());
        // The map slot: from `x` to `d`.
        let stored = &self.stored;
        if let super::Probe::Found { slot, .. } = self.map.probe(key, |b| stored[b as usize].hash) {
            self.map.replace(slot, d);
        }
        let bs = self.block_size;
        self.tokens
            .copy_within(x as usize * bs..(x as usize + 1) * bs, d as usize * bs);
        let old: Stored = std::mem::take(&mut self.stored[x as usize]);
        self.indexed[x as usize] = false;
        self.dups.duplicate[d as usize] = false;
        self.dups.flagged[x as usize] = false;
        self.dups.flagged[d as usize] = more;
        self.indexed[d as usize] = true;
        let s = &mut self.stored[d as usize];
        s.hash = key;
        s.parent = old.parent;
        s.has_parent = old.has_parent;
        s.extra_key = old.extra_key;
        s.child = old.child;
        s.chained_to = NO_BLOCK;
        s.many_children = old.many_children;
        s.group = old.group;
        s.caller_hash = old.caller_hash;
        // A chained child of `x` is reached through `d`'s hint now.
        if let Some(c) = self.stored.get_mut(old.child as usize) {
            if c.chained_to == x {
                c.chained_to = d;
            }
        }
        // The parent content's holder tracked `x` (as its hint, or with many children): it
        // tracks `d` in its place. Found through the hint taken when `d` was tracked, else
        // the map; a holder found neither way (chained, never a duplicate's predecessor) may
        // still name `x`, so the parent hash joins the orphan parents (a sound superset).
        if old.has_parent {
            let ph = old.parent;
            let q = Some(hint)
                .filter(|&q| q != NO_BLOCK && self.holds(q, ph))
                .or_else(|| {
                    let stored = &self.stored;
                    self.map.get(ph, |b| stored[b as usize].hash)
                });
            match q {
                Some(q) => {
                    if self.stored[q as usize].child == x {
                        self.stored[q as usize].child = d;
                    }
                }
                None => self.add_orphan_parent(ph),
            }
        }
    }

    /// Invariant 7 of [`BlockIndex::check_invariants`]: every tracked duplicate is marked in
    /// `duplicate` (and no other block is), is not indexed, is listed once under the key it is
    /// tracked with; every key with duplicates is indexed with a map entry on a block flagged
    /// `flagged`, and every flagged block has duplicates. (That each is live, private and
    /// holds that content is the manager's to check: it knows refcounts and tables.)
    pub(crate) fn check_duplicates(&self) -> Result<(), String> {
        let d = &*self.dups;
        let marked = d.duplicate.iter().filter(|&&m| m).count();
        if marked != d.of_block.len() {
            return Err(format!(
                "{marked} blocks marked duplicate, {} tracked",
                d.of_block.len()
            ));
        }
        let mut listed = 0usize;
        for (&key, list) in &d.by_key {
            if list.is_empty() {
                return Err(format!("content {key:#x} has an empty duplicate list"));
            }
            listed += list.len();
            for &b in list {
                if d.of_block.get(&b).map(|&(k, _)| k) != Some(key) {
                    return Err(format!(
                        "duplicate {b} listed under content {key:#x} but tracked otherwise"
                    ));
                }
                if !self.is_duplicate(b) || self.is_indexed(b) {
                    return Err(format!("duplicate {b} is not marked as one, or is indexed"));
                }
            }
            let stored = &self.stored;
            let Some(x) = self.map.get(key, |b| stored[b as usize].hash) else {
                return Err(format!(
                    "content {key:#x} has duplicates but no map entry in the index"
                ));
            };
            if !d.flagged[x as usize] {
                return Err(format!(
                    "block {x} holds content {key:#x}, which has duplicates, unflagged"
                ));
            }
        }
        if listed != d.of_block.len() {
            return Err(format!(
                "{listed} duplicates listed, {} tracked",
                d.of_block.len()
            ));
        }
        for (b, s) in self.stored.iter().enumerate() {
            let flagged = d.flagged[b];
            if flagged && (!self.is_indexed(b as BlockId) || !d.by_key.contains_key(&s.hash)) {
                return Err(format!(
                    "block {b} is flagged with duplicates but none are tracked"
                ));
            }
        }
        Ok(())
    }
}
