"""What the GPU benchmarks share: CUDA-event timing of a launch and random 16-bit cache contents.

Imported by `gpu_decode.py` and `gpu_prefill.py` (run as scripts, so this folder is on the path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def time_kernel(
    cupy: Any,
    fn: Callable[[], Any],
    flush: Callable[[], None] | None = None,
    min_iters: int = 20,
    min_seconds: float = 0.2,
    max_iters: int = 1000,
) -> float:
    """Median seconds of fn() on the current stream, CUDA events around fn() alone, after 3 warm-up
    calls; ``flush`` (outside the events) runs before every iteration so each starts with a cold
    L2. Runs at least ``min_iters`` times and ``min_seconds``, at most ``max_iters`` times."""
    for _ in range(3):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times: list[float] = []
    start_wall = time.perf_counter()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    while len(times) < min_iters or time.perf_counter() - start_wall < min_seconds:
        if flush is not None:
            flush()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        if len(times) >= max_iters:
            break
    return statistics.median(times)


def random_values(cupy: Any, shape: tuple[int, ...], kind: str) -> Any:
    """Standard-normal values on the device as float16, or as bf16 bits (uint16, round to nearest
    even) for ``kind == "bfloat16"``."""
    x = cupy.random.standard_normal(shape, dtype=cupy.float32)
    if kind == "float16":
        return x.astype(cupy.float16)
    u = x.view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)
