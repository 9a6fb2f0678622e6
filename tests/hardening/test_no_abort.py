"""Regression tests for inputs that used to abort the process or corrupt a cache (docs/security.md).

Every case runs in a child interpreter (``hardening_isolated``): before the fixes, several of
them died with SIGABRT (a failed multi-terabyte allocation) or SIGSEGV, which would have killed
pytest itself. Each case must end in the named outcome, and the manager must be unchanged.
"""

from __future__ import annotations

import numpy as np
import pagedkv
import pytest
from hardening_isolated import run_cases
from pagedkv.attention import copy_blocks, paged_attention, swap_blocks, write_kv

MANAGER_SETUP = """
import numpy as np
import pagedkv
from pagedkv import _core
kv = pagedkv.KvCacheManager(
    num_blocks=1 << 20, block_size=16, enable_prefix_caching=True, enable_kv_events=True
)
kv.add_sequence(0, [1, 2, 3])
kv.add_sequence(1, num_tokens=5)
huge = np.broadcast_to(np.int64(1), (1 << 40,))
huge_u8 = np.broadcast_to(np.uint8(1), (1 << 40,))
huge_f = np.broadcast_to(np.float64(1), (1 << 40,))
one_i, one_f = np.array([1]), np.array([0.0])
"""

# case -> expected outcome (exception class name, or OK).
MANAGER_CASES = {
    # Item 1: lengths the pool can never hold are refused before any allocation.
    "append_tokens(huge)": ("kv.append_tokens(0, huge)", "InvalidArgumentError"),
    "append_tokens(huge uint8)": ("kv.append_tokens(0, huge_u8)", "InvalidArgumentError"),
    "add_sequence(huge)": ("kv.add_sequence(9, huge)", "InvalidArgumentError"),
    "append_tokens_batch(ids=huge)": ("kv.append_tokens_batch(huge)", "InvalidArgumentError"),
    "append_tokens_batch(tokens=huge)": ("kv.append_tokens_batch([0, 1], huge)", "InvalidArgumentError"),
    "free_batch(huge)": ("kv.free_batch(huge)", "InvalidArgumentError"),
    "batch_block_tables(huge)": ("kv.batch_block_tables(huge)", "InvalidArgumentError"),
    "slot_mapping(huge)": ("kv.slot_mapping(huge, 1)", "InvalidArgumentError"),
    "swap_out(huge)": ("kv.swap_out(huge)", "InvalidArgumentError"),
    "swap_in(huge)": ("kv.swap_in(huge)", "InvalidArgumentError"),
    # The per-chunk calls (docs/design.md, Per-chunk allocation): lengths and counts no pool
    # holds are refused before anything is read or allocated.
    "provide_token_ids(huge)": ("kv.provide_token_ids(0, huge)", "InvalidArgumentError"),
    "allocate_slots(2**63)": ("kv.allocate_slots(0, 1 << 63)", "InvalidArgumentError"),
    "allocate_slots(lookahead 2**63)": (
        "kv.allocate_slots(0, 1, num_lookahead_tokens=1 << 63)",
        "InvalidArgumentError",
    ),
    "add_sequence(block_hashes=huge)": (
        "kv.add_sequence(9, [1, 2], block_hashes=huge)",
        "InvalidArgumentError",
    ),
    "add_sequence(block_extra_keys=huge)": (
        "kv.add_sequence(9, [1, 2], block_extra_keys=huge_u8)",
        "InvalidArgumentError",
    ),
    "add_sequence(reserve_prompt=False, huge)": (
        "kv.add_sequence(9, huge, reserve_prompt=False)",
        "InvalidArgumentError",
    ),
    # Without the whole-prompt check a prompt is bounded by max_model_len, not by the pool: a
    # bound past the machine's memory is a MemoryError before the buffer is asked for.
    "add_sequence(require_full_prompt=False, huge)": (
        "pagedkv.KvCacheManager(8, 4, max_model_len=1 << 40).add_sequence("
        "9, huge, reserve_prompt=False, require_full_prompt=False)",
        "MemoryError",
    ),
    # Item 2: huge results; a batch names each sequence once.
    "batch_block_tables(dup x1024)": ("kv.batch_block_tables([0] * 1024)", "InvalidArgumentError"),
    "slot_mapping(dup x1024)": ("kv.slot_mapping([0] * 1024, 1 << 24)", "InvalidArgumentError"),
    "slot_mapping(dup small n)": ("kv.slot_mapping([0, 0], 1)", "InvalidArgumentError"),
    # The simulator's columns: a failed allocation is a MemoryError, not an abort.
    "simulate(huge column)": (
        "_core.simulate(huge, one_i, one_f, None, 'none', None, None, {})",
        "MemoryError",
    ),
    "simulate(huge float column)": (
        "_core.simulate(one_i, one_i, huge_f, None, 'none', None, None, {})",
        "MemoryError",
    ),
    # Item 6: untyped errors.
    "simulate(config=[])": (
        "_core.simulate(one_i, one_i, one_f, None, 'none', None, None, [])",
        "InvalidArgumentError",
    ),
    "simulate(group_kind=1)": (
        "_core.simulate(one_i, one_i, one_f, None, 1, None, None, {})",
        "InvalidArgumentError",
    ),
    "record_frames(max_steps=2**64)": (
        "_core.record_frames(one_i, one_i, one_f, None, 'none', None, None, {}, 2**64)",
        "InvalidArgumentError",
    ),
    "check_invariants": ("kv.check_invariants()", "OK"),
}


def test_attacker_inputs_end_in_typed_errors() -> None:
    outcomes = run_cases(MANAGER_SETUP, {name: expr for name, (expr, _) in MANAGER_CASES.items()})
    wrong = {
        name: (outcomes.get(name), expected)
        for name, (_, expected) in MANAGER_CASES.items()
        if outcomes.get(name) != expected
    }
    assert not wrong, f"case: (got, expected): {wrong}"


def test_failed_huge_calls_change_nothing() -> None:
    kv = pagedkv.KvCacheManager(
        num_blocks=64, block_size=4, enable_prefix_caching=True, enable_kv_events=True
    )
    kv.add_sequence(0, [1, 2, 3, 4, 5])
    kv.add_sequence(1, num_tokens=3)
    before = (kv.stats(), kv.block_table(0).tolist(), kv.block_table(1).tolist(), kv.num_tokens(0))
    huge = np.broadcast_to(np.int64(1), (1 << 40,))
    for call in (
        lambda: kv.append_tokens(0, huge),
        lambda: kv.free_batch(huge),
        lambda: kv.append_tokens_batch([0, 1], huge),
        lambda: kv.batch_block_tables([0, 0]),
        lambda: kv.slot_mapping([1, 1], 1),
        lambda: kv.append_tokens(0, list(range(64 * 4 + 1))),  # one token more than the pool
    ):
        with pytest.raises(pagedkv.InvalidArgumentError):
            call()
    after = (kv.stats(), kv.block_table(0).tolist(), kv.block_table(1).tolist(), kv.num_tokens(0))
    assert after == before
    kv.check_invariants()
    # Exactly the pool's capacity is still accepted as a length (and then fails for blocks).
    with pytest.raises(pagedkv.OutOfBlocksError):
        kv.add_sequence(5, list(range(64 * 4)))


def test_long_batches_within_the_live_sequences_are_read() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    ids = np.arange(70_000, dtype=np.int64)  # longer than the always-read threshold
    with pytest.raises(pagedkv.InvalidArgumentError, match="more ids than live sequences"):
        kv.free_batch(ids)
    # Short batches still name the exact unknown id.
    with pytest.raises(pagedkv.UnknownSequenceError):
        kv.free_batch(np.array([3, 4]))


class _Raises:
    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    def __index__(self) -> int:
        raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError])
def test_base_exceptions_from_index_propagate(exc: type[BaseException]) -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(0, [1, 2])
    bad = _Raises(exc)
    for call in (
        lambda: kv.free(bad),
        lambda: kv.append_tokens(0, num_tokens=bad),
        lambda: kv.append_tokens(0, [bad] * 9),  # the heap path
        lambda: kv.append_tokens(0, (bad,)),  # the inline path
        lambda: kv.free_batch((bad,)),
        lambda: kv.refcount(bad),
        lambda: bad in kv,
    ):
        with pytest.raises(exc):
            call()
    assert kv.num_tokens(0) == 2
    kv.check_invariants()


def test_ordinary_index_errors_stay_invalid_argument() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.free(_Raises(ValueError))
    assert (_Raises(ValueError) in kv) is False


def test_token_id_errors_state_the_token_range() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    for bad in ([-1], [2**32], [2**70], np.array([-1]), np.array([2**32], dtype=np.uint64)):
        with pytest.raises(pagedkv.InvalidArgumentError, match=r"\[0, 2\*\*32\)"):
            kv.add_sequence(1, bad)


@pytest.mark.parametrize("dtype", [">i8", ">u4", ">i2", "<i8", ">u8"])
def test_either_byte_order_is_accepted(dtype: str) -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, enable_kv_events=True)
    kv.add_sequence(3, np.array([5, 6, 7, 8, 9], dtype=dtype))
    kv.append_tokens(3, np.array([10], dtype=dtype))
    tables, lens = kv.batch_block_tables(np.array([3], dtype=dtype))
    assert lens.tolist() == [6]
    kv.free_batch(np.array([3], dtype=dtype)[::-1])  # non-contiguous view of a swapped array
    kv.check_invariants()


def test_masked_id_and_token_arrays_are_refused() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence(0, [1, 2])
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        kv.append_tokens(0, np.ma.array([1, 2], mask=[False, True]))
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        kv.free_batch(np.ma.array([0], mask=[True]))
    assert kv.num_tokens(0) == 2


def test_numpy_integer_extra_keys_name_the_int_namespace() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True, enable_kv_events=True)
    kv.add_sequence(0, [1, 2, 3], extra_key=5)
    assert kv.add_sequence(1, [1, 2, 3], extra_key=np.int64(5)) == 2
    assert kv.add_sequence(2, [1, 2, 3], extra_key=np.uint8(5)) == 2
    assert kv.add_sequence(3, [1, 2, 3], extra_key=np.int64(6)) == 0
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.add_sequence(4, [1, 2, 3], extra_key=np.bool_(True))
    with pytest.raises(pagedkv.InvalidArgumentError):
        kv.add_sequence(4, [1, 2, 3], extra_key=np.float64(5))


# --- item 3: the data plane --------------------------------------------------------------------


def _caches(num_blocks: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (num_blocks, 2, 1, 4)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_masked_copy_pair_never_touches_the_cache() -> None:
    k, v = _caches()
    k0, v0 = k.copy(), v.copy()
    ops = np.ma.array(np.array([[0, 1]], dtype=np.int32), mask=[[False, True]])
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        copy_blocks([k], [v], ops)
    assert np.array_equal(k, k0) and np.array_equal(v, v0)


def test_masked_swap_mapping_is_refused_not_a_silent_no_op() -> None:
    src, _ = _caches()
    dst = np.zeros_like(src)
    mapping = np.ma.array(np.array([[0, 1]], dtype=np.int32), mask=[[True, False]])
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        swap_blocks(src, dst, mapping)
    assert not dst.any()


@pytest.mark.parametrize("field", ["seq_lens", "block_tables", "q", "k_cache"])
def test_masked_attention_inputs_are_refused(field: str) -> None:
    k, v = _caches()
    args = {
        "q": np.ones((1, 1, 4), dtype=np.float32),
        "k_cache": k,
        "v_cache": v,
        "block_tables": np.array([[0, 1]], dtype=np.int32),
        "seq_lens": np.array([3], dtype=np.int32),
    }
    args[field] = np.ma.array(args[field], mask=np.ones(args[field].shape, dtype=bool))
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        paged_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"], args["seq_lens"])


def test_masked_slot_mapping_is_refused() -> None:
    k_cache, v_cache = _caches()
    k = np.ones((1, 1, 4), dtype=np.float32)
    slots = np.ma.array(np.array([10**9], dtype=np.int64), mask=[True])
    with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
        write_kv(k, k, k_cache, v_cache, slots)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_matrix_and_other_subclasses_are_read_as_plain_arrays() -> None:
    k, v = _caches()
    expected = paged_attention(
        np.ones((1, 1, 4), dtype=np.float32),
        k,
        v,
        np.array([[0, 1]], dtype=np.int32),
        np.array([3], np.int32),
    )
    table = np.matrix([[0, 1]], dtype=np.int32)
    got = paged_attention(np.ones((1, 1, 4), dtype=np.float32), k, v, table, np.array([3], np.int32))
    assert np.array_equal(got, expected)
    # copy_blocks through an np.matrix pair and a memmap-like subclass cache writes in place.

    class Tagged(np.ndarray):
        pass

    k2, v2 = _caches()
    kt, vt = k2.view(Tagged), v2.view(Tagged)
    copy_blocks([kt], [vt], np.matrix([[0, 3]], dtype=np.int32))
    assert np.array_equal(k2[3], k2[0]) and np.array_equal(v2[3], v2[0])


@pytest.mark.parametrize("bad", [0, -1, True, np.bool_(True), 1.0, "2", np.int64(0)], ids=repr)
def test_num_splits_is_checked_on_every_backend(bad: object) -> None:
    k, v = _caches()
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_splits"):
        paged_attention(
            np.ones((1, 1, 4), dtype=np.float32),
            k,
            v,
            np.array([[0, 1]], dtype=np.int32),
            np.array([3], np.int32),
            num_splits=bad,  # type: ignore[arg-type]
        )


# --- item 5: bounded memory when the caller never drains ---------------------------------------


def test_undrained_queues_stay_bounded() -> None:
    kv = pagedkv.KvCacheManager(num_blocks=64, block_size=4)
    kv.add_sequence(0, [1, 2, 3, 4, 5])
    for _ in range(3_000):  # fork, write into the shared partial block (a copy), free the child
        kv.fork(0, 1)
        kv.append_tokens(1, [7])
        kv.free(1)
    stats = kv.stats()
    assert stats["cow_copies"] == 3_000
    assert stats["copy_ops_elided"] > 0
    ops = kv.take_copy_ops()
    assert len(ops) <= 2 * 64 + 64
    kv.check_invariants()


def test_event_queue_memory_is_reported() -> None:
    # A long prompt cached and reset repeatedly, events never drained. Passing the
    # 64 MiB bound takes ~16M hashed tokens, so the bound itself is tested in Rust
    # (prefix/events.rs); here the gauge is checked to count each ~160 KB event.
    kv = pagedkv.KvCacheManager(
        num_blocks=2048, block_size=16, enable_prefix_caching=True, enable_kv_events=True
    )
    prompt = np.arange(32 * 1024, dtype=np.int64)
    for _ in range(4):
        kv.add_sequence(1, prompt)
        kv.free(1)
        assert kv.reset_prefix_cache()
    stats = kv.stats()
    assert 4 * 32 * 1024 * 4 < stats["event_queue_bytes"] <= 64 << 20
    assert stats["events_dropped"] == 0
    events = kv.take_events()
    assert isinstance(events[-1], pagedkv.AllBlocksCleared)
    assert kv.stats()["event_queue_bytes"] == 0


def test_simulator_workload_columns_refuse_masked_arrays() -> None:
    from pagedkv.sim.engine import SimConfig, Workload, simulate

    masked = np.ma.array([100, 200], mask=[False, True])
    for workload in (
        Workload("w", masked, np.array([10, 20]), np.zeros(2)),
        Workload("w", np.array([100, 200]), np.array([10, 20]), np.ma.array([0.0, 1.0], mask=[True, False])),
    ):
        with pytest.raises(pagedkv.InvalidArgumentError, match="masked"):
            simulate(workload, SimConfig())
