"""vLLM's HiSparse (a host tier of KV pages behind a GPU write-back cache, for sparse attention):
what of it pagedkv's vLLM manager refuses at construction, each piece by name.

HiSparse is not one option but a set of KV-cache groups that vLLM's manager builds other
per-group managers for, plus a coordinator (``vllm.v1.hisparse.coordinator``) that reaches into
them and into vLLM's block pool (docs/integrations/vllm.md, HiSparse: vLLM's contract and what
pagedkv needs). pagedkv's core has none of these behaviours, so every way a config asks for them
is refused here, before any group is mapped:

- ``KVCacheConfig.hisparse_host_num_blocks``: the private host pool of the source group;
- a group whose ``role`` is ``HISPARSE_SOURCE``: vLLM gives it a ``HiSparseSourceManager``
  (blocks counted against the host pool, never the device pool; hashes published only once the
  host copy is durable; frees routed through the coordinator), even without host blocks
  configured, where vLLM's manager fails its first allocation that needs the coordinator;
- ``HiSparseResidentSpec`` groups (GPU pages released to the pool while still read, dropped when
  the pool reuses them) and ``HiSparseHotSpec`` groups (a fixed region allocated on demand).

What vLLM's manager answers exactly as full attention stays accepted: a ``HISPARSE_INDEXER``
role (vLLM builds a ``FullAttentionManager`` for it) and ``host_resident`` on a group of the
default role (it places the group's tensors, which the manager never reads).
tests/vllm/test_vllm_hisparse.py runs both managers on each of these configs.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, KVCacheGroupRole

from pagedkv.errors import UnsupportedVllmFeatureError


def check_hisparse(kv_cache_config: Any) -> None:
    """Raises ``UnsupportedVllmFeatureError`` naming the first HiSparse piece the config asks
    for; returns for a config without one."""
    host_blocks = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    if host_blocks is not None:
        raise UnsupportedVllmFeatureError(
            f"HiSparse host blocks (hisparse_host_num_blocks={host_blocks}: a private host pool "
            "behind GPU-resident pages)"
        )
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, (HiSparseResidentSpec, HiSparseHotSpec)):
            raise UnsupportedVllmFeatureError(
                f"KV-cache group {i}: HiSparse {type(spec).__name__} (GPU pages a host tier "
                "backs, released while still read)"
            )
        if getattr(group, "role", None) == KVCacheGroupRole.HISPARSE_SOURCE:
            raise UnsupportedVllmFeatureError(
                f"KV-cache group {i}: the HiSparse source role (vLLM's HiSparseSourceManager: "
                "host-pool blocks, hashes published once durable)"
            )
