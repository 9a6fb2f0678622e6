//! Decode attention at the target shape (batch 32, 2 K context, 8 query / 2 KV heads of
//! 64, block 16) beside a plain copy of the same K/V bytes, fp32 and fp16, in one run:
//! `cargo bench -p pagedkv-cpu --bench decode [-- REPS [CONTEXT | smol]]`. Prints GB/s of K/V read and the ratio to copy.
//! Then decode at SmolLM2's shapes (9 query / 3 KV heads of 64, block 16, fp32) over the short
//! contexts an engine decoding many requests sees: batch 32 x 40 / 200 / 2048 and batch 1 x 40,
//! in ns per (sequence, KV head, key). `RAYON_NUM_THREADS` sets the threads.

use std::hint::black_box;
use std::time::Instant;

use pagedkv_cpu::{f16, paged_decode, AttentionParams, BlockTables, CacheShape, KvElem};

fn best<F: FnMut()>(mut f: F, reps: usize) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn run<T: KvElem + Default>(name: &str, from: fn(f32) -> T, reps: usize, ctx: usize) {
    let (batch, nq, nkv, hd, bs) = (32usize, 8usize, 2usize, 64usize, 16usize);
    let per_seq = ctx / bs;
    let shape = CacheShape {
        num_blocks: batch * per_seq,
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let n = shape.elems().unwrap();
    let k: Vec<T> = (0..n)
        .map(|i| from(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
        .collect();
    let v: Vec<T> = (0..n)
        .map(|i| from(((i * 104729) % 1000) as f32 / 1000.0 - 0.5))
        .collect();
    let q: Vec<T> = (0..batch * nq * hd)
        .map(|i| from((i % 13) as f32 / 13.0))
        .collect();
    // A scattered permutation of the blocks.
    let table: Vec<i32> = (0..batch * per_seq)
        .map(|i| ((i * 40503) % (batch * per_seq)) as i32)
        .collect();
    let tables = BlockTables::padded(&table, batch, per_seq).unwrap();
    let lens = vec![ctx as i32; batch];
    let params = AttentionParams {
        num_q_heads: nq,
        scale: 0.125,
        causal: true,
        window: None,
    };
    let mut out = vec![T::default(); q.len()];
    let attn = best(
        || {
            paged_decode(&q, &k, &v, shape, &tables, &lens, params, &mut out).unwrap();
            black_box(&out);
        },
        reps,
    );
    let (mut dk, mut dv) = (vec![T::default(); n], vec![T::default(); n]);
    let copy = best(
        || {
            dk.copy_from_slice(black_box(&k));
            dv.copy_from_slice(black_box(&v));
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

/// Scattered K/V cache and tables for `batch` sequences of `ctx` tokens (SmolLM2 shapes).
fn smol(batch: usize, ctx: usize, reps: usize) -> f64 {
    let (nq, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let per_seq = ctx.div_ceil(bs);
    let shape = CacheShape {
        num_blocks: batch * per_seq,
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let n = shape.elems().unwrap();
    let k: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let q: Vec<f32> = (0..batch * nq * hd)
        .map(|i| (i % 13) as f32 / 13.0)
        .collect();
    let table: Vec<i32> = (0..batch * per_seq)
        .map(|i| ((i * 40503) % (batch * per_seq)) as i32)
        .collect();
    let tables = BlockTables::padded(&table, batch, per_seq).unwrap();
    let lens = vec![ctx as i32; batch];
    let params = AttentionParams {
        num_q_heads: nq,
        scale: 0.125,
        causal: true,
        window: None,
    };
    let mut out = vec![0.0f32; q.len()];
    let t = best(
        || {
            paged_decode(&q, &k, &v, shape, &tables, &lens, params, &mut out).unwrap();
            black_box(&out);
        },
        reps,
    );
    let per_key = t * 1e9 / (batch * nkv * ctx) as f64;
    println!(
        "smollm2 fp32 batch {batch:>2} x context {ctx:>4}: {:>9.1} us per call, {per_key:>6.1} ns per (sequence, KV head, key)",
        t * 1e6
    );
    per_key
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
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
}
