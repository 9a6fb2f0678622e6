//! Paged decode and prefill attention over `[num_blocks, block_size, num_kv_heads, head_dim]`
//! caches, one online-softmax pass per (sequence, KV head, tile of query rows).
//!
//! A task reads each of its keys and values once and serves every query of the tile and every
//! query head of its KV head's group (GQA) from it, so K/V traffic is one pass per KV head per
//! tile. Within a block, the scores of all the task's queries come first (one `dot` per visible
//! (query, key)), then one max per query, one rescale of its accumulator, and the value pass.
//! Keys a query must not see are skipped, never multiplied by zero, so NaN or garbage in a slot
//! outside a query's range cannot leak in; slots past `seq_len` and blocks wholly before a
//! window are never read at all.

use rayon::prelude::*;

use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::layout::{BlockTables, CacheShape};
use crate::vector::{add_scaled, dot};

/// Query rows per task in prefill: enough tasks for 2+ cores on one long prompt, and each K/V
/// row read once per tile instead of once per query.
pub const PREFILL_TILE_ROWS: usize = 16;

/// Below this many (query head x key) pairs a call runs on the calling thread: waking the pool
/// costs more than the work.
const PARALLEL_MIN_PAIRS: usize = 1 << 14;

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
    if p.num_q_heads == 0 || p.num_q_heads % cache.num_kv_heads != 0 {
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
    let ctx = Ctx {
        q,
        k,
        v,
        cache,
        tables,
        params,
        group,
    };
    let work = |t: &Task| attend_tile(&ctx, t, &rows[t.seq]);
    let results: Vec<Vec<f32>> = if pairs.saturating_mul(params.num_q_heads) < PARALLEL_MIN_PAIRS {
        tasks.iter().map(work).collect()
    } else {
        tasks.par_iter().map(work).collect()
    };
    let hd = cache.head_dim;
    for (t, res) in tasks.iter().zip(&results) {
        let r = &rows[t.seq];
        for (i, row) in (t.r0..t.r1).enumerate() {
            let token = r.q0 + row;
            let base = token * row_elems + t.kv_head * group * hd;
            T::narrow(
                &res[i * group * hd..(i + 1) * group * hd],
                &mut out[base..base + group * hd],
            );
        }
    }
    Ok(())
}

/// The attention of one tile of one sequence's query rows, for one KV head's group of query
/// heads: `[(r1 - r0) * group, head_dim]` fp32, rows in (query row, head) order.
///
/// Compiled several times (multiversion: AVX-512, AVX2+FMA, and the x86-64 baseline) and
/// dispatched once per call on the CPU's features; the inlined `dot` / `add_scaled` loops are
/// vectorised at each width.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn attend_tile<T: KvElem>(ctx: &Ctx<'_, T>, t: &Task, rows: &SeqRows) -> Vec<f32> {
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
    let bounds: Vec<(usize, usize)> = (t.r0..t.r1)
        .map(|r| {
            let pos = first_pos + r;
            let hi = if p.causal { pos + 1 } else { rows.seq_len };
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            (lo, hi)
        })
        .collect();
    let klo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
    let khi = bounds.iter().map(|b| b.1).max().unwrap_or(0);

    // Queries of the tile in fp32, pre-multiplied by nothing (scale applies to the dot).
    let mut qbuf = vec![0.0f32; nq * hd];
    let mut scratch = vec![0.0f32; hd];
    let qrow = p.num_q_heads * hd;
    for (i, r) in (t.r0..t.r1).enumerate() {
        let base = (rows.q0 + r) * qrow + t.kv_head * group * hd;
        let src = &ctx.q[base..base + group * hd];
        for g in 0..group {
            let dst = &mut qbuf[(i * group + g) * hd..(i * group + g + 1) * hd];
            dst.copy_from_slice(T::widen(&src[g * hd..(g + 1) * hd], &mut scratch));
        }
    }
    let mut acc = vec![0.0f32; nq * hd];
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0.0f32; nq];
    let mut s = vec![0.0f32; nq * bs];
    let mut kbuf = vec![0.0f32; hd];
    let mut vbuf = vec![0.0f32; hd];
    let token_elems = nkv * hd;
    if khi > klo {
        for blk in klo / bs..khi.div_ceil(bs) {
            let block = ctx.tables.block(t.seq, blk);
            let t0 = (blk * bs).max(klo);
            let t1 = ((blk + 1) * bs).min(khi);
            let n = t1 - t0;
            let row_of = |tok: usize| (block * bs + tok - blk * bs) * token_elems + t.kv_head * hd;
            // Scores.
            for tok in t0..t1 {
                let off = row_of(tok);
                let key = T::widen(&ctx.k[off..off + hd], &mut kbuf);
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    let visible = tok >= lo && tok < hi;
                    for g in 0..group {
                        let j = i * group + g;
                        s[j * bs + tok - t0] = if visible {
                            dot(&qbuf[j * hd..(j + 1) * hd], key) * p.scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }
            }
            // Online softmax: new maxima, rescaled accumulators, probabilities in place.
            for j in 0..nq {
                let sj = &mut s[j * bs..j * bs + n];
                let bm = sj.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if bm == f32::NEG_INFINITY {
                    continue;
                }
                let m_new = m[j].max(bm);
                let corr = (m[j] - m_new).exp();
                m[j] = m_new;
                if corr != 1.0 {
                    l[j] *= corr;
                    for a in &mut acc[j * hd..(j + 1) * hd] {
                        *a *= corr;
                    }
                }
                for x in sj.iter_mut() {
                    *x = (*x - m_new).exp();
                }
                l[j] += sj.iter().sum::<f32>();
            }
            // Values.
            for tok in t0..t1 {
                let off = row_of(tok);
                let value = T::widen(&ctx.v[off..off + hd], &mut vbuf);
                for (i, &(lo, hi)) in bounds.iter().enumerate() {
                    if tok < lo || tok >= hi {
                        continue;
                    }
                    for g in 0..group {
                        let j = i * group + g;
                        add_scaled(&mut acc[j * hd..(j + 1) * hd], s[j * bs + tok - t0], value);
                    }
                }
            }
        }
    }
    for j in 0..nq {
        let inv = if l[j] > 0.0 { 1.0 / l[j] } else { 0.0 };
        for a in &mut acc[j * hd..(j + 1) * hd] {
            *a *= inv;
        }
    }
    acc
}
