//! The elementwise fp32 work of a transformer layer, fused: RMS norm (alone, or after the residual
//! add that precedes it), the SiLU-gated product of the MLP, and the interleaved rotary embedding.
//!
//! Why: with the projections in Rust, what is left of a decode step in NumPy is ~40 small calls per
//! layer (norms, rope, SiLU, adds, copies), whose per-call overhead dominates at small batches and
//! whose temporaries dominate at larger ones. One pass per op over each row does the same work.
//!
//! Every op works row by row (a row is one token) and a row's result depends only on that row: the
//! same bits whatever the batch or the thread count. Calls over fewer than `PARALLEL_MIN_ELEMS`
//! elements run on the calling thread; larger ones split rows over rayon tasks. Lengths are checked
//! first: a mismatch is a [`CpuError::Shape`] and nothing is written. No `unsafe`: the loops are
//! plain elementwise code that LLVM vectorises in the `multiversion` builds.
//!
//! Numerics against NumPy (`pagedkv.models.llama`): `rms_norm` performs the same operations in the
//! same order (`x / sqrt(sum(x*x) / d + eps) * w`: a division, as NumPy does, not a multiplication
//! by a reciprocal) except that the sum of squares runs over 8 lanes in a fixed order (NumPy sums
//! pairwise), so it agrees within a few ulp. `rope_interleaved` is bit-identical (`x0*c - x1*s`,
//! `x0*s + x1*c`, each product rounded, no fused multiply-add). `silu_mul` is `g / (1 + exp(-g)) * u`
//! in NumPy's order with the polynomial [`exp`] below (at most 2 ulp from the correctly rounded
//! exp, tested), so it agrees within a few ulp and propagates inf and NaN as NumPy does.

use std::ops::Range;

use rayon::prelude::*;

use crate::error::{CpuError, Result};
use crate::vector::dot;

/// Below this many output elements a call runs on the calling thread: a rayon hand-off costs more
/// than the whole op at a decode batch's size (32 tokens of 576 features are 18k elements;
/// docs/cpu_data_plane.md, Fused elementwise ops).
const PARALLEL_MIN_ELEMS: usize = 1 << 16;
/// Output elements per rayon task (whole rows; at least one row).
const TASK_ELEMS: usize = 1 << 14;

fn product(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| CpuError::Shape(format!("{what}: {a} x {b} overflows")))
}

fn check(op: &str, name: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(CpuError::Shape(format!(
            "{op}: {name} has {got} elements, the shape needs {want}"
        )))
    }
}

/// Rows per task for rows of `row` output elements.
fn task_rows(row: usize) -> usize {
    (TASK_ELEMS / row.max(1)).max(1)
}

/// Runs `f(first_row, out_rows)` over `out` (rows of `row` elements): on this thread for small
/// calls, else over rayon tasks of whole rows.
fn by_rows<F>(out: &mut [f32], row: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    if out.is_empty() || row == 0 {
        return;
    }
    if out.len() < PARALLEL_MIN_ELEMS {
        f(0, out);
    } else {
        let rows = task_rows(row);
        out.par_chunks_mut(rows * row)
            .enumerate()
            .for_each(|(c, o)| f(c * rows, o));
    }
}

/// `out[j] = x[j] / sqrt(mean(x[j]^2) + eps) * weight` for each row `j` of `x [t, d]`
/// (`d = weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, t: usize, out: &mut [f32]) -> Result<()> {
    let d = weight.len();
    let n = product(t, d, "x")?;
    check("rms_norm", "x", x.len(), n)?;
    check("rms_norm", "out", out.len(), n)?;
    by_rows(out, d, |r0, o| {
        rms_norm_rows(&x[r0 * d..r0 * d + o.len()], weight, eps, o)
    });
    Ok(())
}

/// The residual add fused with the next norm: `x_out = x + delta`, `normed_out = rms_norm(x_out)`,
/// rows of `d = weight.len()` features.
pub fn add_rms_norm(
    x: &[f32],
    delta: &[f32],
    weight: &[f32],
    eps: f32,
    t: usize,
    x_out: &mut [f32],
    normed_out: &mut [f32],
) -> Result<()> {
    let d = weight.len();
    let n = product(t, d, "x")?;
    check("add_rms_norm", "x", x.len(), n)?;
    check("add_rms_norm", "delta", delta.len(), n)?;
    check("add_rms_norm", "x_out", x_out.len(), n)?;
    check("add_rms_norm", "normed_out", normed_out.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let work = |r0: usize, xo: &mut [f32], no: &mut [f32]| {
        let span = r0 * d..r0 * d + xo.len();
        add_rms_norm_rows(&x[span.clone()], &delta[span], weight, eps, xo, no)
    };
    if n < PARALLEL_MIN_ELEMS {
        work(0, x_out, normed_out);
    } else {
        let rows = task_rows(d);
        x_out
            .par_chunks_mut(rows * d)
            .zip(normed_out.par_chunks_mut(rows * d))
            .enumerate()
            .for_each(|(c, (xo, no))| work(c * rows, xo, no));
    }
    Ok(())
}

/// `out[j, i] = silu(g) * u` with `g = gate_up[j, i]` and `u = gate_up[j, f + i]`
/// (`gate_up [t, 2f]`, `out [t, f]`), `silu(g) = g / (1 + exp(-g))`.
pub fn silu_mul(gate_up: &[f32], t: usize, f: usize, out: &mut [f32]) -> Result<()> {
    let two_f = product(f, 2, "gate_up")?;
    check(
        "silu_mul",
        "gate_up",
        gate_up.len(),
        product(t, two_f, "gate_up")?,
    )?;
    check("silu_mul", "out", out.len(), product(t, f, "out")?)?;
    by_rows(out, f, |r0, o| {
        silu_mul_rows(&gate_up[r0 * two_f..r0 * two_f + 2 * o.len()], f, o)
    });
    Ok(())
}

/// The shape of a rotary embedding's input: `[tokens, heads, head_dim]`, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// Rotates the heads `heads` of `x [t, H, hd]` by adjacent pairs, written to `out [t, heads.len(),
/// hd]`: `(x0, x1) -> (x0*c - x1*s, x0*s + x1*c)` with `c = cos[j, i]`, `s = sin[j, i]`
/// (`cos`, `sin` `[t, hd / 2]`). A head range lets the model rotate the q and k heads of its fused
/// q|k|v projection without first copying them out.
pub fn rope_interleaved(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: RopeShape,
    heads: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let RopeShape {
        tokens: t,
        heads: h,
        head_dim: hd,
    } = shape;
    if hd % 2 != 0 {
        return Err(CpuError::Shape(format!(
            "rope_interleaved: head_dim {hd} is odd; pairs need an even head_dim"
        )));
    }
    if heads.start > heads.end || heads.end > h {
        return Err(CpuError::Shape(format!(
            "rope_interleaved: heads {heads:?} are not a range of the {h} heads"
        )));
    }
    let row = product(h, hd, "x")?;
    let out_row = product(heads.len(), hd, "out")?;
    check("rope_interleaved", "x", x.len(), product(t, row, "x")?)?;
    check(
        "rope_interleaved",
        "cos",
        cos.len(),
        product(t, hd / 2, "cos")?,
    )?;
    check(
        "rope_interleaved",
        "sin",
        sin.len(),
        product(t, hd / 2, "sin")?,
    )?;
    check(
        "rope_interleaved",
        "out",
        out.len(),
        product(t, out_row, "out")?,
    )?;
    let half = hd / 2;
    let first = heads.start * hd;
    by_rows(out, out_row, |r0, o| {
        let rows = o.len() / out_row;
        let tables = r0 * half..(r0 + rows) * half;
        rope_rows(
            &x[r0 * row..(r0 + rows) * row],
            &cos[tables.clone()],
            &sin[tables],
            row,
            first,
            hd,
            o,
        )
    });
    Ok(())
}

// The row loops below are compiled for AVX-512, AVX2+FMA and NEON as well as the baseline and
// dispatched on the CPU's features at run time, as the matmul kernels are.

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        normalize(xr, weight, eps, or);
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn add_rms_norm_rows(
    x: &[f32],
    delta: &[f32],
    weight: &[f32],
    eps: f32,
    x_out: &mut [f32],
    normed: &mut [f32],
) {
    let d = weight.len();
    let rows = x
        .chunks_exact(d)
        .zip(delta.chunks_exact(d))
        .zip(x_out.chunks_exact_mut(d).zip(normed.chunks_exact_mut(d)));
    for ((xr, dr), (xo, no)) in rows {
        for ((o, a), b) in xo.iter_mut().zip(xr).zip(dr) {
            *o = a + b;
        }
        normalize(xo, weight, eps, no);
    }
}

/// One row's RMS norm, in NumPy's order of operations; the sum of squares is [`dot`]'s fixed
/// 8-lane order.
#[inline(always)]
fn normalize(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let rms = (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, xi), w) in out.iter_mut().zip(x).zip(weight) {
        *o = xi / rms * w;
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn silu_mul_rows(gate_up: &[f32], f: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (gate, up) = gu.split_at(f);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = silu_times(*g, *u);
        }
    }
}

/// `silu(g) * u` in NumPy's order of operations.
#[inline(always)]
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rope_rows(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    row: usize,
    first: usize,
    hd: usize,
    out: &mut [f32],
) {
    let half = hd / 2;
    let out_row = out.len() / (x.len() / row);
    let tokens = x
        .chunks_exact(row)
        .zip(out.chunks_exact_mut(out_row))
        .zip(cos.chunks_exact(half).zip(sin.chunks_exact(half)));
    for ((xr, or), (c, s)) in tokens {
        let heads = xr[first..first + out_row]
            .chunks_exact(hd)
            .zip(or.chunks_exact_mut(hd));
        for (xh, oh) in heads {
            let pairs = xh
                .chunks_exact(2)
                .zip(oh.chunks_exact_mut(2))
                .zip(c.iter().zip(s));
            for ((p, o), (c, s)) in pairs {
                let (x0, x1) = (p[0], p[1]);
                o[0] = x0 * c - x1 * s;
                o[1] = x0 * s + x1 * c;
            }
        }
    }
}

/// `1.5 * 2^23`: adding it rounds `|v| < 2^22` to an integer held in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln(2)` split Cody-Waite style: `LN2_HI` has 9 significant bits, so `n * LN2_HI` is exact for
/// `|n| < 2^15`.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Inputs are clamped into `[EXP_LO, EXP_HI]`: below, exp is under half the least subnormal
/// (rounds to 0); above, over the largest finite fp32 (inf). NaN passes the clamp unchanged.
const EXP_LO: f32 = -104.0;
const EXP_HI: f32 = 89.0;

/// `e^x` in fp32 without a libm call, so loops over it vectorise: `x = n ln2 + r` with `|r| <=
/// ln2 / 2`, a degree-7 polynomial for `e^r` (the Cephes `expf` coefficients, fused multiply-adds),
/// and `2^n` applied as two exact powers of two so that results near the overflow and subnormal
/// ends round once. At most 2 ulp from the correctly rounded result over the finite range (tested
/// below: the measured maximum is 1 ulp); `exp(-inf) = 0`, `exp(inf) = inf`, NaN stays NaN.
/// `mul_add` is a fused multiply-add on every build (a libm call where the CPU has no FMA), so the
/// result is the same on every machine.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = if x < EXP_LO { EXP_LO } else { x };
    let x = if x > EXP_HI { EXP_HI } else { x };
    let k = x.mul_add(LOG2E, ROUND_MAGIC);
    let n = (k.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let nf = k - ROUND_MAGIC;
    let r = (-nf).mul_add(LN2_HI, x);
    let r = (-nf).mul_add(LN2_LO, r);
    let p = 1.987_569_1e-4f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    let er = p.mul_add(r * r, r) + 1.0;
    let n1 = n >> 1;
    let n2 = n.wrapping_sub(n1);
    er * pow2(n1) * pow2(n2)
}

/// `2^n` for `-126 <= n <= 127` (callers stay in `[-76, 65]`).
#[inline(always)]
fn pow2(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32).wrapping_shl(23))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        let key = |v: f32| {
            let i = v.to_bits() as i32;
            if i < 0 {
                i32::MIN.wrapping_sub(i)
            } else {
                i
            }
        };
        key(a).wrapping_sub(key(b)).unsigned_abs()
    }

    #[test]
    fn exp_is_within_2_ulp_of_the_correctly_rounded_result() {
        let mut worst = 0;
        let mut x = -103.9f32;
        while x < 88.8 {
            for v in [x, x * 0.999_9, x + 1e-3] {
                let want = (v as f64).exp() as f32;
                if want.is_subnormal() || want == 0.0 {
                    assert!((exp(v) - want).abs() <= f32::from_bits(2), "{v}");
                } else {
                    // inf is one ulp above the largest finite value here.
                    worst = worst.max(ulps(exp(v), want));
                }
            }
            x += 1.0 / 1024.0;
        }
        for bits in (0u32..0x3400_0000).step_by(4099) {
            for v in [f32::from_bits(bits), -f32::from_bits(bits)] {
                worst = worst.max(ulps(exp(v), (v as f64).exp() as f32));
            }
        }
        assert!(worst <= 2, "worst {worst} ulp");
    }

    #[test]
    fn exp_ends_and_specials() {
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(1e30), f32::INFINITY);
        assert!(ulps(exp(88.72), f64::from(88.72f32).exp() as f32) <= 2);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn bad_lengths_are_refused_before_writing() {
        let shape = |t, h, hd| RopeShape {
            tokens: t,
            heads: h,
            head_dim: hd,
        };
        let mut out = vec![7.0f32; 6];
        let mut out2 = vec![7.0f32; 6];
        let shape_err = |r: Result<()>| assert!(matches!(r, Err(CpuError::Shape(_))), "{r:?}");
        shape_err(rms_norm(&[1.0; 5], &[1.0; 3], 1e-5, 2, &mut out));
        shape_err(rms_norm(&[1.0; 6], &[1.0; 3], 1e-5, 2, &mut out[..5]));
        shape_err(rms_norm(&[1.0; 6], &[1.0; 3], 1e-5, usize::MAX, &mut out));
        shape_err(add_rms_norm(
            &[1.0; 6], &[1.0; 5], &[1.0; 3], 1e-5, 2, &mut out, &mut out2,
        ));
        shape_err(add_rms_norm(
            &[1.0; 6],
            &[1.0; 6],
            &[1.0; 3],
            1e-5,
            2,
            &mut out,
            &mut out2[..4],
        ));
        shape_err(silu_mul(&[1.0; 11], 2, 3, &mut out));
        shape_err(silu_mul(&[1.0; 12], 2, 3, &mut out[..5]));
        shape_err(silu_mul(&[1.0; 12], 2, usize::MAX, &mut out));
        let (c, s) = ([1.0f32; 2], [0.0f32; 2]);
        shape_err(rope_interleaved(
            &[1.0; 6],
            &c,
            &s,
            shape(2, 1, 3),
            0..1,
            &mut out,
        ));
        shape_err(rope_interleaved(
            &[1.0; 8],
            &c,
            &s,
            shape(2, 2, 2),
            1..3,
            &mut out[..4],
        ));
        #[allow(clippy::reversed_empty_ranges)]
        shape_err(rope_interleaved(
            &[1.0; 8],
            &c,
            &s,
            shape(2, 2, 2),
            2..1,
            &mut out[..0],
        ));
        shape_err(rope_interleaved(
            &[1.0; 8],
            &c[..1],
            &s,
            shape(2, 2, 2),
            0..1,
            &mut out[..4],
        ));
        shape_err(rope_interleaved(
            &[1.0; 8],
            &c,
            &s,
            shape(2, 2, 2),
            0..1,
            &mut out[..5],
        ));
        shape_err(rope_interleaved(
            &[1.0; 8],
            &c,
            &s,
            shape(usize::MAX, 2, 2),
            0..1,
            &mut out[..4],
        ));
        assert_eq!(out, vec![7.0; 6]);
        assert_eq!(out2, vec![7.0; 6]);
    }

    #[test]
    fn ops_match_f64_and_rows_do_not_depend_on_their_batch() {
        let (t, d) = (300, 301); // above the parallel threshold, odd width
        let x: Vec<f32> = (0..t * d).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let delta: Vec<f32> = (0..t * d).map(|i| (i as f32 * 0.11).cos()).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
        let (mut xo, mut no) = (vec![0.0; t * d], vec![0.0; t * d]);
        add_rms_norm(&x, &delta, &w, 1e-5, t, &mut xo, &mut no).unwrap();
        let mut alone = vec![0.0; t * d];
        rms_norm(&xo, &w, 1e-5, t, &mut alone).unwrap();
        assert_eq!(alone, no);
        for j in [0, 17, t - 1] {
            let row = &xo[j * d..(j + 1) * d];
            let ms: f64 = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
            for i in 0..d {
                let want = f64::from(row[i]) / (ms + 1e-5).sqrt() * f64::from(w[i]);
                assert!((f64::from(no[j * d + i]) - want).abs() <= 1e-6 * (1.0 + want.abs()));
                assert_eq!(xo[j * d + i], x[j * d + i] + delta[j * d + i]);
            }
            let mut one = vec![0.0; d];
            rms_norm(row, &w, 1e-5, 1, &mut one).unwrap();
            assert_eq!(one, no[j * d..(j + 1) * d]);
        }
        let f = d;
        let mut act = vec![0.0; t * f / 2];
        silu_mul(&x[..t * f], t / 2, f, &mut act).unwrap();
        for (j, row) in x[..t * f].chunks_exact(2 * f).enumerate() {
            for i in 0..f {
                let (g, u) = (f64::from(row[i]), f64::from(row[f + i]));
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((f64::from(act[j * f + i]) - want).abs() <= 1e-6 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn rope_rotates_the_selected_heads_pairwise() {
        let shape = RopeShape {
            tokens: 3,
            heads: 4,
            head_dim: 6,
        };
        let x: Vec<f32> = (0..3 * 4 * 6).map(|i| i as f32 * 0.25 - 3.0).collect();
        let c: Vec<f32> = (0..9).map(|i| (i as f32 * 0.3).cos()).collect();
        let s: Vec<f32> = (0..9).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut out = vec![0.0; 3 * 2 * 6];
        rope_interleaved(&x, &c, &s, shape, 1..3, &mut out).unwrap();
        for j in 0..3 {
            for h in 0..2 {
                for i in 0..3 {
                    let src = j * 24 + (h + 1) * 6 + 2 * i;
                    let (x0, x1, cc, ss) = (x[src], x[src + 1], c[j * 3 + i], s[j * 3 + i]);
                    let dst = j * 12 + h * 6 + 2 * i;
                    assert_eq!(out[dst], x0 * cc - x1 * ss);
                    assert_eq!(out[dst + 1], x0 * ss + x1 * cc);
                }
            }
        }
    }
}
