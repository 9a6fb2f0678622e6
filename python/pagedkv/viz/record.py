"""Record the grid of runs the visualizer switches among: allocator x block size x seed.

Every run replays the seed's workload through the real simulator
(``pagedkv.sim.engine.record_frames``) on the same pool of ``num_slots`` token slots, so the
page compares allocators on identical memory. All runs are recorded up front: the page then
switches among them offline.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.names import ALLOCATORS
from pagedkv.viz.encode import encode_run

#: Allocators on the page: paging against contiguous reservation for the worst case (max),
#: for a power-of-two guess (pow2), and for the exact final length (oracle).
DEFAULT_ALLOCATORS = ALLOCATORS
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_SEEDS = (0, 1, 2)
#: A pool small enough to see every slot (32 rows of 64 slots), large enough for a dozen requests.
DEFAULT_NUM_SLOTS = 2048
DEFAULT_MAX_MODEL_LEN = 512
DEFAULT_NUM_REQUESTS = 200
DEFAULT_MAX_STEPS = 300
#: Most steps one run may record: every step is a frame on the page (about 100 bytes each after
#: compression), so this keeps the page and the recording's memory bounded.
MAX_STEPS = 100_000

KNOWN_ALLOCATORS = ALLOCATORS

_DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)


@dataclass(frozen=True)
class VizGrid:
    """Which runs to record. ``max_steps`` bounds every run's frame count (page size grows with it)."""

    allocators: tuple[str, ...] = DEFAULT_ALLOCATORS
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    max_steps: int = DEFAULT_MAX_STEPS

    def __post_init__(self) -> None:
        for name in ("allocators", "block_sizes", "seeds"):
            values = tuple(getattr(self, name))
            if not values:
                raise InvalidArgumentError(f"VizGrid.{name} must not be empty")
            if len(set(values)) != len(values):
                raise InvalidArgumentError(f"VizGrid.{name} has duplicates: {values}")
            object.__setattr__(self, name, values)
        unknown = [a for a in self.allocators if a not in KNOWN_ALLOCATORS]
        if unknown:
            raise InvalidArgumentError(
                f"unknown allocator(s) {unknown}: expected some of {', '.join(KNOWN_ALLOCATORS)}"
            )
        for block_size in self.block_sizes:
            if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
                raise InvalidArgumentError(f"block sizes must be integers >= 1, got {block_size!r}")
        for seed in self.seeds:
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                raise InvalidArgumentError(f"seeds must be integers >= 0, got {seed!r}")
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= MAX_STEPS:
            raise InvalidArgumentError(
                f"max_steps must be an integer in [1, {MAX_STEPS:,}], got {self.max_steps!r}"
            )

    @property
    def num_runs(self) -> int:
        return len(self.allocators) * len(self.block_sizes) * len(self.seeds)


def _default_recorder() -> Callable[..., dict[str, Any]]:
    from pagedkv.sim.engine import record_frames

    return record_frames


def record_grid(
    workload_for_seed: Callable[[int], Any],
    base_config: Any,
    grid: VizGrid = VizGrid(),
    *,
    recorder: Callable[..., dict[str, Any]] | None = None,
    on_run_done: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Record and encode every run of ``grid``; returns the page's data dict.

    ``workload_for_seed(seed)`` returns a ``pagedkv.sim.engine.Workload``; ``base_config`` is a
    ``SimConfig`` whose ``allocator``, ``block_size`` and ``seed`` are replaced per run (its
    ``num_slots`` is shared by all runs). ``recorder`` defaults to ``record_frames``; any
    function with its signature and result schema can stand in for it.
    ``on_run_done(label)`` is called after each run, for progress display.
    """
    record = recorder if recorder is not None else _default_recorder()
    runs: list[dict[str, Any]] = []
    workload_names: dict[str, str] = {}
    group_kind = "none"
    for seed in grid.seeds:
        workload = workload_for_seed(seed)
        workload_names[str(seed)] = str(getattr(workload, "name", f"seed {seed}"))
        group_kind = str(getattr(workload, "group_kind", group_kind))
        for allocator in grid.allocators:
            for block_size in grid.block_sizes:
                config = dataclasses.replace(
                    base_config, allocator=allocator, block_size=block_size, seed=seed
                )
                recording = record(workload, config, max_steps=grid.max_steps)
                runs.append(encode_run(recording, allocator=allocator, block_size=block_size, seed=seed))
                if on_run_done is not None:
                    on_run_done(f"{allocator} bs={block_size} seed={seed}")
    return {
        "workload": {"name": workload_names[str(grid.seeds[0])], "by_seed": workload_names},
        # "parallel" or "beam" names the sequences of a group in the block tables ("none" otherwise).
        "group_kind": group_kind,
        "num_slots": int(base_config.num_slots),
        "max_model_len": int(base_config.max_model_len),
        "arrival": str(getattr(base_config, "arrival", "")),
        "grid": {
            "allocators": list(grid.allocators),
            "block_sizes": list(grid.block_sizes),
            "seeds": list(grid.seeds),
            "max_steps": grid.max_steps,
        },
        "runs": runs,
    }


def parse_int_list(text: str, *, what: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), for the command line; a clear error otherwise."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    # ASCII decimal digits only: int() would also take "1_000" and other scripts' digits.
    if not all(_DECIMAL.fullmatch(part) for part in parts):
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"
        raise InvalidArgumentError(f"{what}: expected comma-separated integers, got {shown!r}")
    values = tuple(int(part) for part in parts)
    if not values:
        raise InvalidArgumentError(f"{what}: expected at least one integer, got {text!r}")
    return values


def parse_name_list(text: str, *, what: str, allowed: Sequence[str]) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise InvalidArgumentError(f"{what}: expected some of {', '.join(allowed)}, got {text!r}")
    return values
