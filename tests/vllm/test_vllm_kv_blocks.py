"""The ``KVCacheBlocks`` pagedkv's vLLM manager returns (kv_blocks.py) answer what vLLM's own
class answers: ``get_block_ids`` for every argument the scheduler and connectors pass, equality
both ways, ``repr``; and the manager's answers are of that class (the shared empty one on a
decode step inside one block). Runs in the vLLM stage (scripts/vllm/stage.sh); skipped
elsewhere.
"""

from __future__ import annotations

import itertools
from typing import Any

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")


def _groups() -> list[tuple[Any, ...]]:
    """Block tuples of one to three groups, empty and not, the null block included."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(6)]
    blocks[0].is_null = True
    shapes: list[tuple[Any, ...]] = [
        ((),),
        ([],),
        (blocks[1:4],),
        (blocks[0:1],),
        ((), ()),
        (blocks[1:3], []),
        ([], blocks[2:5]),
        (blocks[0:2], blocks[3:6], ()),
        ((), (), ()),
    ]
    return shapes


def test_get_block_ids_answers_as_vllms() -> None:
    from pagedkv.integrations.vllm.kv_blocks import PagedkvKVCacheBlocks, empty_blocks
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    pairs = [(PagedkvKVCacheBlocks(groups), KVCacheBlocks(groups)) for groups in _groups()]
    # the manager's shared empty answer, whose class answers the scheduler's read unlooked
    pairs += [(empty_blocks(n), KVCacheBlocks(((),) * n)) for n in (1, 2, 3)]
    for ours, theirs in pairs:
        groups = theirs.blocks
        selections: list[Any] = [None, []]
        selections += [
            list(c) for n in range(1, len(groups) + 1) for c in itertools.combinations(range(len(groups)), n)
        ]
        for allow_none, group_ids in itertools.product((False, True), selections):
            want = theirs.get_block_ids(allow_none, group_ids=group_ids)
            got = ours.get_block_ids(allow_none, group_ids=group_ids)
            assert got == want, (groups, allow_none, group_ids)
            assert type(got) is type(want)
            if got is not None:
                assert all(type(g) is list for g in got)
        # fresh lists every call, as vLLM's (a caller may keep and change them)
        first = ours.get_block_ids()
        for ids in first:
            ids.append(-1)
        assert ours.get_block_ids() == theirs.get_block_ids()


def test_equal_to_vllms_class_both_ways_and_same_repr() -> None:
    from pagedkv.integrations.vllm.kv_blocks import PagedkvKVCacheBlocks, empty_blocks
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    for groups in _groups():
        ours, theirs = PagedkvKVCacheBlocks(groups), KVCacheBlocks(groups)
        assert isinstance(ours, KVCacheBlocks)
        assert ours == theirs and theirs == ours and not (ours != theirs)
        assert repr(ours) == repr(theirs)
    assert empty_blocks(2) == KVCacheBlocks(((), ())) != KVCacheBlocks(((),))
    assert PagedkvKVCacheBlocks(((),)) != "((),)"


def test_the_managers_answers_are_of_the_class() -> None:
    """The shared empty answer, a decode step's, and an admission's blocks: pagedkv's class,
    whose ids the scheduler reads are vLLM's manager's."""
    import torch
    from pagedkv.integrations.vllm import KVCacheManager
    from pagedkv.integrations.vllm.kv_blocks import PagedkvKVCacheBlocks
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    answers: dict[str, list[Any]] = {}
    for kind, cls in (("vllm", VllmKVCacheManager), ("pagedkv", KVCacheManager)):
        m = cls(config, max_model_len=64, scheduler_block_size=4, hash_block_size=4)
        hasher = get_request_block_hasher(4, sha256, 0)
        r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit = m.get_computed_blocks(r)[:2]
        got = [m.allocate_slots(r, r.num_tokens - hit, hit, blocks)]
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
        got.append(m.allocate_slots(r, 1))  # 6 + 1: inside block 1
        r.num_computed_tokens += 1
        r.append_output_token_ids(8)
        got.append(m.allocate_slots(r, 1))  # 7 + 1: fills block 1
        r.num_computed_tokens += 1
        r.append_output_token_ids(9)
        got.append(m.allocate_slots(r, 1))  # 8 + 1: block 2
        got.append(m.get_blocks("r"))
        if kind == "pagedkv":
            assert all(isinstance(b, PagedkvKVCacheBlocks) for b in got)
            assert got[1] is m.empty_kv_cache_blocks
        answers[kind] = [(b.get_block_ids(), b.get_block_ids(allow_none=True)) for b in got]
    assert answers["pagedkv"] == answers["vllm"]
