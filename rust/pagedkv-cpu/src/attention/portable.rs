//! The two inner loops' arithmetic in plain Rust (`simd` docs define it): the reference every
//! intrinsic path matches bit for bit, and the portable path itself. A leaf: the intrinsic
//! paths (`avx2`, `avx512`) take [`LANES`] from here and `simd` dispatches to all three, so
//! no path imports the dispatcher back.

/// Lanes of the partial sums.
pub const LANES: usize = 16;

/// The fixed reduction tree (`simd` docs).
#[inline(always)]
pub fn reduce(p: [f32; LANES]) -> f32 {
    let s: [f32; 8] = std::array::from_fn(|l| p[l] + p[l + 8]);
    let t: [f32; 4] = std::array::from_fn(|l| s[l] + s[l + 4]);
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// `q . k` with the scores' arithmetic (`simd` docs; rows of equal length).
#[inline(always)]
pub fn dot(q: &[f32], k: &[f32]) -> f32 {
    debug_assert_eq!(q.len(), k.len());
    let n = q.len().min(k.len());
    let (q, k) = (&q[..n], &k[..n]);
    let mut acc = [0.0f32; LANES];
    let (cq, ck) = (q.chunks_exact(LANES), k.chunks_exact(LANES));
    let (rq, rk) = (cq.remainder(), ck.remainder());
    for (x, y) in cq.zip(ck) {
        // Fixed-size chunks: no bounds checks, and LLVM keeps `acc` in vector registers.
        let x: &[f32; LANES] = x.try_into().expect("chunks_exact");
        let y: &[f32; LANES] = y.try_into().expect("chunks_exact");
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in rq.iter().zip(rk).enumerate() {
        acc[l] += x * y;
    }
    reduce(acc)
}

/// `[dot(q, k[0]), .., dot(q, k[3])]` in plain Rust.
// Always inlined: a call would run the baseline build, not the caller's multiversioned one.
#[inline(always)]
pub fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    [dot(q, k[0]), dot(q, k[1]), dot(q, k[2]), dot(q, k[3])]
}
