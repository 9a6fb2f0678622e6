"""The two implementations every Python benchmark runs side by side."""

from __future__ import annotations

from typing import Any

import pagedkv
from pagedkv.baseline import BaselineBlockManager


def make_manager(impl: str, **kwargs: Any) -> Any:
    """`pagedkv.KvCacheManager` for "pagedkv", the plain-Python baseline for "baseline"."""
    if impl == "pagedkv":
        return pagedkv.KvCacheManager(**kwargs)
    return BaselineBlockManager(**kwargs)
