//! The block-quantized matmul against its definition (f64 and the in-order fma chain of the exact
//! weights), batch independence, and the shape checks.

use super::*;

struct Case {
    codes: Vec<i8>,
    scales: Vec<f32>,
    offsets: Vec<f32>,
    k: usize,
    n: usize,
    block: usize,
    format: CodeFormat,
}

const FORMATS: [CodeFormat; 3] = [CodeFormat::I8, CodeFormat::U4, CodeFormat::I4];

impl Case {
    fn new(k: usize, n: usize, block: usize, seed: usize) -> Self {
        Self::with_format(k, n, block, seed, CodeFormat::I8)
    }

    fn with_format(k: usize, n: usize, block: usize, seed: usize, format: CodeFormat) -> Self {
        let nb = k / block;
        let (lo, span) = match format {
            CodeFormat::I8 => (-125, 251),
            CodeFormat::U4 => (0, 16),
            CodeFormat::I4 => (-8, 16),
        };
        Case {
            codes: (0..n * k)
                .map(|i| (((i * 53 + seed) % span) as i32 + lo) as i8)
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
            format,
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
            self.format,
        );
        let w = BlockWeights {
            codes: &c,
            format: self.format,
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
    // Both paths (up to 4 rows: in registers; 5 and more: a dequantized panel) and every
    // code format.
    for (format, t) in FORMATS.into_iter().flat_map(|f| [(f, 3), (f, 6), (f, 13)]) {
        let (k, n, block) = (64, 19, 32);
        let case = Case::with_format(k, n, block, 3, format);
        let x = x_rows(t, k);
        let out = case.run(&x, t);
        for j in 0..t {
            for r in 0..n {
                let mut acc = 0.0f32;
                for i in 0..k {
                    acc = x[j * k + i].mul_add(case.weight(r, i), acc);
                }
                assert_eq!(
                    out[j * n + r].to_bits(),
                    acc.to_bits(),
                    "{format:?} t={t} [{j}, {r}]"
                );
            }
        }
    }
}

#[test]
fn a_token_result_does_not_depend_on_its_batch() {
    for format in FORMATS {
        let (k, n) = (64, 40);
        let case = Case::with_format(k, n, 16, 1, format);
        let x = x_rows(13, k);
        let all = case.run(&x, 13);
        for j in 0..13 {
            let one = case.run(&x[j * k..(j + 1) * k], 1);
            assert_eq!(one, all[j * n..(j + 1) * n], "{format:?} row {j}");
        }
    }
}

#[test]
fn rows_past_a_chunk_are_the_same_as_alone() {
    let (k, n, t) = (32, 21, 2 * ROW_CHUNK + 7);
    let case = Case::with_format(k, n, 16, 2, CodeFormat::U4);
    let x = x_rows(t, k);
    let all = case.run(&x, t);
    for j in [0, ROW_CHUNK - 1, ROW_CHUNK, 2 * ROW_CHUNK + 1, t - 1] {
        let one = case.run(&x[j * k..(j + 1) * k], 1);
        assert_eq!(one, all[j * n..(j + 1) * n], "row {j}");
    }
}

#[test]
fn bad_shapes_are_refused_before_writing() {
    let case = Case::new(32, 16, 32, 0);
    let (c, s, o) = to_panels(
        &case.codes,
        &case.scales,
        &case.offsets,
        32,
        16,
        32,
        CodeFormat::I8,
    );
    let w = BlockWeights {
        codes: &c,
        format: CodeFormat::I8,
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
