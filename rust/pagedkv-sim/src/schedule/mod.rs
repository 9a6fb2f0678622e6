//! Cache-aware scheduling: the order in which waiting requests are admitted.
//!
//! [`Scheduling::Fcfs`] admits in arrival order. [`Scheduling::Lpm`] (longest prefix match)
//! admits the request whose prompt the prefix cache would serve most of right now.
//! [`Scheduling::Dfs`] walks the trie of the waiting requests' block chains depth first, heaviest
//! subtree first, following cached blocks before uncached ones, so that requests sharing a prefix
//! are admitted together and the prefix is computed once while it stays cached (SGLang's
//! DFS-weight order, over the waiting requests' own chains as well as the cache). Both stay on at
//! any queue length: [`CacheAwareQueue`] keeps the index incrementally (requests in and out, the
//! allocator's KV events), never re-sorting the queue. No request is passed over by more than the
//! aging bound's admissions. docs/scheduling.md describes the policies, the index and the bound.

mod aging;
mod index;
mod lists;
mod queue;
mod trie;

pub use queue::{CacheAwareQueue, QueueStats};
pub(crate) use trie::LowBits;
