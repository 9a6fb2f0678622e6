//! Paged decode and prefill attention on quantized caches (`quant::QuantCache`): the plain
//! kernel's tasks and tile, reading K and V through [`QuantRows`], which dequantizes each block
//! the tile reads (only the rows of its tokens and heads) into a per-run fp32 buffer with the
//! SIMD row functions of `quant::dequant`, and reads an int4 sequence's open last block from its
//! residual slot (an int8 block, dequantized the same way). The dequantized values are exactly the codec's (`quant_codec.decode_blocks`),
//! and the tile's arithmetic is the plain kernel's, so the result equals, bit for bit, the plain
//! kernel on an fp32 cache holding the dequantized values (the tests check it).

use std::ops::Range;

use super::driver::{decode_rows, prefill_rows, run};
use super::source::{touch_bytes, KvSource, SourceScratch};
use super::task::AttentionParams;
use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::layout::BlockTables;
use crate::quant::cache::{check_pair, QuantCache};
use crate::quant::codec::{bf16_to_f32, int4_group_params, ue5m3_to_f32};
use crate::quant::dequant::Dequant;
use crate::quant::layout::{QuantFormat, Role};

/// The K (or V) rows of a quantized cache. Invariant: every sequence's `open` entry names a
/// residual slot of `cache` (checked when built) where its last block is open.
pub struct QuantRows<'a> {
    cache: QuantCache<'a>,
    /// Per sequence: its open last block (logical index) and residual slot; `usize::MAX` for
    /// a sequence whose blocks are all sealed (and every 8-bit one).
    open: Vec<(usize, usize)>,
    simd: Dequant,
}

const SEALED: (usize, usize) = (usize::MAX, usize::MAX);

impl KvSource for QuantRows<'_> {
    type Elem = f32;

    #[inline(always)]
    fn block<'s>(
        &'s self,
        seq: usize,
        blk: usize,
        id: usize,
        heads: Range<usize>,
        tokens: Range<usize>,
        scratch: &'s mut SourceScratch,
    ) -> &'s [f32] {
        let l = &self.cache.layout;
        let (hd, te) = (l.head_dim, l.token_elems());
        let out = &mut scratch.block;
        out.resize(l.block_size * te, 0.0);
        let (open_blk, slot) = self.open[seq];
        let (l, data) = if blk == open_blk {
            // int4's open block: its tokens are in the residual slot, an int8 block.
            let rl = &self.cache.residual_layout;
            (
                rl,
                &self.cache.residual[slot * rl.block_bytes..][..rl.block_bytes],
            )
        } else {
            (l, &self.cache.data[id * l.block_bytes..][..l.block_bytes])
        };
        match l.format {
            QuantFormat::Int8 | QuantFormat::Fp8E4m3 => {
                let fp8 = l.format == QuantFormat::Fp8E4m3;
                for b in tokens {
                    for h in heads.clone() {
                        let row = b * l.num_kv_heads + h;
                        let scale = ue5m3_to_f32(data[l.meta_offset + row]);
                        let codes = &data[row * hd..][..hd];
                        self.simd
                            .row_8bit(codes, scale, fp8, &mut out[row * hd..][..hd]);
                    }
                }
            }
            QuantFormat::Int4 => {
                let half_row = hd / 2;
                for h in heads {
                    let side = side_params(data, l.side_offset + 6 * h);
                    match l.role {
                        Role::Key => {
                            // A group per channel: its center and half step, once per block-head.
                            scratch.chat.resize(hd, 0.0);
                            scratch.half.resize(hd, 0.0);
                            let meta = &data[l.meta_offset + h * hd..][..hd];
                            for (d, &m) in meta.iter().enumerate() {
                                (scratch.chat[d], scratch.half[d]) = int4_group_params(m, side);
                            }
                            for b in tokens.clone() {
                                let row = b * l.num_kv_heads + h;
                                let codes = &data[row * half_row..][..half_row];
                                let dst = &mut out[row * hd..][..hd];
                                self.simd.row_int4_channels(
                                    codes,
                                    &scratch.chat,
                                    &scratch.half,
                                    dst,
                                );
                            }
                        }
                        Role::Value => {
                            for b in tokens.clone() {
                                let row = b * l.num_kv_heads + h;
                                let (chat, half) =
                                    int4_group_params(data[l.meta_offset + row], side);
                                let codes = &data[row * half_row..][..half_row];
                                let dst = &mut out[row * hd..][..hd];
                                self.simd.row_int4_uniform(codes, chat, half, dst);
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[inline(always)]
    fn touch(
        &self,
        seq: usize,
        blk: usize,
        id: usize,
        heads: Range<usize>,
        tokens: Range<usize>,
    ) -> u32 {
        let (l, data) = if blk == self.open[seq].0 {
            let rl = &self.cache.residual_layout;
            let slot = self.open[seq].1;
            (
                rl,
                &self.cache.residual[slot * rl.block_bytes..][..rl.block_bytes],
            )
        } else {
            let l = &self.cache.layout;
            (l, &self.cache.data[id * l.block_bytes..][..l.block_bytes])
        };
        let row_bytes = l.row_code_bytes();
        let mut bits = 0;
        for b in tokens {
            let first = (b * l.num_kv_heads + heads.start) * row_bytes;
            bits |= touch_bytes(&data[first..first + heads.len() * row_bytes]);
        }
        bits | u32::from(data[l.meta_offset])
    }
}

/// An int4 block-head's three bfloat16 side parameters (little-endian bytes).
#[inline(always)]
fn side_params(data: &[u8], at: usize) -> [f32; 3] {
    std::array::from_fn(|i| {
        bf16_to_f32(u16::from_le_bytes([data[at + 2 * i], data[at + 2 * i + 1]]))
    })
}

/// The sources of a key/value pair, every sequence's open block checked: a sequence that attends
/// (`q_len > 0`) with an open last block (int4, `seq_len % block_size != 0`) must name a residual
/// slot; the 8-bit formats take no slots.
fn sources<'a>(
    k: QuantCache<'a>,
    v: QuantCache<'a>,
    rows: &[(usize, usize)],
    residual_slots: Option<&[i32]>,
) -> Result<(QuantRows<'a>, QuantRows<'a>)> {
    check_pair(
        (&k.layout, k.num_blocks(), k.num_residual_slots()),
        (&v.layout, v.num_blocks(), v.num_residual_slots()),
    )?;
    let bs = k.layout.block_size;
    let mut open = vec![SEALED; rows.len()];
    match (k.layout.format, residual_slots) {
        (QuantFormat::Int4, None) => {
            return Err(CpuError::Argument(
                "an int4 cache needs residual_slots (each sequence's residual slot)".into(),
            ))
        }
        (QuantFormat::Int4, Some(slots)) => {
            if slots.len() != rows.len() {
                return Err(CpuError::Shape(format!(
                    "residual_slots has {} entries for {} sequences",
                    slots.len(),
                    rows.len()
                )));
            }
            for (i, (&(seq_len, q_len), &slot)) in rows.iter().zip(slots).enumerate() {
                if q_len == 0 || seq_len % bs == 0 {
                    continue; // never read
                }
                if slot < 0 || slot as usize >= k.num_residual_slots() {
                    return Err(CpuError::Index(format!(
                        "residual_slots[{i}] = {slot} is not a residual slot in [0, {}) and \
                         sequence {i}'s last block is open (seq_len {seq_len})",
                        k.num_residual_slots()
                    )));
                }
                open[i] = (seq_len / bs, slot as usize);
            }
        }
        (format, Some(_)) => {
            return Err(CpuError::Argument(format!(
                "residual_slots is for int4 caches, not {}",
                format.name()
            )))
        }
        (_, None) => {}
    }
    let simd = Dequant::detect();
    Ok((
        QuantRows {
            cache: k,
            open: open.clone(),
            simd,
        },
        QuantRows {
            cache: v,
            open,
            simd,
        },
    ))
}

/// [`super::paged_decode`] on quantized caches: one query per sequence over its paged history,
/// dequantized as it is read. `q`, `out`: `[B, num_q_heads, head_dim]` of `R`;
/// `residual_slots` (int4 only): each sequence's residual slot.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_quant<R: KvElem>(
    q: &[R],
    k_cache: QuantCache<'_>,
    v_cache: QuantCache<'_>,
    tables: &BlockTables<'_>,
    seq_lens: &[i32],
    residual_slots: Option<&[i32]>,
    params: AttentionParams,
    out: &mut [R],
) -> Result<()> {
    let params = AttentionParams {
        causal: true,
        ..params
    };
    let rows = decode_rows(seq_lens)?;
    let shape = k_cache.shape();
    let lens: Vec<(usize, usize)> = rows.iter().map(|r| (r.seq_len, r.q_len)).collect();
    let (k, v) = sources(k_cache, v_cache, &lens, residual_slots)?;
    run(q, &k, &v, shape, tables, &rows, seq_lens.len(), params, out)
}

/// [`super::paged_prefill`] on quantized caches (see [`paged_decode_quant`]).
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_quant<R: KvElem>(
    q: &[R],
    k_cache: QuantCache<'_>,
    v_cache: QuantCache<'_>,
    tables: &BlockTables<'_>,
    seq_lens: &[i32],
    query_start_loc: &[i32],
    residual_slots: Option<&[i32]>,
    params: AttentionParams,
    out: &mut [R],
) -> Result<()> {
    let (rows, total_q) = prefill_rows(seq_lens, query_start_loc)?;
    let shape = k_cache.shape();
    let lens: Vec<(usize, usize)> = rows.iter().map(|r| (r.seq_len, r.q_len)).collect();
    let (k, v) = sources(k_cache, v_cache, &lens, residual_slots)?;
    run(q, &k, &v, shape, tables, &rows, total_q, params, out)
}
