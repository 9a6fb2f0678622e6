//! Error mapping: each core `pagedkv::Error` variant becomes its own Python class from
//! `pagedkv.errors` (defined in Python so an error can also be a `KeyError` / `ValueError`).

use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use pagedkv::{Error, Tier};

/// One lazily imported, cached Python exception class.
struct ImportedClass {
    name: &'static str,
    cell: PyOnceLock<Py<PyType>>,
}

impl ImportedClass {
    const fn new(name: &'static str) -> Self {
        Self {
            name,
            cell: PyOnceLock::new(),
        }
    }

    fn get<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyType>> {
        self.cell.import(py, "pagedkv.errors", self.name)
    }
}

static OUT_OF_BLOCKS: ImportedClass = ImportedClass::new("OutOfBlocksError");
static UNKNOWN_SEQUENCE: ImportedClass = ImportedClass::new("UnknownSequenceError");
static SEQUENCE_EXISTS: ImportedClass = ImportedClass::new("SequenceExistsError");
static INVALID_ARGUMENT: ImportedClass = ImportedClass::new("InvalidArgumentError");
static DOUBLE_FREE: ImportedClass = ImportedClass::new("DoubleFreeError");
static STALE_HANDLE: ImportedClass = ImportedClass::new("StaleHandleError");
static SEQUENCE_SWAPPED_OUT: ImportedClass = ImportedClass::new("SequenceSwappedOutError");
static INVARIANT_VIOLATION: ImportedClass = ImportedClass::new("InvariantViolation");

/// Builds an instance of `class(message)`, sets `attrs` on it and wraps it as a `PyErr`.
/// Any failure on the way (a broken install) surfaces as that Python error instead.
fn raise(
    py: Python<'_>,
    class: &ImportedClass,
    message: String,
    attrs: &[(&str, Py<PyAny>)],
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let instance = class.get(py)?.call1((message,))?;
        for (name, value) in attrs {
            instance.setattr(*name, value.bind(py))?;
        }
        Ok(PyErr::from_value(instance))
    };
    build().unwrap_or_else(|err| err)
}

/// The tier name carried by `OutOfBlocksError.tier`: "device" or "host".
pub fn tier_name(tier: &Tier) -> String {
    tier.to_string()
}

/// Converts a core error into the matching `pagedkv.errors` exception.
///
/// `OutOfBlocksError` carries `tier`, `needed_blocks`, `available_blocks` and `blocks_short`;
/// `UnknownSequenceError`, `SequenceExistsError` and `SequenceSwappedOutError` carry `seq_id`;
/// `DoubleFreeError` and `StaleHandleError` carry `block_id` (and the latter `generation`, the
/// handle's). The match names every variant, so a new one cannot fall into another's class.
pub fn to_pyerr(py: Python<'_>, error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::OutOfBlocks {
            tier,
            needed_blocks,
            available_blocks,
        } => {
            let attrs = [
                (
                    "tier",
                    tier_name(&tier)
                        .into_pyobject(py)
                        .map(|s| s.into_any().unbind()),
                ),
                (
                    "needed_blocks",
                    needed_blocks
                        .into_pyobject(py)
                        .map(|v| v.into_any().unbind()),
                ),
                (
                    "available_blocks",
                    available_blocks
                        .into_pyobject(py)
                        .map(|v| v.into_any().unbind()),
                ),
                (
                    "blocks_short",
                    needed_blocks
                        .saturating_sub(available_blocks)
                        .into_pyobject(py)
                        .map(|v| v.into_any().unbind()),
                ),
            ];
            let attrs: Vec<(&str, Py<PyAny>)> = attrs
                .into_iter()
                .filter_map(|(name, value)| value.ok().map(|v| (name, v)))
                .collect();
            raise(py, &OUT_OF_BLOCKS, message, &attrs)
        }
        Error::UnknownSequence(seq_id) => raise(
            py,
            &UNKNOWN_SEQUENCE,
            message,
            &[("seq_id", seq_id_object(py, seq_id))],
        ),
        Error::SequenceExists(seq_id) => raise(
            py,
            &SEQUENCE_EXISTS,
            message,
            &[("seq_id", seq_id_object(py, seq_id))],
        ),
        Error::SequenceSwappedOut(seq_id) => raise(
            py,
            &SEQUENCE_SWAPPED_OUT,
            message,
            &[("seq_id", seq_id_object(py, seq_id))],
        ),
        Error::InvalidArgument(_) => raise(py, &INVALID_ARGUMENT, message, &[]),
        Error::DoubleFree(block_id) => raise(
            py,
            &DOUBLE_FREE,
            message,
            &[("block_id", u64_object(py, u64::from(block_id)))],
        ),
        Error::StaleHandle(handle) => raise(
            py,
            &STALE_HANDLE,
            message,
            &[
                ("block_id", u64_object(py, u64::from(handle.id()))),
                ("generation", u64_object(py, u64::from(handle.generation()))),
            ],
        ),
        Error::InvariantViolation(_) => raise(py, &INVARIANT_VIOLATION, message, &[]),
        Error::OutOfMemory { .. } => pyo3::exceptions::PyMemoryError::new_err(message),
    }
}

fn seq_id_object(py: Python<'_>, seq_id: u64) -> Py<PyAny> {
    u64_object(py, seq_id)
}

fn u64_object(py: Python<'_>, value: u64) -> Py<PyAny> {
    match value.into_pyobject(py) {
        Ok(v) => v.into_any().unbind(),
        Err(never) => match never {},
    }
}

/// `InvalidArgumentError(message)`: malformed input detected while converting arguments.
pub fn invalid_argument(py: Python<'_>, message: String) -> PyErr {
    raise(py, &INVALID_ARGUMENT, message, &[])
}

/// `InvariantViolation(message)`: a bindings-level bug (e.g. a manager poisoned by a panic).
pub fn invariant_violation(py: Python<'_>, message: String) -> PyErr {
    raise(py, &INVARIANT_VIOLATION, message, &[])
}

// Error policy for argument conversion: which caller errors pass through unchanged.

/// Whether an error raised by the caller's own code (an `__index__`, `__bool__` or `__str__`)
/// must reach the caller unchanged instead of becoming an `InvalidArgumentError`: a
/// `BaseException` that is not an `Exception` (`KeyboardInterrupt`, `SystemExit`,
/// `GeneratorExit`) or a `MemoryError`. Turning Ctrl-C into "malformed input" would swallow it.
pub fn must_propagate(py: Python<'_>, err: &PyErr) -> bool {
    !err.is_instance_of::<PyException>(py) || err.is_instance_of::<PyMemoryError>(py)
}

/// `err` with the note PyO3 adds to a failed argument conversion ("while processing 'name'"),
/// for arguments converted inside the method (whose bounds depend on the manager).
pub fn with_arg_note(py: Python<'_>, name: &str, err: PyErr) -> PyErr {
    let _ = err
        .value(py)
        .call_method1("add_note", (format!("while processing '{name}'"),));
    err
}

/// `err` itself when it must propagate (see [`must_propagate`]), else `replacement()`.
pub fn or_invalid(py: Python<'_>, err: PyErr, replacement: impl FnOnce() -> PyErr) -> PyErr {
    if must_propagate(py, &err) {
        err
    } else {
        replacement()
    }
}
