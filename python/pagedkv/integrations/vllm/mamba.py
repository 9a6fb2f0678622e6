"""Mamba groups in align mode on the plain path (docs/integrations/vllm.md, Mamba): what a
manager with a ``MambaSpec`` group refuses besides the group options support.py checks. The
group itself is the core's ``pagedkv.MambaState`` (one block per allocation at the chunk's last
position, the 2-token window's release, hits at the rightmost cached state block, same-step
refusals after ``new_step``); the manager's calls map to the core's as for attention groups."""

from __future__ import annotations

from pagedkv.errors import UnsupportedVllmFeatureError


def check_options(enable_caching: bool, drafting: bool) -> None:
    """Refuses, by name, the options the plain Mamba path does not answer as vLLM does."""
    if not enable_caching:
        raise UnsupportedVllmFeatureError("a Mamba group without prefix caching (mamba_cache_mode='none')")
    if drafting:
        raise UnsupportedVllmFeatureError("a Mamba group with speculative decoding (lookahead tokens)")


def refuse_external() -> None:
    """An async KV load (``delay_cache_blocks``) or reserved blocks on a Mamba group: not
    checked against vLLM yet. A synchronous load's tokens are answered (the core's state-group
    admission with external tokens; hybrid_hits.py, docs/integrations/vllm.md, Mamba)."""
    raise UnsupportedVllmFeatureError(
        "a KV connector's async load (delay_cache_blocks) or reserved blocks with a Mamba group"
    )


def refuse_external_events() -> None:
    """A KV connector's tokens with KV events on a Mamba group: the state group's store range
    after such an admission (events.py) is not checked against vLLM yet."""
    raise UnsupportedVllmFeatureError("a KV connector's tokens with KV events on a Mamba group")
