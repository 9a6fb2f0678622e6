"""Shared pieces of the Python benchmarks: the two implementations, and a ratio report.

Run with ``pytest benches/python --benchmark-enable`` (pytest-benchmark). Every benchmark runs
``pagedkv.KvCacheManager`` and the plain-Python ``pagedkv.baseline.BaselineBlockManager`` on the
same operations in the same run; the summary prints per-operation times and the ratios.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

IMPLEMENTATIONS = ["pagedkv", "baseline"]

# group -> implementation -> (seconds per unit, unit name)
_RESULTS: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def record(benchmark: Any) -> Any:
    """`record(group, impl, units_per_call, unit)`: after `benchmark(...)`, store the mean time
    per unit (e.g. per token or per operation) for the ratio summary."""

    def _record(group: str, impl_name: str, units_per_call: float, unit: str) -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is None:  # --benchmark-disable: the function ran once, nothing measured
            return
        _RESULTS[group][impl_name] = (stats.stats.median / units_per_call, unit)

    return _record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("pagedkv vs plain-Python baseline (median time per unit, same run)")
    write(f"{'benchmark':<38}{'pagedkv':>14}{'baseline':>14}{'speedup':>10}  unit")
    for group in sorted(_RESULTS):
        row = _RESULTS[group]
        ours = row.get("pagedkv")
        base = row.get("baseline")
        unit = (ours or base or (0.0, ""))[1]
        fmt = lambda v: "-" if v is None else f"{v[0] * 1e9:,.0f} ns"  # noqa: E731
        ratio = f"{base[0] / ours[0]:.1f}x" if ours and base else "-"
        write(f"{group:<38}{fmt(ours):>14}{fmt(base):>14}{ratio:>10}  {unit}")
        if ours and unit == "token":
            write(f"{'':<38}{1 / ours[0] / 1e6:>11.1f} M tokens/s (pagedkv)"
                  + (f", {1 / base[0] / 1e6:.2f} M tokens/s (baseline)" if base else ""))
