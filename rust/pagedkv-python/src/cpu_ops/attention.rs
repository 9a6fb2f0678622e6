//! Paged decode and prefill attention on the CPU data plane, and the reading of the arguments
//! the quantized caches' attention shares with it (`cpu_quant_ops.rs`).

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pagedkv_cpu::{self as cpu, AttentionParams, BlockTables};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::convert::{cache_shape, err, ints, kind, read, slice, Storage};
use crate::errors::invalid_argument;

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
    /// Reads the shared arguments, in the order q, seq_lens, query_start_loc, block tables (the
    /// default scale is 1 / sqrt(head_dim)).
    fn read(py: Python<'py>, call: &AttentionCall<'_, 'py>) -> PyResult<Self> {
        let q = read::<S>(py, "q", call.q, 3)?;
        let seq_lens = ints::<i32>(py, "seq_lens", call.seq_lens, 1, "int32")?;
        let query_start_loc = call
            .query_start_loc
            .map(|x| ints::<i32>(py, "query_start_loc", x, 1, "int32"))
            .transpose()?;
        let tables = Tables::new(py, call.tables)?;
        let (num_q_heads, head_dim) = (q.shape()[1], q.shape()[2]);
        let scale = call.scale.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt());
        let params = AttentionParams {
            num_q_heads,
            scale: scale as f32,
            causal: call.causal,
            window: call.window,
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

/// An attention call's arguments but the caches, as Python passed them: decode's (no
/// `query_start_loc`, causal) or prefill's.
pub(crate) struct AttentionCall<'a, 'py> {
    q: &'a Bound<'py, PyAny>,
    tables: &'a Bound<'py, PyAny>,
    seq_lens: &'a Bound<'py, PyAny>,
    query_start_loc: Option<&'a Bound<'py, PyAny>>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
}

/// The caches of an attention call, plain or quantized: read after the call's other arguments,
/// then attended to with them.
pub(crate) trait AttentionCaches<'py> {
    fn attend<S: Storage>(
        &self,
        py: Python<'py>,
        args: AttentionArgs<'py, S>,
    ) -> PyResult<Bound<'py, PyAny>>;
}

impl<'a, 'py> AttentionCall<'a, 'py> {
    pub(crate) fn decode(
        q: &'a Bound<'py, PyAny>,
        tables: &'a Bound<'py, PyAny>,
        seq_lens: &'a Bound<'py, PyAny>,
        scale: Option<f64>,
        window: Option<usize>,
    ) -> Self {
        let (query_start_loc, causal) = (None, true);
        AttentionCall {
            q,
            tables,
            seq_lens,
            query_start_loc,
            scale,
            causal,
            window,
        }
    }

    /// The decode call's arguments made a prefill's.
    pub(crate) fn prefill(self, query_start_loc: &'a Bound<'py, PyAny>, causal: bool) -> Self {
        AttentionCall {
            query_start_loc: Some(query_start_loc),
            causal,
            ..self
        }
    }

    /// Runs the call on `caches`: the dtype of `q` picks the monomorphised kernel.
    pub(crate) fn run(
        &self,
        py: Python<'py>,
        caches: &impl AttentionCaches<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kd = kind(py, "q", self.q)?;
        dispatch!(py, kd, attend(py, self, caches))
    }
}

fn attend<'py, S: Storage>(
    py: Python<'py>,
    call: &AttentionCall<'_, 'py>,
    caches: &impl AttentionCaches<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    caches.attend(py, AttentionArgs::<S>::read(py, call)?)
}

/// Plain caches `[num_blocks, block_size, num_kv_heads, head_dim]` of the call's dtype.
struct Caches<'a, 'py> {
    k_cache: &'a Bound<'py, PyAny>,
    v_cache: &'a Bound<'py, PyAny>,
}

impl<'py> AttentionCaches<'py> for Caches<'_, 'py> {
    fn attend<S: Storage>(
        &self,
        py: Python<'py>,
        args: AttentionArgs<'py, S>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let k = read::<S>(py, "k_cache", self.k_cache, 4)?;
        let v = read::<S>(py, "v_cache", self.v_cache, 4)?;
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
}

/// Paged decode attention (see `pagedkv.attention.paged_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale=None, window=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_paged_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    scale: Option<f64>,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let caches = Caches { k_cache, v_cache };
    AttentionCall::decode(q, block_tables, seq_lens, scale, window).run(py, &caches)
}

/// Paged prefill attention (see `pagedkv.attention.paged_prefill_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, causal=true, window=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_paged_prefill_attention<'py>(
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
    let caches = Caches { k_cache, v_cache };
    AttentionCall::decode(q, block_tables, seq_lens, scale, window)
        .prefill(query_start_loc, causal)
        .run(py, &caches)
}
