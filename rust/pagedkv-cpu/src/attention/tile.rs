//! One task's attention: a tile of one sequence's query rows against its visible keys, for a
//! range of KV heads and their query heads, in named steps (`attend_tile` lists them).

use super::portable::dot;
use super::task::{Ctx, SeqRows, Task};
use crate::elem::KvElem;
use crate::exp::{exp, exp_shifted_in_place};
use crate::layout::CacheShape;
use crate::vector::{add_scaled, max, sum};

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

/// Per-run buffers, reused by every task of a run (sized by the largest).
#[derive(Default)]
pub(super) struct Scratch {
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

/// A task's sizes, fixed for the whole tile.
#[derive(Clone, Copy)]
struct TileDims {
    /// Tokens per cache block.
    bs: usize,
    /// Elements per head row.
    hd: usize,
    /// Query heads per KV head.
    group: usize,
    /// Query heads per row in this task (`(h1 - h0) * group`).
    hg: usize,
    /// Queries (row x query head) of the tile.
    nq: usize,
    /// Elements of one token's rows, all KV heads (`num_kv_heads * hd`).
    token_elems: usize,
    /// Elements of one cache block (`bs * token_elems`).
    block_elems: usize,
}

impl TileDims {
    #[inline(always)]
    fn new<T>(ctx: &Ctx<'_, T>, t: &Task) -> Self {
        let CacheShape {
            block_size: bs,
            num_kv_heads: nkv,
            head_dim: hd,
            ..
        } = ctx.cache;
        let group = ctx.group;
        let hg = (t.h1 - t.h0) * group;
        let token_elems = nkv * hd;
        TileDims {
            bs,
            hd,
            group,
            hg,
            nq: (t.r1 - t.r0) * hg,
            token_elems,
            block_elems: bs * token_elems,
        }
    }

    /// Where the row of token `b` (its offset in the block) and KV head `h` starts in a block.
    #[inline(always)]
    fn row_at(&self, b: usize, h: usize) -> usize {
        b * self.token_elems + h * self.hd
    }
}

/// The keys `[c0, c1)` of the chunk that starts at absolute key `cs`, in blocks `[cb, ce)`; a
/// query `j`'s score of key `tok` is at `s[j * KEY_CHUNK + tok - cs]`.
#[derive(Clone, Copy)]
struct KeyChunk {
    cs: usize,
    c0: usize,
    c1: usize,
    cb: usize,
    ce: usize,
}

impl KeyChunk {
    /// Tokens of block `blk` inside the chunk.
    #[inline(always)]
    fn tokens_of(&self, blk: usize, bs: usize) -> (usize, usize) {
        ((blk * bs).max(self.c0), ((blk + 1) * bs).min(self.c1))
    }
}

/// The attention of one tile of one sequence's query rows, for KV heads `h0..h1` and their
/// query heads, appended to `out`: `[(r1 - r0) * (h1 - h0) * group, head_dim]` fp32, rows in
/// (query row, query head) order.
///
/// Keys go in chunks of [`KEY_CHUNK`] (absolute positions); within a chunk the softmax is
/// two-pass (every score, one maximum, one vectorised `exp` pass, then the values), across chunks
/// online (one rescale of the accumulators per chunk). Keys are scored and values accumulated four
/// at a time, a token's rows of every KV head of the task one after another (`Simd::dot4_rows`,
/// `add_scaled4`: each K/V row loaded once per chunk for every query that reads it). The steps:
/// [`visible_bounds`], [`widen_queries`], [`reset_accumulators`], then per chunk
/// [`score_chunk`], [`softmax_chunk`] and [`add_values_chunk`], and last [`normalize`].
///
/// Compiled several times (multiversion: AVX-512, AVX2+FMA, and the x86-64 baseline) and
/// dispatched once per call on the CPU's features; every step is inlined into it
/// (`#[inline(always)]`), so the loops are vectorised at each width.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub(super) fn attend_tile<T: KvElem>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    rows: &SeqRows,
    sc: &mut Scratch,
    out: &mut Vec<f32>,
) {
    let dims = TileDims::new(ctx, t);
    let (klo, khi) = visible_bounds(ctx, t, rows, &mut sc.bounds);
    widen_queries(ctx, t, rows, &dims, &mut sc.q, &mut sc.widen);
    reset_accumulators(sc, &dims);
    let (qb, acc, m, l, s, d) = (
        &sc.q,
        &mut sc.acc,
        &mut sc.m,
        &mut sc.l,
        &mut sc.s,
        &mut sc.d,
    );
    let bufs = &mut sc.kv;
    let bounds = &sc.bounds;
    let mut ahead = ReadAhead::start(ctx, t, dims.bs, klo, khi);
    let chunk = KEY_CHUNK;
    let mut cs = klo / chunk * chunk;
    while khi > klo && cs < khi {
        let c0 = cs.max(klo);
        let c1 = (cs + chunk).min(khi);
        let keys = KeyChunk {
            cs,
            c0,
            c1,
            cb: c0 / dims.bs,
            ce: c1.div_ceil(dims.bs),
        };
        score_chunk(ctx, t, &dims, &keys, bounds, qb, s, d, bufs, &mut ahead);
        softmax_chunk(&dims, &keys, bounds, s, m, l, acc);
        add_values_chunk(ctx, t, &dims, &keys, bounds, s, acc, d, bufs);
        cs += chunk;
    }
    normalize(&dims, l, acc);
    // The touched values feed nothing; kept alive so that their loads stay.
    std::hint::black_box(ahead.touched);
    out.extend_from_slice(acc);
}

/// Step 1: the visible key range `[lo, hi)` of each query row of the tile into `bounds`, and
/// their union `(klo, khi)`.
#[inline(always)]
fn visible_bounds<T>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    rows: &SeqRows,
    bounds: &mut Vec<(usize, usize)>,
) -> (usize, usize) {
    let p = &ctx.params;
    let first_pos = rows.seq_len - rows.q_len;
    bounds.clear();
    bounds.extend((t.r0..t.r1).map(|r| {
        let pos = first_pos + r;
        let hi = if p.causal { pos + 1 } else { rows.seq_len };
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (lo, hi)
    }));
    let klo = bounds.iter().map(|b| b.0).min().unwrap_or(0);
    let khi = bounds.iter().map(|b| b.1).max().unwrap_or(0);
    (klo, khi)
}

/// Step 2: the tile's queries in fp32 (scale applies to the dot): query j = i * hg + (h - h0) *
/// group + g is row i's query head h * group + g, so one KV head's queries of a row are
/// contiguous.
#[inline(always)]
fn widen_queries<T: KvElem>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    rows: &SeqRows,
    dims: &TileDims,
    q: &mut Vec<f32>,
    widen: &mut Vec<f32>,
) {
    let hd = dims.hd;
    q.clear();
    widen.resize(hd, 0.0);
    let qrow = ctx.params.num_q_heads * hd;
    for r in t.r0..t.r1 {
        let base = (rows.q0 + r) * qrow + t.h0 * dims.group * hd;
        let src = &ctx.q[base..base + dims.hg * hd];
        for row in src.chunks_exact(hd) {
            q.extend_from_slice(T::widen(row, widen));
        }
    }
}

/// Step 3: zero accumulators, maxima at -inf, sums at 0, and the score and K/V row buffers
/// sized for the tile.
#[inline(always)]
fn reset_accumulators(sc: &mut Scratch, dims: &TileDims) {
    let (nq, hd) = (dims.nq, dims.hd);
    fill(&mut sc.acc, nq * hd, 0.0);
    fill(&mut sc.m, nq, f32::NEG_INFINITY);
    fill(&mut sc.l, nq, 0.0);
    if sc.s.len() < nq * KEY_CHUNK {
        sc.s.resize(nq * KEY_CHUNK, 0.0);
    }
    sc.d.resize(dims.group, [0.0; 4]);
    for buf in sc.kv.iter_mut() {
        buf.resize(hd, 0.0);
    }
}

/// The read-ahead (`touch_block`) of a task's blocks: from its first block on, `ahead` blocks
/// before the key pass reaches them.
struct ReadAhead {
    ahead: usize,
    end_blk: usize,
    klo: usize,
    khi: usize,
    /// The loaded values OR-ed, kept alive so that the loads stay.
    touched: u32,
}

impl ReadAhead {
    /// Reads the task's first `ahead` blocks.
    #[inline(always)]
    fn start<T: KvElem>(ctx: &Ctx<'_, T>, t: &Task, bs: usize, klo: usize, khi: usize) -> Self {
        let (first_blk, end_blk) = (klo / bs, khi.div_ceil(bs));
        let ahead = TOUCH_AHEAD_TOKENS.div_ceil(bs);
        let mut touched = 0u32;
        for blk in first_blk..(first_blk + ahead).min(end_blk) {
            touched |= touch_block(ctx, t, blk, klo, khi);
        }
        ReadAhead {
            ahead,
            end_blk,
            klo,
            khi,
            touched,
        }
    }

    /// Reads the block `ahead` blocks past `blk`, if the task has one.
    #[inline(always)]
    fn past<T: KvElem>(&mut self, ctx: &Ctx<'_, T>, t: &Task, blk: usize) {
        if blk + self.ahead < self.end_blk {
            self.touched |= touch_block(ctx, t, blk + self.ahead, self.klo, self.khi);
        }
    }
}

/// Step 4, per chunk: the scores of every (query, key) of the chunk into `s`, already scaled;
/// -inf where the query must not see the key. Four keys at a time (`Simd::dot4_rows`), the
/// chunk's last few one by one.
// The tile's state, borrowed field by field (one struct would borrow all of it at once).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_chunk<T: KvElem>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    dims: &TileDims,
    keys: &KeyChunk,
    bounds: &[(usize, usize)],
    qb: &[f32],
    s: &mut [f32],
    d: &mut [[f32; 4]],
    bufs: &mut [Vec<f32>; 4],
    ahead: &mut ReadAhead,
) {
    let TileDims {
        bs,
        hd,
        group,
        hg,
        token_elems,
        block_elems,
        ..
    } = *dims;
    let (chunk, cs) = (KEY_CHUNK, keys.cs);
    let p = &ctx.params;
    for blk in keys.cb..keys.ce {
        ahead.past(ctx, t, blk);
        let (t0, t1) = keys.tokens_of(blk, bs);
        let kblk = &ctx.k[block_at(ctx, t, blk, block_elems)..][..block_elems];
        let mut tok = t0;
        while tok + 4 <= t1 {
            let b = tok - blk * bs;
            for h in t.h0..t.h1 {
                let k4 = widen4(kblk, dims.row_at(b, h), token_elems, hd, bufs);
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
                let key = T::widen(&kblk[dims.row_at(tok - blk * bs, h)..][..hd], &mut bufs[0]);
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
}

/// Step 5, per chunk: the softmax over the chunk's scores: new maxima, rescaled accumulators
/// and sums, probabilities in place of the scores.
#[inline(always)]
fn softmax_chunk(
    dims: &TileDims,
    keys: &KeyChunk,
    bounds: &[(usize, usize)],
    s: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let (chunk, cs, hd) = (KEY_CHUNK, keys.cs, dims.hd);
    for j in 0..dims.nq {
        // Only the row's own visible keys of the chunk: a function of the row, not the tile.
        let (lo, hi) = bounds[j / dims.hg];
        let (r0, r1) = (lo.max(keys.c0), hi.min(keys.c1));
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
}

/// Step 6, per chunk: each row of V once for every query that sees it, weighted by the
/// probabilities, into the accumulators; unseen keys are skipped, never multiplied by zero.
// The tile's state, borrowed field by field (one struct would borrow all of it at once).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn add_values_chunk<T: KvElem>(
    ctx: &Ctx<'_, T>,
    t: &Task,
    dims: &TileDims,
    keys: &KeyChunk,
    bounds: &[(usize, usize)],
    s: &[f32],
    acc: &mut [f32],
    d: &mut [[f32; 4]],
    bufs: &mut [Vec<f32>; 4],
) {
    let TileDims {
        bs,
        hd,
        group,
        hg,
        token_elems,
        block_elems,
        ..
    } = *dims;
    let (chunk, cs) = (KEY_CHUNK, keys.cs);
    for blk in keys.cb..keys.ce {
        let (t0, t1) = keys.tokens_of(blk, bs);
        let vblk = &ctx.v[block_at(ctx, t, blk, block_elems)..][..block_elems];
        let mut tok = t0;
        while tok + 4 <= t1 {
            let b = tok - blk * bs;
            for h in t.h0..t.h1 {
                let v4 = widen4(vblk, dims.row_at(b, h), token_elems, hd, bufs);
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
                let value = T::widen(&vblk[dims.row_at(tok - blk * bs, h)..][..hd], &mut bufs[0]);
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
}

/// Step 7: each accumulator divided by its query's softmax sum (0 for a query that saw no key).
#[inline(always)]
fn normalize(dims: &TileDims, l: &[f32], acc: &mut [f32]) {
    let hd = dims.hd;
    for j in 0..dims.nq {
        let inv = if l[j] > 0.0 { 1.0 / l[j] } else { 0.0 };
        for a in &mut acc[j * hd..(j + 1) * hd] {
            *a *= inv;
        }
    }
}

/// Where logical block `blk`'s rows start in a cache (one table look-up per block and pass).
#[inline(always)]
fn block_at<T>(ctx: &Ctx<'_, T>, t: &Task, blk: usize, block_elems: usize) -> usize {
    ctx.tables.block(t.seq, blk) * block_elems
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
/// loads into `vpgatherdd` gathers, which measured no gain
/// (benches/results/2026-12-03-cpu-attention.md, "Tried, measured, not kept"); compiled on its
/// own it keeps one scalar load per line.
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
/// these loads made batch-32 decode faster at every context tried, for a few percent more
/// instructions (benches/results/2026-12-03-cpu-attention.md, "Where each step came from").
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
