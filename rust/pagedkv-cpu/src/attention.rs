//! Paged decode and prefill attention over `[num_blocks, block_size, num_kv_heads, head_dim]`
//! caches, one softmax pass per (sequence, KV head, tile of query rows): two-pass within each
//! chunk of [`KEY_CHUNK`] keys (every score, one maximum, one vectorised `exp` pass), online
//! (one rescale) across chunks.
//!
//! A task reads each of its keys and values once per chunk and serves every query of the tile and
//! every query head of its KV head's group (GQA) from it, so K/V traffic is one pass per KV head
//! per tile. Within a chunk, the scores of all the task's queries come first (`dot4`: four keys
//! per pass), then one max per query, one rescale of its accumulator, one vectorised `exp` pass,
//! and the value pass (`add_scaled4`).
//! Keys a query must not see are skipped, never multiplied by zero, so NaN or garbage in a slot
//! outside a query's range cannot leak in; slots past `seq_len` and blocks wholly before a
//! window are never read at all.

use rayon::prelude::*;

use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::exp::{exp, exp_shifted_in_place};
use crate::layout::{BlockTables, CacheShape};
use crate::vector::{add_scaled, add_scaled4, dot, dot4, max, sum};

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

/// One unit of parallel work.
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
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
    let mut tasks = Vec::new();
    for (seq, r) in rows.iter().enumerate() {
        for kv_head in 0..cache.num_kv_heads {
            let mut r0 = 0;
            while r0 < r.q_len {
                let r1 = (r0 + PREFILL_TILE_ROWS).min(r.q_len);
                tasks.push(Task {
                    seq,
                    kv_head,
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
        work += (t.r1 - t.r0) * r.seq_len * group;
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
    let hd = cache.head_dim;
    let tile = group * hd;
    let mut res = results.iter().flat_map(|r| r.chunks_exact(tile));
    for t in &tasks {
        let r = &rows[t.seq];
        for row in t.r0..t.r1 {
            let token = r.q0 + row;
            let base = token * row_elems + t.kv_head * tile;
            let src = res.next().ok_or_else(|| {
                CpuError::Shape("attention produced fewer rows than its tasks".into())
            })?;
            T::narrow(src, &mut out[base..base + tile]);
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
}

/// Resizes `v` to `n` elements, all `x`.
fn fill(v: &mut Vec<f32>, n: usize, x: f32) {
    v.clear();
    v.resize(n, x);
}

/// The attention of one tile of one sequence's query rows, for one KV head's group of query
/// heads, appended to `out`: `[(r1 - r0) * group, head_dim]` fp32, rows in (query row, head) order.
///
/// Keys go in chunks of [`KEY_CHUNK`] (absolute positions); within a chunk the softmax is
/// two-pass (every score, one maximum, one vectorised `exp` pass, then the values), across chunks
/// online (one rescale of the accumulators per chunk). Keys are scored and values accumulated four at a
/// time (`dot4`, `add_scaled4`: each K/V row loaded once per chunk for the whole group and tile).
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
    let nq = nrows * group;
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

    // Queries of the tile in fp32 (scale applies to the dot).
    sc.q.clear();
    sc.widen.resize(hd, 0.0);
    let qrow = p.num_q_heads * hd;
    for r in t.r0..t.r1 {
        let base = (rows.q0 + r) * qrow + t.kv_head * group * hd;
        let src = &ctx.q[base..base + group * hd];
        for g in 0..group {
            let row = T::widen(&src[g * hd..(g + 1) * hd], &mut sc.widen);
            sc.q.extend_from_slice(row);
        }
    }
    fill(&mut sc.acc, nq * hd, 0.0);
    fill(&mut sc.m, nq, f32::NEG_INFINITY);
    fill(&mut sc.l, nq, 0.0);
    let chunk = KEY_CHUNK;
    if sc.s.len() < nq * chunk {
        sc.s.resize(nq * chunk, 0.0);
    }
    for buf in sc.kv.iter_mut() {
        buf.resize(hd, 0.0);
    }
    let (qb, acc, m, l, s) = (&sc.q, &mut sc.acc, &mut sc.m, &mut sc.l, &mut sc.s);
    let [kb0, kb1, kb2, kb3] = &mut sc.kv;
    let token_elems = nkv * hd;
    let row_of = |blk: usize, tok: usize| {
        (ctx.tables.block(t.seq, blk) * bs + tok - blk * bs) * token_elems + t.kv_head * hd
    };
    let mut cs = klo / chunk * chunk;
    while khi > klo && cs < khi {
        // This chunk's keys [c0, c1) and blocks [cb, ce); scores at s[j * chunk + tok - cs].
        let c0 = cs.max(klo);
        let c1 = (cs + chunk).min(khi);
        let (cb, ce) = (c0 / bs, c1.div_ceil(bs));
        // Scores of every (query, key) of the chunk; -inf where the query must not see the key.
        for blk in cb..ce {
            let t0 = (blk * bs).max(c0);
            let t1 = ((blk + 1) * bs).min(c1);
            let mut tok = t0;
            while tok + 4 <= t1 {
                let k4 = [
                    T::widen(&ctx.k[row_of(blk, tok)..][..hd], kb0),
                    T::widen(&ctx.k[row_of(blk, tok + 1)..][..hd], kb1),
                    T::widen(&ctx.k[row_of(blk, tok + 2)..][..hd], kb2),
                    T::widen(&ctx.k[row_of(blk, tok + 3)..][..hd], kb3),
                ];
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    for g in 0..group {
                        let j = i * group + g;
                        let d = dot4(&qb[j * hd..(j + 1) * hd], k4);
                        let dst = &mut s[j * chunk + tok - cs..][..4];
                        for (e, (o, x)) in dst.iter_mut().zip(d).enumerate() {
                            let visible = tok + e >= lo && tok + e < hi;
                            *o = if visible {
                                x * p.scale
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                    }
                }
                tok += 4;
            }
            while tok < t1 {
                let key = T::widen(&ctx.k[row_of(blk, tok)..][..hd], kb0);
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    let visible = tok >= lo && tok < hi;
                    for g in 0..group {
                        let j = i * group + g;
                        s[j * chunk + tok - cs] = if visible {
                            dot(&qb[j * hd..(j + 1) * hd], key) * p.scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }
                tok += 1;
            }
        }
        // Softmax over the chunk: new maxima, rescaled accumulators, probabilities in place.
        for j in 0..nq {
            // Only the row's own visible keys of the chunk: a function of the row, not the tile.
            let (lo, hi) = bounds[j / group];
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
            let mut tok = t0;
            while tok + 4 <= t1 {
                let v4 = [
                    T::widen(&ctx.v[row_of(blk, tok)..][..hd], kb0),
                    T::widen(&ctx.v[row_of(blk, tok + 1)..][..hd], kb1),
                    T::widen(&ctx.v[row_of(blk, tok + 2)..][..hd], kb2),
                    T::widen(&ctx.v[row_of(blk, tok + 3)..][..hd], kb3),
                ];
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    let all = tok >= lo && tok + 4 <= hi;
                    for g in 0..group {
                        let j = i * group + g;
                        let pj = &s[j * chunk + tok - cs..][..4];
                        let aj = &mut acc[j * hd..(j + 1) * hd];
                        if all {
                            add_scaled4(aj, [pj[0], pj[1], pj[2], pj[3]], v4);
                        } else {
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
                let value = T::widen(&ctx.v[row_of(blk, tok)..][..hd], kb0);
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    if tok < lo || tok >= hi {
                        continue;
                    }
                    for g in 0..group {
                        let j = i * group + g;
                        add_scaled(
                            &mut acc[j * hd..(j + 1) * hd],
                            s[j * chunk + tok - cs],
                            value,
                        );
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
    out.extend_from_slice(acc);
}
