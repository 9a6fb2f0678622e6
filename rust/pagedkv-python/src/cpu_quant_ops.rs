//! Bindings of the CPU data plane's quantized caches (`pagedkv_cpu::quant`): conversion only.
//! A quantized cache arrives as the tuple `(data, residual, kv_cache_dtype, role, block_size,
//! num_kv_heads, head_dim)` that `pagedkv.attention.cpu_backend` builds from a
//! `QuantizedKvCache`: `data` uint8 `[num_blocks, block_bytes]`, `residual` (int4; None
//! otherwise) uint8 `[num_residual_slots, residual_block_bytes]`, the bytes of the residual's
//! int8 blocks (one per slot). Every check that guards memory runs in the crate (or, for array shapes,
//! here) before anything is written; the kernels run with the GIL released. The arguments a
//! plain cache's call has too are read by `cpu_ops`' helpers, with the same checks and errors.

use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pagedkv_cpu::{
    self as cpu, CacheShape, QuantCache, QuantCacheMut, QuantFormat, QuantLayout, Role,
};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::cpu_ops::{
    block_pairs, borrow, dispatch, err, ints, kind, mut_slice, slice, swap, AttentionArgs,
    AttentionCaches, AttentionCall, Borrow, NewKv, Storage,
};
use crate::errors::invalid_argument;

/// The layout a cache tuple names (items 2..7).
fn layout(py: Python<'_>, name: &str, t: &Bound<'_, PyTuple>) -> PyResult<QuantLayout> {
    if t.len() != 7 {
        return Err(invalid_argument(
            py,
            format!("{name}: a quantized cache is (data, residual, kv_cache_dtype, role, block_size, num_kv_heads, head_dim)"),
        ));
    }
    let format: String = t.get_item(2)?.extract()?;
    let role: String = t.get_item(3)?.extract()?;
    let dims: [usize; 3] = [
        t.get_item(4)?.extract()?,
        t.get_item(5)?.extract()?,
        t.get_item(6)?.extract()?,
    ];
    let format = QuantFormat::parse(&format).map_err(|e| err(py, e))?;
    let role = Role::parse(&role).map_err(|e| err(py, e))?;
    QuantLayout::new(format, role, dims[0], dims[1], dims[2]).map_err(|e| err(py, e))
}

/// `data` must be `[num_blocks, block_bytes]` of the layout.
fn check_rows(py: Python<'_>, name: &str, shape: &[usize], layout: &QuantLayout) -> PyResult<()> {
    if shape.len() != 2 || shape[1] != layout.block_bytes {
        return Err(invalid_argument(
            py,
            format!(
                "{name} must be uint8 [num_blocks, {}] (the {} {:?} layout), got shape {shape:?}",
                layout.block_bytes,
                layout.format.name(),
                layout.role
            ),
        ));
    }
    Ok(())
}

/// An int4 cache's residual must be uint8 `[num_residual_slots, residual_block_bytes]`.
fn check_residual_rows(
    py: Python<'_>,
    name: &str,
    shape: &[usize],
    layout: &QuantLayout,
) -> PyResult<()> {
    let residual = layout.residual().map_err(|e| err(py, e))?;
    check_rows(py, name, shape, &residual)
}

/// A cache's bytes read, and borrowed for writing.
type Bytes<'py> = PyReadonlyArrayDyn<'py, u8>;
type BytesMut<'py> = PyReadwriteArrayDyn<'py, u8>;

/// A uint8 `[rows, row_bytes]` array (a cache's bytes), borrowed as `B`.
fn bytes<'py, B: Borrow<'py, u8>>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<B> {
    borrow(py, name, x, 2, None, || {
        format!("{name} must be a uint8 NumPy array")
    })
}

/// A cache tuple's layout, bytes and residual bytes (None: an empty one), borrowed as `B`:
/// read-only for attention, for writing in a cache write.
struct CacheArrays<B> {
    layout: QuantLayout,
    data: B,
    residual: Option<B>,
}

fn cache_arrays<'py, B: Borrow<'py, u8>>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<CacheArrays<B>> {
    let t = x
        .cast::<PyTuple>()
        .map_err(|_| invalid_argument(py, format!("{name} must be a quantized cache tuple")))?;
    let layout = layout(py, name, t)?;
    let dname = format!("{name}.data");
    let data: B = bytes(py, &dname, &t.get_item(0)?)?;
    check_rows(py, &dname, data.dims(), &layout)?;
    let res = t.get_item(1)?;
    let residual = if res.is_none() {
        None
    } else {
        let rname = format!("{name}.residual");
        let r: B = bytes(py, &rname, &res)?;
        check_residual_rows(py, &rname, r.dims(), &layout)?;
        Some(r)
    };
    Ok(CacheArrays {
        layout,
        data,
        residual,
    })
}

impl CacheArrays<Bytes<'_>> {
    fn view(&self, py: Python<'_>, name: &str) -> PyResult<QuantCache<'_>> {
        let residual = self.residual.as_ref().map_or(Ok(&[][..]), slice)?;
        QuantCache::new(name, self.layout, slice(&self.data)?, residual).map_err(|e| err(py, e))
    }
}

impl CacheArrays<BytesMut<'_>> {
    fn view_mut(&mut self, py: Python<'_>, name: &str) -> PyResult<QuantCacheMut<'_>> {
        let residual = match self.residual.as_mut() {
            Some(r) => mut_slice(py, r)?,
            None => &mut [][..],
        };
        let data = mut_slice(py, &mut self.data)?;
        QuantCacheMut::new(name, self.layout, data, residual).map_err(|e| err(py, e))
    }
}

/// `residual_slots`, int32 `[num_tokens]` (None: no int4 residual).
fn residual_slots<'py>(
    py: Python<'py>,
    x: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<PyReadonlyArrayDyn<'py, i32>>> {
    x.map(|x| ints::<i32>(py, "residual_slots", x, 1, "int32"))
        .transpose()
}

/// Quantized caches and, for int4, the residual slot of each query token.
struct QuantCaches<'a, 'py> {
    k_cache: &'a Bound<'py, PyAny>,
    v_cache: &'a Bound<'py, PyAny>,
    residual_slots: Option<&'a Bound<'py, PyAny>>,
}

impl<'py> AttentionCaches<'py> for QuantCaches<'_, 'py> {
    fn attend<S: Storage>(
        &self,
        py: Python<'py>,
        args: AttentionArgs<'py, S>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let k = cache_arrays::<Bytes>(py, "k_cache", self.k_cache)?;
        let v = cache_arrays::<Bytes>(py, "v_cache", self.v_cache)?;
        let slots = residual_slots(py, self.residual_slots)?;
        let (kq, vq) = (k.view(py, "k_cache")?, v.view(py, "v_cache")?);
        let slots_s = slots.as_ref().map(slice).transpose()?;
        args.run(
            py,
            k.layout.head_dim,
            k.layout.block_size,
            move |qs, table, lens, qsl, params, out| match qsl {
                Some(qsl) => {
                    cpu::paged_prefill_quant(qs, kq, vq, table, lens, qsl, slots_s, params, out)
                }
                None => cpu::paged_decode_quant(qs, kq, vq, table, lens, slots_s, params, out),
            },
        )
    }
}

/// Paged decode attention on quantized caches (see `pagedkv.attention.paged_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, residual_slots=None, scale=None, window=None))]
#[allow(clippy::too_many_arguments)]
fn cpu_quant_paged_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    residual_slots: Option<&Bound<'py, PyAny>>,
    scale: Option<f64>,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let caches = QuantCaches {
        k_cache,
        v_cache,
        residual_slots,
    };
    AttentionCall::decode(q, block_tables, seq_lens, scale, window).run(py, &caches)
}

/// Paged prefill attention on quantized caches (see `pagedkv.attention.paged_prefill_attention`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, residual_slots=None, scale=None, causal=true, window=None))]
#[allow(clippy::too_many_arguments)]
fn cpu_quant_paged_prefill_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    query_start_loc: &Bound<'py, PyAny>,
    residual_slots: Option<&Bound<'py, PyAny>>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let caches = QuantCaches {
        k_cache,
        v_cache,
        residual_slots,
    };
    AttentionCall::decode(q, block_tables, seq_lens, scale, window)
        .prefill(query_start_loc, causal)
        .run(py, &caches)
}

fn write_t<'py, S: Storage>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
    residual_slots: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let new = NewKv::<S>::read(py, k, v, slot_mapping)?;
    let res = self::residual_slots(py, residual_slots)?;
    let mut kc = cache_arrays::<BytesMut>(py, "k_cache", k_cache)?;
    let mut vc = cache_arrays::<BytesMut>(py, "v_cache", v_cache)?;
    let (ks, vs, ss) = new.slices(py, kc.layout.num_kv_heads, kc.layout.head_dim)?;
    let rs = res.as_ref().map(slice).transpose()?;
    let (kq, vq) = (kc.view_mut(py, "k_cache")?, vc.view_mut(py, "v_cache")?);
    py.detach(|| cpu::write_kv_quant(ks, vs, kq, vq, ss, rs))
        .map_err(|e| err(py, e))
}

/// Quantizes new tokens' K/V into their slots (see `pagedkv.attention.write_kv`).
#[pyfunction]
#[pyo3(signature = (k, v, k_cache, v_cache, slot_mapping, residual_slots=None))]
fn cpu_quant_write_kv<'py>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
    residual_slots: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let kd = kind(py, "k", k)?;
    dispatch!(
        py,
        kd,
        write_t(py, k, v, k_cache, v_cache, slot_mapping, residual_slots)
    )
}

/// Block copies on byte rows (`[num_blocks, block_bytes]` uint8 arrays of one `num_blocks`; the
/// row length may differ, as an int4 key cache's does from its value cache's): quantized blocks
/// move as they are (see `pagedkv.attention.copy_blocks`). One call for every cache of every
/// layer, so a refusal (an array not writable in place, a bad block id) comes before any copy:
/// never the keys copied and the values refused.
#[pyfunction]
fn cpu_copy_block_bytes<'py>(
    py: Python<'py>,
    caches: &Bound<'py, PyList>,
    copy_ops: &Bound<'py, PyAny>,
) -> PyResult<()> {
    let ops = block_pairs(py, "copy_ops", copy_ops, "(src, dst)")?;
    let mut borrows = Vec::with_capacity(caches.len());
    for (i, x) in caches.iter().enumerate() {
        borrows.push(bytes::<BytesMut>(py, &format!("caches[{i}]"), &x)?);
    }
    let Some(first) = borrows.first() else {
        return Err(invalid_argument(
            py,
            "copy_blocks needs at least one cache".into(),
        ));
    };
    let num_blocks = first.shape()[0];
    if let Some((i, b)) = borrows
        .iter()
        .enumerate()
        .find(|(_, b)| b.shape()[0] != num_blocks)
    {
        return Err(invalid_argument(
            py,
            format!(
                "cache {i} has {} blocks, cache 0 has {num_blocks}",
                b.shape()[0]
            ),
        ));
    }
    let shape = |row: usize| CacheShape {
        num_blocks,
        block_size: 1,
        num_kv_heads: 1,
        head_dim: row,
    };
    let mut caches: Vec<(usize, &mut [u8])> = Vec::with_capacity(borrows.len());
    for b in borrows.iter_mut() {
        let row = b.shape()[1];
        caches.push((row, mut_slice(py, b)?));
    }
    let ops_s = slice(&ops)?;
    py.detach(|| {
        // Every check first (each cache's shape, then the ops against `num_blocks`, with no
        // cache), so none of the per-cache copies below can fail after another one ran.
        for (i, (row, c)) in caches.iter().enumerate() {
            shape(*row).check_len(&format!("caches[{i}]"), c.len())?;
        }
        cpu::copy_blocks::<u8>(&mut [], shape(1), ops_s)?;
        for (row, c) in caches.iter_mut() {
            cpu::copy_blocks(&mut [&mut **c], shape(*row), ops_s)?;
        }
        Ok(())
    })
    .map_err(|e| err(py, e))
}

/// Block swaps between two byte-row caches of one row length (see `pagedkv.attention.swap_blocks`);
/// returns the number of copies.
#[pyfunction]
fn cpu_swap_block_bytes<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    mapping: &Bound<'py, PyAny>,
) -> PyResult<usize> {
    let m = block_pairs(py, "mapping", mapping, "(src_block, dst_block)")?;
    let s = bytes::<Bytes>(py, "src_cache", src)?;
    let mut d = bytes::<BytesMut>(py, "dst_cache", dst)?;
    swap(py, &s, &mut d, &m, "row length")
}

/// Registers the quantized CPU data-plane functions on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_quant_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_paged_prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_copy_block_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_swap_block_bytes, m)?)?;
    Ok(())
}
