"""Where a KV-cache manager's share of vLLM's scheduler step goes: per manager method, the calls
per step and the time per call, pagedkv's ``allocate_slots`` split by path (a decode step's fast
path, one that calls the core without or with a new block, an admission, a refused one), on
benches/vllm_scheduler_ab.py's workload.

    $VENV/bin/python benches/vllm_scheduler_calls.py [--config full] [--before-rev REV] vllm pagedkv [before]

(``$VENV``: the vLLM venv of scripts/vllm/env.sh, pagedkv importable; ``before`` is pagedkv's
integration package as of ``--before-rev``, on the installed core.) Each manager runs once with
its public methods wrapped (outermost calls only, wall clock: ``time.perf_counter``, whose
reading costs less than the thread CPU clock's); the wrapper's own cost per call is printed
(a no-op through the same wrapper) and is in every µs/call. The heap is frozen once the scheduler
is built, as vLLM's engine does (benches/vllm_scheduler_ab.py): the wrapper's own allocations
would otherwise set off collections of the whole heap inside the calls it times. The step time printed is the
instrumented run's, not a step-time measurement (benches/vllm_scheduler_ab.py is).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_scheduler as vs  # noqa: E402 (the harness next to this file)
from vllm_scheduler_ab import CONFIGS, WORKLOAD, _load_before_rev  # noqa: E402

_clock = time.perf_counter


def _path(before: list[int] | None, after: list[int] | None) -> str:
    """pagedkv's allocate_slots path from the request's record before and after the call
    (records.py: [1] table length, [6] the core's watermark)."""
    if before is None:
        return "allocate_slots: admission" if after is not None else "allocate_slots: admission refused"
    if after is None or (after[6], after[1]) == (before[6], before[1]):
        return "allocate_slots: fast path (or refused)"
    if after[1] == before[1]:
        return "allocate_slots: core, no new block"
    return "allocate_slots: core, new block"


def _wrap(manager: Any, stats: dict[str, list[float]]) -> None:
    depth = [0]
    records = getattr(manager, "_reqs", None)

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] = 1
            split = name == "allocate_slots" and records is not None
            before = list(records[args[0].request_id]) if split and args[0].request_id in records else None
            t0 = _clock()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = _clock() - t0
                key = _path(before, records.get(args[0].request_id)) if split else name
                entry = stats.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += elapsed
                depth[0] = 0

        return counted

    for name in dir(type(manager)):
        attr = getattr(type(manager), name, None)
        if not name.startswith("_") and callable(attr) and not isinstance(attr, type):
            setattr(manager, name, wrap(name, getattr(manager, name)))


def _wrapper_cost() -> float:
    stats: dict[str, list[float]] = {}

    class Noop:
        def noop(self) -> None:
            return None

    target = Noop()
    _wrap(target, stats)
    for _ in range(200_000):
        target.noop()
    count, seconds = stats["noop"]
    return seconds / count * 1e6


def measure(w: vs.Workload, cls: Any) -> tuple[int, float, dict[str, list[float]]]:
    """(steps, instrumented µs per step, name -> [calls, seconds])."""
    stats: dict[str, list[float]] = {}
    build = vs.build_scheduler

    def build_wrapped(*args: Any, **kwargs: Any) -> Any:
        scheduler = build(*args, **kwargs)
        _wrap(scheduler.kv_cache_manager, stats)
        return scheduler

    vs.build_scheduler = build_wrapped  # type: ignore[assignment]
    try:
        trace = vs.run(w, cls, watch_copies=False, freeze_heap=True)
    finally:
        vs.build_scheduler = build  # type: ignore[assignment]
    steps = len(trace.steps)
    return steps, (trace.schedule_s + trace.update_s) / steps * 1e6, stats


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("managers", nargs="+", help="vllm, pagedkv, before")
    parser.add_argument("--config", default="full", choices=sorted(CONFIGS))
    parser.add_argument("--before-rev", default="HEAD", help="the revision 'before' names")
    args = parser.parse_args()
    w = vs.Workload(**WORKLOAD, **CONFIGS[args.config])
    print(f"wrapper cost: {_wrapper_cost():.2f} us/call (in every us/call below)")
    for name in args.managers:
        cls = _load_before_rev(args.before_rev) if name == "before" else vs.manager_class(name)
        steps, step_us, stats = measure(w, cls)
        total = sum(s for _, s in stats.values())
        calls = sum(c for c, _ in stats.values())
        print(f"{name} {args.config}: {steps} steps, {step_us:.0f} us/step instrumented")
        print(f"  {'method':42s} {'calls/step':>10s} {'us/call':>8s} {'us/step':>8s}")
        for key, (count, seconds) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
            print(
                f"  {key:42s} {count / steps:10.2f} {seconds / count * 1e6:8.2f} {seconds / steps * 1e6:8.1f}"
            )
        print(f"  {'all':42s} {calls / steps:10.2f} {total / calls * 1e6:8.2f} {total / steps * 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
