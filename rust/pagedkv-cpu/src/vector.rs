//! The two inner loops of attention, written so that LLVM vectorises them without `unsafe`:
//! fp32 addition is not associative, so a plain `sum()` stays scalar; these loops keep `LANES`
//! independent partial sums (one SIMD register's worth each at AVX-512, two at AVX2) which the
//! compiler maps onto vector registers. docs/cpu_data_plane.md shows the checked assembly.

/// Independent partial sums in `dot`.
pub const LANES: usize = 16;

/// Dot product of two equal-length fp32 rows.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    // Pairwise reduction of the partial sums (fixed order: results do not depend on threads).
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail
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
