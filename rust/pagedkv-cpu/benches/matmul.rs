//! The bf16-weight projection kernel at SmolLM2-135M's shapes (k = 576, n = 1536 and the 49152-row
//! output projection) for 1 and 32 tokens: GFLOP/s and weight GB/s, best of REPS:
//! `cargo bench -p pagedkv-cpu --bench matmul [-- REPS [TOKENS]]`.

use std::hint::black_box;
use std::time::Instant;

use pagedkv_cpu::matmul::to_panels;
use pagedkv_cpu::{bf16, matmul_bf16};

fn main() {
    let reps: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    for &(t, k, n) in &[
        (1usize, 576usize, 1536usize),
        (32, 576, 1536),
        (1, 576, 49152),
        (32, 576, 49152),
    ] {
        let x: Vec<f32> = (0..t * k).map(|i| (i % 17) as f32 / 17.0).collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 31) % 101) as f32 / 101.0 - 0.5))
            .collect();
        let w = to_panels(&w, k, n);
        let mut out = vec![0.0f32; t * n];
        let best = (0..reps)
            .map(|_| {
                let s = Instant::now();
                matmul_bf16(&x, &w, t, k, n, &mut out).unwrap();
                black_box(&out);
                s.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        println!(
            "t={t:>2} k={k} n={n:>5}: {:8.3} ms  {:6.1} GFLOP/s  {:5.2} GB/s of weights",
            best * 1e3,
            2.0 * (t * k * n) as f64 / best / 1e9,
            (2 * k * n) as f64 / best / 1e9
        );
    }
}
