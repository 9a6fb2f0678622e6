//! The block-quantized projection kernel at SmolLM2-135M's shapes (k = 576 into the fused QKV
//! 960, the fused gate/up 3072, k = 1536 into 576, and the 49152-row output projection) for 1, 8
//! and 32 tokens, SmolLM2's formats (4-bit codes for the Q4_1 layers, int8 for the Q8_0 output):
//! GFLOP/s and code GB/s, best of REPS, for fp32 activations (`matmul_blocks`) and, on the
//! lines below, 8-bit activations with integer dot products (`matmul_dot`, the `int8` mode, on
//! the CPU's fastest tile, then on its other SIMD tiles):
//! `cargo bench -p pagedkv-cpu --bench block_matmul [-- REPS]`.

use std::hint::black_box;
use std::time::Instant;

use pagedkv_cpu::block_matmul::{to_panels, CodeFormat};
use pagedkv_cpu::dot_matmul::{matmul_dot_with, to_dot_panels, Isa};
use pagedkv_cpu::{matmul_blocks, matmul_dot, BlockWeights, DotWeights};

fn main() {
    let reps: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let block = 32;
    for &(k, n, format) in &[
        (576usize, 960usize, CodeFormat::U4),
        (576, 3072, CodeFormat::U4),
        (1536, 576, CodeFormat::U4),
        (576, 49152, CodeFormat::I8),
    ] {
        let nb = k / block;
        let codes: Vec<i8> = (0..n * k).map(|i| ((i * 31) % 16) as i8).collect();
        let scales: Vec<f32> = (0..n * nb).map(|i| (i % 7) as f32 / 700.0).collect();
        let offsets: Vec<f32> = (0..n * nb).map(|i| (i % 5) as f32 / -500.0).collect();
        let (c, s, o) = to_panels(&codes, &scales, &offsets, k, n, block, format);
        let w = BlockWeights {
            codes: &c,
            format,
            scales: &s,
            offsets: &o,
            in_features: k,
            out_features: n,
            block,
        };
        let (dc, ds, dof) = to_dot_panels(&codes, &scales, &offsets, k, n, block, format);
        let dw = DotWeights {
            codes: &dc,
            format,
            scales: &ds,
            offsets: &dof,
            in_features: k,
            out_features: n,
            block,
        };
        for t in [1usize, 8, 32] {
            let x: Vec<f32> = (0..t * k).map(|i| (i % 17) as f32 / 17.0).collect();
            let mut out = vec![0.0f32; t * n];
            let mut best = |f: &mut dyn FnMut(&mut [f32])| {
                (0..reps)
                    .map(|_| {
                        let start = Instant::now();
                        f(&mut out);
                        black_box(&out);
                        start.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let fp32 = best(&mut |o| matmul_blocks(&x, w, t, o).unwrap());
            let int8 = best(&mut |o| matmul_dot(&x, dw, t, o).unwrap());
            let mut rows = vec![
                ("fp32".to_string(), fp32),
                (format!("int8 {:?}", Isa::detect()), int8),
            ];
            for isa in Isa::all_available() {
                if isa != Isa::detect() && isa != Isa::Portable {
                    let secs = best(&mut |o| matmul_dot_with(&x, dw, t, o, isa).unwrap());
                    rows.push((format!("int8 {isa:?}"), secs));
                }
            }
            for (name, secs) in rows {
                println!(
                    "t={t:>2} k={k:>4} n={n:>5} {format:?} {name}: {:8.3} ms  {:6.1} GFLOP/s  {:5.2} GB/s of codes",
                    secs * 1e3,
                    2.0 * (t * k * n) as f64 / secs / 1e9,
                    (k * n * format.row_bytes() / 16) as f64 / secs / 1e9
                );
            }
        }
    }
}
