//! Quantized KV caches (docs/quantized_kv.md): `int8` and `fp8_e4m3` codes with one UE5M3 scale
//! byte per (token, head) inside the block, and `int4` KIVI-style (keys per channel over a
//! block, values per token) with each sequence's open last block in an int8 residual slot
//! (re-quantized to int4 when the block seals). The formats are `python/pagedkv/attention/quant_codec.py`'s, reproduced bit for bit:
//! writes produce the reference's bytes, and attention reads exactly the reference's
//! dequantized values.
//!
//! - `layout`: the formats and a block's byte layout;
//! - `codec`: the formats' arithmetic, element by element (the definition the SIMD paths match);
//! - `dequant`: SIMD row dequantization (plain, AVX2, AVX-512), used by attention
//!   (`attention::quant_source`);
//! - `decode`: whole blocks dequantized element by element (tests, reopening int4 blocks);
//! - `cache`: a cache tensor as slices, checked;
//! - `write`: quantize-on-write, int4 seals and residual parking.
//!
//! Block copies and swaps move the bytes as they are (`cache_ops::copy_blocks` /
//! `swap_blocks` over the byte rows).

pub mod cache;
pub mod codec;
pub mod decode;
pub(crate) mod dequant;
pub mod layout;
pub mod write;

pub use cache::{QuantCache, QuantCacheMut};
pub use decode::dequantize_block;
pub use layout::{QuantFormat, QuantLayout, Role};
pub use write::write_kv_quant;
