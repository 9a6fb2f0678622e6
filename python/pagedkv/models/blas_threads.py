"""The BLAS thread count of the forward pass (both model families)."""

from __future__ import annotations

import os

from pagedkv.errors import InvalidArgumentError

__all__ = ["DEFAULT_BLAS_THREADS", "limit_blas_threads"]

# BLAS threads for the forward pass (benches/results/2026-12-03-cpu-data-plane.md): one thread,
# because at decode batch sizes each product is a few hundred microseconds and OpenBLAS's
# threads spin and wait on a busy machine (7.5 ms vs 0.12 ms for 1x576 @ 576x1536 with another
# process on the second core); PAGEDKV_BLAS_THREADS overrides it, 0 leaves BLAS alone.
DEFAULT_BLAS_THREADS = 1


def limit_blas_threads(threads: int | None = None) -> bool:
    """Sets the process's BLAS thread count (``threads``, else ``PAGEDKV_BLAS_THREADS``, else
    ``DEFAULT_BLAS_THREADS``; 0 changes nothing) through threadpoolctl. Returns False, changing
    nothing, when threadpoolctl is not installed."""
    if threads is None:
        text = os.environ.get("PAGEDKV_BLAS_THREADS", str(DEFAULT_BLAS_THREADS))
        try:
            threads = int(text)
        except ValueError:
            raise InvalidArgumentError(f"PAGEDKV_BLAS_THREADS must be an integer, got {text!r}") from None
    if threads <= 0:
        return False
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return False
    threadpool_limits(limits=threads, user_api="blas")
    return True
