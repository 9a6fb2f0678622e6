//! A branch-free fp32 `exp` that LLVM vectorises inside the attention kernel's multiversioned
//! clones, in place of one libm `expf` call per softmax score.
//!
//! Range reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, with `ln2` split in two so that `n * C1` is
//! exact (Cody-Waite); a degree-7 polynomial for `e^r` (Cephes' `expf` coefficients); the scale
//! `2^n` built from its exponent bits. Plain multiplies and adds (no `mul_add`): the same bits on
//! every target the kernel is compiled for.
//!
//! Error (checked by the tests below against f64 `exp` over the whole f32 line): at most
//! [`EXP_MAX_ULP`] units in the last place for `-86.5 <= x <= 88.72`; `0.0` below `-86.5` (the true
//! value is under `2.8e-38`, an absolute error a softmax never sees), `+inf` above `88.72`,
//! `exp(-inf) == 0`, NaN in gives NaN out.

/// The largest error of [`exp`] in its normal range, in units in the last place of the result.
pub const EXP_MAX_ULP: u32 = 2;

/// Inputs below this give `0.0` (`2^(n-1)` must stay a normal number).
pub const EXP_FLUSH_BELOW: f32 = -86.5;

/// Inputs above this give `+inf` (`ln(f32::MAX)` rounded down).
const EXP_OVERFLOW_ABOVE: f32 = 88.722_83;

/// `e^x`, vectorisable (no branches, no calls). See the module docs for its error.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2; C1 has 9 significant bits, so n * C1 is exact for |n| <= 2^15.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer (nearest even) held in the mantissa's low bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(EXP_FLUSH_BELOW, EXP_OVERFLOW_ABOVE);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which rounds to 0.5 in fp32
    let er = p * (r * r) + r + 1.0;
    // e^x = (2 e^r) * 2^(n-1): n reaches 128 just below the overflow bound, 2^(n-1) never
    // leaves the normal range on [EXP_FLUSH_BELOW, EXP_OVERFLOW_ABOVE].
    let scale = f32::from_bits(((n_int + 126) as u32) << 23);
    let y = (er * 2.0) * scale;
    let y = if x < EXP_FLUSH_BELOW { 0.0 } else { y };
    let y = if x > EXP_OVERFLOW_ABOVE {
        f32::INFINITY
    } else {
        y
    };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `x = exp(x - shift)` over a row (the softmax's probabilities from scores and their maximum).
#[inline(always)]
pub fn exp_shifted_in_place(row: &mut [f32], shift: f32) {
    for x in row.iter_mut() {
        *x = exp(*x - shift);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the correctly rounded `want`.
    fn ulp(got: f32, want: f64) -> u32 {
        let w = want as f32;
        (got.to_bits() as i64 - w.to_bits() as i64).unsigned_abs() as u32
    }

    fn check(x: f32) {
        let got = exp(x);
        let want = f64::from(x).exp();
        if x.is_nan() {
            assert!(got.is_nan(), "exp({x}) = {got}");
        } else if x < EXP_FLUSH_BELOW {
            assert_eq!(got, 0.0, "exp({x})");
            assert!(want < 2.8e-38, "exp({x}) flushed a value of {want}");
        } else if x > EXP_OVERFLOW_ABOVE {
            assert_eq!(got, f32::INFINITY, "exp({x})");
        } else {
            assert!(
                ulp(got, want) <= EXP_MAX_ULP,
                "exp({x}) = {got}, want {want}: {} ulp",
                ulp(got, want)
            );
        }
    }

    #[test]
    fn exp_is_within_its_stated_ulp_over_the_whole_f32_line() {
        // Every 997th bit pattern of all 2^32 (both signs, every exponent, the subnormals), about
        // 4.3 M values (a prime stride: every mantissa residue), plus the edges.
        for bits in (0..=u32::MAX).step_by(997) {
            check(f32::from_bits(bits));
        }
        let edges = [
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            EXP_FLUSH_BELOW,
            EXP_OVERFLOW_ABOVE,
            88.0,
            88.72,
            -87.0,
            -86.49,
            0.5 * std::f32::consts::LN_2,
            -0.5 * std::f32::consts::LN_2,
        ];
        for x in edges {
            check(x);
            check(f32::from_bits(x.to_bits().wrapping_add(1)));
            check(f32::from_bits(x.to_bits().wrapping_sub(1)));
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_is_within_its_stated_ulp_on_a_dense_softmax_range() {
        // One in 61 of the values of [-16, 0]: what exp(score - max) sees.
        let (lo, hi) = ((-16.0f32).to_bits(), (-0.0f32).to_bits());
        for bits in (hi..=lo).step_by(61) {
            check(f32::from_bits(bits));
        }
    }

    #[test]
    fn exp_shifted_in_place_maps_masked_scores_to_zero() {
        let mut row = [f32::NEG_INFINITY, 1.0, 3.0, f32::NEG_INFINITY];
        exp_shifted_in_place(&mut row, 3.0);
        assert_eq!(row[0], 0.0);
        assert_eq!(row[3], 0.0);
        assert_eq!(row[2], 1.0);
        check(-2.0);
        assert!(ulp(row[1], (-2.0f64).exp()) <= EXP_MAX_ULP);
    }
}
