//! Cache element types: fp32, fp16 and bf16, all widened to fp32 for arithmetic.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A KV-cache element. Arithmetic is always fp32: `widen` converts a row for reading, `narrow`
/// rounds results back (round to nearest even, as the NumPy reference does).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Name used in messages.
    const NAME: &'static str;
    /// `src` as fp32: `src` itself for fp32 (no copy), else converted into `scratch[..src.len()]`.
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
    /// `src` rounded into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    const NAME: &'static str = "float32";
    #[inline]
    fn widen<'a>(src: &'a [Self], _scratch: &'a mut [f32]) -> &'a [f32] {
        src
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

/// fp16 bits -> fp32, exact, branch-free (selects), so that a loop over a row vectorises inside
/// the caller's multiversioned clone. `half`'s own conversion checks the CPU's features per call,
/// which per 64-element row cost more than the conversion (perf on fp16 decode;
/// docs/cpu_data_plane.md, How it is built).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    const SHIFTED_EXP: u32 = 0x7c00 << 13; // fp16's exponent field, moved to fp32's position
    let magic = f32::from_bits(113 << 23);
    let h = u32::from(h);
    let mut o = (h & 0x7fff) << 13;
    let exp = o & SHIFTED_EXP;
    o += (127 - 15) << 23; // rebias the exponent
    let inf_nan = o + ((128 - 16) << 23);
    let subnormal = (f32::from_bits(o + (1 << 23)) - magic).to_bits();
    let o = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        o
    };
    f32::from_bits(o | ((h & 0x8000) << 16))
}

impl KvElem for f16 {
    const NAME: &'static str = "float16";
    #[inline(always)]
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32] {
        let out = &mut scratch[..src.len()];
        for (o, x) in out.iter_mut().zip(src) {
            *o = f16_bits_to_f32(x.to_bits());
        }
        out
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl KvElem for bf16 {
    const NAME: &'static str = "bfloat16";
    #[inline(always)]
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32] {
        let out = &mut scratch[..src.len()];
        for (o, x) in out.iter_mut().zip(src) {
            *o = f32::from_bits(u32::from(x.to_bits()) << 16); // exact: bf16 is fp32's top half
        }
        out
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: even mantissa (1.0) wins.
        let mut out = [bf16::ZERO; 3];
        bf16::narrow(&[1.0 + 1.0 / 256.0, f32::NAN, -2.5], &mut out);
        assert_eq!(out[0].to_bits(), 0x3F80);
        assert!(out[1].is_nan());
        assert_eq!(out[2].to_f32(), -2.5);
        let mut scratch = [0.0f32; 3];
        let wide = bf16::widen(&out, &mut scratch);
        assert_eq!(wide[0], 1.0);
    }

    #[test]
    fn f16_widening_is_exact_on_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let (got, want) = (f16_bits_to_f32(bits), f16::from_bits(bits).to_f32());
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn f16_round_trip_is_exact_on_representable_values() {
        let vals = [0.5f32, -3.0, 65504.0, 1.0 / 1024.0];
        let mut narrow = [f16::ZERO; 4];
        f16::narrow(&vals, &mut narrow);
        let mut scratch = [0.0f32; 4];
        assert_eq!(f16::widen(&narrow, &mut scratch), &vals);
    }
}
