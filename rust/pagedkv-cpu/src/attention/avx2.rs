//! Attention's inner loops on AVX2, the same bits as the plain loops (`simd` docs).
//! Scores, four keys at once: a key's 16 partial-sum lanes are two 8-lane registers (`vmulps` +
//! `vaddps` per chunk of 16), the first tree level adds them, and the other three run for the
//! four keys together (two keys per register after the second level, four after the third):
//! a few instructions per score, a fraction of the plain loop's scalar reduction
//! (docs/cpu_data_plane.md, How it is built). Values: a group's
//! accumulator rows in one call, 8 elements per register, the four probabilities of a row
//! broadcast once.
//!
//! The `unsafe` here: unaligned vector loads and stores on fixed-size array references (in bounds
//! by type) and the call into the `#[target_feature]` function, which only an [`Avx2`] value can
//! make, and one exists only where the CPU reported AVX2 at run time.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_loadu_ps,
    _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps,
    _mm256_storeu_ps, _mm_storeu_ps, _mm_unpacklo_ps,
};
use std::sync::OnceLock;

use super::portable::LANES;

/// Lanes of one AVX2 register: half of a key's partial sums.
const HALF: usize = LANES / 2;

/// Proof that this CPU has AVX2: the only way to reach the intrinsic code.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` where the CPU runs AVX2 (checked once per process).
    pub(crate) fn detect() -> Option<Self> {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        let yes = *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"));
        yes.then_some(Avx2(()))
    }

    /// `acc_j += p[j] . v` for consecutive accumulator rows, bit for bit `vector::add_scaled4`.
    #[inline(always)]
    pub(crate) fn add_scaled4_rows(self, acc: &mut [f32], p: &[[f32; 4]], v: [&[f32]; 4]) {
        // SAFETY: `self` exists only where `detect` saw AVX2.
        unsafe { add_scaled4_rows(acc, p, v) }
    }

    /// `out[j] = dot4(q_j, k)` for consecutive query rows, bit for bit `portable::dot4`.
    #[inline(always)]
    pub(crate) fn dot4_rows(self, q: &[f32], k: [&[f32]; 4], out: &mut [[f32; 4]]) {
        // SAFETY: `self` exists only where `detect` saw AVX2.
        unsafe { dot4_rows(q, k, out) }
    }
}

#[inline(always)]
fn load(x: &[f32]) -> __m256 {
    let x: &[f32; HALF] = x.try_into().expect("8 fp32 values");
    // SAFETY: an unaligned load of exactly the 8 floats the array reference covers.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[inline(always)]
fn store(x: &mut [f32], value: __m256) {
    let x: &mut [f32; HALF] = x.try_into().expect("8 fp32 values");
    // SAFETY: an unaligned store of exactly the 8 floats the array reference covers.
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), value) }
}

#[target_feature(enable = "avx2")]
fn add_scaled4_rows(acc: &mut [f32], p: &[[f32; 4]], v: [&[f32]; 4]) {
    let hd = v.iter().fold(v[0].len(), |n, r| n.min(r.len()));
    // Rows cut to one length and walked in fixed-size chunks: no bounds check in the loop.
    let (v0, v1, v2, v3) = (&v[0][..hd], &v[1][..hd], &v[2][..hd], &v[3][..hd]);
    for (j, pj) in p.iter().enumerate() {
        let a = &mut acc[j * hd..(j + 1) * hd];
        let pv = [0, 1, 2, 3].map(|e| _mm256_set1_ps(pj[e]));
        let mut chunks = a.chunks_exact_mut(HALF);
        let vs = v0
            .chunks_exact(HALF)
            .zip(v1.chunks_exact(HALF))
            .zip(v2.chunks_exact(HALF))
            .zip(v3.chunks_exact(HALF));
        for (x, (((y0, y1), y2), y3)) in (&mut chunks).zip(vs) {
            let mut r = load(x);
            r = _mm256_add_ps(r, _mm256_mul_ps(pv[0], load(y0)));
            r = _mm256_add_ps(r, _mm256_mul_ps(pv[1], load(y1)));
            r = _mm256_add_ps(r, _mm256_mul_ps(pv[2], load(y2)));
            r = _mm256_add_ps(r, _mm256_mul_ps(pv[3], load(y3)));
            store(x, r);
        }
        // The last `hd % HALF` elements, one at a time: the same operations per element.
        let full = hd - hd % HALF;
        for (d, x) in (full..).zip(chunks.into_remainder()) {
            *x = *x + pj[0] * v0[d] + pj[1] * v1[d] + pj[2] * v2[d] + pj[3] * v3[d];
        }
    }
}

#[target_feature(enable = "avx2")]
fn dot4_rows(q: &[f32], k: [&[f32]; 4], out: &mut [[f32; 4]]) {
    let hd = k[0].len();
    for (j, o) in out.iter_mut().enumerate() {
        dot4(&q[j * hd..(j + 1) * hd], k, o);
    }
}

/// `out = [dot(q, k[0]), .., dot(q, k[3])]`.
#[target_feature(enable = "avx2")]
#[inline]
fn dot4(q: &[f32], k: [&[f32]; 4], out: &mut [f32; 4]) {
    let n = k.iter().fold(q.len(), |n, r| n.min(r.len()));
    let full = n / LANES * LANES;
    // Rows cut to one length and walked in fixed-size chunks: no bounds check in the loop.
    let (q, k0, k1, k2, k3) = (&q[..n], &k[0][..n], &k[1][..n], &k[2][..n], &k[3][..n]);
    // Lanes 0-7 and 8-15 of each key's partial sums.
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    let ks = k0
        .chunks_exact(LANES)
        .zip(k1.chunks_exact(LANES))
        .zip(k2.chunks_exact(LANES))
        .zip(k3.chunks_exact(LANES));
    for (qc, (((c0, c1), c2), c3)) in q.chunks_exact(LANES).zip(ks) {
        let (q0, q1) = (load(&qc[..HALF]), load(&qc[HALF..]));
        for (i, kc) in [c0, c1, c2, c3].into_iter().enumerate() {
            lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(q0, load(&kc[..HALF])));
            hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(q1, load(&kc[HALF..])));
        }
    }
    if full < n {
        // A short last chunk, zero-padded: `p + 0 * 0` is `p` (a partial sum that starts at +0
        // is never -0 under round-to-nearest), as in the plain loop.
        let pad = |x: &[f32]| {
            let mut padded = [0.0f32; LANES];
            padded[..x.len()].copy_from_slice(x);
            padded
        };
        let qp = pad(&q[full..]);
        let (q0, q1) = (load(&qp[..HALF]), load(&qp[HALF..]));
        for (i, ki) in [k0, k1, k2, k3].into_iter().enumerate() {
            let kp = pad(&ki[full..]);
            lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(q0, load(&kp[..HALF])));
            hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(q1, load(&kp[HALF..])));
        }
    }
    // Level 1 (lanes l + 8): s_i = lo_i + hi_i.
    let s: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(lo[i], hi[i]));
    // Level 2 (l + 4): [s0 lo 4 | s1 lo 4] + [s0 hi 4 | s1 hi 4] = [t0 | t1], and [t2 | t3].
    let t01 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(s[0], s[1]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[1]),
    );
    let t23 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(s[2], s[3]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[3]),
    );
    // Level 3 (l + 2): per 128-bit half, [tA0 tA1 tB0 tB1] + [tA2 tA3 tB2 tB3] = [uA0 uA1 uB0 uB1]
    // (A, B = keys 0, 2 in the low half, 1, 3 in the high half).
    let u = _mm256_add_ps(
        _mm256_shuffle_ps::<0b01_00_01_00>(t01, t23),
        _mm256_shuffle_ps::<0b11_10_11_10>(t01, t23),
    );
    // Level 4 (l + 1): [uA0 uB0 ..] + [uA1 uB1 ..] = [rA rB ..] per half.
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(u, u),
        _mm256_shuffle_ps::<0b11_01_11_01>(u, u),
    );
    // Low half [r0 r2 ..], high half [r1 r3 ..]: interleaved into [r0 r1 r2 r3].
    let four = _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps::<1>(r));
    // SAFETY: an unaligned store of exactly the 4 floats of `out`.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), four) };
}
