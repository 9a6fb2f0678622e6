//! Trace replay: continuous batching of LLM requests under paged and contiguous KV allocators.

mod buddy;
mod extent;
mod first_fit;
pub(crate) mod rng;

pub use buddy::BuddyAllocator;
pub use extent::{Extent, ExtentAllocator};
pub use first_fit::FirstFitAllocator;
pub use rng::SplitMix64;
