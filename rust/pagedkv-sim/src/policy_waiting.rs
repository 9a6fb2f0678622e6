//! The step loop's waiting requests under a cache-aware policy: a [`CacheAwareQueue`] of the
//! arrived requests, kept in step with the allocator's prefix cache through its KV events.
//!
//! Every admission is checked against the index: the hit the allocator reports must be the hit
//! the index predicted, or the run stops with `InvariantViolation` (the index would be ordering
//! the queue by a cache that is not there).

use pagedkv::{BlockHash, Error, Result};

use crate::config::SimConfig;
use crate::group::Group;
use crate::memory::KvMemory;
use crate::schedule::{CacheAwareQueue, QueueStats};

pub(crate) struct PolicyWaiting {
    queue: CacheAwareQueue,
    /// The waiting groups by request index (`Some` exactly for the requests in `queue`).
    groups: Vec<Option<Group>>,
    block_size: usize,
    hashes: Vec<BlockHash>,
    /// Queue-aware eviction: the queue's marks reach the allocator after every change.
    queue_aware_eviction: bool,
    marks: Vec<(BlockHash, bool)>,
}

impl PolicyWaiting {
    pub fn new(config: &SimConfig, num_requests: usize) -> Self {
        let mut queue = CacheAwareQueue::new(config.scheduling, config.aging_bound);
        if config.queue_aware_eviction {
            queue.record_eviction_marks();
        }
        PolicyWaiting {
            queue,
            groups: (0..num_requests).map(|_| None).collect(),
            block_size: config.block_size,
            hashes: Vec::new(),
            queue_aware_eviction: config.queue_aware_eviction,
            marks: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Queues an arrived request (requests arrive in index order, so its rank is its index).
    pub fn push(&mut self, memory: &mut dyn KvMemory, group: Group) -> Result<()> {
        memory.prompt_block_hashes(&group, &mut self.hashes)?;
        let max_hit_blocks = group.spec.prompt_tokens.saturating_sub(1) / self.block_size;
        let request = group.request;
        let rank = self
            .queue
            .push(request as u64, &self.hashes, max_hit_blocks)?;
        debug_assert_eq!(rank, request as u64, "requests arrive in index order");
        self.groups[request] = Some(group);
        self.send_marks(memory)
    }

    /// Passes the queue's eviction marks to the allocator (queue-aware eviction), runs of equal
    /// marks in one call.
    fn send_marks(&mut self, memory: &mut dyn KvMemory) -> Result<()> {
        if !self.queue_aware_eviction {
            return Ok(());
        }
        self.queue.take_eviction_marks(&mut self.marks);
        for run in self.marks.chunk_by(|a, b| a.1 == b.1) {
            self.hashes.clear();
            self.hashes.extend(run.iter().map(|&(h, _)| h));
            memory.set_eviction_priority(&self.hashes, run[0].1)?;
        }
        Ok(())
    }

    /// Feeds the allocator's KV events since the last call to the index.
    pub fn sync(&mut self, memory: &mut dyn KvMemory) -> Result<()> {
        self.queue.apply_drained(&memory.take_cache_events()?)?;
        Ok(())
    }

    /// The request to admit next.
    pub fn peek(&mut self) -> Option<usize> {
        self.queue.peek().map(|id| id as usize)
    }

    /// The tokens the index predicts waiting `request` hits now.
    pub fn predicted_hit_tokens(&self, request: usize) -> usize {
        self.queue.hit_blocks(request as u64).unwrap_or(0) * self.block_size
    }

    pub fn group_mut(&mut self, request: usize) -> Result<&mut Group> {
        self.groups[request]
            .as_mut()
            .ok_or_else(|| Error::InvariantViolation(format!("request {request} is not waiting")))
    }

    /// `request` was admitted with `hit_tokens` from the cache: it leaves the queue, and the
    /// events of its admission reach the index.
    pub fn admitted(
        &mut self,
        memory: &mut dyn KvMemory,
        request: usize,
        hit_tokens: usize,
    ) -> Result<Group> {
        let predicted = self.predicted_hit_tokens(request);
        if hit_tokens != predicted {
            return Err(Error::InvariantViolation(format!(
                "request {request} hit {hit_tokens} cached tokens but the scheduling index predicted {predicted}"
            )));
        }
        self.queue.admitted(request as u64)?;
        self.send_marks(memory)?;
        self.sync(memory)?;
        self.groups[request].take().ok_or_else(|| {
            Error::InvariantViolation(format!("request {request} was admitted twice"))
        })
    }

    /// Whether a preempted or swapped-out group of request `request` may come back now (the
    /// aging bound).
    pub fn may_admit_other(&mut self, request: usize) -> bool {
        self.queue.may_admit_other(request as u64)
    }

    /// A preempted or swapped-out group of request `request` came back.
    pub fn other_admitted(&mut self, request: usize) {
        self.queue.other_admitted(request as u64);
    }

    pub fn stats(&self) -> QueueStats {
        self.queue.stats()
    }

    pub fn check_invariants(&self) -> Result<()> {
        self.queue.check_invariants()
    }
}
