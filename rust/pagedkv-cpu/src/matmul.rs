//! The model's projections with bf16 weights: `out[t, n] = Σ_k x[t, k] · w[n, k]` for fp32
//! activations `x [t, k]` and bf16 weights `w [n, k]` (the GGUF file's row-major `[out, in]`),
//! accumulated in fp32.
//!
//! Why: at decode batch sizes a step streams every weight once, so the weights' bytes bound it
//! (SmolLM2-135M: 540 MB per step in fp32, 270 MB in bf16). bf16 widens to fp32 by a shift, which
//! vectorises without F16C, and its 8-bit mantissa is far finer than the 4-bit quantization the
//! weights come from (docs/cpu_data_plane.md states the measured logit difference).
//!
//! Work split: tasks of `ROWS_PER_TASK` weight rows (rayon). A task widens its rows once into an
//! fp32 scratch (in L2) and computes them against every token, 4 rows x 2 tokens at a time so
//! that each loaded activation lane feeds 4 products and each weight lane 2. Every output is the
//! same fixed-order sum (8 lane partial sums, then a fixed pairwise reduction, then the tail),
//! whatever the blocking, the thread count or the other tokens of the batch: a token's result
//! does not depend on what it was batched with.

use half::bf16;
use rayon::prelude::*;

use crate::error::{CpuError, Result};

/// Weight rows per task: 16 rows of a 1536-wide matrix widen to 96 KB of fp32 (half an L2).
pub const ROWS_PER_TASK: usize = 16;
/// Lanes of each partial sum (one AVX register).
const LANES: usize = 8;
/// Below this many multiply-adds a call runs on the calling thread (no rayon hand-off).
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// `out[t, n] = x[t, k] @ w[n, k]ᵀ`; all three row-major. Lengths are checked first: a mismatch
/// is a [`CpuError::Shape`] and nothing is written.
pub fn matmul_bf16(
    x: &[f32],
    w: &[bf16],
    t: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    let want = |a: usize, b: usize, what: &str| {
        a.checked_mul(b)
            .ok_or_else(|| CpuError::Shape(format!("{what}: {a} x {b} overflows")))
    };
    let (xl, wl, ol) = (want(t, k, "x")?, want(n, k, "w")?, want(t, n, "out")?);
    if x.len() != xl || w.len() != wl || out.len() != ol {
        return Err(CpuError::Shape(format!(
            "matmul: x has {} elements, w {}, out {}; [t={t}, k={k}] @ [n={n}, k={k}]ᵀ needs \
             {xl}, {wl}, {ol}",
            x.len(),
            w.len(),
            out.len()
        )));
    }
    if ol == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    if t == 1 {
        // One token: each task writes its slice of `out` directly, widening as it reads.
        let work = |(i, dst): (usize, &mut [f32])| {
            let r0 = i * ROWS_PER_TASK;
            row_vector(x, &w[r0 * k..(r0 + dst.len()) * k], k, dst);
        };
        if n.saturating_mul(k) < PARALLEL_MIN_MACS {
            out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(work);
        } else {
            out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(work);
        }
        return Ok(());
    }
    // Several tokens: each task returns its columns as [t, rows], copied into `out` after.
    let tasks = n.div_ceil(ROWS_PER_TASK);
    let work = |i: usize| {
        let (r0, r1) = (i * ROWS_PER_TASK, ((i + 1) * ROWS_PER_TASK).min(n));
        let mut dst = vec![0.0f32; t * (r1 - r0)];
        rows_times_tokens(x, &w[r0 * k..r1 * k], t, k, &mut dst);
        dst
    };
    let cols: Vec<Vec<f32>> = if ol.saturating_mul(k) < PARALLEL_MIN_MACS {
        (0..tasks).map(work).collect()
    } else {
        (0..tasks).into_par_iter().map(work).collect()
    };
    for (i, c) in cols.iter().enumerate() {
        let r0 = i * ROWS_PER_TASK;
        let rows = c.len() / t;
        for (j, src) in c.chunks_exact(rows).enumerate() {
            out[j * n + r0..j * n + r0 + rows].copy_from_slice(src);
        }
    }
    Ok(())
}

/// One token: `dst[r] = w_r · x` for the task's rows, bf16 widened in registers (a step streams
/// each weight once, so no scratch pass).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn row_vector(x: &[f32], w: &[bf16], k: usize, dst: &mut [f32]) {
    let body = k - k % LANES;
    for (r, d) in dst.iter_mut().enumerate() {
        let row = &w[r * k..(r + 1) * k];
        let mut acc = [0.0f32; LANES];
        for (wc, xc) in row[..body]
            .chunks_exact(LANES)
            .zip(x[..body].chunks_exact(LANES))
        {
            for l in 0..LANES {
                acc[l] += widen(wc[l]) * xc[l];
            }
        }
        let mut total = reduce(&acc);
        for (w, x) in row[body..].iter().zip(&x[body..k]) {
            total += widen(*w) * x;
        }
        *d = total;
    }
}

/// bf16 -> fp32, exact: bf16 is fp32's top half.
#[inline(always)]
fn widen(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// The fixed-order reduction of a dot product's lane sums (pairwise), before its tail.
#[inline(always)]
fn reduce(s: &[f32; LANES]) -> f32 {
    let s4 = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// One task of several tokens: `dst[j, r] = w_r · x_j` for its `rows = w.len() / k` weight rows.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn rows_times_tokens(x: &[f32], w: &[bf16], t: usize, k: usize, dst: &mut [f32]) {
    let rows = w.len() / k;
    let mut wide = vec![0.0f32; rows * k];
    for (o, b) in wide.iter_mut().zip(w) {
        *o = widen(*b);
    }
    let wrow = |r: usize| &wide[r * k..(r + 1) * k];
    let xrow = |j: usize| &x[j * k..(j + 1) * k];
    let mut j = 0;
    while j < t {
        let nt = (t - j).min(2);
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(4);
            if nr == 4 && nt == 2 {
                let s = dots::<4, 2>(
                    [wrow(r), wrow(r + 1), wrow(r + 2), wrow(r + 3)],
                    [xrow(j), xrow(j + 1)],
                );
                for (a, pair) in s.iter().enumerate() {
                    dst[j * rows + r + a] = pair[0];
                    dst[(j + 1) * rows + r + a] = pair[1];
                }
            } else if nr == 4 {
                let s = dots::<4, 1>([wrow(r), wrow(r + 1), wrow(r + 2), wrow(r + 3)], [xrow(j)]);
                for (a, one) in s.iter().enumerate() {
                    dst[j * rows + r + a] = one[0];
                }
            } else {
                for a in 0..nr {
                    for b in 0..nt {
                        dst[(j + b) * rows + r + a] =
                            dots::<1, 1>([wrow(r + a)], [xrow(j + b)])[0][0];
                    }
                }
            }
            r += nr;
        }
        j += nt;
    }
}

/// `R x T` dot products of equal-length rows, each summed in the one fixed order of the module
/// docs. The partial sums are `R * T` local `[f32; LANES]` arrays that LLVM keeps in vector
/// registers; lanes are copied by value out of `chunks_exact` (no bounds checks in the loop).
#[inline(always)]
fn dots<const R: usize, const T: usize>(ws: [&[f32]; R], xs: [&[f32]; T]) -> [[f32; T]; R] {
    let k = ws[0].len();
    let body = k - k % LANES;
    let mut acc = [[[0.0f32; LANES]; T]; R];
    let mut wc = ws.map(|w| w[..body].chunks_exact(LANES));
    let mut xc = xs.map(|x| x[..body].chunks_exact(LANES));
    for _ in 0..body / LANES {
        let mut wv = [[0.0f32; LANES]; R];
        for (v, c) in wv.iter_mut().zip(wc.iter_mut()) {
            v.copy_from_slice(c.next().unwrap_or(&[0.0; LANES]));
        }
        let mut xv = [[0.0f32; LANES]; T];
        for (v, c) in xv.iter_mut().zip(xc.iter_mut()) {
            v.copy_from_slice(c.next().unwrap_or(&[0.0; LANES]));
        }
        for (acc_a, w) in acc.iter_mut().zip(&wv) {
            for (acc_ab, x) in acc_a.iter_mut().zip(&xv) {
                for l in 0..LANES {
                    acc_ab[l] += w[l] * x[l];
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for a in 0..R {
        for b in 0..T {
            let mut total = reduce(&acc[a][b]);
            for l in body..k {
                total += ws[a][l] * xs[b][l];
            }
            out[a][b] = total;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[bf16], t: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; t * n];
        for j in 0..t {
            for r in 0..n {
                out[j * n + r] = (0..k)
                    .map(|i| f64::from(x[j * k + i]) * f64::from(w[r * k + i].to_f32()))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn matches_f64_on_blocking_remainders() {
        // Every (rows mod 4, tokens mod 2, k mod 8) remainder, below and above a task's rows.
        for &(t, k, n) in &[
            (1, 1, 1),
            (3, 9, 5),
            (2, 16, 4),
            (5, 23, 37),
            (1, 576, 33),
            (7, 70, 18),
        ] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 53) % 97) as f32 / 48.0 - 1.0))
                .collect();
            let mut out = vec![f32::NAN; t * n];
            matmul_bf16(&x, &w, t, k, n, &mut out).unwrap();
            for (got, want) in out.iter().zip(reference(&x, &w, t, k, n)) {
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-5 * (k as f64),
                    "{t} {k} {n}"
                );
            }
        }
    }

    #[test]
    fn a_token_result_does_not_depend_on_its_batch() {
        let (k, n) = (40, 21);
        let x: Vec<f32> = (0..5 * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i as f32 * 0.11).cos()))
            .collect();
        let mut all = vec![0.0; 5 * n];
        matmul_bf16(&x, &w, 5, k, n, &mut all).unwrap();
        for j in 0..5 {
            let mut one = vec![0.0; n];
            matmul_bf16(&x[j * k..(j + 1) * k], &w, 1, k, n, &mut one).unwrap();
            assert_eq!(one, all[j * n..(j + 1) * n]);
        }
    }

    #[test]
    fn bad_lengths_are_refused_before_writing() {
        let mut out = vec![7.0f32; 4];
        let w = vec![bf16::ONE; 6];
        assert!(matches!(
            matmul_bf16(&[1.0; 5], &w, 2, 3, 2, &mut out),
            Err(CpuError::Shape(_))
        ));
        assert!(matches!(
            matmul_bf16(&[1.0; 6], &w, 2, 3, usize::MAX, &mut out),
            Err(CpuError::Shape(_))
        ));
        assert_eq!(out, vec![7.0; 4]);
        let mut empty: Vec<f32> = vec![];
        matmul_bf16(&[], &w, 0, 3, 2, &mut empty).unwrap();
        let mut z = vec![7.0f32; 4];
        matmul_bf16(&[], &[], 2, 0, 2, &mut z).unwrap();
        assert_eq!(z, vec![0.0; 4]);
    }
}
