//! The formats' arithmetic, element by element: the definition in
//! `python/pagedkv/attention/quant_codec.py` and `small_floats.py`, reproduced bit for bit (the
//! same float32 operations in the same order; every product a compiler could fuse is exact by
//! construction, and Rust never fuses on its own). The SIMD dequantization (`quant::dequant`)
//! is checked against these functions on every byte value.

/// Largest int8 code magnitude (-128 is never produced).
pub const INT8_MAX: f32 = 127.0;
/// 1.5 * 2^23: an integral float32 q with |q| < 2^22 plus this is exact, with q in the low
/// mantissa bits (two's complement).
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The UE5M3 scale byte of NaN (a row that held a NaN or an infinity).
pub const UE5M3_NAN: u8 = 0xFF;
/// The largest finite UE5M3 byte: 1.75 * 2^9.
pub const UE5M3_LARGEST: u8 = 0xFE;
/// UE5M3 mantissa bits; a byte is `e << 3 | m`, `(1 + m / 8) * 2^(e - 22)`.
const UE5M3_MANTISSA_BITS: u32 = 3;
/// float32 bits of UE5M3 byte 0 (2^-22); byte b's bits are `(b << 20) + UE5M3_BASE`.
const UE5M3_BASE: u32 = (127 - 22) << 23;
/// bfloat16 quiet NaN: the side parameters of an int4 set that held a NaN or an infinity.
pub const BF16_NAN: u16 = 0x7FC0;

/// The int4 half-step ladder `L[k] = m[k % 4] / 2^(k / 4)`, m = 1, 7/8, 3/4, 5/8: 16 levels of
/// 3 significant bits (so `L[k] * H` is exact for a bfloat16 `H`).
pub const INT4_LEVELS: [f32; 16] = [
    1.0, 0.875, 0.75, 0.625, 0.5, 0.4375, 0.375, 0.3125, 0.25, 0.21875, 0.1875, 0.15625, 0.125,
    0.109375, 0.09375, 0.078125,
];

/// UE5M3 byte `b = e << 3 | m` as `(1 + m / 8) * 2^(e - 22)` (exact, no subnormals); 0xFF NaN.
#[inline(always)]
pub fn ue5m3_to_f32(b: u8) -> f32 {
    if b == UE5M3_NAN {
        f32::NAN
    } else {
        f32::from_bits((u32::from(b) << (23 - UE5M3_MANTISSA_BITS)) + UE5M3_BASE)
    }
}

/// The UE5M3 byte of the smallest scale `s` with `amax <= max_code * s`, clamped to the format's
/// range (2^-22 ..= 1.75 * 2^9: a larger row saturates); 0xFF for a NaN or infinite `amax`.
/// `amax / max_code` rounded up to the format is the candidate; float32 rounding of the quotient
/// can leave it one step short, which the exact check (`max_code * s` has at most 11
/// significant bits) catches.
/// `power_of_two`: only the bytes with mantissa 0 (2^-22 ..= 2^9), as e4m3 takes them.
#[inline]
pub fn ue5m3_scale_for(amax: f32, max_code: f32, power_of_two: bool) -> u8 {
    if !amax.is_finite() {
        return UE5M3_NAN;
    }
    let step: u32 = if power_of_two {
        1 << UE5M3_MANTISSA_BITS
    } else {
        1
    };
    let largest = u32::from(UE5M3_LARGEST) & !(step - 1);
    let t = (amax / max_code).to_bits();
    let shift = 23 - UE5M3_MANTISSA_BITS;
    let b = if t <= UE5M3_BASE {
        0
    } else {
        let rel = t - UE5M3_BASE;
        (rel >> shift) + u32::from(rel & ((1 << shift) - 1) != 0)
    };
    let b = (b.div_ceil(step) * step).min(largest);
    let b = if max_code * ue5m3_to_f32(b as u8) < amax && b < largest {
        b + step
    } else {
        b
    };
    b as u8
}

/// float32 -> e4m3 byte, as CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`: round
/// to nearest even; above 464 (infinities too) +-448; at or below 2^-10 zero; NaN NaN (0x7F with
/// the sign).
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7FFF_FFFF;
    let out: u32 = if a > 0x7F80_0000 {
        0x7F
    } else if a > 0x43E8_0000 {
        0x7E
    } else if a <= 0x3A80_0000 {
        0
    } else {
        let exponent = (a >> 23) as i32 - 127;
        let mantissa = a & 0x7F_FFFF;
        if exponent >= -6 {
            let kept = mantissa >> 20;
            let rest = mantissa & 0xF_FFFF;
            let up = u32::from(rest > 0x8_0000 || (rest == 0x8_0000 && kept & 1 == 1));
            ((((exponent + 7) as u32) << 3) | kept) + up
        } else {
            // Subnormal: units of 2^-9; exponent is -10..-7 here, so the shift is 21..24.
            let significand = mantissa | 0x80_0000;
            let shift = (14 - exponent) as u32;
            let m = significand >> shift;
            let frac = significand & ((1 << shift) - 1);
            let half = 1 << (shift - 1);
            m + u32::from(frac > half || (frac == half && m & 1 == 1))
        }
    };
    out as u8 | sign
}

/// e4m3 byte -> float32 (exact; 0x7F and 0xFF are NaN).
#[inline(always)]
pub fn e4m3_to_f32(c: u8) -> f32 {
    let a = u32::from(c & 0x7F);
    let v = if a == 0x7F {
        f32::NAN
    } else if a < 8 {
        a as f32 * 0.001_953_125 // subnormal: m * 2^-9, exact
    } else {
        f32::from_bits((((a >> 3) + 120) << 23) | ((a & 7) << 20))
    };
    if c & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// An int8 code's value.
#[inline(always)]
pub fn int8_to_f32(c: u8) -> f32 {
    f32::from(c as i8)
}

/// One 8-bit code's dequantized value: `code * scale`, exact.
#[inline(always)]
pub fn dequantize_8bit(code: u8, scale: f32, fp8: bool) -> f32 {
    let value = if fp8 {
        e4m3_to_f32(code)
    } else {
        int8_to_f32(code)
    };
    value * scale
}

/// Quantizes one (token, head) row of `head_dim` values into `codes` and returns its UE5M3 scale
/// byte: int8 codes `rint(x / s)` (half to even, clamped to +-127), e4m3 codes `x / s` rounded
/// to nearest even (`x / s` one correctly rounded float32 division); a row holding a NaN or an
/// infinity gets scale 0xFF and zero codes.
///
/// Branch-free loops, always inlined: a caller compiled for AVX2 / AVX-512 (`multiversion`, as
/// `quant::write` is) gets them vectorised, with the same IEEE operations per element in the
/// same order, so the same bits (the scalar definition is kept in the tests and compared on
/// hostile rows). Without SSE4.1 `round_ties_even` is a libm call per value, which dominated
/// the write's profile (benches/results/2026-12-06-quant-write-cost-v2.md).
#[inline(always)]
pub fn quantize_8bit_row(x: &[f32], codes: &mut [u8], fp8: bool) -> u8 {
    let codes = &mut codes[..x.len()];
    // max |x| on the bits: for non-negative floats the bit patterns order as the values do, and
    // every NaN or infinity is at or above the infinity's bits. So the row is finite iff the
    // maximum is below them, and then it is NumPy's `abs(x).max()` exactly (+0.0 for a row of
    // zeros, as the scalar loop's start).
    let mut amax_bits = 0u32;
    for &v in x {
        amax_bits = amax_bits.max(v.to_bits() & 0x7FFF_FFFF);
    }
    if amax_bits >= 0x7F80_0000 {
        codes.fill(0);
        return UE5M3_NAN;
    }
    let amax = f32::from_bits(amax_bits);
    // e4m3 takes power-of-two scales only: x / s is then exact (docs/quantized_kv.md, "8-bit").
    let scale = ue5m3_scale_for(amax, if fp8 { E4M3_MAX } else { INT8_MAX }, fp8);
    let divisor = ue5m3_to_f32(scale);
    if fp8 {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = f32_to_e4m3(v / divisor);
        }
    } else {
        for (c, &v) in codes.iter_mut().zip(x) {
            let q = (v / divisor).round_ties_even().clamp(-INT8_MAX, INT8_MAX);
            // q is integral in [-127, 127]: q + 1.5 * 2^23 is exact, and its low mantissa byte
            // is q's two's complement byte (a conversion that vectorises, unlike `as i8`'s
            // saturating one).
            *c = (q + ROUND_MAGIC).to_bits() as u8;
        }
    }
    scale
}

/// bfloat16 bits -> float32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// float32 -> bfloat16 bits rounded toward +infinity (`toward_positive`) or -infinity; NaN gives
/// the quiet NaN.
fn bf16_directed(x: f32, toward_positive: bool) -> u16 {
    let u = x.to_bits();
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        return BF16_NAN;
    }
    let high = u >> 16;
    let inexact = u & 0xFFFF != 0;
    let negative = u >> 31 != 0;
    if inexact && negative != toward_positive {
        (high + 1) as u16
    } else {
        high as u16
    }
}

/// NaN-propagating minimum and maximum (NumPy's `min` / `max` reductions).
#[inline(always)]
fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if b < a {
        b
    } else {
        a
    }
}

#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if b > a {
        b
    } else {
        a
    }
}

/// An int4 set's side parameters and group bytes, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4Side {
    /// Center grid start (rounded down), step (rounded up), half-step unit (rounded up):
    /// bfloat16 bits.
    pub bits: [u16; 3],
}

/// Quantizes one int4 *set* (`groups` groups of `n` values sharing side parameters; group `g`'s
/// value `i` is `x(g, i)`) into `code(g, i, q)` callbacks, group bytes `meta[g]` and the side
/// parameters (see `quant_codec.int4_encode`). A set holding a NaN or an infinity stores zero
/// codes and bytes and NaN side parameters.
#[inline(always)]
pub fn int4_encode_set(
    groups: usize,
    n: usize,
    x: impl Fn(usize, usize) -> f32,
    meta: &mut [u8],
    mut code: impl FnMut(usize, usize, u8),
    scratch: &mut Int4Scratch,
) -> Int4Side {
    let finite = (0..groups).all(|g| (0..n).all(|i| x(g, i).is_finite()));
    if !finite {
        for (g, m) in meta.iter_mut().enumerate().take(groups) {
            *m = 0;
            for i in 0..n {
                code(g, i, 0);
            }
        }
        return Int4Side {
            bits: [BF16_NAN; 3],
        };
    }
    let s = scratch;
    s.resize(groups);
    for g in 0..groups {
        let (mut mn, mut mx) = (x(g, 0), x(g, 0));
        for i in 1..n {
            // The set is finite here: nan_min / nan_max without their NaN checks.
            let v = x(g, i);
            mn = if v < mn { v } else { mn };
            mx = if v > mx { v } else { mx };
        }
        s.mn[g] = mn;
        s.mx[g] = mx;
        s.center[g] = mn * 0.5 + mx * 0.5;
    }
    let cmin = s.center.iter().copied().reduce(nan_min).unwrap_or(0.0);
    let cmax = s.center.iter().copied().reduce(nan_max).unwrap_or(0.0);
    let lo_bits = bf16_directed(cmin, false);
    let lo = bf16_to_f32(lo_bits);
    let cstep_bits = bf16_directed((cmax - lo) / 15.0, true);
    let cstep = bf16_to_f32(cstep_bits);
    let mut rmax = f32::NEG_INFINITY;
    for g in 0..groups {
        let j = if cstep > 0.0 {
            ((s.center[g] - lo) / cstep)
                .round_ties_even()
                .clamp(0.0, 15.0)
        } else {
            0.0
        };
        let chat = lo + j * cstep;
        s.j[g] = j;
        s.chat[g] = chat;
        s.need[g] = nan_max(s.mx[g] - chat, chat - s.mn[g]);
        rmax = if g == 0 {
            s.need[g]
        } else {
            nan_max(rmax, s.need[g])
        };
    }
    let mut unit_bits = bf16_directed(rmax / 15.0, true);
    for _ in 0..2 {
        // rmax / 15 was rounded: make sure 15 * H covers rmax.
        if 15.0 * bf16_to_f32(unit_bits) < rmax {
            unit_bits = unit_bits.wrapping_add(1);
        }
    }
    let unit = bf16_to_f32(unit_bits);
    for (g, m) in meta.iter_mut().enumerate().take(groups) {
        let need = s.need[g];
        // The smallest level that covers (the levels decrease with k); level 0 otherwise.
        let k = (0..16)
            .rev()
            .find(|&k| 15.0 * (INT4_LEVELS[k] * unit) >= need)
            .unwrap_or(0);
        let half = INT4_LEVELS[k] * unit;
        let chat = s.chat[g];
        for i in 0..n {
            let q = if half > 0.0 {
                let t = (x(g, i) - chat) / (half + half) + 7.5;
                // Integral in [0, 15]: the exact magic add puts it in the low byte (as the
                // 8-bit rows do; `as u8` would be a saturating scalar conversion).
                (t.round_ties_even().clamp(0.0, 15.0) + ROUND_MAGIC).to_bits() as u8
            } else {
                8
            };
            code(g, i, q);
        }
        *m = ((s.j[g] as u8) << 4) | k as u8;
    }
    Int4Side {
        bits: [lo_bits, cstep_bits, unit_bits],
    }
}

/// Per-group buffers of [`int4_encode_set`], reused across sets.
#[derive(Default)]
pub struct Int4Scratch {
    mn: Vec<f32>,
    mx: Vec<f32>,
    center: Vec<f32>,
    j: Vec<f32>,
    chat: Vec<f32>,
    need: Vec<f32>,
}

impl Int4Scratch {
    fn resize(&mut self, groups: usize) {
        for v in [
            &mut self.mn,
            &mut self.mx,
            &mut self.center,
            &mut self.j,
            &mut self.chat,
            &mut self.need,
        ] {
            v.clear();
            v.resize(groups, 0.0);
        }
    }
}

/// An int4 group's quantized center and half step from its group byte and the set's side
/// parameters (`chat = lo + j * cstep`, `h = L[k] * H`; both products exact).
#[inline(always)]
pub fn int4_group_params(meta: u8, side: [f32; 3]) -> (f32, f32) {
    let chat = side[0] + f32::from(meta >> 4) * side[1];
    (chat, INT4_LEVELS[usize::from(meta & 0xF)] * side[2])
}

/// One int4 code's value: `chat + (2q - 15) * h` (the product is exact).
#[inline(always)]
pub fn int4_value(q: u8, chat: f32, half: f32) -> f32 {
    chat + f32::from(2 * i16::from(q & 0xF) - 15) * half
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(c & 0x7F, 0x7F);
                continue;
            }
            let back = f32_to_e4m3(v);
            // +-0 both encode to their own sign's zero.
            assert_eq!(back, c, "code {c:#04x} value {v}");
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7F, 0x7F);
        assert_eq!(f32_to_e4m3(0.0009765625), 0); // 2^-10: half the smallest subnormal, even
    }

    #[test]
    fn ue5m3_scales_are_the_smallest_that_cover() {
        // Every byte decodes to (1 + m / 8) * 2^(e - 22), increasing; the encoder picks the
        // smallest byte that covers, checked against every byte by brute force.
        let values: Vec<f32> = (0..=UE5M3_LARGEST).map(ue5m3_to_f32).collect();
        assert_eq!(values[0], 2f32.powi(-22));
        assert_eq!(values[254], 1.75 * 512.0);
        assert!(values.windows(2).all(|w| w[0] < w[1]));
        let mut amaxes = vec![
            0.0f32, 1e-45, 1e-39, 1e-5, 1.0, 127.0, 127.5, 448.0, 449.0, 3.0e38,
        ];
        amaxes.extend((0..2000).map(|i| (1.0137f32).powi(i) * 1e-6));
        amaxes.extend(
            values
                .iter()
                .flat_map(|&v| [v * 127.0, v * 448.0, (v * 127.0).next_up()]),
        );
        for &amax in &amaxes {
            for m in [INT8_MAX, E4M3_MAX] {
                let b = ue5m3_scale_for(amax, m, false);
                let want = values.iter().position(|&v| amax <= m * v).unwrap_or(254);
                assert_eq!(usize::from(b), want, "{amax} {m}");
                let b = ue5m3_scale_for(amax, m, true);
                let want = (0..=248)
                    .step_by(8)
                    .find(|&i| amax <= m * values[i])
                    .unwrap_or(248);
                assert_eq!(usize::from(b), want, "{amax} {m} (powers of two)");
            }
        }
        assert_eq!(ue5m3_scale_for(f32::INFINITY, INT8_MAX, false), UE5M3_NAN);
        assert_eq!(ue5m3_scale_for(f32::NAN, E4M3_MAX, true), UE5M3_NAN);
        assert!(ue5m3_to_f32(UE5M3_NAN).is_nan());
    }

    #[test]
    fn int8_rows_round_half_to_even_within_half_a_scale() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let mut codes = vec![0u8; 64];
        let b = quantize_8bit_row(&x, &mut codes, false);
        let s = ue5m3_to_f32(b);
        for (&c, &v) in codes.iter().zip(&x) {
            assert!((dequantize_8bit(c, s, false) - v).abs() <= s / 2.0);
        }
        let mut nan = x.clone();
        nan[3] = f32::NAN;
        assert_eq!(quantize_8bit_row(&nan, &mut codes, false), UE5M3_NAN);
        assert!(codes.iter().all(|&c| c == 0));
    }

    /// The row quantizer as first written (a NaN-propagating maximum that stops at a NaN, a
    /// saturating `as i8`): the definition the branch-free, vectorised one must match.
    fn quantize_8bit_row_reference(x: &[f32], codes: &mut [u8], fp8: bool) -> u8 {
        let mut amax = 0.0f32;
        for &v in x {
            let a = v.abs();
            if a.is_nan() || a > amax {
                amax = a;
                if a.is_nan() {
                    break;
                }
            }
        }
        let scale = ue5m3_scale_for(amax, if fp8 { E4M3_MAX } else { INT8_MAX }, fp8);
        if scale == UE5M3_NAN {
            codes.fill(0);
            return scale;
        }
        let divisor = ue5m3_to_f32(scale);
        for (c, &v) in codes.iter_mut().zip(x) {
            let scaled = v / divisor;
            *c = if fp8 {
                f32_to_e4m3(scaled)
            } else {
                scaled.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8 as u8
            };
        }
        scale
    }

    /// `quantize_8bit_row` compiled as the writes compile it (AVX-512 / AVX2 where the CPU has
    /// them), row by row.
    #[multiversion::multiversion(targets(
        "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
        "x86_64+avx2+fma+f16c",
        "aarch64+neon"
    ))]
    fn quantize_rows_dispatched(rows: &[Vec<f32>], codes: &mut [Vec<u8>], fp8: bool) -> Vec<u8> {
        rows.iter()
            .zip(codes.iter_mut())
            .map(|(x, c)| quantize_8bit_row(x, c, fp8))
            .collect()
    }

    /// Hostile rows: NaN and infinities anywhere, zeros of both signs, subnormals (and a row of
    /// only subnormals, below the smallest scale), quotients that tie at .5, values at and past
    /// the clamp (a row past the largest scale saturates), lengths that leave vector tails.
    fn hostile_rows() -> Vec<Vec<f32>> {
        let mut rows = Vec::new();
        for len in [1usize, 7, 8, 9, 16, 31, 64, 65, 256] {
            let base: Vec<f32> = (0..len).map(|i| (i as f32 * 0.61).sin() * 3.0).collect();
            rows.push(base.clone());
            for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, len / 2, len - 1] {
                    let mut r = base.clone();
                    r[at] = bad;
                    rows.push(r);
                }
            }
            rows.push(vec![0.0; len]);
            rows.push(vec![-0.0; len]);
            rows.push(
                (0..len)
                    .map(|i| f32::from_bits(1 + i as u32 * 977))
                    .collect(),
            );
            rows.push(
                (0..len)
                    .map(|i| -f32::from_bits(0x7F_FFFF - i as u32))
                    .collect(),
            );
            // Scale 1 (amax 127): k + 0.5 ties, both signs, and +-127 / +-127.5 at the clamp.
            rows.push(
                (0..len)
                    .map(|i| match i % 4 {
                        0 => 127.0,
                        1 => -127.0,
                        2 => (i as f32 % 100.0) + 0.5,
                        _ => -((i as f32 % 100.0) + 0.5),
                    })
                    .collect(),
            );
            rows.push(
                (0..len)
                    .map(|i| if i % 2 == 0 { 1e30 } else { -3e38 })
                    .collect(),
            );
            rows.push((0..len).map(|i| 896.0 * 127.0 + i as f32).collect());
            rows.push((0..len).map(|i| (i as f32 - 3.0) * 1e-8).collect());
        }
        rows
    }

    #[test]
    fn vectorised_rows_match_the_scalar_definition_bit_for_bit() {
        let rows = hostile_rows();
        for fp8 in [false, true] {
            let mut got: Vec<Vec<u8>> = rows.iter().map(|r| vec![0xAA; r.len()]).collect();
            let scales = quantize_rows_dispatched(&rows, &mut got, fp8);
            for (i, x) in rows.iter().enumerate() {
                let mut want = vec![0x55; x.len()];
                let want_scale = quantize_8bit_row_reference(x, &mut want, fp8);
                assert_eq!(scales[i], want_scale, "row {i} fp8={fp8}: {x:?}");
                assert_eq!(got[i], want, "row {i} fp8={fp8}: {x:?}");
            }
        }
    }

    #[test]
    fn int4_sets_decode_within_their_half_step() {
        let (groups, n) = (8, 16);
        let x = |g: usize, i: usize| ((g * 31 + i * 7) as f32 * 0.13).cos() * (1.0 + g as f32);
        let mut meta = vec![0u8; groups];
        let mut codes = vec![0u8; groups * n];
        let side = int4_encode_set(
            groups,
            n,
            x,
            &mut meta,
            |g, i, q| codes[g * n + i] = q,
            &mut Int4Scratch::default(),
        );
        let side_f = side.bits.map(bf16_to_f32);
        for g in 0..groups {
            let (chat, half) = int4_group_params(meta[g], side_f);
            for i in 0..n {
                let err = (int4_value(codes[g * n + i], chat, half) - x(g, i)).abs();
                assert!(err <= half * 1.0001, "g={g} i={i} err={err} half={half}");
            }
        }
    }
}
