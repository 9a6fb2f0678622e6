"""Helpers of the simulator tests and benches: locating the shared real traces, loading one, and a
seeded synthetic workload. (A uniquely named module: several test folders have a conftest.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from pagedkv.sim.engine import Workload

REPO_ROOT = Path(__file__).resolve().parents[2]


def find_traces_dir() -> Path | None:
    """$PAGEDKV_TRACES, else ``shared/traces`` next to the repository root (``../shared/traces``)
    or next to one of its ancestors (a git worktree sits deeper); None when absent."""
    override = os.environ.get("PAGEDKV_TRACES")
    if override:
        return Path(override) if Path(override).is_dir() else None
    for base in REPO_ROOT.parents:
        candidate = base / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return None


def load_azure(path: Path) -> Workload:
    """The trace as a Workload: the CLI helper's reader when present, else a minimal one."""
    try:
        from pagedkv.sim.traces import read_azure_csv
    except ImportError:
        read_azure_csv = None
    if read_azure_csv is not None:
        return read_azure_csv(path)
    stamps, prompts, outputs = np.loadtxt(path, delimiter=",", skiprows=1, dtype=str, unpack=True)
    times = np.array([np.datetime64(s.strip()[:26].replace(" ", "T")) for s in stamps])
    arrival = (times - times[0]) / np.timedelta64(1, "us") / 1e6
    order = np.argsort(arrival, kind="stable")
    return Workload(
        path.stem,
        prompts.astype(np.int64)[order],
        np.maximum(outputs.astype(np.int64), 1)[order],
        arrival[order].astype(np.float64),
    )


def synthetic_workload(num_requests: int = 400, seed: int = 0) -> Workload:
    """The textbook mix: mostly short generations, a few long ones (seeded)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(16, 512, size=num_requests)
    long = rng.random(num_requests) < 0.1
    output = np.where(
        long, rng.integers(400, 1200, size=num_requests), rng.integers(1, 64, size=num_requests)
    )
    return Workload("synthetic", prompt.astype(np.int64), output.astype(np.int64), np.zeros(num_requests))
