//! Bindings of the CPU data plane's quantized caches (`pagedkv_cpu::quant`): conversion only.
//! A quantized cache arrives as the tuple `(data, residual, kv_cache_dtype, role, block_size,
//! num_kv_heads, head_dim)` that `pagedkv.attention.cpu_backend` builds from a
//! `QuantizedKvCache`: `data` uint8 `[num_blocks, block_bytes]`, `residual` (int4; None
//! otherwise) uint8 `[num_residual_slots, residual_block_bytes]`, the bytes of the residual's
//! int8 blocks (one per slot). Every check that guards memory runs in the crate (or, for array shapes,
//! here) before anything is written; the kernels run with the GIL released.

use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pagedkv_cpu::{
    self as cpu, f16, CacheShape, QuantCache, QuantCacheMut, QuantFormat, QuantLayout, Role,
};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::arrays::require_aligned;
use crate::cpu_ops::{array, err, ints, kind, mut_slice, read, slice, AttentionArgs, Storage};
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

/// A read cache tuple: its layout, bytes and residual bytes (None: an empty one).
struct ReadCache<'py> {
    layout: QuantLayout,
    data: PyReadonlyArrayDyn<'py, u8>,
    residual: Option<PyReadonlyArrayDyn<'py, u8>>,
}

fn read_cache<'py>(py: Python<'py>, name: &str, x: &Bound<'py, PyAny>) -> PyResult<ReadCache<'py>> {
    let t = x
        .cast::<PyTuple>()
        .map_err(|_| invalid_argument(py, format!("{name} must be a quantized cache tuple")))?;
    let layout = layout(py, name, t)?;
    let data = array::<u8>(
        py,
        &format!("{name}.data"),
        &t.get_item(0)?,
        2,
        "a uint8 NumPy array",
    )?;
    check_rows(py, &format!("{name}.data"), data.shape(), &layout)?;
    let res = t.get_item(1)?;
    let residual = if res.is_none() {
        None
    } else {
        let rname = format!("{name}.residual");
        let r = array::<u8>(py, &rname, &res, 2, "a uint8 NumPy array")?;
        check_residual_rows(py, &rname, r.shape(), &layout)?;
        Some(r)
    };
    Ok(ReadCache {
        layout,
        data,
        residual,
    })
}

impl<'py> ReadCache<'py> {
    fn view(&self, py: Python<'_>, name: &str) -> PyResult<QuantCache<'_>> {
        let residual = self.residual.as_ref().map_or(Ok(&[][..]), slice)?;
        QuantCache::new(name, self.layout, slice(&self.data)?, residual).map_err(|e| err(py, e))
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
    residual_slots: Option<&Bound<'py, PyAny>>,
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
    let k = read_cache(py, "k_cache", k_cache)?;
    let v = read_cache(py, "v_cache", v_cache)?;
    let slots = residual_slots
        .map(|x| ints::<i32>(py, "residual_slots", x, 1, "int32"))
        .transpose()?;
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

macro_rules! dispatch {
    ($kind:expr, $f:ident ( $($arg:expr),* )) => {
        match $kind {
            "f32" => $f::<f32>($($arg),*),
            "f16" => $f::<f16>($($arg),*),
            _ => $f::<u16>($($arg),*),
        }
    };
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
    let kd = kind(py, "q", q)?;
    dispatch!(
        kd,
        attention_t(
            py,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            None,
            residual_slots,
            scale,
            true,
            window
        )
    )
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
    let kd = kind(py, "q", q)?;
    dispatch!(
        kd,
        attention_t(
            py,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            Some(query_start_loc),
            residual_slots,
            scale,
            causal,
            window
        )
    )
}

/// A writable C-contiguous array of `T` with `ndim` dimensions, borrowed exclusively (NumPy's
/// borrow tracking refuses one array passed twice).
fn writable<'py, T: numpy::Element>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
    ndim: usize,
    dtype: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
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
    arr.try_readwrite().map_err(|e| {
        invalid_argument(
            py,
            format!("{name} is read-only or borrowed twice (one array passed as two caches?): {e}"),
        )
    })
}

/// A written cache tuple: its layout, bytes and residual bytes.
struct WriteCache<'py> {
    layout: QuantLayout,
    data: PyReadwriteArrayDyn<'py, u8>,
    residual: Option<PyReadwriteArrayDyn<'py, u8>>,
}

fn write_cache<'py>(
    py: Python<'py>,
    name: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<WriteCache<'py>> {
    let t = x
        .cast::<PyTuple>()
        .map_err(|_| invalid_argument(py, format!("{name} must be a quantized cache tuple")))?;
    let layout = layout(py, name, t)?;
    let data = writable::<u8>(
        py,
        &format!("{name}.data"),
        &t.get_item(0)?,
        2,
        "a uint8 NumPy array",
    )?;
    check_rows(py, &format!("{name}.data"), data.shape(), &layout)?;
    let res = t.get_item(1)?;
    let residual = if res.is_none() {
        None
    } else {
        let rname = format!("{name}.residual");
        let r = writable::<u8>(py, &rname, &res, 2, "a uint8 NumPy array")?;
        check_residual_rows(py, &rname, r.shape(), &layout)?;
        Some(r)
    };
    Ok(WriteCache {
        layout,
        data,
        residual,
    })
}

impl<'py> WriteCache<'py> {
    fn view(&mut self, py: Python<'_>, name: &str) -> PyResult<QuantCacheMut<'_>> {
        let residual = match self.residual.as_mut() {
            Some(r) => mut_slice(py, r)?,
            None => &mut [][..],
        };
        let data = mut_slice(py, &mut self.data)?;
        QuantCacheMut::new(name, self.layout, data, residual).map_err(|e| err(py, e))
    }
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
    let k = read::<S>(py, "k", k, 3)?;
    let v = read::<S>(py, "v", v, 3)?;
    let slots = ints::<i64>(py, "slot_mapping", slot_mapping, 1, "int64")?;
    let res = residual_slots
        .map(|x| ints::<i32>(py, "residual_slots", x, 1, "int32"))
        .transpose()?;
    let mut kc = write_cache(py, "k_cache", k_cache)?;
    let mut vc = write_cache(py, "v_cache", v_cache)?;
    let want = [kc.layout.num_kv_heads, kc.layout.head_dim];
    if k.shape() != v.shape() || k.shape()[1..] != want {
        return Err(invalid_argument(
            py,
            format!(
                "k {:?} and v {:?} must be [num_tokens, {}, {}]",
                k.shape(),
                v.shape(),
                want[0],
                want[1]
            ),
        ));
    }
    let (ks, vs, ss) = (S::view(slice(&k)?), S::view(slice(&v)?), slice(&slots)?);
    let rs = res.as_ref().map(slice).transpose()?;
    let (kq, vq) = (kc.view(py, "k_cache")?, vc.view(py, "v_cache")?);
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
    let mut borrows = Vec::with_capacity(caches.len());
    for (i, x) in caches.iter().enumerate() {
        borrows.push(writable::<u8>(
            py,
            &format!("caches[{i}]"),
            &x,
            2,
            "a uint8 NumPy array",
        )?);
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
    let s = array::<u8>(py, "src_cache", src, 2, "a uint8 NumPy array")?;
    let mut d = writable::<u8>(py, "dst_cache", dst, 2, "a uint8 NumPy array")?;
    if s.shape()[1] != d.shape()[1] {
        return Err(invalid_argument(
            py,
            format!(
                "src_cache {:?} and dst_cache {:?} must have one row length",
                s.shape(),
                d.shape()
            ),
        ));
    }
    let row = s.shape()[1];
    let (ss, ms) = (slice(&s)?, slice(&m)?);
    let ds = mut_slice(py, &mut d)?;
    py.detach(|| cpu::swap_blocks(ss, ds, row, ms))
        .map_err(|e| err(py, e))
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
