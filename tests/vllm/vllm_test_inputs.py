"""vLLM ``KVCacheConfig``s and ``Request``s shared by the tests of this folder (imported by name:
conftest.py puts the folder on ``sys.path``). vLLM is imported inside, as in the tests: the
folder's conftest.py skips a test whose module cannot import it.

Layer names: group ``i`` of kind ``k`` holds the one layer ``f"{k}{i}"``. Neither manager reads
layer names (vLLM's manager, coordinator and block pool see a group's spec only; pagedkv's
integration reads ``kv_cache_spec`` and ``num_blocks``), so configs that differ in names alone
answer alike.
"""

from __future__ import annotations

from typing import Any

BS = 16

# The two managers the tests compare: vLLM's own and pagedkv's drop-in.
KINDS = ("vllm", "pagedkv")


def manager(kind: str, config: Any, **args: Any) -> Any:
    """vLLM's ``KVCacheManager`` (``kind`` "vllm") or pagedkv's ("pagedkv") on ``config``: a
    1,024-token model and blocks of ``BS`` tokens for the scheduler and the hasher unless
    ``args`` say otherwise (``args`` are the managers' keyword arguments)."""
    from pagedkv.integrations.vllm import KVCacheManager
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    if kind not in KINDS:
        raise ValueError(f"unknown manager kind {kind!r}")
    options: dict[str, Any] = dict(max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS)
    options.update(args)
    return (VllmKVCacheManager if kind == "vllm" else KVCacheManager)(config, **options)


def both_managers(config: Any, **args: Any) -> dict[str, Any]:
    """``manager`` of each kind on one ``config``, by kind."""
    return {kind: manager(kind, config, **args) for kind in KINDS}


def kv_cache_config(
    *kinds: str, num_blocks: int = 32, window: int = 32, retention: Any = None, block_size: int = BS
) -> Any:
    """One group per kind (``"full"``: full attention; else a sliding window of ``window``
    tokens), blocks of ``block_size`` tokens, a one-head float32 shape (no tensors), and vLLM's
    ``prefix_cache_retention_interval`` ``retention``."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(
            [f"{kind}{i}"],
            FullAttentionSpec(**shape)
            if kind == "full"
            else SlidingWindowSpec(**shape, sliding_window=window),
        )
        for i, kind in enumerate(kinds)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


def request(rid: str, num_tokens: int, first: int = 0, max_tokens: int = 4, ignore_eos: bool = False) -> Any:
    """A request of the tokens ``first, first + 1, ...`` (``num_tokens`` of them) with vLLM's
    sha256 block hashes of ``BS``-token blocks. ``max_tokens`` and ``ignore_eos`` are its
    sampling parameters: the scheduler reads them, neither manager does."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    tokens = list(range(first, first + num_tokens))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(rid, tokens, params, None, block_hasher=get_request_block_hasher(BS, sha256))


def prompt_request(rid: str, prompt: list[int], hasher: Any) -> Any:
    """A request of the token ids ``prompt`` whose block hashes ``hasher`` (vLLM's
    ``get_request_block_hasher``) computes, sampling at most 8 tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)


def admit_alike(managers: dict[str, Any], rid: str, prompt: list[int], hasher: Any) -> dict[str, Any]:
    """Admits ``prompt`` whole as request ``rid`` on each of ``managers`` (vLLM's and pagedkv's,
    by name): its prefix hit, then slots for the rest, which must fit; the request is then running
    with every token computed. Both managers must find the same hit. Returns each manager's
    request."""
    from vllm.v1.request import RequestStatus

    requests, hits = {}, {}
    for kind, m in managers.items():
        r = prompt_request(rid, prompt, hasher)
        blocks, hit = m.get_computed_blocks(r)[:2]
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True) is not None
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        requests[kind] = r
        hits[kind] = hit
    assert len(set(hits.values())) == 1, hits
    return requests


def mamba_workload(num_blocks: int = 140, **overrides: object) -> dict[str, object]:
    """A scheduler-differential workload (benches/vllm_scheduler.py's ``Workload`` overrides): full
    attention beside an align-mode Mamba group, 24 requests on `num_blocks` blocks, prefill
    chunks of at most 128 tokens."""
    return dict(
        requests=24,
        num_blocks=num_blocks,
        max_num_batched_tokens=128,
        groups=("full", "mamba"),
        **overrides,
    )


def window_mamba_workload(
    num_blocks: int, groups: tuple[str, ...] = ("full", "swa", "mamba"), **overrides: object
) -> dict[str, object]:
    """`mamba_workload` with a sliding-window group of 48 tokens among `groups`."""
    return {**mamba_workload(num_blocks, window=48, **overrides), "groups": groups}


def window_config(window: int, **overrides: object) -> dict[str, object]:
    """A scheduler-differential workload (benches/vllm_scheduler.py's ``Workload`` overrides): full
    attention beside a sliding-window group of `window` tokens, 24 requests on 50 blocks."""
    return dict(
        requests=24,
        num_blocks=50,
        groups=("full", "swa"),
        window=window,
        max_num_batched_tokens=128,
        **overrides,
    )


def mamba_config(
    num_blocks: int = 32, window: int | None = None, block_size: int = BS, **mamba_options: Any
) -> Any:
    """Full attention + an align-mode Mamba group (+ a window group), blocks of ``block_size`` tokens
    (the layer names are read by neither manager)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    options: dict[str, Any] = {"mamba_cache_mode": "align", **mamba_options}
    groups = [
        KVCacheGroupSpec(
            ["fa"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        ),
        KVCacheGroupSpec(
            ["m"], MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), **options)
        ),
    ]
    if window is not None:
        spec = SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window
        )
        groups.append(KVCacheGroupSpec(["w"], spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
