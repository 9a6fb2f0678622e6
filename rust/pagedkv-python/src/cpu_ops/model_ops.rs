//! The model's dense operators on the CPU data plane: bf16 matmul, RMS norms, SiLU, rotary.

use half::slice::HalfBitsSliceExt;
use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pagedkv_cpu::{self as cpu, bf16};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::convert::{array, new_f32, slice};
use crate::errors::invalid_argument;

/// `x [t, k] @ W [k, n]` with bf16 weights in the kernel's panels (uint16 bit patterns
/// `[ceil(n / 64), k, 64]`, columns past `n` ignored), fp32 out `[t, n]`: the model's projections
/// (see `pagedkv.models.bf16_weights`).
#[pyfunction]
pub(super) fn cpu_matmul_bf16<'py>(
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
pub(super) fn cpu_rms_norm<'py>(
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
pub(super) fn cpu_add_rms_norm<'py>(
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
pub(super) fn cpu_silu_mul<'py>(
    py: Python<'py>,
    gate_up: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
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
pub(super) fn cpu_rope_interleaved<'py>(
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
