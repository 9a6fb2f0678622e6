//! The model's projections on the file's own quantized weights: `out[t, n] = x[t, k] @ w[k, n]`
//! for fp32 activations `x` and weights held as 8-bit codes with an fp32 scale and offset per
//! block of `block` inputs: `w[i, c] = fma(scale[i / block, c], code[i, c], offset[i / block, c])`.
//!
//! Why: every GGUF block type (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) is `scale * code + offset`
//! per block with `scale * code` exact in fp32, so this form reproduces the fp32 dequantized
//! weights **bit for bit** (one rounding, the same as NumPy's `scale * code + offset`) at a quarter
//! of their bytes; a decode step streams every weight once, so bytes bound batch 1, and the
//! register-blocked tile below makes batch 32 bound by fused multiply-adds instead of loads.
//!
//! Layout: panels of [`PANEL_COLS`] output columns; panel `p` holds the codes of its `[k, 16]`
//! weights (contiguous, so a panel streams in order: one row of [`CodeFormat::row_bytes`] bytes
//! per input feature — 16 int8 codes, or 16 4-bit codes packed two per byte for the 4-bit types,
//! which halves the bytes batch 1 streams) and `scales[p][b][c]`, `offsets[p][b][c]`
//! (`[k / block, 16]` fp32). Columns past `n` are zero.
//!
//! Arithmetic: each output is `acc = fma(x[j, i], w[i, c], acc)` for `i` in order from zero, the
//! weight dequantized in registers; nothing depends on the tile a row lands in, its batch or the
//! thread count, so a token's result does not depend on what it was batched with.
//!
//! Work split: rayon tasks of whole panels (every row of the batch per panel: a panel's codes are
//! read from memory once per call); inside a task, tiles of [`ROWS_PER_TILE`] rows share each
//! dequantized weight: 4 rows x 16 columns = 8 accumulator registers of 8 lanes, with the block's
//! scales, offsets and the weight vector, 15 of AVX2's 16 registers.

use rayon::prelude::*;

use crate::error::{CpuError, Result};

/// Output columns per panel: two AVX2 registers of fp32 sums per row.
pub const PANEL_COLS: usize = 16;
/// Rows sharing one weight vector dequantized in registers (the register budget above).
pub const ROWS_PER_TILE: usize = 4;
/// From this many rows a panel is dequantized once into a buffer and tiles of [`WIDE_TILE`] rows
/// run on fp32 weights (the dequantization is then shared by every row of the batch).
const WIDE_MIN_ROWS: usize = 5;
/// Rows per tile on a dequantized panel: 12 accumulator registers.
const WIDE_TILE: usize = 6;
/// Rows per pass over the panels (a multiple of [`WIDE_TILE`]): 96 rows of 576 (1536) inputs are
/// 221 (590) KB of activations, about one core's L2.
pub(crate) const ROW_CHUNK: usize = 96;
/// Below this many multiply-adds a call runs on the calling thread (no rayon hand-off); above,
/// each task gets at least this many (tiny tasks cost more to hand over than to run).
const TASK_MIN_MACS: usize = 1 << 16;

/// How a panel row stores the 16 codes of one input feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeFormat {
    /// One signed byte per code (any code in -128..=127: Q8_0, Q5_x, Q6_K, ...).
    I8,
    /// Two unsigned 4-bit codes per byte (codes 0..=15: Q4_1, Q4_K): byte `c` holds column `c`
    /// in its low nibble and column `c + 8` in its high one.
    U4,
    /// Two signed (two's complement) 4-bit codes per byte (codes -8..=7: Q4_0), packed as `U4`.
    I4,
}

impl CodeFormat {
    /// Bytes per panel row (one input feature's 16 codes).
    pub const fn row_bytes(self) -> usize {
        match self {
            CodeFormat::I8 => PANEL_COLS,
            CodeFormat::U4 | CodeFormat::I4 => PANEL_COLS / 2,
        }
    }
}

/// Borrowed block-quantized weights in the panel layout of the module docs.
#[derive(Clone, Copy, Debug)]
pub struct BlockWeights<'a> {
    /// Panel rows of `format.row_bytes()` bytes (int8 codes as their byte patterns).
    pub codes: &'a [u8],
    pub format: CodeFormat,
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    /// Input features `k` (a multiple of `block`).
    pub in_features: usize,
    /// Output features `n` (the panels hold `n.div_ceil(16) * 16` columns).
    pub out_features: usize,
    /// Inputs per scale/offset.
    pub block: usize,
}

impl BlockWeights<'_> {
    /// Every length and the block size checked, before any work.
    fn check(&self) -> Result<()> {
        let (k, block) = (self.in_features, self.block);
        if block == 0 || k % block != 0 {
            return Err(CpuError::Shape(format!(
                "block weights: block {block} must be positive and divide in_features {k}"
            )));
        }
        check_panel_lengths(
            "block weights",
            [self.codes.len(), self.scales.len(), self.offsets.len()],
            self.format,
            k,
            self.out_features,
            block,
        )
    }
}

/// The lengths of `[codes, scales, offsets]` against `k x n` weights in blocks of `block` (which
/// divides `k`): `k * format.row_bytes()` code bytes and `k / block * 16` scales and offsets per
/// panel of 16 columns. Both kernels' layouts hold the same number of bytes (the dot layout's
/// groups of 4 or 8 inputs are 64 bytes), so both check here.
pub(crate) fn check_panel_lengths(
    name: &str,
    lengths: [usize; 3],
    format: CodeFormat,
    k: usize,
    n: usize,
    block: usize,
) -> Result<()> {
    let panels = n.div_ceil(PANEL_COLS);
    let want_codes = panels
        .checked_mul(format.row_bytes())
        .and_then(|c| c.checked_mul(k));
    let want_scales = panels
        .checked_mul(k / block)
        .and_then(|b| b.checked_mul(PANEL_COLS));
    let [codes, scales, offsets] = lengths;
    if want_codes != Some(codes) || want_scales != Some(scales) || want_scales != Some(offsets) {
        return Err(CpuError::Shape(format!(
            "{name} [k={k}, n={n}] in blocks of {block}: codes have {codes}, scales {scales}, \
             offsets {offsets} elements; the panels need {want_codes:?}, {want_scales:?}, \
             {want_scales:?}"
        )));
    }
    Ok(())
}

/// Row-major `[n, nb]` scales and offsets (the file's order) as `[panels, nb, 16]`, columns past
/// `n` zero: the layout both kernels read.
pub(crate) fn panel_scales(
    scales: &[f32],
    offsets: &[f32],
    n: usize,
    nb: usize,
) -> (Vec<f32>, Vec<f32>) {
    let panels = n.div_ceil(PANEL_COLS);
    let mut ps = vec![0.0f32; panels * nb * PANEL_COLS];
    let mut po = vec![0.0f32; panels * nb * PANEL_COLS];
    for r in 0..n {
        let (p, c) = (r / PANEL_COLS, r % PANEL_COLS);
        for b in 0..nb {
            ps[(p * nb + b) * PANEL_COLS + c] = scales[r * nb + b];
            po[(p * nb + b) * PANEL_COLS + c] = offsets[r * nb + b];
        }
    }
    (ps, po)
}

/// `out[t, n] = x[t, k] @ w` (`x`, `out` row-major). Lengths are checked first: a mismatch is a
/// [`CpuError::Shape`] and nothing is written.
pub fn matmul_blocks(x: &[f32], w: BlockWeights<'_>, t: usize, out: &mut [f32]) -> Result<()> {
    w.check()?;
    let (k, n) = (w.in_features, w.out_features);
    if !has_work(x, t, k, n, out)? {
        return Ok(());
    }
    // Long batches (prefill) in chunks of rows, so that a chunk's activations stay in the L2
    // cache while every panel of the matrix passes over them; a row's arithmetic is unchanged.
    for (xc, oc) in x.chunks(ROW_CHUNK * k).zip(out.chunks_mut(ROW_CHUNK * n)) {
        let rows = xc.len() / k;
        match w.format {
            CodeFormat::I8 => panels_into::<I8Row>(xc, w, rows, oc),
            CodeFormat::U4 => panels_into::<U4Row>(xc, w, rows, oc),
            CodeFormat::I4 => panels_into::<I4Row>(xc, w, rows, oc),
        }
    }
    Ok(())
}

/// The activations' and the output's lengths checked against `[t, k] @ [k, n]` (a mismatch is a
/// [`CpuError::Shape`], nothing written); `false` when there is nothing to multiply (no output,
/// or `k = 0`: the output is then zero). Shared by both projection kernels.
pub(crate) fn has_work(x: &[f32], t: usize, k: usize, n: usize, out: &mut [f32]) -> Result<bool> {
    let x_len = t.checked_mul(k);
    let out_len = t.checked_mul(n);
    if x_len != Some(x.len()) || out_len != Some(out.len()) {
        return Err(CpuError::Shape(format!(
            "matmul: x has {} elements and out {}; [t={t}, k={k}] @ [k={k}, n={n}] needs {x_len:?} and {out_len:?}",
            x.len(),
            out.len()
        )));
    }
    if k == 0 {
        out.fill(0.0);
    }
    Ok(!out.is_empty() && k > 0)
}

/// A rayon task: a run of consecutive panels and, for each row of the batch, the slice of `out`
/// holding those panels' columns (disjoint from every other task's).
struct Task<'o> {
    first_panel: usize,
    rows: Vec<&'o mut [f32]>,
}

/// `out [t, n]` cut into tasks of `panels_per_task` panels: each row split at the tasks' column
/// boundaries, so that tasks write their results in place.
fn tasks_over(out: &mut [f32], t: usize, n: usize, panels_per_task: usize) -> Vec<Task<'_>> {
    let cols = panels_per_task * PANEL_COLS;
    let mut tasks: Vec<Task<'_>> = (0..n.div_ceil(cols))
        .map(|i| Task {
            first_panel: i * panels_per_task,
            rows: Vec::with_capacity(t),
        })
        .collect();
    for row in out.chunks_mut(n) {
        for (task, part) in tasks.iter_mut().zip(row.chunks_mut(cols)) {
            task.rows.push(part);
        }
    }
    tasks
}

/// Every panel of an `[k, n]` product with `t` rows, written into `out [t, n]`: rayon over runs
/// of panels (each at least `TASK_MIN_MACS` of work, at most ~16 runs per thread; one run on the
/// calling thread below that). Each task makes its `scratch()` once, and `panel(p, scratch, dst)`
/// fills `dst` (`[t, 16]`) with panel `p`'s columns, which are then copied into place. Shared by
/// both kernels (fp32 activations here, 8-bit activations in `dot_matmul`).
pub(crate) fn panel_tasks<S>(
    out: &mut [f32],
    t: usize,
    k: usize,
    n: usize,
    scratch: impl Fn() -> S + Sync,
    panel: impl Fn(usize, &mut S, &mut [f32]) + Sync,
) {
    let panels = n.div_ceil(PANEL_COLS);
    let macs_per_panel = k * PANEL_COLS * t;
    let serial = macs_per_panel.saturating_mul(panels) < TASK_MIN_MACS;
    let per_task = if serial {
        panels
    } else {
        let most_tasks = 16 * rayon::current_num_threads().max(1);
        TASK_MIN_MACS
            .div_ceil(macs_per_panel)
            .max(panels.div_ceil(most_tasks))
            .max(1)
    };
    let run = |task: Task<'_>| {
        let mut dst = vec![0.0f32; t * PANEL_COLS];
        let mut state = scratch();
        let mut rows = task.rows;
        for p in task.first_panel..(task.first_panel + per_task).min(panels) {
            panel(p, &mut state, &mut dst);
            let c0 = (p - task.first_panel) * PANEL_COLS;
            for (row, src) in rows.iter_mut().zip(dst.chunks_exact(PANEL_COLS)) {
                let cols = PANEL_COLS.min(row.len() - c0);
                row[c0..c0 + cols].copy_from_slice(&src[..cols]);
            }
        }
    };
    let tasks = tasks_over(out, t, n, per_task);
    if serial {
        tasks.into_iter().for_each(run);
    } else {
        tasks.into_par_iter().for_each(run);
    }
}

/// The product of every panel with `x [t, k]`, written into `out [t, n]` (`panel_tasks`): the
/// small-batch or the wide path (module docs) per panel.
fn panels_into<F: CodeRow>(x: &[f32], w: BlockWeights<'_>, t: usize, out: &mut [f32]) {
    let (k, n, nb) = (w.in_features, w.out_features, w.in_features / w.block);
    let panel = |p: usize| Panel {
        codes: &w.codes[p * k * F::BYTES..(p + 1) * k * F::BYTES],
        scales: &w.scales[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS],
        offsets: &w.offsets[p * nb * PANEL_COLS..(p + 1) * nb * PANEL_COLS],
        block: w.block,
    };
    let wide = t >= WIDE_MIN_ROWS;
    let xt4 = if wide {
        Vec::new()
    } else {
        tile_rows::<ROWS_PER_TILE>(x, t, k)
    };
    let xt6 = if wide {
        tile_rows::<WIDE_TILE>(x, t, k)
    } else {
        Vec::new()
    };
    let scratch = || {
        if wide {
            vec![[0.0f32; PANEL_COLS]; k]
        } else {
            Vec::new()
        }
    };
    panel_tasks(out, t, k, n, scratch, |p, wbuf, dst| {
        if wide {
            wide_panel::<F>(&xt6, t, k, panel(p), wbuf, dst);
        } else {
            fused_panel::<F>(&xt4, t, k, panel(p), dst);
        }
    });
}

/// One panel row's 16 codes widened to fp32 (exact), per [`CodeFormat`].
trait CodeRow {
    const BYTES: usize;
    fn widen(row: &[u8]) -> [f32; PANEL_COLS];
}

struct I8Row;
struct U4Row;
struct I4Row;

impl CodeRow for I8Row {
    const BYTES: usize = PANEL_COLS;
    #[inline(always)]
    fn widen(row: &[u8]) -> [f32; PANEL_COLS] {
        let row: &[u8; PANEL_COLS] = row.try_into().expect("a row of 16 codes");
        let mut q = [0.0f32; PANEL_COLS];
        for c in 0..PANEL_COLS {
            q[c] = f32::from(row[c] as i8);
        }
        q
    }
}

impl CodeRow for U4Row {
    const BYTES: usize = PANEL_COLS / 2;
    #[inline(always)]
    fn widen(row: &[u8]) -> [f32; PANEL_COLS] {
        let row: &[u8; PANEL_COLS / 2] = row.try_into().expect("a row of 8 bytes");
        let mut q = [0.0f32; PANEL_COLS];
        for c in 0..PANEL_COLS / 2 {
            q[c] = f32::from(row[c] & 15);
            q[c + PANEL_COLS / 2] = f32::from(row[c] >> 4);
        }
        q
    }
}

impl CodeRow for I4Row {
    const BYTES: usize = PANEL_COLS / 2;
    #[inline(always)]
    fn widen(row: &[u8]) -> [f32; PANEL_COLS] {
        let row: &[u8; PANEL_COLS / 2] = row.try_into().expect("a row of 8 bytes");
        let mut q = [0.0f32; PANEL_COLS];
        for c in 0..PANEL_COLS / 2 {
            // Arithmetic shifts of the byte sign-extend each nibble.
            q[c] = f32::from(((row[c] << 4) as i8) >> 4);
            q[c + PANEL_COLS / 2] = f32::from((row[c] as i8) >> 4);
        }
        q
    }
}

/// One panel's borrowed codes, scales and offsets.
#[derive(Clone, Copy)]
struct Panel<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
    offsets: &'a [f32],
    block: usize,
}

/// `x [t, k]` regrouped as `[t / R, k]` tiles of `R` rows side by side (`[f32; R]` per input
/// feature), the last tile zero-padded: the tile kernels then read one short array per step.
fn tile_rows<const R: usize>(x: &[f32], t: usize, k: usize) -> Vec<[f32; R]> {
    let mut xt = vec![[0.0f32; R]; t.div_ceil(R) * k];
    for (j, row) in x.chunks_exact(k).enumerate() {
        let (tile, r) = (j / R, j % R);
        for (dst, &v) in xt[tile * k..(tile + 1) * k].iter_mut().zip(row) {
            dst[r] = v;
        }
    }
    xt
}

/// The 16 weights of one input feature: `fma(scale, code, offset)` (exact: see the module docs).
#[inline(always)]
fn dequantize(
    s: &[f32; PANEL_COLS],
    q: [f32; PANEL_COLS],
    o: &[f32; PANEL_COLS],
) -> [f32; PANEL_COLS] {
    let mut w = [0.0f32; PANEL_COLS];
    for c in 0..PANEL_COLS {
        w[c] = s[c].mul_add(q[c], o[c]);
    }
    w
}

/// Small batches (up to 4 rows): one panel for every row, the weights dequantized in registers
/// and used at once (`dst` is `[t, 16]`).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn fused_panel<'a, F: CodeRow>(
    xt: &[[f32; ROWS_PER_TILE]],
    t: usize,
    k: usize,
    w: Panel<'a>,
    dst: &mut [f32],
) {
    for (tile, rows_out) in dst.chunks_mut(ROWS_PER_TILE * PANEL_COLS).enumerate() {
        let x = &xt[tile * k..(tile + 1) * k];
        let rows = (t - tile * ROWS_PER_TILE).min(ROWS_PER_TILE);
        let acc = match rows {
            4 => fused_tile::<F, 4>(x, w),
            3 => fused_tile::<F, 3>(x, w),
            2 => fused_tile::<F, 2>(x, w),
            _ => fused_tile::<F, 1>(x, w),
        };
        for (dst_row, acc_row) in rows_out.chunks_exact_mut(PANEL_COLS).zip(&acc) {
            dst_row.copy_from_slice(acc_row);
        }
    }
}

/// `R` rows (of a 4-row tile) times one panel: per input feature the 16 weights are dequantized
/// once and fused into `R` rows of sums: 8 accumulator registers, the block's scales and
/// offsets and the weights, 15 of AVX2's 16. Constant trip counts, so that LLVM keeps `acc` in
/// registers and vectorises the 16 columns.
#[inline(always)]
fn fused_tile<F: CodeRow, const R: usize>(
    x: &[[f32; ROWS_PER_TILE]],
    w: Panel<'_>,
) -> [[f32; PANEL_COLS]; ROWS_PER_TILE] {
    let mut acc = [[0.0f32; PANEL_COLS]; R];
    let blocks = x
        .chunks_exact(w.block)
        .zip(w.codes.chunks_exact(w.block * F::BYTES))
        .zip(
            w.scales
                .chunks_exact(PANEL_COLS)
                .zip(w.offsets.chunks_exact(PANEL_COLS)),
        );
    for ((xb, qb), (s, o)) in blocks {
        let s: &[f32; PANEL_COLS] = s.try_into().expect("PANEL_COLS scales");
        let o: &[f32; PANEL_COLS] = o.try_into().expect("PANEL_COLS offsets");
        for (xv, q) in xb.iter().zip(qb.chunks_exact(F::BYTES)) {
            let w = dequantize(s, F::widen(q), o);
            for r in 0..R {
                for c in 0..PANEL_COLS {
                    acc[r][c] = xv[r].mul_add(w[c], acc[r][c]);
                }
            }
        }
    }
    let mut out = [[0.0f32; PANEL_COLS]; ROWS_PER_TILE];
    out[..R].copy_from_slice(&acc);
    out
}

/// Larger batches: the panel is dequantized once into `wbuf` (`[k, 16]` fp32, the same values
/// the fused path computes), then tiles of 6 rows run on plain fp32 weights: 12 accumulator
/// registers, 2 weight registers and a broadcast, 12 fused multiply-adds per 8 loads.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c",
    "aarch64+neon"
))]
fn wide_panel<'a, F: CodeRow>(
    xt: &[[f32; WIDE_TILE]],
    t: usize,
    k: usize,
    w: Panel<'a>,
    wbuf: &mut [[f32; PANEL_COLS]],
    dst: &mut [f32],
) {
    let rows_of_block = w.codes.chunks_exact(w.block * F::BYTES);
    let scales = w
        .scales
        .chunks_exact(PANEL_COLS)
        .zip(w.offsets.chunks_exact(PANEL_COLS));
    for ((wb, qb), (s, o)) in wbuf
        .chunks_exact_mut(w.block)
        .zip(rows_of_block)
        .zip(scales)
    {
        let s: &[f32; PANEL_COLS] = s.try_into().expect("PANEL_COLS scales");
        let o: &[f32; PANEL_COLS] = o.try_into().expect("PANEL_COLS offsets");
        for (wr, q) in wb.iter_mut().zip(qb.chunks_exact(F::BYTES)) {
            *wr = dequantize(s, F::widen(q), o);
        }
    }
    for (tile, rows_out) in dst.chunks_mut(WIDE_TILE * PANEL_COLS).enumerate() {
        let x = &xt[tile * k..(tile + 1) * k];
        let acc = match (t - tile * WIDE_TILE).min(WIDE_TILE) {
            6 => wide_tile::<6>(x, wbuf),
            5 => wide_tile::<5>(x, wbuf),
            4 => wide_tile::<4>(x, wbuf),
            3 => wide_tile::<3>(x, wbuf),
            2 => wide_tile::<2>(x, wbuf),
            _ => wide_tile::<1>(x, wbuf),
        };
        for (dst_row, acc_row) in rows_out.chunks_exact_mut(PANEL_COLS).zip(&acc) {
            dst_row.copy_from_slice(acc_row);
        }
    }
}

#[inline(always)]
fn wide_tile<const R: usize>(
    x: &[[f32; WIDE_TILE]],
    wbuf: &[[f32; PANEL_COLS]],
) -> [[f32; PANEL_COLS]; WIDE_TILE] {
    let mut acc = [[0.0f32; PANEL_COLS]; R];
    for (xv, w) in x.iter().zip(wbuf) {
        for r in 0..R {
            for c in 0..PANEL_COLS {
                acc[r][c] = xv[r].mul_add(w[c], acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; PANEL_COLS]; WIDE_TILE];
    out[..R].copy_from_slice(&acc);
    out
}

/// Row-major `[n, k]` codes and `[n, k / block]` scales/offsets (the file's order: one output
/// feature per row) as the kernel's panels in `format`: `(codes, scales, offsets)`, columns past
/// `n` zero. The caller has checked the lengths (`n * k`, `n * (k / block)`) and that every code
/// fits the format (a 4-bit format keeps a code's low 4 bits).
pub fn to_panels(
    codes: &[i8],
    scales: &[f32],
    offsets: &[f32],
    k: usize,
    n: usize,
    block: usize,
    format: CodeFormat,
) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (panels, row) = (n.div_ceil(PANEL_COLS), format.row_bytes());
    let mut pc = vec![0u8; panels * k * row];
    for r in 0..n {
        let (p, c) = (r / PANEL_COLS, r % PANEL_COLS);
        for i in 0..k {
            let code = codes[r * k + i] as u8;
            let at = (p * k + i) * row;
            match format {
                CodeFormat::I8 => pc[at + c] = code,
                CodeFormat::U4 | CodeFormat::I4 => {
                    let half = PANEL_COLS / 2;
                    pc[at + c % half] |= (code & 15) << (4 * (c / half));
                }
            }
        }
    }
    let (ps, po) = panel_scales(scales, offsets, n, k / block);
    (pc, ps, po)
}

#[cfg(test)]
mod tests;
