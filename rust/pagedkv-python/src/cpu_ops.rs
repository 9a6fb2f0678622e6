//! Bindings of the CPU data plane (`pagedkv-cpu`): NumPy arrays in, slices out, the GIL released
//! around each kernel. Conversion only: every size and index check lives in the crate, which
//! refuses a bad call before its first write.
//!
//! dtypes: float32, float16, and uint16 holding bfloat16 bit patterns (the package's bf16
//! convention), native byte order. Every array must be C-contiguous and aligned to its dtype
//! (caches are read or written in place; anything else is an `InvalidArgumentError`, see
//! `arrays.rs`); the Python layer makes queries, new K/V and integer metadata so before calling.

use half::slice::HalfBitsSliceExt;
use numpy::{
    Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pagedkv_cpu::{self as cpu, bf16, f16, AttentionParams, BlockTables, CacheShape, KvElem};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::arrays::require_aligned;
use crate::errors::invalid_argument;

/// A NumPy element type and the cache element it stores.
pub(crate) trait Storage: Element + Copy + Send + Sync {
    type Elem: KvElem;
    fn view(s: &[Self]) -> &[Self::Elem];
    fn view_mut(s: &mut [Self]) -> &mut [Self::Elem];
}

impl Storage for f32 {
    type Elem = f32;
    fn view(s: &[Self]) -> &[f32] {
        s
    }
    fn view_mut(s: &mut [Self]) -> &mut [f32] {
        s
    }
}

impl Storage for f16 {
    type Elem = f16;
    fn view(s: &[Self]) -> &[f16] {
        s
    }
    fn view_mut(s: &mut [Self]) -> &mut [f16] {
        s
    }
}

/// bfloat16 as uint16 bit patterns.
impl Storage for u16 {
    type Elem = bf16;
    fn view(s: &[Self]) -> &[bf16] {
        s.reinterpret_cast()
    }
    fn view_mut(s: &mut [Self]) -> &mut [bf16] {
        s.reinterpret_cast_mut()
    }
}

pub(crate) fn err(py: Python<'_>, e: cpu::CpuError) -> PyErr {
    invalid_argument(py, e.to_string())
}

/// The dtype of a cache or query array: "f32" | "f16" | "bf16".
pub(crate) fn kind(py: Python<'_>, name: &str, x: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    let arr = x
        .cast::<PyUntypedArray>()
        .map_err(|_| invalid_argument(py, format!("{name} must be a NumPy array")))?;
    let dt = arr.dtype();
    if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        Ok("f32")
    } else if dt.is_equiv_to(&numpy::dtype::<f16>(py)) {
        Ok("f16")
    } else if dt.is_equiv_to(&numpy::dtype::<u16>(py)) {
        Ok("bf16")
    } else {
        Err(invalid_argument(
            py,
            format!(
                "{name}: dtype {dt} is not supported by backend='cpu' (float32, float16, or \
                 bfloat16 as uint16 bit patterns)"
            ),
        ))
    }
}

/// `x` as a read-only C-contiguous `ndim`-D array of `T`: the one conversion every argument that
/// is read goes through. `dtype` names what a wrong element type should have been.
pub(crate) fn array<'py, T: Element>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let arr = x
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| invalid_argument(py, format!("{name} must be {dtype}")))?;
    if arr.ndim() != ndim {
        return Err(invalid_argument(
            py,
            format!("{name} must be {ndim}-D, got shape {:?}", arr.shape()),
        ));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(py, format!("{name} must be C-contiguous")));
    }
    require_aligned(py, name, arr.as_untyped())?;
    arr.try_readonly()
        .map_err(|e| invalid_argument(py, format!("{name}: {e}")))
}

/// A K/V tensor: its dtype must be the call's (the first tensor's, see [`kind`]).
pub(crate) fn read<'py, S: Storage>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
) -> PyResult<PyReadonlyArrayDyn<'py, S>> {
    array(py, name, x, ndim, "of the dtype of the other tensors")
}

/// Integer metadata (block tables, lengths, slots, copy ops).
pub(crate) fn ints<'py, T: Element>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dtype: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    array(py, name, x, ndim, &format!("a {dtype} NumPy array"))
}

fn cache_shape(py: Python<'_>, k: &[usize], v: &[usize]) -> PyResult<CacheShape> {
    if k != v {
        return Err(invalid_argument(
            py,
            format!("v_cache shape {v:?} != k_cache shape {k:?}"),
        ));
    }
    Ok(CacheShape {
        num_blocks: k[0],
        block_size: k[1],
        num_kv_heads: k[2],
        head_dim: k[3],
    })
}

/// The block tables argument: a padded int32 `[B, max_blocks]` array or a CSR tuple
/// `(kv_indptr, kv_indices, kv_last_page_len)`.
pub(crate) enum Tables<'py> {
    Padded(PyReadonlyArrayDyn<'py, i32>),
    Csr([PyReadonlyArrayDyn<'py, i32>; 3]),
}

impl<'py> Tables<'py> {
    pub(crate) fn new(py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = x.cast::<PyTuple>() {
            if t.len() != 3 {
                return Err(invalid_argument(
                    py,
                    "a CSR page table is (kv_indptr, kv_indices, kv_last_page_len)".into(),
                ));
            }
            return Ok(Tables::Csr([
                ints(py, "kv_indptr", &t.get_item(0)?, 1, "int32")?,
                ints(py, "kv_indices", &t.get_item(1)?, 1, "int32")?,
                ints(py, "kv_last_page_len", &t.get_item(2)?, 1, "int32")?,
            ]));
        }
        Ok(Tables::Padded(ints(py, "block_tables", x, 2, "int32")?))
    }

    pub(crate) fn build(
        &self,
        py: Python<'_>,
        seq_lens: &[i32],
        block_size: usize,
    ) -> PyResult<BlockTables<'_>> {
        let tables = match self {
            Tables::Padded(a) => {
                let shape = a.shape();
                BlockTables::padded(slice(a)?, shape[0], shape[1])
            }
            Tables::Csr([indptr, indices, last]) => {
                let (indptr, indices, last) = (slice(indptr)?, slice(indices)?, slice(last)?);
                BlockTables::csr(indptr, indices)
                    .and_then(|t| t.check_csr_exact(last, seq_lens, block_size).map(|()| t))
            }
        };
        tables.map_err(|e| err(py, e))
    }
}

/// The slice of an array borrowed by [`array`], which checked it C-contiguous and aligned; a
/// typed error, never an empty slice, if it somehow is not (see `arrays.rs`).
pub(crate) fn slice<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|e| invalid_argument(a.py(), format!("array not readable in place: {e}")))
}

/// The attention arguments decode and prefill share, for plain and quantized caches alike:
/// `q [num_tokens, num_q_heads, head_dim]`, the block tables (padded or CSR), `seq_lens`, the
/// prefill's `query_start_loc` (None: decode), and the kernel parameters.
pub(crate) struct AttentionArgs<'py, S: Storage> {
    q: PyReadonlyArrayDyn<'py, S>,
    tables: Tables<'py>,
    seq_lens: PyReadonlyArrayDyn<'py, i32>,
    query_start_loc: Option<PyReadonlyArrayDyn<'py, i32>>,
    params: AttentionParams,
}

impl<'py, S: Storage> AttentionArgs<'py, S> {
    /// Reads the shared arguments (the default scale is 1 / sqrt(head_dim)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read(
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        tables: &Bound<'py, PyAny>,
        seq_lens: &Bound<'py, PyAny>,
        query_start_loc: Option<&Bound<'py, PyAny>>,
        scale: Option<f64>,
        causal: bool,
        window: Option<usize>,
    ) -> PyResult<Self> {
        let q = read::<S>(py, "q", q, 3)?;
        let seq_lens = ints::<i32>(py, "seq_lens", seq_lens, 1, "int32")?;
        let query_start_loc = query_start_loc
            .map(|x| ints::<i32>(py, "query_start_loc", x, 1, "int32"))
            .transpose()?;
        let tables = Tables::new(py, tables)?;
        let (num_q_heads, head_dim) = (q.shape()[1], q.shape()[2]);
        let scale = scale.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt());
        let params = AttentionParams {
            num_q_heads,
            scale: scale as f32,
            causal,
            window,
        };
        Ok(AttentionArgs {
            q,
            tables,
            seq_lens,
            query_start_loc,
            params,
        })
    }

    /// Checks `q`'s head_dim against the cache's, builds the tables for `block_size`, and runs
    /// `kernel` (q, tables, seq_lens, query_start_loc, params, out) with the GIL released into a
    /// new output `[num_tokens, num_q_heads, head_dim]`.
    pub(crate) fn run<F>(
        &self,
        py: Python<'py>,
        cache_head_dim: usize,
        block_size: usize,
        kernel: F,
    ) -> PyResult<Bound<'py, PyAny>>
    where
        F: for<'t> FnOnce(
                &[S::Elem],
                &BlockTables<'t>,
                &[i32],
                Option<&[i32]>,
                AttentionParams,
                &mut [S::Elem],
            ) -> cpu::Result<()>
            + Send,
    {
        let (num_tokens, num_q_heads, head_dim) =
            (self.q.shape()[0], self.q.shape()[1], self.q.shape()[2]);
        if head_dim != cache_head_dim {
            return Err(invalid_argument(
                py,
                format!("q head_dim {head_dim} != cache head_dim {cache_head_dim}"),
            ));
        }
        let lens = slice(&self.seq_lens)?;
        let table = self.tables.build(py, lens, block_size)?;
        let out = PyArrayDyn::<S>::zeros(py, &[num_tokens, num_q_heads, head_dim][..], false);
        {
            let mut out_rw = out.readwrite();
            let out_s = S::view_mut(
                out_rw
                    .as_slice_mut()
                    .map_err(|e| invalid_argument(py, format!("output: {e}")))?,
            );
            let qs = S::view(slice(&self.q)?);
            let qsl = self.query_start_loc.as_ref().map(slice).transpose()?;
            let params = self.params;
            py.detach(|| kernel(qs, &table, lens, qsl, params, out_s))
                .map_err(|e| err(py, e))?;
        }
        Ok(out.into_any())
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_t<'py, S: Storage>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    query_start_loc: Option<&Bound<'py, PyAny>>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let args = AttentionArgs::<S>::read(
        py,
        q,
        tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        window,
    )?;
    let k = read::<S>(py, "k_cache", k_cache, 4)?;
    let v = read::<S>(py, "v_cache", v_cache, 4)?;
    let cache = cache_shape(py, k.shape(), v.shape())?;
    let (ks, vs) = (S::view(slice(&k)?), S::view(slice(&v)?));
    args.run(
        py,
        cache.head_dim,
        cache.block_size,
        move |qs, table, lens, qsl, params, out| match qsl {
            Some(qsl) => cpu::paged_prefill(qs, ks, vs, cache, table, lens, qsl, params, out),
            None => cpu::paged_decode(qs, ks, vs, cache, table, lens, params, out),
        },
    )
}

macro_rules! dispatch {
    ($py:expr, $kind:expr, $f:ident ( $($arg:expr),* )) => {
        match $kind {
            "f32" => $f::<f32>($($arg),*),
            "f16" => $f::<f16>($($arg),*),
            _ => $f::<u16>($($arg),*),
        }
    };
}

/// Both attention entry points: the cache dtype (from `q`) picks the monomorphised kernel.
#[allow(clippy::too_many_arguments)]
fn attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    query_start_loc: Option<&Bound<'py, PyAny>>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let k = kind(py, "q", q)?;
    dispatch!(
        py,
        k,
        attention_t(
            py,
            q,
            k_cache,
            v_cache,
            tables,
            seq_lens,
            query_start_loc,
            scale,
            causal,
            window
        )
    )
}

/// Paged decode attention (see `pagedkv.attention.paged_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale=None, window=None))]
#[allow(clippy::too_many_arguments)]
fn cpu_paged_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    scale: Option<f64>,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    attention(
        py,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        None,
        scale,
        true,
        window,
    )
}

/// Paged prefill attention (see `pagedkv.attention.paged_prefill_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, causal=true, window=None))]
#[allow(clippy::too_many_arguments)]
fn cpu_paged_prefill_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    query_start_loc: &Bound<'py, PyAny>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    attention(
        py,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        Some(query_start_loc),
        scale,
        causal,
        window,
    )
}

/// `x [t, k] @ W [k, n]` with bf16 weights in the kernel's panels (uint16 bit patterns
/// `[ceil(n / 64), k, 64]`, columns past `n` ignored), fp32 out `[t, n]`: the model's projections
/// (see `pagedkv.models.bf16_weights`).
#[pyfunction]
fn cpu_matmul_bf16<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let x = array::<f32>(py, "x", x, 2, "a float32 NumPy array")?;
    let w = array::<u16>(
        py,
        "w",
        w,
        3,
        "a uint16 NumPy array (bfloat16 bit patterns)",
    )?;
    let (t, k) = (x.shape()[0], x.shape()[1]);
    let cols = cpu::matmul::COLS_PER_TASK;
    let want = [n.div_ceil(cols), k, cols];
    if w.shape() != want {
        return Err(invalid_argument(
            py,
            format!(
                "x is [{t}, {k}], so w must be {want:?} panels for n = {n}; got {:?}",
                w.shape()
            ),
        ));
    }
    let (xs, ws): (&[f32], &[bf16]) = (slice(&x)?, slice(&w)?.reinterpret_cast());
    new_f32(py, &[t, n], |out| cpu::matmul_bf16(xs, ws, t, k, n, out))
}

/// A new fp32 array of `shape` and the result of `fill` on its elements, computed with the GIL
/// released.
pub(crate) fn new_f32<'py>(
    py: Python<'py>,
    shape: &[usize],
    fill: impl FnOnce(&mut [f32]) -> cpu::Result<()> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    let out = PyArrayDyn::<f32>::zeros(py, shape, false);
    {
        let mut rw = out.readwrite();
        let s = rw
            .as_slice_mut()
            .map_err(|e| invalid_argument(py, format!("output: {e}")))?;
        py.detach(|| fill(s)).map_err(|e| err(py, e))?;
    }
    Ok(out.into_any())
}

/// `x [t, d]` and a norm weight `[d]`, both float32 and C-contiguous.
fn norm_args<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
) -> PyResult<(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, f32>)> {
    let x = array::<f32>(py, "x", x, 2, "a float32 NumPy array")?;
    let weight = array::<f32>(py, "weight", weight, 1, "a float32 NumPy array")?;
    if weight.shape()[0] != x.shape()[1] {
        return Err(invalid_argument(
            py,
            format!(
                "x is {:?}, so weight must be [{}]; got {:?}",
                x.shape(),
                x.shape()[1],
                weight.shape()
            ),
        ));
    }
    Ok((x, weight))
}

/// RMS norm of each row of `x [t, d]` scaled by `weight [d]` (see `pagedkv.models.llama.rms_norm`).
#[pyfunction]
fn cpu_rms_norm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    eps: f32,
) -> PyResult<Bound<'py, PyAny>> {
    let (x, weight) = norm_args(py, x, weight)?;
    let (xs, ws, t) = (slice(&x)?, slice(&weight)?, x.shape()[0]);
    new_f32(py, x.shape(), |out| cpu::rms_norm(xs, ws, eps, t, out))
}

/// The residual add and the next RMS norm: `(x + delta, rms_norm(x + delta, weight, eps))`.
#[pyfunction]
fn cpu_add_rms_norm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    delta: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    eps: f32,
) -> PyResult<Bound<'py, PyTuple>> {
    let (x, weight) = norm_args(py, x, weight)?;
    let delta = array::<f32>(py, "delta", delta, 2, "a float32 NumPy array")?;
    if delta.shape() != x.shape() {
        return Err(invalid_argument(
            py,
            format!(
                "delta must have x's shape {:?}, got {:?}",
                x.shape(),
                delta.shape()
            ),
        ));
    }
    let sum = PyArrayDyn::<f32>::zeros(py, x.shape(), false);
    let normed = {
        let mut sum_rw = sum.readwrite();
        let sum_s = sum_rw
            .as_slice_mut()
            .map_err(|e| invalid_argument(py, format!("output: {e}")))?;
        let (xs, ds, ws, t) = (slice(&x)?, slice(&delta)?, slice(&weight)?, x.shape()[0]);
        new_f32(py, x.shape(), |normed| {
            cpu::add_rms_norm(xs, ds, ws, eps, t, sum_s, normed)
        })?
    };
    PyTuple::new(py, [sum.into_any(), normed])
}

/// `silu(gate) * up` for `gate_up [t, 2f]` holding `[gate | up]`: float32 `[t, f]`.
#[pyfunction]
fn cpu_silu_mul<'py>(py: Python<'py>, gate_up: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let gu = array::<f32>(py, "gate_up", gate_up, 2, "a float32 NumPy array")?;
    let (t, width) = (gu.shape()[0], gu.shape()[1]);
    if width % 2 != 0 {
        return Err(invalid_argument(
            py,
            format!("gate_up's width {width} must be even ([gate | up])"),
        ));
    }
    let f = width / 2;
    let gs = slice(&gu)?;
    new_f32(py, &[t, f], |out| cpu::silu_mul(gs, t, f, out))
}

/// Heads `[first_head, first_head + num_heads)` of `x [t, heads, head_dim]` rotated by adjacent
/// pairs with `cos`, `sin` `[t, head_dim / 2]` (see `pagedkv.models.llama.rotary_interleaved`):
/// float32 `[t, num_heads, head_dim]`; every head from `first_head` on when `num_heads` is None.
#[pyfunction]
#[pyo3(signature = (x, cos, sin, first_head=0, num_heads=None))]
fn cpu_rope_interleaved<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    cos: &Bound<'py, PyAny>,
    sin: &Bound<'py, PyAny>,
    first_head: usize,
    num_heads: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let x = array::<f32>(py, "x", x, 3, "a float32 NumPy array")?;
    let cos = array::<f32>(py, "cos", cos, 2, "a float32 NumPy array")?;
    let sin = array::<f32>(py, "sin", sin, 2, "a float32 NumPy array")?;
    let (t, h, hd) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    if hd % 2 != 0 {
        return Err(invalid_argument(
            py,
            format!("x's head_dim {hd} must be even (adjacent pairs)"),
        ));
    }
    let table = [t, hd / 2];
    if cos.shape() != table || sin.shape() != table {
        return Err(invalid_argument(
            py,
            format!(
                "x is {:?}, so cos and sin must be {table:?}; got {:?}, {:?}",
                x.shape(),
                cos.shape(),
                sin.shape()
            ),
        ));
    }
    let count = num_heads.unwrap_or(h.saturating_sub(first_head));
    let end = first_head.checked_add(count).filter(|e| *e <= h);
    let Some(end) = end else {
        return Err(invalid_argument(
            py,
            format!("heads [{first_head}, {first_head} + {count}) are not among x's {h} heads"),
        ));
    };
    let shape = cpu::RopeShape {
        tokens: t,
        heads: h,
        head_dim: hd,
    };
    let (xs, cs, ss) = (slice(&x)?, slice(&cos)?, slice(&sin)?);
    new_f32(py, &[t, count, hd], |out| {
        cpu::rope_interleaved(xs, cs, ss, shape, first_head..end, out)
    })
}

fn write_kv_t<'py, S: Storage>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let k = read::<S>(py, "k", k, 3)?;
    let v = read::<S>(py, "v", v, 3)?;
    let slots = ints::<i64>(py, "slot_mapping", slot_mapping, 1, "int64")?;
    let mut kc = write::<S>(py, "k_cache", k_cache)?;
    let mut vc = write::<S>(py, "v_cache", v_cache)?;
    let cache = cache_shape(py, kc.shape(), vc.shape())?;
    if k.shape() != v.shape() || k.shape()[1..] != kc.shape()[2..] {
        return Err(invalid_argument(
            py,
            format!(
                "k {:?} and v {:?} must be [num_tokens, {}, {}]",
                k.shape(),
                v.shape(),
                cache.num_kv_heads,
                cache.head_dim
            ),
        ));
    }
    let (ks, vs, ss) = (S::view(slice(&k)?), S::view(slice(&v)?), slice(&slots)?);
    let kcs = S::view_mut(mut_slice(py, &mut kc)?);
    let vcs = S::view_mut(mut_slice(py, &mut vc)?);
    py.detach(|| cpu::write_kv(ks, vs, kcs, vcs, cache, ss))
        .map_err(|e| err(py, e))
}

/// A writable C-contiguous 4-D cache, borrowed exclusively (the same array passed twice is
/// refused by NumPy's borrow tracking).
fn write<'py, S: Storage>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<numpy::PyReadwriteArrayDyn<'py, S>> {
    let arr = x.cast::<PyArrayDyn<S>>().map_err(|_| {
        invalid_argument(
            py,
            format!("{name} must share the dtype of the other tensors"),
        )
    })?;
    if arr.ndim() != 4 {
        return Err(invalid_argument(
            py,
            format!(
                "{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {:?}",
                arr.shape()
            ),
        ));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(py, format!("{name} must be C-contiguous")));
    }
    require_aligned(py, name, arr.as_untyped())?;
    arr.try_readwrite().map_err(|e| {
        invalid_argument(
            py,
            format!("{name} is read-only or borrowed twice (one array passed as two caches?): {e}"),
        )
    })
}

pub(crate) fn mut_slice<'a, S: Element>(
    py: Python<'_>,
    a: &'a mut numpy::PyReadwriteArrayDyn<'_, S>,
) -> PyResult<&'a mut [S]> {
    a.as_slice_mut()
        .map_err(|e| invalid_argument(py, format!("cache: {e}")))
}

/// Writes new tokens' K/V into their slots (see `pagedkv.attention.write_kv`).
#[pyfunction]
fn cpu_write_kv<'py>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let kd = kind(py, "k_cache", k_cache)?;
    dispatch!(py, kd, write_kv_t(py, k, v, k_cache, v_cache, slot_mapping))
}

fn copy_blocks_t<'py, S: Storage>(
    py: Python<'py>,
    k_caches: &Bound<'py, PyList>,
    v_caches: &Bound<'py, PyList>,
    copy_ops: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let ops = ints::<i32>(py, "copy_ops", copy_ops, 2, "int32")?;
    if ops.shape()[1] != 2 {
        return Err(invalid_argument(
            py,
            format!(
                "copy_ops must be [N, 2] (src, dst), got shape {:?}",
                ops.shape()
            ),
        ));
    }
    if k_caches.len() == 0 || k_caches.len() != v_caches.len() {
        return Err(invalid_argument(
            py,
            format!(
                "k_caches ({}) and v_caches ({}) must list the same layers, at least one",
                k_caches.len(),
                v_caches.len()
            ),
        ));
    }
    let items: Vec<Bound<'py, PyAny>> = k_caches.iter().chain(v_caches.iter()).collect();
    let mut borrows = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        borrows.push(write::<S>(py, &format!("caches[{i}]"), x)?);
    }
    let shape = borrows[0].shape().to_vec();
    for (i, b) in borrows.iter().enumerate() {
        if b.shape() != shape.as_slice() {
            return Err(invalid_argument(
                py,
                format!(
                    "cache {i} has shape {:?}, layer 0's is {shape:?}",
                    b.shape()
                ),
            ));
        }
    }
    let cache = cache_shape(py, &shape, &shape)?;
    let mut slices: Vec<&mut [S::Elem]> = Vec::with_capacity(borrows.len());
    for b in borrows.iter_mut() {
        slices.push(S::view_mut(mut_slice(py, b)?));
    }
    let ops_s = slice(&ops)?;
    py.detach(|| cpu::copy_blocks(&mut slices, cache, ops_s))
        .map_err(|e| err(py, e))
}

/// Copy-on-write block copies in every layer (see `pagedkv.attention.copy_blocks`).
#[pyfunction]
fn cpu_copy_blocks<'py>(
    py: Python<'py>,
    k_caches: &Bound<'py, PyList>,
    v_caches: &Bound<'py, PyList>,
    copy_ops: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let first = k_caches
        .get_item(0)
        .map_err(|_| invalid_argument(py, "k_caches must list at least one layer".into()))?;
    let kd = kind(py, "k_caches[0]", &first)?;
    dispatch!(py, kd, copy_blocks_t(py, k_caches, v_caches, copy_ops))
}

fn swap_blocks_t<'py, S: Storage>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let m = ints::<i32>(py, "mapping", mapping, 2, "int32")?;
    if m.shape()[1] != 2 {
        return Err(invalid_argument(
            py,
            format!(
                "mapping must be [N, 2] (src_block, dst_block), got shape {:?}",
                m.shape()
            ),
        ));
    }
    let s = read::<S>(py, "src_cache", src, 4)?;
    let mut d = write::<S>(py, "dst_cache", dst)?;
    if s.shape()[1..] != d.shape()[1..] {
        return Err(invalid_argument(
            py,
            format!(
                "src_cache {:?} and dst_cache {:?} must have one block shape",
                s.shape(),
                d.shape()
            ),
        ));
    }
    let block_elems: usize = s.shape()[1..].iter().product();
    let (ss, ms) = (S::view(slice(&s)?), slice(&m)?);
    let ds = S::view_mut(mut_slice(py, &mut d)?);
    py.detach(|| cpu::swap_blocks(ss, ds, block_elems, ms))
        .map_err(|e| err(py, e))
}

/// Copies blocks between two caches of one block shape (see `pagedkv.attention.swap_blocks`).
#[pyfunction]
fn cpu_swap_blocks<'py>(
    py: Python<'py>,
    src_cache: &Bound<'py, PyAny>,
    dst_cache: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let kd = kind(py, "src_cache", src_cache)?;
    dispatch!(py, kd, swap_blocks_t(py, src_cache, dst_cache, mapping))
}

/// Registers the CPU data-plane functions on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_paged_prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_copy_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_swap_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_matmul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rope_interleaved, m)?)?;
    Ok(())
}
