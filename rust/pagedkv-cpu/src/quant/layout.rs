//! The quantized formats and where the parts of one block lie: the byte layout of
//! `python/pagedkv/attention/kv_cache_dtype.py` (`block_layout`), computed the same way, so that
//! a block written by any backend is read by every other (docs/quantized_kv.md).

use crate::error::{CpuError, Result};

/// Every block is whole 16-byte vectors (the GPU copy kernel and vector loads rely on it).
pub const ALIGN_BYTES: usize = 16;
/// bfloat16 side parameters per (block, head) of an int4 cache: center grid start, center grid
/// step, half-step unit.
pub const INT4_SIDE_PARAMS: usize = 3;

/// A quantized cache's `kv_cache_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// int8 codes, one UE5M3 scale byte per (token, head).
    Int8,
    /// fp8 e4m3 codes (OCP E4M3FN), one UE5M3 scale byte per (token, head).
    Fp8E4m3,
    /// 4-bit KIVI-style codes: keys per channel over a block, values per token; the newest
    /// tokens in an int8 residual slot per sequence.
    Int4,
}

impl QuantFormat {
    /// The format named as `kv_cache_dtype` names it (`"int8"`, `"fp8_e4m3"`, `"int4"`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "int8" => Ok(QuantFormat::Int8),
            "fp8_e4m3" => Ok(QuantFormat::Fp8E4m3),
            "int4" => Ok(QuantFormat::Int4),
            _ => Err(CpuError::Argument(format!(
                "kv_cache_dtype {name:?} is not a quantized format (int8, fp8_e4m3, int4)"
            ))),
        }
    }

    /// The `kv_cache_dtype` name.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Int8 => "int8",
            QuantFormat::Fp8E4m3 => "fp8_e4m3",
            QuantFormat::Int4 => "int4",
        }
    }
}

/// Which tensor a cache holds: int4 quantizes keys per channel and values per token (the 8-bit
/// formats treat both alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Key,
    Value,
}

impl Role {
    /// `"key"` or `"value"`, as the Python layer names roles.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "key" => Ok(Role::Key),
            "value" => Ok(Role::Value),
            _ => Err(CpuError::Argument(format!(
                "role must be \"key\" or \"value\", got {name:?}"
            ))),
        }
    }
}

/// One block's byte layout. Invariants (established by [`QuantLayout::new`]): `block_size`,
/// `num_kv_heads`, `head_dim` >= 1 (head_dim even for int4); codes `[0, codes_bytes)`, metadata
/// `[meta_offset, meta_offset + meta_bytes)`, int4 side parameters `[side_offset, side_offset +
/// side_bytes)` (side_offset even), in that order, all inside `block_bytes`, a multiple of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantLayout {
    pub format: QuantFormat,
    pub role: Role,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// 8-bit: `[block_size, num_kv_heads, head_dim]` codes; int4: `[.., head_dim / 2]` bytes
    /// of two codes (the low nibble the even channel).
    pub codes_bytes: usize,
    /// 8-bit: an UE5M3 scale per (token, head) `[block_size, num_kv_heads]`; int4: a group byte
    /// per (head, channel) for keys `[num_kv_heads, head_dim]`, per (token, head) for values.
    pub meta_offset: usize,
    pub meta_bytes: usize,
    /// int4: `[num_kv_heads, 3]` little-endian bfloat16; empty for the 8-bit formats.
    pub side_offset: usize,
    pub side_bytes: usize,
    pub block_bytes: usize,
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|x| x / to * to)
}

impl QuantLayout {
    /// The layout of one block (the Python `block_layout`); sizes that overflow or are zero are
    /// refused.
    pub fn new(
        format: QuantFormat,
        role: Role,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        if block_size == 0 || num_kv_heads == 0 || head_dim == 0 {
            return Err(CpuError::Shape(format!(
                "block_size ({block_size}), num_kv_heads ({num_kv_heads}) and head_dim ({head_dim}) must be >= 1"
            )));
        }
        let overflow = || CpuError::Shape("the block layout overflows usize".into());
        let elems = block_size
            .checked_mul(num_kv_heads)
            .and_then(|x| x.checked_mul(head_dim))
            .ok_or_else(overflow)?;
        let rows = block_size * num_kv_heads;
        let (codes, meta, side_offset, side) = match format {
            QuantFormat::Int4 => {
                if !head_dim.is_multiple_of(2) {
                    return Err(CpuError::Shape(format!(
                        "an int4 cache packs two channels a byte: head_dim must be even, got {head_dim}"
                    )));
                }
                let codes = elems / 2;
                let meta = match role {
                    Role::Key => num_kv_heads * head_dim,
                    Role::Value => rows,
                };
                let side_offset = round_up(codes + meta, 2).ok_or_else(overflow)?;
                (
                    codes,
                    meta,
                    side_offset,
                    num_kv_heads * INT4_SIDE_PARAMS * 2,
                )
            }
            QuantFormat::Int8 | QuantFormat::Fp8E4m3 => (elems, rows, elems + rows, 0),
        };
        let end = side_offset.checked_add(side).ok_or_else(overflow)?;
        Ok(QuantLayout {
            format,
            role,
            block_size,
            num_kv_heads,
            head_dim,
            codes_bytes: codes,
            meta_offset: codes,
            meta_bytes: meta,
            side_offset,
            side_bytes: side,
            block_bytes: round_up(end, ALIGN_BYTES).ok_or_else(overflow)?,
        })
    }

    /// Whether sequences keep their last, open block in a residual slot (int4).
    pub fn has_residual(&self) -> bool {
        self.format == QuantFormat::Int4
    }

    /// The layout of one residual slot of an int4 cache: an int8 block of the same role and
    /// geometry (`RESIDUAL_FORMAT` of `kv_cache_dtype.py`; docs/quantized_kv.md, "The residual
    /// in a paged cache").
    pub fn residual(&self) -> Result<Self> {
        QuantLayout::new(
            QuantFormat::Int8,
            self.role,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
    }

    /// Code bytes of one (token, head) row.
    pub fn row_code_bytes(&self) -> usize {
        match self.format {
            QuantFormat::Int4 => self.head_dim / 2,
            _ => self.head_dim,
        }
    }

    /// Elements of one token's rows (every head), the residual's row.
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_documented_sizes() {
        // docs/quantized_kv.md, "Byte accounting": block 16, 2 heads, head_dim 64.
        let int8 = QuantLayout::new(QuantFormat::Int8, Role::Key, 16, 2, 64).unwrap();
        assert_eq!(
            (int8.codes_bytes, int8.meta_bytes, int8.block_bytes),
            (2048, 32, 2080)
        );
        let k4 = QuantLayout::new(QuantFormat::Int4, Role::Key, 16, 2, 64).unwrap();
        assert_eq!(
            (k4.codes_bytes, k4.meta_bytes, k4.side_offset),
            (1024, 128, 1152)
        );
        assert_eq!(k4.block_bytes, 1168);
        let v4 = QuantLayout::new(QuantFormat::Int4, Role::Value, 16, 2, 64).unwrap();
        assert_eq!(v4.block_bytes, 1072);
        assert!(QuantLayout::new(QuantFormat::Int4, Role::Key, 16, 2, 63).is_err());
        assert!(QuantLayout::new(QuantFormat::Int8, Role::Key, 0, 2, 64).is_err());
        assert!(QuantLayout::new(QuantFormat::Int8, Role::Key, usize::MAX, 2, 64).is_err());
        assert_eq!(
            QuantFormat::parse("fp8_e4m3").unwrap(),
            QuantFormat::Fp8E4m3
        );
        assert!(QuantFormat::parse("float16").is_err());
        assert!(Role::parse("keys").is_err());
    }
}
