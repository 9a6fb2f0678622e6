//! Row dequantization on AVX2, the same bits as the plain loops (`portable`): 8 elements per
//! register. int8: sign-extend 8 codes to 32 bits, convert, one multiply by the row's UE5M3 scale
//! (exact). e4m3: the code's bits rebuilt as fp32 bits for normals, `m * 2^-9` for subnormals,
//! NaN for 0x7F, the sign or-ed in, then the scale. int4: 8 bytes widened to 16-bit lanes, the
//! nibbles split and re-packed in channel order as 16 bytes, widened to 32 bits; `2q - 15` in
//! integers, then `chat + odd * half` as a multiply and an add (never fused: the product is exact
//! anyway, but the add must round once, as NumPy's does).
//!
//! The `unsafe` here: loads and stores on fixed-size array references (in bounds by type) and
//! the call into the `#[target_feature]` functions, which only an [`Avx2`] value can make, and
//! one exists only where the CPU reported AVX2 at run time.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_ps,
    _mm256_castsi256_ps, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32, _mm256_cvtepi32_ps,
    _mm256_cvtepi8_epi32, _mm256_cvtepu8_epi32, _mm256_loadu_ps, _mm256_mul_ps, _mm256_or_ps,
    _mm256_or_si256, _mm256_set1_epi32, _mm256_set1_ps, _mm256_slli_epi32, _mm256_srli_epi32,
    _mm256_storeu_ps, _mm256_sub_epi32, _mm_and_si128, _mm_cvtepu8_epi16, _mm_loadl_epi64,
    _mm_or_si128, _mm_set1_epi16, _mm_slli_epi16, _mm_srli_epi16, _mm_srli_si128,
};
use std::sync::OnceLock;

use super::portable;

/// Proof that this CPU has AVX2: the only way to reach the intrinsic code.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` where the CPU runs AVX2 (checked once per process).
    pub(crate) fn detect() -> Option<Self> {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        let yes = *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"));
        yes.then_some(Avx2(()))
    }

    #[inline(always)]
    pub(crate) fn row_8bit(self, codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
        // SAFETY: `self` exists only where `detect` saw AVX2.
        unsafe { row_8bit(codes, scale, fp8, out) }
    }

    #[inline(always)]
    pub(crate) fn row_int4_channels(
        self,
        codes: &[u8],
        chat: &[f32],
        half: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: `self` exists only where `detect` saw AVX2.
        unsafe { row_int4_channels(codes, chat, half, out) }
    }

    #[inline(always)]
    pub(crate) fn row_int4_uniform(self, codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
        // SAFETY: `self` exists only where `detect` saw AVX2.
        unsafe { row_int4_uniform(codes, chat, half, out) }
    }
}

/// 8 bytes into the low half of a register.
#[inline(always)]
fn load8(x: &[u8]) -> __m128i {
    let x: &[u8; 8] = x.try_into().expect("8 bytes");
    // SAFETY: a 64-bit unaligned load of exactly the 8 bytes the array reference covers.
    unsafe { _mm_loadl_epi64(x.as_ptr().cast()) }
}

#[inline(always)]
fn load(x: &[f32]) -> __m256 {
    let x: &[f32; 8] = x.try_into().expect("8 fp32 values");
    // SAFETY: an unaligned load of exactly the 8 floats the array reference covers.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[inline(always)]
fn store(x: &mut [f32], value: __m256) {
    let x: &mut [f32; 8] = x.try_into().expect("8 fp32 values");
    // SAFETY: an unaligned store of exactly the 8 floats the array reference covers.
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), value) }
}

/// 8 e4m3 codes (zero-extended to 32 bits) as fp32 values (`codec::e4m3_to_f32`).
#[target_feature(enable = "avx2")]
fn e4m3(c: __m256i) -> __m256 {
    let a = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(c, _mm256_set1_epi32(0x80)));
    let exponent = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_srli_epi32::<3>(a),
        _mm256_set1_epi32(120),
    ));
    let mantissa = _mm256_slli_epi32::<20>(_mm256_and_si256(a, _mm256_set1_epi32(7)));
    let normal = _mm256_castsi256_ps(_mm256_or_si256(exponent, mantissa));
    let subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(0.001_953_125));
    let is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), a));
    let is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32(0x7F)));
    let v = _mm256_blendv_ps(normal, subnormal, is_sub);
    let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), is_nan);
    _mm256_or_ps(v, _mm256_castsi256_ps(sign))
}

#[target_feature(enable = "avx2")]
fn row_8bit(codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
    let n = out.len().min(codes.len());
    let (codes, out) = (&codes[..n], &mut out[..n]);
    let s = _mm256_set1_ps(scale);
    let mut outs = out.chunks_exact_mut(8);
    let mut ins = codes.chunks_exact(8);
    for (o, c) in (&mut outs).zip(&mut ins) {
        let v = if fp8 {
            e4m3(_mm256_cvtepu8_epi32(load8(c)))
        } else {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(c)))
        };
        store(o, _mm256_mul_ps(v, s));
    }
    portable::row_8bit(ins.remainder(), scale, fp8, outs.into_remainder());
}

/// 8 bytes of int4 codes as two registers of `2q - 15` (channels 0-7, 8-15), exact in fp32.
#[target_feature(enable = "avx2")]
fn odd16(c: &[u8]) -> [__m256; 2] {
    let x = _mm_cvtepu8_epi16(load8(c));
    let nibble = _mm_set1_epi16(0x0F);
    let lo = _mm_and_si128(x, nibble);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), nibble);
    let packed = _mm_or_si128(lo, _mm_slli_epi16::<8>(hi)); // bytes: q0 q1 .. q15
    let odd = |q: __m256i| {
        _mm256_cvtepi32_ps(_mm256_sub_epi32(
            _mm256_slli_epi32::<1>(q),
            _mm256_set1_epi32(15),
        ))
    };
    [
        odd(_mm256_cvtepu8_epi32(packed)),
        odd(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(packed))),
    ]
}

#[target_feature(enable = "avx2")]
fn row_int4_channels(codes: &[u8], chat: &[f32], half: &[f32], out: &mut [f32]) {
    let n = out
        .len()
        .min(chat.len())
        .min(half.len())
        .min(2 * codes.len());
    let full = n / 16 * 16;
    for i in (0..full).step_by(16) {
        let odd = odd16(&codes[i / 2..i / 2 + 8]);
        for (j, o) in odd.into_iter().enumerate() {
            let d = i + 8 * j;
            let v = _mm256_add_ps(
                load(&chat[d..d + 8]),
                _mm256_mul_ps(o, load(&half[d..d + 8])),
            );
            store(&mut out[d..d + 8], v);
        }
    }
    portable::row_int4_channels(
        &codes[full / 2..],
        &chat[full..n],
        &half[full..n],
        &mut out[full..n],
    );
}

#[target_feature(enable = "avx2")]
fn row_int4_uniform(codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
    let n = out.len().min(2 * codes.len());
    let full = n / 16 * 16;
    let (c, h) = (_mm256_set1_ps(chat), _mm256_set1_ps(half));
    for i in (0..full).step_by(16) {
        let odd = odd16(&codes[i / 2..i / 2 + 8]);
        for (j, o) in odd.into_iter().enumerate() {
            let d = i + 8 * j;
            store(&mut out[d..d + 8], _mm256_add_ps(c, _mm256_mul_ps(o, h)));
        }
    }
    portable::row_int4_uniform(&codes[full / 2..], chat, half, &mut out[full..n]);
}
