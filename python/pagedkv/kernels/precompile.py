"""Compiles every kernel instance into the persistent cubin cache, in parallel, before a GPU run.

    python -m pagedkv.kernels.precompile --arch sm_90 --jobs 16
    python -m pagedkv.kernels.precompile --dry-run      # list what would compile; compiles nothing

A process that launches an instance whose cubin is cached loads it from disk (`cubin_cache`); one
that is not compiles it on first launch, 0.2-1.7 s each, serially, inside whatever test or timing
loop reached it first. Compiling all of them here first, one NVRTC program per instance exactly
as the runner keys them (``[instance.name]``), moves that cost out of the tests' and benchmarks'
time limits and spreads it over the machine's cores (NVRTC is called through ctypes, which
releases the GIL, so threads compile in parallel).

Prints one line per instance that fails and a summary; exits 1 if any failed, 2 without NVRTC.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pagedkv.errors import PagedKvError
from pagedkv.kernels import cubin_cache, instances, nvrtc

__all__ = ["precompile", "main"]


def precompile(arch: str, jobs: int) -> tuple[int, list[str]]:
    """Compiles (or finds cached) every instance for ``arch``; returns (compiled now, failures)."""
    todo = instances.all_instances()
    before = cubin_cache.compilations

    def one(instance: instances.Instance) -> str | None:
        try:
            cubin_cache.cached_cubin(instance.source, [instance.name], arch)
        except PagedKvError as error:  # a compile error: report it, keep compiling the others
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            return f"{instance.name}: {first_line}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        failures = [f for f in pool.map(one, todo) if f is not None]
    return cubin_cache.compilations - before, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default=nvrtc.DEFAULT_ARCH, help="NVRTC architecture, e.g. sm_90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--dry-run", action="store_true", help="list the instances; compile nothing")
    args = parser.parse_args(argv)
    if not args.arch.startswith("sm_") or not args.arch[3:].isdigit():
        parser.error(f"--arch must look like sm_90, got {args.arch!r}")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    todo = instances.all_instances()
    print(f"{len(todo)} kernel instances for {args.arch}, cache {cubin_cache.cache_dir()}")
    if args.dry_run:
        return 0
    try:
        nvrtc.load()
    except nvrtc.NvrtcUnavailable as error:
        print(f"precompile: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    compiled, failures = precompile(args.arch, args.jobs)
    for failure in failures:
        print(f"FAILED {failure}")
    print(
        f"compiled {compiled}, {len(todo) - compiled - len(failures)} already cached, "
        f"{len(failures)} failed, in {time.perf_counter() - started:.1f} s on {args.jobs} threads"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
