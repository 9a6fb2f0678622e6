//! Decode attention at the target shape (batch 32, 2 K context, 8 query / 2 KV heads of
//! 64, block 16) beside a plain copy of the same K/V bytes, fp32 and fp16, in one run:
//! `cargo bench -p pagedkv-cpu --bench decode [-- REPS [CONTEXT | smol]]`. Prints GB/s of K/V read and the ratio to copy.
//! Then decode at SmolLM2's shapes (9 query / 3 KV heads of 64, block 16, fp32) over the short
//! contexts an engine decoding many requests sees: batch 32 x 40 / 200 / 2048 and batch 1 x 40,
//! in ns per (sequence, KV head, key). `RAYON_NUM_THREADS` sets the threads.
//! Then the quantized caches (int8, fp8 e4m3, int4 with fp16 residuals) at the first shape,
//! written from the fp16 run's keys and values, each timed alternately with fp16 and reported as
//! a ratio to it (`cargo bench -p pagedkv-cpu --bench decode -- REPS quant` runs only those).

use std::hint::black_box;
use std::time::Instant;

use pagedkv_cpu::{
    f16, paged_decode, paged_decode_quant, write_kv_quant, AttentionParams, BlockTables,
    CacheShape, KvElem, QuantCache, QuantCacheMut, QuantFormat, QuantLayout, Role,
};

fn best<F: FnMut()>(mut f: F, reps: usize) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// A decode problem: `batch` sequences of `ctx` tokens, `nq` query / `nkv` KV heads of 64, blocks
/// of 16 scattered over the cache by a permutation.
struct Problem<T> {
    shape: CacheShape,
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<T>,
    table: Vec<i32>,
    per_seq: usize,
    lens: Vec<i32>,
    params: AttentionParams,
}

impl<T: KvElem + Default> Problem<T> {
    fn new(batch: usize, ctx: usize, nq: usize, nkv: usize, from: fn(f32) -> T) -> Self {
        let (hd, bs) = (64usize, 16usize);
        let per_seq = ctx.div_ceil(bs);
        let shape = CacheShape {
            num_blocks: batch * per_seq,
            block_size: bs,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let n = shape.elems().unwrap();
        let table: Vec<i32> = (0..batch * per_seq)
            .map(|i| ((i * 40503) % (batch * per_seq)) as i32)
            .collect();
        Problem {
            shape,
            k: (0..n)
                .map(|i| from(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
                .collect(),
            v: (0..n)
                .map(|i| from(((i * 104729) % 1000) as f32 / 1000.0 - 0.5))
                .collect(),
            q: (0..batch * nq * hd)
                .map(|i| from((i % 13) as f32 / 13.0))
                .collect(),
            table,
            per_seq,
            lens: vec![ctx as i32; batch],
            params: AttentionParams {
                num_q_heads: nq,
                scale: 0.125,
                causal: true,
                window: None,
            },
        }
    }

    /// Best seconds of one `paged_decode` call over `reps`.
    fn time_decode(&self, reps: usize) -> f64 {
        let mut out = vec![T::default(); self.q.len()];
        let tables = BlockTables::padded(&self.table, self.lens.len(), self.per_seq).unwrap();
        best(
            || {
                paged_decode(
                    &self.q,
                    &self.k,
                    &self.v,
                    self.shape,
                    &tables,
                    &self.lens,
                    self.params,
                    &mut out,
                )
                .unwrap();
                black_box(&out);
            },
            reps,
        )
    }
}

fn run<T: KvElem + Default>(name: &str, from: fn(f32) -> T, reps: usize, ctx: usize) {
    let p = Problem::new(32, ctx, 8, 2, from);
    let attn = p.time_decode(reps);
    let n = p.k.len();
    let (mut dk, mut dv) = (vec![T::default(); n], vec![T::default(); n]);
    let copy = best(
        || {
            dk.copy_from_slice(black_box(&p.k));
            dv.copy_from_slice(black_box(&p.v));
            black_box((&dk, &dv));
        },
        reps,
    );
    let bytes = (2 * n * std::mem::size_of::<T>()) as f64;
    println!(
        "{name}: attention {:.2} ms ({:.2} GB/s), copy {:.2} ms ({:.2} GB/s), attention/copy bytes/s {:.2}",
        attn * 1e3,
        bytes / attn / 1e9,
        copy * 1e3,
        bytes / copy / 1e9,
        copy / attn
    );
}

/// Decode over `batch` sequences of `ctx` tokens at SmolLM2's shapes (9 query / 3 KV heads), fp32.
fn smol(batch: usize, ctx: usize, reps: usize) -> f64 {
    let nkv = 3;
    let t = Problem::new(batch, ctx, 9, nkv, |x| x).time_decode(reps);
    let per_key = t * 1e9 / (batch * nkv * ctx) as f64;
    println!(
        "smollm2 fp32 batch {batch:>2} x context {ctx:>4}: {:>9.1} us per call, {per_key:>6.1} ns per (sequence, KV head, key)",
        t * 1e6
    );
    per_key
}

/// A quantized copy of an fp16 problem's caches (every block sealed: the contexts are whole
/// blocks, so an int4 cache reads no residual).
struct QuantProblem {
    k: (QuantLayout, Vec<u8>, Vec<u8>),
    v: (QuantLayout, Vec<u8>, Vec<u8>),
}

impl QuantProblem {
    fn new(p: &Problem<f16>, format: QuantFormat) -> Self {
        let s = p.shape;
        let mk = |role| {
            let l =
                QuantLayout::new(format, role, s.block_size, s.num_kv_heads, s.head_dim).unwrap();
            let residual = if l.has_residual() {
                vec![0u8; l.residual().unwrap().block_bytes]
            } else {
                Vec::new()
            };
            (l, vec![0u8; s.num_blocks * l.block_bytes], residual)
        };
        let (mut k, mut v) = (mk(Role::Key), mk(Role::Value));
        // Whole blocks, one write each: every block sealed at once.
        let te = s.token_elems();
        let per_block = s.block_size * te;
        for b in 0..s.num_blocks {
            let slots: Vec<i64> = (0..s.block_size)
                .map(|o| (b * s.block_size + o) as i64)
                .collect();
            let res = vec![0i32; s.block_size];
            let kc = QuantCacheMut::new("k", k.0, &mut k.1, &mut k.2).unwrap();
            let vc = QuantCacheMut::new("v", v.0, &mut v.1, &mut v.2).unwrap();
            let rows = b * per_block..(b + 1) * per_block;
            let slots_res = k.0.has_residual().then_some(&res[..]);
            write_kv_quant(&p.k[rows.clone()], &p.v[rows], kc, vc, &slots, slots_res).unwrap();
        }
        QuantProblem { k, v }
    }

    fn time_decode(&self, p: &Problem<f16>, reps: usize) -> f64 {
        let mut out = vec![f16::ZERO; p.q.len()];
        let tables = BlockTables::padded(&p.table, p.lens.len(), p.per_seq).unwrap();
        let slots = vec![-1i32; p.lens.len()];
        let res = self.k.0.has_residual().then_some(&slots[..]);
        let kq = QuantCache::new("k", self.k.0, &self.k.1, &self.k.2).unwrap();
        let vq = QuantCache::new("v", self.v.0, &self.v.1, &self.v.2).unwrap();
        best(
            || {
                paged_decode_quant(&p.q, kq, vq, &tables, &p.lens, res, p.params, &mut out)
                    .unwrap();
                black_box(&out);
            },
            reps,
        )
    }
}

/// Quantized decode beside fp16 at the first shape: best of `reps` each, in alternating rounds.
fn quant(reps: usize, ctx: usize) {
    let p = Problem::new(32, ctx, 8, 2, f16::from_f32);
    let rounds = 5;
    for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3, QuantFormat::Int4] {
        let qp = QuantProblem::new(&p, format);
        let (mut plain, mut quant) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..rounds {
            plain = plain.min(p.time_decode(reps));
            quant = quant.min(qp.time_decode(&p, reps));
        }
        let bytes = (qp.k.1.len() + qp.v.1.len()) as f64;
        println!(
            "{:>8}: attention {:.2} ms ({:.2} GB/s of its {:.1} MB), fp16 {:.2} ms: fp16 time / {} time = {:.2}",
            format.name(),
            quant * 1e3,
            bytes / quant / 1e9,
            bytes / 1e6,
            plain * 1e3,
            format.name(),
            plain / quant
        );
    }
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    if std::env::args().nth(2).as_deref() == Some("quant") {
        let ctx = std::env::args()
            .nth(3)
            .and_then(|s| s.parse().ok())
            .unwrap_or(2048);
        quant(reps, ctx);
        return;
    }
    // A second argument shortens the context (e.g. 128 for callgrind's instruction counts).
    // `smol` instead of a context runs only the SmolLM2 table (for perf).
    let arg = std::env::args().nth(2);
    if arg.as_deref() != Some("smol") {
        let ctx = arg.and_then(|s| s.parse().ok()).unwrap_or(2048);
        run::<f32>("fp32", |x| x, reps, ctx);
        run::<f16>("fp16", f16::from_f32, reps, ctx);
    }
    let threads = rayon::current_num_threads();
    println!("SmolLM2 decode, {threads} thread(s):");
    let only: Option<usize> = std::env::var("SMOL_CONTEXT")
        .ok()
        .and_then(|s| s.parse().ok());
    for (batch, ctx) in [(32, 40), (32, 200), (32, 2048), (1, 40)] {
        if only.is_some_and(|c| c != ctx) {
            continue;
        }
        smol(batch, ctx, reps.max(20));
    }
    println!("Quantized caches, batch 32 x 2 K (8 query / 2 KV heads of 64, block 16):");
    quant(reps, 2048);
}
