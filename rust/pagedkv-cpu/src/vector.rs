//! Row loops of attention's softmax and value pass and of the RMS norm, written so that LLVM
//! vectorises them without `unsafe`: fp32 addition is not associative, so a plain `sum()` stays
//! scalar; these loops keep `LANES` independent partial sums which the compiler maps onto vector
//! registers. docs/cpu_data_plane.md shows the checked assembly. (Attention's q.k products have
//! their own arithmetic and SIMD paths: `attention::simd`.)

/// Independent partial sums in `dot`: one AVX register, two SSE registers.
pub const LANES: usize = 8;

/// Dot product of two equal-length fp32 rows.
#[inline(always)]
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
    reduce(acc, tail)
}

/// The fixed pairwise reduction of `LANES` partial sums plus a tail (results do not depend on
/// threads).
#[inline(always)]
fn reduce(acc: [f32; LANES], tail: f32) -> f32 {
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1] + tail
}

/// `acc += p[0] * v[0] + .. + p[3] * v[3]`, added left to right, so bit for bit four
/// `add_scaled` calls, with one load and store of `acc` instead of four.
// Always inlined: a call would run the baseline build, not the caller's multiversioned one.
#[inline(always)]
pub fn add_scaled4(acc: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
    let n = v.iter().fold(acc.len(), |n, r| n.min(r.len()));
    let [v0, v1, v2, v3] = v.map(|r| &r[..n]);
    let rows = acc[..n].iter_mut().zip(v0).zip(v1).zip(v2).zip(v3);
    for ((((a, x0), x1), x2), x3) in rows {
        *a = *a + p[0] * x0 + p[1] * x1 + p[2] * x2 + p[3] * x3;
    }
}

/// Largest element of a row, NaN ignored (`f32::max`); `-inf` for an empty or all-NaN row.
/// `LANES` partial maxima: exact in any order, and vectorised, unlike a scalar fold.
// Always inlined: a call would run the baseline build, not the caller's multiversioned one.
#[inline(always)]
pub fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for x in chunks {
        let x: &[f32; LANES] = x.try_into().expect("chunks_exact");
        for i in 0..LANES {
            acc[i] = acc[i].max(x[i]);
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

/// Sum of a row with `LANES` partial sums (vectorised) and a fixed reduction order.
// Always inlined: a call would run the baseline build, not the caller's multiversioned one.
#[inline(always)]
pub fn sum(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for x in chunks {
        let x: &[f32; LANES] = x.try_into().expect("chunks_exact");
        for i in 0..LANES {
            acc[i] += x[i];
        }
    }
    reduce(acc, tail)
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
    fn add_scaled4_is_bit_for_bit_the_single_row_loop() {
        for n in [0usize, 1, 7, 8, 9, 33, 64, 70] {
            let row = |s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin() * 3.0).collect() };
            let q = row(0.37);
            let ks = [row(0.11), row(0.5), row(1.3), row(-0.7)];
            let k = [&ks[0][..], &ks[1][..], &ks[2][..], &ks[3][..]];
            let p = [0.3f32, -1.7, 2.5e-3, 11.0];
            let (mut a, mut b) = (row(0.9), row(0.9));
            add_scaled4(&mut a, p, k);
            for (pi, r) in p.iter().zip(k) {
                add_scaled(&mut b, *pi, r);
            }
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "n={n}"
            );
            let want_max = q.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&q), want_max, "n={n}");
            let want_sum: f64 = q.iter().map(|&x| f64::from(x)).sum();
            assert!((f64::from(sum(&q)) - want_sum).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn max_ignores_nan_and_handles_empty_rows() {
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN; 11]), f32::NEG_INFINITY);
        let mut row = vec![f32::NEG_INFINITY; 19];
        row[3] = f32::NAN;
        row[17] = -4.0;
        assert_eq!(max(&row), -4.0);
        row[9] = 2.0;
        assert_eq!(max(&row), 2.0);
    }

    #[test]
    fn add_scaled_adds_p_times_v() {
        let mut acc = vec![2.5f32, 3.0, 3.5];
        add_scaled(&mut acc, -1.0, &[0.5, 0.0, 0.5]);
        assert_eq!(acc, vec![2.0, 3.0, 3.0]);
    }
}
