"""llama.cpp's decode rates on the engine's GGUF file, each measured in a subprocess.

The subprocess runs ``llama_cpp_runner.py``'s source in the interpreter ``PAGEDKV_LLAMA_PYTHON``
names (default: this one), so that llama.cpp's threads and the engine's never share a process and
llama-cpp-python (a tool here, not a dependency) can live in its own environment. Where it does
not import or fails, the row is ``{"skipped": reason}``: a note in the bench output, not a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["engine_threads", "llama_cpp_batch_api", "llama_cpp_single_stream"]

_RUNNER = Path(__file__).with_name("llama_cpp_runner.py")
_TIMEOUT_S = 600


def engine_threads() -> int:
    """The thread count of the engine's Rust data plane: rayon's global pool takes
    ``RAYON_NUM_THREADS`` when it is a positive integer, else the CPUs this process may run on."""
    text = os.environ.get("RAYON_NUM_THREADS", "")
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def llama_cpp_single_stream(
    model_path: str, threads: int, prompt_tokens: int = 16, decode_tokens: int = 64
) -> dict[str, Any]:
    """llama-cpp-python's greedy single stream (``Llama.generate``), or a note why it did not run."""
    return _run(["single", model_path, str(threads), str(prompt_tokens), str(decode_tokens)])


def llama_cpp_batch_api(
    model_path: str, threads: int, batches: tuple[int, ...], prompt_tokens: int = 16, decode_tokens: int = 16
) -> dict[str, Any]:
    """llama.cpp's batched greedy decode through its batch API at each of ``batches`` sequences:
    ``{"threads": t, "batches": {"8": row, ...}}``, or a note why it did not run."""
    args = ["batch", model_path, str(threads), str(prompt_tokens), str(decode_tokens)]
    return _run(args + [str(b) for b in batches])


def _run(args: list[str]) -> dict[str, Any]:
    python = os.environ.get("PAGEDKV_LLAMA_PYTHON", sys.executable)
    try:
        done = subprocess.run(
            [python, "-c", _RUNNER.read_text(encoding="utf-8"), *args],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"llama.cpp did not run ({python}): {exc}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"llama_cpp does not run in {python} (set PAGEDKV_LLAMA_PYTHON): {last}"}
    try:
        row = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"skipped": f"llama.cpp printed no result in {python}: {done.stdout[-200:]!r}"}
    return dict(row)
