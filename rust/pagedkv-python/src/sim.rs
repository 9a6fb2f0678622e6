//! Bindings of the trace-replay simulator (`pagedkv.sim.engine` is the Python face):
//! `_core.simulate(...)` and `_core.record_frames(...)`. Argument conversion and result
//! packing only; the logic is in the `pagedkv-sim` crate.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use pagedkv_sim::{self as sim, Frame, PrefixBlocks, SimConfig, SimProgress, SimResult, Workload};

use crate::alloc_guard::try_vec;
use crate::errors::or_invalid;
use crate::errors::{invalid_argument, to_pyerr};
use crate::scalars::CountArg;

/// Copies a 1-D array (`[R]`) of `T` (NumPy dtype `dtype_name`, either byte order, any
/// alignment and strides) out of `obj`.
fn column<T: numpy::Element + Copy>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    dtype_name: &str,
) -> PyResult<Vec<T>> {
    let wrong = || {
        invalid_argument(
            obj.py(),
            format!(
                "{name} must be a 1-D {dtype_name} NumPy array, got {}",
                describe(obj)
            ),
        )
    };
    let untyped = obj.cast::<numpy::PyUntypedArray>().map_err(|_| wrong())?;
    // An array that cannot be read in place (misaligned, strides that are not whole items,
    // the other byte order) is read from a native copy (`arrays.rs`); the copy's dtype is then
    // checked like the array's.
    let behaved = crate::arrays::behaved(untyped, false)?;
    let array = behaved.cast::<PyArray1<T>>().map_err(|_| wrong())?;
    let readonly = array
        .try_readonly()
        .map_err(|e| invalid_argument(obj.py(), format!("{name}: {e}")))?;
    let view = readonly.as_array();
    // A zero-stride view can claim any length: allocate fallibly (MemoryError, not an abort).
    let mut out = try_vec(obj.py(), view.len(), name)?;
    out.extend(view.iter().copied());
    Ok(out)
}

/// `config` as a dict, or `InvalidArgumentError` naming what it is instead.
fn config_dict<'a, 'py>(config: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyDict>> {
    config.cast::<PyDict>().map_err(|_| {
        invalid_argument(
            config.py(),
            format!("config must be a dict, got {}", describe(config)),
        )
    })
}

/// `group_kind` as a str, or `InvalidArgumentError`.
fn group_kind_str(group_kind: &Bound<'_, PyAny>) -> PyResult<String> {
    group_kind.extract::<String>().map_err(|_| {
        invalid_argument(
            group_kind.py(),
            format!("group_kind must be a str, got {}", describe(group_kind)),
        )
    })
}

/// Copies a 1-D int64 array (`[R]`) out of `obj`.
fn int_column(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    column(obj, name, "int64")
}

/// Copies a 1-D float64 array (`[R]`) out of `obj`.
fn float_column(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f64>> {
    column(obj, name, "float64")
}

fn optional_int_column(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Vec<i64>>> {
    match obj {
        Some(o) if !o.is_none() => int_column(o, name).map(Some),
        _ => Ok(None),
    }
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    if let Ok(array) = obj.cast::<numpy::PyUntypedArray>() {
        let dtype = array
            .dtype()
            .str()
            .map(|s| s.to_string())
            .unwrap_or_default();
        return format!("a {}-D array of dtype {dtype}", array.ndim());
    }
    obj.get_type()
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

fn parse<T: std::str::FromStr<Err = pagedkv::Error>>(py: Python<'_>, value: &str) -> PyResult<T> {
    value.parse().map_err(|e| to_pyerr(py, e))
}

/// Reads `SimConfig` from a dict with the Python dataclass's field names; unknown keys and
/// wrongly typed values are `InvalidArgumentError`s naming the key.
fn read_config(config: &Bound<'_, PyDict>) -> PyResult<SimConfig> {
    let py = config.py();
    let mut out = SimConfig::default();
    for (key, value) in config.iter() {
        let key: String = key
            .extract()
            .map_err(|_| invalid_argument(py, "config keys must be strings".into()))?;
        let wrong = |want: &str| {
            invalid_argument(
                py,
                format!("config {key} must be {want}, got {}", describe(&value)),
            )
        };
        let size = || -> PyResult<usize> {
            if value.is_instance_of::<pyo3::types::PyBool>() {
                return Err(wrong("a non-negative int"));
            }
            value
                .extract::<usize>()
                .map_err(|e| or_invalid(py, e, || wrong("a non-negative int")))
        };
        let number = || -> PyResult<f64> {
            if value.is_instance_of::<pyo3::types::PyBool>() {
                return Err(wrong("a number"));
            }
            value
                .extract::<f64>()
                .map_err(|e| or_invalid(py, e, || wrong("a number")))
        };
        let text = || -> PyResult<String> { value.extract::<String>().map_err(|_| wrong("a str")) };
        let flag = || -> PyResult<bool> {
            value
                .cast::<pyo3::types::PyBool>()
                .map(|b| b.is_true())
                .map_err(|_| wrong("a bool"))
        };
        match key.as_str() {
            "allocator" => out.allocator = parse(py, &text()?)?,
            "placement" => out.placement = parse(py, &text()?)?,
            "block_size" => out.block_size = size()?,
            "num_slots" => out.num_slots = size()?,
            "max_model_len" => out.max_model_len = size()?,
            "arrival" => out.arrival = parse(py, &text()?)?,
            "poisson_rate" => out.poisson_rate = number()?,
            "step_time_s" => out.step_time_s = number()?,
            "preemption" => out.preemption = parse(py, &text()?)?,
            "num_host_slots" => out.num_host_slots = size()?,
            "max_num_seqs" => out.max_num_seqs = size()?,
            "enable_prefix_caching" => out.enable_prefix_caching = flag()?,
            "seed" => {
                out.seed = value
                    .extract::<u64>()
                    .map_err(|e| or_invalid(py, e, || wrong("an int in [0, 2**64)")))?
            }
            "max_steps" => out.max_steps = if value.is_none() { None } else { Some(size()?) },
            "watermark" => out.watermark = number()?,
            "check_invariants" => out.check_invariants = flag()?,
            "scheduling" => out.scheduling = parse(py, &text()?)?,
            "aging_bound" => out.aging_bound = size()?,
            "queue_aware_eviction" => out.queue_aware_eviction = flag()?,
            other => {
                return Err(invalid_argument(
                    py,
                    format!("unknown config key {other:?}"),
                ))
            }
        }
    }
    Ok(out)
}

/// The trace prefix blocks of `simulate`'s keyword arguments: all three given, or none.
fn read_prefix_blocks(
    py: Python<'_>,
    block_tokens: Option<CountArg>,
    block_offsets: Option<&Bound<'_, PyAny>>,
    block_ids: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<PrefixBlocks>> {
    let present = |o: Option<&Bound<'_, PyAny>>| o.is_some_and(|o| !o.is_none());
    match (block_tokens, present(block_offsets), present(block_ids)) {
        (None, false, false) => Ok(None),
        (Some(tokens), true, true) => {
            let offsets = int_column(block_offsets.expect("present"), "block_offsets")?;
            let ids = int_column(block_ids.expect("present"), "block_ids")?;
            PrefixBlocks::new(tokens.0, &offsets, &ids)
                .map(Some)
                .map_err(|e| to_pyerr(py, e))
        }
        _ => Err(invalid_argument(
            py,
            "block_tokens, block_offsets and block_ids must be given together".into(),
        )),
    }
}

#[allow(clippy::too_many_arguments)]
fn read_workload(
    py: Python<'_>,
    prompt_tokens: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    arrival_s: &Bound<'_, PyAny>,
    group_size: Option<&Bound<'_, PyAny>>,
    group_kind: &Bound<'_, PyAny>,
    prefix_id: Option<&Bound<'_, PyAny>>,
    prefix_tokens: Option<&Bound<'_, PyAny>>,
    prefix_blocks: Option<PrefixBlocks>,
) -> PyResult<Workload> {
    let group_kind = group_kind_str(group_kind)?;
    let prompt = int_column(prompt_tokens, "prompt_tokens")?;
    let output = int_column(output_tokens, "output_tokens")?;
    let arrival = float_column(arrival_s, "arrival_s")?;
    let group = optional_int_column(group_size, "group_size")?;
    let pid = optional_int_column(prefix_id, "prefix_id")?;
    let plen = optional_int_column(prefix_tokens, "prefix_tokens")?;
    let kind = parse(py, &group_kind)?;
    let workload = Workload::from_arrays(
        &prompt,
        &output,
        &arrival,
        group.as_deref(),
        kind,
        pid.as_deref(),
        plen.as_deref(),
    )
    .map_err(|e| to_pyerr(py, e))?;
    match prefix_blocks {
        Some(blocks) => workload
            .with_prefix_blocks(blocks)
            .map_err(|e| to_pyerr(py, e)),
        None => Ok(workload),
    }
}

/// Packs a result as a dict of Python scalars and NumPy arrays.
fn result_dict<'py>(py: Python<'py>, r: &SimResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_slots", r.num_slots)?;
    d.set_item("steps", r.steps)?;
    d.set_item("simulated_seconds", r.simulated_seconds)?;
    d.set_item("token_states", r.token_states)?;
    d.set_item("reserved", r.reserved)?;
    d.set_item("internal_fragmentation", r.internal_fragmentation)?;
    d.set_item("external_fragmentation", r.external_fragmentation)?;
    d.set_item("free", r.free)?;
    d.set_item("queued_steps", r.queued_steps)?;
    let names = [
        "token_states",
        "reserved",
        "internal_fragmentation",
        "external_fragmentation",
        "free",
    ];
    let queued = PyDict::new(py);
    for (name, share) in names.iter().zip(r.shares_while_queued) {
        queued.set_item(*name, share)?;
    }
    d.set_item("shares_while_queued", queued)?;
    d.set_item("mean_resident_requests", r.mean_resident_requests)?;
    d.set_item("peak_resident_requests", r.peak_resident_requests)?;
    d.set_item("mean_running_sequences", r.mean_running_sequences)?;
    d.set_item("mean_used_blocks", r.mean_used_blocks)?;
    d.set_item("preemptions", r.preemptions)?;
    d.set_item("recompute_preemptions", r.recompute_preemptions)?;
    d.set_item("swap_preemptions", r.swap_preemptions)?;
    d.set_item("finished_requests", r.finished_requests)?;
    d.set_item("generated_tokens", r.generated_tokens)?;
    d.set_item("prefill_tokens", r.prefill_tokens)?;
    d.set_item("recomputed_tokens", r.recomputed_tokens)?;
    d.set_item("prefix_query_tokens", r.prefix_query_tokens)?;
    d.set_item("prefix_hit_tokens", r.prefix_hit_tokens)?;
    d.set_item("swapped_out_blocks", r.swapped_out_blocks)?;
    d.set_item("swapped_in_blocks", r.swapped_in_blocks)?;
    let ids: Vec<i64> = r.finished_request_ids.iter().map(|&i| i as i64).collect();
    d.set_item("finished_request_ids", PyArray1::from_vec(py, ids))?;
    d.set_item(
        "waste_per_request_tokens",
        PyArray1::from_slice(py, &r.waste_per_request_tokens),
    )?;
    let lens: Vec<i64> = r.block_table_len.iter().map(|&l| l as i64).collect();
    d.set_item("block_table_len", PyArray1::from_vec(py, lens))?;
    d.set_item("latency_s", PyArray1::from_slice(py, &r.latency_s))?;
    d.set_item("wait_s", PyArray1::from_slice(py, &r.wait_s))?;
    d.set_item("prompt_tokens", r.prompt_tokens)?;
    d.set_item("prompt_hit_tokens", r.prompt_hit_tokens)?;
    d.set_item("optimal_prompt_tokens", r.optimal_prompt_tokens)?;
    d.set_item("optimal_hit_tokens", r.optimal_hit_tokens)?;
    d.set_item("scheduling", r.scheduling.to_string())?;
    d.set_item("aging_bound", r.aging_bound)?;
    d.set_item("max_passed_over", r.max_passed_over)?;
    d.set_item("forced_admissions", r.forced_admissions)?;
    d.set_item("evicted_wanted_blocks", r.evicted_wanted_blocks)?;
    Ok(d)
}

/// One frame as the visualizer's dict (see `pagedkv.sim.engine.record_frames`).
fn frame_dict<'py>(py: Python<'py>, f: &Frame) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", f.step)?;
    d.set_item("time_s", f.time_s)?;
    d.set_item("running", f.running)?;
    d.set_item("waiting", f.waiting)?;
    d.set_item("finished", f.finished)?;
    d.set_item("preemptions", f.preemptions)?;
    d.set_item("used_blocks", f.used_blocks)?;
    d.set_item("token_slots", f.shares.token_slots)?;
    d.set_item("reserved_slots", f.shares.reserved_slots)?;
    d.set_item("internal_frag_slots", f.shares.internal_slots)?;
    d.set_item("external_frag_slots", f.shares.external_slots)?;
    d.set_item("free_slots", f.shares.free_slots)?;
    d.set_item("waste_pct", f.waste_pct())?;
    // int64 [num_cells, 3]: one array instead of a list per cell (several hundred thousand
    // small lists per recording made the garbage collector the bottleneck).
    let flat: Vec<i64> = f
        .pool
        .cells
        .iter()
        .flat_map(|c| [c.owner, c.tokens as i64, c.reserved as i64])
        .collect();
    let pool = PyArray1::from_vec(py, flat).reshape([f.pool.cells.len(), 3])?;
    d.set_item("pool", pool)?;
    let tables = PyDict::new(py);
    for (request, seqs) in &f.pool.tables {
        let entry = PyDict::new(py);
        let first = &seqs[0];
        entry.set_item("blocks", first.blocks.clone())?;
        entry.set_item("num_tokens", first.num_tokens)?;
        if seqs.len() > 1 {
            let all = PyList::empty(py);
            for s in seqs {
                let sd = PyDict::new(py);
                sd.set_item("blocks", s.blocks.clone())?;
                sd.set_item("num_tokens", s.num_tokens)?;
                all.append(sd)?;
            }
            entry.set_item("sequences", all)?;
        }
        tables.set_item(*request, entry)?;
    }
    d.set_item("tables", tables)?;
    let shared = PyList::empty(py);
    for &(block, refcount) in &f.pool.shared {
        shared.append(PyList::new(py, [block, refcount])?)?;
    }
    d.set_item("shared", shared)?;
    Ok(d)
}

/// simulate(prompt_tokens, output_tokens, arrival_s, group_size, group_kind, prefix_id,
///          prefix_tokens, config, progress=None, *, block_tokens=None, block_offsets=None,
///          block_ids=None) -> dict
///
/// Arrays are 1-D `[R]`: int64 lengths, float64 arrival seconds; `group_size`, `prefix_id`,
/// `prefix_tokens` may be None. `config` holds SimConfig fields by name. `progress`, if given,
/// is called as `progress(steps, finished_requests, total_requests)` every few thousand steps;
/// a falsy return stops the run early. Runs without the GIL between callbacks. Trace prefix
/// blocks (all three or none): `block_offsets` int64 `[R + 1]`, `block_ids` int64 (request i's
/// are `block_ids[block_offsets[i]:block_offsets[i + 1]]`), `block_tokens` tokens per block.
#[pyfunction]
#[pyo3(signature = (prompt_tokens, output_tokens, arrival_s, group_size, group_kind, prefix_id, prefix_tokens, config, progress=None, *, block_tokens=None, block_offsets=None, block_ids=None))]
#[allow(clippy::too_many_arguments)]
pub fn simulate<'py>(
    py: Python<'py>,
    prompt_tokens: &Bound<'py, PyAny>,
    output_tokens: &Bound<'py, PyAny>,
    arrival_s: &Bound<'py, PyAny>,
    group_size: Option<&Bound<'py, PyAny>>,
    group_kind: &Bound<'py, PyAny>,
    prefix_id: Option<&Bound<'py, PyAny>>,
    prefix_tokens: Option<&Bound<'py, PyAny>>,
    config: &Bound<'py, PyAny>,
    progress: Option<Py<PyAny>>,
    block_tokens: Option<CountArg>,
    block_offsets: Option<&Bound<'py, PyAny>>,
    block_ids: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let blocks = read_prefix_blocks(py, block_tokens, block_offsets, block_ids)?;
    let workload = read_workload(
        py,
        prompt_tokens,
        output_tokens,
        arrival_s,
        group_size,
        group_kind,
        prefix_id,
        prefix_tokens,
        blocks,
    )?;
    let config = read_config(config_dict(config)?)?;
    let mut callback_error: Option<PyErr> = None;
    let outcome = py.detach(|| {
        let mut on_progress = |p: SimProgress| -> bool {
            Python::attach(|py| {
                // Ctrl-C reaches us here even without a callback.
                if let Err(e) = py.check_signals() {
                    callback_error = Some(e);
                    return false;
                }
                let Some(callback) = progress.as_ref() else {
                    return true;
                };
                match callback.call1(py, (p.steps, p.finished_requests, p.total_requests)) {
                    Ok(ret) => ret.is_none(py) || ret.is_truthy(py).unwrap_or(true),
                    Err(e) => {
                        callback_error = Some(e);
                        false
                    }
                }
            })
        };
        sim::simulate_with_progress(&workload, &config, &mut on_progress)
    });
    if let Some(e) = callback_error {
        return Err(e);
    }
    let result = outcome.map_err(|e| to_pyerr(py, e))?;
    result_dict(py, &result)
}

/// record_frames(prompt_tokens, output_tokens, arrival_s, group_size, group_kind, prefix_id,
///               prefix_tokens, config, max_steps, *, block_tokens=None, block_offsets=None,
///               block_ids=None) -> dict
///
/// The result dict of the first `max_steps` steps plus `"frames"`: one dict per step.
#[pyfunction]
#[pyo3(signature = (prompt_tokens, output_tokens, arrival_s, group_size, group_kind, prefix_id, prefix_tokens, config, max_steps, *, block_tokens=None, block_offsets=None, block_ids=None))]
#[allow(clippy::too_many_arguments)]
pub fn record_frames<'py>(
    py: Python<'py>,
    prompt_tokens: &Bound<'py, PyAny>,
    output_tokens: &Bound<'py, PyAny>,
    arrival_s: &Bound<'py, PyAny>,
    group_size: Option<&Bound<'py, PyAny>>,
    group_kind: &Bound<'py, PyAny>,
    prefix_id: Option<&Bound<'py, PyAny>>,
    prefix_tokens: Option<&Bound<'py, PyAny>>,
    config: &Bound<'py, PyAny>,
    max_steps: CountArg,
    block_tokens: Option<CountArg>,
    block_offsets: Option<&Bound<'py, PyAny>>,
    block_ids: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let max_steps = max_steps.0;
    let blocks = read_prefix_blocks(py, block_tokens, block_offsets, block_ids)?;
    let workload = read_workload(
        py,
        prompt_tokens,
        output_tokens,
        arrival_s,
        group_size,
        group_kind,
        prefix_id,
        prefix_tokens,
        blocks,
    )?;
    let config = read_config(config_dict(config)?)?;
    let (result, frames) = py
        .detach(|| sim::record_frames(&workload, &config, max_steps))
        .map_err(|e| to_pyerr(py, e))?;
    let d = result_dict(py, &result)?;
    let list = PyList::empty(py);
    for frame in &frames {
        list.append(frame_dict(py, frame)?)?;
    }
    d.set_item("frames", list)?;
    Ok(d)
}

/// Registers the simulator functions on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(record_frames, m)?)?;
    Ok(())
}
