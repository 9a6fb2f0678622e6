//! Quantized caches: attention equals, bit for bit, the plain kernel on an fp32 cache holding the
//! dequantized values (sealed blocks via `dequantize_block`, int4 open blocks from their int8
//! residual slots),
//! for decode and prefill, windows, GQA, every element type, caches written in random chunks
//! (so int4 blocks are sealed from residual tokens), unused blocks and residual rows poisoned
//! (0xFF bytes decode to NaN in every format). And every refused call writes nothing.

use pagedkv_cpu::quant::dequantize_block;
use pagedkv_cpu::{
    bf16, f16, paged_decode, paged_decode_quant, paged_prefill, paged_prefill_quant,
    write_kv_quant, AttentionParams, BlockTables, CacheShape, KvElem, QuantCache, QuantCacheMut,
    QuantFormat, QuantLayout, Role,
};
use proptest::prelude::*;

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Roughly standard normal (sum of uniforms), with an occasional outlier channel.
    fn normal(&mut self) -> f32 {
        let s: f32 = (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum();
        (s - 2.0) * 1.7
    }
}

trait Elem: KvElem + Default {
    fn from_f32(x: f32) -> Self;
}
impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Elem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Elem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

fn widen<T: KvElem>(x: &[T]) -> Vec<f32> {
    let mut buf = vec![0.0f32; x.len()];
    T::widen(x, &mut buf).to_vec()
}

struct Problem {
    k: (QuantLayout, Vec<u8>, Vec<u8>),
    v: (QuantLayout, Vec<u8>, Vec<u8>),
    table: Vec<i32>,
    max_blocks: usize,
    lens: Vec<i32>,
    slots: Option<Vec<i32>>,
}

/// Sequences of `lens` tokens in random blocks, written in random chunks, several sequences per
/// write call.
fn problem<T: Elem>(
    rng: &mut Rng,
    format: QuantFormat,
    bs: usize,
    heads: usize,
    hd: usize,
    lens: &[usize],
) -> Problem {
    let need: Vec<usize> = lens.iter().map(|n| n.div_ceil(bs)).collect();
    let num_blocks = need.iter().sum::<usize>() + 2;
    let mut ids: Vec<usize> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let max_blocks = need.iter().copied().max().unwrap_or(0).max(1);
    let mut table = vec![-1i32; lens.len() * max_blocks];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        for j in 0..n {
            table[s * max_blocks + j] = ids[next] as i32;
            next += 1;
        }
    }
    let int4 = format == QuantFormat::Int4;
    let te = heads * hd;
    let mk = |role| {
        let l = QuantLayout::new(format, role, bs, heads, hd).unwrap();
        let residual = if int4 {
            // 0xFF bytes: NaN scales, so an unused residual row reads as NaN.
            vec![0xFFu8; lens.len() * l.residual().unwrap().block_bytes]
        } else {
            Vec::new()
        };
        (l, vec![0xFFu8; num_blocks * l.block_bytes], residual)
    };
    let (mut k, mut v) = (mk(Role::Key), mk(Role::Value));
    let outlier = rng.below(hd);
    let keys: Vec<Vec<T>> = lens
        .iter()
        .map(|&n| {
            (0..n * te)
                .map(|i| {
                    let x = rng.normal();
                    T::from_f32(if i % hd == outlier { x * 8.0 + 5.0 } else { x })
                })
                .collect()
        })
        .collect();
    let values: Vec<Vec<T>> = lens
        .iter()
        .map(|&n| (0..n * te).map(|_| T::from_f32(rng.normal())).collect())
        .collect();
    // Chunk bounds per sequence: a prefill in random pieces, then one-token decodes.
    let chunks: Vec<Vec<(usize, usize)>> = lens
        .iter()
        .map(|&n| {
            let (mut out, mut lo) = (Vec::new(), 0);
            while lo < n {
                let step = if lo > n * 3 / 4 {
                    1
                } else {
                    1 + rng.below(n / 2 + 1)
                };
                out.push((lo, (lo + step).min(n)));
                lo += step;
            }
            out
        })
        .collect();
    let steps = chunks.iter().map(Vec::len).max().unwrap_or(0);
    for step in 0..steps {
        let (mut ks, mut vs, mut slots, mut res) = (vec![], vec![], vec![], vec![]);
        for (s, c) in chunks.iter().enumerate() {
            let Some(&(lo, hi)) = c.get(step) else {
                continue;
            };
            for pos in lo..hi {
                slots.push(
                    i64::from(table[s * max_blocks + pos / bs]) * bs as i64 + (pos % bs) as i64,
                );
                res.push(s as i32);
            }
            ks.extend_from_slice(&keys[s][lo * te..hi * te]);
            vs.extend_from_slice(&values[s][lo * te..hi * te]);
        }
        let kc = QuantCacheMut::new("k", k.0, &mut k.1, &mut k.2).unwrap();
        let vc = QuantCacheMut::new("v", v.0, &mut v.1, &mut v.2).unwrap();
        write_kv_quant(&ks, &vs, kc, vc, &slots, int4.then_some(&res[..])).unwrap();
    }
    Problem {
        k,
        v,
        table,
        max_blocks,
        lens: lens.iter().map(|&n| n as i32).collect(),
        slots: int4.then(|| (0..lens.len() as i32).collect()),
    }
}

/// The plain fp32 cache of the dequantized values: sealed blocks decoded, open int4 blocks from
/// the residual; unused blocks NaN.
fn dequantized(p: &Problem, which: &(QuantLayout, Vec<u8>, Vec<u8>)) -> Vec<f32> {
    let (l, data, residual) = which;
    let be = l.block_size * l.token_elems();
    let nb = data.len() / l.block_bytes;
    let mut out = vec![f32::NAN; nb * be];
    for (s, &len) in p.lens.iter().enumerate() {
        let len = len as usize;
        let sealed = if l.has_residual() {
            len / l.block_size
        } else {
            len.div_ceil(l.block_size)
        };
        for j in 0..len.div_ceil(l.block_size) {
            let id = p.table[s * p.max_blocks + j] as usize;
            let dst = &mut out[id * be..(id + 1) * be];
            if j < sealed {
                dequantize_block(l, &data[id * l.block_bytes..][..l.block_bytes], dst).unwrap();
            } else {
                let n = (len - j * l.block_size) * l.token_elems();
                let rl = l.residual().unwrap();
                let mut slot = vec![0.0f32; be];
                dequantize_block(
                    &rl,
                    &residual[s * rl.block_bytes..][..rl.block_bytes],
                    &mut slot,
                )
                .unwrap();
                dst[..n].copy_from_slice(&slot[..n]);
            }
        }
    }
    out
}

fn bits<T: KvElem>(x: &[T]) -> Vec<u32> {
    widen(x)
        .iter()
        .map(|v| if v.is_nan() { 0x7FC0_0000 } else { v.to_bits() })
        .collect()
}

fn check_case<T: Elem>(
    seed: u64,
    format: QuantFormat,
    bs: usize,
    heads: usize,
    group: usize,
    window: Option<usize>,
) {
    let mut rng = Rng(seed);
    let hd = [16usize, 32, 64][rng.below(3)];
    let lens: Vec<usize> = (0..1 + rng.below(4)).map(|_| rng.below(70)).collect();
    check_lens::<T>(
        &mut rng,
        format,
        (bs, heads, hd, group),
        window,
        &lens,
        seed,
    );
}

/// Decode and prefill on sequences of `lens` tokens; `dims`: block size, KV heads, head size,
/// query heads per KV head.
fn check_lens<T: Elem>(
    rng: &mut Rng,
    format: QuantFormat,
    dims: (usize, usize, usize, usize),
    window: Option<usize>,
    lens: &[usize],
    seed: u64,
) {
    let (bs, heads, hd, group) = dims;
    let p = problem::<T>(rng, format, bs, heads, hd, lens);
    let nq = heads * group;
    let shape = CacheShape {
        num_blocks: p.k.1.len() / p.k.0.block_bytes,
        block_size: bs,
        num_kv_heads: heads,
        head_dim: hd,
    };
    let kd = dequantized(&p, &p.k);
    let vd = dequantized(&p, &p.v);
    let tables = BlockTables::padded(&p.table, lens.len(), p.max_blocks).unwrap();
    let params = AttentionParams {
        num_q_heads: nq,
        scale: 0.3,
        causal: true,
        window,
    };
    let kq = QuantCache::new("k", p.k.0, &p.k.1, &p.k.2).unwrap();
    let vq = QuantCache::new("v", p.v.0, &p.v.1, &p.v.2).unwrap();
    // Decode.
    let q: Vec<T> = (0..lens.len() * nq * hd)
        .map(|_| T::from_f32(rng.normal()))
        .collect();
    let mut out = vec![T::default(); q.len()];
    paged_decode_quant(
        &q,
        kq,
        vq,
        &tables,
        &p.lens,
        p.slots.as_deref(),
        params,
        &mut out,
    )
    .unwrap();
    let mut want = vec![0.0f32; q.len()];
    paged_decode(
        &widen(&q),
        &kd,
        &vd,
        shape,
        &tables,
        &p.lens,
        params,
        &mut want,
    )
    .unwrap();
    let mut narrowed = vec![T::default(); q.len()];
    T::narrow(&want, &mut narrowed);
    assert_eq!(
        bits(&out),
        bits(&narrowed),
        "decode {format:?} {} seed {seed}",
        T::NAME
    );
    // Prefill: each sequence's last few tokens query, causal, then not (no window).
    let q_lens: Vec<i32> = lens
        .iter()
        .map(|&n| rng.below(n.min(20) + 1) as i32)
        .collect();
    let mut qsl = vec![0i32];
    for &n in &q_lens {
        qsl.push(qsl.last().unwrap() + n);
    }
    let total = *qsl.last().unwrap() as usize;
    let q: Vec<T> = (0..total * nq * hd)
        .map(|_| T::from_f32(rng.normal()))
        .collect();
    for causal in [true, false] {
        if !causal && window.is_some() {
            continue;
        }
        let params = AttentionParams { causal, ..params };
        let mut out = vec![T::default(); q.len()];
        paged_prefill_quant(
            &q,
            kq,
            vq,
            &tables,
            &p.lens,
            &qsl,
            p.slots.as_deref(),
            params,
            &mut out,
        )
        .unwrap();
        let mut want = vec![0.0f32; q.len()];
        paged_prefill(
            &widen(&q),
            &kd,
            &vd,
            shape,
            &tables,
            &p.lens,
            &qsl,
            params,
            &mut want,
        )
        .unwrap();
        let mut narrowed = vec![T::default(); q.len()];
        T::narrow(&want, &mut narrowed);
        assert_eq!(
            bits(&out),
            bits(&narrowed),
            "prefill causal={causal} {format:?} seed {seed}"
        );
    }
}

const FORMATS: [QuantFormat; 3] = [QuantFormat::Int8, QuantFormat::Fp8E4m3, QuantFormat::Int4];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn quantized_attention_is_the_plain_kernel_on_the_dequantized_cache(
        seed in any::<u64>(),
        format in prop::sample::select(FORMATS.to_vec()),
        bs in prop::sample::select(vec![1usize, 4, 16]),
        heads in 1usize..=3,
        group in prop::sample::select(vec![1usize, 3, 4]),
        window in prop::option::of(1usize..40),
        elem in 0usize..3,
    ) {
        match elem {
            0 => check_case::<f32>(seed, format, bs, heads, group, window),
            1 => check_case::<f16>(seed, format, bs, heads, group, window),
            _ => check_case::<bf16>(seed, format, bs, heads, group, window),
        }
    }
}

#[test]
fn long_contexts_cross_softmax_chunks() {
    for (i, format) in FORMATS.into_iter().enumerate() {
        let mut rng = Rng(99 + i as u64);
        let lens = [700usize, 300];
        check_lens::<f16>(&mut rng, format, (16, 2, 64, 3), None, &lens, 0);
        check_lens::<f32>(&mut rng, format, (16, 1, 64, 2), Some(290), &lens, 1);
    }
}

#[test]
fn refused_calls_write_nothing() {
    let mut rng = Rng(7);
    let (bs, heads, hd) = (4usize, 1usize, 16usize);
    let mut p = problem::<f32>(&mut rng, QuantFormat::Int4, bs, heads, hd, &[6, 9]);
    let te = heads * hd;
    let x = vec![0.5f32; 3 * te];
    let snapshot = |p: &Problem| (p.k.1.clone(), p.k.2.clone(), p.v.1.clone(), p.v.2.clone());
    let before = snapshot(&p);
    let b0 = i64::from(p.table[0]) * bs as i64;
    let b1 = i64::from(p.table[p.max_blocks + 2]) * bs as i64;
    let cases: Vec<(Vec<i64>, Option<Vec<i32>>)> = vec![
        (vec![b0 + 1, b0 + 3, -1], Some(vec![0, 0, 0])), // offsets 1 and 3: not consecutive
        (vec![b0 + 1, b0 + 2, -1], Some(vec![0, 1, 0])), // one block, two slots
        (vec![b0 + 1, b1 + 1, -1], Some(vec![0, 0, 0])), // two open blocks park in slot 0
        (vec![b0 + 1, -1, -1], Some(vec![5, 0, 0])),     // not a slot
        (vec![b0 + 1, -1, -1], None),                    // int4 needs slots
        (vec![b0 + 1, b0 + 1, -1], Some(vec![0, 0, 0])), // a slot twice
        (vec![1 << 40, -1, -1], Some(vec![0, 0, 0])),    // past the cache
    ];
    for (slots, res) in cases {
        let kc = QuantCacheMut::new("k", p.k.0, &mut p.k.1, &mut p.k.2).unwrap();
        let vc = QuantCacheMut::new("v", p.v.0, &mut p.v.1, &mut p.v.2).unwrap();
        assert!(
            write_kv_quant(&x, &x, kc, vc, &slots, res.as_deref()).is_err(),
            "{slots:?} {res:?}"
        );
        assert!(
            snapshot(&p) == before,
            "{slots:?} {res:?} wrote before failing"
        );
    }
    // Attention: an open block needs its slot; swapped roles are refused.
    let tables = BlockTables::padded(&p.table, 2, p.max_blocks).unwrap();
    let params = AttentionParams {
        num_q_heads: 1,
        scale: 1.0,
        causal: true,
        window: None,
    };
    let kq = QuantCache::new("k", p.k.0, &p.k.1, &p.k.2).unwrap();
    let vq = QuantCache::new("v", p.v.0, &p.v.1, &p.v.2).unwrap();
    let q = vec![0.1f32; 2 * hd];
    let mut out = vec![0.0f32; 2 * hd];
    assert!(paged_decode_quant(
        &q,
        kq,
        vq,
        &tables,
        &p.lens,
        Some(&[0, -1]),
        params,
        &mut out
    )
    .is_err());
    assert!(paged_decode_quant(&q, kq, vq, &tables, &p.lens, None, params, &mut out).is_err());
    assert!(paged_decode_quant(
        &q,
        vq,
        kq,
        &tables,
        &p.lens,
        Some(&[0, 1]),
        params,
        &mut out
    )
    .is_err());
    // A sequence whose blocks are all sealed reads no residual: -1 is fine.
    let full = [8i32, 8];
    assert!(paged_decode_quant(
        &q,
        kq,
        vq,
        &tables,
        &full,
        Some(&[-1, -1]),
        params,
        &mut out
    )
    .is_ok());
    // 8-bit caches take no slots.
    let p8 = problem::<f32>(&mut rng, QuantFormat::Int8, bs, heads, hd, &[6]);
    let tables8 = BlockTables::padded(&p8.table, 1, p8.max_blocks).unwrap();
    let k8 = QuantCache::new("k", p8.k.0, &p8.k.1, &p8.k.2).unwrap();
    let v8 = QuantCache::new("v", p8.v.0, &p8.v.1, &p8.v.2).unwrap();
    let mut out8 = vec![0.0f32; hd];
    assert!(paged_decode_quant(
        &q[..hd],
        k8,
        v8,
        &tables8,
        &p8.lens,
        Some(&[0]),
        params,
        &mut out8
    )
    .is_err());
    assert!(paged_decode_quant(
        &q[..hd],
        k8,
        v8,
        &tables8,
        &p8.lens,
        None,
        params,
        &mut out8
    )
    .is_ok());
    // Block bytes that are not whole blocks of the layout.
    assert!(QuantCache::new("k", p8.k.0, &p8.k.1[1..], &p8.k.2).is_err());
}
