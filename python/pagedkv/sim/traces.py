"""Request traces in the Azure LLM inference format: ``TIMESTAMP,ContextTokens,GeneratedTokens``.

``TIMESTAMP`` is ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (any number of fractional digits) or a plain
number of seconds; arrivals are returned relative to the first row. Every problem is reported as a
`TraceError` naming the file and the 1-based line.

The two Azure traces (CC-BY 4.0) ship gzip-compressed inside the package (``pagedkv/sim/data``,
attribution in ``TRACES.md`` there), so ``--workload azure-conv`` works after ``pip install``.
``$PAGEDKV_TRACES``, or a ``shared/traces`` folder next to a checkout, overrides those copies.
A trace file may itself be gzip-compressed (a name ending in ``.gz``).
"""

from __future__ import annotations

import datetime as _dt
import gzip
import io
import math
import os
import re
from pathlib import Path

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.engine import Workload
from pagedkv.sim.names import KNOWN_TRACES

__all__ = [
    "TraceError",
    "TraceNotFoundError",
    "TRACE_COLUMNS",
    "KNOWN_TRACES",
    "AZURE_ATTRIBUTION",
    "BUNDLED_TRACES_DIR",
    "read_azure_csv",
    "traces_dir",
    "known_trace_path",
    "is_azure_trace",
]

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# The Azure traces are CC-BY 4.0: results computed from them carry this attribution.
AZURE_ATTRIBUTION = "Data: Azure LLM inference trace 2023, Azure Public Dataset, Microsoft (CC-BY 4.0)"
# The copies inside the package, gzip-compressed (``<file name>.gz``).
BUNDLED_TRACES_DIR = Path(__file__).resolve().parent / "data"


# Longest prompt or output a trace row may give: far beyond any pool, and small enough that the
# simulator's int64 token arithmetic cannot overflow.
MAX_TRACE_TOKENS = 2**40


class TraceError(InvalidArgumentError):
    """A trace file is malformed; the message names the file and the line."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """The trace file (or the folder of the shared traces) does not exist."""


# A plain number of seconds: ASCII digits only (no ``1_000``, no other scripts' digits, no nan/inf).
_SECONDS = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
# ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (or ``T`` between date and time); any number of fraction digits.
_DATETIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?", re.ASCII)
# A token count: ASCII decimal digits (Python's int() would also take ``1_000`` and ``١٢``).
_COUNT = re.compile(r"[+-]?\d+", re.ASCII)
# Longest span of arrival times in one trace: a century. Far beyond any real trace, and small
# enough that the simulator's step clock (int64 steps of at least a microsecond) cannot overflow.
MAX_TRACE_SPAN_S = 100 * 365.25 * 86_400.0
# Longest field quoted back in an error message.
_MAX_QUOTED_CHARS = 60


def _quote(text: str) -> str:
    """``repr(text)``, cut to a readable length (a malformed file may hold a 50 MB field)."""
    if len(text) <= _MAX_QUOTED_CHARS:
        return repr(text)
    return f"{text[:_MAX_QUOTED_CHARS]!r}... ({len(text):,} characters)"


def _parse_count(text: str) -> int:
    if not _COUNT.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _parse_timestamp_s(text: str, date_cache: dict[str, float]) -> float:
    """Seconds since the epoch (UTC, naive) of ``YYYY-MM-DD HH:MM:SS[.f...]``, or a plain number.

    Parsed by hand: ``datetime.fromisoformat`` rejects the 7 fractional digits of the Azure traces
    before Python 3.11.
    """
    if _SECONDS.fullmatch(text):
        seconds = float(text)
        if not math.isfinite(seconds):
            raise ValueError("not a finite number of seconds")
        return seconds
    match = _DATETIME.fullmatch(text)
    if match is None:
        raise ValueError("neither seconds nor 'YYYY-MM-DD HH:MM:SS[.fff]'")
    date_part, hours_text, minutes_text, seconds_text, fraction = match.groups()
    day_s = date_cache.get(date_part)
    if day_s is None:
        day = _dt.date.fromisoformat(date_part)
        day_s = float((day - _dt.date(1970, 1, 1)).days * 86_400)
        date_cache[date_part] = day_s
    hour, minute, second = int(hours_text), int(minutes_text), int(seconds_text)
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 61):
        raise ValueError(f"time of day {hours_text}:{minutes_text}:{seconds_text} out of range")
    frac_s = int(fraction) / 10 ** len(fraction) if fraction else 0.0
    return day_s + hour * 3600 + minute * 60 + second + frac_s


def _open_lines(file_path: Path) -> io.BufferedIOBase:
    """The file's bytes, decompressed when its name ends in ``.gz``."""
    if file_path.name.lower().endswith(".gz"):
        return gzip.GzipFile(file_path, "rb")
    return open(file_path, "rb")


def read_azure_csv(path: str | os.PathLike, *, name: str | None = None) -> Workload:
    """Read a trace file into a `Workload` (prompt = ContextTokens, output = GeneratedTokens).

    Rows must have exactly three fields; lengths are decimal integers, the prompt >= 1 token and
    the output >= 1 token (a request that generates nothing has no decode phase to replay).
    Rows out of time order are replayed in time order (a stable sort keeps ties in file order);
    the arrivals may span at most `MAX_TRACE_SPAN_S`. A name ending in ``.gz`` is read through gzip.
    """
    file_path = Path(path)
    if not file_path.is_file():
        kind = "is a directory, not a file" if file_path.is_dir() else "does not exist"
        raise TraceNotFoundError(f"trace file {str(file_path)!r} {kind}")
    prompts: list[int] = []
    outputs: list[int] = []
    times_s: list[float] = []
    line_numbers: list[int] = []
    date_cache: dict[str, float] = {}
    # Read bytes and decode line by line, so that a file that is not UTF-8 text is reported at
    # the line where it stops being text (a text-mode read fails somewhere in a chunk).
    try:
        with _open_lines(file_path) as handle:
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
                            f"{where}: expected the header {','.join(TRACE_COLUMNS)!r}, got {_quote(line)}"
                        )
                    header_seen = True
                    continue
                if len(fields) != 3:
                    raise TraceError(
                        f"{where}: expected 3 comma-separated fields "
                        f"(TIMESTAMP,ContextTokens,GeneratedTokens), got {len(fields)}: {_quote(line)}"
                    )
                stamp, context_text, generated_text = fields
                try:
                    context = _parse_count(context_text)
                    generated = _parse_count(generated_text)
                except ValueError:
                    raise TraceError(
                        f"{where}: token counts must be integers (decimal digits), got "
                        f"ContextTokens={_quote(context_text)}, GeneratedTokens={_quote(generated_text)}"
                    ) from None
                if max(abs(context), abs(generated)) > MAX_TRACE_TOKENS:
                    raise TraceError(
                        f"{where}: length out of range (ContextTokens={_quote(context_text)}, "
                        f"GeneratedTokens={_quote(generated_text)}; at most {MAX_TRACE_TOKENS} each)"
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
                    raise TraceError(f"{where}: bad TIMESTAMP {_quote(stamp)} ({error})") from None
                prompts.append(context)
                outputs.append(generated)
                line_numbers.append(line_number)
            if not header_seen:
                raise TraceError(f"{file_path}: empty file (expected the header {','.join(TRACE_COLUMNS)!r})")
    except (OSError, EOFError) as error:  # unreadable, or a corrupt or truncated .gz
        raise TraceError(f"{file_path}: cannot read the trace ({error})") from None
    if not prompts:
        raise TraceError(f"{file_path}: no requests after the header")
    arrival_s = np.asarray(times_s, dtype=np.float64)
    order = np.argsort(arrival_s, kind="stable")
    first, last = int(order[0]), int(order[-1])
    span_s = arrival_s[last] - arrival_s[first]
    if not span_s <= MAX_TRACE_SPAN_S:
        raise TraceError(
            f"{file_path}:{line_numbers[last]}: TIMESTAMP lies {span_s:.3g} s after the earliest one "
            f"(line {line_numbers[first]}); a trace may span at most {MAX_TRACE_SPAN_S:.3g} s"
        )
    arrival_s = arrival_s[order] - arrival_s[first]
    return Workload(
        name=name or file_path.name.removesuffix(".gz"),
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
    """The folder of the shared real traces, overriding the bundled copies.

    ``$PAGEDKV_TRACES`` when set (it must exist); otherwise the first ``shared/traces`` found in
    a checkout root or one of its ancestors -- ``../shared/traces`` next to the main checkout,
    further up for a git worktree nested one level deeper. Raises `TraceNotFoundError` when
    there is none (the bundled copies in `BUNDLED_TRACES_DIR` still serve `known_trace_path`).
    """
    override = os.environ.get("PAGEDKV_TRACES")
    if override:
        folder = Path(override)
        if not folder.is_dir():
            raise TraceNotFoundError(f"$PAGEDKV_TRACES={_quote(override)} is not a directory")
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
    """Path of one of `KNOWN_TRACES` (``azure-conv``, ``azure-code``).

    ``$PAGEDKV_TRACES`` is authoritative when set: the file (or its ``.gz``) must be there.
    Otherwise a checkout's ``shared/traces`` copy is used when present, else the copy bundled
    in the package.
    """
    if short_name not in KNOWN_TRACES:
        raise InvalidArgumentError(
            f"unknown trace {_quote(short_name)}: expected one of {', '.join(KNOWN_TRACES)}"
        )
    file_name = KNOWN_TRACES[short_name]
    folders: list[Path] = []
    try:
        folders.append(traces_dir())
    except TraceNotFoundError:
        if os.environ.get("PAGEDKV_TRACES"):
            raise
    if not os.environ.get("PAGEDKV_TRACES"):
        folders.append(BUNDLED_TRACES_DIR)
    for folder in folders:
        for candidate in (folder / file_name, folder / f"{file_name}.gz"):
            if candidate.is_file():
                return candidate
    raise TraceNotFoundError(
        f"trace file {file_name!r} not found in {' or '.join(repr(str(f)) for f in folders)}"
    )


def is_azure_trace(path: str | os.PathLike) -> bool:
    """Whether ``path`` names one of the Azure traces (whose results carry `AZURE_ATTRIBUTION`)."""
    return Path(path).name.startswith("azure_llm_")
