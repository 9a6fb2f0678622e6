//! Bindings of the CPU data plane (`pagedkv-cpu`): NumPy arrays in, slices out, the GIL released
//! around each kernel. Conversion only: every size and index check lives in the crate, which
//! refuses a bad call before its first write.
//!
//! dtypes: float32, float16, and uint16 holding bfloat16 bit patterns (the package's bf16
//! convention), native byte order. Every array must be C-contiguous and aligned to its dtype
//! (caches are read or written in place; anything else is an `InvalidArgumentError`, see
//! `arrays.rs`); the Python layer makes queries, new K/V and integer metadata so before calling.
//!
//! One file per kind of call: attention (attention.rs), cache writes and block copies
//! (cache_ops.rs), the model's dense operators (model_ops.rs); the conversions they share
//! (convert.rs). The quantized caches' bindings (`cpu_quant_ops.rs`) read their arguments with
//! these files' helpers, so the two check alike and refuse alike.

use pyo3::prelude::*;

/// Calls the monomorphised `$f` for the cache dtype `$kind` (see [`kind`]).
macro_rules! dispatch {
    ($py:expr, $kind:expr, $f:ident ( $($arg:expr),* )) => {
        match $kind {
            "f32" => $f::<f32>($($arg),*),
            "f16" => $f::<pagedkv_cpu::f16>($($arg),*),
            _ => $f::<u16>($($arg),*),
        }
    };
}
pub(crate) use dispatch;

mod attention;
mod cache_ops;
mod convert;
mod model_ops;

pub(crate) use attention::{AttentionArgs, AttentionCaches, AttentionCall};
pub(crate) use cache_ops::{swap, NewKv};
pub(crate) use convert::{
    array, block_pairs, borrow, err, ints, kind, mut_slice, new_f32, slice, Borrow, Storage,
};

/// Registers the CPU data-plane functions on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attention::cpu_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(attention::cpu_paged_prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cache_ops::cpu_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(cache_ops::cpu_copy_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(cache_ops::cpu_swap_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(model_ops::cpu_matmul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(model_ops::cpu_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(model_ops::cpu_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(model_ops::cpu_silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(model_ops::cpu_rope_interleaved, m)?)?;
    Ok(())
}
