//! Dequantization of one (token, head) row in plain Rust, element by element with the codec's
//! own functions: the arithmetic every intrinsic path matches bit for bit, and the portable path
//! itself (vectorised, where LLVM manages, by the caller's multiversioned build). A leaf: the
//! intrinsic paths take nothing from the dispatcher.

use crate::quant::codec::{dequantize_8bit, int4_value};

/// `out[d] = value(codes[d]) * scale` (int8 or e4m3 codes).
#[inline(always)]
pub fn row_8bit(codes: &[u8], scale: f32, fp8: bool, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = dequantize_8bit(c, scale, fp8);
    }
}

/// int4 keys: `out[d] = chat[d] + (2 q_d - 15) * half[d]`, codes two a byte (low nibble first).
#[inline(always)]
pub fn row_int4_channels(codes: &[u8], chat: &[f32], half: &[f32], out: &mut [f32]) {
    let n = out
        .len()
        .min(chat.len())
        .min(half.len())
        .min(2 * codes.len());
    for d in 0..n {
        let q = codes[d / 2] >> (4 * (d & 1));
        out[d] = int4_value(q, chat[d], half[d]);
    }
}

/// int4 values: `out[d] = chat + (2 q_d - 15) * half`.
#[inline(always)]
pub fn row_int4_uniform(codes: &[u8], chat: f32, half: f32, out: &mut [f32]) {
    let n = out.len().min(2 * codes.len());
    for d in 0..n {
        let q = codes[d / 2] >> (4 * (d & 1));
        out[d] = int4_value(q, chat, half);
    }
}
