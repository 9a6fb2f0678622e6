//! Dequantization of one (token, head) row of a quantized block into fp32, with one arithmetic
//! (the codec's: `codec::dequantize_8bit`, `codec::int4_value`) and three implementations of
//! the same bits behind [`Dequant`], picked once per kernel call: plain Rust (`portable`) and
//! intrinsics on AVX2 (`avx2`) and AVX-512 (`avx512`). Attention dequantizes the rows it reads
//! into a per-task buffer and runs the unquantized inner loops on it (`attention::quant_source`),
//! so a quantized cache is attended exactly as an fp32 cache of the dequantized values.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod portable;

#[cfg(target_arch = "x86_64")]
use self::avx2::Avx2;
#[cfg(target_arch = "x86_64")]
use self::avx512::Avx512;

/// Which implementation dequantizes: the plain loops or an intrinsic path the CPU has, all with
/// the same bits.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Dequant {
    /// The plain loops, vectorised (where LLVM manages) by the caller's multiversioned build.
    Portable,
    #[cfg(target_arch = "x86_64")]
    /// `avx2`.
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    /// `avx512`.
    Avx512(Avx512),
}

impl Dequant {
    /// The fastest path this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(simd) = Avx512::detect() {
                return Dequant::Avx512(simd);
            }
            if let Some(simd) = Avx2::detect() {
                return Dequant::Avx2(simd);
            }
        }
        Dequant::Portable
    }

    /// Every path this CPU runs, slowest first (tests compare them).
    #[cfg(test)]
    pub fn available() -> Vec<Self> {
        let mut paths = vec![Dequant::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            paths.extend(Avx2::detect().map(Dequant::Avx2));
            paths.extend(Avx512::detect().map(Dequant::Avx512));
        }
        paths
    }

    /// `out[d] = value(codes[d]) * scale` for an int8 (`fp8` false) or e4m3 row, over
    /// `min(out.len(), codes.len())` elements.
    #[inline(always)]
    pub fn row_8bit(self, codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
        match self {
            Dequant::Portable => portable::row_8bit(codes, scale, fp8, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx2(simd) => simd.row_8bit(codes, scale, fp8, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx512(simd) => simd.row_8bit(codes, scale, fp8, out),
        }
    }

    /// An int4 key row: `out[d] = chat[d] + (2 q_d - 15) * half[d]`, codes two a byte (low
    /// nibble the even channel), over the shortest of the four lengths (codes counted twice).
    #[inline(always)]
    pub fn row_int4_channels(self, codes: &[u8], chat: &[f32], half: &[f32], out: &mut [f32]) {
        match self {
            Dequant::Portable => portable::row_int4_channels(codes, chat, half, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx2(simd) => simd.row_int4_channels(codes, chat, half, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx512(simd) => simd.row_int4_channels(codes, chat, half, out),
        }
    }

    /// An int4 value row: one group, `out[d] = chat + (2 q_d - 15) * half`.
    #[inline(always)]
    pub fn row_int4_uniform(self, codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
        match self {
            Dequant::Portable => portable::row_int4_uniform(codes, chat, half, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx2(simd) => simd.row_int4_uniform(codes, chat, half, out),
            #[cfg(target_arch = "x86_64")]
            Dequant::Avx512(simd) => simd.row_int4_uniform(codes, chat, half, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::codec::{dequantize_8bit, int4_value, ue5m3_to_f32};

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn every_8bit_path_gives_the_codec_bits_on_every_code_and_scale() {
        let codes: Vec<u8> = (0..=255u8).collect();
        for fp8 in [false, true] {
            for scale_byte in [0u8, 1, 2, 100, 127, 130, 200, 253, 254, 255] {
                let scale = ue5m3_to_f32(scale_byte);
                let want: Vec<f32> = codes
                    .iter()
                    .map(|&c| dequantize_8bit(c, scale, fp8))
                    .collect();
                for simd in Dequant::available() {
                    // Every length 0..=40 from every start, then the whole row.
                    for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 31, 33, 40, 256] {
                        for start in [0usize, 3, 200] {
                            let end = (start + n).min(256);
                            let mut got = vec![0.0f32; end - start];
                            simd.row_8bit(&codes[start..end], scale, fp8, &mut got);
                            assert!(
                                same(&got, &want[start..end]),
                                "{simd:?} fp8={fp8} scale={scale_byte} n={n} start={start}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_int4_path_gives_the_codec_bits_on_every_byte() {
        let codes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        let chats = [0.0f32, -1.5, 3.25e-3, 7.0e30, -0.0, 1e-40];
        let halves = [0.0f32, 0.125, 2.5e-4, 1e30, 9.1e-41];
        for simd in Dequant::available() {
            for n in [0usize, 2, 14, 16, 18, 32, 64, 66, 128, 512] {
                let c = &codes[..n / 2];
                let chat: Vec<f32> = (0..n)
                    .map(|d| chats[d % chats.len()] * (d as f32 + 1.0))
                    .collect();
                let half: Vec<f32> = (0..n).map(|d| halves[d % halves.len()]).collect();
                let want: Vec<f32> = (0..n)
                    .map(|d| int4_value(c[d / 2] >> (4 * (d & 1)), chat[d], half[d]))
                    .collect();
                let mut got = vec![0.0f32; n];
                simd.row_int4_channels(c, &chat, &half, &mut got);
                assert!(same(&got, &want), "{simd:?} channels n={n}");
                for (&ch, &h) in chats.iter().zip(&halves) {
                    let want: Vec<f32> = (0..n)
                        .map(|d| int4_value(c[d / 2] >> (4 * (d & 1)), ch, h))
                        .collect();
                    simd.row_int4_uniform(c, ch, h, &mut got);
                    assert!(
                        same(&got, &want),
                        "{simd:?} uniform n={n} chat={ch} half={h}"
                    );
                }
            }
        }
    }
}
