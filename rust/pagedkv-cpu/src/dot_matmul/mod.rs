//! The model's projections with 8-bit activations and integer dot products: the `int8` weight
//! mode. The weights are the file's block codes, as in `block_matmul`; the activations of each
//! row are quantized per block of the weights' `block` inputs to codes `a` in -127..=127 with one
//! fp32 step `dx = max|x| / 127`, and each block's products are summed **exactly in integers**:
//!
//! `out[r, c] = sum over blocks b, in order: acc = fma(scale[b, c] * dx[r, b], isum[r, b, c], acc);
//!                                          acc = fma(offset[b, c], xsum[r, b], acc)`
//!
//! with `isum = sum_i a[r, i] * code[i, c]` (exact in i32, and exact as an f32 for blocks of up to
//! [`MAX_BLOCK`] inputs) and `xsum = dx * sum_i a[r, i]`, the block's *quantized* activations
//! summed. This is llama.cpp's arithmetic for its quantized matrices (`Q8_1` activations): every
//! term is the product of the rounded activations with the exact weights, so the error is
//! `sum_i e_i * w_i` for the rounding errors `e_i` (at most `dx / 2`). The exact fp32 sum of `x`
//! in the offset term would look more accurate and is not: the error would become
//! `sum_i e_i * scale * code_i`, and the codes are not centred (Q4_1's run 0..15 around an offset
//! near `-8 * scale`), which measured about twice the error on three of SmolLM2's matrices
//! (random activations with outlier channels; docs/cpu_data_plane.md, 8-bit activations). One
//! rounding of each activation to 8 bits buys 4x the multiply-adds per instruction (`vpdpbusd`,
//! `vnni`; `vpmaddubsw` on AVX2, `avx2`). Results do not depend on the batch, the tile a row
//! lands in, the thread count or the instruction set: the portable tile (`portable`), the AVX2
//! and the AVX-512 VNNI tiles compute the same integers and the same fp32 operations in the same
//! order, so they agree bit for bit (tested).
//!
//! Layout ([`to_dot_panels`]): panels of 16 output columns, as `block_matmul`; inside a panel, 64
//! bytes per group of inputs, byte `4 * c + j` for column `c`: one unsigned byte per code for
//! [`CodeFormat::I8`] (inputs `4g + j` of group `g`; the code plus 128), and for the 4-bit formats
//! the inputs `8h + j` in the low nibble and `8h + 4 + j` in the high one (the code plus 8 for
//! [`CodeFormat::I4`]). The bias makes every code unsigned, as `vpdpbusd` wants its first operand;
//! each block subtracts `bias * sum(a)` back (exact). Scales and offsets: `[panels, k / block, 16]`.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod operands;
mod portable;
#[cfg(target_arch = "x86_64")]
mod vnni;

use self::operands::{DotPanel, QuantRows};
pub use self::operands::{DOT_TILE, GROUP_BYTES};
use self::portable::portable_tile;
use crate::block_matmul::{
    check_panel_lengths, has_work, panel_scales, panel_tasks, CodeFormat, PANEL_COLS, ROW_CHUNK,
};
use crate::error::{CpuError, Result};

/// The largest block: `MAX_BLOCK * 255 * 127` stays below 2^24, so a block's integer sum is exact
/// as an f32.
pub const MAX_BLOCK: usize = 256;
impl CodeFormat {
    /// Inputs whose codes one 64-byte group holds: 4, or 8 for the formats packed two per byte.
    pub const fn dot_group_inputs(self) -> usize {
        match self {
            CodeFormat::I8 => 4,
            CodeFormat::U4 | CodeFormat::I4 => 8,
        }
    }

    /// What the dot layout adds to a code to make it unsigned.
    pub const fn dot_bias(self) -> i32 {
        match self {
            CodeFormat::I8 => 128,
            CodeFormat::I4 => 8,
            CodeFormat::U4 => 0,
        }
    }
}

/// Borrowed block-quantized weights in the dot layout of the module docs.
#[derive(Clone, Copy, Debug)]
pub struct DotWeights<'a> {
    /// `[panels, k / group_inputs, 64]` code bytes.
    pub codes: &'a [u8],
    pub format: CodeFormat,
    /// `[panels, k / block, 16]`.
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    /// Input features `k` (a multiple of `block`).
    pub in_features: usize,
    /// Output features `n`.
    pub out_features: usize,
    /// Inputs per scale/offset (and per activation step): a multiple of the format's group, at
    /// most [`MAX_BLOCK`].
    pub block: usize,
}

impl DotWeights<'_> {
    /// Every length and the block size checked, before any work.
    fn check(&self) -> Result<()> {
        let (k, block) = (self.in_features, self.block);
        let group = self.format.dot_group_inputs();
        if block == 0 || block % group != 0 || block > MAX_BLOCK || k % block != 0 {
            return Err(CpuError::Shape(format!(
                "dot weights: block {block} must be a multiple of {group} (the {:?} group), at \
                 most {MAX_BLOCK}, and divide in_features {k}",
                self.format
            )));
        }
        check_panel_lengths(
            "dot weights",
            [self.codes.len(), self.scales.len(), self.offsets.len()],
            self.format,
            k,
            self.out_features,
            block,
        )
    }
}

/// `out[t, n] = x[t, k] @ w` with 8-bit activations (module docs; `x`, `out` row-major). Lengths
/// are checked first: a mismatch is a [`CpuError::Shape`] and nothing is written.
pub fn matmul_dot(x: &[f32], w: DotWeights<'_>, t: usize, out: &mut [f32]) -> Result<()> {
    matmul_dot_with(x, w, t, out, Isa::detect())
}

/// Which tile runs: the AVX-512 VNNI one where the CPU has it, else the AVX2 one, else the
/// portable one. All three give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Isa {
    /// The fastest tile this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if vnni::available() {
                return Isa::Vnni;
            }
            if avx2::available() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU runs the tile.
    pub fn runs_here(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::available(),
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni => vnni::available(),
        }
    }

    /// Every tile this CPU can run (the tests compare them).
    pub fn all_available() -> Vec<Self> {
        let every = [
            Isa::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni,
        ];
        every.into_iter().filter(|isa| isa.runs_here()).collect()
    }
}

/// [`matmul_dot`] on a given tile (benchmarks and tests compare them); a tile this CPU cannot run
/// is a [`CpuError::Argument`].
pub fn matmul_dot_with(
    x: &[f32],
    w: DotWeights<'_>,
    t: usize,
    out: &mut [f32],
    isa: Isa,
) -> Result<()> {
    if !isa.runs_here() {
        return Err(CpuError::Argument(format!(
            "this CPU cannot run the {isa:?} tile"
        )));
    }
    w.check()?;
    let (k, n) = (w.in_features, w.out_features);
    if !has_work(x, t, k, n, out)? {
        return Ok(());
    }
    let nb = k / w.block;
    let group_bytes = k / w.format.dot_group_inputs() * GROUP_BYTES;
    for (xc, oc) in x.chunks(ROW_CHUNK * k).zip(out.chunks_mut(ROW_CHUNK * n)) {
        let rows = xc.len() / k;
        let q = QuantRows::new(xc, rows, k, w.block, w.format.dot_bias());
        panel_tasks(
            oc,
            rows,
            k,
            n,
            || (),
            |p, (), dst| {
                let panel = DotPanel {
                    codes: &w.codes[p * group_bytes..(p + 1) * group_bytes],
                    scales: &w.scales[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS],
                    offsets: &w.offsets[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS],
                    block: w.block,
                    format: w.format,
                };
                dot_panel(&q, panel, isa, dst);
            },
        );
    }
    Ok(())
}

/// Panel `w` times every row of `q`, into `dst` (`[t, 16]`): tiles of [`DOT_TILE`] rows.
fn dot_panel(q: &QuantRows, w: DotPanel<'_>, isa: Isa, dst: &mut [f32]) {
    for (tile, rows_out) in dst.chunks_mut(DOT_TILE * PANEL_COLS).enumerate() {
        let row0 = tile * DOT_TILE;
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni => vnni::tile(q, row0, w, rows_out),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::tile(q, row0, w, rows_out),
            Isa::Portable => portable_tile(q, row0, w, rows_out),
        }
    }
}

/// Row-major `[n, k]` codes and `[n, k / block]` scales/offsets (the file's order) as the dot
/// layout's panels in `format`: `(codes, scales, offsets)`, columns past `n` zero. The caller has
/// checked the lengths and that every code fits the format.
pub fn to_dot_panels(
    codes: &[i8],
    scales: &[f32],
    offsets: &[f32],
    k: usize,
    n: usize,
    block: usize,
    format: CodeFormat,
) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let panels = n.div_ceil(PANEL_COLS);
    let group = format.dot_group_inputs();
    let panel_bytes = k / group * GROUP_BYTES;
    let bias = format.dot_bias();
    let mut pc = vec![0u8; panels * panel_bytes];
    for p in 0..panels {
        // Padding columns hold the biased zero code, so their sums are exactly 0 like the rest.
        for i in 0..k {
            let (g, j) = (i / group, i % group);
            for c in 0..PANEL_COLS {
                let r = p * PANEL_COLS + c;
                let code = if r < n {
                    i32::from(codes[r * k + i])
                } else {
                    0
                };
                let biased = (code + bias) as u8;
                let at = p * panel_bytes + g * GROUP_BYTES + 4 * c + j % 4;
                match format {
                    CodeFormat::I8 => pc[at] = biased,
                    CodeFormat::U4 | CodeFormat::I4 => pc[at] |= (biased & 15) << (4 * (j / 4)),
                }
            }
        }
    }
    let (ps, po) = panel_scales(scales, offsets, n, k / block);
    (pc, ps, po)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [CodeFormat; 3] = [CodeFormat::I8, CodeFormat::U4, CodeFormat::I4];

    struct Case {
        codes: Vec<i8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
        k: usize,
        n: usize,
        block: usize,
        format: CodeFormat,
        panels: (Vec<u8>, Vec<f32>, Vec<f32>),
    }

    impl Case {
        fn new(k: usize, n: usize, block: usize, seed: usize, format: CodeFormat) -> Self {
            let nb = k / block;
            let (lo, span) = match format {
                CodeFormat::I8 => (-128, 256),
                CodeFormat::U4 => (0, 16),
                CodeFormat::I4 => (-8, 16),
            };
            let codes: Vec<i8> = (0..n * k)
                .map(|i| (((i * 53 + seed * 7) % span) as i32 + lo) as i8)
                .collect();
            let scales: Vec<f32> = (0..n * nb)
                .map(|i| ((i * 7 + seed) % 13) as f32 / 1024.0 + 1.0 / 4096.0)
                .collect();
            let offsets: Vec<f32> = (0..n * nb)
                .map(|i| ((i * 11 + seed) % 9) as f32 / 64.0 - 0.0625)
                .collect();
            let panels = to_dot_panels(&codes, &scales, &offsets, k, n, block, format);
            Case {
                codes,
                scales,
                offsets,
                k,
                n,
                block,
                format,
                panels,
            }
        }

        fn weights(&self) -> DotWeights<'_> {
            DotWeights {
                codes: &self.panels.0,
                format: self.format,
                scales: &self.panels.1,
                offsets: &self.panels.2,
                in_features: self.k,
                out_features: self.n,
                block: self.block,
            }
        }

        fn run(&self, x: &[f32], t: usize, isa: Isa) -> Vec<f32> {
            let mut out = vec![f32::NAN; t * self.n];
            matmul_dot_with(x, self.weights(), t, &mut out, isa).unwrap();
            out
        }

        /// The module docs' formula, written out independently of the kernel (row-major codes,
        /// its own quantization).
        fn reference(&self, x: &[f32], t: usize) -> Vec<f32> {
            let (k, n, block) = (self.k, self.n, self.block);
            let mut out = vec![0.0f32; t * n];
            for j in 0..t {
                for c in 0..n {
                    let mut acc = 0.0f32;
                    for b in 0..k / block {
                        let xb = &x[j * k + b * block..j * k + (b + 1) * block];
                        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                        let isum: i32 = (0..block)
                            .map(|i| {
                                let a = ((xb[i] * inv).round() as i32).clamp(-127, 127);
                                a * i32::from(self.codes[c * k + b * block + i])
                            })
                            .sum();
                        let asum: i32 = (0..block)
                            .map(|i| ((xb[i] * inv).round() as i32).clamp(-127, 127))
                            .sum();
                        let dx = amax / 127.0;
                        let step = self.scales[c * (k / block) + b] * dx;
                        acc = step.mul_add(isum as f32, acc);
                        acc = self.offsets[c * (k / block) + b].mul_add(dx * asum as f32, acc);
                    }
                    out[j * n + c] = acc;
                }
            }
            out
        }

        fn weight(&self, c: usize, i: usize) -> f32 {
            let b = c * (self.k / self.block) + i / self.block;
            self.scales[b] * f32::from(self.codes[c * self.k + i]) + self.offsets[b]
        }
    }

    fn x_rows(t: usize, k: usize) -> Vec<f32> {
        (0..t * k)
            .map(|i| (i as f32 * 0.37).sin() * (1.0 + (i % 5) as f32))
            .collect()
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vnni_path_runs_where_the_cpu_has_it() {
        let has = std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512bw");
        assert_eq!(Isa::detect() == Isa::Vnni, has);
        assert_eq!(
            Isa::all_available().contains(&Isa::Avx2),
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        );
    }

    fn isas() -> Vec<Isa> {
        Isa::all_available()
    }

    #[test]
    fn every_path_is_the_documented_formula_bit_for_bit() {
        for format in FORMATS {
            for &(t, k, n, block) in &[
                (1, 32, 1, 32),
                (3, 64, 17, 16),
                (8, 64, 16, 32),
                (9, 96, 33, 32),
                (13, 48, 40, 16),
                (20, 256, 19, 256),
            ] {
                let case = Case::new(k, n, block, t, format);
                let x = x_rows(t, k);
                let want = case.reference(&x, t);
                for isa in isas() {
                    let got = case.run(&x, t, isa);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{format:?} {isa:?} t={t} k={k} n={n} block={block}: [{i}] {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_error_is_bounded_by_the_activations_rounding() {
        // |x - dx * a| <= dx / 2 per input, so |out - x @ w| <= sum_b dx_b / 2 * sum |w| (plus
        // fp32 rounding, far smaller).
        for format in FORMATS {
            let (t, k, n, block) = (5, 128, 24, 32);
            let case = Case::new(k, n, block, 2, format);
            let x = x_rows(t, k);
            let got = case.run(&x, t, Isa::detect());
            for j in 0..t {
                for c in 0..n {
                    let exact: f64 = (0..k)
                        .map(|i| f64::from(x[j * k + i]) * f64::from(case.weight(c, i)))
                        .sum();
                    let bound: f64 = (0..k / block)
                        .map(|b| {
                            let xb = &x[j * k + b * block..j * k + (b + 1) * block];
                            let dx =
                                f64::from(xb.iter().fold(0.0f32, |m, v| m.max(v.abs()))) / 127.0;
                            (0..block)
                                .map(|i| dx / 2.0 * f64::from(case.weight(c, b * block + i)).abs())
                                .sum::<f64>()
                        })
                        .sum();
                    let err = (f64::from(got[j * n + c]) - exact).abs();
                    assert!(
                        err <= bound * 1.01 + 1e-5,
                        "{format:?} [{j}, {c}]: {err} > {bound}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_result_does_not_depend_on_its_batch() {
        for format in FORMATS {
            let (k, n, t) = (64, 40, 2 * ROW_CHUNK + 11);
            let case = Case::new(k, n, 16, 1, format);
            let x = x_rows(t, k);
            let all = case.run(&x, t, Isa::detect());
            for j in [0, 7, 8, 12, ROW_CHUNK, t - 1] {
                let one = case.run(&x[j * k..(j + 1) * k], 1, Isa::detect());
                assert_eq!(one, all[j * n..(j + 1) * n], "{format:?} row {j}");
            }
        }
    }

    #[test]
    fn zeros_and_non_finite_rows() {
        let (k, n) = (64, 16);
        let case = Case::new(k, n, 32, 3, CodeFormat::U4);
        let mut x = x_rows(3, k);
        x[..k].fill(0.0);
        x[k + 5] = f32::NAN;
        x[2 * k + 40] = f32::INFINITY;
        for isa in isas() {
            let out = case.run(&x, 3, isa);
            assert!(
                out[..n].iter().all(|&v| v == 0.0),
                "{isa:?}: zeros in, zeros out"
            );
            assert!(
                out[n..].iter().all(|v| !v.is_finite()),
                "{isa:?}: {:?}",
                &out[n..]
            );
        }
    }

    #[test]
    fn bad_shapes_are_refused_before_writing() {
        let case = Case::new(32, 16, 32, 0, CodeFormat::U4);
        let w = case.weights();
        let mut out = vec![7.0f32; 16];
        assert!(matches!(
            matmul_dot(&[1.0; 31], w, 1, &mut out),
            Err(CpuError::Shape(_))
        ));
        assert!(matches!(
            matmul_dot(&[1.0; 32], w, usize::MAX, &mut out),
            Err(CpuError::Shape(_))
        ));
        for bad in [
            DotWeights { block: 0, ..w },
            DotWeights { block: 4, ..w },
            DotWeights {
                block: 512,
                in_features: 512,
                ..w
            },
            DotWeights {
                out_features: 17,
                ..w
            },
            DotWeights {
                out_features: usize::MAX,
                ..w
            },
            DotWeights {
                format: CodeFormat::I8,
                ..w
            },
            DotWeights {
                scales: &w.scales[1..],
                ..w
            },
            DotWeights {
                codes: &w.codes[1..],
                ..w
            },
        ] {
            assert!(matches!(
                matmul_dot(&[1.0; 32], bad, 1, &mut out),
                Err(CpuError::Shape(_))
            ));
        }
        assert_eq!(out, vec![7.0; 16]);
    }
}
