//! The aging bound: how many admissions may pass over a waiting request.
//!
//! An admission *passes over* every waiting request that arrived before it (a smaller rank:
//! ranks are arrival order). A cache-aware policy may admit out of arrival order, but no request
//! is ever passed over more than `bound` times: once the oldest waiting request (the head) has
//! been passed over `bound` times, it is admitted next. That bounds every waiting request, because
//! the head has always been passed over at least as often as any other waiting request: every
//! admission that passes over a younger waiting request passes over the head too, and the head
//! has waited longer (requests enter in rank order and leave only by admission).
//!
//! Counting: an admission of rank `a` passes over the waiting request of rank `r` iff `a > r`,
//! and every admission of a rank `a > r` happens after `r` arrived (ranks are given in arrival
//! order). So `passes(r)` is the number of admissions so far of ranks above `r`: the total minus
//! those at or below `r`. The clock keeps the admissions below the head as one count and those at
//! or above it per rank (a deque from the head's rank on), folding ranks into the count as the
//! head moves up, so every operation is O(1) amortized.

use std::collections::VecDeque;

/// Counts admissions by rank relative to the oldest waiting request.
///
/// Invariants: `below_head` counts the admissions of ranks `< head`; `at_or_above[k]` counts
/// those of rank `head + k`; `below_head + sum(at_or_above) == total`.
#[derive(Debug, Clone, Default)]
pub(crate) struct AgingClock {
    /// Admissions counted so far.
    total: u64,
    /// Rank of the oldest waiting request (while one waits).
    head: u64,
    /// Admissions of ranks below `head`.
    below_head: u64,
    /// Admissions of rank `head + k` at index `k`.
    at_or_above: VecDeque<u32>,
}

impl AgingClock {
    /// Records one admission of a request of rank `rank` (a first admission, or a re-admission
    /// after preemption).
    pub fn admitted(&mut self, rank: u64) {
        self.total += 1;
        if rank < self.head {
            self.below_head += 1;
            return;
        }
        let k = (rank - self.head) as usize;
        if self.at_or_above.len() <= k {
            self.at_or_above.resize(k + 1, 0);
        }
        self.at_or_above[k] += 1;
    }

    /// The oldest waiting request is now `head` (>= the previous head, or any rank when nothing
    /// waited before).
    pub fn set_head(&mut self, head: u64) {
        if head < self.head {
            // Nothing waited: no admission can have a rank above a newly arrived request's, so
            // every admission so far counts as below it.
            debug_assert!(
                self.total
                    == self.below_head
                        + self.at_or_above.iter().map(|&c| u64::from(c)).sum::<u64>()
            );
            self.head = head;
            self.below_head = self.total;
            self.at_or_above.clear();
            return;
        }
        let mut step = head - self.head;
        while step > 0 {
            match self.at_or_above.pop_front() {
                Some(count) => self.below_head += u64::from(count),
                None => break,
            }
            step -= 1;
        }
        self.head = head;
    }

    /// Admissions that passed over the request of rank `self.head` (while it waits).
    pub fn head_passes(&self) -> u64 {
        let at_head = self.at_or_above.front().map_or(0, |&c| u64::from(c));
        self.total - self.below_head - at_head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// passes(r) by definition: admissions of ranks above r.
    fn passes(log: &[u64], r: u64) -> u64 {
        log.iter().filter(|&&a| a > r).count() as u64
    }

    #[test]
    fn head_passes_counts_admissions_of_younger_requests() {
        let mut clock = AgingClock::default();
        let mut log = Vec::new();
        clock.set_head(0);
        for a in [3, 5, 1, 7, 0] {
            clock.admitted(a);
            log.push(a);
        }
        assert_eq!(clock.head_passes(), passes(&log, 0)); // 3, 5, 1, 7 passed over 0
        clock.set_head(2);
        assert_eq!(clock.head_passes(), passes(&log, 2));
        clock.admitted(2);
        log.push(2);
        clock.set_head(4);
        assert_eq!(clock.head_passes(), passes(&log, 4)); // 5, 7
        clock.set_head(9);
        assert_eq!(clock.head_passes(), 0);
        // The queue ran empty; a request arrives with a rank above every admission.
        clock.set_head(10);
        clock.admitted(12);
        log.push(12);
        assert_eq!(clock.head_passes(), 1);
    }

    #[test]
    fn matches_the_definition_on_random_logs() {
        let mut rng = crate::rng::SplitMix64::new(7);
        for _ in 0..200 {
            let mut clock = AgingClock::default();
            let mut log = Vec::new();
            let mut head = 0u64;
            clock.set_head(0);
            for _ in 0..50 {
                if rng.next_below(3) == 0 {
                    head += rng.next_below(4);
                    clock.set_head(head);
                } else {
                    let a = rng.next_below(head + 20);
                    clock.admitted(a);
                    log.push(a);
                }
                assert_eq!(clock.head_passes(), passes(&log, head));
            }
        }
    }
}
