"""Runs GGUF load cases in child interpreters (``gguf_load_child.py``) with a timeout and an
address-space limit, split over ``workers`` processes that run at once.

A child that times out, dies, or reports an exception other than the loader's typed errors
fails with the case it was in: a regression to a hang or a memory bomb cannot hang CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("gguf_load_child.py")
TYPED = {"OK", "ModelLoadError", "UnsupportedModelError"}


@dataclass
class Outcome:
    outcome: str  # OK or the exception class name
    cause: str  # class of the exception's __cause__, or "-"
    peak_growth_kib: int  # growth of the child's peak resident size since warm-up, so far


class ChildFailed(AssertionError):
    """A child timed out, died, or stopped in the middle of a case."""


def run_load_cases(
    base: Path,
    cases: list[list[Any]],
    tmp_path: Path,
    *,
    workers: int = 2,
    timeout_s: float = 60.0,
    extra_bytes: int = 512 << 20,
) -> dict[str, Outcome]:
    chunks = [cases[i::workers] for i in range(workers) if cases[i::workers]]
    env = {**os.environ, "PAGEDKV_CACHE_DIR": "off", "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    procs = []
    for i, chunk in enumerate(chunks):
        spec = tmp_path / f"spec{i}.json"
        spec.write_text(
            json.dumps(
                {
                    "base": str(base),
                    "scratch": str(tmp_path / f"case{i}.gguf"),
                    "extra_bytes": extra_bytes,
                    "cases": chunk,
                }
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(CHILD), str(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outcomes: dict[str, Outcome] = {}
    failure = None
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            timed_out = True
        current = None
        for line in stdout.splitlines():
            fields = line.split("\t")
            if fields[0] == "START":
                current = fields[1]
            elif len(fields) == 4:
                outcomes[fields[0]] = Outcome(fields[1], fields[2], int(fields[3]))
                current = None
        if (timed_out or proc.returncode != 0 or current is not None) and failure is None:
            why = f"timed out after {timeout_s} s" if timed_out else f"exited with status {proc.returncode}"
            failure = f"a child {why} in case {current!r}; stderr tail: {stderr[-1500:]}"
    if failure is not None:
        raise ChildFailed(failure)
    return outcomes
