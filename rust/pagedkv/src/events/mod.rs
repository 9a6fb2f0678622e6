//! What the crate hands KV-aware routers: the KV events' wire encoding ([`wire`], vLLM's
//! msgpack, feature `wire`) and router digests ([`router_digest`], each stored block's tokens
//! folded as a router hashes them). The events themselves are recorded where the cache changes
//! (`prefix::events`: [`KvEvent`](crate::KvEvent) and its queue); this module only reads them.
//! Both are re-exported at the crate root under their old paths (`pagedkv::wire`,
//! `pagedkv::router_digest`).

pub mod router_digest;
#[cfg(feature = "wire")]
pub mod wire;
