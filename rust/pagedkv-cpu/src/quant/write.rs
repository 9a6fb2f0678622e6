//! KV writes into quantized caches: quantize on the way in.
//!
//! 8-bit caches quantize each token's heads into its slot (codes and the row's UE5M3 scale).
//! int4 caches keep a sequence's last, open block in its residual slot: the tokens a write puts
//! in a block that stays open are parked there as they are; a block the write fills is *sealed*
//! (its earlier tokens, from the slot, and the new ones quantized as a whole). Seals run before
//! parking, so a write that seals block b and opens block b + 1 of one sequence reads the slot
//! before reusing it. The contract and every check are `quant_validation.plan_seals`'s
//! (docs/quantized_kv.md, "Writes"): the tokens a write puts in one block are consecutive
//! offsets of one sequence (one residual slot); two blocks of one write may not both read, or
//! both park in, one slot. Everything is checked before the first byte is written.

use crate::cache_ops::check_write_rows;
use crate::elem::KvElem;
use crate::error::{CpuError, Result};
use crate::quant::cache::{check_pair, QuantCacheMut};
use crate::quant::codec::{int4_encode_set, quantize_8bit_row, Int4Scratch};
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
/// formats). The residual holds `T` (the model's dtype). Nothing is written unless every check
/// passes.
pub fn write_kv_quant<T: KvElem>(
    k: &[T],
    v: &[T],
    k_cache: QuantCacheMut<'_, T>,
    v_cache: QuantCacheMut<'_, T>,
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
fn write_8bit<T: KvElem>(x: &[T], cache: QuantCacheMut<'_, T>, slot_mapping: &[i64]) {
    let l = cache.layout;
    let (hd, heads, bs) = (l.head_dim, l.num_kv_heads, l.block_size);
    let fp8 = l.format == QuantFormat::Fp8E4m3;
    let mut wide = vec![0.0f32; hd];
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, off) = (slot as usize / bs, slot as usize % bs);
        let base = block * l.block_bytes;
        for h in 0..heads {
            let src = T::widen(&x[(t * heads + h) * hd..][..hd], &mut wide);
            let at = base + (off * heads + h) * hd;
            let scale = quantize_8bit_row(src, &mut cache.data[at..at + hd], fp8);
            cache.data[base + l.meta_offset + off * heads + h] = scale;
        }
    }
}

/// int4: seal the blocks that fill (residual tokens, then new ones, quantized whole), then park
/// the tokens of the blocks that stay open in their slots. The plan was checked.
fn write_int4<T: KvElem>(x: &[T], cache: QuantCacheMut<'_, T>, plan: &SealPlan) {
    let l = cache.layout;
    let (bs, te) = (l.block_size, l.token_elems());
    let mut tokens = vec![0.0f32; bs * te];
    let mut bytes = vec![0u8; l.block_bytes];
    let mut scratch = Int4Scratch::default();
    let mut wide = vec![0.0f32; bs * te];
    for r in plan.runs.iter().filter(|r| r.first_off + r.len == bs) {
        if r.first_off > 0 {
            let slot = r.slot as usize * bs * te;
            let from = &cache.residual[slot..slot + r.first_off * te];
            tokens[..r.first_off * te].copy_from_slice(T::widen(from, &mut wide));
        }
        for (i, &(_, row)) in plan.tokens[r.start..r.start + r.len].iter().enumerate() {
            let off = r.first_off + i;
            let from = &x[row * te..(row + 1) * te];
            tokens[off * te..(off + 1) * te].copy_from_slice(T::widen(from, &mut wide));
        }
        encode_int4_block(&l, &tokens, &mut bytes, &mut scratch);
        cache.data[r.block * l.block_bytes..(r.block + 1) * l.block_bytes].copy_from_slice(&bytes);
    }
    for r in plan.runs.iter().filter(|r| r.first_off + r.len < bs) {
        let slot = r.slot as usize * bs * te;
        for (i, &(_, row)) in plan.tokens[r.start..r.start + r.len].iter().enumerate() {
            let at = slot + (r.first_off + i) * te;
            cache.residual[at..at + te].copy_from_slice(&x[row * te..(row + 1) * te]);
        }
    }
}

/// One int4 block's bytes from its tokens `[block_size, num_kv_heads, head_dim]` (fp32):
/// per head a set (keys: a group per channel over the tokens; values: a group per token), codes
/// two a byte, group bytes, side parameters; padding zero (`quant_codec.encode_blocks`).
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
