//! KV writes into quantized caches: quantize on the way in.
//!
//! 8-bit caches quantize each token's heads into its slot (codes and the row's UE5M3 scale).
//! int4 caches keep a sequence's last, open block in its residual slot, an int8 block: the
//! tokens a write puts in a block that stays open are parked there, quantized to int8; a block
//! the write fills is *sealed*: its tokens' int8 values (the earlier ones read from the slot,
//! the new ones round-tripped through int8 the same way) quantized to int4 as a whole, so the
//! sealed bytes do not depend on which write brought which token. Seals run before
//! parking, so a write that seals block b and opens block b + 1 of one sequence reads the slot
//! before reusing it. The contract and every check are `quant_validation.plan_seals`'s
//! (docs/quantized_kv.md, "Writes"): the tokens a write puts in one block are consecutive
//! offsets of one sequence (one residual slot); two blocks of one write may not both read, or
//! both park in, one slot. Everything is checked before the first byte is written.

use crate::cache_ops::check_write_rows;
use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::quant::cache::{check_pair, QuantCacheMut};
use crate::quant::codec::{
    dequantize_8bit, int4_encode_set, quantize_8bit_row, ue5m3_to_f32, Int4Scratch,
};
use crate::quant::layout::{QuantFormat, QuantLayout, Role};

/// One block an int4 write touches: the tokens it writes there (`rows[first..]` input rows, in
/// offset order from `first_off`), the residual slot they name.
#[derive(Debug, Clone, Copy)]
struct BlockRun {
    block: usize,
    first_off: usize,
    /// Index into the sorted (slot, row) list where the run starts, and its length.
    start: usize,
    len: usize,
    slot: i64,
}

/// The int4 plan: which blocks are sealed (and from which slot they read their earlier tokens)
/// and which tokens are parked where.
struct SealPlan {
    runs: Vec<BlockRun>,
    /// (slot, input row) of every written token, sorted by slot.
    tokens: Vec<(usize, usize)>,
}

fn plan_seals(
    slot_mapping: &[i64],
    residual_slots: &[i32],
    block_size: usize,
    num_residual_slots: usize,
) -> Result<SealPlan> {
    let mut tokens: Vec<(usize, usize)> = slot_mapping
        .iter()
        .enumerate()
        .filter(|(_, &s)| s >= 0)
        .map(|(row, &s)| (s as usize, row))
        .collect();
    tokens.sort_unstable();
    let mut runs: Vec<BlockRun> = Vec::new();
    for (i, &(slot, row)) in tokens.iter().enumerate() {
        let (block, off) = (slot / block_size, slot % block_size);
        let res = i64::from(residual_slots[row]);
        match runs.last_mut() {
            Some(r) if r.block == block => {
                if off != r.first_off + r.len {
                    return Err(CpuError::Argument(format!(
                        "the tokens written to block {block} are not consecutive offsets"
                    )));
                }
                if res != r.slot {
                    return Err(CpuError::Argument(format!(
                        "the tokens written to block {block} name different residual slots"
                    )));
                }
                r.len += 1;
            }
            _ => runs.push(BlockRun {
                block,
                first_off: off,
                start: i,
                len: 1,
                slot: res,
            }),
        }
    }
    let (mut read, mut parked) = (
        vec![false; num_residual_slots],
        vec![false; num_residual_slots],
    );
    for r in &runs {
        let fills = r.first_off + r.len == block_size;
        let reads = fills && r.first_off > 0;
        if fills && !reads {
            continue; // a whole block: no residual involved
        }
        if r.slot < 0 || r.slot as usize >= num_residual_slots {
            return Err(CpuError::Index(format!(
                "block {} is open (or sealed from earlier tokens) and needs a residual slot in \
                 [0, {num_residual_slots}), got {}",
                r.block, r.slot
            )));
        }
        let used = if reads { &mut read } else { &mut parked };
        if std::mem::replace(&mut used[r.slot as usize], true) {
            let what = if reads { "read" } else { "parked in" };
            return Err(CpuError::Argument(format!(
                "two blocks of one write are {what} one residual slot"
            )));
        }
    }
    Ok(SealPlan { runs, tokens })
}

/// Writes token t's key and value rows (`[num_kv_heads, head_dim]` of `T`) into slot
/// `slot_mapping[t]` of two quantized caches (-1 skips a token; slots distinct). int4:
/// `residual_slots[t]` names the residual slot of token t's sequence (`None` for the 8-bit
/// formats). Nothing is written unless every check passes.
pub fn write_kv_quant<T: KvElem>(
    k: &[T],
    v: &[T],
    k_cache: QuantCacheMut<'_>,
    v_cache: QuantCacheMut<'_>,
    slot_mapping: &[i64],
    residual_slots: Option<&[i32]>,
) -> Result<()> {
    let shape = check_pair(
        (
            &k_cache.layout,
            k_cache.num_blocks(),
            k_cache.num_residual_slots(),
        ),
        (
            &v_cache.layout,
            v_cache.num_blocks(),
            v_cache.num_residual_slots(),
        ),
    )?;
    let layout = k_cache.layout;
    check_write_rows(k.len(), v.len(), shape, slot_mapping)?;
    let n = slot_mapping.len();
    if layout.format != QuantFormat::Int4 {
        if residual_slots.is_some() {
            return Err(CpuError::Argument(format!(
                "residual_slots is for int4 caches, not {}",
                layout.format.name()
            )));
        }
        write_8bit(k, k_cache, slot_mapping);
        write_8bit(v, v_cache, slot_mapping);
        return Ok(());
    }
    let Some(res) = residual_slots else {
        return Err(CpuError::Argument(
            "an int4 write needs residual_slots (each token's residual slot)".into(),
        ));
    };
    if res.len() != n {
        return Err(CpuError::Shape(format!(
            "residual_slots has {} entries for {n} tokens",
            res.len()
        )));
    }
    let plan = plan_seals(
        slot_mapping,
        res,
        layout.block_size,
        k_cache.num_residual_slots(),
    )?;
    write_int4(k, k_cache, &plan);
    write_int4(v, v_cache, &plan);
    Ok(())
}

/// 8-bit: each token's heads quantized into its slot. Slots were checked.
///
/// Compiled several times (AVX-512, AVX2, the x86-64 baseline) and dispatched once per call on
/// the CPU's features; the row quantizer is inlined, so its loops are vectorised at each width
/// with the scalar definition's bits (`codec::quantize_8bit_row`).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn write_8bit<T: KvElem>(x: &[T], cache: QuantCacheMut<'_>, slot_mapping: &[i64]) {
    let l = cache.layout;
    let te = l.token_elems();
    let mut wide = vec![0.0f32; te];
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot >= 0 {
            let src = T::widen(&x[t * te..(t + 1) * te], &mut wide);
            put_8bit_token(&l, cache.data, slot as usize, src);
        }
    }
}

/// Quantizes one token's rows `[num_kv_heads, head_dim]` (fp32) into slot `slot` (`block *
/// block_size + offset`) of the 8-bit blocks `data` of layout `l` (in bounds: checked by the
/// caller).
#[inline(always)]
fn put_8bit_token(l: &QuantLayout, data: &mut [u8], slot: usize, x: &[f32]) {
    let (hd, heads, bs) = (l.head_dim, l.num_kv_heads, l.block_size);
    let fp8 = l.format == QuantFormat::Fp8E4m3;
    let (block, off) = (slot / bs, slot % bs);
    let base = block * l.block_bytes;
    for h in 0..heads {
        let at = base + (off * heads + h) * hd;
        let scale = quantize_8bit_row(&x[h * hd..(h + 1) * hd], &mut data[at..at + hd], fp8);
        data[base + l.meta_offset + off * heads + h] = scale;
    }
}

/// The fp32 values of token `off` of the 8-bit block `block` (layout `l`) into `out`
/// `[num_kv_heads, head_dim]`: `code * scale`, exact (`quant_codec.decode_blocks`).
#[inline(always)]
fn get_8bit_token(l: &QuantLayout, data: &[u8], block: usize, off: usize, out: &mut [f32]) {
    let (hd, heads) = (l.head_dim, l.num_kv_heads);
    let base = block * l.block_bytes;
    let fp8 = l.format == QuantFormat::Fp8E4m3;
    for h in 0..heads {
        let row = off * heads + h;
        let scale = ue5m3_to_f32(data[base + l.meta_offset + row]);
        let codes = &data[base + row * hd..][..hd];
        for (o, &c) in out[h * hd..(h + 1) * hd].iter_mut().zip(codes) {
            *o = dequantize_8bit(c, scale, fp8);
        }
    }
}

/// A token's rows `x` (fp32) replaced by the values its int8 residual row holds: quantized
/// with the row's own scale and dequantized (`quant_codec.round_trip_8bit`).
#[inline(always)]
fn round_trip_token(l: &QuantLayout, x: &mut [f32], codes: &mut [u8]) {
    let hd = l.head_dim;
    for row in x.chunks_exact_mut(hd) {
        let scale = ue5m3_to_f32(quantize_8bit_row(row, codes, false));
        for (v, &c) in row.iter_mut().zip(codes.iter()) {
            *v = dequantize_8bit(c, scale, false);
        }
    }
}

/// int4: seal the blocks that fill (their tokens' int8 values, from the residual slot or
/// round-tripped from the write, quantized to int4 whole), then park the tokens of the blocks
/// that stay open in their slots (quantized to int8). The plan was checked. Multiversioned as
/// [`write_8bit`], every step inlined.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn write_int4<T: KvElem>(x: &[T], cache: QuantCacheMut<'_>, plan: &SealPlan) {
    let (l, rl) = (cache.layout, cache.residual_layout);
    let (bs, te) = (l.block_size, l.token_elems());
    let mut tokens = vec![0.0f32; bs * te];
    let mut bytes = vec![0u8; l.block_bytes];
    let mut scratch = Int4Scratch::default();
    let mut wide = vec![0.0f32; te];
    let mut codes = vec![0u8; l.head_dim];
    for r in plan.runs.iter().filter(|r| r.first_off + r.len == bs) {
        for off in 0..r.first_off {
            let dst = &mut tokens[off * te..(off + 1) * te];
            get_8bit_token(&rl, cache.residual, r.slot as usize, off, dst);
        }
        for (i, &(_, row)) in plan.tokens[r.start..r.start + r.len].iter().enumerate() {
            let off = r.first_off + i;
            let dst = &mut tokens[off * te..(off + 1) * te];
            dst.copy_from_slice(T::widen(&x[row * te..(row + 1) * te], &mut wide));
            round_trip_token(&rl, dst, &mut codes);
        }
        encode_int4_block(&l, &tokens, &mut bytes, &mut scratch);
        cache.data[r.block * l.block_bytes..(r.block + 1) * l.block_bytes].copy_from_slice(&bytes);
    }
    for r in plan.runs.iter().filter(|r| r.first_off + r.len < bs) {
        for (i, &(_, row)) in plan.tokens[r.start..r.start + r.len].iter().enumerate() {
            let src = T::widen(&x[row * te..(row + 1) * te], &mut wide);
            let slot = r.slot as usize * bs + r.first_off + i;
            put_8bit_token(&rl, cache.residual, slot, src);
        }
    }
}

/// One int4 block's bytes from its tokens `[block_size, num_kv_heads, head_dim]` (fp32):
/// per head a set (keys: a group per channel over the tokens; values: a group per token), codes
/// two a byte, group bytes, side parameters; padding zero (`quant_codec.encode_blocks`).
#[inline(always)]
pub(crate) fn encode_int4_block(
    l: &QuantLayout,
    tokens: &[f32],
    bytes: &mut [u8],
    scratch: &mut Int4Scratch,
) {
    let (bs, heads, hd) = (l.block_size, l.num_kv_heads, l.head_dim);
    bytes.fill(0);
    let at = |b: usize, h: usize, d: usize| (b * heads + h) * hd + d;
    for h in 0..heads {
        let (codes, rest) = bytes.split_at_mut(l.meta_offset);
        let meta = &mut rest[..l.meta_bytes];
        let mut put = |b: usize, d: usize, q: u8| {
            let e = at(b, h, d);
            codes[e / 2] |= q << (4 * (e & 1));
        };
        let side = match l.role {
            Role::Key => {
                let mut group_meta = vec![0u8; hd];
                let side = int4_encode_set(
                    hd,
                    bs,
                    |d, b| tokens[at(b, h, d)],
                    &mut group_meta,
                    |d, b, q| put(b, d, q),
                    scratch,
                );
                meta[h * hd..(h + 1) * hd].copy_from_slice(&group_meta);
                side
            }
            Role::Value => {
                let mut group_meta = vec![0u8; bs];
                let side = int4_encode_set(
                    bs,
                    hd,
                    |b, d| tokens[at(b, h, d)],
                    &mut group_meta,
                    &mut put,
                    scratch,
                );
                for (b, &m) in group_meta.iter().enumerate() {
                    meta[b * heads + h] = m;
                }
                side
            }
        };
        for (i, bits) in side.bits.iter().enumerate() {
            let o = l.side_offset + h * 6 + 2 * i;
            bytes[o..o + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
}
