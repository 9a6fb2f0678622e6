"""vLLM 0.33's scheduler on pagedkv (docs/integrations/vllm.md).

``KVCacheManager`` is constructor- and call-compatible with
``vllm.v1.core.kv_cache_manager.KVCacheManager`` on the scheduler's paths;
``PagedkvScheduler`` is vLLM's ``Scheduler`` building it, for vLLM's ``scheduler_cls`` setting::

    SchedulerConfig(..., scheduler_cls="pagedkv.integrations.vllm.PagedkvScheduler")

Importing this package imports vLLM (the optional extra ``pagedkv[vllm]``).
"""

from pagedkv.integrations.vllm.manager import KVCacheManager, UnsupportedVllmFeatureError
from pagedkv.integrations.vllm.scheduler import PagedkvAsyncScheduler, PagedkvScheduler

SUPPORTED_VLLM_VERSION = "0.33.0"

__all__ = [
    "SUPPORTED_VLLM_VERSION",
    "KVCacheManager",
    "PagedkvAsyncScheduler",
    "PagedkvScheduler",
    "UnsupportedVllmFeatureError",
]
