//! What every tile of the `int8` projections reads (module docs of `dot_matmul`): one panel's
//! codes, scales and offsets, and a chunk of rows' activations quantized per block. A leaf:
//! the portable, AVX2 and VNNI tiles import these, and `dot_matmul` dispatches to the tiles, so
//! no tile imports the dispatcher back.

use crate::block_matmul::CodeFormat;

/// Bytes of one group of codes: 16 columns x 4 inputs (one 512-bit register).
pub const GROUP_BYTES: usize = 64;
/// Rows per register tile: 8 integer and 8 fp32 accumulators of 16 lanes.
pub const DOT_TILE: usize = 8;
/// The activation codes' range is -ACT_MAX..=ACT_MAX (symmetric, as llama.cpp's Q8_0).
const ACT_MAX: f32 = 127.0;

/// One panel's borrowed codes, scales and offsets (dot layout).
#[derive(Clone, Copy)]
pub(crate) struct DotPanel<'a> {
    pub(crate) codes: &'a [u8],
    pub(crate) scales: &'a [f32],
    pub(crate) offsets: &'a [f32],
    pub(crate) block: usize,
    pub(crate) format: CodeFormat,
}

/// A chunk of rows' activations quantized per block (`dot_matmul` docs).
pub(crate) struct QuantRows {
    /// `[t, k / 4]`: the codes of inputs `4g..4g + 4` of a row as one little-endian word (what
    /// `vpdpbusd` broadcasts).
    pub(crate) words: Vec<i32>,
    /// `[t, nb]`: the activation step of each block.
    pub(crate) dx: Vec<f32>,
    /// `[t, nb]`: the sum of each block's quantized activations, `dx * sum(a)`.
    pub(crate) xsum: Vec<f32>,
    /// `[t, nb]`: `bias * sum(a)` over the block (what the biased codes add).
    pub(crate) bias_sum: Vec<i32>,
    pub(crate) k: usize,
    pub(crate) nb: usize,
}

impl QuantRows {
    /// `x [t, k]`'s rows in blocks of `block` (which divides `k` and is a multiple of 4). A block
    /// of zeros has step 0 and codes 0; a NaN or an infinity makes the block's step NaN, so every
    /// output of that row is NaN.
    pub(crate) fn new(x: &[f32], t: usize, k: usize, block: usize, bias: i32) -> Self {
        let nb = k / block;
        let mut q = QuantRows {
            words: vec![0; t * k / 4],
            dx: vec![0.0; t * nb],
            xsum: vec![0.0; t * nb],
            bias_sum: vec![0; t * nb],
            k,
            nb,
        };
        for (r, row) in x.chunks_exact(k).enumerate() {
            for (b, xb) in row.chunks_exact(block).enumerate() {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let inv = if amax > 0.0 && amax.is_finite() {
                    ACT_MAX / amax
                } else {
                    0.0
                };
                let mut code_sum = 0i32;
                let words = &mut q.words[(r * k + b * block) / 4..(r * k + (b + 1) * block) / 4];
                for (word, x4) in words.iter_mut().zip(xb.chunks_exact(4)) {
                    let mut bytes = [0u8; 4];
                    for (byte, &v) in bytes.iter_mut().zip(x4) {
                        // `as` saturates and maps NaN to 0; the clamp keeps -128 out.
                        let a = ((v * inv).round() as i32).clamp(-127, 127);
                        code_sum += a;
                        *byte = a as i8 as u8;
                    }
                    *word = i32::from_le_bytes(bytes);
                }
                // A NaN or an infinity has no code: the block's step becomes NaN, and with it
                // every output of the row (`max` would have skipped a NaN).
                let dx = if xb.iter().all(|v| v.is_finite()) {
                    amax / ACT_MAX
                } else {
                    f32::NAN
                };
                q.dx[r * nb + b] = dx;
                q.xsum[r * nb + b] = dx * code_sum as f32;
                q.bias_sum[r * nb + b] = bias * code_sum;
            }
        }
        q
    }
}
