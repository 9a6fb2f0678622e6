//! The model's projections with bf16 weights: `out[t, n] = x[t, k] @ w[k, n]` for fp32
//! activations `x` and bf16 weights `w` stored `[in, out]` row-major, accumulated in fp32.
//!
//! Why: at decode batch sizes a step streams every weight once, so the weights' bytes bound it
//! (SmolLM2-135M: 540 MB per step in fp32, 270 MB in bf16). bf16 widens to fp32 by a shift, which
//! vectorises without F16C, and its 8-bit mantissa is far finer than the 4-bit quantization the
//! weights come from (docs/cpu_data_plane.md states the measured logit difference).
//!
//! Work split: tasks of `COLS_PER_TASK` output columns (rayon). A task adds `x[j, i] * w[i, cols]`
//! for `i` in order into 64 running sums per token: elementwise, so it vectorises with no
//! reassociation, and every output is the same in-order sum whatever the thread count or the
//! other tokens of the batch: a token's result does not depend on what it was batched with.

use half::bf16;
use rayon::prelude::*;

use crate::error::{CpuError, Result};

/// Output columns per task: 64 fp32 sums (8 AVX registers), and 128 bytes (two cache lines) of
/// each weight row per input feature.
pub const COLS_PER_TASK: usize = 64;
/// Below this many multiply-adds a call runs on the calling thread (no rayon hand-off).
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// `out[t, n] = x[t, k] @ w[k, n]`; all three row-major. Lengths are checked first: a mismatch
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
    let panels = n.div_ceil(COLS_PER_TASK);
    let (xl, wl, ol) = (
        want(t, k, "x")?,
        want(want(panels, k, "w")?, COLS_PER_TASK, "w")?,
        want(t, n, "out")?,
    );
    if x.len() != xl || w.len() != wl || out.len() != ol {
        return Err(CpuError::Shape(format!(
            "matmul: x has {} elements, w {}, out {}; [t={t}, k={k}] @ {panels} panels of [k={k}, 64] needs \
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
    let panel = k * COLS_PER_TASK;
    let work =
        |(c, dst): (usize, &mut [f32])| columns(x, &w[c * panel..(c + 1) * panel], t, k, dst);
    let mut cols_out = vec![0.0f32; ol];
    // Tasks own `COLS_PER_TASK` output columns of every token: [t, cols] blocks, copied after.
    let chunk = t * COLS_PER_TASK;
    if ol.saturating_mul(k) < PARALLEL_MIN_MACS {
        cols_out.chunks_mut(chunk).enumerate().for_each(work);
    } else {
        cols_out.par_chunks_mut(chunk).enumerate().for_each(work);
    }
    for (c, block) in cols_out.chunks(chunk).enumerate() {
        let c0 = c * COLS_PER_TASK;
        let cols = block.len() / t;
        for (j, src) in block.chunks_exact(cols).enumerate() {
            out[j * n + c0..j * n + c0 + cols].copy_from_slice(src);
        }
    }
    Ok(())
}

/// One task: `dst[j, c] = Σ_i x[j, i] · panel[i, c]` for its panel (64 output columns, stored
/// contiguously: the task streams 128 bytes per input feature, in order) and every token, as `k`
/// scaled row additions: elementwise over the 64 columns, so LLVM vectorises it with no
/// reassociation (a dot-product form kept 2-lane sums in the assembly), and each output's sum
/// runs over `i` in order.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn columns(x: &[f32], panel: &[bf16], t: usize, k: usize, dst: &mut [f32]) {
    let cols = dst.len() / t;
    for j in 0..t {
        let xr = &x[j * k..(j + 1) * k];
        let mut acc = [0.0f32; COLS_PER_TASK];
        for (xi, wr) in xr.iter().zip(panel.chunks_exact(COLS_PER_TASK)) {
            let wr: &[bf16; COLS_PER_TASK] = wr.try_into().expect("COLS_PER_TASK columns");
            for l in 0..COLS_PER_TASK {
                acc[l] += xi * widen(wr[l]);
            }
        }
        dst[j * cols..(j + 1) * cols].copy_from_slice(&acc[..cols]);
    }
}

/// bf16 -> fp32, exact: bf16 is fp32's top half.
#[inline(always)]
fn widen(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// `w [n, k]` (row-major `[out, in]`) as the kernel's panels: `n.div_ceil(64)` blocks of
/// `[k, 64]`, the columns past `n` zero.
pub fn to_panels(w: &[bf16], k: usize, n: usize) -> Vec<bf16> {
    let panels = n.div_ceil(COLS_PER_TASK);
    let mut out = vec![bf16::ZERO; panels * k * COLS_PER_TASK];
    for r in 0..n {
        let (p, c) = (r / COLS_PER_TASK, r % COLS_PER_TASK);
        for i in 0..k {
            out[(p * k + i) * COLS_PER_TASK + c] = w[r * k + i];
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
            matmul_bf16(&x, &to_panels(&w, k, n), t, k, n, &mut out).unwrap();
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
        let w = to_panels(&w, k, n);
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
        let w = vec![bf16::ONE; 3 * 64];
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
        assert!(matches!(
            matmul_bf16(&[1.0; 6], &w[..6], 2, 3, 2, &mut out),
            Err(CpuError::Shape(_))
        ));
        assert_eq!(z, vec![0.0; 4]);
    }
}
