//! Paged decode and prefill attention over `[num_blocks, block_size, num_kv_heads, head_dim]`
//! caches, one softmax pass per (sequence, tile of query rows, KV head or all KV heads): two-pass
//! within each chunk of [`KEY_CHUNK`] keys (every score, one maximum, one vectorised `exp` pass),
//! online (one rescale) across chunks.
//!
//! A task reads each of its keys and values once per chunk and serves every query of the tile and
//! every query head of its KV heads' groups (GQA) from it, so K/V traffic is one pass per tile.
//! With enough tiles to fill the threads a task takes every KV head, so it reads a block's token
//! rows whole, in address order. Within a chunk, the scores of all the task's queries come first
//! (`Simd::dot4_rows`: four keys per pass, on AVX-512 with intrinsics), then one max per query,
//! one rescale of its accumulator, one vectorised `exp` pass, and the value pass (`add_scaled4`).
//! Keys a query must not see are skipped, never multiplied by zero, so NaN or garbage in a slot
//! outside a query's range cannot leak in; slots past `seq_len` and blocks wholly before a
//! window are never read at all.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod driver;
mod portable;
mod quant_source;
mod simd;
mod source;
mod task;
mod tile;

pub use self::driver::PREFILL_TILE_ROWS;
use self::driver::{decode_rows, prefill_rows, run};
pub use self::quant_source::{paged_decode_quant, paged_prefill_quant};
use self::source::PlainRows;
pub use self::task::AttentionParams;
pub use self::tile::KEY_CHUNK;
use crate::elem::KvElem;
use crate::error::Result;
use crate::layout::{BlockTables, CacheShape};

/// Paged decode attention: one query token per sequence, the last of its `seq_lens[b]` tokens.
///
/// `q`, `out`: `[B, num_q_heads, head_dim]`; `tables` has B rows; `seq_lens[b] == 0` gives zeros.
/// Every table entry the call reads is checked before anything runs.
// The kernel's natural signature (tensors, shape, tables, lengths, params, output).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode<T: KvElem>(
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    cache: CacheShape,
    tables: &BlockTables<'_>,
    seq_lens: &[i32],
    params: AttentionParams,
    out: &mut [T],
) -> Result<()> {
    let params = AttentionParams {
        causal: true,
        ..params
    };
    let rows = decode_rows(seq_lens)?;
    let k = PlainRows::new("k_cache", k_cache, cache)?;
    let v = PlainRows::new("v_cache", v_cache, cache)?;
    run(q, &k, &v, cache, tables, &rows, seq_lens.len(), params, out)
}

/// Paged prefill attention over a CSR batch of query rows (`query_start_loc`, B + 1 entries):
/// sequence i's `q_len = qsl[i+1] - qsl[i]` queries are its last `q_len` of `seq_lens[i]` tokens.
///
/// `q`, `out`: `[total_q, num_q_heads, head_dim]`, `total_q == qsl[B]`.
// The kernel's natural signature (tensors, shape, tables, lengths, params, output).
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill<T: KvElem>(
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    cache: CacheShape,
    tables: &BlockTables<'_>,
    seq_lens: &[i32],
    query_start_loc: &[i32],
    params: AttentionParams,
    out: &mut [T],
) -> Result<()> {
    let (rows, total_q) = prefill_rows(seq_lens, query_start_loc)?;
    let k = PlainRows::new("k_cache", k_cache, cache)?;
    let v = PlainRows::new("v_cache", v_cache, cache)?;
    run(q, &k, &v, cache, tables, &rows, total_q, params, out)
}
