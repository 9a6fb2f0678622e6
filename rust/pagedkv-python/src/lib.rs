//! Thin PyO3 bindings for the `pagedkv` core: argument conversion and error mapping only.
//!
//! Module `pagedkv._core` (abi3, CPython >= 3.10). The exception classes live in Python
//! (`pagedkv.errors`), the KV-event classes in `pagedkv.events`; both are imported once and
//! cached. Tables leave as NumPy int32 arrays, slots as int64, copy ops as int32 `[N, 2]`.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use pyo3::prelude::*;

/// Every Rust allocation of the extension (never one Python frees: NumPy arrays made from
/// Rust vectors are dropped by Rust code) comes from mimalloc; see `Cargo.toml` for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod alloc_guard;
mod arrays;
mod block_keys;
mod cpu_ops;
mod cpu_quant_ops;
mod errors;
mod event_digests;
mod events;
mod groups;
mod id_batches;
mod int_list;
mod manager;
mod pool;
mod prompt_hashes;
mod quantized_matmul;
mod scalars;
mod scheduling;
mod sim;
mod stats;
mod wire;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<pool::PyBlockHandle>()?;
    m.add_class::<manager::PyKvCacheManager>()?;
    m.add_class::<groups::PyFullAttention>()?;
    m.add_class::<groups::PySlidingWindow>()?;
    m.add_class::<groups::PyMambaState>()?;
    m.add_class::<scheduling::PyCacheAwareQueue>()?;
    m.add_class::<prompt_hashes::PyPromptHashes>()?;
    sim::register(m)?;
    wire::register(m)?;
    event_digests::register(m)?;
    int_list::register(m)?;
    block_keys::register(m)?;
    cpu_ops::register(m)?;
    cpu_quant_ops::register(m)?;
    quantized_matmul::register(m)?;
    Ok(())
}
