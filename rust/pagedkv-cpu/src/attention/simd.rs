//! Attention's two inner loops, each with one arithmetic on every path so that a result has the
//! same bits whichever code computes it:
//!
//! - **Scores** (`q . k`): 16 lanes, lane `l` summing `q[16c + l] * k[16c + l]` over chunks `c`
//!   in order (a multiply, then an add, from +0; a short last chunk adds only its own lanes), then
//!   the fixed tree `s[l] = p[l] + p[l + 8]`, `t[l] = s[l] + s[l + 4]`, `u[l] = t[l] + t[l + 2]`,
//!   `u[0] + u[1]`.
//! - **Values** (`acc += p[0] v[0] + .. + p[3] v[3]`): per element, added left to right
//!   (`vector::add_scaled4`, bit for bit four `add_scaled` calls).
//!
//! Three implementations behind [`Simd`], picked once per kernel call: plain Rust (vectorised by
//! the caller's multiversioned build, `portable`) and intrinsics on AVX2 (`avx2`) and AVX-512
//! (`avx512`): four keys against one query with the four reduction trees interleaved in
//! registers, and the value rows of one KV head's group of queries in one call. Intrinsics because
//! the compiler's own code was far off: LLVM vectorised the plain 8-lane dot of the previous
//! version into 2-float `xmm` operations inside the AVX-512 build, the plain 16-lane reduction
//! runs scalar on AVX2, and each plain value call spends more instructions on set-up and run-time
//! alias checks than on its loop (perf annotate and callgrind: docs/cpu_data_plane.md, How it is
//! built; benches/results/2026-12-03-cpu-attention.md, "Where each step came from").

#[cfg(target_arch = "x86_64")]
use super::avx2::Avx2;
#[cfg(target_arch = "x86_64")]
use super::avx512::Avx512;
use super::portable::dot4;
use crate::vector::add_scaled4;

/// Which implementation of the two inner loops runs: the plain loops or an intrinsic path the CPU
/// has, all with the same bits.
#[derive(Debug, Clone, Copy)]
pub enum Simd {
    /// The plain loop, vectorised by the caller's multiversioned build.
    Portable,
    #[cfg(target_arch = "x86_64")]
    /// `avx2`.
    Avx2(Avx2),
    #[cfg(target_arch = "x86_64")]
    /// `avx512`.
    Avx512(Avx512),
}

impl Simd {
    /// The fastest path this CPU runs (chosen once per call of the kernel).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(simd) = Avx512::detect() {
                return Simd::Avx512(simd);
            }
            if let Some(simd) = Avx2::detect() {
                return Simd::Avx2(simd);
            }
        }
        Simd::Portable
    }

    /// Every path this CPU runs, slowest first (tests compare them).
    #[cfg(test)]
    pub fn available() -> Vec<Self> {
        let mut paths = vec![Simd::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            paths.extend(Avx2::detect().map(Simd::Avx2));
            paths.extend(Avx512::detect().map(Simd::Avx512));
        }
        paths
    }

    /// `acc_j += p[j][0] * v[0] + .. + p[j][3] * v[3]` for the consecutive accumulator rows
    /// `acc_j = acc[j * hd..(j + 1) * hd]` (`hd` the value rows' length, `acc.len() == p.len() *
    /// hd`), added left to right: bit for bit `vector::add_scaled4` per row on every path.
    #[inline(always)]
    pub fn add_scaled4_rows(self, acc: &mut [f32], p: &[[f32; 4]], v: [&[f32]; 4]) {
        match self {
            Simd::Portable => {
                let hd = v[0].len();
                for (a, pj) in acc.chunks_exact_mut(hd.max(1)).zip(p) {
                    add_scaled4(a, *pj, v);
                }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(simd) => simd.add_scaled4_rows(acc, p, v),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(simd) => simd.add_scaled4_rows(acc, p, v),
        }
    }

    /// `out[j] = dot4(q_j, k)` for the consecutive query rows `q_j = q[j * hd..(j + 1) * hd]`
    /// (`hd` the keys' length, `q.len() == out.len() * hd`), on the chosen path: the same bits
    /// either way.
    #[inline(always)]
    pub fn dot4_rows(self, q: &[f32], k: [&[f32]; 4], out: &mut [[f32; 4]]) {
        match self {
            Simd::Portable => {
                let hd = k[0].len();
                for (o, qj) in out.iter_mut().zip(q.chunks_exact(hd.max(1))) {
                    *o = dot4(qj, k);
                }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(simd) => simd.dot4_rows(q, k, out),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(simd) => simd.dot4_rows(q, k, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::portable::{dot, LANES};

    fn row(n: usize, s: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * s).sin() * 3.0).collect()
    }

    #[test]
    fn dot_is_the_documented_lane_sum_and_tree() {
        for n in 0..100 {
            let (q, k) = (row(n, 0.37), row(n, 0.11));
            // The module docs' arithmetic written out independently.
            let mut p = [0.0f32; LANES];
            for i in 0..n {
                p[i % LANES] += q[i] * k[i];
            }
            let mut w = p.to_vec();
            while w.len() > 1 {
                let h = w.len() / 2;
                w = (0..h).map(|l| w[l] + w[l + h]).collect();
            }
            assert_eq!(dot(&q, &k).to_bits(), w[0].to_bits(), "n={n}");
            let want: f64 = q.iter().zip(&k).map(|(a, b)| f64::from(a * b)).sum();
            assert!((f64::from(dot(&q, &k)) - want).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn every_dot4_path_gives_the_single_dot_bits() {
        for n in [0usize, 1, 7, 15, 16, 17, 33, 64, 70, 128, 200, 256] {
            let q = row(n, 0.37);
            let ks = [row(n, 0.11), row(n, 0.5), row(n, 1.3), row(n, -0.7)];
            let k = [&ks[0][..], &ks[1][..], &ks[2][..], &ks[3][..]];
            let want = k.map(|r| dot(&q, r).to_bits());
            assert_eq!(dot4(&q, k).map(f32::to_bits), want, "n={n}");
            for simd in Simd::available() {
                let mut out = [[0.0f32; 4]; 3];
                let qs = [q.clone(), q.clone(), q.clone()].concat();
                simd.dot4_rows(&qs, k, &mut out);
                for o in out {
                    assert_eq!(o.map(f32::to_bits), want, "{simd:?} n={n}");
                }
            }
        }
    }

    /// Equal bits, or both NaN (which NaN payload survives an add is the hardware's choice).
    fn same(a: [f32; 4], b: [f32; 4]) -> bool {
        a.iter()
            .zip(&b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn every_value_path_gives_the_single_row_bits() {
        for n in [0usize, 1, 7, 8, 15, 16, 17, 33, 64, 70, 128, 200] {
            let vs = [row(n, 0.11), row(n, 0.5), row(n, 1.3), row(n, -0.7)];
            let v = [&vs[0][..], &vs[1][..], &vs[2][..], &vs[3][..]];
            let p = [
                [0.3f32, -1.7, 2.5e-3, 11.0],
                [1.0, 0.0, -0.0, 1e-30],
                [f32::MIN_POSITIVE, 7.5, -2.25, 0.125],
            ];
            let start = [row(n, 0.9), row(n, -0.2), row(n, 2.1)].concat();
            let mut want = start.clone();
            for (a, pj) in want.chunks_exact_mut(n.max(1)).zip(&p) {
                add_scaled4(a, *pj, v);
            }
            for simd in Simd::available() {
                let mut got = start.clone();
                simd.add_scaled4_rows(&mut got, &p, v);
                let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{simd:?} n={n}");
            }
            // Infinities, NaN, extremes and subnormals in the values and the accumulators.
            if n == 0 {
                continue;
            }
            let specials = [
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                f32::MAX,
                1e-45,
                -0.0,
            ];
            for (i, &x) in specials.iter().enumerate() {
                let mut vs = vs.clone();
                vs[i % 4][(i * 5) % n] = x;
                let v = [&vs[0][..], &vs[1][..], &vs[2][..], &vs[3][..]];
                let mut start = start.clone();
                let at = (i * 11) % start.len();
                start[at] = -x;
                let mut want = start.clone();
                for (a, pj) in want.chunks_exact_mut(n).zip(&p) {
                    add_scaled4(a, *pj, v);
                }
                for simd in Simd::available() {
                    let mut got = start.clone();
                    simd.add_scaled4_rows(&mut got, &p, v);
                    for (g, w) in got.iter().zip(&want) {
                        let ok = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                        assert!(ok, "{simd:?} n={n} x={x}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn special_values_follow_the_same_arithmetic() {
        let specials = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            -f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
        ];
        for n in [5usize, 16, 21, 64] {
            for (i, &x) in specials.iter().enumerate() {
                let mut q = row(n, 0.37);
                let mut k = row(n, 0.11);
                q[(i * 7) % n] = x;
                k[(i * 3) % n] = -x;
                let ks = [&k[..], &q[..], &k[..], &q[..]];
                let want = ks.map(|r| dot(&q, r));
                for simd in Simd::available() {
                    let mut out = [[0.0f32; 4]; 1];
                    simd.dot4_rows(&q, ks, &mut out);
                    assert!(same(out[0], want), "{simd:?} n={n} x={x}");
                }
            }
        }
    }
}
