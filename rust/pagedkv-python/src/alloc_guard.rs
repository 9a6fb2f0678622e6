//! The allocation guard: result and argument buffers sized by caller input are reserved with
//! a `MemoryError` on failure, never the process abort of `Vec::with_capacity`.

use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use std::sync::OnceLock;

/// Bytes of physical memory (read once), where the platform says; `None` elsewhere.
fn physical_memory_bytes() -> Option<usize> {
    static BYTES: OnceLock<Option<usize>> = OnceLock::new();
    *BYTES.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: `sysconf` has no preconditions; it returns -1 for an unknown name.
            let (pages, page_bytes) = unsafe {
                (
                    libc::sysconf(libc::_SC_PHYS_PAGES),
                    libc::sysconf(libc::_SC_PAGESIZE),
                )
            };
            if pages > 0 && page_bytes > 0 {
                return usize::try_from(pages)
                    .ok()?
                    .checked_mul(usize::try_from(page_bytes).ok()?);
            }
        }
        None
    })
}

/// An empty vector with room for `len` items, or a `MemoryError` when that much memory cannot
/// be had (never an abort: `Vec::with_capacity` aborts the process on allocation failure).
/// More bytes than the machine's physical memory are refused before asking the allocator: an
/// allocator that reserves address space without committing it (mimalloc, or any under
/// `vm.overcommit_memory = 1`) would grant them, and filling them would end in the kernel's
/// OOM kill instead of an error. (`_py`: the GIL is held, so the error can be built right away.)
pub fn try_vec<T>(_py: Python<'_>, len: usize, what: &str) -> PyResult<Vec<T>> {
    let item_bytes = std::mem::size_of::<T>();
    let refuse = |why: String| {
        PyMemoryError::new_err(format!(
            "cannot allocate {what}: {len} items of {item_bytes} bytes{why}"
        ))
    };
    let bytes = len.checked_mul(item_bytes);
    if let (Some(bytes), Some(memory)) = (bytes, physical_memory_bytes()) {
        if bytes > memory {
            return Err(refuse(format!(
                " ({bytes} bytes, more than the machine's {memory} bytes of memory)"
            )));
        }
    }
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| refuse(String::new()))?;
    Ok(out)
}
