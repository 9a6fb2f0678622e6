"""Plain-text tables for the experiments (aligned columns, units in the headers)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "SHARE_KEYS",
    "SHARE_LABELS",
    "format_table",
    "percent",
    "shares_table",
    "occupancy_table",
    "result_field",
]

# The five time-averaged shares of the pool (DESIGN.md §5); they sum to 1.
SHARE_KEYS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
SHARE_LABELS = {
    "token_states": "token states",
    "reserved": "reserved",
    "internal_fragmentation": "internal frag",
    "external_fragmentation": "external frag",
    "free": "free",
}


def percent(share: float, digits: int = 1) -> str:
    """A share in [0, 1] as ``"20.4 %"``."""
    return f"{100.0 * share:.{digits}f} %"


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1e5 or (0 < abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _is_numeric_text(text: str) -> bool:
    stripped = text.replace(",", "").replace("%", "").replace("x", "").strip().lstrip("+-")
    return bool(stripped) and stripped.replace(".", "", 1).replace("e", "", 1).replace("-", "").isdigit()


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    note: str | None = None,
) -> str:
    """Render rows under headers; numbers right-aligned, text left-aligned; optional title and note."""
    text_rows = [[_cell(value) for value in row] for row in rows]
    for row in text_rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, headers have {len(headers)}: {row}")
    widths = [len(header) for header in headers]
    for row in text_rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row)]
    numeric = [
        all(_is_numeric_text(row[i]) or row[i] == "-" for row in text_rows) and bool(text_rows)
        for i in range(len(headers))
    ]

    def render(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if is_number else cell.ljust(width)
            for cell, width, is_number in zip(cells, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(render(list(headers)))
    lines.append("  ".join("-" * width for width in widths))
    lines.extend(render(row) for row in text_rows)
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
        row: list[Any] = [label, *(percent(result_field(result, key)) for key in SHARE_KEYS)]
        if published_token_states is not None:
            published = published_token_states.get(label)
            row.append(percent(published) if published is not None else "-")
        rows.append(row)
    return format_table(headers, rows, title=title)


def occupancy_table(results: Mapping[str, Any], *, title: str | None = None) -> str:
    """One row per run: utilization (over the whole run, and over the steps at which a request was
    waiting, when the result has it), waste, resident requests, throughput, preemptions."""
    headers = [
        "run",
        "utilization",
        "while queued",
        "waste",
        "mean resident",
        "peak resident",
        "tokens/step",
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
                percent(utilization),
                percent(queued) if queued is not None else "-",
                percent(waste),
                float(result_field(result, "mean_resident_requests")),
                int(result_field(result, "peak_resident_requests")),
                float(result_field(result, "generated_tokens_per_step")),
                int(result_field(result, "preemptions")),
                int(result_field(result, "finished_requests")),
                int(result_field(result, "steps")),
            ]
        )
    return format_table(headers, rows, title=title)
