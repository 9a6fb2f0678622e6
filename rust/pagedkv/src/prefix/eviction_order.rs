//! The eviction order of cached-evictable blocks: the LRU, and optionally queue-aware
//! eviction (docs/scheduling.md, Queue-aware eviction).
//!
//! Off (the default: nobody ever called [`EvictionOrder::set_wanted`]), this is the [`Lru`]
//! alone, each operation one `None` test away from it. On, a scheduler marks the block hashes
//! a waiting request will hit as *wanted*; a block whose hash is wanted is evicted only when
//! no other cached-evictable block is left. The marks are hashes, not blocks, so a mark may
//! come before the block is cached, while it is in use, or after it became cached-evictable:
//! blocks enter the LRU as always, and the eviction that reaches a wanted block at the LRU's
//! front sets it aside in the *wanted* list instead (O(1) per block, each block set aside at
//! most once per stay). Unmarking a hash puts its set-aside block back at the LRU's tail.

use rustc_hash::{FxHashMap, FxHashSet};

use super::hash::BlockHash;
use super::lru::Lru;
use crate::BlockId;

/// Cached-evictable blocks in eviction order.
///
/// Invariants (checked by [`EvictionOrder::check`]): no block is in both lists; every block of
/// the wanted list is indexed, its hash is wanted, and `by_hash` maps that hash to it (and
/// holds nothing else).
#[derive(Debug)]
pub(crate) struct EvictionOrder {
    /// Least recently used first; off, every cached-evictable block; on, all but those set aside.
    lru: Lru,
    /// The queue-aware part, from the first [`EvictionOrder::set_wanted`] on.
    wanted: Option<Box<Wanted>>,
    /// Blocks of the pool (the lists' capacity).
    num_blocks: usize,
}

#[derive(Debug)]
struct Wanted {
    /// Hashes some waiting request will hit (the scheduler's marks).
    hashes: FxHashSet<BlockHash>,
    /// Cached-evictable blocks with a wanted hash, set aside: evicted only when `lru` is
    /// empty, the first set aside first.
    aside: Lru,
    /// The block set aside under each hash.
    by_hash: FxHashMap<BlockHash, BlockId>,
    /// The hash each block was set aside under (meaningful while it is in `aside`).
    hash_at: Vec<BlockHash>,
}

impl EvictionOrder {
    pub(crate) fn new(num_blocks: usize) -> Self {
        EvictionOrder {
            lru: Lru::new(num_blocks),
            wanted: None,
            num_blocks,
        }
    }

    /// Cached-evictable blocks.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.lru.len() + self.wanted.as_ref().map_or(0, |w| w.aside.len())
    }

    #[inline]
    pub(crate) fn contains(&self, b: BlockId) -> bool {
        self.lru.contains(b) || self.wanted.as_ref().is_some_and(|w| w.aside.contains(b))
    }

    /// Appends `b` (cached-evictable now) as the most recently used block.
    #[inline]
    pub(crate) fn push_back(&mut self, b: BlockId) {
        self.lru.push_back(b);
    }

    /// Takes `b` (cached-evictable) out of the order: revived, replaced or released.
    #[inline]
    pub(crate) fn remove(&mut self, b: BlockId) {
        match self.wanted.as_deref_mut() {
            Some(w) if w.aside.contains(b) => w.take_aside(b),
            _ => self.lru.remove(b),
        }
    }

    /// Takes the next block to evict: the least recently used block whose hash is not wanted
    /// (setting wanted ones aside on the way), else the first block set aside. `hash_of`
    /// reads the index.
    #[inline]
    pub(crate) fn pop_front(
        &mut self,
        hash_of: impl Fn(BlockId) -> Option<BlockHash>,
    ) -> Option<BlockId> {
        let Some(w) = self.wanted.as_deref_mut() else {
            return self.lru.pop_front();
        };
        while let Some(b) = self.lru.pop_front() {
            match hash_of(b) {
                Some(h) if w.hashes.contains(&h) => {
                    w.aside.push_back(b);
                    w.by_hash.insert(h, b);
                    w.hash_at[b as usize] = h;
                }
                _ => return Some(b),
            }
        }
        let b = w.aside.pop_front()?;
        w.by_hash.remove(&w.hash_at[b as usize]);
        Some(b)
    }

    /// Takes the next `n` blocks to evict (there are at least `n`) into `out`, in order.
    pub(crate) fn pop_front_into(
        &mut self,
        n: usize,
        out: &mut Vec<BlockId>,
        hash_of: impl Fn(BlockId) -> Option<BlockHash>,
    ) {
        if self.wanted.is_none() {
            return self.lru.pop_front_into(n, out);
        }
        for _ in 0..n {
            let b = self.pop_front(&hash_of);
            debug_assert!(b.is_some(), "popping {n} blocks of fewer");
            out.extend(b);
        }
    }

    /// Marks `hash` wanted (a waiting request will hit it) or not. The first call turns the
    /// queue-aware order on for good. Unmarking puts a block set aside under `hash` back at the
    /// LRU's tail.
    pub(crate) fn set_wanted(&mut self, hash: BlockHash, wanted: bool) {
        let num_blocks = self.num_blocks;
        let w = self.wanted.get_or_insert_with(|| {
            Box::new(Wanted {
                hashes: FxHashSet::default(),
                aside: Lru::new(num_blocks),
                by_hash: FxHashMap::default(),
                hash_at: vec![0; num_blocks],
            })
        });
        if wanted {
            w.hashes.insert(hash);
        } else if w.hashes.remove(&hash) {
            if let Some(b) = w.by_hash.remove(&hash) {
                w.aside.remove(b);
                self.lru.push_back(b);
            }
        }
    }

    /// Whether the queue-aware order is on.
    pub(crate) fn is_queue_aware(&self) -> bool {
        self.wanted.is_some()
    }

    /// Hashes marked wanted.
    pub(crate) fn num_wanted_hashes(&self) -> usize {
        self.wanted.as_ref().map_or(0, |w| w.hashes.len())
    }

    /// The blocks in list order: the LRU's, then those set aside.
    pub(crate) fn order(&self) -> Vec<BlockId> {
        let mut out = self.lru.order();
        if let Some(w) = &self.wanted {
            out.extend(w.aside.iter());
        }
        out
    }

    /// Verifies the struct's invariants; `hash_of` reads the index.
    pub(crate) fn check(
        &self,
        hash_of: impl Fn(BlockId) -> Option<BlockHash>,
    ) -> Result<(), String> {
        self.lru.check()?;
        let Some(w) = &self.wanted else {
            return Ok(());
        };
        w.aside.check()?;
        for b in w.aside.iter() {
            if self.lru.contains(b) {
                return Err(format!("block {b} is both in the LRU and set aside"));
            }
            let Some(h) = hash_of(b) else {
                return Err(format!("block {b} set aside is not indexed"));
            };
            if !w.hashes.contains(&h) {
                return Err(format!("block {b} set aside under a hash nobody wants"));
            }
            if w.by_hash.get(&h) != Some(&b) {
                return Err(format!("block {b} set aside is not found by its hash"));
            }
        }
        if w.by_hash.len() != w.aside.len() {
            return Err(format!(
                "{} hashes map to the {} blocks set aside",
                w.by_hash.len(),
                w.aside.len()
            ));
        }
        Ok(())
    }
}

impl Wanted {
    /// Takes set-aside block `b` out (revived, replaced or released).
    fn take_aside(&mut self, b: BlockId) {
        self.aside.remove(b);
        self.by_hash.remove(&self.hash_at[b as usize]);
    }
}
