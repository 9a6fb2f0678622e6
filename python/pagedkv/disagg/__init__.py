"""Disaggregated serving: a prefill engine that hands a request's K/V out over NIXL and a decode
engine that reads it in before generating (``pagedkv.transfer`` moves the blocks), the two
worker processes and ``pagedkv disagg`` (docs/transfer.md, The engine).

``LLM(kv_role="prefill" | "decode", kv_peer=...)`` and ``EngineConfig`` carry the role; the
engines live here so that the single-instance engine (``pagedkv.engine``) stays as it is.
Needs the ``transfer`` extra (NIXL, xxhash).
"""

from pagedkv.disagg.decode_engine import DecodeEngine
from pagedkv.disagg.prefill_engine import PrefillEngine, make_engine

__all__ = ["DecodeEngine", "PrefillEngine", "make_engine"]
