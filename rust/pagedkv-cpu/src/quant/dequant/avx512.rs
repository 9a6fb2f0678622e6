//! Row dequantization on AVX-512 F, the same bits as the plain loops (`portable`): 16 elements
//! per register, the arithmetic of `avx2` (codes widened to 32-bit lanes; e4m3 bits rebuilt,
//! subnormals and NaN chosen by masks; int4 nibbles re-packed in channel order, then `chat + odd
//! * half` as a multiply and an add).
//!
//! The `unsafe` here: loads and stores on fixed-size array references (in bounds by type) and
//! the call into the `#[target_feature]` functions, which only an [`Avx512`] value can make, and
//! one exists only where the CPU reported AVX-512 F at run time.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m512, __m512i, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512,
    _mm512_castps_si512, _mm512_castsi512_ps, _mm512_cmpeq_epi32_mask, _mm512_cmplt_epi32_mask,
    _mm512_cvtepi32_ps, _mm512_cvtepi8_epi32, _mm512_cvtepu8_epi32, _mm512_loadu_ps,
    _mm512_mask_blend_ps, _mm512_mul_ps, _mm512_or_si512, _mm512_set1_epi32, _mm512_set1_ps,
    _mm512_slli_epi32, _mm512_srli_epi32, _mm512_storeu_ps, _mm512_sub_epi32, _mm_and_si128,
    _mm_cvtepu8_epi16, _mm_loadl_epi64, _mm_loadu_si128, _mm_or_si128, _mm_set1_epi16,
    _mm_slli_epi16, _mm_srli_epi16,
};
use std::sync::OnceLock;

use super::portable;

/// Proof that this CPU has AVX-512 F: the only way to reach the intrinsic code.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// `Some` where the CPU runs AVX-512 F (checked once per process).
    pub(crate) fn detect() -> Option<Self> {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        let yes = *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"));
        yes.then_some(Avx512(()))
    }

    #[inline(always)]
    pub(crate) fn row_8bit(self, codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
        // SAFETY: `self` exists only where `detect` saw AVX-512 F.
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
        // SAFETY: `self` exists only where `detect` saw AVX-512 F.
        unsafe { row_int4_channels(codes, chat, half, out) }
    }

    #[inline(always)]
    pub(crate) fn row_int4_uniform(self, codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
        // SAFETY: `self` exists only where `detect` saw AVX-512 F.
        unsafe { row_int4_uniform(codes, chat, half, out) }
    }
}

#[inline(always)]
fn load8(x: &[u8]) -> __m128i {
    let x: &[u8; 8] = x.try_into().expect("8 bytes");
    // SAFETY: a 64-bit unaligned load of exactly the 8 bytes the array reference covers.
    unsafe { _mm_loadl_epi64(x.as_ptr().cast()) }
}

#[inline(always)]
fn load16(x: &[u8]) -> __m128i {
    let x: &[u8; 16] = x.try_into().expect("16 bytes");
    // SAFETY: an unaligned load of exactly the 16 bytes the array reference covers.
    unsafe { _mm_loadu_si128(x.as_ptr().cast()) }
}

#[inline(always)]
fn load(x: &[f32]) -> __m512 {
    let x: &[f32; 16] = x.try_into().expect("16 fp32 values");
    // SAFETY: an unaligned load of exactly the 16 floats the array reference covers.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

#[inline(always)]
fn store(x: &mut [f32], value: __m512) {
    let x: &mut [f32; 16] = x.try_into().expect("16 fp32 values");
    // SAFETY: an unaligned store of exactly the 16 floats the array reference covers.
    unsafe { _mm512_storeu_ps(x.as_mut_ptr(), value) }
}

/// 16 e4m3 codes (zero-extended to 32 bits) as fp32 values (`codec::e4m3_to_f32`).
#[target_feature(enable = "avx512f")]
fn e4m3(c: __m512i) -> __m512 {
    let a = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(c, _mm512_set1_epi32(0x80)));
    let exponent = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_srli_epi32::<3>(a),
        _mm512_set1_epi32(120),
    ));
    let mantissa = _mm512_slli_epi32::<20>(_mm512_and_si512(a, _mm512_set1_epi32(7)));
    let normal = _mm512_castsi512_ps(_mm512_or_si512(exponent, mantissa));
    let subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(0.001_953_125));
    let v = _mm512_mask_blend_ps(
        _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(8)),
        normal,
        subnormal,
    );
    let v = _mm512_mask_blend_ps(
        _mm512_cmpeq_epi32_mask(a, _mm512_set1_epi32(0x7F)),
        v,
        _mm512_set1_ps(f32::NAN),
    );
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
}

#[target_feature(enable = "avx512f")]
fn row_8bit(codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
    let n = out.len().min(codes.len());
    let (codes, out) = (&codes[..n], &mut out[..n]);
    let s = _mm512_set1_ps(scale);
    let mut outs = out.chunks_exact_mut(16);
    let mut ins = codes.chunks_exact(16);
    for (o, c) in (&mut outs).zip(&mut ins) {
        let v = if fp8 {
            e4m3(_mm512_cvtepu8_epi32(load16(c)))
        } else {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(c)))
        };
        store(o, _mm512_mul_ps(v, s));
    }
    portable::row_8bit(ins.remainder(), scale, fp8, outs.into_remainder());
}

/// 8 bytes of int4 codes as `2q - 15` for 16 channels, exact in fp32.
#[target_feature(enable = "avx512f")]
fn odd16(c: &[u8]) -> __m512 {
    let x = _mm_cvtepu8_epi16(load8(c));
    let nibble = _mm_set1_epi16(0x0F);
    let lo = _mm_and_si128(x, nibble);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), nibble);
    let packed = _mm_or_si128(lo, _mm_slli_epi16::<8>(hi)); // bytes: q0 q1 .. q15
    let q = _mm512_cvtepu8_epi32(packed);
    _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_slli_epi32::<1>(q),
        _mm512_set1_epi32(15),
    ))
}

#[target_feature(enable = "avx512f")]
fn row_int4_channels(codes: &[u8], chat: &[f32], half: &[f32], out: &mut [f32]) {
    let n = out
        .len()
        .min(chat.len())
        .min(half.len())
        .min(2 * codes.len());
    let full = n / 16 * 16;
    for d in (0..full).step_by(16) {
        let odd = odd16(&codes[d / 2..d / 2 + 8]);
        let v = _mm512_add_ps(
            load(&chat[d..d + 16]),
            _mm512_mul_ps(odd, load(&half[d..d + 16])),
        );
        store(&mut out[d..d + 16], v);
    }
    portable::row_int4_channels(
        &codes[full / 2..],
        &chat[full..n],
        &half[full..n],
        &mut out[full..n],
    );
}

#[target_feature(enable = "avx512f")]
fn row_int4_uniform(codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
    let n = out.len().min(2 * codes.len());
    let full = n / 16 * 16;
    let (c, h) = (_mm512_set1_ps(chat), _mm512_set1_ps(half));
    for d in (0..full).step_by(16) {
        let odd = odd16(&codes[d / 2..d / 2 + 8]);
        store(&mut out[d..d + 16], _mm512_add_ps(c, _mm512_mul_ps(odd, h)));
    }
    portable::row_int4_uniform(&codes[full / 2..], chat, half, &mut out[full..n]);
}
