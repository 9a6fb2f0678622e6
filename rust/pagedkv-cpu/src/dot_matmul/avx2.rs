//! The `int8` projections' register tile on AVX2 (CPUs without AVX-512 VNNI): a 64-byte group of
//! a panel's codes is two 256-bit halves (columns 0-7 and 8-15); `vpmaddubsw` multiplies the
//! unsigned codes with a row's four signed activation codes broadcast to every lane and adds
//! adjacent pairs into int16, `vpmaddwd` with ones adds the pairs into one int32 per column.
//!
//! No int16 sum may saturate: the 4-bit formats' codes are at most 15 (`2 * 15 * 127` fits), and
//! the int8 format's biased codes (up to 255) would not fit, so that format multiplies `|code|`
//! with the activations given the code's sign (`vpsignb`, at most `2 * 128 * 127 = 32512`) and
//! sums the products without the bias. After each block the sums become fp32 with exactly the
//! portable tile's operations in the same order (`dot_matmul` module docs): the paths agree bit
//! for bit.
//!
//! `unsafe` as in `vnni`: vector loads and stores from fixed-size array references, and the
//! call into the `#[target_feature]` function after the run-time feature check.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_cvtepi32_ps, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_mul_ps,
    _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_epi8, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_setzero_si256, _mm256_sign_epi8, _mm256_srli_epi16, _mm256_storeu_ps, _mm256_sub_epi32,
    _mm256_xor_si256,
};
use std::sync::OnceLock;

use super::operands::{DotPanel, QuantRows, GROUP_BYTES};
use crate::block_matmul::{CodeFormat, PANEL_COLS};

/// Rows per AVX2 tile: 8 integer accumulators of 8 lanes (two per row), the fp32 ones beside.
const ROWS: usize = 4;
const HALF: usize = PANEL_COLS / 2;

/// Whether this CPU runs the tile (AVX2 and FMA), checked once.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    })
}

/// Panel `w` times rows `row0..` of `q` into `out` (`[rows, 16]`), in tiles of [`ROWS`] rows.
/// Only called when [`available`] said yes.
pub(crate) fn tile(q: &QuantRows, row0: usize, w: DotPanel<'_>, out: &mut [f32]) {
    assert!(
        available(),
        "the AVX2 tile runs only where the CPU has AVX2 and FMA"
    );
    for (i, rows_out) in out.chunks_mut(ROWS * PANEL_COLS).enumerate() {
        let first = row0 + i * ROWS;
        // SAFETY: `available()` established that the CPU supports every feature the function
        // enables.
        unsafe {
            match (rows_out.len() / PANEL_COLS, w.format) {
                (4, CodeFormat::I8) => rows::<4, false>(q, first, w, rows_out),
                (4, _) => rows::<4, true>(q, first, w, rows_out),
                (3, CodeFormat::I8) => rows::<3, false>(q, first, w, rows_out),
                (3, _) => rows::<3, true>(q, first, w, rows_out),
                (2, CodeFormat::I8) => rows::<2, false>(q, first, w, rows_out),
                (2, _) => rows::<2, true>(q, first, w, rows_out),
                (_, CodeFormat::I8) => rows::<1, false>(q, first, w, rows_out),
                (_, _) => rows::<1, true>(q, first, w, rows_out),
            }
        }
    }
}

#[inline(always)]
fn load_halves(bytes: &[u8]) -> [__m256i; 2] {
    let bytes: &[u8; GROUP_BYTES] = bytes.try_into().expect("a group of 64 code bytes");
    let (lo, hi) = bytes.split_at(GROUP_BYTES / 2);
    // SAFETY: unaligned loads of exactly the two 32-byte halves of the array reference.
    unsafe {
        [
            _mm256_loadu_si256(lo.as_ptr().cast()),
            _mm256_loadu_si256(hi.as_ptr().cast()),
        ]
    }
}

#[inline(always)]
fn load_f32(values: &[f32]) -> __m256 {
    let values: &[f32; HALF] = values.try_into().expect("8 fp32 values");
    // SAFETY: an unaligned load of exactly the 8 floats the array reference covers.
    unsafe { _mm256_loadu_ps(values.as_ptr()) }
}

/// `R` rows; `NIBBLES`: the 4-bit formats (biased codes, products summed with the bias), else
/// the int8 format (signed codes, products summed without it).
#[target_feature(enable = "avx2,fma")]
fn rows<const R: usize, const NIBBLES: bool>(
    q: &QuantRows,
    row0: usize,
    w: DotPanel<'_>,
    out: &mut [f32],
) {
    let (k, nb) = (q.k, q.nb);
    let words: [&[i32]; R] =
        std::array::from_fn(|r| &q.words[(row0 + r) * k / 4..(row0 + r + 1) * k / 4]);
    let groups_per_block = w.block / 4;
    let low = _mm256_set1_epi8(15);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let mut isum = [[_mm256_setzero_si256(); 2]; R];
        let g0 = b * groups_per_block;
        if NIBBLES {
            let pairs = &w.codes[g0 / 2 * GROUP_BYTES..(g0 + groups_per_block) / 2 * GROUP_BYTES];
            for (h, pair) in pairs.chunks_exact(GROUP_BYTES).enumerate() {
                let v = load_halves(pair);
                let g = g0 + 2 * h;
                for half in 0..2 {
                    let lo = _mm256_and_si256(v[half], low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v[half]), low);
                    for r in 0..R {
                        let a_lo = _mm256_set1_epi32(words[r][g]);
                        let a_hi = _mm256_set1_epi32(words[r][g + 1]);
                        let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a_lo), ones);
                        let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a_hi), ones);
                        isum[r][half] =
                            _mm256_add_epi32(isum[r][half], _mm256_add_epi32(p_lo, p_hi));
                    }
                }
            }
        } else {
            let groups = &w.codes[g0 * GROUP_BYTES..(g0 + groups_per_block) * GROUP_BYTES];
            for (i, group) in groups.chunks_exact(GROUP_BYTES).enumerate() {
                let v = load_halves(group);
                for half in 0..2 {
                    let code = _mm256_xor_si256(v[half], flip); // the signed code
                    let magnitude = _mm256_sign_epi8(code, code);
                    for r in 0..R {
                        let a = _mm256_sign_epi8(_mm256_set1_epi32(words[r][g0 + i]), code);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones);
                        isum[r][half] = _mm256_add_epi32(isum[r][half], p);
                    }
                }
            }
        }
        for half in 0..2 {
            let cols = b * PANEL_COLS + half * HALF..b * PANEL_COLS + (half + 1) * HALF;
            let s = load_f32(&w.scales[cols.clone()]);
            let o = load_f32(&w.offsets[cols]);
            for r in 0..R {
                let at = (row0 + r) * nb + b;
                let sums = if NIBBLES {
                    _mm256_sub_epi32(isum[r][half], _mm256_set1_epi32(q.bias_sum[at]))
                } else {
                    isum[r][half]
                };
                let step = _mm256_mul_ps(s, _mm256_set1_ps(q.dx[at]));
                acc[r][half] = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(sums), acc[r][half]);
                acc[r][half] = _mm256_fmadd_ps(o, _mm256_set1_ps(q.xsum[at]), acc[r][half]);
            }
        }
    }
    for (r, dst) in out.chunks_exact_mut(PANEL_COLS).take(R).enumerate() {
        for (half, part) in dst.chunks_exact_mut(HALF).enumerate() {
            let part: &mut [f32; HALF] = part.try_into().expect("8 outputs");
            // SAFETY: an unaligned store of exactly the 8 floats the array reference covers.
            unsafe { _mm256_storeu_ps(part.as_mut_ptr(), acc[r][half]) }
        }
    }
}
