//! The projections on block-quantized weights: `cpu_matmul_blocks` (fp32 activations, weights
//! bit-identical to the fp32 dequantization) and `cpu_matmul_dot` (8-bit activations, integer dot
//! products: the `int8` weight mode). Both take the weights as panels of 16 output columns built
//! by `pagedkv.models.block_weights` / `dot_weights`; every shape is checked before the GIL is
//! released and the kernel runs.

use numpy::PyUntypedArrayMethods;
use pagedkv_cpu::block_matmul::{CodeFormat, PANEL_COLS};
use pagedkv_cpu::dot_matmul::GROUP_BYTES;
use pagedkv_cpu::{self as cpu};
use pyo3::prelude::*;

use crate::cpu_ops::{array, new_f32, slice};
use crate::errors::invalid_argument;

fn code_format(py: Python<'_>, name: &str) -> PyResult<CodeFormat> {
    match name {
        "i8" => Ok(CodeFormat::I8),
        "u4" => Ok(CodeFormat::U4),
        "i4" => Ok(CodeFormat::I4),
        other => Err(invalid_argument(
            py,
            format!("code_format must be 'i8', 'u4' or 'i4', got {other:?}"),
        )),
    }
}

/// The arrays of one call, converted and checked against the shapes `codes_shape(panels, k)`
/// gives for `n` outputs in blocks of `block`: `(x, codes, scales, offsets, t, k)`.
type Operands<'py> = (
    numpy::PyReadonlyArrayDyn<'py, f32>,
    numpy::PyReadonlyArrayDyn<'py, u8>,
    numpy::PyReadonlyArrayDyn<'py, f32>,
    numpy::PyReadonlyArrayDyn<'py, f32>,
    usize,
    usize,
);

#[allow(clippy::too_many_arguments)]
fn operands<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    codes: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    n: usize,
    block: usize,
    codes_shape: impl Fn(usize, usize) -> [usize; 3],
) -> PyResult<Operands<'py>> {
    let x = array::<f32>(py, "x", x, 2, "a float32 NumPy array")?;
    let codes = array::<u8>(py, "codes", codes, 3, "a uint8 NumPy array (code bytes)")?;
    let scales = array::<f32>(py, "scales", scales, 3, "a float32 NumPy array")?;
    let offsets = array::<f32>(py, "offsets", offsets, 3, "a float32 NumPy array")?;
    let (t, k) = (x.shape()[0], x.shape()[1]);
    if block == 0 || k % block != 0 {
        return Err(invalid_argument(
            py,
            format!("block must be positive and divide x's width {k}, got {block}"),
        ));
    }
    let panels = n.div_ceil(PANEL_COLS);
    let (want_codes, want_scales) = (codes_shape(panels, k), [panels, k / block, PANEL_COLS]);
    if codes.shape() != want_codes
        || scales.shape() != want_scales
        || offsets.shape() != want_scales
    {
        return Err(invalid_argument(
            py,
            format!(
                "x is [{t}, {k}], so for n = {n} in blocks of {block} codes must be {want_codes:?} \
                 and scales, offsets {want_scales:?}; got {:?}, {:?}, {:?}",
                codes.shape(),
                scales.shape(),
                offsets.shape()
            ),
        ));
    }
    Ok((x, codes, scales, offsets, t, k))
}

/// `x [t, k] @ W [k, n]` with block-quantized weights in the kernel's panels: codes as bytes
/// `[ceil(n / 16), k, row]` (`code_format` "i8": 16 int8 codes per row; "u4" / "i4": 16 unsigned /
/// signed 4-bit codes packed two per byte, row = 8) and fp32 scales and offsets
/// `[ceil(n / 16), k / block, 16]`, the weight being `fma(scale, code, offset)` (see
/// `pagedkv.models.block_weights`); fp32 out `[t, n]`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cpu_matmul_blocks<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    codes: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    n: usize,
    block: usize,
    code_format: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let format = self::code_format(py, code_format)?;
    let (x, codes, scales, offsets, t, k) =
        operands(py, x, codes, scales, offsets, n, block, |panels, k| {
            [panels, k, format.row_bytes()]
        })?;
    let w = cpu::BlockWeights {
        codes: slice(&codes)?,
        format,
        scales: slice(&scales)?,
        offsets: slice(&offsets)?,
        in_features: k,
        out_features: n,
        block,
    };
    let xs = slice(&x)?;
    new_f32(py, &[t, n], |out| cpu::matmul_blocks(xs, w, t, out))
}

/// `x [t, k] @ W [k, n]` with each row's activations quantized to 8 bits per block of `block`
/// inputs and integer dot products (`pagedkv.models.dot_weights`): codes as bytes
/// `[ceil(n / 16), k / g, 64]` (`g` = 4 inputs per group for "i8", 8 for "u4" / "i4"), scales and
/// offsets `[ceil(n / 16), k / block, 16]`; `block` a multiple of `g`, at most 256. fp32 out
/// `[t, n]`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cpu_matmul_dot<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    codes: &Bound<'py, PyAny>,
    scales: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    n: usize,
    block: usize,
    code_format: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let format = self::code_format(py, code_format)?;
    let group = format.dot_group_inputs();
    if !block.is_multiple_of(group) || block > cpu::dot_matmul::MAX_BLOCK {
        return Err(invalid_argument(
            py,
            format!(
                "block must be a multiple of {group} for code_format {code_format:?} and at most {}, got {block}",
                cpu::dot_matmul::MAX_BLOCK
            ),
        ));
    }
    let (x, codes, scales, offsets, t, k) =
        operands(py, x, codes, scales, offsets, n, block, |panels, k| {
            [panels, k / group, GROUP_BYTES]
        })?;
    let w = cpu::DotWeights {
        codes: slice(&codes)?,
        format,
        scales: slice(&scales)?,
        offsets: slice(&offsets)?,
        in_features: k,
        out_features: n,
        block,
    };
    let xs = slice(&x)?;
    new_f32(py, &[t, n], |out| cpu::matmul_dot(xs, w, t, out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_matmul_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_matmul_dot, m)?)?;
    Ok(())
}
