//! One test per rule of the index (`index.rs`): chained blocks, promotion, one copy per content
//! (replace a cached copy, keep the one in use), the holder found through a private parent, and
//! the orphan parents.

use std::collections::HashSet;

use super::*;
use crate::prefix::hash::BlockHasher;

const BS: usize = 2;

/// An index of 8 blocks of 2 tokens, the hasher its hashes come from, and which blocks are in
/// use; each method enters one block, checks the invariants and returns the block's hash.
struct Fixture {
    idx: BlockIndex,
    hasher: BlockHasher,
    in_use: HashSet<BlockId>,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            idx: BlockIndex::new(8, BS),
            hasher: BlockHasher::new(7),
            in_use: HashSet::new(),
        }
    }

    /// Enters `b` holding `tokens` after the blocks hashed `chain` (their last is the parent)
    /// with `parent_block` before it in its table.
    fn enter(
        &mut self,
        b: BlockId,
        chain: &[BlockHash],
        parent_block: Option<BlockId>,
        tokens: &[TokenId],
    ) -> (BlockHash, Entered) {
        let parent = chain.last().copied();
        let h = self.hasher.hash_block(parent, tokens, None);
        let in_use = self.in_use.clone();
        let entered = self
            .idx
            .insert(b, h, parent, parent_block, chain, tokens, &None, |x| {
                in_use.contains(&x)
            });
        self.idx.check_invariants(&self.hasher).unwrap();
        (h, entered)
    }

    /// A first block (no parent), new content.
    fn root(&mut self, b: BlockId, tokens: &[TokenId]) -> BlockHash {
        let (h, entered) = self.enter(b, &[], None, tokens);
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

    fn remove(&mut self, b: BlockId) -> Option<BlockHash> {
        let h = self.idx.remove(b);
        self.idx.check_invariants(&self.hasher).unwrap();
        h
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
    // the hint with the chained one: block 0 now has many children.
    let (h2, entered) = f.enter(2, &[h0], Some(0), &[5, 6]);
    assert_eq!(entered, Entered::New);
    assert!(!f.is_chained(2) && f.idx.stored[0].many_children);
    assert_eq!(f.idx.lookup(h2, Some(h0), &[5, 6], None), Some(2));
    assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((1, h1)));
    // Leaving the index, a chained block touches no map entry.
    assert_eq!(f.remove(1), Some(h1));
    assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), None);
    assert_eq!(f.idx.len(), 2);
}

#[test]
fn removing_a_parent_promotes_its_chained_child_and_records_an_orphan_parent() {
    let mut f = Fixture::new();
    let h0 = f.root(0, &[1, 2]);
    let h1 = f.chained(1, h0, 0, &[3, 4]);
    let h2 = f.chained(2, h1, 1, &[5, 6]);
    assert!(f.is_chained(1) && f.is_chained(2));
    assert!(!f.idx.may_have_orphans());
    // Out of least-recently-used order: the head first. Its child gets a map entry and keeps
    // its own chained child; the head's hash joins the orphan parents.
    assert_eq!(f.remove(0), Some(h0));
    assert!(!f.is_chained(1) && f.is_chained(2));
    assert!(f.idx.may_have_orphans_of(h0) && !f.idx.may_have_orphans_of(h1));
    assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(1));
    assert_eq!(f.idx.lookup_child(1, h1, &[5, 6], None), Some((2, h2)));
    // In least-recently-used order (tail first) no orphan is left and none is recorded.
    let mut g = Fixture::new();
    let g0 = g.root(0, &[1, 2]);
    let g1 = g.chained(1, g0, 0, &[3, 4]);
    g.remove(1);
    g.remove(0);
    assert!(!g.idx.may_have_orphans() && !g.idx.may_have_orphans_of(g1));
}

#[test]
fn a_copy_of_a_cached_block_replaces_it_in_the_index() {
    let mut f = Fixture::new();
    f.in_use.insert(0);
    let h0 = f.root(0, &[1, 2]);
    let h1 = f.chained(1, h0, 0, &[3, 4]);
    let h2 = f.chained(2, h1, 1, &[5, 6]);
    // Block 1 is cached-evictable: a recomputed copy after the same parent takes its place,
    // chained as it was, with its chained child.
    f.in_use.insert(3);
    let (h, entered) = f.enter(3, &[h0], Some(0), &[3, 4]);
    assert_eq!((h, entered), (h1, Entered::Replaced(1)));
    assert!(!f.idx.is_indexed(1) && f.is_chained(3));
    assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((3, h1)));
    assert_eq!(f.idx.lookup_child(3, h1, &[5, 6], None), Some((2, h2)));
    assert_eq!(f.idx.stored[2].chained_to, 3);
    assert_eq!(f.idx.len(), 3);
}

#[test]
fn a_copy_of_a_block_in_use_stays_private() {
    let mut f = Fixture::new();
    f.in_use.extend([0, 1]);
    let h0 = f.root(0, &[1, 2]);
    let h1 = f.chained(1, h0, 0, &[3, 4]);
    let (h, entered) = f.enter(3, &[h0], Some(0), &[3, 4]);
    assert_eq!((h, entered), (h1, Entered::Duplicate));
    assert!(!f.idx.is_indexed(3));
    // The copy in use keeps the content, now with a map entry, so the private copy's
    // successors find it in one probe.
    assert!(!f.is_chained(1));
    assert_eq!(f.idx.lookup(h1, Some(h0), &[3, 4], None), Some(1));
    assert_eq!(f.idx.lookup_child(0, h0, &[3, 4], None), Some((1, h1)));
}

#[test]
fn a_block_after_a_private_parent_finds_the_content_chained_below_the_indexed_one() {
    let mut f = Fixture::new();
    f.in_use.extend([0, 1, 2]);
    let h0 = f.root(0, &[1, 2]);
    let h1 = f.chained(1, h0, 0, &[3, 4]);
    let h2 = f.chained(2, h1, 1, &[5, 6]);
    // Block 7 is not indexed (a private copy of content h1, or swapped in): the holder of h1
    // is found through the chain's hashes (block 0 by hash, then its chained child), and its
    // chained child holds the content.
    let (h, entered) = f.enter(5, &[h0, h1], Some(7), &[5, 6]);
    assert_eq!((h, entered), (h2, Entered::Duplicate));
    assert!(!f.idx.is_indexed(5));
    // Cached, the chained copy is replaced in place.
    f.in_use.remove(&2);
    let (_, entered) = f.enter(5, &[h0, h1], Some(7), &[5, 6]);
    assert_eq!(entered, Entered::Replaced(2));
    assert_eq!(f.idx.lookup(h2, Some(h1), &[5, 6], None), Some(5));
}

#[test]
fn a_child_entered_with_no_holder_is_an_orphan_and_stops_a_chained_run() {
    let mut f = Fixture::new();
    let h0 = f.hasher.hash_block(None, &[1, 2], None);
    // Content h0 is not indexed: the child gets a map entry and h0 joins the orphan parents.
    let (h1, entered) = f.enter(3, &[h0], Some(7), &[3, 4]);
    assert_eq!(entered, Entered::New);
    assert!(f.idx.may_have_orphans_of(h0));
    // Entered later as new content, h0's children must be looked up (the manager does so
    // instead of chaining): the copy finds block 3.
    f.root(0, &[1, 2]);
    let (h, entered) = f.enter(4, &[h0], Some(0), &[3, 4]);
    assert_eq!((h, entered), (h1, Entered::Replaced(3)));
    // The rebuild keeps only what is still an orphan parent: none (h0 is indexed, and block
    // 0 tracks block 4).
    f.idx.rebuild_orphan_parents();
    assert!(!f.idx.may_have_orphans());
    f.idx.check_invariants(&f.hasher).unwrap();
}

#[test]
fn a_removed_parent_with_many_children_leaves_its_hash_among_the_orphan_parents() {
    let mut f = Fixture::new();
    let h0 = f.root(0, &[1, 2]);
    f.enter(1, &[h0], Some(0), &[3, 4]);
    f.enter(2, &[h0], Some(0), &[5, 6]);
    assert!(f.idx.stored[0].many_children);
    // The hinted child (block 2) leaves first; block 1 is still a child.
    f.remove(2);
    f.remove(0);
    assert!(f.idx.may_have_orphans_of(h0));
    // Nothing indexed: nothing is an orphan.
    f.remove(1);
    assert!(!f.idx.may_have_orphans());
}
