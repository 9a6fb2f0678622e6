//! `pagedkv.FullAttention`, `pagedkv.SlidingWindow` and `pagedkv.MambaState`: the KV-cache
//! group specs a
//! `KvCacheManager(kv_groups=[...])` takes (docs/design.md, KV groups). Small frozen
//! value classes: equal when their specs are, hashable, with a `repr` that evaluates back,
//! and picklable (`__reduce__`: the class and its constructor's arguments, every protocol).

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

use pagedkv::KvGroupSpec;

use crate::errors::invalid_argument;
use crate::scalars::CountArg;

/// A group of full-attention layers: every token attends to every earlier token.
#[pyclass(module = "pagedkv._core", name = "FullAttention", frozen)]
pub struct PyFullAttention;

#[pymethods]
impl PyFullAttention {
    #[new]
    fn new() -> Self {
        PyFullAttention
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyFullAttention>().is_ok()
    }

    fn __hash__(&self) -> u64 {
        0x6675_6c6c // "full"
    }

    fn __repr__(&self) -> &'static str {
        "FullAttention()"
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, ()) {
        (slf.get_type(), ())
    }
}

/// A group of sliding-window layers: each token attends to itself and the `window - 1`
/// tokens before it (the inclusive convention of Hugging Face configs and vLLM).
#[pyclass(module = "pagedkv._core", name = "SlidingWindow", frozen)]
pub struct PySlidingWindow {
    window: usize,
}

#[pymethods]
impl PySlidingWindow {
    #[new]
    #[pyo3(signature = (window))]
    fn new(py: Python<'_>, window: CountArg) -> PyResult<Self> {
        if window.0 == 0 {
            return Err(invalid_argument(
                py,
                "window must be at least 1 token".to_string(),
            ));
        }
        Ok(PySlidingWindow { window: window.0 })
    }

    /// Tokens each query sees, itself included.
    #[getter]
    fn window(&self) -> usize {
        self.window
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PySlidingWindow>()
            .is_ok_and(|o| o.get().window == self.window)
    }

    fn __hash__(&self) -> u64 {
        self.window as u64 ^ 0x5357_0000_0000_0000
    }

    fn __repr__(&self) -> String {
        format!("SlidingWindow(window={})", self.window)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, (usize,)) {
        (slf.get_type(), (slf.get().window,))
    }
}

/// A group of recurrent (Mamba) layers whose state is kept per block boundary (vLLM's
/// `MambaSpec` in its `"align"` mode, no speculative blocks): one block per allocation, at the
/// chunk's last token; a hit is the rightmost cached state block (docs/design.md, KV groups).
#[pyclass(module = "pagedkv._core", name = "MambaState", frozen)]
pub struct PyMambaState;

#[pymethods]
impl PyMambaState {
    #[new]
    fn new() -> Self {
        PyMambaState
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyMambaState>().is_ok()
    }

    fn __hash__(&self) -> u64 {
        0x6d61_6d62 // "mamb"
    }

    fn __repr__(&self) -> &'static str {
        "MambaState()"
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, ()) {
        (slf.get_type(), ())
    }
}

/// The core specs of a `kv_groups` argument: a list or tuple of `FullAttention` /
/// `SlidingWindow` / `MambaState` objects (`None`: the default single full-attention group). Anything else
/// is `InvalidArgumentError`; an empty list is refused by the core.
pub(crate) fn parse_kv_groups(
    py: Python<'_>,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<KvGroupSpec>>> {
    let Some(obj) = obj else {
        return Ok(None);
    };
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = obj.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(invalid_argument(
            py,
            "kv_groups must be a list of pagedkv.FullAttention() / pagedkv.SlidingWindow(window=W) \
             / pagedkv.MambaState()"
                .to_string(),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            if item.cast::<PyFullAttention>().is_ok() {
                Ok(KvGroupSpec::FullAttention)
            } else if let Ok(w) = item.cast::<PySlidingWindow>() {
                Ok(KvGroupSpec::SlidingWindow {
                    window: w.get().window,
                })
            } else if item.cast::<PyMambaState>().is_ok() {
                Ok(KvGroupSpec::MambaState)
            } else {
                Err(invalid_argument(
                    py,
                    format!(
                        "kv_groups[{i}] must be pagedkv.FullAttention(), \
                         pagedkv.SlidingWindow(window=W) or pagedkv.MambaState()"
                    ),
                ))
            }
        })
        .collect::<PyResult<Vec<_>>>()
        .map(Some)
}

/// The Python spec objects of `groups` (the manager's `kv_groups` property).
pub(crate) fn groups_to_python(py: Python<'_>, groups: &[KvGroupSpec]) -> PyResult<Vec<Py<PyAny>>> {
    groups
        .iter()
        .map(|g| match *g {
            KvGroupSpec::FullAttention => Ok(Py::new(py, PyFullAttention)?.into_any()),
            KvGroupSpec::SlidingWindow { window } => {
                Ok(Py::new(py, PySlidingWindow { window })?.into_any())
            }
            KvGroupSpec::MambaState => Ok(Py::new(py, PyMambaState)?.into_any()),
        })
        .collect()
}
