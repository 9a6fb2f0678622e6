//! KV events: every change to the prefix index, for KV-aware routers.
//!
//! While prefix caching and `ManagerConfig::enable_kv_events` are on, every index change is
//! recorded as a [`KvEvent`] whose field names follow vLLM's KV-event schema (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`). With events off (the default, as in vLLM) the queue is
//! disabled: callers test [`EventQueue::enabled`] before building an event, so no event is
//! allocated at all. The queue is bounded twice: by count (`ManagerConfig::max_events`) and by
//! memory ([`MAX_EVENT_BYTES`], counting each event's heap buffers at their capacity). When a new
//! event would pass either bound the **oldest** events are dropped until it fits, and
//! `Stats::events_dropped` counts them, so a consumer that falls behind sees a gap it can detect
//! (and can resync after an `AllBlocksCleared`) rather than unbounded memory growth. An event
//! larger than the whole byte budget on its own is dropped (and counted) instead of emptying the
//! queue for it.
//!
//! Why bytes too: one `BlockStored` of a 32k-token prompt carries its 32k token ids (~160 KB),
//! so a count bound alone (65 536 events) still allows gigabytes.

use std::collections::VecDeque;

use crate::{BlockHash, Tier, TokenId};

/// A change to the prefix-cache index, named and shaped after vLLM's KV events
/// (`vllm.distributed.kv_events`), for KV-aware routers.
///
/// ```
/// use pagedkv::{KvCacheManager, KvEvent, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig {
///     num_blocks: 4, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
///     ..Default::default()
/// })?;
/// kv.add_sequence(1, &[1, 2, 3], None)?;
/// match &kv.take_events()[..] {
///     [KvEvent::BlockStored { block_hashes, parent_block_hash: None, token_ids, block_size: 2, .. }] => {
///         assert_eq!(block_hashes.len(), 1);
///         assert_eq!(token_ids, &[1, 2]);
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one prefix chain were entered in the index.
    BlockStored {
        /// Hashes of the stored blocks, in chain order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first stored one (`None`: the chain starts here).
        parent_block_hash: Option<BlockHash>,
        /// The stored blocks' token ids, concatenated (`block_hashes.len() * block_size`).
        token_ids: Vec<TokenId>,
        /// Tokens per block.
        block_size: usize,
        /// The sequence's extra key (salt / adapter / multimodal hash), if any.
        extra_key: Option<Vec<u8>>,
        /// Where the blocks live (vLLM's `medium`; always the device tier here).
        medium: Tier,
    },
    /// Blocks were evicted from the index (their content is gone).
    BlockRemoved {
        /// Hashes of the removed blocks.
        block_hashes: Vec<BlockHash>,
        /// Where the blocks lived.
        medium: Tier,
    },
    /// The whole index was cleared (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// Memory bound of one manager's undrained KV events: 64 MiB (about 400 `BlockStored` events
/// of 32k-token prompts, or ~500 000 small ones), as measured by [`event_bytes`].
pub(crate) const MAX_EVENT_BYTES: usize = 64 << 20;

/// The memory one queued event holds: the enum itself plus its heap buffers at capacity.
pub(crate) fn event_bytes(event: &KvEvent) -> usize {
    let heap = match event {
        KvEvent::BlockStored {
            block_hashes,
            token_ids,
            extra_key,
            ..
        } => {
            block_hashes.capacity() * std::mem::size_of::<BlockHash>()
                + token_ids.capacity() * std::mem::size_of::<TokenId>()
                + extra_key.as_ref().map_or(0, Vec::capacity)
        }
        KvEvent::BlockRemoved { block_hashes, .. } => {
            block_hashes.capacity() * std::mem::size_of::<BlockHash>()
        }
        KvEvent::AllBlocksCleared => 0,
    };
    std::mem::size_of::<KvEvent>() + heap
}

/// The bounded event queue: oldest first; when a new event would pass the count or byte
/// bound, the oldest events are dropped and counted.
#[derive(Debug)]
pub(crate) struct EventQueue {
    events: VecDeque<KvEvent>,
    /// Whether events are recorded at all (`ManagerConfig::enable_kv_events`).
    enabled: bool,
    /// Count capacity (0: every event is dropped).
    max_events: usize,
    /// Byte capacity ([`MAX_EVENT_BYTES`]).
    max_bytes: usize,
    /// Sum of [`event_bytes`] over `events` (invariant).
    bytes: usize,
    /// Events dropped because a bound was reached, lifetime.
    pub(crate) dropped: u64,
}

impl EventQueue {
    pub(crate) fn new(enabled: bool, max_events: usize) -> Self {
        Self::with_byte_limit(enabled, max_events, MAX_EVENT_BYTES)
    }

    pub(crate) fn with_byte_limit(enabled: bool, max_events: usize, max_bytes: usize) -> Self {
        EventQueue {
            events: VecDeque::new(),
            enabled,
            max_events,
            max_bytes,
            bytes: 0,
            dropped: 0,
        }
    }

    /// Whether events are recorded; callers skip building an event when not.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records `event` (nothing when disabled).
    pub(crate) fn push(&mut self, event: KvEvent) {
        if !self.enabled {
            return;
        }
        let size = event_bytes(&event);
        if self.max_events == 0 || size > self.max_bytes {
            self.dropped += 1;
            return;
        }
        while self.events.len() >= self.max_events || self.bytes + size > self.max_bytes {
            let Some(oldest) = self.events.pop_front() else {
                break;
            };
            self.bytes -= event_bytes(&oldest);
            self.dropped += 1;
        }
        self.bytes += size;
        self.events.push_back(event);
    }

    /// Bytes held by the queued events ([`event_bytes`] summed).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Drains the queue, oldest first.
    pub(crate) fn take(&mut self) -> Vec<KvEvent> {
        self.bytes = 0;
        self.events.drain(..).collect()
    }
}

/// The one builder of [`KvEvent::BlockStored`]: collects consecutive blocks of one chain that
/// were entered in the index and reports them as one event on [`StoredRun::flush`].
#[derive(Debug, Default)]
pub(crate) struct StoredRun {
    hashes: Vec<BlockHash>,
    /// The parent of the first collected block.
    parent: Option<BlockHash>,
    token_ids: Vec<TokenId>,
}

impl StoredRun {
    /// A run sized for up to `num_blocks` blocks of `block_size` tokens, so collecting them
    /// never reallocates (an admission knows how many blocks it may register).
    pub(crate) fn with_capacity(num_blocks: usize, block_size: usize) -> Self {
        StoredRun {
            hashes: Vec::with_capacity(num_blocks),
            parent: None,
            token_ids: Vec::with_capacity(num_blocks.saturating_mul(block_size)),
        }
    }

    /// Adds the next block of the run (`parent` is its parent's hash).
    pub(crate) fn add(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) {
        if self.hashes.is_empty() {
            self.parent = parent;
        }
        self.hashes.push(hash);
        self.token_ids.extend_from_slice(tokens);
    }

    /// Records the collected blocks as one `BlockStored` event (nothing when empty) and
    /// starts a new run.
    pub(crate) fn flush(
        &mut self,
        events: &mut EventQueue,
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) {
        if self.hashes.is_empty() {
            return;
        }
        events.push(KvEvent::BlockStored {
            block_hashes: std::mem::take(&mut self.hashes),
            parent_block_hash: self.parent.take(),
            token_ids: std::mem::take(&mut self.token_ids),
            block_size,
            extra_key: extra_key.map(<[u8]>::to_vec),
            medium: Tier::Device,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queue_drops_the_oldest() {
        let mut q = EventQueue::new(true, 2);
        for i in 0..3 {
            q.push(KvEvent::BlockRemoved {
                block_hashes: vec![i],
                medium: Tier::Device,
            });
        }
        assert_eq!(q.dropped, 1);
        let kept: Vec<_> = q.take();
        assert_eq!(kept.len(), 2);
        assert!(
            matches!(&kept[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes == &[1])
        );
        let mut none = EventQueue::new(true, 0);
        none.push(KvEvent::AllBlocksCleared);
        assert_eq!((none.dropped, none.take().len()), (1, 0));
        let mut off = EventQueue::new(false, 8);
        off.push(KvEvent::AllBlocksCleared);
        assert_eq!((off.dropped, off.take().len()), (0, 0));
    }

    fn stored(tokens: usize) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![1; tokens / 16],
            parent_block_hash: None,
            token_ids: vec![7; tokens],
            block_size: 16,
            extra_key: None,
            medium: Tier::Device,
        }
    }

    #[test]
    fn byte_bound_drops_the_oldest_and_counts_them() {
        let one = event_bytes(&stored(1024));
        let mut q = EventQueue::with_byte_limit(true, 1000, 3 * one);
        for _ in 0..10 {
            q.push(stored(1024));
            assert!(q.bytes() <= 3 * one);
        }
        assert_eq!((q.dropped, q.take().len(), q.bytes()), (7, 3, 0));
        // An event larger than the whole budget is dropped alone; the queue keeps its events.
        q.push(stored(16));
        q.push(stored(1 << 16));
        assert_eq!(q.dropped, 8);
        assert_eq!(q.take().len(), 1);
    }

    #[test]
    fn a_cycled_long_prompt_stays_within_the_default_byte_bound() {
        // A 32k-token prompt's event repeated without draining; ~158 KB each.
        let mut q = EventQueue::new(true, 65_536);
        for _ in 0..1_000 {
            q.push(stored(32 * 1024));
            q.push(KvEvent::AllBlocksCleared);
        }
        assert!(q.bytes() <= MAX_EVENT_BYTES);
        assert!(q.dropped > 0);
        let kept = q.take();
        assert!(matches!(kept.last(), Some(KvEvent::AllBlocksCleared)));
    }

    #[test]
    fn stored_run_reports_consecutive_blocks_once() {
        let mut q = EventQueue::new(true, 8);
        let mut run = StoredRun::default();
        run.flush(&mut q, 2, None); // empty: nothing
        run.add(10, Some(9), &[1, 2]);
        run.add(11, Some(10), &[3, 4]);
        run.flush(&mut q, 2, Some(b"k"));
        run.add(20, None, &[5, 6]);
        run.flush(&mut q, 2, None);
        let events = q.take();
        assert_eq!(
            events[0],
            KvEvent::BlockStored {
                block_hashes: vec![10, 11],
                parent_block_hash: Some(9),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                extra_key: Some(b"k".to_vec()),
                medium: Tier::Device,
            }
        );
        assert!(matches!(
            &events[1],
            KvEvent::BlockStored {
                parent_block_hash: None,
                ..
            }
        ));
        assert_eq!(events.len(), 2);
    }
}
