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

impl KvElem for f16 {
    const NAME: &'static str = "float16";
    #[inline]
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32] {
        let out = &mut scratch[..src.len()];
        src.convert_to_f32_slice(out);
        out
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl KvElem for bf16 {
    const NAME: &'static str = "bfloat16";
    #[inline]
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32] {
        let out = &mut scratch[..src.len()];
        src.convert_to_f32_slice(out);
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
    fn f16_round_trip_is_exact_on_representable_values() {
        let vals = [0.5f32, -3.0, 65504.0, 1.0 / 1024.0];
        let mut narrow = [f16::ZERO; 4];
        f16::narrow(&vals, &mut narrow);
        let mut scratch = [0.0f32; 4];
        assert_eq!(f16::widen(&narrow, &mut scratch), &vals);
    }
}
