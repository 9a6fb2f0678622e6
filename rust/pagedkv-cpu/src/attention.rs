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

use rayon::prelude::*;

use crate::attention_simd::{dot, Simd};
use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::exp::{exp, exp_shifted_in_place};
use crate::layout::{BlockTables, CacheShape};
use crate::vector::{add_scaled, max, sum};

/// Query rows per task in prefill: enough tasks for 2+ cores on one long prompt, and each K/V
/// row read once per tile instead of once per query.
pub const PREFILL_TILE_ROWS: usize = 16;

/// Below this many (query head x key) pairs a call runs on the calling thread: waking the pool
/// costs more than the work.
const PARALLEL_MIN_PAIRS: usize = 1 << 14;

/// Keys per softmax chunk. Chunks are aligned to absolute key positions (`[c * KEY_CHUNK,
/// (c + 1) * KEY_CHUNK)`), never to a tile's first key, so a row's arithmetic (which scores are
/// summed together, in which lanes, and when its accumulator is rescaled) depends on the row
/// alone: the same row gives the same bits as a decode row, in any prefill tile, in any batch.
/// 256 keys: the exp and sum passes run long vectors, a task's scores stay in L1/L2
/// (`tile rows x group x 256` floats), and the per-chunk rescale is amortised.
pub const KEY_CHUNK: usize = 256;

/// How far ahead of its key pass a task reads its blocks' lines (`touch_lines`): two blocks of
/// 16 tokens.
const TOUCH_AHEAD_TOKENS: usize = 32;

/// Tasks take every KV head of their rows when there are at least this many row tiles per thread.
const WHOLE_ROW_TASKS_PER_THREAD: usize = 2;

/// A parallel unit of work runs consecutive tasks until it has at least this many (query head x
/// key) pairs (one task at long contexts, several short decode rows otherwise).
const RUN_MIN_PAIRS: usize = 4096;

/// What every query of a call shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads (a multiple of the cache's KV heads).
    pub num_q_heads: usize,
    /// Multiplies q.k before the softmax.
    pub scale: f32,
    /// Query at position p sees keys 0..=p (else every key of its sequence).
    pub causal: bool,
    /// Sliding window: the query at position p sees only keys p+1-window..=p. Blocks wholly
    /// before the window are never read (their table entries may be -1). Requires `causal`.
    pub window: Option<usize>,
}

/// One sequence's rows of a call.
#[derive(Debug, Clone, Copy)]
struct SeqRows {
    /// First query row (token) of the sequence in q / out.
    q0: usize,
    q_len: usize,
    seq_len: usize,
    /// A decode row of an empty sequence: no query runs, its output row is zeros.
    zero_row: bool,
}

/// One unit of parallel work: query rows `r0..r1` of sequence `seq`, against KV heads `h0..h1`.
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    h0: usize,
    h1: usize,
    r0: usize,
    r1: usize,
}

struct Ctx<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    cache: CacheShape,
    tables: &'a BlockTables<'a>,
    params: AttentionParams,
    group: usize,
    simd: Simd,
}

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

fn check_arrays<T>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    cache: &CacheShape,
    num_tokens: usize,
    p: &AttentionParams,
) -> Result<()> {
    cache.check_len("k_cache", k.len())?;
    cache.check_len("v_cache", v.len())?;
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
    let b = seq_lens.len();
    let mut rows = Vec::with_capacity(b);
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
    run(q, k_cache, v_cache, cache, tables, &rows, b, params, out)
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
    let total_q = query_start_loc[b] as usize;
    run(
        q, k_cache, v_cache, cache, tables, &rows, total_q, params, out,
    )
}

#[allow(clippy::too_many_arguments)]
fn run<T: KvElem>(
    q: &[T],
    k: &[T],
    v: &[T],
    cache: CacheShape,
    tables: &BlockTables<'_>,
    rows: &[SeqRows],
    num_tokens: usize,
    params: AttentionParams,
    out: &mut [T],
) -> Result<()> {
    let group = check_params(&params, &cache)?;
    check_arrays(q, k, v, out, &cache, num_tokens, &params)?;
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
    // the rest, later (measured 9.3-9.9 against 12.6 GB/s for the reads alone, 2 threads,
    // docs/cpu_data_plane.md). With few tiles (batch-1 decode), one task per KV head.
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

/// Per-run buffers, reused by every task of a run (sized by the largest).
#[derive(Default)]
struct Scratch {
    bounds: Vec<(usize, usize)>,
    q: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    s: Vec<f32>,
    kv: [Vec<f32>; 4],
    widen: Vec<f32>,
    /// One KV head's group of queries times four keys (`Simd::dot4_rows`, `add_scaled4_rows`).
    d: Vec<[f32; 4]>,
}

/// Resizes `v` to `n` elements, all `x`.
fn fill(v: &mut Vec<f32>, n: usize, x: f32) {
    v.clear();
    v.resize(n, x);
}

/// The attention of one tile of one sequence's query rows, for KV heads `h0..h1` and their
/// query heads, appended to `out`: `[(r1 - r0) * (h1 - h0) * group, head_dim]` fp32, rows in
/// (query row, query head) order.
///
/// Keys go in chunks of [`KEY_CHUNK`] (absolute positions); within a chunk the softmax is
/// two-pass (every score, one maximum, one vectorised `exp` pass, then the values), across chunks
/// online (one rescale of the accumulators per chunk). Keys are scored and values accumulated four
/// at a time, a token's rows of every KV head of the task one after another (`Simd::dot4_rows`,
/// `add_scaled4`: each K/V row loaded once per chunk for every query that reads it).
///
/// Compiled several times (multiversion: AVX-512, AVX2+FMA, and the x86-64 baseline) and
/// dispatched once per call on the CPU's features; the inlined loops are vectorised at each width.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn attend_tile<T: KvElem>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    rows: &SeqRows,
    sc: &mut Scratch,
    out: &mut Vec<f32>,
) {
    let CacheShape {
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
        ..
    } = ctx.cache;
    let p = &ctx.params;
    let group = ctx.group;
    let nrows = t.r1 - t.r0;
    // Query heads per row in this task, and queries (row x query head) in all.
    let hg = (t.h1 - t.h0) * group;
    let nq = nrows * hg;
    let first_pos = rows.seq_len - rows.q_len;
    // Visible key range [lo, hi) of each query row of the tile.
    sc.bounds.clear();
    sc.bounds.extend((t.r0..t.r1).map(|r| {
        let pos = first_pos + r;
        let hi = if p.causal { pos + 1 } else { rows.seq_len };
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (lo, hi)
    }));
    let bounds = &sc.bounds;
    let klo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
    let khi = bounds.iter().map(|b| b.1).max().unwrap_or(0);

    // Queries of the tile in fp32 (scale applies to the dot): query j = i * hg + (h - h0) * group
    // + g is row i's query head h * group + g, so one KV head's queries of a row are contiguous.
    sc.q.clear();
    sc.widen.resize(hd, 0.0);
    let qrow = p.num_q_heads * hd;
    for r in t.r0..t.r1 {
        let base = (rows.q0 + r) * qrow + t.h0 * group * hd;
        let src = &ctx.q[base..base + hg * hd];
        for row in src.chunks_exact(hd) {
            sc.q.extend_from_slice(T::widen(row, &mut sc.widen));
        }
    }
    fill(&mut sc.acc, nq * hd, 0.0);
    fill(&mut sc.m, nq, f32::NEG_INFINITY);
    fill(&mut sc.l, nq, 0.0);
    let chunk = KEY_CHUNK;
    if sc.s.len() < nq * chunk {
        sc.s.resize(nq * chunk, 0.0);
    }
    sc.d.resize(group, [0.0; 4]);
    for buf in sc.kv.iter_mut() {
        buf.resize(hd, 0.0);
    }
    let (qb, acc, m, l, s, d) = (
        &sc.q,
        &mut sc.acc,
        &mut sc.m,
        &mut sc.l,
        &mut sc.s,
        &mut sc.d,
    );
    let bufs = &mut sc.kv;
    let token_elems = nkv * hd;
    let block_elems = bs * token_elems;
    // Where logical block `blk`'s rows start in a cache (one table look-up per block and pass).
    let block_at = |blk: usize| ctx.tables.block(t.seq, blk) * block_elems;
    // Where the row of token `b` (its offset in the block) and KV head `h` starts in the block.
    let row_at = |b: usize, h: usize| b * token_elems + h * hd;
    // Read ahead (`touch_block`), from the task's first block on.
    let (first_blk, end_blk) = (klo / bs, khi.div_ceil(bs));
    let ahead = TOUCH_AHEAD_TOKENS.div_ceil(bs);
    let mut touched = 0u32;
    for blk in first_blk..(first_blk + ahead).min(end_blk) {
        touched |= touch_block(ctx, t, blk, klo, khi);
    }
    let mut cs = klo / chunk * chunk;
    while khi > klo && cs < khi {
        // This chunk's keys [c0, c1) and blocks [cb, ce); scores at s[j * chunk + tok - cs].
        let c0 = cs.max(klo);
        let c1 = (cs + chunk).min(khi);
        let (cb, ce) = (c0 / bs, c1.div_ceil(bs));
        // Scores of every (query, key) of the chunk; -inf where the query must not see the key.
        for blk in cb..ce {
            if blk + ahead < end_blk {
                touched |= touch_block(ctx, t, blk + ahead, klo, khi);
            }
            let t0 = (blk * bs).max(c0);
            let t1 = ((blk + 1) * bs).min(c1);
            let kblk = &ctx.k[block_at(blk)..][..block_elems];
            let mut tok = t0;
            while tok + 4 <= t1 {
                let b = tok - blk * bs;
                for h in t.h0..t.h1 {
                    let k4 = widen4(kblk, row_at(b, h), token_elems, hd, bufs);
                    let hq = (h - t.h0) * group;
                    for (i, &(lo, hi)) in bounds.iter().enumerate() {
                        let j0 = i * hg + hq;
                        ctx.simd.dot4_rows(&qb[j0 * hd..(j0 + group) * hd], k4, d);
                        let all = tok >= lo && tok + 4 <= hi;
                        for (g, dg) in d.iter().enumerate() {
                            let dst = &mut s[(j0 + g) * chunk + tok - cs..][..4];
                            if all {
                                for (o, x) in dst.iter_mut().zip(dg) {
                                    *o = x * p.scale;
                                }
                                continue;
                            }
                            for (e, (o, x)) in dst.iter_mut().zip(dg).enumerate() {
                                let visible = tok + e >= lo && tok + e < hi;
                                *o = if visible {
                                    x * p.scale
                                } else {
                                    f32::NEG_INFINITY
                                };
                            }
                        }
                    }
                }
                tok += 4;
            }
            while tok < t1 {
                for h in t.h0..t.h1 {
                    let key = T::widen(&kblk[row_at(tok - blk * bs, h)..][..hd], &mut bufs[0]);
                    let hq = (h - t.h0) * group;
                    for (i, &(lo, hi)) in bounds.iter().enumerate() {
                        let visible = tok >= lo && tok < hi;
                        for g in 0..group {
                            let j = i * hg + hq + g;
                            s[j * chunk + tok - cs] = if visible {
                                dot(&qb[j * hd..(j + 1) * hd], key) * p.scale
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                    }
                }
                tok += 1;
            }
        }
        // Softmax over the chunk: new maxima, rescaled accumulators, probabilities in place.
        for j in 0..nq {
            // Only the row's own visible keys of the chunk: a function of the row, not the tile.
            let (lo, hi) = bounds[j / hg];
            let (r0, r1) = (lo.max(c0), hi.min(c1));
            if r0 >= r1 {
                continue;
            }
            let sj = &mut s[j * chunk + r0 - cs..j * chunk + r1 - cs];
            let bm = max(sj);
            if bm == f32::NEG_INFINITY {
                continue;
            }
            let m_new = m[j].max(bm);
            let corr = exp(m[j] - m_new);
            m[j] = m_new;
            if corr != 1.0 {
                l[j] *= corr;
                for a in &mut acc[j * hd..(j + 1) * hd] {
                    *a *= corr;
                }
            }
            exp_shifted_in_place(sj, m_new);
            l[j] += sum(sj);
        }
        // Values: each row of V once for every query that sees it; unseen keys are skipped.
        for blk in cb..ce {
            let t0 = (blk * bs).max(c0);
            let t1 = ((blk + 1) * bs).min(c1);
            let vblk = &ctx.v[block_at(blk)..][..block_elems];
            let mut tok = t0;
            while tok + 4 <= t1 {
                let b = tok - blk * bs;
                for h in t.h0..t.h1 {
                    let v4 = widen4(vblk, row_at(b, h), token_elems, hd, bufs);
                    let hq = (h - t.h0) * group;
                    for (i, &(lo, hi)) in bounds.iter().enumerate() {
                        let j0 = i * hg + hq;
                        if tok >= lo && tok + 4 <= hi {
                            // The row sees all four keys: its group's rows in one call.
                            for (g, dg) in d.iter_mut().enumerate() {
                                let pj = &s[(j0 + g) * chunk + tok - cs..][..4];
                                *dg = [pj[0], pj[1], pj[2], pj[3]];
                            }
                            let rows = &mut acc[j0 * hd..(j0 + group) * hd];
                            ctx.simd.add_scaled4_rows(rows, d, v4);
                            continue;
                        }
                        for j in j0..j0 + group {
                            let pj = &s[j * chunk + tok - cs..][..4];
                            let aj = &mut acc[j * hd..(j + 1) * hd];
                            for e in 0..4 {
                                if tok + e >= lo && tok + e < hi {
                                    add_scaled(aj, pj[e], v4[e]);
                                }
                            }
                        }
                    }
                }
                tok += 4;
            }
            while tok < t1 {
                for h in t.h0..t.h1 {
                    let value = T::widen(&vblk[row_at(tok - blk * bs, h)..][..hd], &mut bufs[0]);
                    let hq = (h - t.h0) * group;
                    for (i, &(lo, hi)) in bounds.iter().enumerate() {
                        if tok < lo || tok >= hi {
                            continue;
                        }
                        for j in i * hg + hq..i * hg + hq + group {
                            add_scaled(
                                &mut acc[j * hd..(j + 1) * hd],
                                s[j * chunk + tok - cs],
                                value,
                            );
                        }
                    }
                }
                tok += 1;
            }
        }
        cs += chunk;
    }
    for j in 0..nq {
        let inv = if l[j] > 0.0 { 1.0 / l[j] } else { 0.0 };
        for a in &mut acc[j * hd..(j + 1) * hd] {
            *a *= inv;
        }
    }
    // The touched values feed nothing; kept alive so that their loads stay.
    std::hint::black_box(touched);
    out.extend_from_slice(acc);
}

/// Four consecutive tokens' rows of one KV head in fp32: `len` elements from `at`, `at + stride`,
/// `at + 2 stride`, `at + 3 stride` of a block's rows (fp32 rows are returned in place).
#[inline(always)]
fn widen4<'a, T: KvElem>(
    rows: &'a [T],
    at: usize,
    stride: usize,
    len: usize,
    bufs: &'a mut [Vec<f32>; 4],
) -> [&'a [f32]; 4] {
    let [b0, b1, b2, b3] = bufs;
    [
        T::widen(&rows[at..][..len], b0),
        T::widen(&rows[at + stride..][..len], b1),
        T::widen(&rows[at + 2 * stride..][..len], b2),
        T::widen(&rows[at + 3 * stride..][..len], b3),
    ]
}

/// Reads block `blk`'s K and V rows of the task's KV heads for its keys in `[klo, khi)`
/// (`touch_lines`): the caller's table entries for these blocks were checked.
///
/// Never inlined: inside the AVX2 and AVX-512 builds of `attend_tile` LLVM turned the strided
/// loads into `vpgatherdd` gathers, which measured no gain; compiled on its own it keeps one
/// scalar load per line.
#[inline(never)]
fn touch_block<T: KvElem>(ctx: &Ctx<'_, T>, t: &Task, blk: usize, klo: usize, khi: usize) -> u32 {
    let CacheShape {
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
        ..
    } = ctx.cache;
    let token_elems = nkv * hd;
    let first = ctx.tables.block(t.seq, blk) * bs;
    let (t0, t1) = ((blk * bs).max(klo), ((blk + 1) * bs).min(khi));
    let row = |tok: usize| (first + tok - blk * bs) * token_elems;
    let mut bits = 0;
    for tok in t0..t1 {
        let (r0, r1) = (row(tok) + t.h0 * hd, row(tok) + t.h1 * hd);
        bits |= touch_lines(&ctx.k[r0..r1]) | touch_lines(&ctx.v[r0..r1]);
    }
    bits
}

/// One plain load per 64-byte cache line of `rows`, the values' bits OR-ed (one cycle per line,
/// no long dependency chain): a read-ahead of the next blocks of a paged cache. Scattered blocks
/// defeat the hardware prefetcher at every block start; `prefetcht0` one or two blocks ahead
/// measured no gain on this VM (a software prefetch that misses the TLB may be dropped), while
/// these loads took batch 32 x 2 K decode from 7.9-8.3 to 6.4-6.6 ms (medians of 10-12
/// alternated runs; docs/cpu_data_plane.md), at 6 % more instructions.
#[inline(always)]
fn touch_lines<T: KvElem>(rows: &[T]) -> u32 {
    let step = (64 / std::mem::size_of::<T>()).max(1);
    let mut one = [0.0f32; 1];
    let mut bits = 0;
    let lines = rows.chunks_exact(step);
    let last = lines.remainder().first();
    for line in lines {
        bits |= T::widen(&line[..1], &mut one)[0].to_bits();
    }
    if let Some(x) = last {
        bits |= T::widen(std::slice::from_ref(x), &mut one)[0].to_bits();
    }
    bits
}
