"""Instructions of vLLM's scheduler loop on one KV-cache manager, for a step-cost ratio that the
machine's load and timing noise do not move (benches/vllm_scheduler_ab.py's workload; the loop
of benches/vllm_scheduler.py's ``run``: ``schedule``, the fake model output, ``update_from_output``).

    VALGRIND="valgrind --tool=callgrind --separate-threads=yes --zero-before=getppid --dump-before=getpgrp"
    PYTHONHASHSEED=0 $VALGRIND --callgrind-out-file=vllm.%p $VENV/bin/python \\
        benches/vllm_scheduler_instructions.py vllm full
    PYTHONHASHSEED=0 $VALGRIND --callgrind-out-file=pagedkv.%p $VENV/bin/python \\
        benches/vllm_scheduler_instructions.py pagedkv full
    PYTHONHASHSEED=0 $VALGRIND --callgrind-out-file=before.%p $VENV/bin/python \\
        benches/vllm_scheduler_instructions.py before full REV    # pagedkv's as of REV
    grep ^summary vllm.*.1-01 pagedkv.*.1-01 before.*.1-01      # the main thread: the loop

    # the step alone (schedule + update_from_output, what the step-time ratio is about):
    VALGRIND="$VALGRIND --collect-atstart=no --toggle-collect=_operator_call"
    PYTHONHASHSEED=0 $VALGRIND ... benches/vllm_scheduler_instructions.py pagedkv full --steps-only

(``$VENV``: the vLLM venv of scripts/vllm/env.sh, pagedkv importable.) Callgrind zeroes its
counts when the loop starts (``os.getppid``, libc's ``getppid``) and writes them when it ends
(``os.getpgrp``), so imports, set-up (the scheduler built, the requests added) and a warm-up run
are left out; ``--separate-threads=yes`` leaves out the process's background thread,
whose count varied by 6-17 M between runs of the same code (2026-12-07-vllm-scheduler-v8.md).
The heap is frozen once the scheduler is built, as vLLM's engine does
(benches/vllm_scheduler_ab.py); ``--heap-live`` leaves it unfrozen (this script's count until
2026-12-07, which also counted building the scheduler and adding the requests). The loop's fake model output
is the same for both managers when their schedules are (the run prints the step count), so the
ratio of the two dumps bounds the ratio of the scheduler's own calls from above.
"""

from __future__ import annotations

import operator
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_scheduler as vs  # noqa: E402 (the harness next to this file)
from vllm_scheduler_ab import CONFIGS, WORKLOAD, _load_before_rev  # noqa: E402


def _count_steps_only() -> None:
    """Every scheduler built from now on makes its ``schedule`` and ``update_from_output`` calls
    through ``operator.call``, a C function nothing else in the loop calls: callgrind run with
    ``--collect-atstart=no --toggle-collect=_operator_call`` then counts those two calls only
    (the step the ratio is about), not the loop's fake model output or its trace."""
    build = vs.build_scheduler

    def build_counted(w: vs.Workload, manager: Any, scheduler_cls: Any = None) -> Any:
        scheduler = build(w, manager, scheduler_cls)
        schedule, update = scheduler.schedule, scheduler.update_from_output
        scheduler.schedule = lambda: operator.call(schedule)
        scheduler.update_from_output = lambda out, runner_output: operator.call(update, out, runner_output)
        return scheduler

    vs.build_scheduler = build_counted


def main() -> int:
    args = sys.argv[1:]
    live = "--heap-live" in args
    if live:
        args.remove("--heap-live")
    if "--steps-only" in args:
        args.remove("--steps-only")
        _count_steps_only()
    name, config = args[0], args[1]
    # "before REV": pagedkv's integration package as of git revision REV, on the installed core.
    manager = _load_before_rev(args[2]) if name == "before" else vs.manager_class(name)
    # A short run first: lazy imports and first-call caches out of the counted loop.
    vs.run(vs.Workload(**{**WORKLOAD, "requests": 4}, **CONFIGS[config]), manager, watch_copies=False)
    workload = vs.Workload(**WORKLOAD, **CONFIGS[config])
    # callgrind --zero-before=getppid: once the scheduler is built and the requests added (and
    # the heap frozen, whose collection is not the loop's)
    # (watch_copies: the marks would count on vLLM's side)
    trace = vs.run(workload, manager, watch_copies=False, freeze_heap=not live, loop_starts=os.getppid)
    os.getpgrp()  # callgrind --dump-before=getpgrp
    print(f"{name} {config}: {len(trace.steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
