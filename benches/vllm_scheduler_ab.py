"""vLLM's scheduler step time on three KV-cache managers in one process: vLLM's own, pagedkv's
drop-in as of an earlier commit ("before") and as installed ("after"), alternated per run, with
the exact manager calls and pagedkv core (PyO3) calls per step.

    $VENV/bin/python benches/vllm_scheduler_ab.py --before-rev REV \\
        [--configs full,async,full+window64] [--repeat 3] [--cpu-time]

(``$VENV``: the vLLM venv of scripts/vllm/env.sh, pagedkv importable; ``--before PATH`` instead
takes an earlier manager.py alone, with the package's other modules as installed.) The workload is the one of
benches/results/2026-12-06-vllm-scheduler.md (200 requests, prompts 200-2,000 tokens, outputs
64-256, 3,000 blocks). ``--cpu-time`` times with the scheduler thread's CPU clock instead of the
wall clock (on a machine shared with other work, time spent descheduled is left out). Each timed
run starts from the heap vLLM's engine serves from: ``EngineCore`` freezes every object the
garbage collector tracks once its scheduler is built, so a collection while serving skips them
(``--heap live`` leaves the heap unfrozen, as this harness did until 2026-12-07: a collection of
the oldest generation then walks every object of vLLM, torch and the harness, about 640,000,
0.3 s on this machine; the plain loop rarely reaches one, an instrumented run often does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_scheduler as vs  # noqa: E402 (the harness next to this file)

CONFIGS: dict[str, dict[str, Any]] = {
    "full": {},
    "async": {"async_scheduling": True},
    "full+window64": {"groups": ("full", "swa"), "window": 64},
    # EAGLE drafters beside a window group (draft.py): lookahead hashes, and the dropped block
    # (eagle_hits.py's look-up in Python)
    "eagle+window64": {"groups": ("full", "swa"), "window": 64, "num_spec_tokens": 2, "drafter": "eagle"},
    "eagle-drop+window64": {
        "groups": ("full", "swa"),
        "window": 64,
        "num_spec_tokens": 2,
        "drafter": "eagle-drop",
    },
}
WORKLOAD = dict(
    requests=200,
    prompt_min=200,
    prompt_max=2000,
    out_min=64,
    out_max=256,
    num_blocks=3000,
    max_num_batched_tokens=2048,
    max_num_seqs=128,
)


class _CountingCore:
    """Forwards to a ``pagedkv.KvCacheManager``, counting the method calls made through it."""

    def __init__(self, core: Any, counter: list[int]) -> None:
        self._core = core
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr
        counter = self._counter

        def call(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return attr(*args, **kwargs)

        return call


def _counting(cls: Any, counter: list[int]) -> Any:
    class Counting(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._core = _CountingCore(self._core, counter)
            self.block_pool._core = self._core

    return Counting


def _load_before(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("pagedkv_before_manager", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KVCacheManager


# The integration package of an earlier revision, imported under this name beside the installed one.
_BEFORE_PACKAGE = "pagedkv_before_vllm"


def _load_before_rev(rev: str) -> Any:
    """The ``KVCacheManager`` of ``python/pagedkv/integrations/vllm`` as of git revision ``rev``
    (on the installed core): the whole package, since its modules call each other; its imports of
    itself renamed so that it does not replace the installed one."""
    folder = "python/pagedkv/integrations/vllm"
    root = Path(tempfile.mkdtemp(prefix="pagedkv-before-"))
    package = root / _BEFORE_PACKAGE
    package.mkdir()
    repo = Path(__file__).resolve().parents[1]
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{folder}"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(
                ["git", "show", f"{rev}:{folder}/{name}"],
                cwd=repo,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (package / name).write_text(text.replace("pagedkv.integrations.vllm", _BEFORE_PACKAGE))
    sys.path.insert(0, str(root))
    return importlib.import_module(f"{_BEFORE_PACKAGE}.manager").KVCacheManager


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    before = parser.add_mutually_exclusive_group(required=True)
    before.add_argument(
        "--before", type=Path, help="an earlier manager.py (the package's other modules installed)"
    )
    before.add_argument("--before-rev", help="a git revision: its whole integration package")
    parser.add_argument("--configs", default="full,async,full+window64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument(
        "--heap",
        choices=("frozen", "live"),
        default="frozen",
        help="frozen: the start-up heap frozen as vLLM's engine does (the default); live: not",
    )
    args = parser.parse_args()
    frozen = args.heap == "frozen"
    if args.cpu_time:
        vs.time = type("CpuClock", (), {"perf_counter": staticmethod(time.thread_time)})  # type: ignore[assignment]
    managers = {
        "vllm": vs.manager_class("vllm"),
        "before": _load_before(args.before) if args.before else _load_before_rev(args.before_rev),
        "after": vs.manager_class("pagedkv"),
    }
    for name in args.configs.split(","):
        w = vs.Workload(**WORKLOAD, **CONFIGS[name])
        best: dict[str, float] = {}
        verdicts: dict[str, str] = {}
        steps = 0
        for _ in range(args.repeat):
            reference = None
            for label, cls in managers.items():
                trace = vs.run(w, cls, watch_copies=False, freeze_heap=frozen)
                seconds = trace.schedule_s + trace.update_s
                best[label] = min(best.get(label, seconds), seconds)
                steps = len(trace.steps)
                if reference is None:
                    # the verdict reads the duplicate-copy marks: an untimed run that sets them
                    reference = vs.run(w, cls)
                else:
                    diff = vs.first_difference(reference, trace)
                    explained = vs.explained_divergence(reference, trace)
                    verdicts[label] = "identical" if diff is None else (explained or f"DIFFER: {diff}")
        print(
            f"{name}: {steps} steps, "
            + ", ".join(f"{k} {v / steps * 1e6:.0f} us/step" for k, v in best.items())
        )
        print(f"  ratio before {best['before'] / best['vllm']:.3f}, after {best['after'] / best['vllm']:.3f}")
        for label, verdict in verdicts.items():
            print(f"  {label} trace: {verdict}")
        for label, cls in managers.items():
            counter = [0]
            t = vs.run(
                w,
                cls if label == "vllm" else _counting(cls, counter),
                count_calls=True,
                freeze_heap=frozen,
            )
            n = len(t.steps)
            print(
                f"  {label}: {t.manager_calls / n:.1f} manager calls/step, "
                f"{t.manager_s / max(t.manager_calls, 1) * 1e6:.2f} us/call, "
                f"{t.manager_s / (t.schedule_s + t.update_s):.0%} of the step, "
                f"{counter[0] / n:.1f} core calls/step"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
