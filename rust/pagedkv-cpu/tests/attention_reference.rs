//! The kernels against a naive f64 attention over gathered histories, on random shapes, block
//! sizes, GQA groups, ragged batches, windows and NaN-poisoned unused slots (proptest).

use pagedkv_cpu::{
    bf16, f16, paged_decode, paged_prefill, AttentionParams, BlockTables, CacheShape, CpuError,
    KvElem,
};
use proptest::prelude::*;

/// Naive attention of one query over keys `lo..hi` of a contiguous f64 history.
fn naive(q: &[f64], k: &[Vec<f64>], v: &[Vec<f64>], lo: usize, hi: usize, scale: f64) -> Vec<f64> {
    let hd = q.len();
    if hi <= lo {
        return vec![0.0; hd];
    }
    let s: Vec<f64> = (lo..hi)
        .map(|t| q.iter().zip(&k[t]).map(|(a, b)| a * b).sum::<f64>() * scale)
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = p.iter().sum();
    (0..hd)
        .map(|d| (lo..hi).map(|t| p[t - lo] * v[t][d]).sum::<f64>() / l)
        .collect()
}

/// One sequence's rows per KV head: `[head][token][dim]`.
type History = Vec<Vec<Vec<f64>>>;

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    seqs: Vec<(usize, usize)>, // (seq_len, q_len)
    window: Option<usize>,
    seed: u64,
    /// Multiplies the queries: larger scores, sharper softmaxes, larger rescales between chunks.
    q_gain: f64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        1usize..=3,
        prop::sample::select(vec![1usize, 2, 4, 5]),
        prop::sample::select(vec![1usize, 8, 16, 33, 64]),
        prop::collection::vec((0usize..40, 0usize..6), 1..5),
        prop::option::of(1usize..20),
        any::<u64>(),
    )
        .prop_map(|(bs, nkv, group, hd, raw, window, seed)| Case {
            block_size: bs,
            num_kv_heads: nkv,
            group,
            head_dim: hd,
            seqs: raw.into_iter().map(|(s, q)| (s, q.min(s))).collect(),
            window,
            seed,
            q_gain: 1.0,
        })
}

/// Contexts long enough that the kernel's softmax chunks (`KEY_CHUNK`: 256 keys at absolute
/// positions, for prefill tiles and decode rows alike) split a task's keys into several chunks,
/// with windows that cut blocks and leave some rows of a tile nothing to see in a chunk, and
/// sharper softmaxes.
fn long_case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 4, 16]),
        1usize..=2,
        prop::sample::select(vec![1usize, 3, 8]),
        prop::sample::select(vec![16usize, 64]),
        prop::collection::vec((64usize..1100, 0usize..24), 1..3),
        prop::option::of(1usize..600),
        any::<u64>(),
        prop::sample::select(vec![1.0f64, 4.0]),
    )
        .prop_map(|(bs, nkv, group, hd, raw, window, seed, q_gain)| Case {
            block_size: bs,
            num_kv_heads: nkv,
            group,
            head_dim: hd,
            seqs: raw.into_iter().map(|(s, q)| (s, q.min(s))).collect(),
            window,
            seed,
            q_gain,
        })
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

/// Runs a case in element type T; returns the largest |kernel - naive| over the outputs.
fn run_case<T: KvElem>(
    c: &Case,
    decode: bool,
    from: impl Fn(f32) -> T,
    to: impl Fn(T) -> f64,
) -> f64 {
    let mut rng = Rng(c.seed);
    let bs = c.block_size;
    let nkv = c.num_kv_heads;
    let hd = c.head_dim;
    let nqh = nkv * c.group;
    // Blocks: each sequence's blocks scattered in reverse order over a shared pool, one spare
    // block of NaN that no table names.
    let blocks: Vec<usize> = c.seqs.iter().map(|s| s.0.div_ceil(bs)).collect();
    let num_blocks = blocks.iter().sum::<usize>() + 1;
    let max_blocks = blocks.iter().copied().max().unwrap_or(0) + 1;
    let shape = CacheShape {
        num_blocks,
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let n = num_blocks * bs * nkv * hd;
    let nan = from(f32::NAN);
    let (mut kc, mut vc) = (vec![nan; n], vec![nan; n]);
    let mut table = vec![-1i32; c.seqs.len() * max_blocks];
    let mut hist: Vec<(History, History)> = Vec::new();
    let mut next = num_blocks - 1;
    for (i, &(seq_len, _)) in c.seqs.iter().enumerate() {
        let mut kh = vec![vec![]; nkv];
        let mut vh = vec![vec![]; nkv];
        for j in 0..blocks[i] {
            next -= 1;
            table[i * max_blocks + j] = next as i32;
        }
        // Windowed calls must not read blocks wholly before the window: mark them -1 (released).
        for tok in 0..seq_len {
            let blk = table[i * max_blocks + tok / bs] as usize;
            for h in 0..nkv {
                let kr: Vec<f64> = (0..hd).map(|_| rng.next()).collect();
                let vr: Vec<f64> = (0..hd).map(|_| rng.next()).collect();
                let off = ((blk * bs + tok % bs) * nkv + h) * hd;
                for d in 0..hd {
                    kc[off + d] = from(kr[d] as f32);
                    vc[off + d] = from(vr[d] as f32);
                }
                // The kernel sees the rounded values: the reference must too.
                kh[h].push(kr.iter().map(|x| to(from(*x as f32))).collect());
                vh[h].push(vr.iter().map(|x| to(from(*x as f32))).collect());
            }
        }
        hist.push((kh, vh));
    }
    let q_lens: Vec<usize> = c
        .seqs
        .iter()
        .map(|s| if decode { usize::from(s.0 > 0) } else { s.1 })
        .collect();
    if let Some(w) = c.window {
        for (i, &(seq_len, _)) in c.seqs.iter().enumerate() {
            if q_lens[i] == 0 {
                continue;
            }
            let first_key = (seq_len - q_lens[i] + 1).saturating_sub(w);
            for j in 0..first_key / bs {
                table[i * max_blocks + j] = -1;
            }
        }
    }
    let total_q: usize = if decode {
        c.seqs.len()
    } else {
        q_lens.iter().sum()
    };
    let qv: Vec<f64> = (0..total_q * nqh * hd)
        .map(|_| rng.next() * c.q_gain)
        .collect();
    let q: Vec<T> = qv.iter().map(|x| from(*x as f32)).collect();
    let mut out = vec![nan; q.len()];
    let lens: Vec<i32> = c.seqs.iter().map(|s| s.0 as i32).collect();
    let tables = BlockTables::padded(&table, c.seqs.len(), max_blocks).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let params = AttentionParams {
        num_q_heads: nqh,
        scale,
        causal: true,
        window: c.window,
    };
    let mut qsl = vec![0i32];
    for &ql in &q_lens {
        qsl.push(qsl.last().unwrap() + ql as i32);
    }
    if decode {
        paged_decode(&q, &kc, &vc, shape, &tables, &lens, params, &mut out).unwrap();
    } else {
        paged_prefill(&q, &kc, &vc, shape, &tables, &lens, &qsl, params, &mut out).unwrap();
    }
    let mut worst = 0.0f64;
    for (i, &(seq_len, _)) in c.seqs.iter().enumerate() {
        let row0 = if decode { i } else { qsl[i] as usize };
        let rows = if decode { 1 } else { q_lens[i] };
        for r in 0..rows {
            let pos = if decode {
                seq_len.max(1) - 1
            } else {
                seq_len - q_lens[i] + r
            };
            let hi = if seq_len == 0 { 0 } else { pos + 1 };
            let lo = c.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..nqh {
                let base = ((row0 + r) * nqh + h) * hd;
                let qf: Vec<f64> = q[base..base + hd].iter().map(|x| to(*x)).collect();
                let (kh, vh) = (&hist[i].0[h / c.group], &hist[i].1[h / c.group]);
                let want = naive(&qf, kh, vh, lo, hi, scale as f64);
                for d in 0..hd {
                    let got = to(out[base + d]);
                    assert!(got.is_finite(), "NaN leaked: seq {i} row {r} head {h}");
                    worst = worst.max((got - want[d]).abs());
                }
            }
        }
    }
    worst
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn prefill_fp32_matches_naive(c in case()) {
        let err = run_case::<f32>(&c, false, |x| x, |x| x as f64);
        prop_assert!(err < 2e-5, "max error {err}");
    }

    #[test]
    fn decode_fp32_matches_naive(c in case()) {
        let err = run_case::<f32>(&c, true, |x| x, |x| x as f64);
        prop_assert!(err < 2e-5, "max error {err}");
    }

    #[test]
    fn prefill_fp16_and_bf16_match_naive_within_one_output_rounding(c in case()) {
        // Outputs lie in [-1, 1]: one rounding is 2^-11 (fp16) and 2^-8 (bf16) at most.
        let e16 = run_case::<f16>(&c, false, f16::from_f32, |x| x.to_f64());
        prop_assert!(e16 < 1.0 / 1024.0, "fp16 max error {e16}");
        let eb = run_case::<bf16>(&c, true, bf16::from_f32, |x| x.to_f64());
        prop_assert!(eb < 1.0 / 128.0, "bf16 max error {eb}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn long_contexts_split_into_chunks_match_naive(c in long_case()) {
        let err = run_case::<f32>(&c, false, |x| x, |x| x as f64);
        prop_assert!(err < 2e-5, "prefill max error {err}");
        let err = run_case::<f32>(&c, true, |x| x, |x| x as f64);
        prop_assert!(err < 2e-5, "decode max error {err}");
        let e16 = run_case::<f16>(&c, true, f16::from_f32, |x| x.to_f64());
        prop_assert!(e16 < 1.0 / 1024.0, "fp16 decode max error {e16}");
    }
}

#[test]
fn out_of_range_and_negative_entries_are_typed_errors() {
    let shape = CacheShape {
        num_blocks: 2,
        block_size: 4,
        num_kv_heads: 1,
        head_dim: 4,
    };
    let kc = vec![0.0f32; 32];
    let q = vec![0.0f32; 4];
    let mut out = vec![0.0f32; 4];
    let params = AttentionParams {
        num_q_heads: 1,
        scale: 0.5,
        causal: true,
        window: None,
    };
    for entry in [2, -1, i32::MAX, i32::MIN] {
        let t = [0, entry];
        let tables = BlockTables::padded(&t, 1, 2).unwrap();
        let e = paged_decode(&q, &kc, &kc, shape, &tables, &[5], params, &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                CpuError::BlockId {
                    row: 0,
                    entry: 1,
                    ..
                }
            ),
            "{e:?}"
        );
    }
    // A window that starts in block 1 never reads entry 0, whatever it holds.
    let t = [-1, 1];
    let tables = BlockTables::padded(&t, 1, 2).unwrap();
    let win = AttentionParams {
        window: Some(3),
        ..params
    };
    paged_decode(&q, &kc, &kc, shape, &tables, &[8], win, &mut out).unwrap();
    assert!(paged_decode(&q, &kc, &kc, shape, &tables, &[8], params, &mut out).is_err());
    // Lengths past the table, negative lengths, bad shapes, bad scales, bad windows.
    let t = [0, 1];
    let tables = BlockTables::padded(&t, 1, 2).unwrap();
    for (lens, p) in [
        ([9], params),
        ([-1], params),
        (
            [4],
            AttentionParams {
                num_q_heads: 0,
                ..params
            },
        ),
        (
            [4],
            AttentionParams {
                scale: f32::NAN,
                ..params
            },
        ),
        (
            [4],
            AttentionParams {
                window: Some(0),
                ..params
            },
        ),
    ] {
        assert!(paged_decode(&q, &kc, &kc, shape, &tables, &lens, p, &mut out).is_err());
    }
    assert!(paged_decode(&q, &kc[..31], &kc, shape, &tables, &[4], params, &mut out).is_err());
    // Prefill: more queries than tokens, bad query_start_loc, a window without causal.
    let q2 = vec![0.0f32; 8];
    let mut out2 = vec![0.0f32; 8];
    let pre = |lens: &[i32], qsl: &[i32], p: AttentionParams, out: &mut [f32]| {
        paged_prefill(&q2, &kc, &kc, shape, &tables, lens, qsl, p, out)
    };
    assert!(pre(&[2], &[0, 2], params, &mut out2).is_ok());
    assert!(pre(&[1], &[0, 2], params, &mut out2).is_err());
    assert!(pre(&[2], &[1, 2], params, &mut out2).is_err());
    assert!(pre(&[2], &[0, 3], params, &mut out2).is_err());
    let nc = AttentionParams {
        causal: false,
        window: Some(2),
        ..params
    };
    assert!(pre(&[2], &[0, 2], nc, &mut out2).is_err());
}

/// Every prefill row, bit for bit, equals the same query run as a decode row (alone and beside
/// another sequence) over the same prefix: a row's result does not depend on its tile, its
/// position in the tile, the window's start for the tile's first row, or the batch (the engine's
/// greedy output relies on it under chunked prefill, preemption and batching), nor on whether its
/// task took one KV head or all of them (rayon pools of 1 and 8 threads choose either layout).
fn rows_match_decode(
    bs: usize,
    group: usize,
    seq_len: usize,
    q_len: usize,
    window: Option<usize>,
    seed: u64,
) {
    let (nkv, hd) = (2usize, 64usize);
    let nqh = nkv * group;
    let nblk = seq_len.div_ceil(bs);
    let shape = CacheShape {
        num_blocks: nblk + 1,
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let mut rng = Rng(seed);
    let n = shape.elems().unwrap();
    let kc: Vec<f32> = (0..n).map(|_| rng.next() as f32).collect();
    let vc: Vec<f32> = (0..n).map(|_| rng.next() as f32).collect();
    // Blocks in reverse order; the spare block 0 is the second sequence's.
    let table: Vec<i32> = (0..nblk).map(|j| (nblk - j) as i32).collect();
    let tables = BlockTables::padded(&table, 1, nblk).unwrap();
    let q: Vec<f32> = (0..q_len * nqh * hd)
        .map(|_| (rng.next() * 3.0) as f32)
        .collect();
    let params = AttentionParams {
        num_q_heads: nqh,
        scale: 0.125,
        causal: true,
        window,
    };
    // One thread: a task takes every KV head once there are 2 row tiles (q_len > 16) or 2
    // decode rows; 8 threads: one head per task for every call here.
    let pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    };
    let (whole_rows, per_head) = (pool(1), pool(8));
    let qsl = [0, q_len as i32];
    let prefill = |out: &mut [f32]| {
        paged_prefill(
            &q,
            &kc,
            &vc,
            shape,
            &tables,
            &[seq_len as i32],
            &qsl,
            params,
            out,
        )
        .unwrap()
    };
    let mut out = vec![0.0f32; q.len()];
    per_head.install(|| prefill(&mut out));
    let mut out_whole = vec![0.0f32; q.len()];
    whole_rows.install(|| prefill(&mut out_whole));
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&out_whole),
        bits(&out),
        "prefill: tasks over all KV heads differ from tasks per KV head"
    );
    let row = nqh * hd;
    let mut pair = table.clone();
    pair.extend(std::iter::once(0).chain(std::iter::repeat_n(-1, nblk - 1)));
    let pair_tables = BlockTables::padded(&pair, 2, nblk).unwrap();
    for r in 0..q_len {
        let len = (seq_len - q_len + r + 1) as i32;
        let qr = &q[r * row..(r + 1) * row];
        let mut one = vec![0.0f32; row];
        paged_decode(qr, &kc, &vc, shape, &tables, &[len], params, &mut one).unwrap();
        let mut q2 = qr.to_vec();
        q2.extend_from_slice(qr);
        let mut two = vec![0.0f32; 2 * row];
        let other = bs.min(5) as i32;
        whole_rows
            .install(|| {
                paged_decode(
                    &q2,
                    &kc,
                    &vc,
                    shape,
                    &pair_tables,
                    &[len, other],
                    params,
                    &mut two,
                )
            })
            .unwrap();
        let want = bits(&out[r * row..(r + 1) * row]);
        assert_eq!(
            bits(&one),
            want,
            "row {r}: decode alone differs from its prefill tile"
        );
        assert_eq!(
            bits(&two[..row]),
            want,
            "row {r}: decode in a batch differs"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn a_rows_bits_do_not_depend_on_its_tile_or_batch(
        bs in prop::sample::select(vec![4usize, 16]),
        group in prop::sample::select(vec![1usize, 3]),
        seq_len in 200usize..900,
        q_len in 1usize..40,
        window in prop::option::of(1usize..500),
        seed in any::<u64>(),
    ) {
        rows_match_decode(bs, group, seq_len, q_len.min(seq_len), window, seed);
    }
}
