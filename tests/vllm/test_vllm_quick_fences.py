"""The quick fences (records.set_quick_fences: two lengths against two numbers of the record)
that ``allocate_slots`` and ``cache_blocks`` read first imply their general fast-path test:
whenever they let a step through, ``records.give_ids`` would give the core nothing and leave the
cached estimate as it is. The
scheduler flows never reach some of these records (the ids of a block filling while the
watermark stays in an earlier block), so the implication is checked here on records of every
shape, not only through the differentials. Runs in the vLLM stage (scripts/vllm/stage.sh);
skipped elsewhere.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.request")


class _Core:
    """Fails the test on any call: the quick fences let through only steps that make none."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"core call {name} on a step the quick fences let through")


def _manager(bs: int, full_attention_only: bool = True) -> Any:
    return SimpleNamespace(
        block_size=bs,
        full_attention_only=full_attention_only,
        enable_caching=True,
        max_model_len=1 << 20,
        _core=_Core(),
    )


def test_a_step_the_quick_fences_let_through_gives_the_core_nothing() -> None:
    from pagedkv.integrations.vllm import records

    rng = random.Random(7)
    let_through = 0
    for _ in range(20_000):
        bs = rng.choice((1, 2, 4, 16))
        m = _manager(bs)
        num_ids = rng.randrange(0, 12 * bs)
        num_hashes = rng.randrange(-1, num_ids // bs + 2)
        table = rng.randrange(0, 14)
        estimate = rng.randrange(0, max(num_hashes, 0) * bs + 2 * bs) // bs * bs
        watermark = rng.randrange(0, 12 * bs)
        state = [0, table, num_ids, num_hashes, estimate, watermark, watermark, -1, -1, -1]
        records.set_fence(m, state)
        num_tokens = num_ids + rng.randrange(0, 3 * bs)
        hashes = max(num_hashes, 0) + rng.randrange(0, 3)
        request = SimpleNamespace(_all_token_ids=[0] * num_tokens, block_hashes=[b"h"] * hashes)
        if not (num_tokens < state[8] and hashes <= state[9]):
            continue
        let_through += 1
        end = watermark + rng.randrange(1, 2 * bs)
        before = list(state)
        assert not records.give_ids(m, request, state, end, None, num_tokens)
        assert state == before, (bs, before, num_tokens, hashes, end)
        # cache_blocks' call (async scheduling): the scheduler's watermark, the record's, and
        # ids held back from any point.
        upto = rng.randrange(0, num_tokens + 1)
        assert not records.give_ids(m, request, state, upto, watermark, upto)
        assert state == before, (bs, before, num_tokens, hashes, upto)
    assert let_through > 2_000  # the check ran on many records


def test_no_quick_fences_where_the_general_test_decides() -> None:
    """A request without hashes, one whose hashes could raise the estimate, and any record
    with a window group: -1 (never let through)."""
    from pagedkv.integrations.vllm import records

    for state, full in (
        ([0, 4, 16, -1, 0, 8, 8, -1, 0, 0], True),  # no hashes given (skips the cache)
        ([0, 4, 16, 3, 8, 8, 8, -1, 0, 0], True),  # 3 blocks hashed, 2 estimated
        ([0, 4, 16, 2, 8, 8, 8, -1, 0, 0], False),  # a window group
    ):
        records.set_quick_fences(_manager(4, full), state)
        assert state[8] == state[9] == -1
