"""Shared pieces of the Python benchmarks: the two implementations, and a ratio report.

Run with ``pytest benches/python --benchmark-enable`` (pytest-benchmark). Every benchmark runs
``pagedkv.KvCacheManager`` and the plain-Python ``BaselineBlockManager``
(``tests/python/baseline_manager.py``) on the
same operations in the same run; the summary prints per-operation times and the ratios.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

IMPLEMENTATIONS = ["pagedkv", "baseline"]

# group -> implementation -> (min seconds per unit, median seconds per unit, unit name)
_RESULTS: dict[str, dict[str, tuple[float, float, str]]] = defaultdict(dict)


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def record(benchmark: Any) -> Any:
    """`record(group, impl, units_per_call, unit)`: after `benchmark(...)`, store the minimum and
    median time per unit (e.g. per token or per operation) for the ratio summary."""

    def _record(group: str, impl_name: str, units_per_call: float, unit: str) -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is None:  # --benchmark-disable: the function ran once, nothing measured
            return
        _RESULTS[group][impl_name] = (
            stats.stats.min / units_per_call,
            stats.stats.median / units_per_call,
            unit,
        )

    return _record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Per-unit times and speedups. The minimum over rounds is the robust statistic on a shared
    machine (interference only ever adds time); the median is shown for comparison."""
    if not _RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("pagedkv vs plain-Python baseline, same run: time per unit, min (median)")
    write(f"{'benchmark':<46}{'pagedkv':>20}{'baseline':>22}{'speedup':>9}  unit")
    for group in sorted(_RESULTS):
        row = _RESULTS[group]
        ours, base = row.get("pagedkv"), row.get("baseline")
        unit = (ours or base or (0.0, 0.0, ""))[2]

        def fmt(v: tuple[float, float, str] | None) -> str:
            return "-" if v is None else f"{v[0] * 1e9:,.0f} ({v[1] * 1e9:,.0f}) ns"

        ratio = f"{base[0] / ours[0]:.1f}x" if ours and base else "-"
        write(f"{group:<46}{fmt(ours):>20}{fmt(base):>22}{ratio:>9}  {unit}")
        if ours and unit == "token":
            line = f"{'':<46}{1 / ours[0] / 1e6:.1f} M tokens/s (pagedkv)"
            if base:
                line += f", {1 / base[0] / 1e6:.1f} M tokens/s (baseline)"
            write(line)
