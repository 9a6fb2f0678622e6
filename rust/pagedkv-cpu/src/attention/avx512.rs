//! Attention's inner loops on AVX-512, the same bits as the plain loops (`simd` docs).
//! Scores, four keys at once: per key one 16-lane partial-sum register (`vmulps` + `vaddps` per
//! chunk of 16), then the four reduction trees run together — each level adds the upper half of
//! every live lane group to its lower half, with the four keys packed side by side in one register
//! after the first level — so a score costs about 2 reduction instructions instead of 8. Values:
//! a group's accumulator rows in one call, 16 elements per register, the four probabilities of a
//! row broadcast once.
//!
//! The `unsafe` here: unaligned vector loads from fixed-size array references (in bounds by
//! type) and the call into the `#[target_feature]` function, which only an [`Avx512`] value can
//! make, and one exists only where the CPU reported AVX-512 F at run time.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m512, _mm512_add_ps, _mm512_castps512_ps128, _mm512_loadu_ps, _mm512_mul_ps,
    _mm512_permute_ps, _mm512_permutexvar_ps, _mm512_set1_ps, _mm512_set_epi32, _mm512_setzero_ps,
    _mm512_shuffle_f32x4, _mm512_storeu_ps, _mm_storeu_ps,
};
use std::sync::OnceLock;

use super::portable::LANES;

/// Proof that this CPU has AVX-512 F: the only way to reach the intrinsic code.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// `Some` where the CPU runs AVX-512 F (checked once per process).
    pub(crate) fn detect() -> Option<Self> {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        let yes = *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"));
        yes.then_some(Avx512(()))
    }

    /// `acc_j += p[j] . v` for consecutive accumulator rows, bit for bit `vector::add_scaled4`.
    #[inline(always)]
    pub(crate) fn add_scaled4_rows(self, acc: &mut [f32], p: &[[f32; 4]], v: [&[f32]; 4]) {
        // SAFETY: `self` exists only where `detect` saw AVX-512 F.
        unsafe { add_scaled4_rows(acc, p, v) }
    }

    /// `out[j] = dot4(q_j, k)` for consecutive query rows, bit for bit `portable::dot4`.
    #[inline(always)]
    pub(crate) fn dot4_rows(self, q: &[f32], k: [&[f32]; 4], out: &mut [[f32; 4]]) {
        // SAFETY: `self` exists only where `detect` saw AVX-512 F.
        unsafe { dot4_rows(q, k, out) }
    }
}

#[inline(always)]
fn load(x: &[f32]) -> __m512 {
    let x: &[f32; LANES] = x.try_into().expect("16 fp32 values");
    // SAFETY: an unaligned load of exactly the 16 floats the array reference covers.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

#[inline(always)]
fn store(x: &mut [f32], value: __m512) {
    let x: &mut [f32; LANES] = x.try_into().expect("16 fp32 values");
    // SAFETY: an unaligned store of exactly the 16 floats the array reference covers.
    unsafe { _mm512_storeu_ps(x.as_mut_ptr(), value) }
}

#[target_feature(enable = "avx512f")]
fn add_scaled4_rows(acc: &mut [f32], p: &[[f32; 4]], v: [&[f32]; 4]) {
    let hd = v.iter().fold(v[0].len(), |n, r| n.min(r.len()));
    // Rows cut to one length and walked in fixed-size chunks: no bounds check in the loop.
    let (v0, v1, v2, v3) = (&v[0][..hd], &v[1][..hd], &v[2][..hd], &v[3][..hd]);
    for (j, pj) in p.iter().enumerate() {
        let a = &mut acc[j * hd..(j + 1) * hd];
        let pv = pj.map(|x| _mm512_set1_ps(x));
        let mut chunks = a.chunks_exact_mut(LANES);
        let vs = v0
            .chunks_exact(LANES)
            .zip(v1.chunks_exact(LANES))
            .zip(v2.chunks_exact(LANES))
            .zip(v3.chunks_exact(LANES));
        for (x, (((y0, y1), y2), y3)) in (&mut chunks).zip(vs) {
            let mut r = load(x);
            r = _mm512_add_ps(r, _mm512_mul_ps(pv[0], load(y0)));
            r = _mm512_add_ps(r, _mm512_mul_ps(pv[1], load(y1)));
            r = _mm512_add_ps(r, _mm512_mul_ps(pv[2], load(y2)));
            r = _mm512_add_ps(r, _mm512_mul_ps(pv[3], load(y3)));
            store(x, r);
        }
        // The last `hd % LANES` elements, one at a time: the same operations per element.
        let full = hd - hd % LANES;
        for (d, x) in (full..).zip(chunks.into_remainder()) {
            *x = *x + pj[0] * v0[d] + pj[1] * v1[d] + pj[2] * v2[d] + pj[3] * v3[d];
        }
    }
}

/// A short last chunk, zero-padded: `p + 0 * 0` is `p` (a partial sum that starts at +0 is
/// never -0 under round-to-nearest), so the padded lanes add nothing, as in the plain loop.
#[inline(always)]
fn load_tail(x: &[f32]) -> __m512 {
    let mut padded = [0.0f32; LANES];
    padded[..x.len()].copy_from_slice(x);
    load(&padded)
}

#[target_feature(enable = "avx512f")]
fn dot4_rows(q: &[f32], k: [&[f32]; 4], out: &mut [[f32; 4]]) {
    let hd = k[0].len();
    for (j, o) in out.iter_mut().enumerate() {
        dot4(&q[j * hd..(j + 1) * hd], k, o);
    }
}

/// `out = [dot(q, k[0]), .., dot(q, k[3])]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn dot4(q: &[f32], k: [&[f32]; 4], out: &mut [f32; 4]) {
    let n = k.iter().fold(q.len(), |n, r| n.min(r.len()));
    let full = n / LANES * LANES;
    // Rows cut to one length and walked in fixed-size chunks: no bounds check in the loop.
    let (q, k0, k1, k2, k3) = (&q[..n], &k[0][..n], &k[1][..n], &k[2][..n], &k[3][..n]);
    let mut p = [_mm512_setzero_ps(); 4];
    let ks = k0
        .chunks_exact(LANES)
        .zip(k1.chunks_exact(LANES))
        .zip(k2.chunks_exact(LANES))
        .zip(k3.chunks_exact(LANES));
    for (qc, (((c0, c1), c2), c3)) in q.chunks_exact(LANES).zip(ks) {
        let qc = load(qc);
        for (pi, kc) in p.iter_mut().zip([c0, c1, c2, c3]) {
            *pi = _mm512_add_ps(*pi, _mm512_mul_ps(qc, load(kc)));
        }
    }
    if full < n {
        let qc = load_tail(&q[full..]);
        for (pi, ki) in p.iter_mut().zip([k0, k1, k2, k3]) {
            *pi = _mm512_add_ps(*pi, _mm512_mul_ps(qc, load_tail(&ki[full..])));
        }
    }
    // Level 1 (lanes l + 8): [p0 lo 8 | p1 lo 8] + [p0 hi 8 | p1 hi 8] = [s0 | s1], same for 2, 3.
    // `_mm512_shuffle_f32x4(a, b, imm)` picks 128-bit blocks: two from a, then two from b.
    let lo01 = _mm512_shuffle_f32x4::<0b01_00_01_00>(p[0], p[1]);
    let hi01 = _mm512_shuffle_f32x4::<0b11_10_11_10>(p[0], p[1]);
    let lo23 = _mm512_shuffle_f32x4::<0b01_00_01_00>(p[2], p[3]);
    let hi23 = _mm512_shuffle_f32x4::<0b11_10_11_10>(p[2], p[3]);
    let s01 = _mm512_add_ps(lo01, hi01);
    let s23 = _mm512_add_ps(lo23, hi23);
    // Level 2 (lanes l + 4): blocks [s0a s0b s1a s1b] and [s2a ..] -> [s0a s1a s2a s3a] +
    // [s0b s1b s2b s3b] = [t0 | t1 | t2 | t3], one 128-bit block per key.
    let a = _mm512_shuffle_f32x4::<0b10_00_10_00>(s01, s23);
    let b = _mm512_shuffle_f32x4::<0b11_01_11_01>(s01, s23);
    let t = _mm512_add_ps(a, b);
    // Level 3 (lanes l + 2) and 4 (l + 1) within each block: lane 0 of block i ends as key i's sum.
    let u = _mm512_add_ps(t, _mm512_permute_ps::<0b01_00_11_10>(t));
    let r = _mm512_add_ps(u, _mm512_permute_ps::<0b10_11_00_01>(u));
    // Lanes 0, 4, 8, 12 into one 128-bit store (four scalar stores would stall the next 16-byte
    // load of `out` on store forwarding).
    let four = _mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0),
        r,
    ));
    // SAFETY: an unaligned store of exactly the 4 floats of `out`.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), four) };
}
