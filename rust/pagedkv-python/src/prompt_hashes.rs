//! `pagedkv._core.PromptHashes`: a prompt's chained block hashes held in Rust
//! (`KvCacheManager.prompt_hashes`), so that a scheduler hashes a request once at arrival and
//! hands the same hashes to its queue (`CacheAwareQueue.push`) and to its admission
//! (`add_sequence(..., prompt_hashes=...)`, the core's `AdmitOptions::prompt_hashes`) without
//! 80+ 128-bit Python ints per prompt (docs/scheduling.md, Cost).

use pyo3::prelude::*;
use pyo3::types::PyList;

use pagedkv::BlockHash;

use crate::errors::{invalid_argument, or_invalid};
use crate::scalars::type_name;

/// A prompt's chained block hashes, as `KvCacheManager.prefix_block_hashes` returns them, kept
/// in Rust. Immutable; `len()` is the number of hashes, `to_list()` gives them as ints.
#[pyclass(module = "pagedkv._core", name = "PromptHashes", frozen)]
pub struct PyPromptHashes {
    pub(crate) hashes: Vec<BlockHash>,
}

#[pymethods]
impl PyPromptHashes {
    fn __len__(&self) -> usize {
        self.hashes.len()
    }

    /// The hashes as Python ints.
    fn to_list(&self) -> Vec<u128> {
        self.hashes.clone()
    }

    fn __repr__(&self) -> String {
        format!("PromptHashes(<{} blocks>)", self.hashes.len())
    }
}

/// Block hashes given as a `PromptHashes` or as a list of ints.
/// (`Send` and `Sync`: read while the manager runs detached from the interpreter.)
pub(crate) enum HashesArg {
    Held(Py<PyPromptHashes>),
    Listed(Vec<BlockHash>),
}

impl HashesArg {
    pub(crate) fn as_slice(&self) -> &[BlockHash] {
        match self {
            HashesArg::Held(h) => &h.get().hashes,
            HashesArg::Listed(v) => v,
        }
    }
}

/// Reads `obj` (a `PromptHashes`, or a list of at most `max_len` ints in `[0, 2**128)`) as the
/// argument `what`; anything else is `InvalidArgumentError`.
pub(crate) fn hashes_arg(
    obj: &Bound<'_, PyAny>,
    what: &str,
    max_len: usize,
) -> PyResult<HashesArg> {
    let py = obj.py();
    if let Ok(held) = obj.cast::<PyPromptHashes>() {
        return Ok(HashesArg::Held(held.clone().unbind()));
    }
    let wrong = || {
        invalid_argument(
            py,
            format!(
                "{what} must be a PromptHashes or a list of block hashes (ints in [0, 2**128)), \
                 got {}",
                type_name(obj)
            ),
        )
    };
    let list = obj.cast::<PyList>().map_err(|_| wrong())?;
    if list.len() > max_len {
        return Err(invalid_argument(
            py,
            format!("{what} has {} entries, more than {max_len}", list.len()),
        ));
    }
    list.iter()
        .map(|h| h.extract::<u128>().map_err(|e| or_invalid(py, e, wrong)))
        .collect::<PyResult<Vec<_>>>()
        .map(HashesArg::Listed)
}
