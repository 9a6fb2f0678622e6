"""The state group kind through the bindings (docs/design.md, KV groups, "State groups"):
``pagedkv.MambaState()`` as a spec value, its tables (one block per allocation at the chunk's
last position, -1 elsewhere), ``group_hits`` and ``new_step``, and what a manager with one
refuses. The rule itself is checked step by step in rust/pagedkv/tests/state_group.rs and the
model test; vLLM's tables in tests/vllm/test_vllm_mamba.py."""

import copy
import pickle

import numpy as np
import pagedkv
import pytest
from pagedkv import FullAttention, InvalidArgumentError, KvCacheManager, MambaState, OutOfBlocksError

BS = 4


def manager(num_blocks: int = 32) -> KvCacheManager:
    return KvCacheManager(
        num_blocks, BS, enable_prefix_caching=True, kv_groups=[FullAttention(), MambaState()]
    )


def live(kv: KvCacheManager, seq_id: int) -> list[int]:
    return [i for i, b in enumerate(kv.block_table(seq_id, group=1)) if b != -1]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_spec_is_a_small_frozen_value(protocol: int) -> None:
    assert repr(MambaState()) == "MambaState()" and MambaState() == MambaState()
    assert MambaState() != FullAttention() and FullAttention() != MambaState()
    assert len({MambaState(), MambaState(), FullAttention()}) == 2
    assert eval(repr(MambaState()), vars(pagedkv)) == MambaState()
    assert pagedkv.MambaState is MambaState and "MambaState" in pagedkv.__all__
    groups = [FullAttention(), MambaState()]
    assert pickle.loads(pickle.dumps(groups, protocol)) == groups == copy.deepcopy(groups)
    assert manager().kv_groups == groups


def test_one_block_per_allocation_at_the_chunks_last_position() -> None:
    kv = manager()
    prompt = list(range(1, 18))  # 17 tokens
    assert kv.add_sequence(1, prompt, num_scheduled=8, reserve_prompt=False) == 0
    assert live(kv, 1) == [1]
    assert kv.allocate_slots(1, 9)  # to 17: positions 2..4, the state block at 4 only
    table = kv.block_table(1, group=1)
    assert table.tolist()[2:] == [-1, -1, table[4]] and table[4] != -1
    assert live(kv, 1) == [1, 4]  # 1 stays until the watermark passes it by a token
    assert kv.allocate_slots(1, 1)
    assert live(kv, 1) == [4]
    assert len(kv.block_table(1, group=0)) == 5
    assert kv.num_blocks - kv.num_available_blocks == 5 + 1
    kv.check_invariants()


def test_group_hits_new_step_and_the_same_step_refusal() -> None:
    kv = manager()
    prompt = list(range(1, 10))
    kv.new_step()
    kv.add_sequence(1, prompt[:8], num_scheduled=8, reserve_prompt=False)
    hashes = kv.prefix_block_hashes(prompt)
    assert kv.group_hits(hashes, 8) == [8, 8] and kv.group_hits(hashes, 7) == [4, 0]
    assert kv.group_hits([], 8) == [0, 0]
    before = kv.num_available_blocks
    with pytest.raises(OutOfBlocksError):  # its state's pass has not run in this step
        kv.add_sequence(2, prompt, num_scheduled=1, reserve_prompt=False)
    assert kv.num_available_blocks == before and 2 not in kv
    kv.new_step()
    assert kv.add_sequence(2, prompt, num_scheduled=1, reserve_prompt=False) == 8
    assert kv.block_table(2, group=1)[0] == -1
    assert kv.block_table(2, group=1)[1] == kv.block_table(1, group=1)[1]
    kv.check_invariants()


def test_hostile_arguments_are_typed_errors_changing_nothing() -> None:
    kv = manager()
    kv.add_sequence(1, list(range(1, 11)), num_scheduled=10, reserve_prompt=False)
    tables = [kv.block_table(1, group=g).copy() for g in (0, 1)]
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(1, 1, num_lookahead_tokens=1)
    with pytest.raises(InvalidArgumentError):
        kv.allocate_slots(1, 1, num_computed_tokens=9)
    with pytest.raises(InvalidArgumentError):
        kv.truncate(1, 8)
    with pytest.raises(InvalidArgumentError):
        kv.add_sequence(2, [1, 2, 3], num_lookahead_tokens=2, reserve_prompt=False)
    for g, t in enumerate(tables):
        np.testing.assert_array_equal(kv.block_table(1, group=g), t)
    with pytest.raises((TypeError, InvalidArgumentError)):
        kv.group_hits([b"x" * 32, "x"], 8)  # type: ignore[list-item]
    with pytest.raises(OverflowError):
        kv.group_hits([], -1)
    # A bad hash past the bound is never read.
    assert kv.group_hits([b"x" * 32, "x"], 4) == [0, 0]  # type: ignore[list-item]
    kv.check_invariants()


def test_the_diverged_hit_through_the_binding() -> None:
    """``add_sequence(..., diverged_hit=True)``: full attention's own run is the hit where the
    state group's own hit lags it (here no state block was cached at all: one chunk ending
    mid-block), the state row null over it; outside its configs ``InvalidArgumentError``,
    nothing changed (rust/pagedkv/src/manager/state_diverged.rs)."""
    kv = manager()
    prompt = list(range(1, 11))
    kv.new_step()
    kv.add_sequence(1, prompt, num_scheduled=10, reserve_prompt=False)  # states at 10: none full
    kv.free(1)
    kv.new_step()
    replay = prompt[:8] + [50, 51, 52, 53, 54]
    assert kv.match_prefix(replay) == 0  # the reconciled hit: no state block
    before = kv.num_available_blocks
    for bad in (
        dict(num_external_computed_tokens=0),  # no connector's tokens
        dict(num_external_computed_tokens=2, reserve_prompt=True),
    ):
        options = dict(num_scheduled=5, reserve_prompt=False, diverged_hit=True) | bad
        with pytest.raises(InvalidArgumentError):
            kv.add_sequence(2, replay, **options)  # type: ignore[arg-type]
        assert kv.num_available_blocks == before and 2 not in kv
    hit = kv.add_sequence(
        2, replay, num_scheduled=5, reserve_prompt=False, num_external_computed_tokens=2, diverged_hit=True
    )
    assert hit == 8
    assert live(kv, 2) == [2, 3]  # nulls to (8 + 2 - 1) // 4, a block there and at the chunk's end
    kv.check_invariants()
    alone = KvCacheManager(16, BS, enable_prefix_caching=True)
    with pytest.raises(InvalidArgumentError):
        alone.add_sequence(
            1,
            replay,
            num_scheduled=5,
            reserve_prompt=False,
            num_external_computed_tokens=2,
            diverged_hit=True,
        )
    assert alone.num_available_blocks == 16
