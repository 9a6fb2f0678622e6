//! pagedkv's CPU data plane: paged decode and prefill attention, KV writes, block copies and
//! tier swaps on plain slices laid out as `[num_blocks, block_size, num_kv_heads, head_dim]`.
//!
//! Pure Rust (the Python bindings convert NumPy arrays and release the GIL around these calls).
//! fp32, fp16 and bf16 caches; arithmetic in fp32. Every index a call uses (block-table entries,
//! slots, copy and swap block ids) is checked before anything is read or written: a bad argument
//! is a [`CpuError`], never a panic or an out-of-bounds access. `unsafe` is denied everywhere but
//! the intrinsic paths `attention::{avx2, avx512}` and `dot_matmul::{avx2, vnni}` (vector loads
//! and stores on fixed-size arrays, and a call made after the run-time feature check). Each SIMD
//! family is one folder: the dispatcher, the portable path and one file per instruction set, the
//! shared definitions in a leaf module that every path imports (no path imports the dispatcher).
//! docs/cpu_data_plane.md describes the design and its measurements.

#![deny(unsafe_code)]

pub mod attention;
pub mod block_matmul;
pub mod cache_ops;
pub mod dot_matmul;
pub mod elem;
pub mod elementwise;
pub mod error;
pub mod exp;
pub mod layout;
pub mod matmul;
pub mod vector;

pub use attention::{paged_decode, paged_prefill, AttentionParams};
pub use block_matmul::{matmul_blocks, BlockWeights};
pub use cache_ops::{copy_blocks, swap_blocks, write_kv};
pub use dot_matmul::{matmul_dot, DotWeights};
pub use elem::KvElem;
pub use elementwise::{add_rms_norm, rms_norm, rope_interleaved, silu_mul, RopeShape};
pub use error::{CpuError, Result};
pub use half::{bf16, f16};
pub use layout::{BlockTables, CacheShape};
pub use matmul::matmul_bf16;
