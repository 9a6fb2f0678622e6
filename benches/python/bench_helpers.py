"""The two implementations every Python benchmark runs side by side."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pagedkv

# The plain-Python baseline lives with the tests that prove it correct (tests/python).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))

from baseline_manager import BaselineBlockManager  # noqa: E402


def make_manager(impl: str, **kwargs: Any) -> Any:
    """`pagedkv.KvCacheManager` for "pagedkv", the plain-Python baseline for "baseline"."""
    if impl == "pagedkv":
        return pagedkv.KvCacheManager(**kwargs)
    return BaselineBlockManager(**kwargs)
