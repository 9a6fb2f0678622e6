"""vLLM's ``Scheduler`` / ``AsyncScheduler`` building pagedkv's KV-cache manager.

vLLM's scheduler constructs its manager from the name ``KVCacheManager`` in its own module, with
no hook besides the scheduler class itself; these subclasses swap that name for the duration of
their own construction only (one module-level name, so construction is serialized by a lock), and
refuse up front what the scheduler would reach and the manager does not support: HiSparse
(hisparse.py: its connector would otherwise be named first), a KV connector on groups
other than full-attention and sliding-window groups, or full attention of one spec beside
Mamba groups (connector.py, hybrid_hits.py). Auxiliary outputs
(``aux_output_config``) are supported: their connector's look-ups by one block hash are the
core's (aux_outputs.py).

    SchedulerConfig(..., scheduler_cls="pagedkv.integrations.vllm.PagedkvScheduler")
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.sched import scheduler as _scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from pagedkv.integrations.vllm.hisparse import check_hisparse
from pagedkv.integrations.vllm.manager import KVCacheManager, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm.support import checkpoint_alignment

_CONSTRUCTION = threading.Lock()


def _check_vllm_config(vllm_config: Any, kv_cache_config: Any) -> None:
    """What the scheduler would reach and pagedkv's manager does not support, named up front."""
    if kv_cache_config is not None:
        check_hisparse(kv_cache_config)  # HiSparse comes with its connector: named before it
    if getattr(vllm_config, "kv_transfer_config", None) is not None and kv_cache_config is not None:
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        # Beside Mamba groups: full attention of one spec (the core's diverged admission, which
        # a connector's look-up can ask for there, covers only that; hybrid_hits.py).
        with_mamba = any(type(s) is MambaSpec for s in specs)
        allowed = (FullAttentionSpec, MambaSpec) if with_mamba else (FullAttentionSpec, SlidingWindowSpec)
        full = {s for s in specs if type(s) is FullAttentionSpec}
        if checkpoint_alignment(kv_cache_config) is not None:
            # The core's check-points take no external tokens (admission.py refuses them there).
            raise UnsupportedVllmFeatureError(
                "a KV connector (kv_transfer_config) with Mamba prefill check-points "
                "(num_prefill_checkpoint_blocks)"
            )
        for i, spec in enumerate(specs):
            if type(spec) not in allowed or (with_mamba and len(full) != 1):
                raise UnsupportedVllmFeatureError(
                    f"a KV connector (kv_transfer_config) with KV-cache group {i} a "
                    f"{type(spec).__name__}: pagedkv's vLLM manager supports KV connectors on "
                    "full-attention and sliding-window groups, and on full attention of one "
                    "spec beside Mamba groups"
                )


@contextmanager
def _building(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """vLLM's scheduler module names pagedkv's manager while one scheduler is built."""
    _check_vllm_config(
        kwargs.get("vllm_config", args[0] if args else None),
        kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None),
    )
    with _CONSTRUCTION:
        saved = _scheduler_module.KVCacheManager
        _scheduler_module.KVCacheManager = KVCacheManager
        try:
            yield
        finally:
            _scheduler_module.KVCacheManager = saved


class PagedkvScheduler(Scheduler):
    """vLLM's ``Scheduler`` on pagedkv's ``KVCacheManager``; with async scheduling configured
    (``SchedulerConfig.async_scheduling``), an instance of ``PagedkvAsyncScheduler``, as vLLM
    picks ``AsyncScheduler`` when no scheduler class is set, so one setting serves both."""

    def __new__(cls, *args: Any, **kwargs: Any) -> PagedkvScheduler:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        scheduler_config = getattr(vllm_config, "scheduler_config", None)
        if cls is PagedkvScheduler and getattr(scheduler_config, "async_scheduling", False):
            cls = PagedkvAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _building(args, kwargs):
            super().__init__(*args, **kwargs)


class PagedkvAsyncScheduler(PagedkvScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling) on pagedkv's ``KVCacheManager``."""
