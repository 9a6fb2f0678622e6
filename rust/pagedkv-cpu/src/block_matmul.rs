//! The model's projections on the file's own quantized weights: `out[t, n] = x[t, k] @ w[k, n]`
//! for fp32 activations `x` and weights held as 8-bit codes with an fp32 scale and offset per
//! block of `block` inputs: `w[i, c] = fma(scale[i / block, c], code[i, c], offset[i / block, c])`.
//!
//! Why: every GGUF block type (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) is `scale * code + offset`
//! per block with `scale * code` exact in fp32, so this form reproduces the fp32 dequantized
//! weights **bit for bit** (one rounding, the same as NumPy's `scale * code + offset`) at a quarter
//! of their bytes; a decode step streams every weight once, so bytes bound batch 1, and the
//! register-blocked tile below makes batch 32 bound by fused multiply-adds instead of loads.
//!
//! Layout: panels of [`PANEL_COLS`] output columns; panel `p` holds `codes[p][i][c]` (`[k, 16]`
//! int8, contiguous, so a panel streams in order) and `scales[p][b][c]`, `offsets[p][b][c]`
//! (`[k / block, 16]` fp32). Columns past `n` are zero.
//!
//! Arithmetic: each output is `acc = fma(x[j, i], w[i, c], acc)` for `i` in order from zero, the
//! weight dequantized in registers; nothing depends on the tile a row lands in, its batch or the
//! thread count, so a token's result does not depend on what it was batched with.
//!
//! Work split: rayon tasks of whole panels (every row of the batch per panel: a panel's codes are
//! read from memory once per call); inside a task, tiles of [`ROWS_PER_TILE`] rows share each
//! dequantized weight: 4 rows x 16 columns = 8 accumulator registers of 8 lanes, with the block's
//! scales, offsets and the weight vector, 15 of AVX2's 16 registers.

use rayon::prelude::*;

use crate::error::{CpuError, Result};

/// Output columns per panel: two AVX2 registers of fp32 sums per row.
pub const PANEL_COLS: usize = 16;
/// Rows sharing one dequantized weight vector (the register budget above).
pub const ROWS_PER_TILE: usize = 4;
/// Below this many multiply-adds a call runs on the calling thread (no rayon hand-off); above,
/// each task gets at least this many (tiny tasks cost more to hand over than to run).
const TASK_MIN_MACS: usize = 1 << 16;

/// Borrowed block-quantized weights in the panel layout of the module docs.
#[derive(Clone, Copy, Debug)]
pub struct BlockWeights<'a> {
    pub codes: &'a [i8],
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    /// Input features `k` (a multiple of `block`).
    pub in_features: usize,
    /// Output features `n` (the panels hold `n.div_ceil(16) * 16` columns).
    pub out_features: usize,
    /// Inputs per scale/offset.
    pub block: usize,
}

impl BlockWeights<'_> {
    /// Every length and the block size checked, before any work.
    fn check(&self) -> Result<()> {
        let (k, n, block) = (self.in_features, self.out_features, self.block);
        if block == 0 || k % block != 0 {
            return Err(CpuError::Shape(format!(
                "block weights: block {block} must be positive and divide in_features {k}"
            )));
        }
        let cols = n.div_ceil(PANEL_COLS).checked_mul(PANEL_COLS);
        let want_codes = cols.and_then(|c| c.checked_mul(k));
        let want_scales = cols.map(|c| c * (k / block));
        if want_codes != Some(self.codes.len())
            || want_scales != Some(self.scales.len())
            || want_scales != Some(self.offsets.len())
        {
            return Err(CpuError::Shape(format!(
                "block weights [k={k}, n={n}] in blocks of {block}: codes have {}, scales {}, \
                 offsets {} elements; the panels need {:?}, {:?}, {:?}",
                self.codes.len(),
                self.scales.len(),
                self.offsets.len(),
                want_codes,
                want_scales,
                want_scales
            )));
        }
        Ok(())
    }
}

/// `out[t, n] = x[t, k] @ w` (`x`, `out` row-major). Lengths are checked first: a mismatch is a
/// [`CpuError::Shape`] and nothing is written.
pub fn matmul_blocks(x: &[f32], w: BlockWeights<'_>, t: usize, out: &mut [f32]) -> Result<()> {
    w.check()?;
    let (k, n) = (w.in_features, w.out_features);
    let x_len = t.checked_mul(k);
    let out_len = t.checked_mul(n);
    if x_len != Some(x.len()) || out_len != Some(out.len()) {
        return Err(CpuError::Shape(format!(
            "matmul: x has {} elements and out {}; [t={t}, k={k}] @ [k={k}, n={n}] needs {x_len:?} and {out_len:?}",
            x.len(),
            out.len()
        )));
    }
    if out.is_empty() {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let xt = tile_rows(x, t, k);
    let nb = k / w.block;
    let per_panel = t * PANEL_COLS;
    let panels = n.div_ceil(PANEL_COLS);
    let mut cols_out = vec![0.0f32; panels * per_panel];
    let work = |(p, dst): (usize, &mut [f32])| {
        let codes = &w.codes[p * k * PANEL_COLS..(p + 1) * k * PANEL_COLS];
        let scales = &w.scales[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS];
        let offsets = &w.offsets[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS];
        panel_product(&xt, t, k, w.block, codes, scales, offsets, dst);
    };
    let macs_per_panel = k * PANEL_COLS * t;
    if macs_per_panel.saturating_mul(panels) < TASK_MIN_MACS {
        cols_out.chunks_mut(per_panel).enumerate().for_each(work);
    } else {
        let min_panels = TASK_MIN_MACS.div_ceil(macs_per_panel).max(1);
        cols_out
            .par_chunks_mut(per_panel)
            .enumerate()
            .with_min_len(min_panels)
            .for_each(work);
    }
    for (p, block) in cols_out.chunks_exact(per_panel).enumerate() {
        let c0 = p * PANEL_COLS;
        let cols = PANEL_COLS.min(n - c0);
        for (j, src) in block.chunks_exact(PANEL_COLS).enumerate() {
            out[j * n + c0..j * n + c0 + cols].copy_from_slice(&src[..cols]);
        }
    }
    Ok(())
}

/// `x [t, k]` regrouped as `[t / 4, k]` tiles of 4 rows side by side (`[f32; 4]` per input
/// feature), the last tile zero-padded: the tile kernel then reads one short array per step.
fn tile_rows(x: &[f32], t: usize, k: usize) -> Vec<[f32; ROWS_PER_TILE]> {
    let mut xt = vec![[0.0f32; ROWS_PER_TILE]; t.div_ceil(ROWS_PER_TILE) * k];
    for (j, row) in x.chunks_exact(k).enumerate() {
        let (tile, r) = (j / ROWS_PER_TILE, j % ROWS_PER_TILE);
        for (dst, &v) in xt[tile * k..(tile + 1) * k].iter_mut().zip(row) {
            dst[r] = v;
        }
    }
    xt
}

/// One panel for every row: `dst[j][c]` (`[t, 16]`), tile by tile.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
#[allow(clippy::too_many_arguments)]
fn panel_product(
    xt: &[[f32; ROWS_PER_TILE]],
    t: usize,
    k: usize,
    block: usize,
    codes: &[i8],
    scales: &[f32],
    offsets: &[f32],
    dst: &mut [f32],
) {
    for (tile, rows_out) in dst.chunks_mut(ROWS_PER_TILE * PANEL_COLS).enumerate() {
        let x = &xt[tile * k..(tile + 1) * k];
        let acc = match (t - tile * ROWS_PER_TILE).min(ROWS_PER_TILE) {
            4 => tile_product::<4>(x, block, codes, scales, offsets),
            3 => tile_product::<3>(x, block, codes, scales, offsets),
            2 => tile_product::<2>(x, block, codes, scales, offsets),
            _ => tile_product::<1>(x, block, codes, scales, offsets),
        };
        for (dst_row, acc_row) in rows_out.chunks_exact_mut(PANEL_COLS).zip(&acc) {
            dst_row.copy_from_slice(acc_row);
        }
    }
}

/// `R` rows (of a tile) times one panel: per input feature the 16 weights are dequantized once
/// (`fma(scale, code, offset)`, exact as the module docs say) and fused into `R` rows of sums.
/// Constant trip counts so that LLVM keeps `acc` in registers and vectorises the 16 columns.
#[inline(always)]
fn tile_product<const R: usize>(
    x: &[[f32; ROWS_PER_TILE]],
    block: usize,
    codes: &[i8],
    scales: &[f32],
    offsets: &[f32],
) -> [[f32; PANEL_COLS]; ROWS_PER_TILE] {
    let mut acc = [[0.0f32; PANEL_COLS]; R];
    let blocks = x
        .chunks_exact(block)
        .zip(codes.chunks_exact(block * PANEL_COLS))
        .zip(scales.chunks_exact(PANEL_COLS).zip(offsets.chunks_exact(PANEL_COLS)));
    for ((xb, qb), (s, o)) in blocks {
        let s: &[f32; PANEL_COLS] = s.try_into().expect("PANEL_COLS scales");
        let o: &[f32; PANEL_COLS] = o.try_into().expect("PANEL_COLS offsets");
        for (xv, q) in xb.iter().zip(qb.chunks_exact(PANEL_COLS)) {
            let q: &[i8; PANEL_COLS] = q.try_into().expect("PANEL_COLS codes");
            let mut w = [0.0f32; PANEL_COLS];
            for c in 0..PANEL_COLS {
                w[c] = s[c].mul_add(f32::from(q[c]), o[c]);
            }
            for r in 0..R {
                for c in 0..PANEL_COLS {
                    acc[r][c] = xv[r].mul_add(w[c], acc[r][c]);
                }
            }
        }
    }
    let mut out = [[0.0f32; PANEL_COLS]; ROWS_PER_TILE];
    out[..R].copy_from_slice(&acc);
    out
}

/// Row-major `[n, k]` codes and `[n, k / block]` scales/offsets (the file's order: one output
/// feature per row) as the kernel's panels: `(codes, scales, offsets)`, columns past `n` zero.
/// The caller has checked the lengths (`n * k`, `n * (k / block)`).
pub fn to_panels(
    codes: &[i8],
    scales: &[f32],
    offsets: &[f32],
    k: usize,
    n: usize,
    block: usize,
) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
    let (panels, nb) = (n.div_ceil(PANEL_COLS), k / block);
    let mut pc = vec![0i8; panels * k * PANEL_COLS];
    let mut ps = vec![0.0f32; panels * nb * PANEL_COLS];
    let mut po = vec![0.0f32; panels * nb * PANEL_COLS];
    for r in 0..n {
        let (p, c) = (r / PANEL_COLS, r % PANEL_COLS);
        for i in 0..k {
            pc[(p * k + i) * PANEL_COLS + c] = codes[r * k + i];
        }
        for b in 0..nb {
            ps[(p * nb + b) * PANEL_COLS + c] = scales[r * nb + b];
            po[(p * nb + b) * PANEL_COLS + c] = offsets[r * nb + b];
        }
    }
    (pc, ps, po)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        codes: Vec<i8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
        k: usize,
        n: usize,
        block: usize,
    }

    impl Case {
        fn new(k: usize, n: usize, block: usize, seed: usize) -> Self {
            let nb = k / block;
            Case {
                codes: (0..n * k)
                    .map(|i| (((i * 53 + seed) % 251) as i32 - 125) as i8)
                    .collect(),
                scales: (0..n * nb)
                    .map(|i| ((i * 7 + seed) % 13) as f32 / 1024.0 + 1.0 / 4096.0)
                    .collect(),
                offsets: (0..n * nb)
                    .map(|i| ((i * 11 + seed) % 9) as f32 / 64.0 - 0.0625)
                    .collect(),
                k,
                n,
                block,
            }
        }

        /// The weight as the file's dequantization computes it (fp32 `scale * code + offset`).
        fn weight(&self, r: usize, i: usize) -> f32 {
            let b = r * (self.k / self.block) + i / self.block;
            self.scales[b] * f32::from(self.codes[r * self.k + i]) + self.offsets[b]
        }

        fn run(&self, x: &[f32], t: usize) -> Vec<f32> {
            let (c, s, o) = to_panels(
                &self.codes,
                &self.scales,
                &self.offsets,
                self.k,
                self.n,
                self.block,
            );
            let w = BlockWeights {
                codes: &c,
                scales: &s,
                offsets: &o,
                in_features: self.k,
                out_features: self.n,
                block: self.block,
            };
            let mut out = vec![f32::NAN; t * self.n];
            matmul_blocks(x, w, t, &mut out).unwrap();
            out
        }
    }

    fn x_rows(t: usize, k: usize) -> Vec<f32> {
        (0..t * k).map(|i| (i as f32 * 0.37).sin()).collect()
    }

    #[test]
    fn matches_f64_on_tile_and_panel_remainders() {
        for &(t, k, n, block) in &[
            (1, 32, 1, 32),
            (3, 64, 17, 32),
            (4, 16, 16, 16),
            (5, 96, 37, 32),
            (9, 48, 33, 16),
            (2, 576, 70, 32),
        ] {
            let case = Case::new(k, n, block, t);
            let x = x_rows(t, k);
            let out = case.run(&x, t);
            for j in 0..t {
                for r in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| f64::from(x[j * k + i]) * f64::from(case.weight(r, i)))
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|i| (f64::from(x[j * k + i]) * f64::from(case.weight(r, i))).abs())
                        .sum();
                    let got = f64::from(out[j * n + r]);
                    assert!(
                        (got - want).abs() <= 1e-6 * scale + 1e-30,
                        "t={t} k={k} n={n}: [{j}, {r}] {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_sum_is_the_in_order_fma_chain_of_the_exact_weights() {
        let (t, k, n, block) = (6, 64, 19, 32);
        let case = Case::new(k, n, block, 3);
        let x = x_rows(t, k);
        let out = case.run(&x, t);
        for j in 0..t {
            for r in 0..n {
                let mut acc = 0.0f32;
                for i in 0..k {
                    acc = x[j * k + i].mul_add(case.weight(r, i), acc);
                }
                assert_eq!(out[j * n + r].to_bits(), acc.to_bits(), "[{j}, {r}]");
            }
        }
    }

    #[test]
    fn a_token_result_does_not_depend_on_its_batch() {
        let (k, n) = (64, 40);
        let case = Case::new(k, n, 16, 1);
        let x = x_rows(7, k);
        let all = case.run(&x, 7);
        for j in 0..7 {
            let one = case.run(&x[j * k..(j + 1) * k], 1);
            assert_eq!(one, all[j * n..(j + 1) * n], "row {j}");
        }
    }

    #[test]
    fn bad_shapes_are_refused_before_writing() {
        let case = Case::new(32, 16, 32, 0);
        let (c, s, o) = to_panels(&case.codes, &case.scales, &case.offsets, 32, 16, 32);
        let w = BlockWeights {
            codes: &c,
            scales: &s,
            offsets: &o,
            in_features: 32,
            out_features: 16,
            block: 32,
        };
        let mut out = vec![7.0f32; 16];
        assert!(matches!(
            matmul_blocks(&[1.0; 31], w, 1, &mut out),
            Err(CpuError::Shape(_))
        ));
        assert!(matches!(
            matmul_blocks(&[1.0; 32], w, usize::MAX, &mut out),
            Err(CpuError::Shape(_))
        ));
        for bad in [
            BlockWeights { block: 0, ..w },
            BlockWeights { block: 5, ..w },
            BlockWeights {
                out_features: 17,
                ..w
            },
            BlockWeights {
                out_features: usize::MAX,
                ..w
            },
            BlockWeights {
                scales: &s[1..],
                ..w
            },
            BlockWeights {
                codes: &c[1..],
                ..w
            },
        ] {
            assert!(matches!(
                matmul_blocks(&[1.0; 32], bad, 1, &mut out),
                Err(CpuError::Shape(_))
            ));
        }
        assert_eq!(out, vec![7.0; 16]);
    }
}
