"""Planning the launches of the block-copy kernels from a host list of copies: hazard-free waves
of copy-on-write copies (``copy_blocks``) and contiguous runs of a swap mapping (``swap_blocks``).

Pure host arithmetic on validated ``[N, 2]`` int32 arrays (`cache_op_validation.check_copy_blocks`,
`cache_op_validation.check_swap_blocks`); shared by the NumPy reference and the kernel launchers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.attention.validation import is_cupy_array

__all__ = ["copy_waves", "merge_runs"]


def copy_waves(copy_ops: np.ndarray) -> list[np.ndarray]:
    """Splits copy_ops [N, 2] (host int32) into launches with no hazard inside one launch.

    The copies take effect as if run one at a time in order; a launch runs its copies in
    parallel, so a copy that reads or writes a block an earlier copy of the same launch writes
    (or writes a block it reads) starts a new launch. Self-copies are dropped. Usually one wave.
    """
    waves: list[np.ndarray] = []
    current: list[tuple[int, int]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in copy_ops.tolist():
        if src == dst:
            continue
        if src in writes or dst in writes or dst in reads:
            waves.append(np.array(current, dtype=np.int32))
            current, reads, writes = [], set(), set()
        current.append((src, dst))
        reads.add(src)
        writes.add(dst)
    if current:
        waves.append(np.array(current, dtype=np.int32))
    return waves


def merge_runs(mapping: Any) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, num_blocks) copies covering mapping [N, 2]: sorted by source, and a
    block whose source and destination both follow the previous one's joins its run."""
    m = mapping.get() if is_cupy_array(mapping) else np.asarray(mapping)
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(m.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs
