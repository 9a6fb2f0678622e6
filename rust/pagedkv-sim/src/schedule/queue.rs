//! [`CacheAwareQueue`]: the waiting queue of a cache-aware scheduler, for the simulator and for
//! an engine embedding the allocator: requests in, the allocator's KV events in, the next
//! request to admit out, with the aging bound enforced.

use std::collections::VecDeque;

use pagedkv::{BlockHash, DrainedEvent, DrainedEvents, Error, KvEvent, Result, Tier};

use super::aging::AgingClock;
use super::index::WaitingIndex;
use crate::config::Scheduling;

/// What a queue did, for the run's statistics.
///
/// ```
/// use pagedkv_sim::QueueStats;
/// assert_eq!(QueueStats::default().max_passed_over, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Requests admitted from the queue.
    pub admissions: u64,
    /// Most admissions that passed over one request while it waited (at most the aging bound).
    pub max_passed_over: u64,
    /// Admissions of the oldest request because it had reached the aging bound.
    pub forced_admissions: u64,
    /// Blocks the allocator evicted while reachable and on a waiting request's chain: hits a
    /// queue-aware eviction would have kept (docs/scheduling.md).
    pub evicted_wanted_blocks: u64,
}

/// Waiting requests ordered by a [`Scheduling`] policy over the prefix cache.
///
/// The caller pushes each arriving request with the chained hashes of its prompt's full blocks
/// (`KvCacheManager::prefix_block_hashes`, the same hasher and seed as the allocator), feeds every
/// KV event the allocator records ([`CacheAwareQueue::apply`]), asks [`CacheAwareQueue::peek`] for
/// the next request and reports each admission ([`CacheAwareQueue::admitted`]). Admissions of
/// requests that come back from outside the queue (preempted, swapped out) are reported with
/// [`CacheAwareQueue::other_admitted`] and asked with [`CacheAwareQueue::may_admit_other`], so
/// that the aging bound holds for them too. Only the device tier's events count.
///
/// ```
/// use pagedkv::{KvCacheManager, ManagerConfig};
/// use pagedkv_sim::{CacheAwareQueue, Scheduling};
/// let mut kv = KvCacheManager::new(ManagerConfig {
///     num_blocks: 16, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
///     ..Default::default()
/// })?;
/// let mut queue = CacheAwareQueue::new(Scheduling::Lpm, 8);
/// let (a, b): (&[u32], &[u32]) = (&[9, 9, 9], &[1, 2, 3, 4, 5]);
/// queue.push(0, &kv.prefix_block_hashes(a, None), 1)?;
/// queue.push(1, &kv.prefix_block_hashes(b, None), 2)?;
/// kv.add_sequence(7, &[1, 2, 3, 4, 8], None)?;          // another request caches [1 2] [3 4]
/// for event in kv.take_events() { queue.apply(&event)?; }
/// assert_eq!(queue.peek(), Some(1));                      // 2 cached blocks beat none
/// assert_eq!(queue.hit_blocks(1), Some(2));
/// queue.admitted(1)?;
/// assert_eq!(queue.peek(), Some(0));
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug)]
pub struct CacheAwareQueue {
    policy: Scheduling,
    aging_bound: u64,
    index: WaitingIndex,
    clock: AgingClock,
    /// `(id, rank)` of every request pushed and not yet seen gone, in arrival order; the front is
    /// the oldest waiting request once entries of requests no longer waiting are dropped.
    arrivals: VecDeque<(u64, u64)>,
    next_rank: u64,
    stats: QueueStats,
}

impl CacheAwareQueue {
    /// An empty queue ordering by `policy`; no request is passed over more than `aging_bound`
    /// times (0: first come, first served).
    pub fn new(policy: Scheduling, aging_bound: usize) -> CacheAwareQueue {
        CacheAwareQueue {
            policy,
            aging_bound: aging_bound as u64,
            index: WaitingIndex::new(policy == Scheduling::Dfs),
            clock: AgingClock::default(),
            arrivals: VecDeque::new(),
            next_rank: 0,
            stats: QueueStats::default(),
        }
    }

    /// The ordering policy.
    pub fn policy(&self) -> Scheduling {
        self.policy
    }

    /// Most admissions that may pass over a waiting request.
    pub fn aging_bound(&self) -> usize {
        self.aging_bound as usize
    }

    /// Waiting requests.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// Records queue-aware eviction marks from now on ([`CacheAwareQueue::take_eviction_marks`]).
    pub fn record_eviction_marks(&mut self) {
        self.index.record_marks();
    }

    /// Drains the marks of queue-aware eviction recorded since the last call, in order: a block
    /// hash some waiting request came to go through (`true`: it will hit it once cached) or that
    /// the last such request left (`false`). Feed them to
    /// `KvCacheManager::set_eviction_priority` before the next admission.
    pub fn take_eviction_marks(&mut self, out: &mut Vec<(BlockHash, bool)>) {
        out.clear();
        std::mem::swap(out, &mut self.index.marks);
    }

    /// Trie nodes held (waiting chains and cached blocks).
    pub fn num_nodes(&self) -> usize {
        self.index.num_nodes()
    }

    /// Adds a request (its `id` not waiting already) whose prompt's full blocks have the chained
    /// hashes `block_hashes` and which can hit at most `max_hit_blocks` of them (a prompt of `n`
    /// tokens: `(n - 1) / block_size`, its last token is always computed). Returns its arrival
    /// rank (0, 1, 2, ... in push order).
    pub fn push(
        &mut self,
        id: u64,
        block_hashes: &[BlockHash],
        max_hit_blocks: usize,
    ) -> Result<u64> {
        let rank = self.next_rank;
        self.index.push(id, rank, block_hashes, max_hit_blocks)?;
        self.next_rank += 1;
        if self.arrivals.is_empty() {
            self.clock.set_head(rank);
        }
        self.arrivals.push_back((id, rank));
        Ok(rank)
    }

    /// The oldest waiting request `(id, rank)`.
    fn head(&mut self) -> Option<(u64, u64)> {
        let mut moved = false;
        while let Some(&(id, rank)) = self.arrivals.front() {
            if self.index.rank(id) == Some(rank) {
                if moved {
                    self.clock.set_head(rank);
                }
                return Some((id, rank));
            }
            self.arrivals.pop_front();
            moved = true;
        }
        None
    }

    /// Admissions that passed over the oldest waiting request (0 when nothing waits).
    pub fn head_passes(&mut self) -> u64 {
        match self.head() {
            Some(_) => self.clock.head_passes(),
            None => 0,
        }
    }

    /// The request to admit next: the oldest when it has been passed over `aging_bound` times,
    /// else the policy's choice. `None` when nothing waits.
    pub fn peek(&mut self) -> Option<u64> {
        let (head, _) = self.head()?;
        if self.clock.head_passes() >= self.aging_bound {
            return Some(head);
        }
        let choice = match self.policy {
            Scheduling::Fcfs => return Some(head),
            Scheduling::Lpm => self.index.longest_prefix_first(),
            Scheduling::Dfs => self.index.depth_first(),
        };
        choice.map(|(id, _)| id)
    }

    /// The blocks waiting request `id` would hit if admitted now.
    pub fn hit_blocks(&self, id: u64) -> Option<usize> {
        self.index.hit_blocks(id)
    }

    /// The arrival rank of waiting request `id`.
    pub fn rank(&self, id: u64) -> Option<u64> {
        self.index.rank(id)
    }

    /// Request `id` was admitted: it leaves the queue. A request that is not waiting is
    /// `InvalidArgument`, changing nothing. Feed the admission's KV events before the next
    /// [`CacheAwareQueue::push`] or `admitted`: the index then keeps the request's newly cached
    /// blocks instead of dropping its nodes and entering them again (correct either way).
    pub fn admitted(&mut self, id: u64) -> Result<()> {
        let rank = self
            .index
            .rank(id)
            .ok_or_else(|| Error::InvalidArgument(format!("request {id} is not waiting")))?;
        // The head has been passed over at least as often as any waiting request.
        let head_passes = self.head_passes();
        self.stats.max_passed_over = self.stats.max_passed_over.max(head_passes);
        if self.head().is_some_and(|(h, _)| h == id) && head_passes >= self.aging_bound {
            self.stats.forced_admissions += 1;
        }
        self.index.remove(id, true);
        self.clock.admitted(rank);
        self.stats.admissions += 1;
        self.note_head();
        Ok(())
    }

    /// Whether a request of arrival rank `rank` coming back from outside the queue may be
    /// admitted now: not when the oldest waiting request, older than it, is due.
    pub fn may_admit_other(&mut self, rank: u64) -> bool {
        match self.head() {
            Some((_, head)) => rank <= head || self.clock.head_passes() < self.aging_bound,
            None => true,
        }
    }

    /// A request of arrival rank `rank` from outside the queue was admitted.
    pub fn other_admitted(&mut self, rank: u64) {
        self.head();
        self.clock.admitted(rank);
        self.note_head();
    }

    /// Drops waiting request `id` without admitting it (an abort); `false` if it was not waiting.
    pub fn remove(&mut self, id: u64) -> bool {
        let removed = self.index.remove(id, false).is_some();
        self.head();
        removed
    }

    /// Feeds one KV event of the allocator (device tier; others are ignored).
    pub fn apply(&mut self, event: &KvEvent) -> Result<()> {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                medium: Tier::Device,
                ..
            } => {
                self.index.stored(*parent_block_hash, block_hashes);
                Ok(())
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium: Tier::Device,
                ..
            } => {
                for &h in block_hashes {
                    self.index.removed(h)?;
                }
                self.stats.evicted_wanted_blocks = self.index.evicted_wanted_blocks;
                Ok(())
            }
            KvEvent::AllBlocksCleared => self.index.cleared(),
            _ => Ok(()),
        }
    }

    /// Feeds drained KV events (`KvCacheManager::take_drained_events`), as [`Self::apply`]
    /// does each of them but reading a device block's removal in place: no `KvEvent` is built
    /// and nothing is allocated per removal (the allocator's drain was most of the per-request
    /// cost of a queue of unique prompts, docs/scheduling.md, Cost). Only group 0's events of
    /// a hybrid manager are applied (each group stores and removes its own copies, and group 0
    /// holds full-attention layers, the one kind that keeps a whole prefix); a single-group
    /// manager's events have no group. Returns how many were applied; on an error the events
    /// before it are applied.
    pub fn apply_drained(&mut self, events: &DrainedEvents) -> Result<usize> {
        let mut applied = 0;
        for event in events.iter() {
            match event {
                DrainedEvent::DeviceRemoval {
                    block_hash,
                    group_idx: None | Some(0),
                } => {
                    self.index.removed(block_hash)?;
                    self.stats.evicted_wanted_blocks = self.index.evicted_wanted_blocks;
                }
                DrainedEvent::Event(
                    e @ (KvEvent::BlockStored {
                        group_idx: None | Some(0),
                        ..
                    }
                    | KvEvent::BlockRemoved {
                        group_idx: None | Some(0),
                        ..
                    }
                    | KvEvent::AllBlocksCleared),
                ) => self.apply(e)?,
                _ => continue,
            }
            applied += 1;
        }
        Ok(applied)
    }

    /// What the queue did so far.
    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Checks the index's invariants (slow; for tests): `InvariantViolation` naming the first
    /// broken one.
    pub fn check_invariants(&self) -> Result<()> {
        self.index.check().map_err(Error::InvariantViolation)
    }

    /// Samples the new head's count into `max_passed_over`.
    fn note_head(&mut self) {
        if self.head().is_some() {
            self.stats.max_passed_over = self.stats.max_passed_over.max(self.clock.head_passes());
        }
    }
}
