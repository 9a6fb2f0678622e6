"""Request traces in the Azure LLM inference format: ``TIMESTAMP,ContextTokens,GeneratedTokens``.

``TIMESTAMP`` is ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (any number of fractional digits) or a plain
number of seconds; arrivals are returned relative to the first row. Every problem is reported as a
`TraceError` naming the file and the 1-based line.

The two real traces of the project live outside the repository, in ``shared/traces/`` next to it
(``../shared/traces`` from the repository root); ``$PAGEDKV_TRACES`` overrides the location.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import Workload

__all__ = [
    "TraceError",
    "TraceNotFoundError",
    "TRACE_COLUMNS",
    "KNOWN_TRACES",
    "read_azure_csv",
    "traces_dir",
    "known_trace_path",
]

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# Short names of the real traces in the shared folder (CLI: --workload azure-conv).
KNOWN_TRACES = {
    "azure-conv": "azure_llm_2023_conv.csv",
    "azure-code": "azure_llm_2023_code.csv",
}


# Longest prompt or output a trace row may give: far beyond any pool, and small enough that the
# simulator's int64 token arithmetic cannot overflow.
MAX_TRACE_TOKENS = 2**40


class TraceError(InvalidArgumentError):
    """A trace file is malformed; the message names the file and the line."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """The trace file (or the folder of the shared traces) does not exist."""


def _parse_timestamp_s(text: str, date_cache: dict[str, float]) -> float:
    """Seconds since the epoch (UTC, naive) of ``YYYY-MM-DD HH:MM:SS[.f...]``, or a plain number.

    Parsed by hand: ``datetime.fromisoformat`` rejects the 7 fractional digits of the Azure traces
    before Python 3.11.
    """
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not np.isfinite(seconds):
            raise ValueError(f"timestamp {text!r} is not a finite number of seconds")
        return seconds
    date_part, sep, time_part = text.partition(" ")
    if not sep:
        date_part, sep, time_part = text.partition("T")
    if not sep:
        raise ValueError(f"timestamp {text!r} is neither seconds nor 'YYYY-MM-DD HH:MM:SS'")
    day_s = date_cache.get(date_part)
    if day_s is None:
        day = _dt.date.fromisoformat(date_part)
        day_s = float((day - _dt.date(1970, 1, 1)).days * 86_400)
        date_cache[date_part] = day_s
    whole, _, fraction = time_part.partition(".")
    hours_text, minutes_text, seconds_text = whole.split(":")
    hour, minute, second = int(hours_text), int(minutes_text), int(seconds_text)
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 61):
        raise ValueError(f"time of day {whole!r} out of range")
    if fraction and not fraction.isdigit():
        raise ValueError(f"fractional seconds {fraction!r} are not digits")
    frac_s = int(fraction) / 10 ** len(fraction) if fraction else 0.0
    return day_s + hour * 3600 + minute * 60 + second + frac_s


def read_azure_csv(path: str | os.PathLike, *, name: str | None = None) -> Workload:
    """Read a trace file into a `Workload` (prompt = ContextTokens, output = GeneratedTokens).

    Rows must have exactly three fields; lengths are integers, the prompt >= 1 token and the
    output >= 1 token (a request that generates nothing has no decode phase to replay).
    Rows out of time order are replayed in time order (a stable sort keeps ties in file order).
    """
    file_path = Path(path)
    if not file_path.is_file():
        kind = "is a directory, not a file" if file_path.is_dir() else "does not exist"
        raise TraceNotFoundError(f"trace file {str(file_path)!r} {kind}")
    prompts: list[int] = []
    outputs: list[int] = []
    times_s: list[float] = []
    date_cache: dict[str, float] = {}
    # Read bytes and decode line by line, so that a file that is not UTF-8 text is reported at
    # the line where it stops being text (a text-mode read fails somewhere in a chunk).
    with open(file_path, "rb") as handle:
        header_seen = False
        for line_number, raw_bytes in enumerate(handle, start=1):
            try:
                raw_line = raw_bytes.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise TraceError(
                    f"{file_path}:{line_number}: not UTF-8 text ({error.reason} at byte {error.start})"
                ) from None
            line = raw_line.strip()
            if not line:
                continue
            fields = [field.strip() for field in line.split(",")]
            where = f"{file_path}:{line_number}"
            if not header_seen:
                if tuple(fields) != TRACE_COLUMNS:
                    raise TraceError(
                        f"{where}: expected the header {','.join(TRACE_COLUMNS)!r}, got {line!r}"
                    )
                header_seen = True
                continue
            if len(fields) != 3:
                raise TraceError(
                    f"{where}: expected 3 comma-separated fields "
                    f"(TIMESTAMP,ContextTokens,GeneratedTokens), got {len(fields)}: {line!r}"
                )
            stamp, context_text, generated_text = fields
            try:
                context = int(context_text)
                generated = int(generated_text)
            except ValueError:
                raise TraceError(
                    f"{where}: token counts must be integers, got "
                    f"ContextTokens={context_text!r}, GeneratedTokens={generated_text!r}"
                ) from None
            if max(abs(context), abs(generated)) > MAX_TRACE_TOKENS:
                raise TraceError(
                    f"{where}: length out of range (ContextTokens={context_text}, "
                    f"GeneratedTokens={generated_text}; at most {MAX_TRACE_TOKENS} each)"
                )
            if context < 0 or generated < 0:
                raise TraceError(
                    f"{where}: negative length (ContextTokens={context}, GeneratedTokens={generated})"
                )
            if context == 0 or generated == 0:
                raise TraceError(
                    f"{where}: a request needs at least 1 prompt token and 1 generated token "
                    f"(ContextTokens={context}, GeneratedTokens={generated})"
                )
            try:
                times_s.append(_parse_timestamp_s(stamp, date_cache))
            except ValueError as error:
                raise TraceError(f"{where}: bad TIMESTAMP {stamp!r} ({error})") from None
            prompts.append(context)
            outputs.append(generated)
        if not header_seen:
            raise TraceError(f"{file_path}: empty file (expected the header {','.join(TRACE_COLUMNS)!r})")
    if not prompts:
        raise TraceError(f"{file_path}: no requests after the header")
    arrival_s = np.asarray(times_s, dtype=np.float64)
    order = np.argsort(arrival_s, kind="stable")
    arrival_s = arrival_s[order] - arrival_s[order[0]]
    return Workload(
        name=name or file_path.name,
        prompt_tokens=np.asarray(prompts, dtype=np.int64)[order],
        output_tokens=np.asarray(outputs, dtype=np.int64)[order],
        arrival_s=arrival_s,
    )


def _repo_roots() -> list[Path]:
    """Folders that look like a pagedkv checkout: above the current directory and above this file."""
    roots: list[Path] = []
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for folder in (start, *start.parents):
            if (folder / "pyproject.toml").is_file() and folder not in roots:
                roots.append(folder)
    return roots


def traces_dir() -> Path:
    """The folder of the shared real traces.

    ``$PAGEDKV_TRACES`` when set (it must exist); otherwise the first ``shared/traces`` found in
    a checkout root or one of its ancestors -- ``../shared/traces`` next to the main checkout,
    further up for a git worktree nested one level deeper.
    """
    override = os.environ.get("PAGEDKV_TRACES")
    if override:
        folder = Path(override)
        if not folder.is_dir():
            raise TraceNotFoundError(f"$PAGEDKV_TRACES={override!r} is not a directory")
        return folder
    tried: list[str] = []
    for root in _repo_roots():
        for ancestor in (root, *root.parents):
            candidate = ancestor / "shared" / "traces"
            if candidate.is_dir():
                return candidate
            tried.append(str(candidate))
    raise TraceNotFoundError(
        "no shared/traces folder found next to the repository; set $PAGEDKV_TRACES "
        f"(looked in: {', '.join(tried[:4]) or 'no checkout found'})"
    )


def known_trace_path(short_name: str) -> Path:
    """Path of one of `KNOWN_TRACES` (``azure-conv``, ``azure-code``) in `traces_dir`."""
    if short_name not in KNOWN_TRACES:
        raise InvalidArgumentError(f"unknown trace {short_name!r}: expected one of {', '.join(KNOWN_TRACES)}")
    path = traces_dir() / KNOWN_TRACES[short_name]
    if not path.is_file():
        raise TraceNotFoundError(f"trace file {str(path)!r} does not exist")
    return path
