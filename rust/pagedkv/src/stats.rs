//! Counters a manager exposes through [`crate::KvCacheManager::stats`].

/// A snapshot of one manager's state and lifetime counters. Counter names say their unit
/// (`blocks_*` count blocks, `forks` and `cow_copies` count operations). The Python `stats()`
/// dict has one key per field under the field's name (and three historical aliases;
/// docs/design.md, Python API, lists them).
///
/// ```
/// use pagedkv::{KvCacheManager, ManagerConfig};
/// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 8, block_size: 4, ..Default::default() })?;
/// kv.add_sequence_len(1, 6)?;
/// kv.fork(1, 2)?;
/// kv.append_len(2, 1)?;                         // copy-on-write of the shared partial block
/// let s = kv.stats();
/// assert_eq!((s.num_blocks_in_use, s.blocks_allocated, s.cow_copies, s.forks), (3, 3, 1, 1));
/// assert_eq!(s.num_blocks_in_use + s.num_cached_blocks + s.num_free_list_blocks, s.num_blocks);
/// assert_eq!(s.num_available_blocks, kv.num_available_blocks());
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Device blocks in the pool.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Distinct device blocks referenced by this manager's sequences or pins (refcount > 0).
    pub num_blocks_in_use: usize,
    /// This manager's cached-evictable blocks (refcount 0, still indexed by the prefix cache).
    pub num_cached_blocks: usize,
    /// Blocks on the pool's free list (shared with other managers on the same pool).
    pub num_free_list_blocks: usize,
    /// Blocks this manager can allocate now: `num_free_list_blocks + num_cached_blocks`
    /// ([`crate::KvCacheManager::num_available_blocks`]).
    pub num_available_blocks: usize,
    /// Live sequences (device-resident and swapped out).
    pub num_sequences: usize,
    /// Blocks handed to this manager's sequences as fresh blocks (pool or evicted), lifetime.
    pub blocks_allocated: u64,
    /// Blocks whose refcount dropped to 0 (to the free list or the cache), lifetime.
    pub blocks_freed: u64,
    /// Copy-on-write copies recorded (one block each), lifetime.
    pub cow_copies: u64,
    /// Successful forks (sequences created by `fork`), lifetime.
    pub forks: u64,
    /// Prompt tokens looked up in the prefix cache, lifetime.
    pub prefix_query_tokens: u64,
    /// Prompt tokens served from the prefix cache, lifetime.
    pub prefix_hit_tokens: u64,
    /// `prefix_hit_tokens / prefix_query_tokens` (0 when nothing was queried).
    pub prefix_hit_rate: f64,
    /// Cached blocks evicted to satisfy allocations, lifetime.
    pub blocks_evicted: u64,
    /// Distinct blocks held by `pin_prefix` pins (in use, never evicted).
    pub num_pinned_blocks: usize,
    /// KV events dropped because the bounded event queue was full, lifetime.
    pub events_dropped: u64,
    /// Memory held by undrained KV events, in bytes (bounded; see `take_events`).
    pub event_queue_bytes: usize,
    /// Pending copy-on-write copies found dead (their destination overwritten or released
    /// before the caller drained them) and dropped to bound the queue, lifetime.
    pub copy_ops_elided: u64,
    /// Blocks in the host tier (0: no host tier).
    pub num_host_blocks: usize,
    /// Host blocks referenced by swapped-out sequences.
    pub num_host_blocks_in_use: usize,
    /// Sequences currently swapped out.
    pub num_swapped_sequences: usize,
    /// Device blocks copied to the host by swap-out, lifetime.
    pub blocks_swapped_out: u64,
    /// Host blocks copied back to the device by swap-in, lifetime.
    pub blocks_swapped_in: u64,
    /// Host blocks of the offload tier (0: none).
    pub num_offload_blocks: usize,
    /// Offload-tier host blocks holding an evicted prefix block's content.
    pub num_offloaded_blocks: usize,
    /// Offload ops recorded (evicted prefix blocks kept in the offload tier), lifetime.
    pub blocks_offloaded: u64,
    /// Load ops recorded (offload-tier hits loaded back), lifetime.
    pub blocks_loaded: u64,
    /// Offload-tier entries dropped to make room (least recently used first), lifetime.
    pub offload_blocks_dropped: u64,
    /// Pool blocks the manager holds out of use: 1 with a reserved null block
    /// (`ManagerConfig::reserve_null_block`), else 0. `num_blocks_in_use + num_cached_blocks +
    /// num_free_list_blocks + num_reserved_blocks == num_blocks` on a pool of its own.
    pub num_reserved_blocks: usize,
    /// Pending offload and load ops whose copies could no longer be observed (a later op
    /// writes the same block, or nothing holds it any more) dropped to bound the queues of a
    /// caller that does not drain them, lifetime.
    pub offload_ops_elided: u64,
}
