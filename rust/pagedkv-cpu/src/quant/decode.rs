//! Whole blocks dequantized element by element with the codec (`quant_codec.decode_blocks`):
//! what attention reads, in plain Rust. Attention itself dequantizes only the rows it reads,
//! with SIMD (`attention::quant_source`); this is the reference its tests compare with, and
//! what reopens an int4 block whose sealed tokens must return to a residual slot.

use crate::error::{CpuError, Result};
use crate::quant::codec::{
    bf16_to_f32, dequantize_8bit, int4_group_params, int4_value, ue5m3_to_f32,
};
use crate::quant::layout::{QuantFormat, QuantLayout, Role};

/// One block's bytes (`layout.block_bytes`) -> its values `[block_size, num_kv_heads,
/// head_dim]` in fp32 (`out`).
pub fn dequantize_block(layout: &QuantLayout, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let l = layout;
    let (bs, heads, hd) = (l.block_size, l.num_kv_heads, l.head_dim);
    if bytes.len() != l.block_bytes || out.len() != bs * heads * hd {
        return Err(CpuError::Shape(format!(
            "a {} block has {} bytes and {} values; got {} and {}",
            l.format.name(),
            l.block_bytes,
            bs * heads * hd,
            bytes.len(),
            out.len()
        )));
    }
    for b in 0..bs {
        for h in 0..heads {
            let row = b * heads + h;
            for d in 0..hd {
                let e = row * hd + d;
                out[e] = match l.format {
                    QuantFormat::Int8 | QuantFormat::Fp8E4m3 => dequantize_8bit(
                        bytes[e],
                        ue5m3_to_f32(bytes[l.meta_offset + row]),
                        l.format == QuantFormat::Fp8E4m3,
                    ),
                    QuantFormat::Int4 => {
                        let at = l.side_offset + 6 * h;
                        let side: [f32; 3] = std::array::from_fn(|i| {
                            bf16_to_f32(u16::from_le_bytes([
                                bytes[at + 2 * i],
                                bytes[at + 2 * i + 1],
                            ]))
                        });
                        let group = match l.role {
                            Role::Key => h * hd + d,
                            Role::Value => row,
                        };
                        let (chat, half) = int4_group_params(bytes[l.meta_offset + group], side);
                        int4_value(bytes[e / 2] >> (4 * (e & 1)), chat, half)
                    }
                };
            }
        }
    }
    Ok(())
}
