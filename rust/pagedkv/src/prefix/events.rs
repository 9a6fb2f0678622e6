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
//!
//! The queue holds a block removal as its hash alone (a 32-byte entry, no heap buffer) and
//! builds its `KvEvent::BlockRemoved` only when drained. An admission that misses the cache
//! evicts one cached block per new block, each a `BlockRemoved` of one hash: built eagerly,
//! every one was a heap allocation and a 128-byte entry, which made recording events a large
//! share of such an admission (callgrind, `prefix_miss_events` against events off, in
//! benches/results/2026-12-01-prefix-admission.md and later files).

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
        /// The KV-cache group the blocks belong to (vLLM's `group_idx`): the group's index in
        /// a hybrid manager (`ManagerConfig::kv_groups`), `None` for the plain manager's one
        /// group (omitted on the wire, as vLLM omits its default).
        group_idx: Option<u32>,
    },
    /// Blocks were evicted from the index (their content is gone).
    BlockRemoved {
        /// Hashes of the removed blocks.
        block_hashes: Vec<BlockHash>,
        /// Where the blocks lived.
        medium: Tier,
        /// The KV-cache group the blocks belonged to (vLLM's `group_idx`; see `BlockStored`).
        group_idx: Option<u32>,
    },
    /// The whole index was cleared (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// Memory bound of one manager's undrained KV events: 64 MiB (about 400 `BlockStored` events
/// of 32k-token prompts, or two million block removals), as measured by [`Queued::bytes`].
pub(crate) const MAX_EVENT_BYTES: usize = 64 << 20;

/// One event as the queue holds it (see the module docs): a removal of one device block is
/// its hash and group; any other event is boxed, so that every entry stays small.
#[derive(Debug)]
enum Queued {
    /// `KvEvent::BlockRemoved` of this one hash, on the device tier, in this group.
    Removed(BlockHash, Option<u32>),
    Event(Box<KvEvent>),
}

// A removal's entry is its hash and the discriminant: 32 bytes, a quarter of a `KvEvent`.
const _: () = assert!(std::mem::size_of::<Queued>() == 32);

impl Queued {
    fn new(event: KvEvent) -> Self {
        match event {
            KvEvent::BlockRemoved {
                block_hashes,
                medium: Tier::Device,
                group_idx,
            } if block_hashes.len() == 1 => Queued::Removed(block_hashes[0], group_idx),
            event => Queued::Event(Box::new(event)),
        }
    }

    /// The memory the entry holds: itself plus what it owns on the heap, at capacity.
    fn bytes(&self) -> usize {
        let owned = match self {
            Queued::Removed(..) => 0,
            Queued::Event(event) => event_bytes(event),
        };
        std::mem::size_of::<Queued>() + owned
    }

    fn into_event(self) -> KvEvent {
        match self {
            Queued::Removed(hash, group_idx) => KvEvent::BlockRemoved {
                block_hashes: vec![hash],
                medium: Tier::Device,
                group_idx,
            },
            Queued::Event(event) => *event,
        }
    }

    #[cfg(feature = "wire")]
    fn view(&self) -> QueuedRef<'_> {
        match self {
            Queued::Removed(hash, group_idx) => QueuedRef::DeviceRemoval(*hash, *group_idx),
            Queued::Event(event) => QueuedRef::Event(event),
        }
    }
}

/// One drained event as the queue held it (see [`DrainedEvents`]); read by the wire encoder.
#[cfg(feature = "wire")]
#[derive(Debug, Clone, Copy)]
pub(crate) enum QueuedRef<'a> {
    /// `KvEvent::BlockRemoved` of this one hash, on the device tier, in this group.
    DeviceRemoval(BlockHash, Option<u32>),
    Event(&'a KvEvent),
}

/// KV events drained as the queue holds them, oldest first: a removal of one device block is
/// still only its hash. A consumer that encodes them at once (`wire::encode_drained_events`,
/// what `take_event_batch` in the Python bindings does) builds no [`KvEvent`] and allocates
/// nothing per removal; [`DrainedEvents::into_events`] gives the public events.
#[derive(Debug, Default)]
pub struct DrainedEvents(Vec<Queued>);

impl DrainedEvents {
    /// Events drained.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing was drained.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The events, as [`crate::KvCacheManager::take_events`] returns them.
    pub fn into_events(self) -> Vec<KvEvent> {
        self.0.into_iter().map(Queued::into_event).collect()
    }

    /// Each event as the queue held it, oldest first.
    #[cfg(feature = "wire")]
    pub(crate) fn views(&self) -> impl ExactSizeIterator<Item = QueuedRef<'_>> + '_ {
        self.0.iter().map(Queued::view)
    }

    /// Each event, oldest first, without building a [`KvEvent`] for a device block's removal
    /// (a consumer that reads them in place, such as a scheduler's index, allocates nothing
    /// per removal).
    ///
    /// ```
    /// use pagedkv::{DrainedEvent, KvCacheManager, KvEvent, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 2, block_size: 2, enable_prefix_caching: true, enable_kv_events: true,
    ///     ..Default::default()
    /// })?;
    /// kv.add_sequence(1, &[1, 2, 3], None)?;
    /// kv.free(1)?;
    /// kv.add_sequence(2, &[7, 8, 9], None)?;                 // evicts [1 2]
    /// let drained = kv.take_drained_events();
    /// let kinds: Vec<&str> = drained.iter().map(|e| match e {
    ///     DrainedEvent::DeviceRemoval { .. } => "removed",
    ///     DrainedEvent::Event(KvEvent::BlockStored { .. }) => "stored",
    ///     DrainedEvent::Event(_) => "other",
    /// }).collect();
    /// assert_eq!(kinds, ["stored", "removed", "stored"]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn iter(&self) -> impl ExactSizeIterator<Item = DrainedEvent<'_>> + '_ {
        self.0.iter().map(|q| match q {
            Queued::Removed(block_hash, group_idx) => DrainedEvent::DeviceRemoval {
                block_hash: *block_hash,
                group_idx: *group_idx,
            },
            Queued::Event(event) => DrainedEvent::Event(event),
        })
    }
}

/// One event of [`DrainedEvents::iter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DrainedEvent<'a> {
    /// `KvEvent::BlockRemoved` of the one block `block_hash` on the device tier, in KV-cache
    /// group `group_idx` (`None` for a single-group manager).
    DeviceRemoval {
        /// The removed block's chained hash.
        block_hash: BlockHash,
        /// Its KV-cache group (`None` for a single-group manager).
        group_idx: Option<u32>,
    },
    /// Any other event.
    Event(&'a KvEvent),
}

/// The memory one event holds: the enum itself plus its heap buffers at capacity.
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
    events: VecDeque<Queued>,
    /// Whether events are recorded at all (`ManagerConfig::enable_kv_events`).
    enabled: bool,
    /// Count capacity (0: every event is dropped).
    max_events: usize,
    /// Byte capacity ([`MAX_EVENT_BYTES`]).
    max_bytes: usize,
    /// Sum of [`Queued::bytes`] over `events` (invariant).
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
        if self.enabled {
            self.enqueue(Queued::new(event));
        }
    }

    /// Records `BlockRemoved` of `hash` on the device tier (nothing when disabled), without
    /// building the event.
    #[inline]
    pub(crate) fn push_removed(&mut self, hash: BlockHash) {
        self.push_removed_in_group(hash, None);
    }

    /// [`EventQueue::push_removed`] of a hybrid manager's block of KV-cache group `group_idx`.
    #[inline]
    pub(crate) fn push_removed_in_group(&mut self, hash: BlockHash, group_idx: Option<u32>) {
        if self.enabled {
            self.enqueue(Queued::Removed(hash, group_idx));
        }
    }

    fn enqueue(&mut self, entry: Queued) {
        let size = entry.bytes();
        if self.max_events == 0 || size > self.max_bytes {
            self.dropped += 1;
            return;
        }
        while self.events.len() >= self.max_events || self.bytes + size > self.max_bytes {
            let Some(oldest) = self.events.pop_front() else {
                break;
            };
            self.bytes -= oldest.bytes();
            self.dropped += 1;
        }
        self.bytes += size;
        self.events.push_back(entry);
    }

    /// Bytes held by the queued events (entries and their heap buffers).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Drains the queue, oldest first.
    #[cfg(test)]
    pub(crate) fn take(&mut self) -> Vec<KvEvent> {
        self.take_drained().into_events()
    }

    /// Drains the queue as it holds the events (see [`DrainedEvents`]).
    pub(crate) fn take_drained(&mut self) -> DrainedEvents {
        self.bytes = 0;
        DrainedEvents(self.events.drain(..).collect())
    }
}

/// The one builder of [`KvEvent::BlockStored`]: consecutive blocks of one chain entered in
/// the index, `block_hashes` in chain order with their `token_ids` concatenated, `parent` the
/// hash before the first. Built once per run from the caller's slices, so collecting a run
/// costs nothing per block.
pub(crate) fn block_stored(
    block_hashes: &[BlockHash],
    parent: Option<BlockHash>,
    token_ids: &[TokenId],
    block_size: usize,
    extra_key: Option<&[u8]>,
) -> KvEvent {
    debug_assert_eq!(token_ids.len(), block_hashes.len() * block_size);
    KvEvent::BlockStored {
        block_hashes: block_hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: token_ids.to_vec(),
        block_size,
        extra_key: extra_key.map(<[u8]>::to_vec),
        medium: Tier::Device,
        group_idx: None,
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
                group_idx: None,
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

    #[test]
    fn removals_are_held_as_hashes_and_drained_as_events() {
        let mut q = EventQueue::new(true, 8);
        q.push_removed(5);
        // The same event pushed built is held the same way; other shapes stay as they came.
        q.push(KvEvent::BlockRemoved {
            block_hashes: vec![6],
            medium: Tier::Device,
            group_idx: None,
        });
        let two = KvEvent::BlockRemoved {
            block_hashes: vec![7, 8],
            medium: Tier::Device,
            group_idx: None,
        };
        let host = KvEvent::BlockRemoved {
            block_hashes: vec![9],
            medium: Tier::Host,
            group_idx: None,
        };
        q.push(two.clone());
        q.push(host.clone());
        q.push(KvEvent::AllBlocksCleared);
        let entry = std::mem::size_of::<Queued>();
        let boxed = |e: &KvEvent| entry + event_bytes(e);
        assert_eq!(
            q.bytes(),
            2 * entry + boxed(&two) + boxed(&host) + boxed(&KvEvent::AllBlocksCleared)
        );
        let removed = |h: BlockHash| KvEvent::BlockRemoved {
            block_hashes: vec![h],
            medium: Tier::Device,
            group_idx: None,
        };
        assert_eq!(
            q.take(),
            vec![removed(5), removed(6), two, host, KvEvent::AllBlocksCleared]
        );
        assert_eq!(q.bytes(), 0);
        // Disabled: nothing is recorded or counted.
        let mut off = EventQueue::new(false, 8);
        off.push_removed(1);
        assert_eq!((off.dropped, off.bytes(), off.take().len()), (0, 0, 0));
    }

    #[test]
    fn removals_count_against_both_bounds() {
        let entry = std::mem::size_of::<Queued>();
        let mut by_count = EventQueue::new(true, 3);
        let mut by_bytes = EventQueue::with_byte_limit(true, 100, 3 * entry);
        for h in 0..5 {
            by_count.push_removed(h);
            by_bytes.push_removed(h);
        }
        for q in [&mut by_count, &mut by_bytes] {
            assert_eq!(q.dropped, 2);
            let kept: Vec<_> = q.take();
            assert!(
                matches!(&kept[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes == &[2])
            );
            assert_eq!(kept.len(), 3);
        }
    }

    fn stored(tokens: usize) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![1; tokens / 16],
            parent_block_hash: None,
            token_ids: vec![7; tokens],
            block_size: 16,
            extra_key: None,
            medium: Tier::Device,
            group_idx: None,
        }
    }

    #[test]
    fn byte_bound_drops_the_oldest_and_counts_them() {
        let one = Queued::new(stored(1024)).bytes();
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
    fn block_stored_carries_the_run() {
        assert_eq!(
            block_stored(&[10, 11], Some(9), &[1, 2, 3, 4], 2, Some(b"k")),
            KvEvent::BlockStored {
                block_hashes: vec![10, 11],
                parent_block_hash: Some(9),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                extra_key: Some(b"k".to_vec()),
                medium: Tier::Device,
                group_idx: None,
            }
        );
    }
}
