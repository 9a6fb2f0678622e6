//! First-fit placement of contiguous reservations over one array of token slots.
//!
//! This is the address-space allocator behind the contiguous baselines: each admitted request
//! gets one run of adjacent slots, placed at the lowest address where it fits. Freed runs are
//! merged with free neighbours at once, so two adjacent free runs never coexist and every free
//! run is as large as it can be; what remains unusable is real external fragmentation.

use std::collections::BTreeMap;

use crate::extent::{runs_hold_extents, Extent, ExtentAllocator};

/// First-fit allocator over the slots `[0, num_slots)`.
///
/// ```
/// use pagedkv_sim::{ExtentAllocator, FirstFitAllocator};
/// let mut slots = FirstFitAllocator::new(10);
/// let a = slots.allocate(4).unwrap();
/// let b = slots.allocate(4).unwrap();
/// assert_eq!((a.start, b.start), (0, 4));
/// slots.release(a.start).unwrap();
/// // 6 slots are free, but in runs of 4 and 2: a 5-slot request does not fit.
/// assert_eq!(slots.free_slots(), 6);
/// assert!(slots.allocate(5).is_none());
/// assert_eq!(slots.largest_free_extent(), 4);
/// ```
#[derive(Debug, Clone)]
pub struct FirstFitAllocator {
    num_slots: usize,
    /// Free runs, start -> length. Invariant: no two runs touch or overlap (merged on release),
    /// and they are disjoint from every allocated run.
    free_runs: BTreeMap<usize, usize>,
    /// Allocated runs, start -> length.
    allocated: BTreeMap<usize, usize>,
    /// Sum of the free runs' lengths.
    free_slots: usize,
}

impl FirstFitAllocator {
    /// An allocator whose whole range `[0, num_slots)` is one free run.
    pub fn new(num_slots: usize) -> Self {
        let mut free_runs = BTreeMap::new();
        if num_slots > 0 {
            free_runs.insert(0, num_slots);
        }
        FirstFitAllocator {
            num_slots,
            free_runs,
            allocated: BTreeMap::new(),
            free_slots: num_slots,
        }
    }

    /// Checks the structure: runs disjoint, free runs never adjacent, counts consistent.
    fn check_structure(&self) -> Result<(), String> {
        let mut runs: Vec<(usize, usize, bool)> = self
            .free_runs
            .iter()
            .map(|(&s, &l)| (s, l, true))
            .chain(self.allocated.iter().map(|(&s, &l)| (s, l, false)))
            .collect();
        runs.sort_unstable();
        let mut covered = 0;
        let mut prev_end = 0;
        let mut prev_free = false;
        for &(start, len, is_free) in &runs {
            if len == 0 {
                return Err(format!("empty run at {start}"));
            }
            if start < prev_end {
                return Err(format!(
                    "run at {start} overlaps the previous one ending at {prev_end}"
                ));
            }
            if is_free && prev_free && start == prev_end {
                return Err(format!(
                    "free run at {start} touches the previous free run (not merged)"
                ));
            }
            prev_free = is_free;
            prev_end = start + len;
            covered += len;
        }
        if prev_end > self.num_slots {
            return Err(format!(
                "a run ends at {prev_end}, past num_slots {}",
                self.num_slots
            ));
        }
        let free: usize = self.free_runs.values().sum();
        if free != self.free_slots {
            return Err(format!(
                "free_slots {} but free runs sum to {free}",
                self.free_slots
            ));
        }
        if covered != self.num_slots {
            // Every slot is either in a free run or an allocated run.
            return Err(format!("runs cover {covered} of {} slots", self.num_slots));
        }
        Ok(())
    }
}

impl ExtentAllocator for FirstFitAllocator {
    fn num_slots(&self) -> usize {
        self.num_slots
    }

    fn extent_len_for(&self, num_slots: usize) -> usize {
        num_slots
    }

    fn allocate(&mut self, num_slots: usize) -> Option<Extent> {
        if num_slots == 0 {
            return None;
        }
        let (&start, &len) = self.free_runs.iter().find(|(_, &len)| len >= num_slots)?;
        self.free_runs.remove(&start);
        if len > num_slots {
            self.free_runs.insert(start + num_slots, len - num_slots);
        }
        self.allocated.insert(start, num_slots);
        self.free_slots -= num_slots;
        Some(Extent {
            start,
            len: num_slots,
        })
    }

    fn release(&mut self, start: usize) -> Option<usize> {
        let len = self.allocated.remove(&start)?;
        let mut run_start = start;
        let mut run_len = len;
        if let Some((&prev_start, &prev_len)) = self.free_runs.range(..start).next_back() {
            if prev_start + prev_len == start {
                self.free_runs.remove(&prev_start);
                run_start = prev_start;
                run_len += prev_len;
            }
        }
        if let Some(next_len) = self.free_runs.remove(&(start + len)) {
            run_len += next_len;
        }
        self.free_runs.insert(run_start, run_len);
        self.free_slots += len;
        Some(len)
    }

    fn free_slots(&self) -> usize {
        self.free_slots
    }

    fn largest_free_extent(&self) -> usize {
        self.free_runs.values().copied().max().unwrap_or(0)
    }

    fn free_slots_in_extents_shorter_than(&self, extent_len: usize) -> usize {
        self.free_runs
            .values()
            .filter(|&&len| len < extent_len)
            .sum()
    }

    fn can_place(&self, extent_len: usize, count: usize) -> bool {
        // Placing one extent at the start of a run leaves the rest of that run as the next
        // candidate, so first-fit fits `count` extents iff the runs hold that many in total.
        // (The division runs only after the helper has refused a zero `extent_len`.)
        runs_hold_extents(
            extent_len,
            count,
            self.free_runs.values().map(|&len| len / extent_len),
        )
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.check_structure()
    }

    fn free_extents(&self) -> Vec<Extent> {
        self.free_runs
            .iter()
            .map(|(&start, &len)| Extent { start, len })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragmentation_blocks_a_request_that_total_free_space_would_hold() {
        // Pool of 12: A[0,4) B[4,8) C[8,12); free A and C -> 8 free slots in two runs of 4.
        let mut ff = FirstFitAllocator::new(12);
        let a = ff.allocate(4).unwrap();
        let b = ff.allocate(4).unwrap();
        let c = ff.allocate(4).unwrap();
        assert_eq!((a.start, b.start, c.start), (0, 4, 8));
        assert!(ff.allocate(1).is_none());
        assert_eq!(ff.release(a.start), Some(4));
        assert_eq!(ff.release(c.start), Some(4));
        ff.check_invariants().unwrap();
        assert_eq!(ff.free_slots(), 8);
        assert_eq!(ff.largest_free_extent(), 4);
        assert!(ff.allocate(5).is_none(), "8 free slots, but no run of 5");
        assert_eq!(ff.free_slots_in_extents_shorter_than(5), 8);
        assert_eq!(ff.free_slots_in_extents_shorter_than(4), 0);
        assert!(ff.can_place(4, 2));
        assert!(!ff.can_place(4, 3));
        // Freeing B merges all three runs into one.
        ff.release(b.start).unwrap();
        ff.check_invariants().unwrap();
        assert_eq!(ff.free_extents(), vec![Extent { start: 0, len: 12 }]);
        assert_eq!(ff.allocate(12).unwrap().start, 0);
    }

    #[test]
    fn first_fit_takes_the_lowest_address_that_fits() {
        let mut ff = FirstFitAllocator::new(20);
        let a = ff.allocate(3).unwrap(); // [0,3)
        let b = ff.allocate(5).unwrap(); // [3,8)
        let _c = ff.allocate(2).unwrap(); // [8,10)
        ff.release(a.start).unwrap(); // free [0,3) and [10,20)
        ff.release(b.start).unwrap(); // merges into [0,8)
        assert_eq!(
            ff.free_extents(),
            vec![Extent { start: 0, len: 8 }, Extent { start: 10, len: 10 }]
        );
        assert_eq!(
            ff.allocate(9).unwrap().start,
            10,
            "only the upper run holds 9"
        );
        assert_eq!(ff.allocate(2).unwrap().start, 0);
        assert_eq!(ff.allocate(6).unwrap().start, 2);
        ff.check_invariants().unwrap();
        assert_eq!(ff.free_slots(), 1);
    }

    #[test]
    fn release_of_an_unknown_start_changes_nothing() {
        let mut ff = FirstFitAllocator::new(8);
        let a = ff.allocate(4).unwrap();
        assert_eq!(ff.release(a.start + 1), None);
        assert_eq!(ff.release(6), None);
        assert_eq!(ff.free_slots(), 4);
        assert_eq!(ff.release(a.start), Some(4));
        assert_eq!(ff.release(a.start), None, "double release is refused");
        ff.check_invariants().unwrap();
    }

    #[test]
    fn merges_with_the_left_neighbour_only() {
        let mut ff = FirstFitAllocator::new(9);
        let a = ff.allocate(3).unwrap();
        let b = ff.allocate(3).unwrap();
        let _c = ff.allocate(3).unwrap();
        ff.release(a.start).unwrap();
        ff.release(b.start).unwrap();
        assert_eq!(ff.free_extents(), vec![Extent { start: 0, len: 6 }]);
        ff.check_invariants().unwrap();
    }

    #[test]
    fn zero_sized_requests_and_pools() {
        let mut ff = FirstFitAllocator::new(0);
        assert!(ff.allocate(1).is_none());
        assert_eq!(ff.largest_free_extent(), 0);
        ff.check_invariants().unwrap();
        let mut ff = FirstFitAllocator::new(4);
        assert!(ff.allocate(0).is_none());
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        // A small deterministic stress run with a reference model of the slot array.
        let mut rng = crate::rng::SplitMix64::new(7);
        let mut ff = FirstFitAllocator::new(64);
        let mut owner = [false; 64];
        let mut live: Vec<Extent> = Vec::new();
        for _ in 0..2000 {
            if live.is_empty() || rng.next_below(3) > 0 {
                let len = 1 + rng.next_below(12) as usize;
                let expected =
                    (0..64).find(|&s| s + len <= 64 && owner[s..s + len].iter().all(|&o| !o));
                let got = ff.allocate(len);
                assert_eq!(
                    got.map(|e| e.start),
                    expected,
                    "first fit picks the lowest free run"
                );
                if let Some(e) = got {
                    owner[e.start..e.start + e.len]
                        .iter_mut()
                        .for_each(|o| *o = true);
                    live.push(e);
                }
            } else {
                let e = live.swap_remove(rng.next_below(live.len() as u64) as usize);
                assert_eq!(ff.release(e.start), Some(e.len));
                owner[e.start..e.start + e.len]
                    .iter_mut()
                    .for_each(|o| *o = false);
            }
            ff.check_invariants().unwrap();
            assert_eq!(ff.free_slots(), owner.iter().filter(|&&o| !o).count());
        }
    }
}
