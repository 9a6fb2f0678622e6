"""The blocks ``get_computed_blocks`` answers on pagedkv's vLLM manager (hit_blocks.py) are
vLLM's: the same blocks, position for position and group for group, as vLLM's manager answers
for the same cached contents (up to the block numbering: each is the block the earlier request
holds at that position, or the null block), looked up only when read, and taken by the
admission. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_test_inputs import BS, both_managers, kv_cache_config, mamba_config, manager, request

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

# (config, chunks of the first request in blocks: a Mamba group caches a state where a chunk ends)
LAYOUTS = {
    "full": (lambda: kv_cache_config("full", num_blocks=64), (6,)),
    "full+full": (lambda: kv_cache_config("full", "full", num_blocks=64), (6,)),
    "full+window": (lambda: kv_cache_config("full", "swa", num_blocks=64, window=2 * BS + 1), (6,)),
    "full+mamba": (lambda: mamba_config(64, block_size=BS), (2, 2, 2)),
    "full+mamba+window": (lambda: mamba_config(64, 2 * BS + 1, block_size=BS), (2, 2, 2)),
}


def _computed(m: Any, first: Any, chunks: tuple[int, ...]) -> None:
    """``first``'s prompt computed chunk by chunk (its last token in a chunk of its own)."""
    from vllm.v1.request import RequestStatus

    for blocks in chunks:
        assert m.allocate_slots(first, blocks * BS) is not None
        first.status = RequestStatus.RUNNING
        first.num_computed_tokens += blocks * BS
        m.new_step_starts()
    assert m.allocate_slots(first, 1) is not None
    first.num_computed_tokens += 1
    m.new_step_starts()


def _positions(m: Any, holder: str, blocks: Any) -> list[list[int | None]]:
    """Each hit block as the position the holder's table has it at (None: the null block)."""
    tables = m.get_block_ids(holder)
    out = []
    for g, row in enumerate(blocks.blocks):
        where = {b: i for i, b in enumerate(tables[g]) if b}
        out.append([None if b.block_id == 0 else where[b.block_id] for b in row])
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_hits_blocks_are_vllms(layout: str) -> None:
    make, chunks = LAYOUTS[layout]
    seen = {}
    for kind, m in both_managers(make(), enable_caching=True).items():
        first = request("first", sum(chunks) * BS + 1)
        _computed(m, first, chunks)
        second = request("second", sum(chunks) * BS + 1)  # the same tokens
        blocks, hit, _ = m.get_computed_blocks(second)
        assert hit >= 2 * BS, (kind, hit)
        seen[kind] = (hit, _positions(m, "first", blocks), blocks.get_block_ids())
        # what the admission takes is what was answered
        new = m.allocate_slots(second, second.num_tokens - hit, hit, blocks)
        assert new is not None
        held = m.get_block_ids("second")
        assert [ids[: hit // BS] for ids in held] == list(seen[kind][2]), kind
    assert seen["vllm"][:2] == seen["pagedkv"][:2]


def test_the_blocks_are_looked_up_when_first_read() -> None:
    from pagedkv.integrations.vllm.hit_blocks import HitBlocks
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    m = manager("pagedkv", kv_cache_config("full", "full", num_blocks=64), enable_caching=True)
    first = request("first", 6 * BS + 1)
    _computed(m, first, (6,))
    answer, hit, _ = m.get_computed_blocks(request("second", 6 * BS + 1))
    assert hit == 6 * BS and isinstance(answer, HitBlocks) and isinstance(answer, KVCacheBlocks)
    assert "_rows" not in answer.__dict__  # nothing looked up yet
    expected = [ids[:6] for ids in m.get_block_ids("first")]
    rows = answer.blocks
    assert "_rows" in answer.__dict__ and answer.blocks is rows  # once
    assert [[b.block_id for b in row] for row in rows] == expected
    assert answer.get_block_ids() == tuple(expected)
    same = KVCacheBlocks(tuple([m._blocks[i] for i in ids] for ids in expected))
    assert answer == same and same == answer and repr(answer) == repr(same)
    # a replacement's rows are the rows given (dataclasses.replace, the dataclass's __init__)
    import dataclasses

    assert dataclasses.replace(answer, blocks=((), ())).blocks == ((), ())
