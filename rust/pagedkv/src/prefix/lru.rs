//! The eviction order of cached-evictable blocks: an intrusive doubly linked list over block
//! ids (O(1) insert at the tail, remove anywhere, pop the front), no allocation after
//! construction.

use crate::BlockId;

/// The end-of-list marker (no block has this id: pools hold fewer than 2^24 blocks).
const NIL: u32 = u32::MAX;

/// One block's place in the list.
#[derive(Debug, Clone, Copy)]
struct Link {
    /// Neighbours (`NIL` at the ends); meaningful while `linked`.
    prev: u32,
    next: u32,
    /// Whether the block is in the list.
    linked: bool,
}

/// Least recently used first; one [`Link`] per block id of the pool.
///
/// Invariants: walking `next` from `head` visits exactly the `len` linked blocks and ends at
/// `tail`; each visited block's `prev` is the block visited before it.
#[derive(Debug)]
pub(crate) struct Lru {
    links: Vec<Link>,
    /// Least recently used block (evicted first).
    head: u32,
    /// Most recently inserted block.
    tail: u32,
    /// Linked blocks.
    len: usize,
}

impl Lru {
    pub(crate) fn new(num_blocks: usize) -> Self {
        let unlinked = Link {
            prev: NIL,
            next: NIL,
            linked: false,
        };
        Lru {
            links: vec![unlinked; num_blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn contains(&self, b: BlockId) -> bool {
        self.links[b as usize].linked
    }

    /// Appends `b` (not in the list) as the most recently used block.
    pub(crate) fn push_back(&mut self, b: BlockId) {
        let tail = self.tail;
        let link = &mut self.links[b as usize];
        debug_assert!(!link.linked, "block {b} is already in the LRU");
        *link = Link {
            prev: tail,
            next: NIL,
            linked: true,
        };
        if tail == NIL {
            self.head = b;
        } else {
            self.links[tail as usize].next = b;
        }
        self.tail = b;
        self.len += 1;
    }

    /// Unlinks `b` (in the list).
    #[inline]
    pub(crate) fn remove(&mut self, b: BlockId) {
        let Link { prev, next, linked } = std::mem::replace(
            &mut self.links[b as usize],
            Link {
                prev: NIL,
                next: NIL,
                linked: false,
            },
        );
        debug_assert!(linked, "block {b} is not in the LRU");
        if prev == NIL {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.len -= 1;
    }

    /// Unlinks and returns the least recently used block.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Unlinks the `n` least recently used blocks (the list holds at least `n`), appending
    /// them to `out` in that order: one walk, and the new front's `prev` written once instead
    /// of once per block.
    pub(crate) fn pop_front_into(&mut self, n: usize, out: &mut Vec<BlockId>) {
        debug_assert!(n <= self.len, "popping {n} of {} blocks", self.len);
        let mut b = self.head;
        for _ in 0..n {
            let link = std::mem::replace(
                &mut self.links[b as usize],
                Link {
                    prev: NIL,
                    next: NIL,
                    linked: false,
                },
            );
            debug_assert!(link.linked, "block {b} is not in the LRU");
            out.push(b);
            b = link.next;
        }
        self.head = b;
        if b == NIL {
            self.tail = NIL;
        } else {
            self.links[b as usize].prev = NIL;
        }
        self.len -= n;
    }

    /// The blocks, least recently used first (at most `links.len() + 1` of them, so a
    /// corrupted cycle cannot hang a walk).
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut b = self.head;
        std::iter::from_fn(move || {
            let cur = b;
            (cur != NIL).then(|| {
                b = self.links[cur as usize].next;
                cur
            })
        })
        .take(self.links.len() + 1)
    }

    /// The blocks, least recently used first (see [`Lru::iter`]).
    pub(crate) fn order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        out.extend(self.iter());
        out
    }

    /// Verifies the links, the flags and the length against each other.
    pub(crate) fn check(&self) -> Result<(), String> {
        let order = self.order();
        if order.len() != self.len {
            return Err(format!(
                "LRU walk found {} blocks, lru_len {}",
                order.len(),
                self.len
            ));
        }
        let flagged = self.links.iter().filter(|l| l.linked).count();
        if flagged != self.len {
            return Err(format!(
                "{flagged} blocks flagged cached, lru_len {}",
                self.len
            ));
        }
        let mut prev = NIL;
        for &b in &order {
            let link = &self.links[b as usize];
            if !link.linked || link.prev != prev {
                return Err(format!("LRU links broken at block {b}"));
            }
            prev = b;
        }
        if self.tail != prev {
            return Err("LRU tail pointer is stale".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_pop_keep_the_order() {
        let mut lru = Lru::new(5);
        for b in [3, 0, 4, 1] {
            lru.push_back(b);
        }
        lru.remove(4); // middle
        lru.remove(3); // head
        assert_eq!(lru.order(), vec![0, 1]);
        lru.push_back(3);
        assert_eq!(lru.pop_front(), Some(0));
        assert_eq!((lru.order(), lru.len()), (vec![1, 3], 2));
        assert!(lru.contains(3) && !lru.contains(0));
        lru.remove(3); // tail
        assert_eq!(lru.pop_front(), Some(1));
        assert_eq!(lru.pop_front(), None);
        lru.check().unwrap();
    }

    #[test]
    fn pop_front_into_takes_the_oldest_in_order() {
        let mut lru = Lru::new(6);
        for b in [5, 2, 0, 3, 1] {
            lru.push_back(b);
        }
        let mut out = vec![9];
        lru.pop_front_into(2, &mut out);
        assert_eq!(out, vec![9, 5, 2]);
        assert_eq!((lru.order(), lru.len()), (vec![0, 3, 1], 3));
        assert!(!lru.contains(5) && !lru.contains(2) && lru.contains(0));
        lru.check().unwrap();
        lru.pop_front_into(0, &mut out);
        lru.pop_front_into(3, &mut out);
        assert_eq!(out, vec![9, 5, 2, 0, 3, 1]);
        assert_eq!(lru.len(), 0);
        lru.check().unwrap();
        lru.push_back(4);
        assert_eq!(lru.order(), vec![4]);
        lru.check().unwrap();
    }
}
