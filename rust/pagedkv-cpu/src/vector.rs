//! The two inner loops of attention, written so that LLVM vectorises them without `unsafe`:
//! fp32 addition is not associative, so a plain `sum()` stays scalar; these loops keep `LANES`
//! independent partial sums which the compiler maps onto vector registers. docs/cpu_data_plane.md shows the checked assembly.

/// Independent partial sums in `dot`: one AVX register, two SSE registers.
pub const LANES: usize = 8;

/// Dot product of two equal-length fp32 rows.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        // Fixed-size chunks: no bounds checks, and LLVM keeps `acc` in vector registers.
        let x: &[f32; LANES] = x.try_into().expect("chunks_exact");
        let y: &[f32; LANES] = y.try_into().expect("chunks_exact");
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    // Pairwise reduction of the partial sums (fixed order: results do not depend on threads).
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1] + tail
}

/// `acc = acc * scale + p * v`, elementwise over equal-length rows.
#[inline]
pub fn scale_add(acc: &mut [f32], scale: f32, p: f32, v: &[f32]) {
    debug_assert_eq!(acc.len(), v.len());
    for (a, x) in acc.iter_mut().zip(v) {
        *a = *a * scale + p * x;
    }
}

/// `acc += p * v`, elementwise over equal-length rows.
#[inline]
pub fn add_scaled(acc: &mut [f32], p: f32, v: &[f32]) {
    debug_assert_eq!(acc.len(), v.len());
    for (a, x) in acc.iter_mut().zip(v) {
        *a += p * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_sum_on_every_tail_length() {
        for n in 0..70 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }

    #[test]
    fn scale_add_and_add_scaled() {
        let mut acc = vec![1.0f32, 2.0, 3.0];
        scale_add(&mut acc, 0.5, 2.0, &[1.0, 1.0, 1.0]);
        assert_eq!(acc, vec![2.5, 3.0, 3.5]);
        add_scaled(&mut acc, -1.0, &[0.5, 0.0, 0.5]);
        assert_eq!(acc, vec![2.0, 3.0, 3.0]);
    }
}
