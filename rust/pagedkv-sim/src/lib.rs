//! Trace replay: continuous batching of LLM requests under paged and contiguous KV allocators.
//!
//! The paged policy drives the real [`pagedkv::KvCacheManager`]; the contiguous baselines
//! (reserve `max_model_len`, a power-of-two over-reservation, or the exact final length) place
//! one run of slots per sequence with a real address-space allocator (first-fit or buddy), so
//! that external fragmentation happens as it would. Every slot of the pool is accounted at every
//! step as token / reserved / internal fragmentation / external fragmentation / free; the
//! definitions are in docs/metrics.md.
//!
//! ```
//! use pagedkv_sim::{simulate, AllocatorKind, GroupKind, SimConfig, Workload};
//! // Three requests of 200-token prompts generating 100 tokens, in a pool of 1,024 slots.
//! let w = Workload::from_arrays(&[200; 3], &[100; 3], &[0.0; 3], None, GroupKind::None, None, None)?;
//! let r = simulate(&w, &SimConfig { num_slots: 1024, block_size: 16, ..Default::default() })?;
//! assert_eq!(r.finished_requests, 3);
//! assert_eq!(r.steps, 100);  // all three fit at once and decode in lockstep
//! # Ok::<(), pagedkv::Error>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod buddy;
mod config;
mod contiguous;
mod engine;
mod extent;
mod first_fit;
mod frames;
mod group;
mod memory;
mod metrics;
mod optimum;
mod paged;
mod policy_waiting;
mod prefix_blocks;
mod rng;
mod schedule;
mod tokens;
mod workload;

pub use buddy::BuddyAllocator;
pub use config::{
    AllocatorKind, Arrival, Placement, Preemption, Scheduling, SimConfig, DEFAULT_AGING_BOUND,
};
pub use engine::{record_frames, simulate, simulate_with_progress, SimProgress};
pub use extent::{Extent, ExtentAllocator};
pub use first_fit::FirstFitAllocator;
pub use frames::{Frame, FrameCell, FramePool, FrameSequence};
pub use metrics::{SimResult, SlotShares};
pub use optimum::{optimal_hits, OptimalHits};
pub use prefix_blocks::PrefixBlocks;
pub use rng::SplitMix64;
pub use schedule::{CacheAwareQueue, QueueStats};
pub use workload::{GroupKind, RequestSpec, Workload};
