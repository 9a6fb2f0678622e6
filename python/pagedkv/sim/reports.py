"""Plain-text tables for the experiments: aligned columns of values, units in the headers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = [
    "SHARE_KEYS",
    "SHARE_LABELS",
    "format_table",
    "percent",
    "Number",
    "Percent",
    "shares_table",
    "occupancy_table",
    "tokens_per_step_differs",
    "result_field",
]

# The five time-averaged shares of the pool (docs/metrics.md); they sum to 1.
SHARE_KEYS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
SHARE_LABELS = {
    "token_states": "token states",
    "reserved": "reserved",
    "internal_fragmentation": "internal frag",
    "external_fragmentation": "external frag",
    "free": "free",
}


def percent(share: float, digits: int = 1) -> str:
    """A share in [0, 1] as ``"20.4 %"`` (for prose; a table cell takes `Percent`)."""
    return f"{100.0 * share:.{digits}f} %"


@dataclass(frozen=True)
class Number:
    """A table cell holding a number with its own format: ``Number(0.25, "+.1f", " pts")``.

    Right-aligned like every number; None renders as ``-``.
    """

    value: float | None
    spec: str = ",.2f"
    suffix: str = ""

    def __str__(self) -> str:
        if self.value is None or self.value != self.value:  # missing or NaN
            return "-"
        return f"{self.value:{self.spec}}{self.suffix}"


def Percent(share: float | None, digits: int = 1) -> Number:  # noqa: N802 (a cell constructor)
    """A table cell: a share in [0, 1] shown as a percentage, ``20.4 %``."""
    return Number(None if share is None else 100.0 * share, f".{digits}f", " %")


def _float_spec(values: Sequence[float]) -> str:
    """One fixed-point format for a whole column of floats, never scientific: two decimals while
    every value is below 100, one below 10,000, none above (with thousands separators)."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    largest = max(finite, default=0.0)
    decimals = 2 if largest < 100 else 1 if largest < 10_000 else 0
    return f",.{decimals}f"


def _column_texts(column: Sequence[Any]) -> tuple[list[str], bool]:
    """The cells of one column as text, and whether the column is numeric (right-aligned)."""
    floats = [v for v in column if isinstance(v, float)]
    float_spec = _float_spec(floats)
    texts = []
    numeric = bool(column)
    for value in column:
        if value is None:
            texts.append("-")
        elif isinstance(value, bool):
            texts.append("yes" if value else "no")
            numeric = False
        elif isinstance(value, (int, np.integer)):
            texts.append(f"{int(value):,}")
        elif isinstance(value, (float, np.floating)):
            texts.append("-" if value != value else f"{float(value):{float_spec}}")
        elif isinstance(value, Number):
            texts.append(str(value))
        else:
            texts.append(str(value))
            numeric = False
    return texts, numeric


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    note: str | None = None,
) -> str:
    """Render rows of values under headers; optional title and note.

    Cells are values, formatted here: ints with thousands separators, floats in one fixed-point
    format per column, `Number`/`Percent` cells with their own format, None as ``-``, strings as
    they are. A column of numbers is right-aligned, any other left-aligned.
    """
    value_rows = [list(row) for row in rows]
    for row in value_rows:
        if len(row) != len(headers):
            raise InvalidArgumentError(f"row has {len(row)} cells, headers have {len(headers)}: {row}")
    columns = [_column_texts([row[i] for row in value_rows]) for i in range(len(headers))]
    widths = [
        max([len(header), *(len(text) for text in texts)])
        for header, (texts, _) in zip(headers, columns, strict=True)
    ]
    numeric = [is_number for _, is_number in columns]

    def render(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if is_number else cell.ljust(width)
            for cell, width, is_number in zip(cells, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(render(list(headers)))
    lines.append("  ".join("-" * width for width in widths))
    lines.extend(render([texts[r] for texts, _ in columns]) for r in range(len(value_rows)))
    if note:
        lines.append(note)
    return "\n".join(lines)


def result_field(result: Any, key: str) -> Any:
    """A field of a `SimResult` or of its ``to_dict()`` form."""
    if isinstance(result, Mapping):
        return result[key]
    return getattr(result, key)


def shares_table(
    results: Mapping[str, Any],
    *,
    title: str | None = None,
    published_token_states: Mapping[str, float] | None = None,
) -> str:
    """One row per run: the five pool shares (and the published token-state share if given)."""
    headers = ["run", *(SHARE_LABELS[key] for key in SHARE_KEYS)]
    if published_token_states is not None:
        headers.append("published token states")
    rows = []
    for label, result in results.items():
        row: list[Any] = [label, *(Percent(result_field(result, key)) for key in SHARE_KEYS)]
        if published_token_states is not None:
            published = published_token_states.get(label)
            row.append(Percent(published))
        rows.append(row)
    return format_table(headers, rows, title=title)


def tokens_per_step_differs(results: Mapping[str, Any]) -> bool:
    """Whether some run generated other than one token per resident request and step.

    Every running sequence generates one token per step, so generated tokens per step equal the
    mean resident requests unless a request runs several sequences (parallel sampling, beams).
    """
    return any(
        abs(
            float(result_field(result, "generated_tokens_per_step"))
            - float(result_field(result, "mean_resident_requests"))
        )
        > 1e-9
        for result in results.values()
    )


def occupancy_table(results: Mapping[str, Any], *, title: str | None = None) -> str:
    """One row per run: utilization (over the whole run, and over the steps at which a request was
    waiting, when the result has it), waste, resident requests, preemptions. A tokens/step column
    only where it says more than mean resident (requests of several sequences)."""
    with_tokens = tokens_per_step_differs(results)
    headers = [
        "run",
        "utilization",
        "while queued",
        "waste",
        "mean resident",
        "peak resident",
        *(["tokens/step"] if with_tokens else []),
        "preemptions",
        "finished",
        "steps",
    ]
    rows = []
    for label, result in results.items():
        utilization = result_field(result, "token_states")
        waste = (
            result_field(result, "reserved")
            + result_field(result, "internal_fragmentation")
            + result_field(result, "external_fragmentation")
        )
        try:
            queued = result_field(result, "shares_while_queued").get("token_states")
        except (KeyError, AttributeError):
            queued = None
        rows.append(
            [
                label,
                Percent(utilization),
                Percent(queued),
                Percent(waste),
                float(result_field(result, "mean_resident_requests")),
                int(result_field(result, "peak_resident_requests")),
                *([float(result_field(result, "generated_tokens_per_step"))] if with_tokens else []),
                int(result_field(result, "preemptions")),
                int(result_field(result, "finished_requests")),
                int(result_field(result, "steps")),
            ]
        )
    note = (
        None
        if with_tokens
        else "Each resident request generates one token per step: tokens/step = mean resident."
    )
    return format_table(headers, rows, title=title, note=note)
