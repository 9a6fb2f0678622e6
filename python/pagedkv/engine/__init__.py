"""A continuous-batching LLM engine on the paged KV cache (needs the ``model`` extra).

``LLM(model=None).generate(prompts, SamplingParams(n=..., temperature=..., max_tokens=...))``
runs a GGUF llama model (SmolLM2-135M-Instruct by default) through ``KvCacheManager`` and the
``pagedkv.attention`` functions; docs/engine.md describes the scheduler and its checks.
"""

from __future__ import annotations

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.stats import EngineStats

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
]
