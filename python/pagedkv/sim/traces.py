"""Request traces: the Azure LLM inference format (``TIMESTAMP,ContextTokens,GeneratedTokens``,
read into a `Workload`) and the Mooncake prefix-sharing format (JSONL with chained prefix-block
ids, read into `TraceRequest` records for `pagedkv.sim.cluster`).

An Azure ``TIMESTAMP`` is ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (any number of fractional digits) or a
plain number of seconds; arrivals are returned relative to the first row. Every problem is
reported as a `TraceError` naming the file and the 1-based line.

The two Azure traces (CC-BY 4.0) and the two Mooncake traces (Apache-2.0) ship gzip-compressed
inside the package (``pagedkv/sim/data``, attribution in ``TRACES.md`` there, the Apache license
in ``data/mooncake``), so ``--workload azure-conv`` and ``mooncake-conversation`` work after
``pip install``.
``$PAGEDKV_TRACES``, or a ``shared/traces`` folder next to a checkout, overrides those copies.
A trace file may itself be gzip-compressed (a name ending in ``.gz``).
"""

from __future__ import annotations

import datetime as _dt
import gzip
import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.errors import InvalidArgumentError, TraceError, TraceNotFoundError
from pagedkv.sim.engine import Workload
from pagedkv.sim.names import KNOWN_TRACES, PREFIX_TRACES

__all__ = [
    "TraceError",
    "TraceNotFoundError",
    "TRACE_COLUMNS",
    "KNOWN_TRACES",
    "PREFIX_TRACES",
    "AZURE_ATTRIBUTION",
    "MOONCAKE_ATTRIBUTION",
    "BUNDLED_TRACES_DIR",
    "read_azure_csv",
    "TRACE_BLOCK_TOKENS",
    "TraceRequest",
    "read_mooncake_jsonl",
    "mooncake_workload",
    "traces_dir",
    "known_trace_path",
    "is_azure_trace",
]

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# The Azure traces are CC-BY 4.0: results computed from them carry this attribution.
AZURE_ATTRIBUTION = "Data: Azure LLM inference trace 2023, Azure Public Dataset, Microsoft (CC-BY 4.0)"
# The Mooncake traces are Apache-2.0; their release asks for this attribution.
MOONCAKE_ATTRIBUTION = "Data: Mooncake trace release, Moonshot AI (Apache-2.0)"
# The copies inside the package, gzip-compressed (``<file name>.gz``).
BUNDLED_TRACES_DIR = Path(__file__).resolve().parent / "data"


# Longest prompt or output a trace row may give: far beyond any pool, and small enough that the
# simulator's int64 token arithmetic cannot overflow.
MAX_TRACE_TOKENS = 2**40


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
        raise TraceError(text)
    return int(text)


def _parse_timestamp_s(text: str, date_cache: dict[str, float]) -> float:
    """Seconds since the epoch (UTC, naive) of ``YYYY-MM-DD HH:MM:SS[.f...]``, or a plain number.

    Parsed by hand: ``datetime.fromisoformat`` rejects the 7 fractional digits of the Azure traces
    before Python 3.11.
    """
    if _SECONDS.fullmatch(text):
        seconds = float(text)
        if not math.isfinite(seconds):
            raise TraceError("not a finite number of seconds")
        return seconds
    match = _DATETIME.fullmatch(text)
    if match is None:
        raise TraceError("neither seconds nor 'YYYY-MM-DD HH:MM:SS[.fff]'")
    date_part, hours_text, minutes_text, seconds_text, fraction = match.groups()
    day_s = date_cache.get(date_part)
    if day_s is None:
        day = _dt.date.fromisoformat(date_part)
        day_s = float((day - _dt.date(1970, 1, 1)).days * 86_400)
        date_cache[date_part] = day_s
    hour, minute, second = int(hours_text), int(minutes_text), int(seconds_text)
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 61):
        raise TraceError(f"time of day {hours_text}:{minutes_text}:{seconds_text} out of range")
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
    """Path of one of `KNOWN_TRACES` (``azure-conv``, ``azure-code``) or `PREFIX_TRACES`
    (``mooncake-conversation``, ``mooncake-synthetic``).

    ``$PAGEDKV_TRACES`` is authoritative when set: the file (or its ``.gz``) must be there.
    Otherwise a checkout's ``shared/traces`` copy is used when present, else the copy bundled
    in the package.
    """
    file_names = {**KNOWN_TRACES, **PREFIX_TRACES}
    if short_name not in file_names:
        raise InvalidArgumentError(
            f"unknown trace {_quote(short_name)}: expected one of {', '.join(file_names)}"
        )
    file_name = file_names[short_name]
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


# -- the Mooncake format: prefix-block ids per request ---------------------------------------------
TRACE_BLOCK_TOKENS = 512
"""Tokens per Mooncake trace block (``hash_ids`` entry)."""
MAX_HASH_ID = 2**22
"""Hash ids lie in ``[0, MAX_HASH_ID)``: ``id * 512 + 511`` stays a uint32 token id."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a prefix-sharing trace: arrival (s), prompt length, output length and its
    chained prefix-block ids (``TRACE_BLOCK_TOKENS`` tokens each, the last one possibly partial).

    Not the engine's `pagedkv.engine.request.Request` (token ids and sampling state): this one
    carries lengths and block ids only, what the cluster simulator replays."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def _json_int(row: dict, key: str) -> int:
    value = row[key]
    # JSON has one number type: 7.0 or 1e400 (a float, inf) is not a token count.
    if type(value) is not int:
        raise TraceError(f"{key} must be an integer, got {_quote(json.dumps(value)[:200])}")
    return value


def _mooncake_request(line: str) -> TraceRequest:
    """One JSONL line as a `TraceRequest`; TraceError (with the reason) when it is not one."""
    try:
        row = json.loads(line)
    except RecursionError:  # a deeply nested line ([[[[...]]]]): not a trace row
        raise TraceError("nested too deeply to be a trace row") from None
    except json.JSONDecodeError as error:
        raise TraceError(f"not JSON ({error.msg} at column {error.colno})") from None
    except ValueError:  # an integer of more than 4,300 digits (Python's int-from-str limit)
        raise TraceError("a number with too many digits") from None
    if not isinstance(row, dict):
        raise TraceError("expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"missing {', '.join(missing)}")
    stamp = row["timestamp"]
    if type(stamp) not in (int, float):
        raise TraceError(f"timestamp must be a number of milliseconds, got {_quote(str(stamp))}")
    try:
        arrival_s = float(stamp) / 1000.0
    except OverflowError:  # an integer beyond a float (10**400)
        raise TraceError("timestamp out of range") from None
    if not (math.isfinite(arrival_s) and abs(arrival_s) <= MAX_TRACE_SPAN_S):
        raise TraceError(f"timestamp out of range (at most {MAX_TRACE_SPAN_S * 1000:.3g} ms)")
    input_tokens = _json_int(row, "input_length")
    output_tokens = _json_int(row, "output_length")
    if not (1 <= input_tokens <= MAX_TRACE_TOKENS and 0 <= output_tokens <= MAX_TRACE_TOKENS):
        raise TraceError(
            f"needs 1 <= input_length <= {MAX_TRACE_TOKENS} and 0 <= output_length <= {MAX_TRACE_TOKENS}"
        )
    ids = row["hash_ids"]
    if not isinstance(ids, list) or any(type(h) is not int or not 0 <= h < MAX_HASH_ID for h in ids):
        raise TraceError("hash_ids must be a list of integers in [0, 2**22)")
    if len(ids) != -(-input_tokens // TRACE_BLOCK_TOKENS):
        raise TraceError(
            f"{len(ids)} hash ids for input_length {input_tokens}: needs one per {TRACE_BLOCK_TOKENS} tokens"
        )
    return TraceRequest(arrival_s, input_tokens, output_tokens, tuple(ids))


def read_mooncake_jsonl(path: str | os.PathLike) -> list[TraceRequest]:
    """A Mooncake-format trace (JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``,
    ``hash_ids``), in arrival order (a stable sort keeps the file's order among equal times).

    A name ending in ``.gz`` is read through gzip. Every problem is a `TraceError` naming the file
    and the line: a line that is not a JSON object, not UTF-8, nested too deeply, a length that is
    not an integer or out of range, a timestamp that is not a finite number, or a ``hash_ids`` list
    whose length does not match ``input_length`` (one id per 512 tokens, the last partial).
    """
    file_path = Path(path)
    if not file_path.is_file():
        kind = "is a directory, not a file" if file_path.is_dir() else "does not exist"
        raise TraceNotFoundError(f"trace file {str(file_path)!r} {kind}")
    requests: list[TraceRequest] = []
    try:
        with _open_lines(file_path) as handle:
            for line_number, raw_bytes in enumerate(handle, start=1):
                where = f"{file_path}:{line_number}"
                try:
                    line = raw_bytes.decode("utf-8-sig" if line_number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    raise TraceError(
                        f"{where}: not UTF-8 text ({error.reason} at byte {error.start})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    requests.append(_mooncake_request(line))
                except ValueError as error:
                    raise TraceError(f"{where}: not a Mooncake trace line: {error}") from None
    except (OSError, EOFError) as error:  # unreadable, or a corrupt or truncated .gz
        raise TraceError(f"{file_path}: cannot read the trace ({error})") from None
    if not requests:
        raise TraceError(f"{file_path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if not span_s <= MAX_TRACE_SPAN_S:
        raise TraceError(
            f"{file_path}: arrivals span {span_s:.3g} s; a trace may span at most {MAX_TRACE_SPAN_S:.3g} s"
        )
    return requests


def mooncake_workload(requests: list[TraceRequest], *, name: str) -> Workload:
    """Prefix-sharing trace records as a simulator `Workload`: prompt = ``input_length``, output =
    ``output_length`` (at least 1: the simulator's prefill yields a request's first token), arrival
    = the timestamp, and the prompt a chain of the request's ``hash_ids`` blocks of
    `TRACE_BLOCK_TOKENS` tokens (``Workload.block_ids``), as ``pagedkv cluster`` replays them."""
    if not requests:
        raise InvalidArgumentError(f"trace {name!r} has no requests")
    lengths = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=len(requests))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((h for r in requests for h in r.hash_ids), dtype=np.int64, count=int(offsets[-1]))
    return Workload(
        name=name,
        prompt_tokens=np.fromiter((r.input_tokens for r in requests), dtype=np.int64, count=len(requests)),
        output_tokens=np.fromiter(
            (max(1, r.output_tokens) for r in requests), dtype=np.int64, count=len(requests)
        ),
        arrival_s=np.fromiter((r.arrival_s for r in requests), dtype=np.float64, count=len(requests)),
        block_offsets=offsets,
        block_ids=ids,
        block_tokens=TRACE_BLOCK_TOKENS,
    )
