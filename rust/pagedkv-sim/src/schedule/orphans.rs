//! Cached blocks the trie cannot place yet: blocks the KV events report stored under a parent
//! block that has no node.
//!
//! The allocator indexes one copy per content (docs/design.md, One copy per content), so a block
//! can enter the prefix cache after a block whose content never did (it was computed on a
//! private block while another block held it, and that holder has been evicted since) or has
//! left it and been collected from the trie. Its `BlockStored` event then names a parent the trie
//! has no node for, and the node cannot be made: a node needs its parent's, and the parent's
//! own parent is not in the event. No request can hit such a block until its parent is cached
//! (the allocator serves only the run of cached blocks from a prompt's first one), but a request
//! through it, or a later store of its parent, must find it cached. So it waits here, keyed by
//! its parent's hash, and becomes a node (with its orphan descendants) as soon as its parent
//! gets one, from a waiting request's chain or a store (`WaitingIndex::adopt`).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use pagedkv::BlockHash;

use super::trie::LowBits;

type Map<V> = HashMap<BlockHash, V, BuildHasherDefault<LowBits>>;

/// Cached blocks whose parent block has no trie node.
///
/// Invariants (checked by `WaitingIndex::check`): every entry of `blocks` holds at least one
/// copy and is listed once in `children` under its parent; `children` holds no other hash and no
/// empty list; no block of `blocks` nor any parent in `children` has a trie node.
#[derive(Debug, Default)]
pub(crate) struct Orphans {
    /// Block hash -> (its parent's hash, copies the prefix cache holds).
    blocks: Map<(BlockHash, u32)>,
    /// Parent hash -> its orphan children.
    children: Map<Vec<BlockHash>>,
}

impl Orphans {
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// One more copy of block `hash`, whose parent is `parent`, is cached.
    pub fn store(&mut self, parent: BlockHash, hash: BlockHash) {
        let entry = self.blocks.entry(hash).or_insert((parent, 0));
        debug_assert_eq!(entry.0, parent, "one hash, two parents");
        entry.1 += 1;
        if entry.1 == 1 {
            self.children.entry(parent).or_default().push(hash);
        }
    }

    /// One copy of block `hash` left the cache: `false` if it is not an orphan.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let Some(entry) = self.blocks.get_mut(&hash) else {
            return false;
        };
        entry.1 -= 1;
        if entry.1 == 0 {
            let parent = entry.0;
            self.blocks.remove(&hash);
            let siblings = self
                .children
                .get_mut(&parent)
                .expect("listed under its parent");
            siblings.retain(|&h| h != hash);
            if siblings.is_empty() {
                self.children.remove(&parent);
            }
        }
        true
    }

    /// Takes the orphan children of `parent` (which is getting a node) out, with their copies.
    pub fn take_children(&mut self, parent: BlockHash) -> Vec<(BlockHash, u32)> {
        let Some(children) = self.children.remove(&parent) else {
            return Vec::new();
        };
        children
            .into_iter()
            .map(|h| {
                (
                    h,
                    self.blocks.remove(&h).expect("listed orphans are held").1,
                )
            })
            .collect()
    }

    /// Checks the invariants of the struct docs against `has_node` (slow; for tests).
    pub fn check(&self, has_node: &dyn Fn(BlockHash) -> bool) -> Result<(), String> {
        let mut listed = 0;
        for (&parent, children) in &self.children {
            if children.is_empty() {
                return Err(format!("orphan parent {parent:#x} lists no child"));
            }
            if has_node(parent) {
                return Err(format!("orphans wait under {parent:#x}, which has a node"));
            }
            for &h in children {
                match self.blocks.get(&h) {
                    Some(&(p, copies)) if p == parent && copies > 0 => listed += 1,
                    _ => return Err(format!("orphan {h:#x} listed under {parent:#x} wrongly")),
                }
                if has_node(h) {
                    return Err(format!("orphan {h:#x} has a node"));
                }
            }
        }
        if listed != self.blocks.len() {
            return Err(format!(
                "{} orphans held, {listed} listed under their parents",
                self.blocks.len()
            ));
        }
        Ok(())
    }
}
