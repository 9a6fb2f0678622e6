//! The portable `int8` tile (any CPU): the module's sums (`dot_matmul` docs) in plain integer
//! and fp32 arithmetic, the reference the AVX2 and VNNI tiles match bit for bit.

use super::operands::{DotPanel, QuantRows, GROUP_BYTES};
use crate::block_matmul::{CodeFormat, PANEL_COLS};

/// The 16 columns x 4 inputs of group `g` of a panel as unsigned codes, byte `4c + j` (for the
/// 4-bit formats, the low or the high nibbles of the pair's 64 bytes).
#[inline(always)]
fn group_codes(w: &DotPanel<'_>, g: usize) -> [u8; GROUP_BYTES] {
    let mut out = [0u8; GROUP_BYTES];
    match w.format {
        CodeFormat::I8 => out.copy_from_slice(&w.codes[g * GROUP_BYTES..(g + 1) * GROUP_BYTES]),
        CodeFormat::U4 | CodeFormat::I4 => {
            let pair = &w.codes[(g / 2) * GROUP_BYTES..(g / 2 + 1) * GROUP_BYTES];
            let shift = 4 * (g % 2);
            for (o, &b) in out.iter_mut().zip(pair) {
                *o = (b >> shift) & 15;
            }
        }
    }
    out
}

/// The portable tile (any CPU): the module's sums in plain integer and fp32 arithmetic. `out` is
/// the tile's `[rows, 16]`, `rows <= DOT_TILE`.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
pub(super) fn portable_tile<'a>(q: &QuantRows, row0: usize, w: DotPanel<'a>, out: &mut [f32]) {
    let (k, nb) = (q.k, q.nb);
    let groups_per_block = w.block / 4;
    for (r, out_row) in out.chunks_exact_mut(PANEL_COLS).enumerate() {
        let row = row0 + r;
        let words = &q.words[row * k / 4..(row + 1) * k / 4];
        let mut acc = [0.0f32; PANEL_COLS];
        for b in 0..nb {
            let mut isum = [0i32; PANEL_COLS];
            let first = b * groups_per_block;
            for (g, word) in (first..).zip(&words[first..first + groups_per_block]) {
                let codes = group_codes(&w, g);
                let a = word.to_le_bytes().map(|v| i32::from(v as i8));
                for (c, s) in isum.iter_mut().enumerate() {
                    for (j, &aj) in a.iter().enumerate() {
                        *s += i32::from(codes[4 * c + j]) * aj;
                    }
                }
            }
            let (dx, xsum, bias_sum) = (
                q.dx[row * nb + b],
                q.xsum[row * nb + b],
                q.bias_sum[row * nb + b],
            );
            let s = &w.scales[b * PANEL_COLS..(b + 1) * PANEL_COLS];
            let o = &w.offsets[b * PANEL_COLS..(b + 1) * PANEL_COLS];
            for c in 0..PANEL_COLS {
                let step = s[c] * dx;
                acc[c] = step.mul_add((isum[c] - bias_sum) as f32, acc[c]);
                acc[c] = o[c].mul_add(xsum, acc[c]);
            }
        }
        out_row.copy_from_slice(&acc);
    }
}
