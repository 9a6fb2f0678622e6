//! [`KvCacheManager`]: sequences' block tables on top of a (possibly shared)
//! [`BlockPool`](crate::BlockPool), for any number of KV-cache groups (docs/design.md, KV
//! groups).
//!
//! Every public operation first validates its input and computes how many fresh blocks it
//! needs, then takes them all at once, and only then mutates tables and refcounts, so a failed
//! operation changes nothing (docs/design.md, Invariants 6). The state changes are a handful
//! of named transitions, all in [`transitions`], each used by several operations:
//!
//! * `allocate_fresh`: new blocks for new content (refcount 0 -> 1);
//! * `revive_cached`: a prefix hit on a cached-evictable block (refcount 0 -> 1, hash kept);
//! * `share`: one more table points at an in-use block (refcount +1, fork);
//! * `copy_on_write`: a sequence about to write into a shared partial block gets a private
//!   copy, recorded as a `(src, dst)` copy op;
//! * `release`: one table stops pointing at a block (refcount -1; at 0 it becomes free, or
//!   cached-evictable when its content is indexed).
//!
//! One manager serves every group list: group 0's table lives inline in each
//! [`Sequence`](state::Sequence), the other groups' beside it, and what differs between group
//! kinds is the policy layer ([`policy`]). The single full-attention group keeps its tuned
//! paths ([`admission`], [`growth`], [`batch`], [`computed`]); every other group list, and
//! every per-chunk or caller-keyed call, takes the plain group loop ([`admit_groups`],
//! [`grow_groups`], [`indexing`], [`window`], [`slots`]), which the model test compares with
//! the same reference.
//!
//! The manager's state (the struct, its sequence rows and counters) is in [`state`], a leaf
//! the operation files build on; the items its fields are made of are leaves too ([`config`],
//! [`group_spec`], [`keys`], [`new_block_log`], [`plans`]), and [`construct`] builds and drops
//! it. This file only declares the modules and re-exports the public names, so that no two
//! modules of `manager/` depend on each other, directly or through others
//! (tests/python/test_rust_layering.py).
//!
//! One file per group of operations: [`admission`] (`add_sequence*`), [`growth`] (`append*`,
//! `can_append`), [`batch`] (`append_*_batch`), [`lifecycle`] (`fork`, `free*`), [`swap`]
//! (host tier), [`prefix`] (prefix-cache integration), [`queries`] (read-only views and
//! stats), [`csr`] (block tables in FlashInfer's CSR layout), [`slots`] (`allocate_slots`,
//! `provide_token_ids`), [`new_blocks`] (`take_new_block_ids`), [`invariants`]
//! (`check_invariants`).

mod admission;
mod admit_groups;
mod batch;
mod checks;
mod computed;
mod config;
mod construct;
mod copy_queue;
mod csr;
mod evict_blocks;
mod eviction_priority;
mod group_spec;
mod groups;
#[cfg(test)]
mod groups_tests;
mod grow_groups;
mod growth;
mod hashed_admission;
mod hits;
mod indexing;
mod invariants;
mod keys;
mod lifecycle;
mod new_block_log;
mod new_blocks;
mod offload;
mod pins;
mod plans;
mod policy;
mod prefix;
mod queries;
mod rollback;
mod slots;
mod state;
mod state_diverged;
mod state_external;
mod state_hit;
mod swap;
mod swap_plan;
mod transitions;
mod window;

pub use self::config::{AdmitOptions, ManagerConfig, PrefillCheckpoint, Prompt, SlotOptions};
pub use self::csr::CsrPageTable;
pub use self::group_spec::{KvGroupSpec, MAX_KV_GROUPS, NULL_BLOCK};
pub use self::new_block_log::NewBlockIds;
pub use self::state::KvCacheManager;
