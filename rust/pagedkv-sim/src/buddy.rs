//! Binary buddy placement of contiguous reservations, as Orca's baseline is usually modelled.
//!
//! Every allocation is a power-of-two run aligned to its size. A free run of order k splits
//! into two buddies of order k-1; on release a run merges with its buddy whenever the buddy
//! is free, repeatedly. A pool that is not a power of two is cut into aligned power-of-two
//! *arenas* (its binary digits, largest first) that never merge with each other. Rounding a
//! request up to a power of two is internal fragmentation; free runs that are too small for the
//! next request (because their buddies are in use) are external fragmentation.

use std::collections::{BTreeMap, BTreeSet};

use crate::extent::{runs_hold_extents, Extent, ExtentAllocator};

/// Buddy allocator over the slots `[0, num_slots)`.
///
/// ```
/// use pagedkv_sim::{BuddyAllocator, ExtentAllocator};
/// let mut buddy = BuddyAllocator::new(16);
/// let a = buddy.allocate(3).unwrap(); // rounded to 4 slots: [0, 4)
/// let b = buddy.allocate(4).unwrap(); // its buddy: [4, 8)
/// assert_eq!((a.start, a.len, b.start), (0, 4, 4));
/// buddy.release(a.start).unwrap();
/// // [0,4) is free but its buddy [4,8) is not: no 8-slot run below address 8.
/// assert_eq!(buddy.allocate(8).unwrap().start, 8);
/// buddy.release(b.start).unwrap(); // [0,4) and [4,8) merge into [0,8)
/// assert_eq!(buddy.largest_free_extent(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct BuddyAllocator {
    num_slots: usize,
    /// Arenas as (start, order), largest first; each start is a multiple of `1 << order`.
    arenas: Vec<(usize, u32)>,
    /// `free_by_order[k]`: starts of free runs of `1 << k` slots. Invariant: a free run's
    /// buddy (inside the same arena) is never free as well; they would have been merged.
    free_by_order: Vec<BTreeSet<usize>>,
    /// Allocated runs, start -> order.
    allocated: BTreeMap<usize, u32>,
    free_slots: usize,
}

/// Smallest k with 2^k >= n (n >= 1).
fn order_for(num_slots: usize) -> u32 {
    num_slots.next_power_of_two().trailing_zeros()
}

impl BuddyAllocator {
    /// An allocator over `[0, num_slots)`, every arena one free run.
    pub fn new(num_slots: usize) -> Self {
        let mut arenas = Vec::new();
        let mut start = 0;
        for order in (0..usize::BITS).rev() {
            if num_slots & (1usize << order) != 0 {
                arenas.push((start, order));
                start += 1usize << order;
            }
        }
        let max_order = arenas.first().map_or(0, |&(_, o)| o);
        let mut free_by_order = vec![BTreeSet::new(); max_order as usize + 1];
        for &(start, order) in &arenas {
            free_by_order[order as usize].insert(start);
        }
        BuddyAllocator {
            num_slots,
            arenas,
            free_by_order,
            allocated: BTreeMap::new(),
            free_slots: num_slots,
        }
    }

    /// Order of the arena holding `slot`.
    fn arena_order(&self, slot: usize) -> u32 {
        self.arenas
            .iter()
            .find(|&&(start, order)| slot >= start && slot < start + (1usize << order))
            .map(|&(_, order)| order)
            .expect("slot lies inside the pool")
    }

    /// The largest run a single allocation can ever get (the biggest arena).
    pub fn max_extent_len(&self) -> usize {
        self.arenas.first().map_or(0, |&(_, o)| 1usize << o)
    }

    /// How many extents of `extent_len` (a power of two) an empty pool could hold at once.
    pub fn capacity_for(&self, extent_len: usize) -> usize {
        if extent_len == 0 || !extent_len.is_power_of_two() {
            return 0;
        }
        self.arenas
            .iter()
            .map(|&(_, order)| (1usize << order) / extent_len)
            .sum()
    }

    /// Checks: runs aligned to their size, disjoint, within one arena, the whole pool covered,
    /// no free run whose buddy is free too, free count consistent.
    fn check_structure(&self) -> Result<(), String> {
        let mut runs: Vec<(usize, u32, bool)> = self
            .allocated
            .iter()
            .map(|(&s, &o)| (s, o, false))
            .collect();
        for (order, starts) in self.free_by_order.iter().enumerate() {
            for &s in starts {
                runs.push((s, order as u32, true));
                let arena_order = self.arena_order(s);
                if (order as u32) < arena_order {
                    let buddy = s ^ (1usize << order);
                    if starts.contains(&buddy) {
                        return Err(format!(
                            "free run {s} of order {order} and its buddy {buddy} both free"
                        ));
                    }
                }
            }
        }
        runs.sort_unstable();
        let mut end = 0;
        let mut free = 0;
        for &(start, order, is_free) in &runs {
            let len = 1usize << order;
            if start % len != 0 {
                return Err(format!("run {start} of order {order} is not aligned"));
            }
            if start != end {
                return Err(format!(
                    "gap or overlap at slot {end} (next run starts at {start})"
                ));
            }
            if order > self.arena_order(start) {
                return Err(format!(
                    "run {start} of order {order} is larger than its arena"
                ));
            }
            end = start + len;
            if is_free {
                free += len;
            }
        }
        if end != self.num_slots {
            return Err(format!(
                "runs cover [0, {end}) but the pool has {} slots",
                self.num_slots
            ));
        }
        if free != self.free_slots {
            return Err(format!(
                "free_slots {} but free runs sum to {free}",
                self.free_slots
            ));
        }
        Ok(())
    }
}

impl ExtentAllocator for BuddyAllocator {
    fn num_slots(&self) -> usize {
        self.num_slots
    }

    fn extent_len_for(&self, num_slots: usize) -> usize {
        num_slots.max(1).next_power_of_two()
    }

    fn allocate(&mut self, num_slots: usize) -> Option<Extent> {
        if num_slots == 0 || num_slots > self.max_extent_len() {
            return None;
        }
        let want = order_for(num_slots);
        // The smallest free run that is large enough, lowest address first.
        let found = (want as usize..self.free_by_order.len())
            .find_map(|k| self.free_by_order[k].first().map(|&s| (k as u32, s)))?;
        let (mut order, start) = found;
        self.free_by_order[order as usize].remove(&start);
        while order > want {
            order -= 1;
            // Keep the lower half, free the upper half (its buddy).
            self.free_by_order[order as usize].insert(start + (1usize << order));
        }
        self.allocated.insert(start, want);
        self.free_slots -= 1usize << want;
        Some(Extent {
            start,
            len: 1usize << want,
        })
    }

    fn release(&mut self, start: usize) -> Option<usize> {
        let order_allocated = self.allocated.remove(&start)?;
        let len = 1usize << order_allocated;
        let arena_order = self.arena_order(start);
        let mut run = start;
        let mut order = order_allocated;
        while order < arena_order {
            let buddy = run ^ (1usize << order);
            if !self.free_by_order[order as usize].remove(&buddy) {
                break;
            }
            run = run.min(buddy);
            order += 1;
        }
        self.free_by_order[order as usize].insert(run);
        self.free_slots += len;
        Some(len)
    }

    fn free_slots(&self) -> usize {
        self.free_slots
    }

    fn largest_free_extent(&self) -> usize {
        self.free_by_order
            .iter()
            .enumerate()
            .rev()
            .find(|(_, s)| !s.is_empty())
            .map_or(0, |(k, _)| 1usize << k)
    }

    fn free_slots_in_extents_shorter_than(&self, extent_len: usize) -> usize {
        self.free_by_order
            .iter()
            .enumerate()
            .filter(|&(k, _)| (1usize << k) < extent_len)
            .map(|(k, s)| s.len() << k)
            .sum()
    }

    fn can_place(&self, extent_len: usize, count: usize) -> bool {
        // Each free run of order k >= want splits into 2^(k - want) runs of order want.
        let want = order_for(extent_len) as usize;
        runs_hold_extents(
            extent_len,
            count,
            self.free_by_order
                .iter()
                .enumerate()
                .skip(want)
                .map(|(k, runs)| runs.len() << (k - want)),
        )
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.check_structure()
    }

    fn free_extents(&self) -> Vec<Extent> {
        let mut runs: Vec<Extent> = self
            .free_by_order
            .iter()
            .enumerate()
            .flat_map(|(k, s)| {
                s.iter().map(move |&start| Extent {
                    start,
                    len: 1usize << k,
                })
            })
            .collect();
        runs.sort_unstable_by_key(|e| e.start);
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_down_to_the_requested_order_then_merge_back() {
        let mut b = BuddyAllocator::new(32);
        let a = b.allocate(5).unwrap();
        assert_eq!(a, Extent { start: 0, len: 8 });
        // Splitting 32 -> 16 + 16 -> 8 + 8 leaves free runs [8,16) and [16,32).
        assert_eq!(
            b.free_extents(),
            vec![Extent { start: 8, len: 8 }, Extent { start: 16, len: 16 }]
        );
        let c = b.allocate(1).unwrap();
        assert_eq!(c, Extent { start: 8, len: 1 });
        b.check_invariants().unwrap();
        assert_eq!(b.free_slots(), 32 - 9);
        b.release(a.start).unwrap();
        // [0,8) cannot merge: its buddy [8,16) is split (slot 8 in use).
        assert_eq!(b.largest_free_extent(), 16);
        b.release(c.start).unwrap();
        b.check_invariants().unwrap();
        assert_eq!(b.free_extents(), vec![Extent { start: 0, len: 32 }]);
    }

    #[test]
    fn external_fragmentation_between_non_buddies() {
        // Four runs of 4 in a pool of 16; free the 2nd and 3rd: [4,8) and [8,12) are adjacent but
        // not buddies, so an 8-slot request fails although 8 slots are free and contiguous.
        let mut b = BuddyAllocator::new(16);
        let runs: Vec<Extent> = (0..4).map(|_| b.allocate(4).unwrap()).collect();
        assert_eq!(
            runs.iter().map(|e| e.start).collect::<Vec<_>>(),
            vec![0, 4, 8, 12]
        );
        b.release(4).unwrap();
        b.release(8).unwrap();
        b.check_invariants().unwrap();
        assert_eq!(b.free_slots(), 8);
        assert!(b.allocate(8).is_none());
        assert_eq!(b.free_slots_in_extents_shorter_than(8), 8);
        assert!(b.can_place(4, 2));
        assert!(!b.can_place(4, 3));
        assert!(!b.can_place(8, 1));
    }

    #[test]
    fn pool_that_is_not_a_power_of_two_is_cut_into_arenas() {
        // 24 = 16 + 8: arenas [0,16) and [16,24). A 16-slot run fits once, never across arenas.
        let mut b = BuddyAllocator::new(24);
        assert_eq!(b.max_extent_len(), 16);
        assert_eq!(b.capacity_for(8), 3);
        assert_eq!(b.capacity_for(16), 1);
        assert!(b.allocate(17).is_none());
        let x = b.allocate(8).unwrap();
        assert_eq!(
            x.start, 16,
            "the smallest sufficient run is the 8-slot arena"
        );
        let y = b.allocate(16).unwrap();
        assert_eq!(y.start, 0);
        b.release(x.start).unwrap();
        b.release(y.start).unwrap();
        b.check_invariants().unwrap();
        // The two arenas stay separate free runs.
        assert_eq!(
            b.free_extents(),
            vec![Extent { start: 0, len: 16 }, Extent { start: 16, len: 8 }]
        );
    }

    #[test]
    fn release_unknown_changes_nothing() {
        let mut b = BuddyAllocator::new(8);
        let a = b.allocate(2).unwrap();
        assert_eq!(b.release(1), None);
        assert_eq!(b.release(a.start), Some(2));
        assert_eq!(b.release(a.start), None);
        b.check_invariants().unwrap();
        assert_eq!(b.free_slots(), 8);
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut b = BuddyAllocator::new(100); // arenas 64 + 32 + 4
        let mut live: Vec<Extent> = Vec::new();
        for _ in 0..3000 {
            if live.is_empty() || rng.next_below(3) > 0 {
                let len = 1 + rng.next_below(20) as usize;
                let could = b.can_place(b.extent_len_for(len), 1);
                match b.allocate(len) {
                    Some(e) => {
                        assert!(could);
                        assert_eq!(e.len, len.next_power_of_two());
                        assert_eq!(e.start % e.len, 0);
                        assert!(live
                            .iter()
                            .all(|o| o.end() <= e.start || e.end() <= o.start));
                        live.push(e);
                    }
                    None => assert!(!could),
                }
            } else {
                let e = live.swap_remove(rng.next_below(live.len() as u64) as usize);
                assert_eq!(b.release(e.start), Some(e.len));
            }
            b.check_invariants().unwrap();
            assert_eq!(
                b.free_slots(),
                100 - live.iter().map(|e| e.len).sum::<usize>()
            );
        }
        for e in live.drain(..) {
            b.release(e.start).unwrap();
        }
        b.check_invariants().unwrap();
        assert_eq!(
            b.free_extents().len(),
            3,
            "everything merges back into the three arenas"
        );
    }
}
