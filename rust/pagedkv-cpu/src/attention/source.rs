//! Where a task's key and value rows come from: [`KvSource`] hands the tile one block's rows at
//! a time, laid out as a plain cache block `[block_size, num_kv_heads, head_dim]`. A plain cache
//! ([`PlainRows`]) hands out its own block, no copy; a quantized cache
//! (`quant_source::QuantRows`) dequantizes the rows the tile reads into a per-run buffer. The
//! tile's arithmetic is the same either way, so a quantized cache is attended exactly as an fp32
//! cache holding its dequantized values. A leaf of `attention`, like `task`.

use std::ops::Range;

use crate::elem::KvElem;
use crate::error::Result;
use crate::layout::CacheShape;

/// Per-run buffers a source may fill (reused by every task of a run).
#[derive(Default)]
pub struct SourceScratch {
    /// One block's dequantized rows `[block_size, num_kv_heads, head_dim]`.
    pub(crate) block: Vec<f32>,
    /// A block-head's per-channel centers and half steps (int4 keys).
    pub(crate) chat: Vec<f32>,
    pub(crate) half: Vec<f32>,
}

/// The K (or V) rows of a call's cache.
pub trait KvSource: Sync {
    /// What the tile widens to fp32 (f32 for dequantized rows: widening them is free).
    type Elem: KvElem;

    /// Logical block `blk` of sequence `seq` (physical block `id`, from the checked table): a
    /// slice of `block_elems` elements laid out `[block_size, num_kv_heads, head_dim]`, whose
    /// rows of in-block offsets `tokens` and heads `heads` hold the block's values (other rows
    /// may hold anything).
    fn block<'s>(
        &'s self,
        seq: usize,
        blk: usize,
        id: usize,
        heads: Range<usize>,
        tokens: Range<usize>,
        scratch: &'s mut SourceScratch,
    ) -> &'s [Self::Elem];

    /// One plain load per cache line of those rows' bytes in the cache (the read-ahead of
    /// `tile::touch_block`), the loaded values OR-ed.
    fn touch(
        &self,
        seq: usize,
        blk: usize,
        id: usize,
        heads: Range<usize>,
        tokens: Range<usize>,
    ) -> u32;
}

/// A plain cache `[num_blocks, block_size, num_kv_heads, head_dim]` of `T`. Invariant: `data`
/// holds exactly `shape.elems()` elements.
pub struct PlainRows<'a, T> {
    data: &'a [T],
    shape: CacheShape,
}

impl<'a, T: KvElem> PlainRows<'a, T> {
    /// `data` checked against `shape` (`name` in the message).
    pub fn new(name: &str, data: &'a [T], shape: CacheShape) -> Result<Self> {
        shape.check_len(name, data.len())?;
        Ok(PlainRows { data, shape })
    }
}

impl<T: KvElem> KvSource for PlainRows<'_, T> {
    type Elem = T;

    #[inline(always)]
    fn block<'s>(
        &'s self,
        _seq: usize,
        _blk: usize,
        id: usize,
        _heads: Range<usize>,
        _tokens: Range<usize>,
        _scratch: &'s mut SourceScratch,
    ) -> &'s [T] {
        let be = self.shape.block_elems();
        &self.data[id * be..][..be]
    }

    #[inline(always)]
    fn touch(
        &self,
        _seq: usize,
        _blk: usize,
        id: usize,
        heads: Range<usize>,
        tokens: Range<usize>,
    ) -> u32 {
        let (te, hd) = (self.shape.token_elems(), self.shape.head_dim);
        let first = id * self.shape.block_size;
        let mut bits = 0;
        for tok in tokens {
            let row = (first + tok) * te;
            bits |= touch_lines(&self.data[row + heads.start * hd..row + heads.end * hd]);
        }
        bits
    }
}

/// One plain load per 64-byte cache line of `rows`, the values' bits OR-ed (one cycle per line,
/// no long dependency chain): a read-ahead of the next blocks of a paged cache. Scattered blocks
/// defeat the hardware prefetcher at every block start; `prefetcht0` one or two blocks ahead
/// measured no gain on this VM (a software prefetch that misses the TLB may be dropped), while
/// these loads made batch-32 decode faster at every context tried, for a few percent more
/// instructions (benches/results/2026-12-03-cpu-attention.md, "Where each step came from").
#[inline(always)]
pub(crate) fn touch_lines<T: KvElem>(rows: &[T]) -> u32 {
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

/// One load per 64-byte line of a byte range (quantized blocks).
#[inline(always)]
pub(crate) fn touch_bytes(bytes: &[u8]) -> u32 {
    let mut bits = 0u32;
    for line in bytes.chunks(64) {
        bits |= u32::from(line[0]);
    }
    bits
}
