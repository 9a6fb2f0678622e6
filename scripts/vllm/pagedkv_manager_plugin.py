"""A pytest plugin that runs vLLM's own tests on pagedkv's KV-cache manager.

vLLM's scheduler builds its ``KVCacheManager`` from its own module's namespace
(``vllm.v1.core.sched.scheduler``), and its tests import the class from
``vllm.v1.core.kv_cache_manager``: replacing the name in both modules before the tests are
collected makes every scheduler and every manager the tests build pagedkv's
(``pagedkv.integrations.vllm.KVCacheManager``). ``PAGEDKV_VLLM_MANAGER=vllm`` keeps vLLM's own
(the reference run), ``passthrough`` substitutes a subclass of vLLM's that adds nothing (a check
that the substitution point still reaches every construction).

    python -m pytest -p pagedkv_manager_plugin tests/v1/core/test_scheduler.py
"""

from __future__ import annotations

import os
from typing import Any


def _manager_class() -> Any:
    choice = os.environ.get("PAGEDKV_VLLM_MANAGER", "pagedkv")
    from vllm.v1.core import kv_cache_manager

    if choice == "vllm":
        return None
    if choice == "passthrough":

        class PassThrough(kv_cache_manager.KVCacheManager):
            pass

        return PassThrough
    if choice == "pagedkv":
        from pagedkv.integrations.vllm import KVCacheManager

        return KVCacheManager
    raise SystemExit(f"PAGEDKV_VLLM_MANAGER={choice!r}: expected pagedkv, vllm or passthrough")


def pytest_configure(config: Any) -> None:
    cls = _manager_class()
    if cls is None:
        return
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.sched import scheduler

    scheduler.KVCacheManager = cls
    kv_cache_manager.KVCacheManager = cls
    config.pluginmanager.register(_Header(cls), "pagedkv-manager-header")


class _Header:
    def __init__(self, cls: Any) -> None:
        self.cls = cls

    def pytest_report_header(self) -> str:
        return f"KVCacheManager substituted: {self.cls.__module__}.{self.cls.__qualname__}"
