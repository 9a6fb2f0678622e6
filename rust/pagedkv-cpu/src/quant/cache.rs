//! A quantized cache tensor as slices: the blocks' bytes and (int4) the residual slots, with the
//! checks that make every later index in bounds. The Python `QuantizedKvCache` in Rust. An int4
//! cache's residual slots are blocks of the 8-bit residual layout (`QuantLayout::residual`:
//! int8 codes and a UE5M3 scale per (token, head)), one row of bytes per slot.

use crate::error::{CpuError, Result};
use crate::layout::CacheShape;
use crate::quant::layout::{QuantLayout, Role};

/// One quantized cache tensor (the keys, or the values, of one layer), read.
///
/// Invariants (checked by [`QuantCache::new`]): `data.len()` is a whole number of
/// `layout.block_bytes` rows; `residual` is empty for the 8-bit formats, and for int4 a whole
/// number of slots, each `residual_layout.block_bytes` bytes; `residual_layout` is
/// `layout.residual()` for int4 (and `layout` itself, unused, otherwise).
#[derive(Debug, Clone, Copy)]
pub struct QuantCache<'a> {
    pub layout: QuantLayout,
    pub residual_layout: QuantLayout,
    pub data: &'a [u8],
    pub residual: &'a [u8],
}

/// The same, written (a write quantizes into `data` and parks tokens in `residual`).
#[derive(Debug)]
pub struct QuantCacheMut<'a> {
    pub layout: QuantLayout,
    pub residual_layout: QuantLayout,
    pub data: &'a mut [u8],
    pub residual: &'a mut [u8],
}

fn check(
    name: &str,
    layout: &QuantLayout,
    data_len: usize,
    residual_len: usize,
) -> Result<QuantLayout> {
    if !data_len.is_multiple_of(layout.block_bytes) {
        return Err(CpuError::Shape(format!(
            "{name}: {data_len} bytes are not whole blocks of {} (the {} {:?} layout)",
            layout.block_bytes,
            layout.format.name(),
            layout.role
        )));
    }
    if !layout.has_residual() {
        if residual_len != 0 {
            return Err(CpuError::Argument(format!(
                "{name}: a {} cache has no residual",
                layout.format.name()
            )));
        }
        return Ok(*layout);
    }
    let residual = layout.residual()?;
    if !residual_len.is_multiple_of(residual.block_bytes) {
        return Err(CpuError::Shape(format!(
            "{name}: the residual's {residual_len} bytes are not whole slots of {} (the {} \
             residual layout)",
            residual.block_bytes,
            residual.format.name()
        )));
    }
    Ok(residual)
}

impl<'a> QuantCache<'a> {
    /// Checks the slices against `layout` (`name` in messages).
    pub fn new(
        name: &str,
        layout: QuantLayout,
        data: &'a [u8],
        residual: &'a [u8],
    ) -> Result<Self> {
        let residual_layout = check(name, &layout, data.len(), residual.len())?;
        Ok(QuantCache {
            layout,
            residual_layout,
            data,
            residual,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.data.len() / self.layout.block_bytes
    }

    pub fn num_residual_slots(&self) -> usize {
        slots(&self.residual_layout, self.residual.len())
    }

    /// The logical shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub fn shape(&self) -> CacheShape {
        shape(&self.layout, self.num_blocks())
    }
}

impl<'a> QuantCacheMut<'a> {
    /// Checks the slices against `layout` (`name` in messages).
    pub fn new(
        name: &str,
        layout: QuantLayout,
        data: &'a mut [u8],
        residual: &'a mut [u8],
    ) -> Result<Self> {
        let residual_layout = check(name, &layout, data.len(), residual.len())?;
        Ok(QuantCacheMut {
            layout,
            residual_layout,
            data,
            residual,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.data.len() / self.layout.block_bytes
    }

    pub fn num_residual_slots(&self) -> usize {
        slots(&self.residual_layout, self.residual.len())
    }
}

fn slots(residual_layout: &QuantLayout, residual_len: usize) -> usize {
    residual_len / residual_layout.block_bytes
}

fn shape(layout: &QuantLayout, num_blocks: usize) -> CacheShape {
    CacheShape {
        num_blocks,
        block_size: layout.block_size,
        num_kv_heads: layout.num_kv_heads,
        head_dim: layout.head_dim,
    }
}

/// A key cache and a value cache that belong together: roles key then value, one format and
/// geometry, as many blocks and (int4) residual slots each. Returns the logical shape.
pub(crate) fn check_pair(
    k: (&QuantLayout, usize, usize),
    v: (&QuantLayout, usize, usize),
) -> Result<CacheShape> {
    let ((kl, kb, ks), (vl, vb, vs)) = (k, v);
    if kl.role != Role::Key || vl.role != Role::Value {
        return Err(CpuError::Argument(format!(
            "k_cache must have role key and v_cache role value, got {:?} and {:?}",
            kl.role, vl.role
        )));
    }
    let geometry = |l: &QuantLayout| (l.format, l.block_size, l.num_kv_heads, l.head_dim);
    if geometry(kl) != geometry(vl) {
        return Err(CpuError::Argument(format!(
            "k_cache and v_cache differ in format or geometry: {:?} vs {:?}",
            geometry(kl),
            geometry(vl)
        )));
    }
    if kb != vb {
        return Err(CpuError::Shape(format!(
            "k_cache has {kb} blocks, v_cache {vb}"
        )));
    }
    if ks != vs {
        return Err(CpuError::Shape(format!(
            "k_cache has {ks} residual slots, v_cache {vs}"
        )));
    }
    Ok(shape(kl, kb))
}
