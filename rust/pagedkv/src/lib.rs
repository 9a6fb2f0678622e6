//! pagedkv: the paged KV-cache allocator core (no Python).
//!
//! A [`BlockPool`] owns `num_blocks` physical KV blocks of `block_size` token slots with a
//! lock-free free list and atomic refcounts. A [`KvCacheManager`] keeps each sequence's
//! [`BlockTable`] on top of a pool, with fork (sharing) and copy-on-write. Several managers can
//! share one pool, one per thread. docs/design.md, Invariants, states what every operation
//! keeps. For a scheduler: chunked prefill with a computed watermark
//! ([`KvCacheManager::add_sequence_scheduled`], [`KvCacheManager::advance_computed`]), prefix
//! look-up without admission ([`KvCacheManager::match_prefix`]), rollback of draft tokens
//! ([`KvCacheManager::truncate`]) and pinned prefixes ([`KvCacheManager::pin_prefix`]).
//!
//! One concept per module: `pool` (blocks and refcounts), `table` (one sequence's blocks),
//! `prefix` (block hashes, the cached-block index and its LRU, KV events), `host` (the swap
//! tier), `manager` (the API, one file per group of operations), `events` (the events' wire
//! encoding and router digests), `types` (the id types, a leaf). The trace-replay simulator
//! is the separate crate `pagedkv-sim`, so an engine embedding this crate compiles only the
//! allocator.
//!
//! ```
//! use pagedkv::{KvCacheManager, ManagerConfig};
//! let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 64, block_size: 16, ..Default::default() })?;
//! kv.add_sequence_len(1, 1000)?;              // 63 blocks (62 full + 1 partial)
//! kv.fork(1, 2)?;                             // parallel sampling: no new blocks
//! assert_eq!(kv.stats().num_blocks_in_use, 63);
//! kv.append_len(2, 1)?;                       // copy-on-write of the partial block
//! assert_eq!(kv.take_copy_ops().len(), 1);
//! # Ok::<(), pagedkv::Error>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod events;
mod host;
mod manager;
mod offload_tier;
mod peers;
mod pool;
mod prefetch;
mod prefix;
mod seqmap;
pub mod splitmix64;
mod stats;
mod sync;
mod table;
mod types;

pub use error::{Error, Result, Tier};
pub use events::router_digest;
#[cfg(feature = "wire")]
pub use events::wire;
pub use manager::{
    AdmitOptions, CsrPageTable, KvCacheManager, KvGroupSpec, ManagerConfig, NewBlockIds,
    PrefillCheckpoint, Prompt, SlotOptions, MAX_KV_GROUPS, NULL_BLOCK,
};
pub use peers::PoolPeers;
pub use pool::{BlockPool, MAX_NUM_BLOCKS, MAX_NUM_SLOTS};
pub use prefix::events::{DrainedEvent, DrainedEvents, KvEvent};
pub use prefix::hash::{reduce_block_hash, BlockHash, BlockHasher};
pub use stats::Stats;
pub use table::BlockTable;
pub use types::{BlockHandle, BlockId, SeqId, TokenId};

/// The Rust quick start in README.md, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// The Rust examples in docs/pool.md (handles, what an embedder may call), compiled and run as
/// doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/pool.md")]
pub struct PoolDocDoctests;
