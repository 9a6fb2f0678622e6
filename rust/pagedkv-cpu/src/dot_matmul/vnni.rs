//! The `int8` projections' register tile on AVX-512 VNNI (`vpdpbusd`: 64 unsigned-by-signed byte
//! products summed into 16 int32 lanes per instruction): for up to [`DOT_TILE`] rows, one 64-byte
//! group of a panel's codes is loaded (and for the 4-bit formats split into its two nibble
//! groups) and multiplied with each row's four activation codes broadcast to every lane. After
//! each block the integer sums become fp32 with exactly the portable tile's operations, in the
//! same order (`dot_matmul` module docs), so the two paths agree bit for bit.
//!
//! The `unsafe` here: the unaligned vector loads and stores (each from a fixed-size array
//! reference, so in bounds by type) and the call into the `#[target_feature]` function, made only
//! after the CPU reported the features at run time.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m512, __m512i, _mm512_and_si512, _mm512_cvtepi32_ps, _mm512_dpbusd_epi32, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_epi8,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_srli_epi16, _mm512_storeu_ps,
    _mm512_sub_epi32,
};
use std::sync::OnceLock;

use super::operands::{DotPanel, QuantRows, DOT_TILE, GROUP_BYTES};
use crate::block_matmul::{CodeFormat, PANEL_COLS};

/// Whether this CPU runs the tile (AVX-512 F, BW and VNNI), checked once.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

/// Panel `w` times rows `row0..` of `q` into `out` (`[rows, 16]`, `rows <= DOT_TILE`). Only
/// called when [`available`] said yes.
pub(crate) fn tile(q: &QuantRows, row0: usize, w: DotPanel<'_>, out: &mut [f32]) {
    assert!(
        available(),
        "the VNNI tile runs only where the CPU has AVX-512 VNNI"
    );
    let rows = out.len() / PANEL_COLS;
    // SAFETY: `available()` established that the CPU supports every feature the function enables.
    unsafe {
        match (rows, w.format) {
            (8, CodeFormat::I8) => tile_rows::<8, false>(q, row0, w, out),
            (8, _) => tile_rows::<8, true>(q, row0, w, out),
            (7, CodeFormat::I8) => tile_rows::<7, false>(q, row0, w, out),
            (7, _) => tile_rows::<7, true>(q, row0, w, out),
            (6, CodeFormat::I8) => tile_rows::<6, false>(q, row0, w, out),
            (6, _) => tile_rows::<6, true>(q, row0, w, out),
            (5, CodeFormat::I8) => tile_rows::<5, false>(q, row0, w, out),
            (5, _) => tile_rows::<5, true>(q, row0, w, out),
            (4, CodeFormat::I8) => tile_rows::<4, false>(q, row0, w, out),
            (4, _) => tile_rows::<4, true>(q, row0, w, out),
            (3, CodeFormat::I8) => tile_rows::<3, false>(q, row0, w, out),
            (3, _) => tile_rows::<3, true>(q, row0, w, out),
            (2, CodeFormat::I8) => tile_rows::<2, false>(q, row0, w, out),
            (2, _) => tile_rows::<2, true>(q, row0, w, out),
            (_, CodeFormat::I8) => tile_rows::<1, false>(q, row0, w, out),
            (_, _) => tile_rows::<1, true>(q, row0, w, out),
        }
    }
    const _: () = assert!(DOT_TILE == 8, "the match above covers 1..=8 rows");
}

#[inline(always)]
fn load_codes(bytes: &[u8]) -> __m512i {
    let bytes: &[u8; GROUP_BYTES] = bytes.try_into().expect("a group of 64 code bytes");
    // SAFETY: an unaligned load of exactly the 64 bytes the array reference covers.
    unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
}

#[inline(always)]
fn load_f32(values: &[f32]) -> __m512 {
    let values: &[f32; PANEL_COLS] = values.try_into().expect("16 fp32 values");
    // SAFETY: an unaligned load of exactly the 16 floats the array reference covers.
    unsafe { _mm512_loadu_ps(values.as_ptr()) }
}

/// `R` rows; `NIBBLES`: 4-bit codes, two groups per 64 bytes (module docs of `dot_matmul`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn tile_rows<const R: usize, const NIBBLES: bool>(
    q: &QuantRows,
    row0: usize,
    w: DotPanel<'_>,
    out: &mut [f32],
) {
    let (k, nb) = (q.k, q.nb);
    let words: [&[i32]; R] =
        std::array::from_fn(|r| &q.words[(row0 + r) * k / 4..(row0 + r + 1) * k / 4]);
    let groups_per_block = w.block / 4;
    let low = _mm512_set1_epi8(15);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let mut isum = [_mm512_setzero_si512(); R];
        let g0 = b * groups_per_block;
        if NIBBLES {
            let pairs = &w.codes[g0 / 2 * GROUP_BYTES..(g0 + groups_per_block) / 2 * GROUP_BYTES];
            for (h, pair) in pairs.chunks_exact(GROUP_BYTES).enumerate() {
                let v = load_codes(pair);
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                let g = g0 + 2 * h;
                for r in 0..R {
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(words[r][g]));
                    isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(words[r][g + 1]));
                }
            }
        } else {
            let groups = &w.codes[g0 * GROUP_BYTES..(g0 + groups_per_block) * GROUP_BYTES];
            for (i, group) in groups.chunks_exact(GROUP_BYTES).enumerate() {
                let v = load_codes(group);
                for r in 0..R {
                    isum[r] = _mm512_dpbusd_epi32(isum[r], v, _mm512_set1_epi32(words[r][g0 + i]));
                }
            }
        }
        let s = load_f32(&w.scales[b * PANEL_COLS..(b + 1) * PANEL_COLS]);
        let o = load_f32(&w.offsets[b * PANEL_COLS..(b + 1) * PANEL_COLS]);
        for r in 0..R {
            let at = (row0 + r) * nb + b;
            let sums = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(q.bias_sum[at]));
            let step = _mm512_mul_ps(s, _mm512_set1_ps(q.dx[at]));
            acc[r] = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(sums), acc[r]);
            acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(q.xsum[at]), acc[r]);
        }
    }
    for (r, dst) in out.chunks_exact_mut(PANEL_COLS).take(R).enumerate() {
        let dst: &mut [f32; PANEL_COLS] = dst.try_into().expect("16 outputs");
        // SAFETY: an unaligned store of exactly the 16 floats the array reference covers.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), acc[r]) }
    }
}
