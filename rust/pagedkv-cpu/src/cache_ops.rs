//! KV writes, copy-on-write block copies and tier swaps. Each call checks every index it will
//! use before its first write, so a refused call leaves the caches untouched.

use crate::error::{CpuError, Result};
use crate::layout::CacheShape;

/// Writes token t's key and value rows (`[num_kv_heads, head_dim]`) into slot `slot_mapping[t]`
/// (`block_id * block_size + offset`) of both caches. -1 skips a token (the NumPy reference's
/// convention); any other negative value, a slot past the cache, or a slot named twice is an
/// error.
pub fn write_kv<T: Copy>(
    k: &[T],
    v: &[T],
    k_cache: &mut [T],
    v_cache: &mut [T],
    cache: CacheShape,
    slot_mapping: &[i64],
) -> Result<()> {
    cache.check_len("k_cache", k_cache.len())?;
    cache.check_len("v_cache", v_cache.len())?;
    check_write_rows(k.len(), v.len(), cache, slot_mapping)?;
    let row = cache.token_elems();
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let dst = slot as usize * row;
        k_cache[dst..dst + row].copy_from_slice(&k[t * row..(t + 1) * row]);
        v_cache[dst..dst + row].copy_from_slice(&v[t * row..(t + 1) * row]);
    }
    Ok(())
}

/// The checks every KV write makes before its first byte (the plain and the quantized caches'):
/// `k` and `v` hold `k_len` and `v_len` elements, one `[num_kv_heads, head_dim]` row per entry
/// of `slot_mapping`; every slot is -1 (skipped) or inside the cache, and no slot is named twice.
pub(crate) fn check_write_rows(
    k_len: usize,
    v_len: usize,
    cache: CacheShape,
    slot_mapping: &[i64],
) -> Result<()> {
    let n = slot_mapping.len();
    let row = cache.token_elems();
    if k_len != n * row || v_len != n * row {
        return Err(CpuError::Shape(format!(
            "k ({k_len}) and v ({v_len}) must hold [{n}, {}, {}] = {} elements (one row per slot)",
            cache.num_kv_heads,
            cache.head_dim,
            n * row
        )));
    }
    let num_slots = cache.num_slots();
    let mut seen: Vec<i64> = Vec::with_capacity(n);
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < -1 || slot >= num_slots as i64 {
            return Err(CpuError::Index(format!(
                "slot_mapping[{t}] = {slot}: slots lie in [-1, {num_slots}) (-1 skips a token)"
            )));
        }
        if slot >= 0 {
            seen.push(slot);
        }
    }
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(CpuError::Index(format!(
            "slot_mapping names slot {} twice",
            w[0]
        )));
    }
    Ok(())
}

/// `copy_ops` (`[N, 2]` flattened: src, dst block ids) applied in order to every cache of
/// `caches` (all layers' K and V caches, each of shape `cache`). Self-copies do nothing.
pub fn copy_blocks<T: Copy>(
    caches: &mut [&mut [T]],
    cache: CacheShape,
    copy_ops: &[i32],
) -> Result<()> {
    for (i, c) in caches.iter().enumerate() {
        cache.check_len(&format!("caches[{i}]"), c.len())?;
    }
    if !copy_ops.len().is_multiple_of(2) {
        return Err(CpuError::Shape("copy_ops must be [N, 2] (src, dst)".into()));
    }
    for (i, &id) in copy_ops.iter().enumerate() {
        if id < 0 || id as usize >= cache.num_blocks {
            return Err(CpuError::Index(format!(
                "copy_ops[{}, {}] = {id} is not a block id in [0, {})",
                i / 2,
                i % 2,
                cache.num_blocks
            )));
        }
    }
    let be = cache.block_elems();
    for op in copy_ops.chunks_exact(2) {
        let (src, dst) = (op[0] as usize, op[1] as usize);
        if src == dst {
            continue;
        }
        for c in caches.iter_mut() {
            c.copy_within(src * be..(src + 1) * be, dst * be);
        }
    }
    Ok(())
}

/// Copies blocks `mapping` (`[N, 2]` flattened: src block, dst block) from `src` to `dst`, two
/// caches of one block shape. Destinations must be distinct. Runs of consecutive blocks (sorted
/// by source) move in one copy; returns the number of copies, as the NumPy reference counts them.
pub fn swap_blocks<T: Copy>(
    src: &[T],
    dst: &mut [T],
    block_elems: usize,
    mapping: &[i32],
) -> Result<usize> {
    if block_elems == 0
        || !src.len().is_multiple_of(block_elems)
        || !dst.len().is_multiple_of(block_elems)
    {
        return Err(CpuError::Shape(format!(
            "caches of {} and {} elements are not whole blocks of {block_elems}",
            src.len(),
            dst.len()
        )));
    }
    if !mapping.len().is_multiple_of(2) {
        return Err(CpuError::Shape(
            "mapping must be [N, 2] (src_block, dst_block)".into(),
        ));
    }
    let (ns, nd) = (src.len() / block_elems, dst.len() / block_elems);
    let mut pairs: Vec<(usize, usize)> = Vec::with_capacity(mapping.len() / 2);
    for (i, op) in mapping.chunks_exact(2).enumerate() {
        let (s, d) = (op[0], op[1]);
        if s < 0 || s as usize >= ns {
            return Err(CpuError::Index(format!(
                "mapping[{i}, 0] = {s} is not a source block id in [0, {ns})"
            )));
        }
        if d < 0 || d as usize >= nd {
            return Err(CpuError::Index(format!(
                "mapping[{i}, 1] = {d} is not a destination block id in [0, {nd})"
            )));
        }
        pairs.push((s as usize, d as usize));
    }
    let mut dsts: Vec<usize> = pairs.iter().map(|p| p.1).collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Err(CpuError::Index(format!(
            "mapping names destination block {} twice",
            w[0]
        )));
    }
    pairs.sort_unstable();
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (s, d) in pairs {
        match runs.last_mut() {
            Some(run) if run.0 + run.2 == s && run.1 + run.2 == d => run.2 += 1,
            _ => runs.push((s, d, 1)),
        }
    }
    for &(s, d, n) in &runs {
        dst[d * block_elems..(d + n) * block_elems]
            .copy_from_slice(&src[s * block_elems..(s + n) * block_elems]);
    }
    Ok(runs.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: CacheShape = CacheShape {
        num_blocks: 3,
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 2,
    };

    #[test]
    fn write_kv_skips_minus_one_and_refuses_bad_slots_before_writing() {
        let mut kc = vec![0.0f32; 12];
        let mut vc = vec![0.0f32; 12];
        let k = [1.0, 2.0, 3.0, 4.0];
        let v = [5.0, 6.0, 7.0, 8.0];
        write_kv(&k, &v, &mut kc, &mut vc, SHAPE, &[5, -1]).unwrap();
        assert_eq!(&kc[10..12], &[1.0, 2.0]);
        assert_eq!(kc.iter().filter(|x| **x != 0.0).count(), 2);
        for bad in [[0, 6], [-2, 0], [3, 3]] {
            let before = kc.clone();
            assert!(write_kv(&k, &v, &mut kc, &mut vc, SHAPE, &bad).is_err());
            assert_eq!(kc, before, "{bad:?} wrote before failing");
        }
        assert!(write_kv(&k[..2], &v, &mut kc, &mut vc, SHAPE, &[0, 1]).is_err());
    }

    #[test]
    fn copy_blocks_runs_in_order_and_checks_ids() {
        let mut a: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let mut b = a.clone();
        {
            let mut caches: Vec<&mut [f32]> = vec![&mut a, &mut b];
            // 0 -> 1 then 1 -> 2: block 2 receives block 0's contents.
            copy_blocks(&mut caches, SHAPE, &[0, 1, 1, 2]).unwrap();
            assert!(copy_blocks(&mut caches, SHAPE, &[0, 3]).is_err());
            assert!(copy_blocks(&mut caches, SHAPE, &[-1, 0]).is_err());
        }
        assert_eq!(&a[8..12], &[0.0, 1.0, 2.0, 3.0]);
        assert_eq!(a, b);
    }

    #[test]
    fn swap_blocks_merges_runs_and_checks_ids() {
        let src: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let mut dst = vec![0.0f32; 16];
        assert_eq!(swap_blocks(&src, &mut dst, 4, &[1, 2, 0, 1]).unwrap(), 1);
        assert_eq!(&dst[4..12], &src[0..8]);
        assert!(swap_blocks(&src, &mut dst, 4, &[0, 4]).is_err());
        assert!(swap_blocks(&src, &mut dst, 4, &[3, 0]).is_err());
        assert!(swap_blocks(&src, &mut dst, 4, &[0, 1, 1, 1]).is_err());
    }
}
