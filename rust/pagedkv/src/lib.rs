//! pagedkv: the paged KV-cache allocator core (no Python).
pub mod sim;
