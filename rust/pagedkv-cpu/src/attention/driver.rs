//! The shared driver of paged decode and prefill attention (plain and quantized caches): the
//! argument checks, the query rows of a decode or prefill batch, and the parallel run of tile
//! tasks over any [`KvSource`]. A leaf below `attention/mod.rs`, so the quantized entry points
//! (`quant_source.rs`) reach it without naming the module that declares them.

use rayon::prelude::*;

use super::simd::Simd;
use super::source::KvSource;
use super::task::{AttentionParams, Ctx, SeqRows, Task};
use super::tile::{attend_tile, Scratch};
use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::layout::{BlockTables, CacheShape};

/// Query rows per task in prefill: enough tasks for 2+ cores on one long prompt, and each K/V
/// row read once per tile instead of once per query.
pub const PREFILL_TILE_ROWS: usize = 16;

/// Below this many (query head x key) pairs a call runs on the calling thread: waking the pool
/// costs more than the work.
const PARALLEL_MIN_PAIRS: usize = 1 << 14;

/// Tasks take every KV head of their rows when there are at least this many row tiles per thread.
const WHOLE_ROW_TASKS_PER_THREAD: usize = 2;

/// A parallel unit of work runs consecutive tasks until it has at least this many (query head x
/// key) pairs (one task at long contexts, several short decode rows otherwise).
const RUN_MIN_PAIRS: usize = 4096;

fn check_params(p: &AttentionParams, cache: &CacheShape) -> Result<usize> {
    if p.num_q_heads == 0 || !p.num_q_heads.is_multiple_of(cache.num_kv_heads) {
        return Err(CpuError::Shape(format!(
            "num_q_heads {} is not a positive multiple of num_kv_heads {}",
            p.num_q_heads, cache.num_kv_heads
        )));
    }
    if !p.scale.is_finite() {
        return Err(CpuError::Argument(format!(
            "scale must be finite, got {}",
            p.scale
        )));
    }
    match p.window {
        Some(0) => return Err(CpuError::Argument("window must be >= 1".into())),
        Some(_) if !p.causal => {
            return Err(CpuError::Argument(
                "a sliding window needs causal attention".into(),
            ))
        }
        _ => {}
    }
    Ok(p.num_q_heads / cache.num_kv_heads)
}

/// `q` and `out` hold `[num_tokens, num_q_heads, head_dim]`.
fn check_queries<T>(
    q: &[T],
    out: &[T],
    cache: &CacheShape,
    num_tokens: usize,
    p: &AttentionParams,
) -> Result<()> {
    let want = num_tokens
        .checked_mul(p.num_q_heads * cache.head_dim)
        .ok_or_else(|| CpuError::Shape("q shape overflows usize".into()))?;
    if q.len() != want || out.len() != want {
        return Err(CpuError::Shape(format!(
            "q ({}) and out ({}) must hold [{num_tokens}, {}, {}] = {want} elements",
            q.len(),
            out.len(),
            p.num_q_heads,
            cache.head_dim
        )));
    }
    Ok(())
}

/// The first key any query of `rows` reads: 0, or the window's start for the first query.
fn first_key(rows: &SeqRows, p: &AttentionParams) -> usize {
    match p.window {
        Some(w) => (rows.seq_len - rows.q_len + 1).saturating_sub(w),
        None => 0,
    }
}

/// One decode row per sequence: its last token queries its `seq_lens[b]` keys (none for an
/// empty sequence, whose output row is zeros).
pub(super) fn decode_rows(seq_lens: &[i32]) -> Result<Vec<SeqRows>> {
    let mut rows = Vec::with_capacity(seq_lens.len());
    for (i, &len) in seq_lens.iter().enumerate() {
        let seq_len = usize::try_from(len)
            .map_err(|_| CpuError::Argument(format!("seq_lens[{i}] = {len} is negative")))?;
        // An empty sequence has no query row to attend with: its output row is zeros.
        rows.push(SeqRows {
            q0: i,
            q_len: usize::from(seq_len > 0),
            seq_len,
            zero_row: seq_len == 0,
        });
    }
    Ok(rows)
}

/// Sequence i's `query_start_loc[i+1] - query_start_loc[i]` queries, its last positions; the
/// rows and the total number of queries.
pub(super) fn prefill_rows(
    seq_lens: &[i32],
    query_start_loc: &[i32],
) -> Result<(Vec<SeqRows>, usize)> {
    let b = seq_lens.len();
    if query_start_loc.len() != b + 1 {
        return Err(CpuError::Shape(format!(
            "query_start_loc has {} entries for {b} sequences (needs B + 1)",
            query_start_loc.len()
        )));
    }
    if query_start_loc[0] != 0 {
        return Err(CpuError::Argument(format!(
            "query_start_loc[0] must be 0, got {}",
            query_start_loc[0]
        )));
    }
    let mut rows = Vec::with_capacity(b);
    for i in 0..b {
        let (start, end) = (query_start_loc[i], query_start_loc[i + 1]);
        if end < start {
            return Err(CpuError::Argument(format!(
                "query_start_loc must be non-decreasing: query_start_loc[{}] = {end} < {start}",
                i + 1
            )));
        }
        let seq_len = usize::try_from(seq_lens[i]).map_err(|_| {
            CpuError::Argument(format!("seq_lens[{i}] = {} is negative", seq_lens[i]))
        })?;
        let q_len = (end - start) as usize;
        if q_len > seq_len {
            return Err(CpuError::Argument(format!(
                "sequence {i} has {q_len} queries but only {seq_len} tokens (seq_lens[{i}])"
            )));
        }
        rows.push(SeqRows {
            q0: start as usize,
            q_len,
            seq_len,
            zero_row: false,
        });
    }
    Ok((rows, query_start_loc[b] as usize))
}

/// Every query row of `rows` against its keys in `k` and `v` (sources of a cache of `cache`'s
/// shape), into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run<T: KvElem, S: KvSource>(
    q: &[T],
    k: &S,
    v: &S,
    cache: CacheShape,
    tables: &BlockTables<'_>,
    rows: &[SeqRows],
    num_tokens: usize,
    params: AttentionParams,
    out: &mut [T],
) -> Result<()> {
    let group = check_params(&params, &cache)?;
    check_queries(q, out, &cache, num_tokens, &params)?;
    if tables.num_rows() != rows.len() {
        return Err(CpuError::Shape(format!(
            "block tables have {} rows for {} sequences",
            tables.num_rows(),
            rows.len()
        )));
    }
    // Every block any task will read, checked before any work.
    let bs = cache.block_size;
    let mut pairs = 0usize;
    for (i, r) in rows.iter().enumerate() {
        let needed = r.seq_len.div_ceil(bs);
        if needed > tables.row_len(i) {
            return Err(CpuError::Argument(format!(
                "seq_lens[{i}] = {} exceeds its table row's capacity {} ({} blocks of {bs})",
                r.seq_len,
                tables.row_len(i) * bs,
                tables.row_len(i)
            )));
        }
        if r.q_len > 0 {
            tables.check_used_blocks(i, first_key(r, &params) / bs, needed, cache.num_blocks)?;
        }
        pairs = pairs.saturating_add(r.q_len.saturating_mul(r.seq_len));
    }
    // Rows of empty decode sequences are zeros; every other row is written by exactly one task
    // per KV head.
    let row_elems = params.num_q_heads * cache.head_dim;
    for r in rows.iter().filter(|r| r.zero_row) {
        T::narrow(
            &vec![0.0; row_elems],
            &mut out[r.q0 * row_elems..(r.q0 + 1) * row_elems],
        );
    }
    // A task takes every KV head of its rows when there are tiles enough to keep every thread
    // busy: it then reads each cache block's token rows whole (one contiguous run per block),
    // where one task per KV head reads every other run of `head_dim` elements and another task
    // the rest, later (the reads alone are faster in whole rows:
    // benches/results/2026-12-03-cpu-attention.md, "Where each step came from"). With few tiles
    // (batch-1 decode), one task per KV head.
    let tiles: usize = rows
        .iter()
        .map(|r| r.q_len.div_ceil(PREFILL_TILE_ROWS))
        .sum();
    let heads_per_task = if tiles >= WHOLE_ROW_TASKS_PER_THREAD * rayon::current_num_threads() {
        cache.num_kv_heads
    } else {
        1
    };
    let mut tasks = Vec::new();
    for (seq, r) in rows.iter().enumerate() {
        for h0 in (0..cache.num_kv_heads).step_by(heads_per_task) {
            let h1 = (h0 + heads_per_task).min(cache.num_kv_heads);
            let mut r0 = 0;
            while r0 < r.q_len {
                let r1 = (r0 + PREFILL_TILE_ROWS).min(r.q_len);
                tasks.push(Task {
                    seq,
                    h0,
                    h1,
                    r0,
                    r1,
                });
                r0 = r1;
            }
        }
    }
    // Runs of consecutive tasks, each run one unit of parallel work with one set of buffers:
    // short decode rows are a few hundred ns of arithmetic each, less than a pool hand-off and
    // the buffers' allocations.
    let mut runs = Vec::new();
    let (mut start, mut work) = (0, 0usize);
    for (i, t) in tasks.iter().enumerate() {
        let r = &rows[t.seq];
        work += (t.r1 - t.r0) * r.seq_len * group * (t.h1 - t.h0);
        if work >= RUN_MIN_PAIRS || i + 1 == tasks.len() {
            runs.push(start..i + 1);
            (start, work) = (i + 1, 0);
        }
    }
    let ctx = Ctx {
        q,
        k,
        v,
        cache,
        tables,
        params,
        group,
        simd: Simd::detect(),
    };
    let work = |run: &std::ops::Range<usize>| {
        let mut scratch = Scratch::default();
        let mut res = Vec::new();
        for t in &tasks[run.clone()] {
            attend_tile(&ctx, t, &rows[t.seq], &mut scratch, &mut res);
        }
        res
    };
    let results: Vec<Vec<f32>> = if pairs.saturating_mul(params.num_q_heads) < PARALLEL_MIN_PAIRS {
        runs.iter().map(work).collect()
    } else {
        runs.par_iter().map(work).collect()
    };
    let head_elems = group * cache.head_dim;
    // Each run's result holds its tasks' rows, in task order.
    for (run, res) in runs.iter().zip(&results) {
        let mut at = 0;
        for t in &tasks[run.clone()] {
            let r = &rows[t.seq];
            let tile = (t.h1 - t.h0) * head_elems;
            for row in t.r0..t.r1 {
                let base = (r.q0 + row) * row_elems + t.h0 * head_elems;
                let src = res.get(at..at + tile).ok_or_else(|| {
                    CpuError::Shape("attention produced fewer rows than its tasks".into())
                })?;
                T::narrow(src, &mut out[base..base + tile]);
                at += tile;
            }
        }
    }
    Ok(())
}
